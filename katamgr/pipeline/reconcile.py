"""One reconcile of the node: host binding, CDI specs, then the Kata chain.

``katamgr plan``, ``apply``, ``revert`` and ``run`` all go through here, so
every entry point does the same steps in the same order and reports them the
same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from gpunode.errors import GpuNodeError
from gpunode.host import vfio
from gpunode.host.root import HostRoot
from gpunode.host.vfiogroups import Action
from gpunode.policy import gpulabels as host_gpulabels
from gpunode.policy import readiness
from gpunode.policy.inventory import discover
from gpunode.policy.naming import Naming
from gpunode.policy.passthrough import resource_units
from gpunode.policy.splitnode import SIDES_FILE
from gpunode.policy.workload import Operand, Workload
from gpunode.services import interrupt
from gpunode.services.interrupt import Interrupted
from gpunode.services.journal import Journal, quiet
from gpunode.services.lock import node_lock, tidy_state_dir
from gpunode.services.nvlinkfabric import FabricSettings
from gpunode.services.podresources import (
    PodDevices,
    assigned_functions,
    list_pod_devices,
    wait_not_offered,
)
from gpunode.services.toolkit import isolation_problem, read_toolkit_config, toml_value
from katamgr.pipeline import cdi_specs, gpulabels, hostpaths, kata_record, nvlinkfabric, records
from katamgr.pipeline.devices import apply_host, revert_host
from katamgr.pipeline.plan import Plan, PlanSection, build_plan
from katamgr.pipeline.report import LeaveReport, Report

if TYPE_CHECKING:
    from gpunode.policy.katadetect import KataOnNode
    from katamgr.pipeline.kata_runtime import KataContext

PASSTHROUGH = Workload.VM_PASSTHROUGH
# How long a second katamgr waits for the one holding the node lock (--wait).
DEFAULT_LOCK_WAIT = 60.0
# How long a leave waits for the kubelet to stop offering the GPUs it gives back (their
# device plugin standing down follows the same label within a second).
OFFER_WAIT = 10.0


@dataclass(frozen=True)
class Steps:
    """Which parts run; each can be switched off (Helm: vfioManager, cdi, kataManager)."""

    vfio: bool = True
    cdi: bool = True
    kata: bool = True
    workload: Workload = PASSTHROUGH  # the node's nvidia.com/gpu.workload.config
    readiness: bool = True  # the vfio step writes /run/nvidia/validations (sandbox-validator's files)

    def __post_init__(self) -> None:
        object.__setattr__(self, "workload", Workload(self.workload))  # "container" -> Workload

    @property
    def passthrough(self) -> bool:
        return self.workload is PASSTHROUGH

    def without(self, operands: frozenset[Operand]) -> Steps:
        """These steps less those of the GPU Operator operands the node opts out of
        (``nvidia.com/gpu.deploy.<operand>=false``; what each means: ``Operand``)."""
        return replace(self, vfio=self.vfio and Operand.VFIO_MANAGER not in operands,
                       kata=self.kata and Operand.KATA_MANAGER not in operands,
                       readiness=self.readiness and Operand.SANDBOX_VALIDATOR not in operands)


def _root_ports(plan: Plan) -> int:
    # One PCIe root port in the VM per passthrough device (a companion rides along).
    return sum(1 for d in plan.devices if d.kind in ("gpu", "nvswitch", "included") and d.action in ("bind", "keep"))


def _kata_runtime():
    # The Kata step brings pydantic's config models, the artifact installer and
    # containerd's settings (a quarter of plan's start-up): loaded only by a
    # command that has a Kata context, or a revert that looks for its records.
    from katamgr.pipeline import kata_runtime

    return kata_runtime


def full_plan(host: HostRoot, naming: Naming, steps: Steps, kata_ctx: KataContext | None,
              *, force: bool = False, workload_why: str = "", gpu_labels: bool | None = None,
              fabric: FabricSettings | None = None, check_sources: bool = True,
              kata_found: KataOnNode | None = None) -> Plan:
    """``gpu_labels``: show the GPU labels the agent publishes (False: say they are off; None:
    no section); ``fabric``: the NVLink fabric section (an NVSwitch board's model, FM's partitions).
    ``check_sources``: ask each runtime class's artifact source for its manifest (reads only) and
    list a class that would fail among the problems. ``kata_found``: the Kata the node's
    context found (``gpunode.services.nodecontext``)."""
    plan = build_plan(host, naming, force=force, kata_found=kata_found)
    if fabric is not None:
        nvlinkfabric.add_section(host, plan, fabric, naming)
    plan.workload = {"mode": steps.workload.value, "why": workload_why}
    if gpu_labels is not None:
        plan.sections.append(gpulabels.plan_section(host, plan.inventory, naming, enabled=gpu_labels))
    if not steps.passthrough:
        _not_passthrough(host, plan, steps.workload)
        return plan
    if steps.cdi:
        plan.sections.append(cdi_specs.plan_section(host, plan.inventory, plan.decisions if steps.vfio else [],
                                                   naming))
    if steps.kata and kata_ctx is not None:
        from katamgr.pipeline import kata_checks

        ctx = _with_root_ports(kata_ctx, plan)
        plan.sections += _kata_runtime().plan_sections(host, ctx, enable_cdi=steps.cdi)
        if check_sources:
            # Each source asked for its manifest, as apply will: a class that would fail is named.
            plan.problems += [f"{why}: it would not be installed or offered on this node"
                              for why in kata_checks.class_problems(host, ctx).values()]
    return plan


def _not_passthrough(host: HostRoot, plan: Plan, workload: Workload) -> None:
    """What a node that does not run VMs will see: no binds, nothing schedulable for
    passthrough, and the GPUs an earlier vm-passthrough left on vfio-pci with the way back."""
    earlier = vfio.bound_by_us(host)
    plan.decisions = [d for d in plan.decisions if d.action is not Action.BIND]
    plan.devices = [
        replace(d, action=Action.KEEP.value if d.bdf in earlier else Action.SKIP.value,
                reason=(f"left on vfio-pci from when this node ran {PASSTHROUGH.value}; "
                        "`katamgr revert` gives it back to its driver") if d.bdf in earlier
                else f"node workload is {workload.value}: stays on its driver")
        if d.action == Action.BIND.value or d.bdf in earlier else d
        for d in plan.devices
    ]
    plan.resources = {}
    plan.problems.insert(0, f"node workload is {workload.value!r}, not {PASSTHROUGH.value!r}: "
                            "nothing is bound and no Kata runtime is set up on this node")
    if earlier:
        plan.problems.insert(1, f"{', '.join(sorted(earlier))} stay on vfio-pci from when this node ran "
                                f"{PASSTHROUGH.value}: `katamgr revert` gives them back to their drivers")
    if workload is Workload.CONTAINER:
        _toolkit_isolation(host, plan)


def _toolkit_isolation(host: HostRoot, plan: Plan) -> None:
    """Whether the NVIDIA Container Toolkit lets unprivileged pods pick GPUs (read-only advice)."""
    config = read_toolkit_config(host)
    if config.read:
        value = config.envvar_when_unprivileged
        lines = [f"{config.path}: accept-nvidia-visible-devices-envvar-when-unprivileged = "
                 f"{'(not set: true)' if value is None else toml_value(value)}"]
    else:
        lines = []
    lines += [f"note: {n}" for n in config.notes]
    plan.sections.append(PlanSection("toolkit", "NVIDIA Container Toolkit", config.to_json(), lines))
    problem = isolation_problem(config)
    if problem:
        plan.problems.append(problem)


def _with_root_ports(ctx: KataContext, plan: Plan) -> KataContext:
    return replace(ctx, root_ports=_root_ports(plan), kata_found=plan.kata_found)


def reconcile(host: HostRoot, naming: Naming, steps: Steps, kata_ctx: KataContext | None, *,
              force: bool = False, wait: float = 5.0, lock_wait: float = DEFAULT_LOCK_WAIT,
              command: str = "katamgr apply", gives_back: bool = False,
              journal: Journal | None = None, kata_found: KataOnNode | None = None) -> Report:
    """Bring the node to the plan, holding the node lock (NodeBusyError after ``lock_wait``).

    Every input is checked before the first write (``kata_checks.preflight``, ``hostpaths``): a
    ConfigError or GpuNodeError out of here means nothing was changed. ``gives_back``:
    the caller gives the GPUs an earlier vm-passthrough left on vfio-pci back itself once
    nothing holds them (``katamgr run``, by ``leave_passthrough``), so a node that does
    not run VMs does not send the operator to ``katamgr revert`` for them. ``journal``:
    where each step is recorded and said as it starts and ends (``gpunode.services.journal``);
    ``kata_found``: the Kata the node's context found.
    """
    journal = journal or quiet()
    with node_lock(host, command, lock_wait):
        records.verify(host)  # a damaged record stops the run before anything is read from it
        return _journalled(journal, lambda: _reconcile(host, naming, steps, kata_ctx, force=force, wait=wait,
                                                       gives_back=gives_back, journal=journal,
                                                       kata_found=kata_found))


def _journalled(journal: Journal, run: Callable[[], Report]) -> Report:
    """``run()`` between the journal's begin and end (interrupted or failed when it raised)."""
    journal.begin()
    try:
        report = run()
    except KeyboardInterrupt:
        journal.end("interrupted")
        raise
    except BaseException:
        journal.end("failed")
        raise
    journal.end("interrupted" if report.interrupted else "succeeded" if report.ok else "failed")
    return report


def _reconcile(host: HostRoot, naming: Naming, steps: Steps, kata_ctx: KataContext | None, *,
               force: bool, wait: float, gives_back: bool, journal: Journal,
               kata_found: KataOnNode | None) -> Report:
    report = Report()
    if not steps.passthrough:
        report.warnings.append(f"node workload is {steps.workload.value!r}: nothing to do for VM passthrough here")
        earlier = [] if gives_back else sorted(vfio.bound_by_us(host))
        if earlier:
            # Never unbound on a label change alone: a VM may still hold them.
            report.warnings.append(
                f"{', '.join(earlier)} stay on vfio-pci from when this node ran {PASSTHROUGH}; "
                "run katamgr revert to give them back to their drivers")
        return report
    kata_dirs = (kata_ctx.config.artifacts_dir,) if steps.kata and kata_ctx is not None else ()
    blocked = hostpaths.problems(host, hostpaths.written(vfio_step=steps.vfio, cdi=steps.cdi,
                                                         readiness_files=steps.readiness, kata_dirs=kata_dirs))
    if blocked:
        raise GpuNodeError("nothing was changed: " + "; ".join(blocked))
    checked = None
    if steps.kata and kata_ctx is not None:
        from katamgr.pipeline import kata_checks

        with journal.step("check the Kata inputs (config, containerd, artifact sources)", writes=False):
            checked = kata_checks.preflight(host, replace(kata_ctx, kata_found=kata_found),
                                            enable_cdi=steps.cdi)
    plan = build_plan(host, naming, force=force, kata_found=kata_found)
    doing = "binding the GPUs"
    try:
        rescan = False
        if steps.vfio:
            bound = apply_host(host, plan, workload=steps.workload, wait=wait, readiness=steps.readiness,
                               journal=journal)
            # A failed group was rolled back, but maybe not all the way: look again.
            rescan = bool(bound.moved) or not bound.ok
            report.merge(bound)
        report.warnings += plan.warnings + plan.problems
        report.problems += plan.problems
        if steps.cdi:
            doing = "writing the CDI specs"
            with journal.step("write the CDI specs") as step:
                # The plan's scan still holds unless devices just moved driver.
                scanned = discover(host, naming.selection, naming.nvswitch_rule) if rescan else plan.inventory
                specs = cdi_specs.write_specs(host, scanned, naming)
                step.failed = not specs.ok
            report.merge(specs)
        if steps.kata and kata_ctx is not None:
            doing = "setting up the Kata runtimes"
            with journal.step("install the Kata runtimes (artifacts, Kata config, containerd, RuntimeClasses)") \
                    as step:
                kata = _kata_runtime().apply(host, _with_root_ports(kata_ctx, plan), enable_cdi=steps.cdi,
                                             checked=checked)
                step.failed = not kata.ok
            report.merge(kata)
    except OSError as exc:
        # A write that failed after the checks: the step rolled back what it had started;
        # what is still in place is named, for the `katamgr revert` that undoes it.
        report.failures.append(hostpaths.failed_write(host, exc, doing))
        report.changes += [k for k in hostpaths.kept(host, kata_dirs) if k not in report.changes]
    except Interrupted as exc:
        # Raised at a safe point (between IOMMU groups, steps or download chunks): what the
        # steps before it did is in place, named from the node's records.
        report.interrupted = exc.exit_code
        report.failures.append(f"stopped by {exc.name} while {doing}; the steps before it are done "
                               f"(steps done: {'; '.join(journal.record.stepsDone) or 'none'})")
        report.changes += [k for k in hostpaths.kept(host, kata_dirs) if k not in report.changes]
    return report


def revert_all(host: HostRoot, steps: Steps, kata_ctx: KataContext | None, *, force: bool = False,
               delete_runtime_classes: bool = False, lock_wait: float = DEFAULT_LOCK_WAIT,
               command: str = "katamgr revert", node_labels: gpulabels.NodeLabels | None = None,
               journal: Journal | None = None) -> Report:
    """Undo in the reverse order, holding the node lock: cluster and containerd first,
    devices last; what the Kata step did is undone as its record lists it, whatever
    ``kata_ctx``'s config names now. A revert that leaves nothing recorded removes the
    lock file too. ``node_labels``: our Node's labels, to remove the GPU labels katamgr set."""
    journal = journal or quiet()
    with node_lock(host, command, lock_wait):
        records.verify(host)

        def run() -> Report:
            if not host_gpulabels.recorded(host):
                report = gpulabels.revert(host, node_labels)  # nothing set: not a step to say
            else:
                with journal.step("remove the GPU labels katamgr set") as step:
                    report = gpulabels.revert(host, node_labels)
                    step.failed = not report.ok
            try:
                return _revert_all(report, host, steps, kata_ctx, force=force,
                                   delete_runtime_classes=delete_runtime_classes, journal=journal)
            except Interrupted as exc:
                # Between two steps: each step done is whole; the rest is still recorded.
                report.interrupted = exc.exit_code
                report.failures.append(
                    f"stopped by {exc.name} before the revert finished (steps done: "
                    f"{'; '.join(journal.record.stepsDone) or 'none'}); what is left is still recorded: "
                    "run `katamgr revert` again to finish")
                return report
        report = _journalled(journal, run)
        try:
            tidy_state_dir(host)
        except OSError:
            pass  # a read-only state dir keeps the lock file: the failures above say why
        return report


def _revert_all(report: Report, host: HostRoot, steps: Steps, kata_ctx: KataContext | None, *, force: bool,
                delete_runtime_classes: bool, journal: Journal) -> Report:
    """Each step as far as it goes, into ``report`` (kept when a stop signal ends the revert
    between two steps): a write that fails (a read-only dir) is named with its cause, and the
    steps after it still run (exit 1: what was left is said)."""
    # What the records list is undone whatever the steps say now: an opt-out (--no-kata,
    # --no-vfio, --no-cdi: a manager turned off since) stops new work, never the undoing of
    # what katamgr did while it was on (the chart's uninstall hook passes today's values).
    if kata_record.recorded(host) or (steps.kata and kata_ctx is not None):
        ctx = kata_ctx if steps.kata else None  # off: the record alone says what is there
        _undo(report, host, journal, "remove the Kata runtimes (containerd config, artifacts)",
              "undoing the Kata runtimes (containerd, artifacts)",
              lambda: _kata_runtime().revert(host, ctx, delete_runtime_classes=delete_runtime_classes))
    elif steps.kata and kata_record.changes_recorded(host):
        # Applied by a katamgr older than the Kata record: only its config names the paths.
        report.failures.append(
            "katamgr has Kata changes recorded on this node (containerd config, artifacts) by a release "
            "that did not record their paths; pass the same --config FILE that applied them to revert them too")
    if steps.cdi or cdi_specs.recorded(host):
        _undo(report, host, journal, "remove the CDI specs", "removing the CDI specs",
              lambda: cdi_specs.remove_specs(host))
    if steps.vfio or vfio.bound_by_us(host) or host.path(SIDES_FILE).exists():
        _undo(report, host, journal, "give the devices back to their drivers", "giving the GPUs back",
              lambda: revert_host(host, force=force))
    return report


def _undo(report: Report, host: HostRoot, journal: Journal, title: str, doing: str,
          step: Callable[[], Report]) -> None:
    """``step()`` as the journal step ``title``; a write that fails is named (``doing``) and
    the revert goes on."""
    with interrupt.deferred():  # a stop signal waits for the step's end, and what it did is kept
        with journal.step(title) as outcome:
            try:
                done = step()
            except OSError as exc:
                done = Report(failures=[hostpaths.failed_write(host, exc, doing) + "; left as it is"])
            outcome.failed = not done.ok
        report.merge(done)


def leave_passthrough(host: HostRoot, naming: Naming, steps: Steps, *, release: bool | None = None,
                      readiness_owned: bool | None = None, lock_wait: float = DEFAULT_LOCK_WAIT,
                      command: str = "katamgr run (workload switch)",
                      pod_devices: Callable[[], PodDevices] | None = None,
                      offer_wait: float = OFFER_WAIT,
                      cancelled: Callable[[], bool] | None = None) -> LeaveReport:
    """The node was relabeled away from vm-passthrough, or opted out of katamgr's binding
    (``steps`` are the steps it asks for now): with ``release`` (default ``steps.vfio``,
    whether katamgr bound its GPUs) give the GPUs no pod or VM holds back to their drivers,
    leave the held ones on vfio-pci (never forced: a label change must not crash a running
    VM), make the readiness files (none with ``steps.readiness`` off; only where
    ``readiness_owned``, default ``release``: katamgr's vfio step writes them) and the CDI
    specs follow. The Kata runtime entries stay (see the agent). Holding the node lock
    (NodeBusyError after ``lock_wait``).

    Held means: a process (a Kata VM's QEMU) has the group's ``/dev/vfio`` node open, or
    the kubelet gave the device to a pod (PodResources ``List``, through ``pod_devices``;
    default: the node's kubelet socket). A GPU given to a pod whose VM has not opened it
    yet (the VM is starting) is kept too (``LeaveReport.waiting``) and the free GPUs go
    at once; the caller tries again, so the kept one goes once its pod is gone. A kubelet
    that cannot be asked is reported and only the VMs' open nodes count.

    On a node that leaves vm-passthrough the kubelet is asked only once it no longer
    offers the GPUs to new pods (their plugin stood down: ``wait_not_offered``, at most
    ``offer_wait`` s, or until ``cancelled()``: the node wants them bound again): a pod
    admitted a moment before is then in its answer and keeps its GPU, and none admitted
    after can get one, so no pod is ever given a GPU that is leaving. A GPU the kubelet
    still offers after that stays on vfio-pci (``LeaveReport.held``, tried again)."""
    release = steps.vfio if release is None else release
    readiness_owned = release if readiness_owned is None else readiness_owned
    with node_lock(host, command, lock_wait):
        report = LeaveReport()
        if release:
            _release_devices(host, naming, report, pod_devices or (lambda: list_pod_devices(host)),
                             offer_wait=0.0 if steps.passthrough else offer_wait, cancelled=cancelled)
        if readiness_owned and steps.readiness:
            report.changes += [f"wrote {p}" if p == readiness.WORKLOAD_TYPE else f"removed {p}"
                               for p in readiness.mark_workload(host, steps.workload)]
        elif readiness_owned:
            report.changes += [f"removed {p}" for p in readiness.clear_ready(host)]
        if steps.cdi:
            # The specs follow the devices still on vfio-pci (the held ones, or none).
            report.merge(cdi_specs.write_specs(host, discover(host, naming.selection, naming.nvswitch_rule), naming))
        return report


def _release_devices(host: HostRoot, naming: Naming, report: LeaveReport,
                     pod_devices: Callable[[], PodDevices], *, offer_wait: float,
                     cancelled: Callable[[], bool] | None = None) -> None:
    """The device half of ``leave_passthrough``: unbind what nobody holds, report the rest."""
    recorded = vfio.bound_by_us(host)
    offered: dict[str, list[str]] = {}  # BDF -> why it stays: the kubelet still offers it
    if offer_wait and recorded:
        units = [u for u in resource_units(host, discover(host, naming.selection, naming.nvswitch_rule), naming)
                 if set(u.functions) & set(recorded)]
        still = set(wait_not_offered(host, [u.id for u in units], timeout=offer_wait, cancelled=cancelled))
        why = ["offered to new pods by the kubelet: its device plugin has not stood down"]
        offered = {bdf: why for u in units if u.id.lower() in still for bdf in u.functions}
        if offered:
            report.warnings.append(
                f"{', '.join(sorted(offered))} stay on vfio-pci: the kubelet still offers them to new pods "
                f"(after {offer_wait:g} s, or the node wants them bound again); given back once it does not")
    asked = pod_devices()
    report.pods_unknown = asked.unknown
    if asked.unknown:
        report.warnings.append(f"could not ask the kubelet which pods hold GPUs ({asked.unknown}); "
                               "only GPUs a running VM holds open are kept")
    inv = discover(host, naming.selection, naming.nvswitch_rule)
    given = assigned_functions(host, inv, naming, asked.assignments)
    report.pods = {bdf: [str(a) for a in who] for bdf, who in given.items() if bdf in recorded}
    report.waiting = {bdf: who for bdf, who in report.pods.items()
                      if not vfio.vfio_holders(host, bdf, recorded[bdf].get("group"))}
    if report.waiting:
        report.warnings.append(
            "kept on vfio-pci: " + "; ".join(f"{bdf} is given to {', '.join(who)}"
                                              for bdf, who in sorted(report.waiting.items()))
            + ", whose VM has not opened it yet; it goes back once the pod is gone")
    before = set(recorded)
    # The pods' GPUs stay whether or not their VM holds them yet; the free ones go now.
    result = vfio.unbind_all(host, force=False, keep=set(report.pods) | set(offered))
    report.changes += result.changes
    vms = {bdf: [str(h) for h in who] for bdf, who in result.held.items()}
    report.held = {bdf: vms.get(bdf, []) + report.pods.get(bdf, []) + offered.get(bdf, [])
                   for bdf in {*vms, *report.pods, *offered}}
    report.restored = sorted(before - set(vfio.bound_by_us(host)))
    for failure in result.failures:
        bdf = failure.split(" ", 1)[0]
        if bdf in vms:  # expected: a running VM keeps its GPU
            report.warnings.append(
                f"{bdf} stays on vfio-pci while {'; '.join(vms[bdf])} "
                "(a running VM); it goes back to its driver once that VM is gone")
        else:
            report.failures.append(failure)
