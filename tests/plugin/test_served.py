"""A served socket whose gRPC loop dies: served again, and unhealthy when it keeps dying.

The issue this answers: under a memory cap a MemoryError ended the serving thread, the
socket stayed, connections were refused and /healthz kept saying ok. Now a failure
while handling one connection closes that connection only; a failure of the loop
itself ends the server, which tells its owner at once; the owner serves again (the
device plugin then registers again, so the kubelet dials the new socket), and after
three deaths within ten minutes reports itself unhealthy, which turns the plugin's
/healthz to failing so that the kubelet's liveness probe restarts the container.

The loop is made to die by its epoll wait raising MemoryError, as it would when
memory runs out at that point.
"""

from __future__ import annotations

import os
import select
import tempfile
import threading

import grpc
import pytest

from gpunode.host.pciids import PciIds
from gpunode.policy.naming import Naming
from gpunode.services.backoff import Backoff
from katamgr.pipeline.devices import apply_host
from katamgr.pipeline.plan import build_plan
from kubeletapi import deviceplugin_pb2 as pb
from nodesim.dial import dial
from sandbox_plugin.manager import Mode, PluginManager
from sandbox_plugin.served import DEATHS_TOLERATED, ServedSocket

ECHO = "/test.Echo/Echo"
NAMING = Naming(PciIds.find())
A10 = "nvidia.com/GA102GL_A10"
_real_epoll = select.epoll


class DyingEpoll:
    """select.epoll whose next wait raises MemoryError once ``die()`` was called."""

    made: list[DyingEpoll] = []

    def __init__(self, *args) -> None:
        self._epoll = _real_epoll(*args)
        self._dying = False
        DyingEpoll.made.append(self)

    def die(self) -> None:
        self._dying = True

    def poll(self, timeout=-1, maxevents=-1):
        if self._dying:
            raise MemoryError("no memory left for the gRPC loop (simulated)")
        return self._epoll.poll(timeout, maxevents)

    def __getattr__(self, name):
        return getattr(self._epoll, name)


@pytest.fixture
def dying_epoll(monkeypatch):
    DyingEpoll.made.clear()
    monkeypatch.setattr(select, "epoll", DyingEpoll)
    return DyingEpoll.made


def call(path, request: bytes = b"ping", method: str = ECHO) -> bytes:
    with dial(path) as channel:
        return channel.unary_unary(method)(request, timeout=10)


def kill_loop(epoll: DyingEpoll, path) -> None:
    epoll.die()
    try:  # a call wakes the loop, which dies at its next wait
        call(path)
    except grpc.RpcError:
        pass


def test_a_socket_whose_loop_died_is_served_again_and_unhealthy_when_it_keeps_dying(dying_epoll):
    path = os.path.join(tempfile.mkdtemp(prefix="kd-"), "s.sock")
    died = threading.Event()
    served = ServedSocket(path, {ECHO: lambda request: request}, name="test", on_failure=died.set)
    try:
        assert served.serve()
        assert call(path) == b"ping"
        for death in range(1, DEATHS_TOLERATED + 1):
            kill_loop(dying_epoll[-1], path)
            assert died.wait(10), "the owner was not told"
            died.clear()
            assert not served.intact
            assert served.serve()  # the owner serves again
            assert call(path) == b"ping"
            assert served.healthy is (death < DEATHS_TOLERATED)
    finally:
        served.stop()


def test_the_device_plugin_serves_again_and_healthz_fails_when_its_loop_keeps_dying(
        sim_host, dying_epoll, caplog):
    host, kubelet = sim_host("a10-server")
    assert apply_host(host, build_plan(host, NAMING)).ok
    manager = PluginManager(host, Mode.VM_PASSTHROUGH, naming=NAMING,
                            backoff=Backoff(initial=0.05, cap=0.2))
    manager.start()
    try:
        kubelet.wait_for(lambda state: len(state.devices.get(A10, [])) == 4, timeout=20)
        socket = manager.servers[A10].socket_path
        device = kubelet.state.devices[A10][0].id
        request = pb.AllocateRequest(container_requests=[
            pb.ContainerAllocateRequest(devices_ids=[device])]).SerializeToString()
        for death in range(1, DEATHS_TOLERATED + 1):
            before = len(kubelet.state.registrations_for(A10))
            loops = len(dying_epoll)
            kill_loop(dying_epoll[-1], socket)
            # Served again at once (not at the next recheck) and registered again.
            kubelet.wait_for(lambda state, n=before: len(state.registrations_for(A10)) > n,
                             timeout=10)
            assert len(dying_epoll) > loops
            assert call(socket, request, "/v1beta1.DevicePlugin/Allocate")
            healthy, why = manager.health()
            assert healthy is (death < DEATHS_TOLERATED), why
        assert "gRPC loop" in why and A10 in why
        assert "MemoryError" in caplog.text
    finally:
        manager.stop()
