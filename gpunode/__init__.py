"""The core both programs run on: what a GPU node is and how it is changed.

Layered (import-linter's one layers contract, pyproject.toml), from the top:
``services`` (what both programs run on a node besides its hardware: the cluster
connection, the Node's labels, the kubelet's PodResources, metrics, the node lock, NVIDIA
Fabric Manager), ``policy`` (which devices are passthrough devices, their names, what the
node's Kata cold-plugs, the workload), ``host`` (the node's hardware and files through one
``HostRoot``: PCI, IOMMU groups, VFIO binding, the kernel seam, NVIDIA's gpu-admin-tools),
then names and errors (``k8snames``, ``kataclasses``, ``errors``). ``katamgr`` and
``sandbox_plugin`` sit above it and never import each other.
"""

__version__ = "0.1.0"
