"""The Kata half of a reconcile: artifacts, Kata config, containerd, RuntimeClasses.

Order matters and is the operator's safety net: a runtime class reaches
containerd only once its artifacts are installed and its Kata config points at
them, and reaches the cluster only once containerd knows it, so a pod can never
be scheduled onto a handler the node cannot run. Under the chart the RuntimeClasses
are Helm's (``KataContext.manage_runtime_classes`` False, ``--no-runtime-classes``):
no node identity may write the cluster's classes, so that step is left out here.
"""

from __future__ import annotations

import dataclasses
import logging
import posixpath
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpunode.errors import ConfigError, GpuNodeError
from gpunode.host.files import remove_stale_temps
from gpunode.host.root import HostRoot
from gpunode.policy import katadetect, katarelease
from gpunode.services import interrupt
from katamgr.artifacts import (
    DEFAULT_DEADLINES,
    ArtifactError,
    Credentials,
    Deadlines,
    LayoutRef,
    NotOursError,
    Pull,
    RegistryRef,
    Resolution,
    credentials_from_dockerconfigjson,
    install_artifact,
    read_install,
    remove_install,
)
from katamgr.config import KataManagerConfig, RuntimeClassConfig
from katamgr.pipeline import kata_record, kata_reload
from katamgr.pipeline.kata_checked import Preflight
from katamgr.pipeline.plan import PlanSection
from katamgr.pipeline.report import Report
from katamgr.runtime import (
    KataRuntime,
    configure_containerd,
    revert_containerd,
    transform_kata_config,
)
from katamgr.runtime.guest_images import GuestCheck, plan_guest
from katamgr.runtime.kata_config import (
    DROP_IN_DIR,
    DROP_IN_NAME,
    drop_in_path,
    installed_cold_plug_gaps,
    remove_gpu_drop_ins,
    rendered_config,
    write_gpu_drop_in,
)

if TYPE_CHECKING:  # the client is imported only where a cluster is talked to
    from kubernetes.client import ApiClient

log = logging.getLogger(__name__)

# The agent's verdict on the installed artifacts (``kata_verify``), in katamgr's state dir.
VERIFIED_NAME = "verified.json"


@dataclass(frozen=True)
class KataContext:
    config: KataManagerConfig
    api: ApiClient | None = None  # None: no cluster reachable, RuntimeClasses skipped
    namespace: str = "default"
    root_ports: int = 0  # passthrough GPUs + NVSwitches on this node
    deadlines: Deadlines = DEFAULT_DEADLINES  # every registry transfer ends by these
    kata_found: katadetect.KataOnNode | None = None  # the Kata runtimes found; None: not looked for
    # False (katamgr --no-runtime-classes): someone else owns the cluster's RuntimeClasses,
    # the chart (Helm) when the chart runs katamgr, so no step applies, updates or deletes
    # one and this identity needs no RuntimeClass rights.
    manage_runtime_classes: bool = True
    # A retry of the runtime classes that failed (the agent's, ``Reconciler``): the other
    # classes, installed, are not looked up again. None: every class is checked.
    retry_classes: frozenset[str] | None = None


def class_release(ctx: KataContext, name: str) -> katarelease.KataRelease:
    """The Kata release that reads class ``name``'s config: devices.kataVersion, else the shim found."""
    typed = ctx.config.devices.kata_release
    return typed if typed.version or ctx.kata_found is None else ctx.kata_found.release_for([name])


def kata_deploy_runtime(ctx: KataContext, name: str) -> katadetect.FoundRuntime | None:
    """kata-deploy's runtime that serves runtime class ``name`` (``kataDeploy``: auto or true)
    with the config containerd names for it (katamgr's drop-in goes beside it), wherever detection
    found it: /opt/kata or below another INSTALLATION_PREFIX (config.rs: <prefix>/opt/kata)."""
    if ctx.config.kata_deploy is False or ctx.kata_found is None:
        return None
    return next((r for r in ctx.kata_found.runtimes
                 if r.name == name and r.installed_by == katadetect.KATA_DEPLOY and r.config_path), None)


def kata_deploy_missing(ctx: KataContext, name: str) -> str | None:
    """Why runtime class ``name`` fails with ``kataDeploy: true`` (kata-deploy does not provide it)."""
    if ctx.config.kata_deploy is not True or kata_deploy_runtime(ctx, name) is not None:
        return None
    return (f"runtime class {name}: kataDeploy is true but kata-deploy registered no runtime {name} on this "
            "node; install it with kata-deploy or set kataDeploy to auto")


def not_ours(rc: RuntimeClassConfig, config: KataManagerConfig, exc: NotOursError) -> str:
    return (f"runtime class {rc.name}: {exc}; choose another kataManager.config.artifactsDir "
            f"({config.artifacts_dir}) or runtime class name, or move that directory aside")


def class_dir(config: KataManagerConfig, name: str) -> str:
    return f"{config.artifacts_dir.rstrip('/')}/{name}"


def pull_of(host: HostRoot, ctx: KataContext, rc: RuntimeClassConfig) -> Pull:
    """How this runtime class's artifact is pulled, for both the preflight and the install."""
    ref = rc.artifacts.source
    if isinstance(ref, LayoutRef):
        # An air-gapped layout lives on the node, so its path is a host path.
        ref = dataclasses.replace(ref, path=host.path(str(ref.path)))
    return Pull.of(ref, label=rc.artifacts.url, credentials=_credentials(ctx, rc, ref),
                   deadlines=ctx.deadlines, insecure_registries=ctx.config.insecure_registries)


def _credentials(ctx: KataContext, rc: RuntimeClassConfig, ref: RegistryRef | LayoutRef) -> Credentials | None:
    secret = rc.artifacts.pull_secret
    if not secret or isinstance(ref, LayoutRef):
        return None
    if ctx.api is None:
        raise ConfigError(
            f"runtimeClasses {rc.name}: pullSecret {secret!r} is set but no cluster is reachable to read it"
        )
    from katamgr import cluster

    data = cluster.read_pull_secret(ctx.api, ctx.namespace, secret)
    return credentials_from_dockerconfigjson(data, ref.registry, secret=f"{ctx.namespace}/{secret}")


def _installed_config(host: HostRoot, ctx: KataContext, name: str) -> str | None:
    local = host.path(class_dir(ctx.config, name))
    if read_install(local) is None:
        return None
    rendered = rendered_config(host, local)
    return host.host_path(rendered) if rendered else None


def runtimes(host: HostRoot, ctx: KataContext, names: list[str] | None = None) -> list[KataRuntime]:
    """The containerd runtime entries for the classes whose artifacts are installed."""
    if names is None:
        names = [rc.name for rc in ctx.config.runtime_classes]
    out = []
    for name in names:
        config_path = _installed_config(host, ctx, name)
        if config_path:
            out.append(KataRuntime(name, config_path, tuple(ctx.config.containerd.pod_annotations)))
    return out


# ---- plan (read-only) -------------------------------------------------------


def plan_sections(host: HostRoot, ctx: KataContext, *, enable_cdi: bool = True) -> list[PlanSection]:
    config = ctx.config
    artifacts, lines = [], []
    theirs = []
    for rc in config.runtime_classes:
        record = read_install(host.path(class_dir(config, rc.name)))
        entry = {"runtimeClass": rc.name, "ref": rc.artifacts.url, "dir": class_dir(config, rc.name)}
        provided = kata_deploy_runtime(ctx, rc.name)
        missing = kata_deploy_missing(ctx, rc.name)
        if provided is not None:
            theirs.append(rc.name)
            drop_in = host.host_path(drop_in_path(host, provided.config_path))
            entry |= {"action": "kata-deploy", "installedDigest": None, "configPath": provided.config_path,
                      "dropIn": drop_in}
            lines.append(f"use kata-deploy's runtime {rc.name} ({provided.release}, {provided.flavour}): pull "
                         f"nothing; write the GPU settings to {drop_in}")
        elif missing:
            entry |= {"action": "fail", "installedDigest": None}
            lines.append(missing)
        elif record is None:
            entry |= {"action": "pull", "installedDigest": None}
            lines.append(f"pull {rc.artifacts.url} into {entry['dir']}")
        else:
            same = record.ref == rc.artifacts.url
            entry |= {"action": "check" if same else "pull", "installedDigest": record.digest}
            lines.append(
                f"{'check for a newer' if same else 'pull new ref'} {rc.artifacts.url} "
                f"(installed {record.digest[:19]}...)"
            )
            gaps = installed_cold_plug_gaps(host, host.path(entry["dir"]))
            entry["coldPlugGaps"] = gaps
            lines += [f"  warning: {gap}" for gap in gaps]
        lines.append(plan_guest(entry, class_release(ctx, rc.name)))  # what its Kata boots, and why
        artifacts.append(entry)
    sections = [PlanSection("artifacts", "Kata artifacts", artifacts, lines,
                            pending=any(a["action"] == "pull" for a in artifacts))]

    entries = runtimes(host, ctx)
    missing = [rc.name for rc in config.runtime_classes
               if rc.name not in {r.name for r in entries} and rc.name not in theirs]
    change = configure_containerd(host, entries, config.containerd.config_path, config.containerd.version,
                                  enable_cdi=enable_cdi, dry_run=True)
    data = {"path": change.path, "mode": change.mode, "version": change.version, "changed": change.changed,
            "diff": change.diff, "pendingArtifacts": missing}
    lines = [f"{'edit' if change.changed else 'keep'} {change.path} ({change.mode}, config version {change.version})"]
    lines += [f"  {line}" for line in change.diff.splitlines()]
    if missing:
        lines.append(f"runtimes added once their artifacts are installed: {', '.join(missing)}")
    if theirs:
        lines.append(f"runtimes kata-deploy registered, left as they are: {', '.join(theirs)}")
    sections.append(PlanSection("containerd", "containerd", data, lines, pending=change.changed or bool(missing)))

    sections.append(_runtime_classes_section(ctx))
    return sections


# Said wherever the RuntimeClass step is skipped for --no-runtime-classes.
MANAGED_ELSEWHERE = "managed elsewhere, by the chart (--no-runtime-classes)"


def _runtime_classes_section(ctx: KataContext) -> PlanSection:
    from katamgr import cluster

    desired = cluster.desired_runtime_classes(ctx.config)
    if not ctx.manage_runtime_classes:
        lines = [f"leave RuntimeClass {b['metadata']['name']}: {MANAGED_ELSEWHERE}" for b in desired]
    else:
        action = "apply" if ctx.api else "skip (no cluster reachable)"
        lines = [f"{action} RuntimeClass {b['metadata']['name']}" for b in desired]
    data = {"managed": ctx.manage_runtime_classes, "reachable": ctx.api is not None, "objects": desired}
    return PlanSection("runtimeClasses", "RuntimeClasses", data, lines)


# ---- apply -------------------------------------------------------------------


def apply(host: HostRoot, ctx: KataContext, *, enable_cdi: bool = True,
          checked: Preflight | None = None) -> Report:
    """Install, render and register; ``checked`` is what ``kata_checks.preflight`` found (else
    each source is read here). A runtime class that fails is named in ``classes_failed`` and
    left out of containerd; the others go ahead (``classes_ready``: those containerd runs)."""
    report = Report()
    config = ctx.config
    ready: list[str] = []
    theirs: list[str] = []
    for rc in config.runtime_classes:
        provided = kata_deploy_runtime(ctx, rc.name)
        if provided is not None:
            done = _kata_deploy_settings(host, ctx, rc.name, provided)
            report.merge(done)
            if done.ok:
                theirs.append(rc.name)
            continue
        why = checked.failed.get(rc.name) if checked is not None else kata_deploy_missing(ctx, rc.name)
        if why:
            report.classes_failed[rc.name] = why
            continue
        installed = _install(host, ctx, rc, checked, report)
        if not installed:
            continue
        dest = host.path(class_dir(config, rc.name))
        try:
            kata = transform_kata_config(host, dest, root_ports=ctx.root_ports,
                                         device_sources=config.pod_resource_device_sources,
                                         release=class_release(ctx, rc.name))
        except GpuNodeError as exc:
            report.classes_failed[rc.name] = f"runtime class {rc.name}: {exc}"
            continue
        report.changes += [f"{kata.config_path}: {c}" for c in kata.changes] if kata.changed else []
        if kata.changed:  # said once, when the config is rendered, not on every reconcile
            report.warnings += [f"runtime class {rc.name}: {gap}" for gap in kata.cold_plug_gaps]
        ready.append(rc.name)

    entries = runtimes(host, ctx, ready)
    with interrupt.deferred():  # containerd's config and its reload: both, or neither
        remove_stale_temps(host.path(config.containerd.config_path))  # a killed earlier write's
        try:
            kata_record.note_containerd(host, config.containerd.config_path, str(config.containerd.restart_mode),
                                        config.containerd.socket)
            change = configure_containerd(host, entries, config.containerd.config_path, config.containerd.version,
                                          enable_cdi=enable_cdi)
        except OSError as exc:
            report.failures.append(f"containerd config {config.containerd.config_path} was not written: "
                                   f"{exc.strerror or exc}")
            return report.merge(_cluster(ctx, config))
        report.classes_ready = sorted({e.name for e in entries} | set(theirs))
        remove_stale_temps(host.path(change.path))  # the drop-in's, where that is the target
        if change.changed:
            what = ", ".join(filter(None, [
                f"added {', '.join(change.runtimes_added)}" if change.runtimes_added else "",
                f"updated {', '.join(change.runtimes_updated)}" if change.runtimes_updated else "",
                f"removed {', '.join(change.runtimes_removed)}" if change.runtimes_removed else "",
            ])) or "settings"
            report.changes.append(f"edited {change.path} ({what})")
            report.merge(kata_reload.reload(host, config, "load the Kata runtimes"))
        elif kata_record.reload_pending(host, config.containerd.config_path):
            report.merge(kata_reload.retry(host, config))  # an earlier edit containerd never read
    # RuntimeClasses are cluster-wide: one node whose pull failed must not
    # delete a class the other nodes serve, so the whole config is applied.
    report.merge(_cluster(ctx, config))
    return report


def _install(host: HostRoot, ctx: KataContext, rc: RuntimeClassConfig, checked: Preflight | None,
             report: Report) -> bool:
    """Install ``rc``'s artifact as the preflight found it; whether the class has artifacts to
    run now (a failure with an earlier install kept still has)."""
    config = ctx.config
    dest = host.path(class_dir(config, rc.name))
    if checked is not None and rc.name in checked.kept:
        return True
    try:
        found = checked.checked.get(rc.name) if checked is not None else None
        pull = found.pull if found is not None else pull_of(host, ctx, rc)
        resolution = found.resolution if found is not None else Resolution(None, 0)
        if not resolution.warning:
            # Recorded before the install: revert finds the dir whatever config it is given.
            kata_record.note_class(host, rc.name, class_dir(config, rc.name), rc.artifacts.url)
        result = None if resolution.warning else install_artifact(  # source down: keep
            pull, dest, fetched=resolution.fetched, check=GuestCheck())
    except NotOursError as exc:
        report.classes_failed[rc.name] = not_ours(rc, config, exc)
        return False
    except (ArtifactError, ConfigError) as exc:
        if read_install(dest) is None:
            report.classes_failed[rc.name] = f"runtime class {rc.name}: {exc}"
            return False
        report.warnings.append(f"runtime class {rc.name}: {exc}; keeping the artifacts already installed")
        return True
    if result is None:
        report.warnings.append(f"runtime class {rc.name}: {resolution.warning}")
    elif result.warning:
        report.warnings.append(f"runtime class {rc.name}: {result.warning}")
    if result is not None and result.changed:
        report.bytes_pulled += result.bytes_transferred
        report.changes.append(
            f"installed {rc.artifacts.url} ({result.digest[:19]}..., {result.bytes_transferred} bytes) "
            f"into {class_dir(config, rc.name)}"
        )
    return True


def _kata_deploy_settings(host: HostRoot, ctx: KataContext, name: str,
                          provided: katadetect.FoundRuntime) -> Report:
    """Runtime class ``name`` is kata-deploy's runtime: only our GPU settings, as a drop-in beside
    its config (its files, its containerd entry and its shim stay as kata-deploy left them)."""
    report = Report()
    try:
        kata_record.note_drop_in(host, host.host_path(drop_in_path(host, provided.config_path)))
        kata = write_gpu_drop_in(host, provided.config_path, root_ports=ctx.root_ports,
                                 device_sources=ctx.config.pod_resource_device_sources)
    except (GpuNodeError, OSError) as exc:
        report.failures.append(f"runtime class {name} (kata-deploy's): {exc}")
        return report
    if kata.changed:
        report.changes.append(f"{kata.config_path} (kata-deploy's {name}): " + "; ".join(kata.changes))
        report.warnings += [f"runtime class {name}: {gap}" for gap in kata.cold_plug_gaps]
    return report


def _cluster(ctx: KataContext, config: KataManagerConfig) -> Report:
    report = Report()
    if not ctx.manage_runtime_classes:
        return report  # the chart's: nothing to say on every reconcile
    if ctx.api is None:
        report.warnings.append("no cluster reachable (no in-cluster token, no kubeconfig): RuntimeClasses skipped")
        return report
    try:
        from katamgr import cluster

        changes = cluster.reconcile_runtime_classes(ctx.api, config)
    except GpuNodeError as exc:
        report.failures.append(str(exc))
        return report
    report.changes += [f"created RuntimeClass {n}" for n in changes.created]
    report.changes += [f"updated RuntimeClass {n}" for n in changes.updated]
    report.changes += [f"deleted RuntimeClass {n} (no longer configured)" for n in changes.deleted]
    return report


# ---- revert ------------------------------------------------------------------


def revert(host: HostRoot, ctx: KataContext | None, *, delete_runtime_classes: bool = False) -> Report:
    """Undo this node's Kata changes as its record lists them (``kata_record``), and those
    the config in ``ctx`` names (None: the record alone); the cluster-wide RuntimeClasses
    only when asked (they serve every node: delete them when the last node is reverted)."""
    report = Report()
    record = kata_record.load(host)
    config = ctx.config if ctx is not None else None
    if delete_runtime_classes:
        report.merge(_delete_runtime_classes(ctx))
    edited = {e.config_path: (e.restart_mode, e.socket) for e in record.containerd}
    if config is not None:
        edited.setdefault(config.containerd.config_path, (str(config.containerd.restart_mode),
                                                          config.containerd.socket))
    for path, (restart_mode, socket) in edited.items():
        change = revert_containerd(host, path)
        # A killed apply's temp file beside the config, when the revert had nothing to write.
        remove_stale_temps(host.path(path))
        remove_stale_temps(host.path(change.path))
        if change.changed:
            report.changes.append(f"restored {change.path}")
            report.merge(kata_reload.reload_with(host, path, restart_mode, socket, "drop the Kata runtimes"))
    # Our GPU settings beside kata-deploy's configs (the drop-ins only: its own files stay).
    # Below /opt/kata, and beside each config the record names (an install below another prefix).
    under = [katadetect.KATA_DEPLOY_DIR, *(posixpath.dirname(posixpath.dirname(p)) for p in record.drop_ins
                                            if p.endswith(f"/{DROP_IN_DIR}/{DROP_IN_NAME}"))]
    for directory in dict.fromkeys(under):
        report.changes += [f"removed {p}" for p in remove_gpu_drop_ins(host, directory)]
    dirs = [c.dir for c in record.runtime_classes]
    if config is not None:
        dirs += [class_dir(config, rc.name) for rc in config.runtime_classes if class_dir(config, rc.name) not in dirs]
    for directory in dirs:
        # Only dirs holding our install record: never a dir someone else filled.
        if remove_install(host.path(directory)):
            report.changes.append(f"removed {directory}")
    if report.ok:
        kata_record.forget(host)
        host.state_path(VERIFIED_NAME).unlink(missing_ok=True)  # the agent's verdict on them
    return report


def _delete_runtime_classes(ctx: KataContext | None) -> Report:
    report = Report()
    if ctx is not None and not ctx.manage_runtime_classes:
        # The CLI refuses the pair; a caller in code gets the same answer, not a delete.
        report.failures.append(f"not deleting the RuntimeClasses: they are {MANAGED_ELSEWHERE}")
    elif ctx is None or ctx.api is None:
        report.warnings.append("RuntimeClasses not deleted: no cluster reachable (pass --config with a "
                               "cluster to reach, or delete them with kubectl)")
    else:
        try:
            from katamgr import cluster

            gone = cluster.delete_managed_runtime_classes(ctx.api, ctx.config)
            report.changes += [f"deleted RuntimeClass {n}" for n in gone.deleted]
            report.warnings += [f"RuntimeClass {n} is labeled as katamgr's but this service account may not "
                                "delete it (another release's, or created by hand): left it" for n in gone.refused]
        except GpuNodeError as exc:
            report.failures.append(str(exc))
    return report
