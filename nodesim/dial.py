"""How the simulated kubelet and shim dial a unix socket with grpcio.

The kubelet and Kata's shim are Go programs; grpc-go keeps no process-wide pool of
connections, so every dial after a plugin served its socket again reaches the new
listener. grpcio shares subchannels between channels to the same address by default,
and a new channel then inherits a subchannel still backing off from the refused
connections of the socket that went away ("failed to connect to all addresses ...
Connection refused" although the socket is served). A local pool per channel keeps
the stand-ins dialling as the Go programs do.
"""

from __future__ import annotations

import grpc


def dial(socket) -> grpc.Channel:
    return grpc.insecure_channel(f"unix://{socket}", options=[("grpc.use_local_subchannel_pool", 1)])
