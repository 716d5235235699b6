"""The node-local services both programs share, apart from the hardware (gpunode.host):
the Node's labels through the API (kube), the kubelet's PodResources (podresources), the
/metrics and probes server, the node lock, logging and signals (process), the watch loop
(watching) and the NVIDIA Container Toolkit's config (toolkit). They may use the hardware
layer; the hardware layer never uses them."""
