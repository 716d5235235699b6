"""The claims this driver prepared, kept in a file so a restart loses none.

The kubelet keeps its own record of prepared claims and, after either side
restarts, calls NodePrepareResources again for the claims its pods still use and
NodeUnprepareResources for the ones they let go of. This file is the driver's
side of that: a claim asked again is answered from it (the same devices and CDI
names, without asking the API server), an unprepare of a claim it no longer lists
succeeds (it was done before), and a device a prepared claim holds is never handed
to a second claim. Every change is written atomically (a temp file renamed over
the old one, ``gpunode.host.files.write_json``) before the kubelet is answered.
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from gpunode.errors import GpuNodeError
from gpunode.host.files import write_json

VERSION = 1
FILE_NAME = "checkpoint.json"


class CheckpointError(GpuNodeError):
    """The checkpoint file cannot be read back."""


@dataclass(frozen=True)
class PreparedDevice:
    request_names: tuple[str, ...]
    pool: str
    device: str
    cdi_ids: tuple[str, ...]


@dataclass(frozen=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...]

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


class Checkpoint:
    """The prepared claims by UID, mirrored to ``path`` on every change."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._claims: dict[str, PreparedClaim] = self._load()

    def _load(self) -> dict[str, PreparedClaim]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise CheckpointError(
                f"the DRA checkpoint {self.path} cannot be read ({exc}); move it aside to start "
                "afresh (the kubelet prepares its pods' claims again, read from the API server)"
            ) from exc
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise CheckpointError(
                f"the DRA checkpoint {self.path} is not version {VERSION} of this driver's format; "
                "move it aside to start afresh")
        try:
            return {uid: PreparedClaim(uid, c["namespace"], c["name"], tuple(
                PreparedDevice(tuple(d["request_names"]), d["pool"], d["device"], tuple(d["cdi_ids"]))
                for d in c["devices"])) for uid, c in data["claims"].items()}
        except (KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(
                f"the DRA checkpoint {self.path} lacks {exc} in a claim; move it aside to start afresh"
            ) from exc

    def _save(self, claims: dict[str, PreparedClaim]) -> None:
        body = {uid: {k: v for k, v in asdict(c).items() if k != "uid"} for uid, c in claims.items()}
        write_json(self.path, {"version": VERSION, "claims": body})

    def get(self, uid: str) -> PreparedClaim | None:
        with self._lock:
            return self._claims.get(uid)

    def claims(self) -> list[PreparedClaim]:
        with self._lock:
            return list(self._claims.values())

    def holder(self, device: str, pool: str) -> PreparedClaim | None:
        """The prepared claim holding ``device`` of ``pool``, if any."""
        with self._lock:
            return next((c for c in self._claims.values()
                         if any(d.device == device and d.pool == pool for d in c.devices)), None)

    def add(self, claim: PreparedClaim) -> None:
        with self._lock:
            claims = {**self._claims, claim.uid: claim}
            self._save(claims)
            self._claims = claims

    def remove(self, uid: str) -> bool:
        """Forget a claim; False when it was not listed (unprepared already)."""
        with self._lock:
            if uid not in self._claims:
                return False
            claims = {k: v for k, v in self._claims.items() if k != uid}
            self._save(claims)
            self._claims = claims
            return True
