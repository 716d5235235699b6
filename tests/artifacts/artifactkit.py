"""Helpers the artifact tests share: what an installed artifact dir looks like."""

from __future__ import annotations

from pathlib import Path


def snapshot(dest: Path) -> dict[str, tuple[bytes, int]]:
    """Every file's bytes and inode: equal snapshots mean the install was not touched."""
    return {p.name: (p.read_bytes(), p.stat().st_ino) for p in sorted(dest.iterdir())}


def leftovers(dest: Path) -> list[str]:
    return sorted(p.name for p in dest.parent.iterdir() if ".staging-" in p.name
                  or ".old-" in p.name)
