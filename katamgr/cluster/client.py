"""What the agent's API layer says about itself: its field manager and managed-by label,
and the namespace it runs in. How it reaches the cluster is ``gpunode.services.apiclient``'s,
the one rule both programs follow."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from gpunode.services.apiclient import SERVICE_ACCOUNT_DIR

FIELD_MANAGER = "kata-sandbox-manager"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY_VALUE = "kata-sandbox-manager"


def agent_namespace(
    environ: Mapping[str, str] | None = None,
    service_account_dir: Path = SERVICE_ACCOUNT_DIR,
) -> str:
    """The namespace the agent runs in: POD_NAMESPACE, else the service account's, else default."""
    env = os.environ if environ is None else environ
    if env.get("POD_NAMESPACE"):
        return env["POD_NAMESPACE"]
    try:
        namespace = (service_account_dir / "namespace").read_text().strip()
    except OSError:
        namespace = ""
    return namespace or "default"
