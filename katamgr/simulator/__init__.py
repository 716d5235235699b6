"""The node simulator: a node described in YAML, made into a host root that the
real code reads and changes as it would a real node's ``/``.

- ``profile``: host profiles, the YAML description of a node's PCI devices.
- ``profiles``: finding a profile by path or by the name of a shipped one
  (``hosts/``, also ``examples/hosts/``).
- ``materialise``: writing a profile out as a host root with the kernel's sysfs
  shape (``materialise``), and opening such a root again by path (``open_root``).
- ``kernel``: the emulated kernel those roots carry (``host.kernel``), which
  answers binding writes and ``modprobe`` as Linux would.

``katamgr.host`` never imports this package; the simulator plugs in through the
``katamgr.host.kernel.Kernel`` a ``HostRoot`` carries.
"""
