"""The chart's uninstall, last of the node suite (file names order the suite's tests):
`hack/local-chart down` deletes the release and runs the chart's post-delete hooks as
`helm uninstall` does (create in weight order, wait for the Job, delete on success), and the
node is put back as it was: every GPU on nvidia, no CDI spec, no runtime class.

What only a pod showed: the hook's revert runs with the state dir as a hostPath mount, which
cannot be removed from inside (EBUSY); it is left empty.
"""

from __future__ import annotations

import os

from support.kubecluster import wait_for
from support.nodekit import GPU_RESOURCE


def test_uninstall_reverts_the_node(node):
    root = node.cluster.host_root
    result = node.cluster_chart("down")
    assert "post-delete hook job/kata-sandbox-manager-revert-wait completed" in result, result
    drivers = {}
    for bdf in os.listdir(root / "sys/bus/pci/devices"):
        link = root / "sys/bus/pci/devices" / bdf / "driver"
        drivers[bdf] = os.path.basename(os.readlink(link)) if link.is_symlink() else None
    assert "vfio-pci" not in drivers.values(), drivers
    assert not list((root / "var/run/cdi").glob("nvidia.com-*")), "CDI specs left behind"
    assert not (root / "run/kata-sandbox-manager/split.json").exists(), "a split's sides left behind"
    assert node.cluster.kubectl("get", "runtimeclass", "kata-qemu-nvidia-gpu", check=False).returncode != 0
    wait_for(lambda: node.resources().get(GPU_RESOURCE) == "0", f"{GPU_RESOURCE} allocatable 0", 60)
