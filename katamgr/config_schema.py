"""JSON schemas made from the config models: the config file's, and the Helm chart's parts.

The chart checks ``kataManager.config`` and ``containerd`` (which it renders into the
agent's config file) and ``devices`` (which it passes to the agent and the device plugin
as flags) against ``values.schema.json`` at install time. Those parts of
that file are generated here from ``katamgr.config``'s models, so the chart refuses
what the agent would refuse instead of rendering a crash-looping DaemonSet, and
nothing is written twice. The chart differs from the model only where
``CHART_OVERLAY`` says, each difference with its reason. A test keeps the committed
file equal to what this module generates.

    python -m katamgr.config_schema              # the config file's schema (draft-07)
    python -m katamgr.config_schema --chart FILE # rewrite the generated parts of FILE
    python -m katamgr.config_schema --chart FILE --check  # exit 1 if FILE is stale
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

from gpunode import k8snames
from katamgr.config import KataManagerConfig
from katamgr.runtime.settings import RestartMode

DRAFT_07 = "http://json-schema.org/draft-07/schema#"
CHART_SCHEMA = Path(__file__).resolve().parent.parent / (
    "deploy/helm/kata-sandbox-manager/values.schema.json")

# Where the chart differs from the model, and why.
CHART_OVERLAY: dict[str, Any] = {
    # The templates read both (the artifacts dir is mounted, the classes are checked for
    # duplicate names); the agent would default an absent key, but a Helm user's null
    # deletes the key, and the ConfigMap would then say null, which means "no classes".
    "config_required": ["artifactsDir", "runtimeClasses"],
    # The chart renders its top-level containerd block into the config (not
    # kataManager.config.containerd) and exposes only what its templates need to
    # mount: the config's and the socket's dirs.
    "containerd_keys": ["configPath", "socket", "restartMode"],
    # systemd runs `chroot /host systemctl`, and the chart mounts only chosen host dirs.
    "restart_modes": [RestartMode.SIGNAL.value, RestartMode.NONE.value],
    # The device selection is a top-level value the chart passes to both the agent and the
    # sandbox device plugin (--include-device, --exclude-device): in kataManager.config only
    # the agent would see it, and the plugin would advertise other devices than it binds.
    "top_level_keys": ["devices"],
    # The chart sets it from dra.enabled (the Kata config must read the claims exactly when
    # the DRA driver serves the devices), so kataManager.config does not take it.
    "chart_set_keys": ["podResourceDeviceSources"],
    # The split per node pool is a sandbox workloads' setting (sandboxWorkloads.splits), as
    # the workload label is; the chart renders it into the agent's config.
    "sandbox_keys": ["splits"],
}

# Key order of the generated schema: what a reader looks for first.
_KEY_ORDER = ("$schema", "title", "description", "type", "additionalProperties", "required",
              "properties", "patternProperties", "propertyNames", "items", "anyOf", "enum", "minLength", "maxLength",
              "minimum", "pattern", "not")
# Keywords whose value maps names (or patterns) to schemas: not sorted, not cleaned as such.
_NAMED = ("properties", "patternProperties")


def config_schema() -> dict[str, Any]:
    """The config file's JSON schema (draft-07, self-contained: no ``$ref``)."""
    generated = KataManagerConfig.model_json_schema(by_alias=True, mode="validation")
    schema = _clean(generated, generated.get("$defs", {}))
    return _ordered({"$schema": DRAFT_07, "title": "kata manager config", **schema})


def chart_parts() -> dict[tuple[str, ...], Any]:
    """Each generated part of the chart's values.schema.json, by its path in that file."""
    schema = config_schema()
    config = {k: v for k, v in schema.items() if k not in ("$schema", "title")}
    containerd = config["properties"].pop("containerd")
    top_level = {key: config["properties"].pop(key) for key in CHART_OVERLAY["top_level_keys"]}
    for key in CHART_OVERLAY["chart_set_keys"]:
        config["properties"].pop(key)
    sandbox = {key: config["properties"].pop(key) for key in CHART_OVERLAY["sandbox_keys"]}
    config["required"] = list(CHART_OVERLAY["config_required"])
    containerd["properties"] = {
        key: containerd["properties"][key] for key in CHART_OVERLAY["containerd_keys"]}
    containerd["properties"]["restartMode"]["enum"] = list(CHART_OVERLAY["restart_modes"])
    # The chart's shared name definitions come from k8snames too; the generated parts
    # refer to them where they say the same.
    definitions = {
        "dnsLabel": {
            "type": "string", "minLength": 1, "maxLength": k8snames.DNS1123_LABEL_MAX,
            "pattern": k8snames.DNS1123_LABEL_PATTERN},
        "dnsSubdomain": {
            "type": "string", "minLength": 1, "maxLength": k8snames.DNS1123_SUBDOMAIN_MAX,
            "pattern": k8snames.DNS1123_SUBDOMAIN_PATTERN},
    }
    return {
        **{("definitions", name): _ordered(d) for name, d in definitions.items()},
        ("properties", "kataManager", "properties", "config"):
            _ordered(_refer(config, definitions)),
        ("properties", "containerd"): _ordered(_refer(containerd, definitions)),
        **{("properties", key): _ordered(_refer(part, definitions)) for key, part in top_level.items()},
        **{("properties", "sandboxWorkloads", "properties", key): _ordered(_refer(part, definitions))
           for key, part in sandbox.items()},
    }


def with_chart_parts(values_schema: dict[str, Any]) -> dict[str, Any]:
    """``values_schema`` with every generated part replaced by its current version."""
    out = copy.deepcopy(values_schema)
    for path, part in chart_parts().items():
        parent = out
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = part
    return out


def dump(schema: dict[str, Any]) -> str:
    """The file's text, formatted as values.schema.json is."""
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def _refer(node: Any, definitions: dict[str, Any]) -> Any:
    """``node`` with each subschema equal to one of ``definitions`` replaced by a $ref."""
    if isinstance(node, list):
        return [_refer(item, definitions) for item in node]
    if not isinstance(node, dict):
        return node
    for name, definition in definitions.items():
        if node == definition:
            return {"$ref": f"#/definitions/{name}"}
    return {k: ({n: _refer(s, definitions) for n, s in v.items()} if k in _NAMED
                else _refer(v, definitions)) for k, v in node.items()}


def _clean(node: Any, defs: dict[str, Any]) -> Any:
    """Inline ``$ref``s; drop what pydantic adds for itself (titles, defaults, $defs)."""
    if isinstance(node, list):
        return [_clean(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        # A referenced class's docstring is no field description.
        node = {**{k: v for k, v in target.items() if k != "description"},
                **{k: v for k, v in node.items() if k != "$ref"}}
    out = {}
    for key, value in node.items():
        if key in ("$defs", "title", "default"):
            continue
        # Under these the keys are names or patterns, never schema keywords.
        out[key] = ({name: _clean(sub, defs) for name, sub in value.items()}
                    if key in _NAMED else _clean(value, defs))
    return out


def _ordered(node: Any) -> Any:
    if isinstance(node, list):
        return [_ordered(item) for item in node]
    if not isinstance(node, dict):
        return node
    rank = {key: i for i, key in enumerate(_KEY_ORDER)}
    keys = sorted(node, key=lambda k: (rank.get(k, len(rank)), k))
    return {k: ({name: _ordered(sub) for name, sub in node[k].items()}
                if k in _NAMED else _ordered(node[k])) for k in keys}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m katamgr.config_schema", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chart", type=Path, metavar="FILE",
                        help=f"a chart's values.schema.json to update (ours: {CHART_SCHEMA})")
    parser.add_argument("--check", action="store_true",
                        help="with --chart: change nothing, exit 1 if FILE is not up to date")
    args = parser.parse_args(argv)
    if args.chart is None:
        if args.check:
            parser.error("--check needs --chart FILE")
        sys.stdout.write(dump(config_schema()))
        return 0
    text = args.chart.read_text()
    updated = dump(with_chart_parts(json.loads(text)))
    if updated == text:
        return 0
    if args.check:
        print(f"{args.chart} is not what the config model generates; run "
              f"python -m katamgr.config_schema --chart {args.chart}", file=sys.stderr)
        return 1
    args.chart.write_text(updated)
    print(f"updated {args.chart}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
