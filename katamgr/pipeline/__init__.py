"""The node's pipeline: plan, then apply, then (on request) revert.

``plan`` scans the host and decides, read-only; ``reconcile`` carries a plan out
step by step (``devices``: vfio binding and readiness files; ``cdi_specs``: the
CDI specs; ``kata_runtime``: Kata artifacts, the Kata config, containerd's
runtimes and the cluster's RuntimeClasses) and ``revert_all`` undoes them in the
reverse order. Each step returns a ``report.Report``; ``katamgr.render`` turns
reports and plans into text at the edge. See docs/architecture.md.
"""
