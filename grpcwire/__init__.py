"""gRPC over HTTP/2 on unix sockets, on python-hyper's h2: the kubelet's plugin APIs
(served by the device plugin and the DRA driver) and its PodResources (asked by the agent).

Two halves, as h2 itself is built. The protocol half does no I/O (no socket, lock, clock
or logger: bytes in, calls and bytes out): ``status`` (what gRPC adds to HTTP/2:
statuses, length-prefixed messages, grpc-status trailers, grpc-timeout), ``limits`` (what
a client may hold), ``frames`` (frame headers checked before h2 reads them),
``protocol`` (a server connection: h2's events as calls) and ``unary`` (a client's
call). The I/O half drives it: ``guards`` (the flood budget and a quiet log, by the
clock), ``connection`` (a socket, its lock and deadlines), ``server`` (the epoll loop) and
``client`` (a blocking call on a unix socket). It imports nothing of the product.
"""
