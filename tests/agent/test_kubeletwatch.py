"""The offer gate hears a kubelet or device plugin restart at once (katamgr.agent.kubeletwatch),
with the agent's loop running and its checks 10 s apart, while Kata pods keep arriving.

What the kubelet does, as the simulator here does it (k8s.io/kubernetes v1.35.4,
pkg/kubelet/cm/devicemanager): a kubelet that stops leaves its sockets and answers no more; a
starting one removes every socket in /var/lib/kubelet/device-plugins (``CleanupPluginDirectory``)
and has no healthy device until each plugin registers again; a plugin whose stream ends has
every device Unhealthy at once (``PluginDisconnected``). A pod bound before the offer label
came off can still be refused (the label cannot call it back); none bound after it is.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.offergatekit import Arrivals, agent_for, close_node, gate_node, offered, start_plugin
from support.passthroughkit import A10

from katamgr.agent import kubeletwatch
from kubeletapi.deviceplugin_paths import DEVICE_PLUGIN_DIR, socket_name_for

REPO = Path(__file__).resolve().parents[2]
CHECK = 10.0  # the agent's check interval: nothing here may wait for it


@pytest.fixture
def node():
    host, kubelet, api, plugins, root = gate_node()
    yield host, kubelet, api, plugins, root
    close_node(kubelet, api, plugins, root)


def running(agent):
    thread = threading.Thread(target=agent.loop, daemon=True)
    thread.start()
    time.sleep(0.3)  # the loop's watches in place
    return thread


def stop(agent, thread) -> None:
    agent.request_stop()
    thread.join(10)


def until(predicate, timeout: float) -> float | None:
    """time.monotonic() when ``predicate()`` first held, or None within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(0.01)
    return None


def started(host, kubelet, api, plugins, *, hears: bool = True):
    start_plugin(host, kubelet, plugins)
    agent = agent_for(host, api, check_interval=CHECK)
    if not hears:
        agent.kubelet_watch = None  # the gate as before: asked at each check only
    assert agent.reconcile("start").ok and offered(api)
    kubelet.admit_pod("tenant", "running", {"main": {A10: 1}})  # a Kata pod running throughout
    return agent, running(agent)


def held(kubelet) -> list:
    return [c.devices for p in kubelet.state.pods if p.name == "running" for c in p.containers]


def test_a_kubelet_restart_takes_the_offers_off_at_once_and_back_once_the_plugin_registers(node):
    host, kubelet, api, plugins, _ = node
    agent, thread = started(host, kubelet, api, plugins)
    before = held(kubelet)
    try:
        with Arrivals(api, kubelet) as arrivals:
            time.sleep(0.5)
            stopped = time.monotonic()
            restart = threading.Thread(target=kubelet.restart, kwargs={"down": 2.0})
            restart.start()
            off = until(lambda: not offered(api), 5.0)
            restart.join(10)
            kubelet.wait_for(lambda s: len(s.healthy(A10)) == 4)  # the plugin registered again
            registered = time.monotonic()
            back = until(lambda: offered(api), 5.0)
            time.sleep(1.0)
        # The kubelet's PodResources connection ended as it stopped: the label off within a
        # fraction of a second (the next check was 10 s away), and on again as soon as the
        # kubelet listed the plugin's devices, not at the next check.
        assert off is not None and off - stopped < 0.75, off and off - stopped
        assert back is not None and back - registered < 0.75, back - registered
        refused = arrivals.rejected + arrivals.broken
        late = [r for r in refused if arrivals.bound[r.split(":")[0]] > off]
        assert late == [], (late, refused)
        assert len(arrivals.admitted) >= 10
        assert held(kubelet) == before  # the running pod keeps its GPU
        assert agent.kubelet_watch.due() is None or until(lambda: agent.kubelet_watch.due() is None, 5.0)
    finally:
        stop(agent, thread)


def test_without_the_watch_pods_bound_after_the_kubelet_stopped_are_refused(node):
    host, kubelet, api, plugins, _ = node
    agent, thread = started(host, kubelet, api, plugins, hears=False)
    try:
        with Arrivals(api, kubelet) as arrivals:
            time.sleep(0.5)
            stopped = time.monotonic()
            kubelet.restart(down=2.0)
            kubelet.wait_for(lambda s: len(s.healthy(A10)) == 4)
            time.sleep(0.5)
        late = [r for r in arrivals.rejected if arrivals.bound[r.split(":")[0]] > stopped + 0.5]
        assert late, arrivals.rejected  # the label stayed on while the kubelet had nothing to give
    finally:
        stop(agent, thread)


def plugin_process(root: str) -> subprocess.Popen:
    """The device plugin in a process of its own, to be killed as a container's is."""
    code = ("import sys, time\n"
            "from nodesim.node import open_node\n"
            "from sandbox_plugin.manager import Mode, PluginManager\n"
            "from support.passthroughkit import FAST, NAMING\n"
            "PluginManager(open_node(sys.argv[1]).host, Mode.VM_PASSTHROUGH, naming=NAMING, backoff=FAST).start()\n"
            "time.sleep(3600)\n")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    return subprocess.Popen([sys.executable, "-c", code, root], env=env)


def test_a_plugin_killed_takes_the_offers_off_at_once_though_its_socket_stays(node):
    host, kubelet, api, plugins, root = node
    process = plugin_process(root)
    try:
        kubelet.wait_for(lambda s: len(s.healthy(A10)) == 4, timeout=30)
        agent = agent_for(host, api, check_interval=CHECK)
        assert agent.reconcile("start").ok and offered(api)
        thread = running(agent)
        try:
            with Arrivals(api, kubelet) as arrivals:
                time.sleep(0.5)
                killed = time.monotonic()
                process.send_signal(signal.SIGKILL)  # its socket stays: no inotify event
                off = until(lambda: not offered(api), 5.0)
                socket = host.path(DEVICE_PLUGIN_DIR) / socket_name_for(A10)
                assert socket.exists()
                time.sleep(1.0)  # the container restarting
                start_plugin(host, kubelet, plugins)  # removes the stale socket, registers
                registered = time.monotonic()
                back = until(lambda: offered(api), 5.0)
                time.sleep(1.0)
            assert off is not None and off - killed < 0.75, off and off - killed
            assert back is not None and back - registered < 0.75, back - registered
            refused = arrivals.rejected + arrivals.broken
            late = [r for r in refused if arrivals.bound[r.split(":")[0]] > off]
            assert late == [], (late, refused)
            assert len(arrivals.admitted) >= 10
        finally:
            stop(agent, thread)
    finally:
        process.kill()
        process.wait(10)


def test_only_the_gate_listens(node):
    host, _, api, _, _ = node
    assert agent_for(host, api, gate=False).kubelet_watch is None
    assert agent_for(host, api).kubelet_watch is not None


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_change_heard_is_followed_every_poll_until_the_gate_stays_open_or_at_most_pending(tmp_path):
    from gpunode.host.root import HostRoot

    clock, state, looks = Clock(), {"open": False}, []
    watch = kubeletwatch.KubeletWatch(HostRoot.at(tmp_path), lambda: [], lambda: state["open"], clock=clock)

    def look():
        looks.append(clock.now)
        if state.get("fail"):
            raise RuntimeError("the scan failed")

    assert watch.follow([kubeletwatch.Heard("kubelet.sock")], look) == [] and looks == [100.0]
    assert watch.due() == 100.0 + kubeletwatch.POLL
    clock.now += 0.1
    watch.follow([], look)
    assert looks == [100.0]  # not yet due
    clock.now += 0.2
    watch.follow([], look)
    assert looks == [100.0, 100.3]
    state["open"] = True  # the plugin registered: open, and settled SETTLE s later
    while watch.due() is not None:
        clock.now = watch.due()
        watch.follow([], look)
    assert 100.3 + kubeletwatch.SETTLE <= looks[-1] <= 100.3 + kubeletwatch.SETTLE + kubeletwatch.POLL
    # A look that fails is tried again at the next poll, never at once, and ends at PENDING.
    state.update(open=False, fail=True)
    watch.follow([kubeletwatch.Heard("plugin.sock")], lambda: None)
    start, looks[:] = clock.now, []
    while watch.due() is not None:
        clock.now = watch.due()
        with pytest.raises(RuntimeError):
            watch.follow([], look)
    assert len(looks) == pytest.approx(kubeletwatch.PENDING / kubeletwatch.POLL, abs=2)
    assert clock.now - start <= kubeletwatch.PENDING + kubeletwatch.POLL
