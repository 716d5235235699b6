"""Device policy, above the host mechanics: which devices are passthrough devices and why
(``selection``), the scan with that selection (``inventory``), their resource names
(``naming``), what the node's Kata cold-plugs (``kata``, ``katarelease``, ``katadetect``),
the passthrough units both programs advertise (``passthrough``), the workload mode and the
GPU Operator's opt-outs (``workload``), and the decisions and labels made from them."""
