"""A simulated node made for a real container runtime (`katamgr simulate
--real-device-nodes`, the local node of tests/node) and `--runtime-root`.

On a node, vfio-pci's probe makes the kernel announce /dev/vfio/<group> and udev creates
it; the agent's pod sees /dev/vfio read-only. So on such a simulated node the emulated
kernel leaves /dev/vfio alone and ``nodesim.udev`` makes the nodes: character
devices of the memory driver with minors it has no device for (a container given one reaches
nothing), one pair of numbers per node as on a node, which containerd can stat and inject. The device
paths a runtime is given (CDI hostPath, the kubelet's DeviceSpec) are below --runtime-root.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import stat
import threading

import pytest
from support.hostkit import GPU_A10, dev, make_host

from gpunode.errors import ConfigError
from gpunode.host import vfio
from gpunode.host.pciids import PciIds
from gpunode.policy.inventory import discover
from gpunode.policy.naming import Naming
from katamgr.pipeline.cdi_specs import write_specs
from katamgr.pipeline.plan import build_plan
from nodesim import udev
from nodesim.materialise import materialise
from nodesim.profile import parse_profile
from sandbox_plugin.discovery import PassthroughDiscovery

A10 = "nvidia.com/GA102GL_A10"
NAMING = Naming(PciIds.find())
DEVICES = [dev("0000:17:00.0", GPU_A10, "nvidia", 12), dev("0000:31:00.0", GPU_A10, "nvidia", 13)]


def _made(tmp_path):
    data = {"name": "t", "iommu": True, "vfio_pci": "loaded", "devices": DEVICES}
    return materialise(parse_profile(data), tmp_path / "host", real_device_nodes=True)


def test_udev_makes_and_removes_the_nodes_the_kernel_leaves_alone(tmp_path):
    if os.geteuid() != 0:  # a user who cannot mknod is told so, and nothing is written
        with pytest.raises(ConfigError, match="run it as root"):
            _made(tmp_path)
        assert not (tmp_path / "host").exists()
        return
    host = _made(tmp_path)
    nodes = host.path("/dev/vfio")
    assert sorted(os.listdir(nodes)) == ["vfio"]
    # The emulated kernel binds but makes no node: that is udev's, and the bind waits for it.
    host.kernel.write(host, "/sys/bus/pci/devices/0000:17:00.0/driver_override", "vfio-pci")
    host.kernel.write(host, "/sys/bus/pci/drivers/nvidia/unbind", "0000:17:00.0")
    host.kernel.write(host, "/sys/bus/pci/drivers_probe", "0000:17:00.0")
    assert sorted(os.listdir(nodes)) == ["vfio"]
    assert udev.sync(host) == (["12"], [])
    stop = threading.Event()
    keeper = threading.Thread(target=udev.keep, args=(host, stop))
    keeper.start()
    try:
        assert not vfio.bind(host, build_plan(host, NAMING).decisions).failures
    finally:
        stop.set()
        keeper.join()
    assert sorted(os.listdir(nodes)) == ["12", "13", "vfio"]
    seen = set()
    for name in ("vfio", "12", "13"):
        st = os.stat(nodes / name)
        assert stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == 1 and os.minor(st.st_rdev) >= 64
        seen.add(st.st_rdev)
        # Opening one reaches no device: the memory driver has none at that minor.
        with pytest.raises(OSError) as err:
            os.open(nodes / name, os.O_RDONLY)
        assert err.value.errno == errno.ENXIO
    assert len(seen) == 3  # a runtime tells them apart by their numbers
    host.kernel.write(host, "/sys/bus/pci/drivers/vfio-pci/unbind", "0000:31:00.0")
    assert udev.sync(host) == ([], ["13"])


def test_runtime_root_prefixes_the_paths_a_runtime_opens(tmp_path):
    host = make_host(tmp_path, DEVICES)
    assert not vfio.bind(host, build_plan(host, NAMING).decisions).failures
    moved = dataclasses.replace(host, runtime_root="/srv/node")
    assert write_specs(moved, discover(moved), NAMING).ok
    spec = (host.path("/var/run/cdi") / "nvidia.com-GA102GL_A10.yaml").read_text()
    assert "hostPath: /srv/node/dev/vfio/12" in spec and "path: /dev/vfio/12" in spec
    discovery = PassthroughDiscovery(moved, NAMING)
    discovery.refresh()
    resource = discovery.resources[A10]
    answer = resource.allocate(["0000:17:00.0"])
    assert {(d.container_path, d.host_path) for d in answer.devices} >= {
        ("/dev/vfio/12", "/srv/node/dev/vfio/12"), ("/dev/vfio/vfio", "/srv/node/dev/vfio/vfio")}
    # The spec's names still match the device (its hostPath mapped back to the node's path).
    assert answer.cdi_devices == ["nvidia.com/pgpu=0"]
    discovery.close()
