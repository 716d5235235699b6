"""``katamgr webhook``: the admission webhook that keeps GPUs where a pod asked for them.

- ``review``: the ``admission.k8s.io/v1`` AdmissionReview contract (parsing a request,
  building a response, the errors that become HTTP 400s);
- ``podparts``: the parts of a pod the rules look at (containers of every kind, their
  requests and env, volumes, mounts, CDI annotations);
- ``rules``: the pod rules, pure functions of a pod dict, the subresource under review and a
  ``Policy``, each container judged on its own: the JSONPatch that hides every GPU from a
  container that asked for none (``NVIDIA_VISIBLE_DEVICES=void``), and the denials (a
  passthrough GPU outside a Kata VM, a CDI annotation, a device hostPath or mount, ...);
- ``answers``: a review routed to the rules and answered;
- the HTTPS server, bounded against hostile and slow clients: ``limits`` (the bounds and
  their flags), ``tls`` (the context, AEAD suites only, and the certificate reloaded when the
  files change), ``httpio`` (HTTP/1.1 parsing), ``connection`` (one client, its deadline),
  ``workers`` (the fixed threads that judge), ``server`` (the epoll loop).

It sits beside ``katamgr.agent`` in the entry-point layer: a program of its own that imports
only the base layer.
"""

# Here, not in ``server``, so ``katamgr --help`` need not load ssl for it.
DEFAULT_LISTEN = "0.0.0.0:8443"
