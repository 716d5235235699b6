"""katamgr's records on the node, checked before any command trusts them.

Revert undoes what the records in ``/var/lib/kata-sandbox-manager`` list, and apply
decides what is left to do from them. A record that cannot be read, or reads as something
else (a file of another program, one cut short or edited by hand), must stop the command
before it changes anything: read as "nothing recorded", apply would say "nothing to change"
and revert would leave the GPUs, the containerd entries or the artifacts it no longer sees.
Each damaged record is named with what it holds and the fix; the command exits
``Exit.RECORD`` having changed nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpunode.errors import GpuNodeError
from gpunode.host import vfio
from gpunode.host.root import HostRoot
from gpunode.policy import gpulabels
from gpunode.services.journal import RunRecord
from gpunode.services.lock import RUN_FILE
from katamgr.exitcodes import Exit
from katamgr.pipeline import cdi_specs, kata_record

BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


class RecordError(GpuNodeError):
    """A record katamgr keeps on the node is damaged or not katamgr's: nothing was changed."""

    exit_code = int(Exit.RECORD)


def _dict_of(value: Any, check: Callable[[str, Any], bool]) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and check(k, v) for k, v in value.items())


def _vfio(data: Any) -> bool:
    def device(bdf: str, entry: Any) -> bool:
        return bool(BDF.match(bdf)) and isinstance(entry, dict) and isinstance(entry.get("driver"), (str, type(None)))
    return isinstance(data, dict) and _dict_of(data.get("devices", {}), device)


def _kata(data: Any) -> bool:
    if not isinstance(data, dict):
        return False
    classes = _dict_of(data.get("runtimeClasses", {}), lambda _, v: isinstance(v, dict)
                       and isinstance(v.get("dir"), str) and v["dir"].startswith("/"))
    edited = _dict_of(data.get("containerd", {}), lambda k, v: k.startswith("/") and isinstance(v, dict))
    drop_ins = data.get("dropIns", [])
    earlier = data.get("earlierDirs", [])
    moved = isinstance(earlier, list) and all(isinstance(e, dict) and isinstance(e.get("dir"), str)
                                              and isinstance(e.get("name"), str) for e in earlier)
    return classes and edited and moved and isinstance(drop_ins, list) and all(isinstance(p, str) for p in drop_ins)


def _run(data: Any) -> bool:
    try:
        return isinstance(data, dict) and isinstance(RunRecord(**data).pid, int)
    except TypeError:
        return False


def _labels(data: Any) -> bool:
    return isinstance(data, dict) and _dict_of(data.get("labels", {}), lambda _, v: isinstance(v, str))


def _cdi(data: Any) -> bool:
    kinds = data.get("kinds") if isinstance(data, dict) else None
    return isinstance(kinds, list) and all(isinstance(k, str) and "/" in k for k in kinds)


def _containerd(data: Any) -> bool:
    return (isinstance(data, dict) and isinstance(data.get("target"), str) and isinstance(data.get("mode"), str)
            and isinstance(data.get("entries", []), list)
            and all(isinstance(e, dict) and isinstance(e.get("path"), list) for e in data.get("entries", [])))


# file name -> (what it records, its check)
RECORDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    vfio.STATE_FILE: ("the devices katamgr moved to vfio-pci and the driver each had", _vfio),
    kata_record.STATE_FILE: ("the Kata runtime class dirs, containerd configs and drop-ins katamgr wrote", _kata),
    cdi_specs.STATE_FILE: ("the CDI specs katamgr wrote", _cdi),
    gpulabels.STATE_FILE: ("the GPU labels katamgr set on the Node", _labels),
    RUN_FILE: ("the last apply or revert (the run journal)", _run),
}
CONTAINERD = ("how to restore a containerd config katamgr edited", _containerd)


def problems(host: HostRoot) -> list[str]:
    """One sentence for each record that cannot be read or is not katamgr's (none: all sound)."""
    return list(damaged(host).values())


def damaged(host: HostRoot) -> dict[str, str]:
    """The damaged records, by their name in the state dir (``vfio.json``,
    ``containerd/<config>.json``), each with its sentence."""
    state = host.state_path(".")
    if not state.is_dir():
        return {}
    found = [(name, *RECORDS[name]) for name in RECORDS if (state / name).exists()]
    if (state / "containerd").is_dir():
        found += [(f"containerd/{p.name}", *CONTAINERD) for p in sorted((state / "containerd").glob("*.json"))]
    out = {}
    for name, what, check in found:
        why = _damage(state / name, check)
        if why:
            shown = host.host_path(host.state_path(name))
            out[name] = (f"{shown} {why}: it is katamgr's record of {what}, which apply and revert follow; "
                         f"nothing was changed. Repair it (from a backup), or, once what it records is undone "
                         f"or checked by hand, move it aside (mv {shown} {shown}.damaged) and run again")
    return out


def _damage(path: Path, check: Callable[[Any], bool]) -> str:
    try:
        data = json.loads(path.read_bytes())
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    except ValueError as exc:
        return f"is not valid JSON ({exc})"
    return "" if check(data) else "is valid JSON but not in the shape katamgr writes (another program's file?)"


def verify(host: HostRoot) -> None:
    """Raise ``RecordError`` naming every damaged record, before anything is changed."""
    found = problems(host)
    if found:
        raise RecordError("; ".join(found))
