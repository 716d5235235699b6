"""The device plugin's /metrics, /healthz and /readyz over HTTP, against the
kubelet simulator: Allocate latency and errors, kubelet registrations."""

from __future__ import annotations

import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpunode.host import vfio
from gpunode.host.pciids import PciIds
from gpunode.policy.inventory import discover
from gpunode.policy.naming import Naming
from gpunode.services.backoff import Backoff
from gpunode.services.metrics_server import MetricsServer, parse_address
from katamgr.pipeline.cdi_specs import write_specs
from katamgr.pipeline.plan import build_plan
from sandbox_plugin.manager import Mode, PluginManager

NAMING = Naming(PciIds.find())
A10 = "nvidia.com/GA102GL_A10"
FAST = Backoff(initial=0.05, factor=2.0, cap=0.4)


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def samples(port: int) -> list:
    status, text = get(port, "/metrics")
    assert status == 200
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def value(found: list, name: str, **labels) -> float:
    hits = [s.value for s in found if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert hits, (name, labels)
    return sum(hits)


def test_allocate_and_registration_metrics_and_readiness(sim_host):
    host, kubelet = sim_host("a10-server")
    assert not vfio.bind(host, build_plan(host, NAMING).decisions).failures
    assert write_specs(host, discover(host), NAMING).ok
    manager = PluginManager(host, Mode.VM_PASSTHROUGH, naming=NAMING, backoff=FAST)
    with MetricsServer("127.0.0.1:0", manager.metrics.registry,
                       healthy=manager.health, ready=manager.readiness) as server:
        assert get(server.port, "/healthz")[0] == 503  # not started
        manager.start()
        try:
            kubelet.wait_for(lambda s: len(s.healthy(A10)) == 4)
            assert manager.wait_registered(10)
            assert get(server.port, "/healthz")[0] == 200
            status, body = get(server.port, "/readyz")
            assert status == 200 and A10 in body
            kubelet.preferred(A10, ["0000:17:00.0", "0000:31:00.0"], size=1)
            kubelet.allocate(A10, ["0000:17:00.0"])
            kubelet.allocate(A10, ["0000:31:00.0", "0000:ca:00.0"])
            with pytest.raises(grpc.RpcError):
                kubelet.allocate(A10, ["0000:99:00.0"])  # no such device
            found = samples(server.port)
            assert value(found, "sandbox_device_plugin_allocate_duration_seconds_count", resource=A10) == 3
            assert value(found, "sandbox_device_plugin_allocate_errors_total", resource=A10,
                         code="INVALID_ARGUMENT") == 1
            assert value(found, "sandbox_device_plugin_kubelet_registrations_total", resource=A10) == 1
            assert value(found, "sandbox_device_plugin_preferred_allocations_total", resource=A10) == 1
            # A kubelet restart: registered again, counted again.
            kubelet.restart()
            kubelet.wait_for(lambda s: len(s.healthy(A10)) == 4)
            assert manager.wait_registered(10)
            found = samples(server.port)
            assert value(found, "sandbox_device_plugin_kubelet_registrations_total", resource=A10) == 2
        finally:
            manager.stop()
        assert get(server.port, "/healthz")[0] == 503
        assert get(server.port, "/readyz")[0] == 503


def test_readyz_waits_for_the_kubelet(short_root):
    from support.hostkit import GPU_A10, dev, make_host

    host = make_host(short_root.root, [dev("0000:01:00.0", GPU_A10, "vfio-pci", 4)])
    with PluginManager(host, Mode.VM_PASSTHROUGH, naming=NAMING, backoff=FAST) as manager:
        status, why = manager.readiness()  # no kubelet socket at all
        assert status is False and "not registered with the kubelet yet" in why
        assert manager.health()[0] is True


@pytest.mark.parametrize("address", ["9400", "host:port", "1.2.3.4:99999"])
def test_a_bad_metrics_address_is_refused(address):
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_address(address)
    assert parse_address(":9400") == ("0.0.0.0", 9400)
    assert parse_address("[::]:9401") == ("::", 9401)
