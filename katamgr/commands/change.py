"""``katamgr plan``, ``apply``, ``revert`` and ``status``: one pass over the node, reported."""

from __future__ import annotations

import argparse
import re
import sys
from typing import TYPE_CHECKING

from gpunode.errors import ConfigError, GpuNodeError
from gpunode.host.root import HostRoot
from gpunode.policy.split import dra_refusal
from gpunode.services.lock import refuse_beside_agent
from gpunode.services.simulator import NodeExtras
from katamgr.commands.setup import (
    NodeSetup,
    config_from,
    host_from,
    node_context,
    node_labels,
    node_setup,
    steps_and_context,
)
from katamgr.exitcodes import Exit
from katamgr.output import documents
from katamgr.output.documents import FORMATS
from katamgr.pipeline.reconcile import Steps, full_plan, reconcile, revert_all
from katamgr.pipeline.report import Report
from katamgr.pipeline.splitplan import split_plan
from katamgr.render import plan_text, print_report, quiet, status_text

if TYPE_CHECKING:
    from katamgr.pipeline.kata_runtime import KataContext



def cmd_plan(args: argparse.Namespace) -> int:
    config = config_from(args)
    with node_context(args, config) as node:
        setup = node_setup(args, node.host, config, extras=node.extras, workload=node.workload)
        value, origin = (args.split, None) if args.split is not None else (setup.split, setup.split_from)
        refused = dra_refusal(value, origin) if value and setup.ctx is not None and setup.ctx.config.dra else None
        naming, split = split_plan(node.host, node.naming, None if refused else value, origin)
        plan = full_plan(node.host, naming, setup.steps.without(setup.opted_out), setup.ctx, force=args.force,
                         workload_why=setup.workload_why, gpu_labels=not args.no_gpu_labels,
                         fabric=node.fabric, kata_found=node.kata_found)
        if split is not None:
            plan.sections.insert(0, split)
        if refused:
            plan.problems.append(f"{refused}; nothing is moved for it")
        if args.output in FORMATS:
            print(documents.dump(documents.plan_document(plan), args.output))
        else:
            print(plan_text(plan, wide=args.output == "wide", headers=not args.no_headers))
    return Exit.PROBLEMS if plan.problems else Exit.OK


def cmd_apply(args: argparse.Namespace) -> int:
    config = config_from(args)
    with node_context(args, config) as node:
        host = node.host
        refuse_beside_agent(host, "katamgr apply")
        setup = node_setup(args, host, config, extras=node.extras, workload=node.workload)
        naming, _ = split_plan(host, node.naming, setup.split, setup.split_from)  # only a split node's VM share
        steps = setup.steps.without(setup.opted_out)
        report = reconcile(host, naming, steps, setup.ctx, force=args.force, kata_found=node.kata_found,
                           wait=args.device_wait,
                           lock_wait=args.wait, command="katamgr apply", journal=_journal(host, "katamgr apply"))
        if not report.interrupted:  # a stopped run offers nothing new
            report.merge(_offer(setup, steps, args, report))
        # "Nothing to change" only where nothing was left out either.
        _show_report(args, "ApplyReport", report,
                     "" if report.problems else "nothing to change: the node is already as planned")
        _tell_how_to_undo(report, args)
    return report.exit_code()


def _offer(setup: NodeSetup, steps: Steps, args: argparse.Namespace, report: Report) -> Report:
    """The runtime classes this node offers, on its Node (``pipeline.offers``), where a node name
    and a cluster are known; without them, say which label the classes need."""
    if setup.ctx is None or report.classes_ready is None:
        return Report()
    from gpunode.kataclasses import offer_label
    from katamgr.pipeline import offers

    configured = [rc.name for rc in setup.ctx.config.runtime_classes]
    if setup.api is None or not args.node_name:
        labels = ", ".join(f"{offer_label(n)}=true" for n in report.classes_ready)
        return Report(warnings=[f"the RuntimeClasses run only on nodes labeled {labels or 'for them'}; pass "
                                "--node-name (or NODE_NAME) with a cluster and katamgr labels this node"]
                      if report.classes_ready else [])
    ready = report.classes_ready if steps.passthrough and steps.kata else []
    return offers.publish(node_labels(setup.api, args.node_name), offers.wanted(configured, ready))


def _journal(host: HostRoot, command: str):
    """The run journal of an apply or revert: recorded on the node, each step said on stderr."""
    from gpunode.services.journal import Journal
    from katamgr.output.progress import progress_printer

    return Journal(host, command, progress_printer(command))


def _show_report(args: argparse.Namespace, kind: str, report: Report, nothing: str) -> None:
    if args.output in FORMATS:
        summary = nothing if quiet(report) else ""
        print(documents.dump(documents.report_document(kind, report, summary), args.output))
    else:
        print_report(report, nothing)


def _tell_how_to_undo(report: Report, args: argparse.Namespace) -> None:
    """A failed apply that changed something says so, and how to undo it (exit 1); a partly
    done one names the runtime classes that are not offered (exit 3)."""
    where = f" --host-root {args.host_root}" if args.host_root not in (None, "/") else ""
    if report.partly:
        print(f"katamgr: partly done: runtime class(es) {', '.join(sorted(report.classes_failed))} failed and "
              "are not offered on this node; the rest is in place (`katamgr run` retries them, or run apply "
              "again once the cause is fixed)", file=sys.stderr)
        return
    if report.interrupted:
        print(f"katamgr: apply stopped at a safe point; the changes listed above are in place: run "
              f"`katamgr apply` again to finish, or `katamgr revert{where}` to undo them", file=sys.stderr)
        return
    if not report.failures or not report.changes:
        return
    print(f"katamgr: apply failed after the changes listed above, which are still in place; "
          f"`katamgr revert{where}` undoes them (it follows the node's record: no --config needed)",
          file=sys.stderr)


def cmd_revert(args: argparse.Namespace) -> int:
    if args.delete_runtimeclasses and args.no_runtime_classes:
        raise ConfigError("--delete-runtimeclasses and --no-runtime-classes contradict each other: "
                          "RuntimeClasses left to the chart are deleted by helm uninstall")
    with host_from(args) as (host, extras):
        steps, ctx = steps_and_context(args, host, extras=extras)
        api = _ApiOnce()  # one unanswered call to the API server: the node is reverted all the same
        labels = _revert_node_labels(args, host, ctx, extras)
        report = revert_all(host, steps, ctx, force=args.force,
                            delete_runtime_classes=args.delete_runtimeclasses, lock_wait=args.wait,
                            node_labels=api.guard(labels) if labels is not None else None,
                            journal=_journal(host, "katamgr revert"))
        # The offer labels go whatever --no-kata says: they name runtimes this node no longer has.
        if ctx is not None and ctx.api is not None and args.node_name:
            from katamgr.pipeline import offers

            report.merge(offers.withdraw(api.guard(node_labels(ctx.api, args.node_name))))
        api.left_on_the_node(report, host, args.node_name,
                             offers=ctx is not None and ctx.api is not None and bool(args.node_name))
        _show_report(args, "RevertReport", report, "nothing to revert: katamgr has no changes recorded on this node")
    if report.interrupted:
        print("katamgr: revert stopped at a safe point; what it undid is listed above, the rest is still "
              "recorded: run `katamgr revert` again to finish", file=sys.stderr)
        return report.exit_code()
    return 0 if report.ok else 1


def cmd_status(args: argparse.Namespace) -> int:
    from katamgr.pipeline.status import node_status

    with host_from(args) as (host, _):
        status = node_status(host)
    if args.output in FORMATS:
        summary = "" if status.installed else "nothing installed: katamgr has no changes recorded on this node"
        print(documents.dump(documents.status_document(status, summary), args.output))
    else:
        print(status_text(status))
    # A damaged record is an error a script must see: revert would not undo what it lost.
    return Exit.RECORD if status.problems else Exit.OK


def _revert_node_labels(args: argparse.Namespace, host: HostRoot, ctx: KataContext | None,
                        extras: NodeExtras):
    """The Node's labels to remove the GPU labels katamgr set from: only asked for when it set some."""
    from gpunode.policy import gpulabels

    if not args.node_name or not gpulabels.recorded(host):
        return None
    api = ctx.api if ctx is not None and ctx.api is not None else None
    if api is None:
        from gpunode.services.apiclient import connect

        api = connect(home_kubeconfig=extras.home_kubeconfig)
    return node_labels(api, args.node_name) if api is not None else None


class _ApiOnce:
    """The Node's labels for a revert: after the first call the API server did not answer,
    the others fail at once (no second wait of the client's timeouts and retries), and
    ``left_on_the_node`` says in one sentence what is left there and how to finish."""

    def __init__(self) -> None:
        self.error: str | None = None

    def guard(self, labels):
        from katamgr.pipeline.gpulabels import NodeLabels

        def once(call):
            def run(*args):
                if self.error is not None:
                    raise GpuNodeError(self.error)
                try:
                    return call(*args)
                except GpuNodeError as exc:
                    if _UNANSWERED.search(str(exc)):  # a refusal (404, 403) is said as it is
                        self.error = str(exc)
                    raise
            return run
        return NodeLabels(once(labels.read), once(labels.patch), labels.read_fresh and once(labels.read_fresh))

    def left_on_the_node(self, report: Report, host: HostRoot, node: str | None, *, offers: bool) -> None:
        if self.error is None:
            return
        from gpunode.kataclasses import OFFER_LABEL_PREFIX
        from gpunode.policy import gpulabels

        said = self.error
        report.warnings = [w for w in report.warnings if said not in w]
        report.failures = [f for f in report.failures if said not in f]
        left = sorted(gpulabels.recorded(host))
        names = ", ".join([*left, *([f"{OFFER_LABEL_PREFIX}*"] if offers else [])])
        unset = " ".join([*(f"{k}-" for k in left), *([f"<each {OFFER_LABEL_PREFIX}* label>-"] if offers else [])])
        report.failures.append(
            f"the API server did not answer ({_short(said)}): this node's host state is reverted as listed, but "
            f"on its Node object {node} the labels {names} are left; finish with `kubectl label node {node} "
            f"{unset}`, or run this revert again once the API server answers (the record of the GPU labels "
            "is kept for it)")


_UNANSWERED = re.compile(r"unreachable|timed out|Max retries exceeded|Failed to establish a new connection")


def _short(error: str) -> str:
    """The cause in an API client's error, without the connection pool's wrapping."""
    found = re.search(r"(Failed to establish a new connection: [^\"')]+|Read timed out[^\"')]*|"
                      r"Name or service not known|timed out)", error)
    return found.group(1) if found else error[:300]

