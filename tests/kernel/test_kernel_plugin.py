"""The device plugin on a real kernel: ``sandbox-device-plugin --mode vm-passthrough
--include-device ...`` in the guest with the kubelet simulator
(nodesim/kubelet.py) in the guest's driver script.

Sources: Kubernetes device plugin API v1beta1 (Register, ListAndWatch with per-device
Health, Allocate's DeviceSpec host/container paths); kernel
Documentation/driver-api/vfio.rst (a VM needs ``/dev/vfio/vfio`` and
``/dev/vfio/$GROUP``).
"""

from __future__ import annotations

import pytest
from kernelkit import group_of, show

pytestmark = pytest.mark.integration

RESOURCES = {"edu": "example.com/edu", "vga": "example.com/vga"}
# The bound on noticing a device unbound behind the plugin's back.
UNHEALTHY_WITHIN_S = 1.0


def _plugin(guest) -> dict:
    plugin = guest.step("plugin")
    if "error" in plugin:
        pytest.fail(f"the plugin step broke:\n{plugin['error']}\nplugin log:\n{plugin.get('log', '')[-3000:]}",
                    pytrace=False)
    return plugin



def test_the_plugin_registers_each_resource(guest):
    plugin = _plugin(guest)
    assert sorted(set(plugin["registrations"])) == sorted(RESOURCES.values()), plugin["registrations"]
    stand_ins = guest.step("facts")["stand_ins"]
    for name, resource in RESOURCES.items():
        assert plugin["devices"][resource] == [{"id": stand_ins[name], "health": "Healthy"}], (
            f"{resource}: {plugin['devices'][resource]}")


@pytest.mark.parametrize("name", ["edu", "vga"])
def test_allocate_answers_with_the_real_device_nodes(guest, name):
    plugin, stand_ins = _plugin(guest), guest.step("facts")["stand_ins"]
    answer = plugin["allocate"][RESOURCES[name]]
    group_node = f"/dev/vfio/{group_of(guest, stand_ins[name])}"
    paths = [(d["host_path"], d["container_path"]) for d in answer["devices"]]
    assert paths == [("/dev/vfio/vfio", "/dev/vfio/vfio"), (group_node, group_node)], answer
    nodes = guest.step("apply_again")["after"]["vfio_nodes"]
    assert all(host in nodes for host, _ in paths), f"Allocate named nodes the kernel did not make: {nodes}"


def test_an_unbind_behind_its_back_marks_the_device_unhealthy_within_1s(guest):
    plugin = _plugin(guest)
    assert plugin["unbind"]["error"] is None, show(plugin["unbind"])
    assert plugin["unhealthy_after_s"] is not None and plugin["unhealthy_after_s"] <= UNHEALTHY_WITHIN_S, (
        f"after the unbind the kubelet saw {plugin['devices_after_unbind']} (first change after "
        f"{plugin['not_healthy_after_s']} s, Unhealthy after {plugin['unhealthy_after_s']} s; "
        f"expected the device listed Unhealthy within {UNHEALTHY_WITHIN_S} s)\n"
        f"plugin log:\n{plugin['log'][-3000:]}")


def test_a_device_bound_again_is_healthy_again(guest):
    plugin = _plugin(guest)
    assert plugin["vga_driver_after_reprobe"] == "vfio-pci", show(plugin["reprobe"])
    assert plugin["healthy_again_after_s"] is not None, f"plugin log:\n{plugin['log'][-3000:]}"
