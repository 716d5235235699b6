"""A real Kubernetes control plane on this machine, for trying the chart and for the tests.

    hack/local-cluster up DIR        build (once, cached) and start etcd, kube-apiserver,
                                     kube-controller-manager and kube-scheduler on loopback
                                     ports; write DIR/kubeconfig (cluster admin) and DIR/env
    hack/local-cluster up DIR --node [--host PROFILE]
                                     also containerd 2.x, a kubelet and kube-proxy on this
                                     machine: node `local-node`, Ready, with the chart's
                                     image and a pause image imported (hack/image/build);
                                     its host a simulated PROFILE (default dgx-h100) in
                                     DIR/host, for the chart's `hostPaths.rootFS`
                                     (`--host none`: no simulated host). Needs root.
    hack/local-cluster down DIR      stop what `up DIR` started (by pid) and nothing else
    hack/local-cluster stop|start|restart DIR COMPONENT
                                     stop one component, start it again with the same
                                     flags, or both (etcd, kube-apiserver,
                                     kube-controller-manager, kube-scheduler; with a node
                                     also containerd, kubelet, kube-proxy)
    hack/local-cluster status DIR    say what runs, on which port

The versions are pinned in hack/kube/go.mod; hack/kube/build builds them into the user's
cache dir. Without a node every component listens on 127.0.0.1 only; with one the API server
also listens on this machine's address (pods reach it through the `kubernetes` Service).
Everything logs to DIR/logs/ and keeps its data in DIR, so `rm -rf DIR` after `down` leaves
nothing behind (hack/localnode.py says what a node sets up and `down` removes). Only Python's
standard library and the `openssl` command are needed.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import localnode  # noqa: E402 - beside this script, not a package

REPO = HERE.parent
IMAGE_BUILD = HERE / "image" / "build"
BUILD = HERE / "kube" / "build"
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
SERVICE_CIDR = "10.0.0.0/24"
SERVICE_IP = "10.0.0.1"  # the first address of SERVICE_CIDR: the `kubernetes` Service
ISSUER = "https://kubernetes.default.svc.cluster.local"
START_TIMEOUT = 120.0  # a first API server start on a loaded 2-core machine takes ~20 s
# kube-apiserver 1.35 logs its shutdown at once on SIGTERM and then lingers (seen for
# well over 30 s here): a local cluster has nothing to drain, so it is killed after this.
STOP_TIMEOUT = 5.0


class Refused(Exception):
    """Nothing was started or stopped; exit 2 with this message."""


@dataclass
class Process:
    name: str
    argv: list[str]
    log: str
    pid: int = 0
    port: int = 0


@dataclass
class State:
    dir: str
    bin: str
    kube_version: str
    ports: dict[str, int] = field(default_factory=dict)
    processes: dict[str, Process] = field(default_factory=dict)
    node_ip: str = ""  # set when the cluster has a node
    host_root: str = ""  # the node's simulated host root, if any
    made: str = ""  # a dir `up` made outside DIR for the kubelet (removed by `down`)

    @property
    def components(self) -> tuple[str, ...]:
        if not self.node_ip:
            return COMPONENTS
        return COMPONENTS + (("udev",) if self.host_root else ()) + localnode.NODE_COMPONENTS

    @property
    def path(self) -> Path:
        return Path(self.dir) / "state.json"

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, self.path)

    @classmethod
    def load(cls, directory: Path) -> State:
        path = directory / "state.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise Refused(f"{directory} holds no local cluster (no {path.name}); "
                          f"start one with: hack/local-cluster up {directory}") from None
        except (OSError, ValueError) as e:
            raise Refused(f"{path} is unreadable ({e}); stop its processes by hand") from None
        processes = {k: Process(**v) for k, v in raw.pop("processes").items()}
        return cls(**raw, processes=processes)


# --- processes ------------------------------------------------------------------------

def alive(proc: Process) -> bool:
    """The recorded pid still runs the recorded binary (a reused pid is not ours)."""
    if proc.pid <= 0:
        return False
    try:
        exe = os.readlink(f"/proc/{proc.pid}/exe")
        stat = Path(f"/proc/{proc.pid}/stat").read_text()
    except OSError:
        return False
    if stat.rsplit(")", 1)[1].split()[0] == "Z":
        return False
    return exe.removesuffix(" (deleted)") == proc.argv[0]


def start(proc: Process, env: dict[str, str] | None = None) -> None:
    log = open(proc.log, "ab")  # noqa: SIM115 - handed to the child, closed below
    try:
        child = subprocess.Popen(proc.argv, stdin=subprocess.DEVNULL, stdout=log, env=env,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        log.close()
    proc.pid = child.pid


def stop(proc: Process, timeout: float = STOP_TIMEOUT) -> bool:
    """SIGTERM, then SIGKILL after ``timeout``; False if it was not running."""
    if not alive(proc):
        return False
    os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(proc):
            break
        time.sleep(0.1)
    else:
        os.kill(proc.pid, signal.SIGKILL)
        while alive(proc) and time.monotonic() < deadline + 5:
            time.sleep(0.1)
    _reap(proc.pid)
    return True


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- certificates ---------------------------------------------------------------------

def openssl(*args: str) -> None:
    result = subprocess.run(["openssl", *args], capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"openssl {' '.join(args[:2])} failed: {result.stderr.strip()}")


def make_pki(pki: Path, node_ip: str = "") -> None:
    """A CA, the API server's serving cert, client certs for the admin and the two
    controllers (names the default RBAC bindings know), and the service-account key; with
    a node, the kubelet's (the Node authorizer's name for it) and kube-proxy's."""
    pki.mkdir(mode=0o700, parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", str(pki / "ca.key"), "-out", str(pki / "ca.crt"),
            "-subj", "/CN=local-cluster-ca", "-days", "3650",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature")
    leaves = {
        "apiserver": ("/CN=kube-apiserver", "serverAuth",
                      f"DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,"
                      f"DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,"
                      f"IP:127.0.0.1,IP:{SERVICE_IP}" + (f",IP:{node_ip}" if node_ip else "")),
        "admin": ("/O=system:masters/CN=local-cluster-admin", "clientAuth", ""),
        "controller-manager": ("/CN=system:kube-controller-manager", "clientAuth", ""),
        "scheduler": ("/CN=system:kube-scheduler", "clientAuth", ""),
        "apiserver-kubelet-client": ("/O=system:masters/CN=kube-apiserver-kubelet-client",
                                     "clientAuth", ""),
    }
    if node_ip:
        leaves["kubelet"] = (f"/O=system:nodes/CN=system:node:{localnode.NODE_NAME}",
                             "clientAuth", "")
        leaves["kube-proxy"] = ("/CN=system:kube-proxy", "clientAuth", "")
    for name, (subject, usage, san) in leaves.items():
        ext = pki / f"{name}.ext"
        lines = ["basicConstraints=CA:FALSE", "keyUsage=critical,digitalSignature",
                 f"extendedKeyUsage={usage}"]
        if san:
            lines.append(f"subjectAltName={san}")
        ext.write_text("\n".join(lines) + "\n")
        openssl("req", "-new", *ec, "-keyout", str(pki / f"{name}.key"),
                "-out", str(pki / f"{name}.csr"), "-subj", subject)
        openssl("x509", "-req", "-in", str(pki / f"{name}.csr"), "-CA", str(pki / "ca.crt"),
                "-CAkey", str(pki / "ca.key"), "-CAcreateserial", "-days", "3650",
                "-out", str(pki / f"{name}.crt"), "-extfile", str(ext))
    openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048",
            "-out", str(pki / "sa.key"))
    openssl("pkey", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))


def kubeconfig(path: Path, server: str, pki: Path, user: str) -> None:
    """A kubeconfig as JSON (valid YAML), certificates by path."""
    config = {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "local", "cluster": {
            "server": server, "certificate-authority": str(pki / "ca.crt")}}],
        "users": [{"name": user, "user": {
            "client-certificate": str(pki / f"{user}.crt"),
            "client-key": str(pki / f"{user}.key")}}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": user}}],
        "current-context": "local",
    }
    path.write_text(json.dumps(config, indent=2) + "\n")
    path.chmod(0o600)


# --- readiness ------------------------------------------------------------------------

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
    return lambda: https_get(port, "/healthz"), "healthy"


# --- the components' flags ------------------------------------------------------------

def processes(d: Path, bin_dir: Path, ports: dict[str, int], node_ip: str = "",
              host_root: Path | None = None) -> dict[str, Process]:
    procs = control_plane(d, bin_dir, ports, node_ip)
    if node_ip:
        if host_root:
            # The simulated host's udev (nodesim.udev), from the repo's .venv.
            python = os.path.realpath(REPO / ".venv" / "bin" / "python")
            procs["udev"] = Process("udev", [python, "-m", "nodesim.udev", str(host_root)],
                                    str(d / "logs" / "udev.log"))
        procs.update(localnode.node_processes(d, bin_dir, ports, node_ip, host_root, Process))
    return procs


def control_plane(d: Path, bin_dir: Path, ports: dict[str, int], node_ip: str) -> dict[str, Process]:
    pki, logs = d / "pki", d / "logs"
    etcd_url = f"http://127.0.0.1:{ports['etcd']}"
    if node_ip:
        # Pods reach the API server through the `kubernetes` Service, whose endpoint is
        # the advertised address (kept by the API server's lease reconciler).
        listen = ["--bind-address", "0.0.0.0", "--advertise-address", node_ip]
    else:
        listen = ["--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1",
                  # The `kubernetes` Service's Endpoints may not hold a loopback address
                  # (the API server refuses its own write every 10 s): keep none.
                  "--endpoint-reconciler-type", "none"]

    def controller(name: str, kubeconfig: str) -> list[str]:
        """The controller manager and the scheduler: one kubeconfig for the API and for
        checking their own callers, serving on loopback only."""
        config = str(pki / kubeconfig)
        return [str(bin_dir / name), "--kubeconfig", config,
                "--authentication-kubeconfig", config, "--authorization-kubeconfig", config,
                "--bind-address", "127.0.0.1", "--secure-port", str(ports[name])]

    return {
        "etcd": Process("etcd", [
            str(bin_dir / "etcd"), "--name", "local", "--data-dir", str(d / "etcd"),
            "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{ports['etcd-peer']}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{ports['etcd-peer']}",
            "--initial-cluster", f"local=http://127.0.0.1:{ports['etcd-peer']}",
            # A throwaway cluster: losing the last writes on a power cut is fine, and
            # fsync per write makes every API write ~10x slower on this disk.
            "--unsafe-no-fsync", "--log-level", "warn",
        ], str(logs / "etcd.log"), port=ports["etcd"]),
        "kube-apiserver": Process("kube-apiserver", [
            str(bin_dir / "kube-apiserver"),
            "--etcd-servers", etcd_url,
            *listen,
            "--secure-port", str(ports["kube-apiserver"]),
            "--tls-cert-file", str(pki / "apiserver.crt"),
            "--tls-private-key-file", str(pki / "apiserver.key"),
            "--client-ca-file", str(pki / "ca.crt"),
            "--kubelet-client-certificate", str(pki / "apiserver-kubelet-client.crt"),
            "--kubelet-client-key", str(pki / "apiserver-kubelet-client.key"),
            "--service-account-issuer", ISSUER,
            "--service-account-key-file", str(pki / "sa.pub"),
            "--service-account-signing-key-file", str(pki / "sa.key"),
            "--service-cluster-ip-range", SERVICE_CIDR,
            "--authorization-mode", "Node,RBAC",
            # Logs, exec and port-forward reach the kubelet at the node's address (the
            # node's name is in no DNS here).
            "--kubelet-preferred-address-types", "InternalIP,Hostname",
            # The default admission plugins (ServiceAccount, RuntimeClass, PodSecurity,
            # MutatingAdmissionWebhook, ValidatingAdmissionPolicy, ValidatingAdmissionWebhook,
            # ...) stay on; NodeRestriction is what a production cluster adds.
            "--enable-admission-plugins", "NodeRestriction",
            "--allow-privileged=true",
            "--profiling=false",
        ], str(logs / "kube-apiserver.log"), port=ports["kube-apiserver"]),
        "kube-controller-manager": Process("kube-controller-manager", [
            *controller("kube-controller-manager", "controller-manager.kubeconfig"),
            "--service-account-private-key-file", str(pki / "sa.key"),
            "--root-ca-file", str(pki / "ca.crt"),
            "--cluster-signing-cert-file", str(pki / "ca.crt"),
            "--cluster-signing-key-file", str(pki / "ca.key"),
            "--service-cluster-ip-range", SERVICE_CIDR,
            "--use-service-account-credentials=true",
            "--leader-elect=false",
            "--profiling=false",
        ], str(logs / "kube-controller-manager.log"), port=ports["kube-controller-manager"]),
        "kube-scheduler": Process("kube-scheduler", [
            *controller("kube-scheduler", "scheduler.kubeconfig"),
            "--leader-elect=false",
            "--profiling=false",
        ], str(logs / "kube-scheduler.log"), port=ports["kube-scheduler"]),
    }


# --- commands -------------------------------------------------------------------------

def build(node: bool) -> tuple[Path, str]:
    args = ["--node"] if node else ["etcd", "kube-apiserver", "kube-controller-manager",
                                     "kube-scheduler", "kubectl"]
    result = subprocess.run([str(BUILD), *args], stdout=subprocess.PIPE, text=True)
    if result.returncode:
        raise Refused(f"hack/kube/build failed (exit {result.returncode}); see above")
    bin_dir = Path(result.stdout.strip().splitlines()[-1])
    version = bin_dir.parent.name.split("-")[0]
    return bin_dir, version


def images() -> list[Path]:
    """The chart's image and the pause image, built (or found cached) by hack/image/build."""
    result = subprocess.run([str(IMAGE_BUILD)], stdout=subprocess.PIPE, text=True)
    if result.returncode:
        raise Refused(f"hack/image/build failed (exit {result.returncode}); see above")
    return [Path(line.split()[1]) for line in result.stdout.splitlines() if line.strip()]


def simulate_host(d: Path, profile: str) -> Path:
    """The node's simulated host: PROFILE's sysfs with /dev/vfio nodes a real runtime can
    inject, plus what the chart's agent works on there (containerd's config, the Kata
    artifacts as an OCI layout, as tests/controlplane's agent node has them)."""
    root = d / "host"
    katamgr = REPO / ".venv" / "bin" / "katamgr"
    result = subprocess.run([str(katamgr), "simulate", profile, "--into", str(root),
                             "--real-device-nodes"], capture_output=True, text=True)
    if result.returncode:
        raise Refused(f"katamgr simulate {profile} failed: {result.stderr.strip()}")
    (root / "etc/containerd").mkdir(parents=True, exist_ok=True)
    config = REPO / "katamgr/data/demo/containerd-config.toml"
    (root / "etc/containerd/config.toml").write_bytes(config.read_bytes())
    # Dirs a node has that the chart mounts (type Directory): the modules vfio-pci would
    # be loaded from, containerd's socket dir (the agent's restart is off on this node).
    for path in ("lib/modules", "run/containerd"):
        (root / path).mkdir(parents=True, exist_ok=True)
    localnode.link_device_plugins(root)
    layout = root / "opt/kata-artifacts/layout"
    shutil.copytree(REPO / "katamgr/data/oci-layout", layout, symlinks=True)
    return root


def up(d: Path, node: bool = False, host: str = "dgx-h100") -> State:
    if (d / "state.json").exists():
        old = State.load(d)
        running = [p.name for p in old.processes.values() if alive(p)]
        if running:
            raise Refused(f"{d} already runs {', '.join(running)}; "
                          f"stop it first with: hack/local-cluster down {d}")
    node_ip, host_root, archives, made = "", None, [], ""
    if node:
        missing = localnode.prerequisites()
        if missing:
            raise Refused("a node needs: " + ", ".join(missing))
        node_ip = localnode.node_ip()
        try:
            localnode.claim(d, cluster_running)
        except RuntimeError as e:
            raise Refused(str(e)) from None
    try:
        bin_dir, version = build(node)
        if node:
            archives = images()
    except BaseException:
        localnode.release(d)
        raise
    started = time.monotonic()
    d.mkdir(parents=True, exist_ok=True)
    (d / "logs").mkdir(exist_ok=True)
    if node:
        made = localnode.make_device_plugins()
    if node and host != "none":
        host_root = simulate_host(d, host)
    pki = d / "pki"
    make_pki(pki, node_ip)
    names = ["etcd", "etcd-peer", *COMPONENTS[1:]]
    if node:
        names += ["kubelet", "kubelet-healthz", "kube-proxy", "kube-proxy-metrics"]
    ports = {name: free_port() for name in names}
    state = State(dir=str(d), bin=str(bin_dir), kube_version=version, ports=ports,
                  processes=processes(d, bin_dir, ports, node_ip, host_root),
                  node_ip=node_ip, host_root=str(host_root or ""), made=made)
    server = f"https://127.0.0.1:{ports['kube-apiserver']}"
    kubeconfig(d / "kubeconfig", server, pki, "admin")
    users = ["controller-manager", "scheduler"] + (["kubelet", "kube-proxy"] if node else [])
    for user in users:
        kubeconfig(pki / f"{user}.kubeconfig", server, pki, user)
    if node:
        localnode.write_configs(d, host_root, ports, node_ip)
    try:
        for name in state.components:
            start_component(state, name)
            if name == "containerd":
                held = localnode.import_images(bin_dir, d, archives)
                print(f"containerd holds: {' '.join(held)}")
            if name == "kubelet":
                wait_node_ready(state)
    except BaseException:
        stop_all(state)
        localnode.release(d)
        raise
    (d / "env").write_text(f"export KUBECONFIG={d / 'kubeconfig'}\n"
                           f"export PATH={bin_dir}:$PATH\n")
    print(f"local cluster {version} up in {time.monotonic() - started:.1f} s: "
          f"API server {server}")
    if node:
        print(f"  node:     {localnode.NODE_NAME} ({node_ip}), Ready; "
              f"host root {host_root or '/ (none simulated)'}")
    print("  use it:   . " + str(d / "env") + "   (KUBECONFIG and kubectl on PATH)")
    print("  check:    kubectl get --raw /readyz")
    print(f"  logs:     {d / 'logs'}/")
    print(f"  stop it:  hack/local-cluster down {d}")
    return state


def cluster_running(d: Path) -> bool:
    try:
        return any(alive(p) for p in State.load(d).processes.values())
    except Refused:
        return False


def start_component(state: State, name: str) -> None:
    proc = state.processes[name]
    env = localnode.containerd_env(Path(state.bin)) if name == "containerd" else None
    start(proc, env)
    state.save()  # every pid recorded before the next wait, so `down` finds it
    check, what = readiness(state, name)
    wait_ready(proc, check, what)


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


def stop_all(state: State) -> list[str]:
    """Node first (its containers killed while containerd still answers), then the
    control plane; then what the node left on the host."""
    stopped = []
    bin_dir, d = Path(state.bin), Path(state.dir)
    for name in reversed(state.components):
        proc = state.processes.get(name)
        if name == "containerd" and proc and alive(proc):
            killed = localnode.kill_containers(bin_dir, d)
            if killed:
                stopped.append(f"{killed} containers")
        if proc and stop(proc):
            stopped.append(f"{name} (pid {proc.pid})")
    state.save()
    if state.node_ip:
        stopped += localnode.clean_up(d, bin_dir, state.made)
    return stopped


def down(d: Path) -> None:
    state = State.load(d)
    stopped = stop_all(state)
    if state.node_ip:
        localnode.release(d)
    print("stopped " + (", ".join(stopped) if stopped else "nothing: no process of it ran"))
    (d / "state.json").rename(d / "state.down.json")


def component(d: Path, name: str, *, stopping: bool, starting: bool) -> None:
    """Stop and/or start one component with the flags `up` gave it."""
    state = State.load(d)
    proc = state.processes.get(name)
    if proc is None:
        raise Refused(f"unknown component {name!r}; one of: {', '.join(state.components)}")
    if stopping:
        old = proc.pid
        print(f"stopped {name} (pid {old})" if stop(proc) else f"{name} was not running")
    if starting:
        if alive(proc):
            raise Refused(f"{name} already runs (pid {proc.pid})")
        start_component(state, name)
        print(f"started {name} (pid {proc.pid})")


def status(d: Path) -> int:
    state = State.load(d)
    down_ = 0
    for name in state.components:
        proc = state.processes[name]
        up_ = alive(proc)
        down_ += not up_
        where = f"127.0.0.1:{proc.port}" if proc.port else ""
        print(f"{name:24} {'running' if up_ else 'stopped':8} pid {proc.pid:<7} {where}")
    return 1 if down_ else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hack/local-cluster", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in ("up", "down", "status"):
        p = sub.add_parser(command)
        p.add_argument("dir", type=Path)
        if command == "up":
            p.add_argument("--node", action="store_true",
                           help="also containerd, a kubelet and kube-proxy on this machine")
            p.add_argument("--host", default="dgx-h100", metavar="PROFILE",
                           help="the node's simulated host (a katamgr profile; default "
                                "dgx-h100; `none` for this machine's own /)")
    for command in ("stop", "start", "restart"):
        p = sub.add_parser(command)
        p.add_argument("dir", type=Path)
        p.add_argument("component", choices=COMPONENTS + ("udev",) + localnode.NODE_COMPONENTS)
    args = parser.parse_args(argv)
    d = args.dir.resolve()
    try:
        if args.command == "up":
            up(d, node=args.node, host=args.host)
        elif args.command == "down":
            down(d)
        elif args.command in ("stop", "start", "restart"):
            component(d, args.component, stopping=args.command != "start",
                      starting=args.command != "stop")
        else:
            return status(d)
    except Refused as e:
        print(f"hack/local-cluster: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"hack/local-cluster: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
