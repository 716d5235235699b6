"""Finding host profiles: a path, or the name of one shipped with katamgr
(``nodesim/hosts/``, also reachable as ``examples/hosts/``)."""

from __future__ import annotations

from pathlib import Path

from nodesim.profile import HostProfile, ProfileError, load_profile

SHIPPED = Path(__file__).parent / "hosts"


def shipped_names() -> list[str]:
    return sorted(p.stem for p in SHIPPED.glob("*.yaml"))


def find_profile(name_or_path: str) -> HostProfile:
    path = Path(name_or_path)
    if path.is_file():
        return load_profile(path)
    shipped = SHIPPED / f"{name_or_path}.yaml"
    if shipped.is_file():
        return load_profile(shipped)
    raise ProfileError(
        f"host profile {name_or_path!r} is neither a file nor a shipped profile "
        f"(shipped: {', '.join(shipped_names())})"
    )
