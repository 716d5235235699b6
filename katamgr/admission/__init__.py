"""``katamgr webhook``: the admission webhook that keeps GPUs where a pod asked for them.

- ``review``: the ``admission.k8s.io/v1`` AdmissionReview contract (parsing a request,
  building a response, the errors that become HTTP 400s);
- ``rules``: the pod rules, pure functions of a pod dict and a ``Policy``: which
  resources are GPUs, the JSONPatch that hides every GPU from a pod that asked for none
  (``NVIDIA_VISIBLE_DEVICES=void``), and the denial of a passthrough GPU outside a Kata VM;
- ``server``: the HTTPS server (``/mutate``, ``/validate``, ``/healthz``) with its
  certificate reloaded when the files change.

It sits beside ``katamgr.agent`` in the entry-point layer: a program of its own that imports
only the base layer.
"""

# Here, not in ``server``, so ``katamgr --help`` need not load ssl for it.
DEFAULT_LISTEN = "0.0.0.0:8443"
