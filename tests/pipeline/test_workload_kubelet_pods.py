"""Leaving vm-passthrough asks the kubelet (its PodResources service) which pods hold GPUs
and which it still offers: a GPU given to a pod whose VM has not opened it yet stays, as does
one the kubelet still offers to new pods, and a kubelet that does not answer is a bounded
wait, reported."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from support.hostkit import GPU_A10, dev, driver_of, hold, make_host
from support.switchkit import (
    A10,
    FREE,
    HELD,
    NAMING,
    cdi_text,
    followed_node,
    relabel,
    run_loop,
    stop_loop,
    switch_lines,
)
from support.waiting import wait_for

from gpunode.policy.workload import Workload
from gpunode.services.podresources import POD_RESOURCES_SOCKET, list_pod_devices
from katamgr.pipeline.reconcile import Steps, reconcile
from nodesim.podresources import (
    ContainerRecord,
    PodRecord,
    PodResourcesServer,
    Snapshot,
)


def short_host(devices):
    """A simulated node in a short temp dir: the kubelet's PodResources socket lives in it,
    and a unix socket path must fit in 107 bytes."""
    import tempfile

    return make_host(Path(tempfile.mkdtemp(prefix="ws-")), devices)


def pod_resources(host, pods):
    """The kubelet's PodResources v1 service on the node's socket, answering ``pods()``
    (nodesim.podresources, as the kubelet simulator serves it)."""
    server = PodResourcesServer(host.path(POD_RESOURCES_SOCKET), lambda: Snapshot(pods(), {}))
    server.start()
    return server


def test_a_gpu_given_to_a_pod_whose_vm_is_starting_stays_and_the_free_one_goes(caplog, monkeypatch):
    from katamgr.agent import giveback

    caplog.set_level("INFO", logger="katamgr.agent")
    host = short_host([dev(HELD, GPU_A10, "nvidia", 4), dev(FREE, GPU_A10, "nvidia", 5)])
    leaves = []
    real_leave = giveback.leave_passthrough

    def counted_leave(*args, **kwargs):
        leaves.append(kwargs.get("command"))
        return real_leave(*args, **kwargs)

    monkeypatch.setattr(giveback, "leave_passthrough", counted_leave)
    pods = [PodRecord("default", "vm-a", [ContainerRecord("cuda", {A10: [HELD.lower()]})])]
    server = pod_resources(host, lambda: list(pods))
    try:
        with followed_node(host, Steps(kata=False), events=True) as (api, agent, watch):
            assert agent.reconcile("start").ok
            thread = run_loop(agent)
            try:
                # The kubelet gave HELD to pod vm-a; its VM is still booting (no open node).
                # HELD stays for it; FREE, which nobody has, goes back at once.
                relabel(api, "container")
                assert wait_for(lambda: agent.target.steps.workload is Workload.CONTAINER)
                assert driver_of(host, HELD) == "vfio-pci" and driver_of(host, FREE) == "nvidia"
                assert agent.give_backs.held == {HELD}
                [line] = switch_lines(caplog)
                assert f"gave {FREE} back to their drivers" in line
                assert f"{HELD} (pod default/vm-a (container cuda, {A10}))" in line
                assert f"{HELD} not opened by its VM yet" in line
                assert len(leaves) == 1  # the switch's
                time.sleep(0.3)  # looked at every check (the kubelet asked), said once
                assert sum(r.getMessage().startswith("kept on vfio-pci:") for r in caplog.records) == 1
                assert "/dev/vfio/4" in cdi_text(host) and "/dev/vfio/5" not in cdi_text(host)
                # The VM is up and holds its GPU: it stays.
                vm = hold(host, 4)
                time.sleep(0.2)
                assert agent.give_backs.held == {HELD} and driver_of(host, HELD) == "vfio-pci"
                # The VM restarts (lets go for a moment) while its pod is still there: still the pod's.
                vm.unlink()
                time.sleep(0.2)
                vm = hold(host, 4, pid=7778)
                assert agent.give_backs.held == {HELD} and driver_of(host, HELD) == "vfio-pci"
                # Nothing let go all this while: no leave after the switch's (no node lock,
                # PCI scan or CDI check every check).
                assert len(leaves) == 1
                # Pod and VM gone: the last GPU goes back too, with no relabel.
                pods.clear()
                vm.unlink()
                assert wait_for(lambda: agent.give_backs.held == set())
                assert driver_of(host, HELD) == "nvidia"
                assert len(leaves) == 2
            finally:
                stop_loop(agent, thread, watch)
    finally:
        server.stop()


def test_a_pod_admitted_while_the_plugin_still_serves_keeps_its_gpu():
    """The leave asks the kubelet which pods hold GPUs only once it no longer offers them
    (PodResources GetAllocatableResources lists healthy devices only; a plugin that stood
    down has none: kubelet manager.go PluginDisconnected): a pod the kubelet admits in the
    moment between the relabel and the plugin standing down is in the answer and keeps
    its GPU, never given one that is leaving."""
    from katamgr.pipeline.reconcile import leave_passthrough
    from nodesim.podresources import ListedDevice

    host = short_host([dev(HELD, GPU_A10, "nvidia", 4), dev(FREE, GPU_A10, "nvidia", 5)])
    assert reconcile(host, NAMING, Steps(kata=False), None).ok
    pods: list[PodRecord] = []
    offered = {A10: [ListedDevice(HELD), ListedDevice(FREE)]}
    server = PodResourcesServer(host.path(POD_RESOURCES_SOCKET), lambda: Snapshot(list(pods), offered))
    server.start()
    try:
        left = []
        leave = threading.Thread(target=lambda: left.append(leave_passthrough(
            host, NAMING, Steps(kata=False, workload=Workload.CONTAINER), offer_wait=10)))
        started = time.monotonic()
        leave.start()
        time.sleep(0.3)
        assert not left and driver_of(host, FREE) == "vfio-pci"  # waiting: the plugin still serves
        # The kubelet admits a Kata pod onto HELD, then the plugin stands down.
        pods.append(PodRecord("default", "late", [ContainerRecord("main", {A10: [HELD.lower()]})]))
        offered[A10] = [ListedDevice(HELD, "Unhealthy"), ListedDevice(FREE, "Unhealthy")]
        leave.join(timeout=10)
        [report] = left
        assert time.monotonic() - started < 2
        assert driver_of(host, HELD) == "vfio-pci" and driver_of(host, FREE) == "nvidia"
        assert list(report.waiting) == [HELD] and "default/late" in report.waiting[HELD][0]
    finally:
        server.stop()


def test_a_gpu_the_kubelet_still_offers_stays_until_it_does_not():
    """A plugin that never stands down (or a label flipped back meanwhile): after the bounded
    wait the GPU the kubelet still offers to new pods stays on vfio-pci, reported, and goes
    back at a later look once it is not offered."""
    from katamgr.pipeline.reconcile import leave_passthrough
    from nodesim.podresources import ListedDevice

    host = short_host([dev(FREE, GPU_A10, "nvidia", 5)])
    assert reconcile(host, NAMING, Steps(kata=False), None).ok
    offered = {A10: [ListedDevice(FREE)]}
    server = PodResourcesServer(host.path(POD_RESOURCES_SOCKET), lambda: Snapshot([], offered))
    server.start()
    try:
        started = time.monotonic()
        container = Steps(kata=False, workload=Workload.CONTAINER)
        report = leave_passthrough(host, NAMING, container, offer_wait=0.5)
        assert 0.5 <= time.monotonic() - started < 3
        assert driver_of(host, FREE) == "vfio-pci" and list(report.held) == [FREE]
        assert any(f"{FREE} stay on vfio-pci: the kubelet still offers them" in w for w in report.warnings)
        # Waiting stops as soon as the node wants its GPUs bound again.
        started = time.monotonic()
        report = leave_passthrough(host, NAMING, container, offer_wait=10, cancelled=lambda: True)
        assert time.monotonic() - started < 2 and driver_of(host, FREE) == "vfio-pci"
        offered[A10] = []  # the plugin stood down at last
        report = leave_passthrough(host, NAMING, container, offer_wait=10)
        assert driver_of(host, FREE) == "nvidia" and report.restored == [FREE]
    finally:
        server.stop()


def test_a_kubelet_that_does_not_answer_is_a_bounded_wait_and_is_reported(tmp_path):
    import socket as sockets

    host = short_host([dev(FREE, GPU_A10, "nvidia", 5)])
    path = host.path(POD_RESOURCES_SOCKET)
    path.parent.mkdir(parents=True)
    # A kubelet that accepts the connection and never answers.
    hung = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
    hung.bind(str(path))
    hung.listen(1)
    try:
        started = time.monotonic()
        asked = list_pod_devices(host, timeout=0.5)
        assert time.monotonic() - started < 3
        assert asked.assignments == () and "failed" in asked.unknown and POD_RESOURCES_SOCKET in asked.unknown
    finally:
        hung.close()
    # A socket file nobody serves (a kubelet that went away): refused at once.
    started = time.monotonic()
    asked = list_pod_devices(host, timeout=5)
    assert time.monotonic() - started < 3 and "UNAVAILABLE" in asked.unknown
    path.unlink()
    assert "does not exist" in list_pod_devices(host).unknown


def test_the_kubelet_is_asked_below_its_own_root_dir():
    """A kubelet with another --root-dir (k0s: /var/lib/k0s/kubelet) serves PodResources
    below it (kubelet_getters.go getPodResourcesDir: <root-dir>/pod-resources); katamgr and the
    plugins ask there once told (--kubelet-dir, the chart's hostPaths.kubeletRootDir)."""
    import dataclasses

    host = dataclasses.replace(short_host([dev(HELD, GPU_A10, "vfio-pci", 4)]),
                               kubelet_dir="/var/lib/k0s/kubelet")
    pods = [PodRecord("default", "vm-a", [ContainerRecord("cuda", {A10: [HELD.lower()]})])]
    server = PodResourcesServer(host.path("/var/lib/k0s/kubelet/pod-resources/kubelet.sock"),
                                lambda: Snapshot(pods, {}))
    server.start()
    try:
        asked = list_pod_devices(host)
        assert asked.unknown is None and [a.pod for a in asked.assignments] == ["vm-a"]
        default = list_pod_devices(dataclasses.replace(host, kubelet_dir="/var/lib/kubelet"))
        assert default.unknown == ("the kubelet's PodResources socket "
                                   "/var/lib/kubelet/pod-resources/kubelet.sock does not exist")
    finally:
        server.stop()
