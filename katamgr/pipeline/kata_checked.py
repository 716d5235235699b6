"""What the runtime classes' preflight found, handed to the install.

``kata_checks.preflight`` fills a ``Preflight`` and ``kata_runtime.apply`` carries it out, so
the two modules share it from here (the checks import the runtime step's helpers, the
runtime step only this record).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from katamgr.artifacts import Pull, Resolution


@dataclass(frozen=True)
class Checked:
    """One runtime class's artifact as ``preflight`` found it, for ``apply`` to install."""

    pull: Pull
    resolution: Resolution


@dataclass
class Preflight:
    """What ``preflight`` found, for ``kata_runtime.apply`` to carry out reading nothing twice."""

    checked: dict[str, Checked] = field(default_factory=dict)  # by runtime class name
    failed: dict[str, str] = field(default_factory=dict)  # name -> why, one sentence naming it
    # Installed classes a retry left alone (``KataContext.retry_classes``): not looked up again.
    kept: set[str] = field(default_factory=set)
