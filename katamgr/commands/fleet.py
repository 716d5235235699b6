"""``katamgr fleet``: every node's state from the API alone (read-only), with the caller's
kubeconfig: its workload label, Kata release, the runtime classes offered there, our Node
conditions and the GPUs the kubelet counts but does not offer (unhealthy)."""

from __future__ import annotations

import argparse

from gpunode.errors import ConfigError
from katamgr.exitcodes import Exit


def cmd_fleet(args: argparse.Namespace) -> int:
    from gpunode.services.apiclient import connect
    from katamgr.cluster.fleet import read_fleet

    api = connect()
    if api is None:
        raise ConfigError("katamgr fleet reads the Nodes from the API server: set KUBECONFIG or "
                          "create ~/.kube/config")
    nodes = read_fleet(api, args.selector or "")
    if args.output == "text":
        print(render_table(nodes))
    else:
        from katamgr.output.documents import document, dump

        print(dump(document("Fleet", {"nodes": [fleet_node(n) for n in nodes]}), args.output))
    return Exit.OK


def fleet_node(node) -> dict:
    return {"name": node.name, "workload": node.workload, "kataVersion": node.kata_version,
            "runtimeClasses": node.runtime_classes,
            "conditions": [{"type": c.type, "status": c.status, "reason": c.reason, "message": c.message,
                            "lastTransitionTime": c.last_transition_time or None} for c in node.conditions],
            "unhealthyGpus": node.unhealthy_gpus, "lastTransitionTime": node.last_transition}


def _conditions(node) -> str:
    if not node.conditions:
        return "-"
    failing = [f"{c.type.removeprefix('Sandbox')}={c.status}({c.reason})" for c in node.conditions
               if c.status != "True"]
    return ",".join(failing) if failing else f"all {len(node.conditions)} True"


def render_table(nodes) -> str:
    header = ("NODE", "WORKLOAD", "KATA", "RUNTIME CLASSES", "CONDITIONS", "UNHEALTHY GPUS", "LAST TRANSITION")
    rows = [header]
    for n in nodes:
        unhealthy = ",".join(f"{r.removeprefix('nvidia.com/')}:{k}" for r, k in n.unhealthy_gpus.items())
        rows.append((n.name, n.workload or "-", n.kata_version or "-", ",".join(n.runtime_classes) or "-",
                     _conditions(n), unhealthy or "0", n.last_transition or "-"))
    if len(rows) == 1:
        return "no nodes"
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("   ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows)
