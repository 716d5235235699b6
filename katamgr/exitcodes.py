"""The exit codes of ``katamgr``: one table, the one docs/operating.md prints.

A script can act on the code alone. Codes 0, 3, 4 and 5 mean the command ran to its end;
which of them is the most serious thing that happened (3 before 4 before 5). Codes 1 and 2
mean it did not: 2 always with nothing changed, 1 either with nothing changed or with every
change kept listed and the command that undoes it named.
"""

from __future__ import annotations

import enum


class Exit(enum.IntEnum):
    OK = 0            # done as planned, or nothing to do (the output says which)
    FAILED = 1        # failed: nothing changed, or the changes kept are listed with their undo
    USAGE = 2         # bad usage or configuration: found before any write, nothing changed
    PARTLY = 3        # partly done: some runtime classes failed (named); the rest is in place
    PROBLEMS = 4      # done, with problems: plan found some, or apply skipped a device (named)
    FORCED = 5        # done, with --force: devices were taken from the processes named
    RECORD = 6        # a record of katamgr's on the node is damaged or foreign (named): nothing changed
    INTERRUPTED = 130  # SIGINT (128 + 2): stopped at a safe point, what was done is listed
    TERMINATED = 143  # SIGTERM (128 + 15): the same, as a shell reports a process a signal ended


MEANING: dict[Exit, str] = {
    Exit.OK: "done as planned, or nothing to do",
    Exit.FAILED: "failed; nothing changed, or the changes kept are listed with the command that undoes them",
    Exit.USAGE: "bad usage or configuration, found before any write; nothing changed",
    Exit.PARTLY: "partly done: the runtime classes named failed and are not offered; the rest is in place",
    Exit.PROBLEMS: "done with problems: `plan` found problems, or `apply` left out a device (named)",
    Exit.FORCED: "done with --force: devices were taken from the running processes named",
    Exit.RECORD: "a record katamgr keeps on the node (named) is damaged or not katamgr's; nothing changed; "
                 "the message says how to repair it",
    Exit.INTERRUPTED: "stopped by SIGINT (Ctrl-C) at a safe point; what was done is listed with the command that "
                      "finishes or undoes it",
    Exit.TERMINATED: "stopped by SIGTERM at a safe point; what was done is listed, as for 130",
}

_SEVERITY = (Exit.PARTLY, Exit.PROBLEMS, Exit.FORCED)


def most_serious(codes: list[Exit]) -> Exit:
    """The code a run ends with when several things happened (a stop signal beats
    everything: the run did not reach its end; then a failure)."""
    for code in (Exit.INTERRUPTED, Exit.TERMINATED, Exit.RECORD, Exit.FAILED, Exit.USAGE, *_SEVERITY):
        if code in codes:
            return code
    return Exit.OK
