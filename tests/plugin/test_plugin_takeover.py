"""Two instances of one device plugin on a node at once (a DaemonSet's surge starts the new pod
beside the old one; a plugin started by hand beside the DaemonSet's), against the kubelet simulator taught the
kubelet's own rules (k8s.io/kubernetes v1.35.4, pkg/kubelet/cm/devicemanager/plugin/v1beta1/
handler.go): a registration makes the new client the resource's without closing the older
connection, and when any connection of the resource ends, the client registered then is
dropped (``runClient`` disconnects ``getClient(name)``), its devices marked Unhealthy.

So the old instance stopping drops the new one: the new one must register again at once, and
the old one must never take the socket back while the new one serves it.
"""

from __future__ import annotations

import time

from support.waiting import wait_for

from gpunode.services.backoff import Backoff
from sandbox_plugin.resources import HEALTHY, PluginDevice, StaticResource
from sandbox_plugin.served import FileId
from sandbox_plugin.server import PluginServer

NAME = "example.com/widget"
FAST = Backoff(initial=0.05, factor=2.0, cap=0.4)


def widgets() -> StaticResource:
    return StaticResource(NAME, [PluginDevice(i, HEALTHY, 0) for i in ("w0", "w1")], cdi_kind="example.com/widget")


def healthy(state) -> bool:
    return [d.health for d in state.devices.get(NAME, [])] == [HEALTHY, HEALTHY]


def test_the_new_instance_serves_on_when_the_old_one_stops(kubelet, short_root):
    old = PluginServer(widgets(), short_root, backoff=FAST)
    new = PluginServer(widgets(), short_root, backoff=FAST)
    try:
        old.start()
        kubelet.wait_for(healthy)
        new.start()  # takes the socket path: it removes the one it finds, as at any start
        kubelet.wait_for(lambda s: len(s.registrations) == 2)
        socket = kubelet.socket_dir / "example.com-widget.sock"
        taken = FileId.of(socket)
        time.sleep(1.5)  # the old one's checks: it answers what the kubelet holds open, nothing more
        assert (old.registrations, new.registrations) == (1, 1)
        assert FileId.of(socket) == taken and len(kubelet.state.registrations) == 2

        old.stop()  # its connection ends: the kubelet drops the new one's, which registers again
        assert wait_for(lambda: new.registrations == 2, "the new instance registered again", 10, every=0.05)
        state = kubelet.wait_for(lambda s: healthy(s) and NAME in s.connected, timeout=10)
        assert len(state.registrations) == 3
        assert FileId.of(socket) == taken  # the old one removed only what was its own
        time.sleep(1.0)
        assert new.registrations == 2 and healthy(kubelet.state)  # and stays
    finally:
        old.stop()
        new.stop()


def test_a_plugin_the_kubelet_drops_registers_again(kubelet, short_root):
    """Any connection of the resource ending drops the current one, whoever's it was (an in-place
    restart of the plugin's server racing its own registration can do it too): the plugin, its
    socket and the kubelet's unchanged, registers again."""
    plugin = PluginServer(widgets(), short_root, backoff=FAST)
    try:
        plugin.start()
        kubelet.wait_for(healthy)
        kubelet.drop(NAME)
        assert wait_for(lambda: plugin.registrations == 2, "registered again", 10, every=0.05)
        kubelet.wait_for(lambda s: healthy(s) and NAME in s.connected, timeout=10)
    finally:
        plugin.stop()
