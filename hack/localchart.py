"""The chart on a hack/local-cluster, with its isolation webhook running on this machine.

    hack/local-chart up DIR [--values FILE]   render the chart (the real Helm engine of
                                              helm-python-sdk, .venv), start `katamgr
                                              webhook` on a loopback port with a serving
                                              certificate from the cluster's CA, apply the
                                              chart server-side with its webhook
                                              configurations pointed at that process
    hack/local-chart up DIR --node [--values FILE]
                                              the chart on a cluster with a node
                                              (hack/local-cluster up DIR --node): every
                                              object as rendered, the webhook included, its
                                              pods started by the node's kubelet from the
                                              imported image; hostPaths.rootFS set to the
                                              node's simulated host
    hack/local-chart down DIR                 delete what `up` applied, stop the webhook;
                                              on a node then run the chart's post-delete
                                              hooks as `helm uninstall` does (the revert)

Without a node the local cluster has nowhere to run the chart's webhook Deployment, so the
API server is given this machine's `katamgr webhook` by URL instead of the chart's Service;
every other object is the chart's own. Values default to examples/values/local-cluster.yaml
(examples/values/local-node.yaml with --node).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV_PYTHON = REPO / ".venv" / "bin" / "python"
try:
    import yaml
    from helm_python import Chart, _native
except ImportError:
    if VENV_PYTHON.exists() and Path(sys.executable) != VENV_PYTHON:
        os.execv(str(VENV_PYTHON), [str(VENV_PYTHON), *sys.argv])
    sys.exit("hack/local-chart: needs helm-python-sdk and pyyaml (run: bash .ci/setup)")

CHART = REPO / "deploy" / "helm" / "kata-sandbox-manager"
RELEASE = "kata-sandbox-manager"
NAMESPACE = "gpu-sandbox"
DEFAULT_VALUES = REPO / "examples" / "values" / "local-cluster.yaml"
NODE_VALUES = REPO / "examples" / "values" / "local-node.yaml"
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "RuntimeClass", "PriorityClass",
                  "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration",
                  "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "DeviceClass"}


def kubectl(d: Path, *args: str, input: str | None = None, check: bool = True, timeout: float = 120):
    state = json.loads((d / "state.json").read_text())
    env = {**os.environ, "KUBECONFIG": str(d / "kubeconfig")}
    result = subprocess.run([str(Path(state["bin"]) / "kubectl"), *args], input=input, env=env,
                            capture_output=True, text=True, timeout=timeout)
    if check and result.returncode:
        sys.exit(f"hack/local-chart: kubectl {' '.join(args[:2])} failed:\n{result.stderr}")
    return result


def openssl(*args: str) -> None:
    result = subprocess.run(["openssl", *args], capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"hack/local-chart: openssl {args[0]} failed: {result.stderr.strip()}")


def serving_pair(d: Path, out: Path) -> None:
    """A certificate for 127.0.0.1 signed by the local cluster's CA, which the API server
    is then given as the webhooks' caBundle."""
    out.mkdir(mode=0o700, exist_ok=True)
    ext = out / "tls.ext"
    ext.write_text("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
                   "extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(out / "tls.key"), "-out", str(out / "tls.csr"), "-subj", "/CN=katamgr-webhook")
    openssl("x509", "-req", "-in", str(out / "tls.csr"), "-CA", str(d / "pki" / "ca.crt"),
            "-CAkey", str(d / "pki" / "ca.key"), "-CAcreateserial", "-days", "365",
            "-out", str(out / "tls.crt"), "-extfile", str(ext))


def capabilities(d: Path) -> dict:
    """What `helm install` learns from the API server (.Capabilities): its version and
    every group/version and group/version/kind it serves."""
    version = json.loads(kubectl(d, "version", "-o", "json").stdout)["serverVersion"]["gitVersion"]
    served = set(kubectl(d, "api-versions").stdout.split())
    for line in kubectl(d, "api-resources", "--no-headers").stdout.splitlines():
        parts = line.split()
        served.add(f"{parts[-3]}/{parts[-1]}")
    return {"kube_version": version, "api_versions": sorted(served)}


def render(d: Path, values: Path, extra: dict | None = None) -> tuple[list[dict], list[dict]]:
    """The release's objects, and its post-delete hooks in Helm's order (weight, then kind,
    then name): hooks run at install/uninstall time with Helm, so a plain apply leaves
    them out."""
    given = yaml.safe_load(values.read_text()) or {}
    for key, value in (extra or {}).items():
        given.setdefault(key, {}).update(value)
    options = {"name": RELEASE, "namespace": NAMESPACE, "is_install": True, **capabilities(d)}
    # Chart.render passes the engine no capabilities; the engine's own render options take
    # them (helm template's --kube-version and --api-versions), as tests/support/chartkit.py
    # passes them.
    with Chart.load(CHART) as chart:
        manifests = json.loads(_native.call_string("helm_render", chart._raw(), json.dumps(given),
                                                   json.dumps(options)))
    objects = [obj for path, text in sorted(manifests.items()) if path.endswith((".yaml", ".yml"))
               for obj in yaml.safe_load_all(text) if obj]
    for obj in objects:  # as `helm install -n` places them
        if obj["kind"] not in CLUSTER_SCOPED:
            obj["metadata"].setdefault("namespace", NAMESPACE)
    hooks = [o for o in objects if "post-delete" in hook_of(o)]
    hooks.sort(key=lambda o: (int(o["metadata"]["annotations"].get("helm.sh/hook-weight", "0")),
                              o["kind"], o["metadata"]["name"]))
    return [o for o in objects if not hook_of(o)], hooks


def hook_of(obj: dict) -> str:
    return (obj["metadata"].get("annotations") or {}).get("helm.sh/hook", "")


def run_hooks(d: Path, hooks: list[dict], timeout: float = 300) -> None:
    """What `helm uninstall` does with post-delete hooks: create each in order, wait for
    each Job to complete, then delete them (hook-delete-policy hook-succeeded)."""
    for obj in hooks:
        kubectl(d, "apply", "--server-side", "--field-manager", "helm", "-f", "-",
                input=yaml.safe_dump(obj))
        if obj["kind"] == "Job":
            name, ns = obj["metadata"]["name"], obj["metadata"]["namespace"]
            result = kubectl(d, "wait", "--for=condition=Complete", f"job/{name}", "-n", ns,
                             f"--timeout={int(timeout)}s", check=False, timeout=timeout + 30)
            if result.returncode:
                sys.exit(f"hack/local-chart: post-delete hook job/{name} did not complete: "
                         f"{result.stderr.strip()}")
            print(f"post-delete hook job/{name} completed")
    kubectl(d, "delete", "--ignore-not-found", "--wait=false", "-f", "-",
            input=yaml.safe_dump_all(hooks), check=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keep_webhook_certs(d: Path, objects: list[dict]) -> None:
    """What the chart's `lookup` of its webhook Secret does in a `helm upgrade`: the
    certificates already in the cluster are kept (rendered offline, the chart makes new
    ones, which the running webhook pods would not serve)."""
    for obj in objects:
        if obj["kind"] != "Secret" or not obj["metadata"]["name"].endswith("-webhook-tls"):
            continue
        live = kubectl(d, "get", "secret", obj["metadata"]["name"], "-n", obj["metadata"]["namespace"],
                       "-o", "json", check=False)
        if live.returncode:
            return  # a first install: the rendered certificates are the ones
        data = json.loads(live.stdout)["data"]
        obj["data"] = {k: data[k] for k in ("ca.crt", "tls.crt", "tls.key")}
        for config in objects:
            if config["kind"] in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
                for hook in config["webhooks"]:
                    hook["clientConfig"]["caBundle"] = data["ca.crt"]


def up_on_node(d: Path, here: Path, values: Path) -> None:
    state = json.loads((d / "state.json").read_text())
    if not state.get("node_ip"):
        sys.exit(f"hack/local-chart: the cluster in {d} has no node; start it with: "
                 f"hack/local-cluster up {d} --node")
    extra = {"hostPaths": {"rootFS": state["host_root"]}} if state.get("host_root") else {}
    objects, hooks = render(d, values, extra)
    keep_webhook_certs(d, objects)
    here.mkdir(exist_ok=True)
    (here / "hooks.yaml").write_text(yaml.safe_dump_all(hooks, sort_keys=False))
    kubectl(d, "create", "namespace", NAMESPACE, check=False)
    (here / "applied.yaml").write_text(yaml.safe_dump_all(objects, sort_keys=False))
    kubectl(d, "apply", "--server-side", "--field-manager", "helm", "-f", str(here / "applied.yaml"))
    kinds = sorted({o["kind"] for o in objects})
    print(f"chart {RELEASE} applied to namespace {NAMESPACE}: {len(objects)} objects ({', '.join(kinds)})")
    print(f"its pods: kubectl -n {NAMESPACE} get pods -o wide   (KUBECONFIG={d / 'kubeconfig'})")
    print(f"remove it with: hack/local-chart down {d}")


def up(d: Path, values: Path, node: bool = False) -> None:
    if not (d / "state.json").exists():
        sys.exit(f"hack/local-chart: {d} holds no running local cluster; "
                 f"start one with: hack/local-cluster up {d}")
    here = d / "local-chart"
    if (here / "webhook.pid").exists():
        sys.exit(f"hack/local-chart: already up in {d}; run: hack/local-chart down {d}")
    if node:
        return up_on_node(d, here, values)
    objects, _ = render(d, values)
    serving_pair(d, here)
    port = free_port()
    ca = base64.b64encode((d / "pki" / "ca.crt").read_bytes()).decode()
    for obj in objects:
        if obj["kind"] in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
            for hook in obj["webhooks"]:
                path = hook["clientConfig"]["service"]["path"]
                hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca}
    argv = [str(REPO / ".venv" / "bin" / "katamgr"), "webhook", "--listen", f"127.0.0.1:{port}",
            "--tls-cert-file", str(here / "tls.crt"), "--tls-private-key-file", str(here / "tls.key")]
    webhook = next((o for o in objects if o["kind"] == "Deployment"), None)
    if webhook is not None:  # the chart's own arguments for the webhook, but its TLS files
        args = webhook["spec"]["template"]["spec"]["containers"][0].get("args", [])
        for flag in ("--runtime-class", "--passthrough-resource", "--inject-runtime-class"):
            for i, arg in enumerate(args):
                if arg == flag:
                    argv += [arg] + ([args[i + 1]] if flag != "--inject-runtime-class" else [])
    with open(here / "webhook.log", "ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    (here / "webhook.pid").write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + 30
    while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"hack/local-chart: katamgr webhook did not start; see {here / 'webhook.log'}")
        time.sleep(0.2)
    kubectl(d, "create", "namespace", NAMESPACE, check=False)
    (here / "applied.yaml").write_text(yaml.safe_dump_all(objects, sort_keys=False))
    kubectl(d, "apply", "--server-side", "--field-manager", "helm", "-f", str(here / "applied.yaml"))
    kinds = sorted({o["kind"] for o in objects})
    print(f"chart {RELEASE} applied to namespace {NAMESPACE}: {len(objects)} objects ({', '.join(kinds)})")
    print(f"katamgr webhook (pid {proc.pid}) serves the API server on 127.0.0.1:{port}; "
          f"log {here / 'webhook.log'}")
    print(f"remove both with: hack/local-chart down {d}")


def down(d: Path) -> None:
    here = d / "local-chart"
    applied = here / "applied.yaml"
    if applied.exists():
        # The webhook configurations first: no Pod meets a webhook that is gone.
        objects = list(yaml.safe_load_all(applied.read_text()))
        objects.sort(key=lambda o: "Webhook" not in o["kind"])
        kubectl(d, "delete", "--ignore-not-found", "--wait=false", "-f", "-",
                input=yaml.safe_dump_all(objects), check=False)
        applied.unlink()
    hooks = here / "hooks.yaml"
    if hooks.exists():
        run_hooks(d, [o for o in yaml.safe_load_all(hooks.read_text()) if o])
        hooks.unlink()
    pid_file = here / "webhook.pid"
    if pid_file.exists():
        pid = int(pid_file.read_text())
        try:
            if "katamgr" in Path(f"/proc/{pid}/cmdline").read_text():
                os.kill(pid, signal.SIGTERM)
                print(f"stopped katamgr webhook (pid {pid})")
        except OSError:
            pass
        pid_file.unlink()
    print("chart removed")


def main() -> int:
    parser = argparse.ArgumentParser(prog="hack/local-chart", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("up")
    p.add_argument("dir", type=Path)
    p.add_argument("--values", type=Path)
    p.add_argument("--node", action="store_true",
                   help="the cluster has a node: run every part of the chart on it")
    p = sub.add_parser("down")
    p.add_argument("dir", type=Path)
    args = parser.parse_args()
    if args.command == "up":
        values = args.values or (NODE_VALUES if args.node else DEFAULT_VALUES)
        up(args.dir.resolve(), values, node=args.node)
    else:
        down(args.dir.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
