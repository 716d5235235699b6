"""The simulated node: a node described in YAML, made into a host root that the real code
reads and changes as it would a real node's ``/``, with stand-ins for what a node brings
that cannot run here (its kernel's VFIO, udev, NVIDIA's driver) and for the programs on a
node the product talks to (the kubelet, Kata's shim).

The node itself:
- ``profile``, ``profiles``: host profiles, the YAML description of a node's PCI devices,
  found by path or by the name of a shipped one (``hosts/``, also ``examples/hosts/``);
- ``materialise``: a profile written out as a host root with the kernel's sysfs shape;
- ``node``: ``open_node``, the one test of "is this root simulated", and ``SimulatedNode``,
  the root with what it simulates: its ``kernel`` (emulated sysfs writes and ``modprobe``,
  installed on the root: ``gpunode.host.kernel.Kernel``), its ``udev`` (the host-side
  /dev/vfio of a node made for a real runtime) and its ``nvml``.

What a node runs besides the product, each reproducing the upstream behaviour its
docstring cites, for the tests and ``katamgr demo``:
- ``kubelet`` (the device-plugin side, with ``podresources``, the PodResources v1 service)
  and ``drakubelet`` (the DRA side);
- ``kata_shim``: Kata's cold-plug at sandbox creation.

Neither program imports this package (a contract in ``pyproject.toml``): they find it,
when installed, through the entry point ``launch.SIMULATOR`` is declared as
(``gpunode.services.simulator``), and the code below their entry points is handed its parts.
"""
