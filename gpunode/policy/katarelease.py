"""The Kata release a node runs, as the device selection and the cold-plug facts use it.

Its own module, below both ``gpunode.policy.selection`` (whose ``NvswitchRule`` decides by it
whether NVSwitches are passed through) and ``gpunode.policy.kata`` (what that release
cold-plugs, asked of an ``Inventory`` that carries the rule).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

NVSWITCH_FIXED = (4, 1)
_VERSION = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?$")


@dataclass(frozen=True)
class KataRelease:
    """The Kata release the node runs; ``version`` None when nobody said."""

    version: tuple[int, int, int] | None = None

    def __str__(self) -> str:
        return "an unknown Kata release" if self.version is None else "Kata " + ".".join(map(str, self.version))

    @property
    def cold_plugs_nvswitches(self) -> bool:
        return self.version is not None and self.version[:2] >= NVSWITCH_FIXED


UNKNOWN = KataRelease()


def parse_release(text: str | None) -> KataRelease:
    """``3.25.0`` (or ``3.25``, ``v3.25.0``) -> KataRelease; ValueError naming the value."""
    if text is None or text == "":
        return UNKNOWN
    found = _VERSION.match(str(text).strip())
    if not found:
        raise ValueError(f"{text!r} is not a Kata release such as 3.25.0")
    major, minor, patch = found.groups()
    return KataRelease((int(major), int(minor), int(patch or 0)))
