"""The stand-in (nodesim.kata_shim) against Kata's own code, on the same inputs.

Where the stand-in still answers (the fast tests, ``katamgr demo``, DRA claims), it must say
what Kata 3.25.0, 3.29.0 and 4.1.0 say: the CDI names, the device nodes in the spec's order, the
functions QEMU gets with their ``-device`` arguments and root ports, or the failure, word for
word.
"""

from __future__ import annotations

import pytest
from support import kataoracle
from support.paths import HOST_PROFILES
from test_kata_decides import (
    NAMING,
    NVSWITCHES,
    STANDINS,
    companion_first,
    iommufd_workstation,
    shared_group,
)

from nodesim import kata_shim
from nodesim.podresources import ClaimDevice, ClaimRecord, ContainerRecord, PodRecord
from nodesim.profiles import find_profile

CASES = {
    **{p.stem: (p.stem, NAMING) for p in HOST_PROFILES},
    "qemu-standins-included": ("qemu-standins", STANDINS),
    "dgx-h100-nvswitches": ("dgx-h100", NVSWITCHES),
    "companion-first": (companion_first(), NAMING),
    "shared-group": (shared_group(), NAMING),
    "iommufd-workstation": (iommufd_workstation(), NAMING),
}


def stand_in(node, pod: str, release: str) -> kata_shim.ColdPlug | str:
    try:
        return kata_shim.cold_plug(node.host, node.kubelet.pod_resources_socket,
                                   kata_shim.sandbox_annotations("default", pod), release=release)
    except kata_shim.ColdPlugError as exc:
        return str(exc)


def without_ids(args):
    # iommufd objects carry the device manager's random ID, and so does Kata 4.1's id= of
    # each vfio-pci device (kataoracle.Outcome.plain_vfio_args).
    return [kataoracle.VFIO_ID.sub("", a.split(",iommufd=")[0])
            for a in args if a != "-device" and not a.startswith("iommufd,")]


def assert_same(kata: kataoracle.Outcome, ours: kata_shim.ColdPlug | str) -> None:
    if isinstance(ours, str):
        assert kata.error == ours, f"Kata {kata.kata}: {kata.error!r}; stand-in: {ours!r}"
        return
    assert kata.ok, f"Kata {kata.kata} fails ({kata.error}); the stand-in plugs {ours.functions}"
    assert list(kata.cdi_devices) == list(ours.cdi_names)
    assert list(kata.device_nodes) == list(ours.device_nodes)
    assert list(kata.plugged) == list(ours.functions)
    assert without_ids(kata.vfio_args) == without_ids(ours.qemu_args)
    assert [",id=vfio-" in a for a in kata.vfio_args] == [",id=vfio-" in a for a in ours.qemu_args if a != "-device"]
    assert kata.root_ports == ours.root_ports


@pytest.mark.parametrize("release", kataoracle.judges())
@pytest.mark.parametrize("case", list(CASES))
def test_every_resource_of_every_profile(kata_node, release, case):
    node = kata_node(find_profile(CASES[case][0]) if isinstance(CASES[case][0], str) else CASES[case][0],
                     CASES[case][1])
    asks = [{resource: len(ids)} for resource, ids in node.units.items()]
    asks += [{resource: 1} for resource in node.units]
    if len(node.units) > 1:
        asks.append({r: len(ids) for r, ids in node.units.items()})
    asks.append({})
    for ask in asks:
        pod = node.admit(ask)
        assert_same(node.kata(release, pod), stand_in(node, pod, release))
        node.kubelet.remove_pod("default", pod)


@pytest.mark.parametrize("release", kataoracle.judges())
def test_failures_and_repeats(kata_node, release):
    node = kata_node("a10-server")
    assert_same(node.kata(release, "ghost"), stand_in(node, "ghost", release))
    first, second = node.units["nvidia.com/GA102GL_A10"][:2]
    node.kubelet.record_pod(PodRecord("default", "twice", [
        ContainerRecord("a", {"nvidia.com/GA102GL_A10": [first, second]}),
        ContainerRecord("b", {"nvidia.com/GA102GL_A10": [first]}),
    ]))
    assert_same(node.kata(release, "twice"), stand_in(node, "twice", release))
    # CRI-O names the pod by its own annotations, which Kata reads from 3.29 on.
    node.admit({"nvidia.com/GA102GL_A10": 1}, name="crio")
    crio = {"io.kubernetes.cri-o.KubeName": "crio", "io.kubernetes.cri-o.Namespace": "default"}
    kata = kataoracle.run(release, pod=None, root=node.host.root, pod_resources=node.kubelet.pod_resources_socket,
                          cdi_dirs=[node.host.path(d) for d in ("/etc/cdi", "/var/run/cdi")], annotations=crio)
    try:
        ours = kata_shim.cold_plug(node.host, node.kubelet.pod_resources_socket, crio, release=release)
    except kata_shim.ColdPlugError as exc:
        ours = str(exc)
    assert_same(kata, ours)
    assert kata.ok == (release != "3.25.0")
    (node.host.path("/var/run/cdi") / "nvidia.com-GA102GL_A10.yaml").unlink()
    assert_same(node.kata(release, "twice"), stand_in(node, "twice", release))


@pytest.mark.parametrize("release", kataoracle.judges())
def test_claims_are_not_read_by_released_kata(kata_node, release):
    """A pod whose GPU came from a DRA claim: Kata 3.25/3.29/4.1 read only the device plugin's
    devices, so its VM boots without the GPU; the stand-in in its released mode agrees. (Its
    pending-pull-request mode, sources=(DRA,), is what tests/plugin/test_dra_driver.py uses.)"""
    node = kata_node("a10-server")
    gpu = node.units["nvidia.com/GA102GL_A10"][0]
    claim = ClaimRecord("default", "gpu", [ClaimDevice("passthrough.kata-sandbox-manager.io", "node", "gpu-0",
                                                       (f"nvidia.com/GA102GL_A10={gpu}",))])
    node.kubelet.record_pod(PodRecord("default", "claimed", [ContainerRecord("main", claims=[claim])]))
    kata = node.kata(release, "claimed")
    assert kata.ok and kata.cdi_devices == () and kata.plugged == ()
    assert_same(kata, stand_in(node, "claimed", release))
    proposed = kata_shim.cold_plug(node.host, node.kubelet.pod_resources_socket,
                                   kata_shim.sandbox_annotations("default", "claimed"), sources=(kata_shim.DRA,))
    assert proposed.functions == (gpu,)
    with pytest.raises(kata_shim.ColdPlugError, match="pod_resource_device_sources"):
        kata_shim.cold_plug(node.host, node.kubelet.pod_resources_socket,
                            kata_shim.sandbox_annotations("default", "claimed"), sources=(kata_shim.DEVICE_PLUGIN,))
