"""What katamgr has installed on this node, read from its records (``katamgr status``).

Read-only: the device record (``vfio.json``: each device moved and the driver it had),
the CDI specs (``cdi.json``), the Kata record (``kata.json``: runtime class dirs,
containerd configs, drop-ins), the containerd edit state (the runtimes in each config),
the GPU labels set on the Node, and the run journal (``run.json``: the last apply or
revert, and the step a killed one reached).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpunode.host import vfio
from gpunode.host.root import STATE_DIR, HostRoot
from gpunode.policy import gpulabels
from gpunode.policy.splitnode import read_sides, sides_from
from gpunode.services import journal
from katamgr.artifacts import read_install
from katamgr.pipeline import cdi_specs, kata_record
from katamgr.runtime import containerd_state


@dataclass(frozen=True)
class BoundDevice:
    bdf: str
    driver_before: str | None
    iommu_group: int | None


@dataclass(frozen=True)
class ContainerdEdit:
    config_path: str
    target: str  # the file edited: the config itself, or our drop-in beside it
    runtimes: tuple[str, ...]
    restart_mode: str
    since: str


@dataclass
class LastRun:
    command: str
    version: str
    pid: int
    started: str
    finished: str | None
    outcome: str | None  # succeeded, failed, interrupted; None: under way
    step: str | None  # the step under way, or reached by an interrupted run
    steps_done: list[str]


@dataclass
class NodeStatus:
    state_dir: str
    devices: list[BoundDevice] = field(default_factory=list)
    cdi_specs: list[str] = field(default_factory=list)
    runtime_classes: list[kata_record.InstalledClass] = field(default_factory=list)
    containerd: list[ContainerdEdit] = field(default_factory=list)
    drop_ins: list[str] = field(default_factory=list)
    gpu_labels: dict[str, str] = field(default_factory=dict)
    since: str | None = None
    version: str | None = None
    last_run: LastRun | None = None
    problems: list[str] = field(default_factory=list)  # a record katamgr could not read
    # A split node's sides as katamgr carries the split out (VM side, container side); None: no split.
    split: tuple[list[str], list[str]] | None = None
    split_from: str | None = None  # where the split came from: the label, or a node pool

    @property
    def installed(self) -> bool:
        return bool(self.devices or self.cdi_specs or self.runtime_classes or self.containerd
                    or self.drop_ins or self.gpu_labels)


def node_status(host: HostRoot) -> NodeStatus:
    from katamgr.pipeline import records

    status = NodeStatus(STATE_DIR)
    # Every damaged record named once with its fix; what the sound ones hold is shown.
    bad = records.damaged(host)
    status.problems = list(bad.values())
    if vfio.STATE_FILE not in bad:
        status.devices = [BoundDevice(bdf, entry.get("driver"), entry.get("group"))
                          for bdf, entry in sorted(vfio.bound_by_us(host).items())]
    if cdi_specs.STATE_FILE not in bad:
        status.cdi_specs = [cdi_specs.spec_path(kind) for kind in cdi_specs.recorded(host)]
    record = kata_record.load(host)
    # Noted before each install: one whose install failed is listed in the record, not on disk.
    status.runtime_classes = [c for c in record.runtime_classes if read_install(host.path(c.dir)) is not None]
    status.drop_ins = list(record.drop_ins)
    for edited in record.containerd:
        try:
            state = containerd_state.load(host, edited.config_path)
        except (ValueError, TypeError):
            continue  # named among the problems
        if state is not None:
            status.containerd.append(ContainerdEdit(edited.config_path, state.target,
                                                    tuple(state.runtime_names()), edited.restart_mode,
                                                    edited.since))
    if gpulabels.STATE_FILE not in bad:
        status.gpu_labels = gpulabels.recorded(host)
    status.since, status.version = record.since, record.version
    sides = read_sides(host)
    if sides is not None:
        status.split = (sorted(sides[0]), sorted(sides[1]))
        status.split_from = sides_from(host)
    run = journal.read_run(host)
    if run is not None:
        outcome = "interrupted" if journal.interrupted(host, run) else run.outcome
        status.last_run = LastRun(run.command, run.version, run.pid, run.started, run.finished, outcome,
                                  run.step, list(run.stepsDone))
        status.version = status.version or run.version
        status.since = min(filter(None, [status.since, run.installedSince]), default=None)
    return status
