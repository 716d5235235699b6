"""``python -m sandbox_plugin``: the ``sandbox-device-plugin`` command (``katamgr demo``
runs the plugin this way, as the separate program it is on a node)."""

import sys

from sandbox_plugin.cli import main

sys.exit(main())
