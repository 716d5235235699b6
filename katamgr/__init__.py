"""kata-sandbox-manager node controller."""

__version__ = "0.1.0"
