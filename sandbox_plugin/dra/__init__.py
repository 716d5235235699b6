"""Dynamic Resource Allocation: the node's passthrough units as ResourceSlices, and
claims prepared for the kubelet with the CDI names Kata's cold-plug resolves.

``sandbox-dra-driver`` (``cli``) runs one ``driver.DraDriver``: the plugin's own
discovery (``sandbox_plugin.discovery``: one PCI scan, one selection, one naming
rule, one list of passthrough units) described as DRA devices (``devices``),
published for this node (``slices``), the kubelet's plugin registration
(``registration``) and DRA service (``service``) over the plugin's gRPC transport,
claims read from the API server (``claims``) and checkpointed (``checkpoint``).
docs/devices.md ("Choosing GPUs with DRA") says what a scheduler sees.
"""
