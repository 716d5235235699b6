"""``-o json`` and ``-o yaml``: one versioned document per command, for scripts.

Each document says what it is the way a Kubernetes object does (``apiVersion``, ``kind``:
``Plan``, ``ApplyReport``, ``RevertReport``, ``Status``); its keys are camelCase like the
kataManager config's (``artifactsDir``, ``runtimeClasses``). Facts are fields a script
can test (``ccMode: null``, ``action: bind``); sentences for people are only ever in
``message`` fields (``ccModeMessage: on nvidia``), so no script parses prose.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import TYPE_CHECKING, Any

import yaml

from katamgr.pipeline.plan import DevicePlan, Plan
from katamgr.pipeline.report import Report

# The group the chart's own names use (passthrough.kata-sandbox-manager.io); v1alpha1
# until the shape is promised to stay.
API_VERSION = "kata-sandbox-manager.io/v1alpha1"
FORMATS = ("json", "yaml")

_SNAKE = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)+$")

if TYPE_CHECKING:  # the records' reader brings containerd's TOML library: only for status
    from katamgr.pipeline.status import NodeStatus


def camel(name: str) -> str:
    """``iommu_group`` -> ``iommuGroup``; a key that is not a snake_case word is kept as it is
    (a resource name, a label, a BDF are data, never renamed)."""
    if not _SNAKE.match(name):
        return name
    head, *rest = name.split("_")
    return head + "".join(word[:1].upper() + word[1:] for word in rest)


def camel_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {camel(k) if isinstance(k, str) else k: camel_keys(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [camel_keys(v) for v in value]
    return value


def document(kind: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": kind, **body}


def dump(doc: dict[str, Any], fmt: str) -> str:
    if fmt == "yaml":
        return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=1000).rstrip("\n")
    return json.dumps(doc, indent=2, ensure_ascii=False)


def _messages(texts: list[str]) -> list[dict[str, str]]:
    return [{"message": t} for t in texts]


def _device(d: DevicePlan) -> dict[str, Any]:
    return {
        "bdf": d.bdf, "kind": d.kind, "model": d.model, "ids": d.ids, "driver": d.driver,
        "vfioDriver": d.vfio_driver, "iommuGroup": d.iommu_group, "numaNode": d.numa_node,
        "resource": d.resource, "action": d.action, "ccMode": d.cc_mode, "ccCapable": d.cc_capable,
        "message": d.reason, "selectionMessage": d.selection, "vfioDriverMessage": d.vfio_driver_why,
        "ccModeMessage": d.cc_mode_message,
        "healthMessage": d.health, "unfitMessages": list(d.unfit),
    }


def plan_document(plan: Plan) -> dict[str, Any]:
    body: dict[str, Any] = {
        "hostRoot": plan.host_root,
        "iommuEnabled": plan.iommu_enabled,
        "iommufd": plan.iommufd,
        "vfioPci": plan.vfio_module,
        "workload": {"mode": plan.workload.get("mode"), "message": plan.workload.get("why", "")},
        "changesPending": plan.changes_pending,
        "devices": [_device(d) for d in plan.devices],
        "resources": dict(plan.resources),
        "problems": _messages(plan.problems),
        "warnings": _messages(plan.warnings),
        "namingNotes": _messages(plan.naming_notes),
    }
    for section in plan.sections:
        body[camel(section.key)] = camel_keys(section.data)
    return document("Plan", body)


def report_document(kind: str, report: Report, summary: str = "") -> dict[str, Any]:
    """An apply's or revert's report: ``succeeded``, ``changed``, ``exitCode`` and the lists of what happened."""
    return document(kind, {
        "succeeded": report.ok,
        "changed": bool(report.changes),
        "message": summary,
        "changes": _messages(report.changes),
        "warnings": _messages(report.warnings),
        "failures": _messages(report.failures),
        "boundDevices": list(report.moved),
        "bytesPulled": report.bytes_pulled,
        # Partial success: the classes containerd runs here (null: the Kata step did not run),
        # those that failed, the plan's problems, and the exit code these add up to.
        "classesReady": None if report.classes_ready is None else list(report.classes_ready),
        "classesFailed": [{"name": name, "message": why} for name, why in sorted(report.classes_failed.items())],
        "problems": _messages(report.problems),
        "exitCode": int(report.exit_code()),
    })


def status_document(status: NodeStatus, summary: str = "") -> dict[str, Any]:
    run = status.last_run
    return document("Status", {
        "installed": status.installed,
        "message": summary,
        "stateDir": status.state_dir,
        "since": status.since,
        "katamgrVersion": status.version,
        "devices": [{"bdf": d.bdf, "driverBefore": d.driver_before, "iommuGroup": d.iommu_group}
                    for d in status.devices],
        "cdiSpecs": list(status.cdi_specs),
        "runtimeClasses": [{"name": c.name, "dir": c.dir, "ref": c.ref, "since": c.since}
                           for c in status.runtime_classes],
        "containerd": [camel_keys(dataclasses.asdict(c)) for c in status.containerd],
        "dropIns": list(status.drop_ins),
        "gpuLabels": dict(status.gpu_labels),
        "split": ({"vm": status.split[0], "container": status.split[1], "from": status.split_from}
                  if status.split is not None else None),
        "lastRun": camel_keys(dataclasses.asdict(run)) if run is not None else None,
        "problems": _messages(status.problems),
    })


def error_document(command: str, message: str, exit_code: int) -> dict[str, Any]:
    """A command that stopped before its report (a busy node lock, a bad config, a stop
    signal before any change): kind ``Error``, so a script reading ``-o json`` always gets one
    document with the exit code."""
    return document("Error", {"command": command, "succeeded": False, "message": message,
                              "exitCode": int(exit_code)})
