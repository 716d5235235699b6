"""The Kata found on the node, looked at again while the agent runs.

kata-deploy may install or upgrade Kata after the agent started: it writes its containerd
drop-in (``kata-deploy.toml``) and replaces the shims and the ``VERSION`` file under
``/opt/kata``. Each check compares the files detection read (``katadetect.inputs``: a stat
each, no shim run); where one changed, the node's Kata is detected again
(``katadetect.on_node``, the one way every part learns it) and the target's NVSwitch rule
and the Kata it found follow: the release label (published from the target), the plan, and, through the
reconcile the loop then runs, what the release decides (NVSwitches passed through on 4.1 and
later, or kept back before it).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from gpunode.policy import katadetect
from gpunode.policy.kata import release_json
from gpunode.policy.selection import NvswitchRule
from katamgr.agent.target import Target

log = logging.getLogger("katamgr.agent")  # the agent's one logger (see drift)


def _summary(found: katadetect.KataOnNode | None) -> tuple[tuple[str, str | None, str], ...]:
    runtimes = found.runtimes if found is not None else ()
    return tuple((r.name, release_json(r.release), r.installed_by) for r in runtimes)


def _said(found: katadetect.KataOnNode | None, deciding: NvswitchRule) -> str:
    runtimes = found.runtimes if found is not None else ()
    if not runtimes:
        return "no Kata runtime in containerd's config"
    releases = sorted({str(r.release) for r in runtimes})
    return f"{len(runtimes)} Kata runtime(s), {', '.join(releases)}; deciding: {deciding.kata}"


@dataclass
class KataFound:
    """``given``: the NVSwitch rule the node's context resolved before detection (the release
    typed, which stays the override; the fabric model's decision); where and for which runtime
    classes the node's Kata is found."""

    given: NvswitchRule
    containerd_config: str
    artifacts_dir: str = ""
    names: tuple[str, ...] = ()
    read_version: katadetect.VersionReader = katadetect.run_version
    _inputs: tuple | None = field(default=None, init=False)

    def remember(self, target: Target) -> None:
        """What detection read for the target's NVSwitch rule (at start)."""
        self._inputs = katadetect.inputs(target.host, self.containerd_config, target.kata_found)

    def follow(self, target: Target, *, ours: bool = False) -> str | None:
        """Why the node's Kata changed, with the target's naming following it; None when the
        files detection reads are as they were, or say the same after a look. ``ours``: looked
        at right after the agent's own reconcile, whose install (its artifacts, its containerd
        entries) is then what changed, never kata-deploy's doing."""
        before, found_before = target.naming.nvswitch_rule, target.kata_found
        now = katadetect.inputs(target.host, self.containerd_config, found_before)
        if self._inputs is None or now == self._inputs:
            self._inputs = now
            return None
        after, found = katadetect.on_node(self.given, target.host, self.containerd_config,
                                          artifacts_dir=self.artifacts_dir, names=self.names,
                                          read_version=self.read_version)
        target.naming = dataclasses.replace(target.naming, nvswitch_rule=after)
        target.kata_found = found
        self._inputs = katadetect.inputs(target.host, self.containerd_config, found)
        if _summary(found_before) == _summary(found) and before.kata == after.kata:
            return None
        if ours:
            why = (f"the Kata runtimes katamgr installed are found on the node: "
                   f"{_said(found, after)} now ({_said(found_before, before)} before)")
        else:
            why = (f"the node's Kata changed (kata-deploy installed or upgraded it?): "
                   f"{_said(found_before, before)} before, {_said(found, after)} now")
        log.info("%s", why)
        return why
