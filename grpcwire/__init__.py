"""gRPC over HTTP/2 on unix sockets for the kubelet's plugin APIs, on python-hyper's h2.

h2 (with hpack and hyperframe) owns the protocol; this package keeps the rest thin:
``status`` (what gRPC adds: statuses, messages, deadlines), ``limits`` (what a client
may hold), ``connection`` (h2's events as calls), ``server`` (the epoll loop) and
``client`` (one unary call). It imports nothing of the product.
"""
