"""Helpers the real-kernel tests share: reading the guest's results and showing a
step's record in a failure message."""

from __future__ import annotations

import json


def show(step: dict, *keys: str) -> str:
    """A step's record for a failure message: its command, exit code, output."""
    keys = keys or ("argv", "rc", "seconds", "startup_s", "work_s", "timed_out", "stdout", "stderr", "error")
    lines = []
    for key in keys:
        if key in step:
            value = step[key]
            if isinstance(value, str) and "\n" in value:
                lines.append(f"{key}:\n{value[-4000:]}")
            else:
                lines.append(f"{key}: {json.dumps(value, default=str)[:4000]}")
    return "\n".join(lines)


def group_of(guest, bdf: str) -> int:
    """The IOMMU group the kernel put ``bdf`` in (the guest's ``facts`` step)."""
    for group, devices in guest.step("facts")["groups"].items():
        if bdf in (d["bdf"] for d in devices):
            return int(group)
    raise AssertionError(f"{bdf} is in no IOMMU group")
