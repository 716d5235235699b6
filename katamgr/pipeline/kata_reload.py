"""containerd's reload after katamgr edited its config, remembered until it is done.

containerd reads its config only when it starts (or, with the CRI plugin's config in a
drop-in, on SIGHUP where it supports that): an edit it never read leaves the node without
the Kata runtimes katamgr reports installed. A reload that could not be done (no process
holds containerd's socket, ``systemctl restart`` failed) is marked pending in the Kata record
(``kata.json``), and the next apply, which finds nothing else to change, tries it again and
says so, rather than reporting "nothing to change".
"""

from __future__ import annotations

from gpunode.errors import GpuNodeError
from gpunode.host.root import HostRoot
from katamgr.config import KataManagerConfig
from katamgr.pipeline import kata_record
from katamgr.pipeline.report import Report
from katamgr.runtime import reload_containerd

NONE = "none"  # restartMode none: the operator restarts containerd; nothing to remember


def reload(host: HostRoot, config: KataManagerConfig, purpose: str) -> Report:
    return reload_with(host, config.containerd.config_path, str(config.containerd.restart_mode),
                       config.containerd.socket, purpose)


def reload_with(host: HostRoot, config_path: str, restart_mode: str, socket: str, purpose: str) -> Report:
    """Reload containerd as ``restart_mode`` says; a reload that failed is remembered."""
    report = Report()
    try:
        result = reload_containerd(host, restart_mode, socket_path=socket, purpose=purpose)
        done, message = result.done, result.message
    except GpuNodeError as exc:  # systemctl failed: the edit stays, containerd did not read it
        done, message = False, str(exc)
    (report.changes if done else report.warnings).append(message)
    if restart_mode != NONE:
        kata_record.mark_reload(host, config_path, None if done else message)
    return report


def retry(host: HostRoot, config: KataManagerConfig) -> Report:
    """The reload an earlier apply could not do, tried again: done, or still a problem."""
    path = config.containerd.config_path
    why = kata_record.reload_pending(host, path)
    report = reload(host, config, "load the Kata runtimes")
    if kata_record.reload_pending(host, path) is None:
        report.changes = [f"{c} (containerd had not read katamgr's earlier edit of {path}: {why})"
                          for c in report.changes]
        return report
    problem = (f"containerd has still not read katamgr's edit of {path}, so the Kata runtimes are not "
               f"running there: {report.warnings[-1] if report.warnings else why}")
    report.problems.append(problem)
    report.warnings = [problem]
    return report
