"""``HeldConnection``: a client connection making no call hears its server go at once (the
offer gate's ear on the kubelet and the device plugin, katamgr.agent.kubeletwatch), and a
server takes it for an idle client meanwhile: grpcwire's and gRPC core's (grpcio, which the
kubelet simulator serves PodResources with) answer calls on other connections, and close
this one only when they stop."""

from __future__ import annotations

import select
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from grpcwire.client import HeldConnection, unary_call
from grpcwire.limits import Limits
from grpcwire.server import GrpcServer


def heard_end(held: HeldConnection, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([held], [], [], deadline - time.monotonic())[0] and not held.feed():
            return True
    return False


@pytest.fixture
def path():
    with tempfile.TemporaryDirectory(prefix="held-") as d:
        yield Path(d) / "s.sock"


def test_a_grpcwire_server_keeps_it_and_it_hears_the_server_stop(path):
    server = GrpcServer(str(path), {"/t.T/Echo": lambda b: b}, {}, name="t")
    server.start()
    held = HeldConnection(str(path))
    try:
        assert not heard_end(held, 0.5)  # the server's SETTINGS answered, the connection kept
        assert unary_call(str(path), "/t.T/Echo", b"x", 2) == b"x"
        server.stop()
        assert heard_end(held, 2)
    finally:
        held.close()
        server.stop()


def test_it_hears_a_server_closing_it_idle(path):
    server = GrpcServer(str(path), {}, {}, name="t", limits=Limits(idle_timeout=0.5))
    server.start()
    held = HeldConnection(str(path))
    try:
        assert heard_end(held, 5)  # GOAWAY: the agent connects again and looks
    finally:
        held.close()
        server.stop()


def test_a_grpc_core_server_keeps_it_and_it_hears_the_server_stop(path):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    server.add_insecure_port(f"unix://{path}")
    server.start()
    held = HeldConnection(str(path))
    try:
        assert not heard_end(held, 0.5)
        server.stop(grace=0).wait(5)
        assert heard_end(held, 2)
    finally:
        held.close()


def test_nobody_serving_is_an_oserror_at_once(path):
    with pytest.raises(OSError):
        HeldConnection(str(path))
