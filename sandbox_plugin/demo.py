"""The device plugin's part of ``katamgr demo``: what a kubelet sees of a node.

Runs the real plugin servers over real unix sockets under the demo's host root,
with the kubelet simulator on the other end, and prints the registration, the
advertised devices, a preferred allocation and an Allocate answer.
"""

from __future__ import annotations

from katamgr.host.inventory import discover
from katamgr.host.naming import Naming
from katamgr.host.root import HostRoot
from sandbox_plugin.manager import Mode, PluginManager
from sandbox_plugin.testing.kubelet import KubeletSimulator


def show_device_plugin(host: HostRoot, naming: Naming, *, gpus: int = 2) -> bool:
    with KubeletSimulator(host) as kubelet, PluginManager(host, Mode.VM_PASSTHROUGH, naming=naming) as manager:
        names = sorted(manager.resources)
        state = kubelet.wait_for(
            lambda s: all(s.registrations_for(n) and n in s.devices for n in names), timeout=15)
        for name in names:
            registration = state.registrations_for(name)[-1]
            print(f"  registered {name} (endpoint {registration.endpoint}, {registration.version}): "
                  f"{len(state.healthy(name))} healthy of {len(state.devices[name])}")
        gpu_names = {naming.resource(d) for d in discover(host).gpus}
        gpu = next((n for n in names if n in gpu_names), None)
        if gpu is None:
            print("  no GPU resource to allocate from")
            return False
        available = [d.id for d in state.devices[gpu]]
        chosen = kubelet.preferred(gpu, available, size=min(gpus, len(available)))
        print(f"  GetPreferredAllocation({gpu}, size {len(chosen)}) -> {', '.join(chosen)}")
        answer = kubelet.allocate(gpu, chosen)
        print(f"  Allocate({', '.join(chosen)}) ->")
        for spec in answer.devices:
            print(f"    device node {spec.host_path} ({spec.permissions})")
        for key, value in sorted(answer.envs.items()):
            print(f"    env {key}={value}")
        for device in answer.cdi_devices:
            print(f"    CDI device {device.name}")
        return bool(answer.devices)

