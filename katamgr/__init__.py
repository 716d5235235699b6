"""kata-sandbox-manager node controller."""

from gpunode import __version__

__all__ = ["__version__"]
