"""The agent's word to the device plugin beside it that this node offers no runtime class
any more, so the plugin may stop serving the kubelet.

When the agent's pod is deleted (a DaemonSet rolling update, ``kubectl delete pod``) the
kubelet sends SIGTERM to all its containers at once. A device plugin whose ListAndWatch stream
ends has every device marked Unhealthy at once (k8s.io/kubernetes v1.35.4
pkg/kubelet/cm/devicemanager/manager.go ``PluginDisconnected``), and a pod the kubelet admits
after that and before the new plugin registers fails admission (``UnexpectedAdmissionError``).
So the order is: the agent removes the Node's offer labels (no new pod is scheduled here), waits
for the kubelet to take the pods already bound, then writes this file; the plugin, told to
stop, keeps serving until the file is newer than its own SIGTERM, or a bounded time.

The file lies in the agent's state dir beside the hand-back verdicts (``gpunode.host.handback``),
which the chart mounts read-only into the plugin's container; it names the boot it was written in.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from gpunode.host import files
from gpunode.host.handback import VERDICTS, boot_id
from gpunode.host.root import HostRoot

WITHDRAWN = f"{VERDICTS}/offers-withdrawn.json"
# Both containers get SIGTERM together; a file written this long before the plugin's own signal
# still counts (the agent was signalled first), an older one is another pod's.
SLACK = 5.0


def tell_withdrawn(host: HostRoot, *, clock: Callable[[], float] = time.time) -> None:
    """Say that the offer labels are off and the pods bound before are the kubelet's."""
    body = {"boot": boot_id(), "at": clock()}
    files.write_atomic(host.path(WITHDRAWN), json.dumps(body) + "\n", marked=False)


def withdrawn_since(host: HostRoot, since: float) -> bool:
    """Whether the agent said so at ``since`` (a wall-clock time) or after, in this boot."""
    try:
        raw = json.loads(host.path(WITHDRAWN).read_text())
        return raw.get("boot") == boot_id() and float(raw["at"]) >= since - SLACK
    except (OSError, ValueError, KeyError, TypeError):
        return False


def wait_withdrawn(host: HostRoot, since: float, timeout: float, *, every: float = 0.2,
                   clock: Callable[[], float] = time.monotonic) -> bool:
    """Wait at most ``timeout`` seconds for ``withdrawn_since(since)``; whether it came."""
    deadline = clock() + timeout
    while not withdrawn_since(host, since):
        if clock() >= deadline:
            return False
        time.sleep(every)
    return True
