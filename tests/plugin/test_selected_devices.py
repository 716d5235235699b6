"""The device plugin advertises what the device selection selects: an included stand-in under its
own resource (with its CDI name and Kata's cold-plug), never an excluded device, and its command
line takes the same --include-device/--exclude-device flags as katamgr."""

from __future__ import annotations

import pytest
from support.hostkit import GPU_A10, dev

from gpunode.host import vfio
from gpunode.host.pciids import PciIds
from gpunode.policy import vfiodecide
from gpunode.policy.inventory import discover
from gpunode.policy.naming import Naming
from gpunode.policy.selection import Selection, parse_exclude, parse_include
from gpunode.services.backoff import Backoff
from katamgr.pipeline.reconcile import Steps, reconcile
from nodesim import kata_shim
from nodesim.profile import parse_profile
from sandbox_plugin.cli import main
from sandbox_plugin.commands import mode_from_host
from sandbox_plugin.manager import Mode, PluginManager
from sandbox_plugin.resources import HEALTHY

PCI_IDS = PciIds.find()
FAST = Backoff(initial=0.05, factor=2.0, cap=0.4)
STANDINS = Naming(PCI_IDS, selection=Selection(
    (parse_include("1234:11e8=example.com/edu"), parse_include("1234:1111=example.com/vga")),
    (parse_exclude("0000:00:01.0"),)))


@pytest.fixture
def serve():
    managers: list[PluginManager] = []

    def start(host, naming: Naming) -> PluginManager:
        manager = PluginManager(host, Mode.VM_PASSTHROUGH, naming=naming, backoff=FAST)
        managers.append(manager)
        manager.start()
        return manager

    yield start
    for manager in managers:
        manager.stop()


def test_an_included_stand_in_is_advertised_and_cold_plugged_under_its_resource(sim_host, serve):
    host, kubelet = sim_host("qemu-standins")
    assert reconcile(host, STANDINS, Steps(kata=False), None).ok  # binds and writes the CDI specs
    serve(host, STANDINS)
    state = kubelet.wait_for(lambda s: "example.com/edu" in s.devices and "example.com/vga" in s.devices)
    assert {r.resource_name for r in state.registrations} == {"example.com/edu", "example.com/vga"}
    # The edu sharing its group with the e1000 was not bound, so it is not advertised.
    assert [(d.id, d.health) for d in state.devices["example.com/edu"]] == [("0000:01:00.0", HEALTHY)]
    assert [d.id for d in state.devices["example.com/vga"]] == ["0000:02:00.0"]

    answers = kubelet.admit_pod("default", "edu-vm", {"vm": {"example.com/edu": 1}})
    answer = answers["vm"]["example.com/edu"]
    assert [d.host_path for d in answer.devices] == ["/dev/vfio/vfio", "/dev/vfio/3"]
    assert dict(answer.envs) == {"PCI_RESOURCE_EXAMPLE_COM_EDU": "0000:01:00.0"}
    assert [d.name for d in answer.cdi_devices] == ["example.com/edu=0000:01:00.0"]
    plug = kata_shim.cold_plug(host, kubelet.pod_resources_socket,
                               kata_shim.sandbox_annotations("default", "edu-vm"))
    assert list(plug.cdi_names) == ["example.com/edu=0000:01:00.0"]
    assert list(plug.functions) == ["0000:01:00.0"]


def test_an_excluded_device_is_never_advertised_even_on_vfio_pci(sim_host, serve):
    profile = parse_profile({"name": "two-a10", "iommu": True, "vfio_pci": "loaded", "devices": [
        dev("0000:17:00.0", GPU_A10, "nvidia", 20, minor=0),
        dev("0000:31:00.0", GPU_A10, "nvidia", 21, minor=1),
    ]})
    host, kubelet = sim_host(profile)
    assert not vfio.bind(host, vfiodecide.decide(host, discover(host))).failures  # both on vfio-pci
    serve(host, Naming(PCI_IDS, selection=Selection((), (parse_exclude("0000:17:00.0"),))))
    state = kubelet.wait_for(lambda s: "nvidia.com/GA102GL_A10" in s.devices)
    assert [d.id for d in state.devices["nvidia.com/GA102GL_A10"]] == ["0000:31:00.0"]


def test_auto_mode_sees_included_devices_on_vfio_pci(sim_host):
    host, _kubelet = sim_host("qemu-standins")
    assert mode_from_host(host, STANDINS.selection) == (
        Mode.CONTAINER, "no passthrough device (as --include-device/--exclude-device select) is bound to vfio-pci")
    assert reconcile(host, STANDINS, Steps(kata=False), None).ok
    mode, why = mode_from_host(host, STANDINS.selection)
    assert mode is Mode.VM_PASSTHROUGH and "0000:01:00.0, 0000:02:00.0" in why
    assert mode_from_host(host)[0] is Mode.CONTAINER  # no NVIDIA GPU there


def test_help_names_the_selection_flags(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "--include-device" in text and "--exclude-device" in text and "example.com/edu" in text


@pytest.mark.parametrize(("args", "named"), [
    (["--include-device", "1234:11e8"], "--include-device: '1234:11e8' is not VENDOR:DEVICE=RESOURCE"),
    (["--include-device", "1234:11e8=edu"], "--include-device: 'edu' is not an extended resource name"),
    (["--exclude-device", "1:0.0"], "--exclude-device: '1:0.0' is not a full PCI address"),
    (["--include-device", "1234:11e8=example.com/a", "--include-device", "1234:11E8=example.com/b"],
     "include 1234:11e8 under two resource names"),
])
def test_bad_selection_values_exit_2_naming_them(capsys, short_root, args, named):
    assert main(["--host-root", str(short_root.root), "--workload", "vm-passthrough", *args]) == 2
    assert named in capsys.readouterr().err
