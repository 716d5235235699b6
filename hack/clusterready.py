"""When a local cluster's component is ready: each one's health endpoint, polled within
a bound, and the node's Ready condition. Part of hack/local-cluster."""

from __future__ import annotations

import http.client
import json
import ssl
import subprocess
import time
from pathlib import Path

import localnode
from clusterstate import START_TIMEOUT, Process, State, alive


def wait_ready(proc: Process, check, what: str, timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while time.monotonic() < deadline:
        if not alive(proc):
            raise RuntimeError(f"{proc.name} exited while starting; its log {proc.log} ends:\n"
                               + tail(proc.log))
        try:
            ok, last = check()
            if ok:
                return
        except (OSError, http.client.HTTPException) as e:
            last = str(e)
        time.sleep(0.25)
    raise RuntimeError(f"{proc.name} not {what} after {timeout:g} s (last: {last}); "
                       f"its log {proc.log} ends:\n" + tail(proc.log))


def tail(path: str, lines: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def https_get(port: int, path: str, pki: Path | None = None) -> tuple[bool, str]:
    if pki is None:
        context = ssl._create_unverified_context()  # noqa: S323 - a health probe of our own loopback child
    else:
        context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        context.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
    return _get(http.client.HTTPSConnection("127.0.0.1", port, timeout=5, context=context), path)


def http_get(port: int, path: str) -> tuple[bool, str]:
    return _get(http.client.HTTPConnection("127.0.0.1", port, timeout=5), path)


def _get(conn: http.client.HTTPConnection, path: str) -> tuple[bool, str]:
    """(answered 200, the status and the start of the body) of one GET, the connection closed."""
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        body = response.read(2000).decode(errors="replace")
        return response.status == 200, f"{response.status} {body.strip()[:300]}"
    finally:
        conn.close()


def readiness(state: State, name: str):
    port = state.processes[name].port
    pki = Path(state.dir) / "pki"
    if name == "etcd":
        return lambda: http_get(port, "/health"), "healthy"
    if name == "kube-apiserver":
        return lambda: https_get(port, "/readyz", pki), "ready"
    if name == "containerd":
        bin_dir, d = Path(state.bin), Path(state.dir)
        return lambda: localnode.containerd_ready(bin_dir, d), "serving"
    if name in ("kubelet", "kube-proxy"):
        return lambda: http_get(port, "/healthz"), "healthy"
    if name == "udev":
        log = Path(state.processes[name].log)
        return lambda: (log.exists() and "keeping" in log.read_text(), "no line yet"), "running"
    if name == "fabricmanager":
        log = Path(state.processes[name].log)
        return lambda: (log.exists() and "serving" in log.read_text(), "no line yet"), "running"
    return lambda: https_get(port, "/healthz"), "healthy"


def wait_node_ready(state: State, timeout: float = START_TIMEOUT) -> None:
    """The kubelet registered its Node and reports it Ready (runtime and CNI ready)."""
    kubectl = [str(Path(state.bin) / "kubectl"), "--kubeconfig", str(Path(state.dir) / "kubeconfig")]
    deadline = time.monotonic() + timeout
    last = "not registered yet"
    while time.monotonic() < deadline:
        result = subprocess.run([*kubectl, "get", "node", localnode.NODE_NAME, "-o", "json"],
                                capture_output=True, text=True, timeout=30)
        if result.returncode == 0:
            conditions = {c["type"]: c for c in json.loads(result.stdout)["status"].get("conditions", [])}
            ready = conditions.get("Ready", {})
            if ready.get("status") == "True":
                return
            last = f"Ready={ready.get('status')} ({ready.get('message', '')})"
        time.sleep(0.5)
    raise RuntimeError(f"node {localnode.NODE_NAME} not Ready after {timeout:g} s (last: {last}); "
                       f"the kubelet's log {state.processes['kubelet'].log} ends:\n"
                       + tail(state.processes["kubelet"].log))
