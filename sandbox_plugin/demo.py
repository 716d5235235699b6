"""The device plugin's part of ``katamgr demo``: what a kubelet sees of a node.

Runs the real plugin servers over real unix sockets under the demo's host root,
with the kubelet simulator on the other end, and prints the registration, the
advertised devices, the allocation for a pod, and what Kata's cold-plug makes
of it (the Kata shim stand-in reading the simulator's PodResources service).
"""

from __future__ import annotations

from katamgr.host.inventory import discover
from katamgr.host.naming import Naming
from katamgr.host.root import HostRoot
from sandbox_plugin.manager import Mode, PluginManager
from sandbox_plugin.testing import kata_shim
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
        inv = discover(host, naming.selection)
        # A GPU resource if there is one, else any passthrough resource (an included device's).
        wanted = {naming.resource(d) for d in inv.gpus} or {naming.resource(d) for d in inv.passthrough}
        gpu = next((n for n in names if n in wanted), None)
        if gpu is None:
            print("  no passthrough resource to allocate from")
            return False
        count = min(gpus, len(state.healthy(gpu)))
        answers = kubelet.admit_pod("default", "cuda-vectoradd-kata", {"cuda": {gpu: count}})
        (chosen,) = [p.containers[0].devices[gpu] for p in kubelet.state.pods]
        answer = answers["cuda"][gpu]
        print(f"  pod default/cuda-vectoradd-kata asks for {count} {gpu}: GetPreferredAllocation, then")
        print(f"  Allocate({', '.join(chosen)}) ->")
        for spec in answer.devices:
            print(f"    device node {spec.host_path} ({spec.permissions})")
        for key, value in sorted(answer.envs.items()):
            print(f"    env {key}={value}")
        for device in answer.cdi_devices:
            print(f"    CDI device {device.name}")
        print("  Kata cold-plug at sandbox creation (PodResources Get -> CDI names -> VFIO nodes -> QEMU):")
        try:
            plug = kata_shim.cold_plug(host, kubelet.pod_resources_socket,
                                       kata_shim.sandbox_annotations("default", "cuda-vectoradd-kata"))
        except kata_shim.ColdPlugError as exc:
            print(f"    FAILED: {exc}")
            return False
        for name in plug.cdi_names:
            print(f"    resolved {name}")
        print(f"    device nodes {' '.join(plug.device_nodes)}")
        print(f"    qemu {' '.join(plug.qemu_args)}")
        return bool(answer.devices) and len(plug.functions) >= count
