"""The generic device plugin server against the kubelet simulator.

Everything here is real gRPC over real unix sockets in a temp host root; only
the kubelet is a stand-in (nodesim.kubelet).
"""

from __future__ import annotations

import socket
import time

import grpc
import pytest

from gpunode.host.root import HostRoot
from gpunode.services.backoff import Backoff
from kubeletapi import deviceplugin_pb2 as pb
from kubeletapi import deviceplugin_pb2_grpc as pb_grpc
from nodesim.kubelet import KubeletSimulator
from nodesim.kubeletstate import PluginOptions
from sandbox_plugin.resources import (
    HEALTHY,
    UNHEALTHY,
    PluginDevice,
    StaticResource,
)
from sandbox_plugin.served import PluginServerError
from sandbox_plugin.server import PluginServer

NAME = "example.com/widget"
FAST = Backoff(initial=0.05, factor=2.0, cap=0.4)


def widgets(*ids: str, numa: int | None = 0) -> StaticResource:
    return StaticResource(
        NAME, [PluginDevice(i, HEALTHY, numa) for i in ids], cdi_kind="example.com/widget"
    )


@pytest.fixture
def serve(short_root):
    servers: list[PluginServer] = []

    def start(resource: StaticResource) -> PluginServer:
        server = PluginServer(resource, short_root, backoff=FAST)
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def advertised(state, name=NAME):
    return {d.id: d.health for d in state.devices.get(name, [])}


def test_registers_with_version_endpoint_resource_and_options(kubelet, serve):
    serve(widgets("w0", "w1"))
    state = kubelet.wait_for(lambda s: NAME in s.options)
    (registration,) = state.registrations
    assert registration.version == "v1beta1"
    assert registration.endpoint == "example.com-widget.sock"
    assert registration.resource_name == NAME
    assert registration.options == PluginOptions(get_preferred_allocation_available=True)
    assert state.options[NAME] == PluginOptions(get_preferred_allocation_available=True)
    assert (kubelet.socket_dir / "example.com-widget.sock").is_socket()


def test_list_and_watch_sends_devices_then_health_changes(kubelet, serve):
    resource = widgets("w0", "w1")
    serve(resource)
    state = kubelet.wait_for(lambda s: advertised(s) == {"w0": HEALTHY, "w1": HEALTHY})
    assert [d.numa_node for d in state.devices[NAME]] == [0, 0]

    resource.set_health("w1", UNHEALTHY)
    kubelet.wait_for(lambda s: advertised(s) == {"w0": HEALTHY, "w1": UNHEALTHY}, timeout=2)

    resource.set_devices([PluginDevice("w0"), PluginDevice("w2", numa_node=None)])
    state = kubelet.wait_for(lambda s: advertised(s) == {"w0": HEALTHY, "w2": HEALTHY}, timeout=2)
    assert [d.numa_node for d in state.devices[NAME]] == [None, None]


def test_unchanged_device_list_is_not_resent(kubelet, serve):
    resource = widgets("w0")
    serve(resource)
    kubelet.wait_for(lambda s: s.updates.get(NAME) == 1)
    resource.set_health("w0", HEALTHY)  # a notification without a change
    resource.set_health("w0", UNHEALTHY)
    state = kubelet.wait_for(lambda s: advertised(s) == {"w0": UNHEALTHY}, timeout=2)
    assert state.updates[NAME] == 2


def test_allocate_returns_what_the_resource_hands_out(kubelet, serve):
    serve(widgets("w0", "w1", "w2"))
    kubelet.wait_for(lambda s: NAME in s.devices)
    answer = kubelet.allocate(NAME, ["w0", "w2"])
    assert dict(answer.envs) == {"STATIC_DEVICES": "w0,w2"}
    assert [(d.container_path, d.host_path, d.permissions) for d in answer.devices] == [
        ("/dev/static/w0", "/dev/static/w0", "rw"),
        ("/dev/static/w2", "/dev/static/w2", "rw"),
    ]
    assert [c.name for c in answer.cdi_devices] == [
        "example.com/widget=w0",
        "example.com/widget=w2",
    ]

    both = kubelet.allocate_containers(NAME, [["w0"], ["w1"]])
    assert [dict(c.envs) for c in both.container_responses] == [
        {"STATIC_DEVICES": "w0"},
        {"STATIC_DEVICES": "w1"},
    ]


def test_allocate_of_unknown_or_unhealthy_device_fails_naming_it(kubelet, serve):
    resource = widgets("w0", "w1")
    serve(resource)
    kubelet.wait_for(lambda s: NAME in s.devices)

    with pytest.raises(grpc.RpcError) as unknown:
        kubelet.allocate(NAME, ["w0", "nope-7"])
    assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'nope-7'" in unknown.value.details()

    resource.set_health("w1", UNHEALTHY)
    with pytest.raises(grpc.RpcError) as sick:
        kubelet.allocate(NAME, ["w1"])
    assert sick.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "'w1'" in sick.value.details()


@pytest.mark.parametrize("containers, fragment", [
    ([], "names no container"),
    ([[]], "container request 0 names no device"),
    ([["w0"], []], "container request 1 names no device"),
    ([["w0", "w1", "w0"]], "names w0 more than once"),
])
def test_allocate_refuses_empty_requests_and_repeated_ids(kubelet, serve, containers, fragment):
    serve(widgets("w0", "w1"))
    kubelet.wait_for(lambda s: NAME in s.devices)
    with pytest.raises(grpc.RpcError) as refused:
        kubelet.allocate_containers(NAME, containers)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in refused.value.details() and NAME in refused.value.details()


def test_preferred_allocation_keeps_required_devices_and_numa_node(kubelet, serve):
    resource = StaticResource(
        NAME,
        [
            PluginDevice("a0", numa_node=0),
            PluginDevice("b0", numa_node=1),
            PluginDevice("a1", numa_node=0),
            PluginDevice("b1", numa_node=1),
        ],
    )
    serve(resource)
    kubelet.wait_for(lambda s: NAME in s.devices)
    assert kubelet.preferred(NAME, ["a0", "b0", "a1", "b1"], ["b1"], 2) == ["b1", "b0"]
    assert kubelet.preferred(NAME, ["a0", "b0", "a1"], [], 2) == ["a0", "a1"]
    kubelet.pre_start(NAME, ["a0"])  # a no-op that must not fail


def test_registers_again_after_each_of_ten_kubelet_restarts(kubelet, serve):
    server = serve(widgets("w0"))
    kubelet.wait_for(lambda s: len(s.registrations) == 1 and NAME in s.devices)
    for round_ in range(1, 11):
        kubelet.restart()
        started = time.monotonic()
        state = kubelet.wait_for(
            lambda s, n=round_ + 1: len(s.registrations) >= n and NAME in s.devices, timeout=2
        )
        assert time.monotonic() - started < 2
        assert advertised(state) == {"w0": HEALTHY}
    # Settled: no registration churn while nothing changes.
    settled = len(kubelet.state.registrations)
    time.sleep(0.3)
    assert len(kubelet.state.registrations) == settled == server.registrations
    assert kubelet.allocate(NAME, ["w0"]).envs["STATIC_DEVICES"] == "w0"


def test_registers_again_when_only_kubelet_sock_is_replaced(kubelet, serve):
    serve(widgets("w0"))
    kubelet.wait_for(lambda s: len(s.registrations) == 1)
    kubelet.stop()  # removes kubelet.sock only; our socket stays
    assert (kubelet.socket_dir / "example.com-widget.sock").is_socket()
    kubelet.start()
    kubelet.wait_for(lambda s: len(s.registrations) == 2 and NAME in s.connected, timeout=2)


def test_retries_registration_until_the_kubelet_appears(short_root):
    server = PluginServer(widgets("w0"), short_root, backoff=FAST)
    server.start()
    try:
        time.sleep(0.3)  # several failed attempts with no kubelet.sock
        assert not server.registered
        sim = KubeletSimulator(short_root)
        with sim:
            sim.wait_for(lambda s: advertised(s) == {"w0": HEALTHY}, timeout=2)
            assert server.wait_registered(1)
    finally:
        server.stop()


def test_retries_while_kubelet_sock_refuses_connections(short_root):
    plugin_dir = short_root.path("/var/lib/kubelet/device-plugins")
    plugin_dir.mkdir(parents=True)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(plugin_dir / "kubelet.sock"))  # a socket file nobody listens on
    stale.close()
    server = PluginServer(widgets("w0"), short_root, backoff=FAST)
    server.start()
    try:
        time.sleep(0.3)
        assert not server.registered
        with KubeletSimulator(short_root) as sim:
            sim.wait_for(lambda s: advertised(s) == {"w0": HEALTHY}, timeout=2)
    finally:
        server.stop()


def test_stop_removes_our_socket_and_ends_the_stream(kubelet, short_root):
    server = PluginServer(widgets("w0"), short_root, backoff=FAST)
    server.start()
    kubelet.wait_for(lambda s: NAME in s.connected)
    assert server.socket_path.is_socket()
    server.stop()
    assert not server.socket_path.exists()
    kubelet.wait_for(lambda s: NAME not in s.connected, timeout=2)


def test_device_id_over_63_characters_is_not_advertised(kubelet, serve):
    long_id = "g" * 64
    serve(widgets("w0", long_id, "x" * 63))
    state = kubelet.wait_for(lambda s: NAME in s.devices)
    assert advertised(state) == {"w0": HEALTHY, "x" * 63: HEALTHY}


def test_two_resources_served_from_one_process(kubelet, serve):
    serve(widgets("w0"))
    serve(StaticResource("example.com/gadget", [PluginDevice("g0"), PluginDevice("g1")]))
    state = kubelet.wait_for(lambda s: {NAME, "example.com/gadget"} <= s.devices.keys())
    assert advertised(state, "example.com/gadget") == {"g0": HEALTHY, "g1": HEALTHY}
    assert kubelet.allocate("example.com/gadget", ["g1"]).envs["STATIC_DEVICES"] == "g1"
    assert kubelet.allocate(NAME, ["w0"]).envs["STATIC_DEVICES"] == "w0"


def test_simulated_kubelet_refuses_other_api_versions(kubelet):
    with grpc.insecure_channel(f"unix://{kubelet.kubelet_socket}") as channel:
        stub = pb_grpc.RegistrationStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Register(
                pb.RegisterRequest(version="v1alpha", endpoint="x.sock", resource_name=NAME),
                timeout=5,
            )
    assert "v1alpha" in refused.value.details()
    assert kubelet.state.registrations == []
    assert kubelet.state.rejections[0][0] == "v1alpha"


def test_socket_path_too_long_for_a_unix_socket_is_refused(tmp_path):
    deep = HostRoot.at(tmp_path / ("d" * 80))
    with pytest.raises(PluginServerError, match="107 bytes"):
        PluginServer(widgets("w0"), deep)


@pytest.mark.parametrize(
    ("resource_name", "socket_name"),
    [("widget", None), ("example.com/" + "w" * 64, None), (NAME, "kubelet.sock"), (NAME, "a/b")],
)
def test_resource_refuses_names_the_kubelet_would_reject(resource_name, socket_name):
    with pytest.raises(ValueError, match="name"):
        StaticResource(resource_name, [], socket_name=socket_name)


def test_device_health_must_be_a_kubelet_value():
    with pytest.raises(ValueError, match="'healthy'"):
        PluginDevice("w0", "healthy")
