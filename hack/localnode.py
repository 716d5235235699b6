"""The node half of hack/local-cluster (`up DIR --node`): containerd 2.x, a kubelet and
kube-proxy on this machine, registered with the local control plane as one node.

Imported by hack/localcluster.py (standard library only, like it). What it sets up, and why:

- containerd (built from hack/containerd/go.mod; Debian 12's 1.6 has no CDI) with its own
  root, state and socket under DIR/containerd, runc from Debian, CDI on and reading the
  node's spec dirs, and a runtime handler named after the Kata runtime class whose shim is
  runc's: no Kata guest can run here, so a "Kata" pod starts as a runc container while
  every Kubernetes-side step (RuntimeClass, scheduling, device plugin, CDI) is the real one.
  (tests/node's kata-deploy install puts kata-deploy's entries in their place for a while, whose
  shim is a stand-in on runc's: hack/containerd/kata-shim.)
- containerd keeps every pod's oom_score_adj at or above its own
  (`restrict_oom_score_adj`): these machines cannot lower one (no CAP_SYS_RESOURCE).
- CNI: the bridge plugin (Debian's containernetworking-plugins) on a bridge of its own with
  a /24 for pods; the bridge plugin turns on IPv4 forwarding as any bridge CNI does.
- the kubelet (cgroupfs driver, cgroup v1 allowed: these machines mount v1 and PID 1 is
  not systemd), its root dir inside the simulated host root when there is one, so that the
  chart's hostPaths (all below `hostPaths.rootFS`) reach its device-plugin, plugin registry
  and PodResources sockets.
- kube-proxy (iptables), so that pods reach the API server through the `kubernetes` Service
  and the API server reaches the webhook's Service, as on any node.

`down` kills every container of this containerd, stops the processes, then ends what
containerd started that outlives it: one `containerd-shim-runc-v2` per pod sandbox (each
shim double-forks away from containerd, so it is re-parented to PID 1 and keeps running
after containerd stops; it knows our containerd by its `-address`), and any process still
in the kubelet's `kubepods` cgroups; it removes kube-proxy's rules (`kube-proxy --cleanup`),
the bridge and every mount left under DIR.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

NODE_NAME = "local-node"
POD_CIDR = "10.244.0.0/24"
BRIDGE = "ksm-cni0"
KATA_HANDLERS = ("kata-qemu-nvidia-gpu", "kata-qemu-nvidia-gpu-snp", "kata-qemu-nvidia-gpu-tdx")
PAUSE_IMAGE = "registry.k8s.io/pause:3.10.1"  # containerd 2.2's default sandbox image
NODE_COMPONENTS = ("containerd", "kubelet", "kube-proxy")
CNI_BIN = Path("/usr/lib/cni")
RUNC = "/usr/sbin/runc"


def node_ip() -> str:
    """The address of the default route's interface: what the kubelet reports and the
    pods reach the API server at (no packet is sent by a UDP connect)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("198.51.100.1", 9))  # TEST-NET-2: routed by default, never sent
        except OSError as e:
            raise RuntimeError(f"no IPv4 route to pick a node address from ({e})") from None
        return s.getsockname()[0]


def prerequisites() -> list[str]:
    """What the node needs from Debian, named as packages; empty when all is there."""
    missing = []
    if not Path(RUNC).exists():
        missing.append("runc")
    if not (CNI_BIN / "bridge").exists():
        missing.append("containernetworking-plugins")
    for tool, package in (("iptables", "iptables"), ("conntrack", "conntrack")):
        if not any((Path(p) / tool).exists() for p in ("/usr/sbin", "/sbin", "/usr/bin")):
            missing.append(package)
    if os.geteuid() != 0:
        missing.append("root (the kubelet and containerd manage cgroups, mounts and networks)")
    busy = device_plugins_in_use()
    if busy:
        missing.append(f"no other kubelet: {busy}")
    return missing


# The kubelet's device-plugin socket dir is a constant, whatever --root-dir says
# (k8s.io/kubelet pkg/apis/deviceplugin/v1beta1/constants.go KubeletSocket, used as is by
# pkg/kubelet/cm/devicemanager/manager.go).
DEVICE_PLUGINS = Path("/var/lib/kubelet/device-plugins")


def make_device_plugins() -> str:
    """The kubelet's device-plugins dir on the machine; returns the top dir made for it
    ("" when it was there), for `down` to remove."""
    made = next((str(p) for p in (*reversed(DEVICE_PLUGINS.parents), DEVICE_PLUGINS)
                 if not p.exists()), "")
    DEVICE_PLUGINS.mkdir(parents=True, exist_ok=True)
    return made


def link_device_plugins(host_root: Path) -> None:
    """The simulated host's device-plugins dir is the kubelet's real one, so the chart's
    hostPath (below hostPaths.rootFS) reaches the sockets the kubelet uses."""
    link = host_root / "var/lib/kubelet/device-plugins"
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.is_symlink():
        link.symlink_to(DEVICE_PLUGINS)


# One local node per machine (the device-plugin dir and the kubelet's pod cgroups are
# machine-wide: a second kubelet would remove the first one's pods). The dir of the
# cluster holding the machine is written here from `up` until `down`.
CLAIM = Path("/run/kata-sandbox-manager-local-node")


def claim(d: Path, still_running) -> None:
    """Take the machine for the node of ``d``; refuse while another cluster's node runs
    (``still_running(dir)`` says whether that cluster has a live process)."""
    try:
        other = Path(CLAIM.read_text().strip())
    except FileNotFoundError:
        other = None
    if other is not None and other != d and still_running(other):
        raise RuntimeError(f"the local node of {other} runs on this machine (one node per "
                           f"machine); stop it first: hack/local-cluster down {other}")
    tmp = CLAIM.with_suffix(".tmp")
    tmp.write_text(f"{d}\n")
    os.replace(tmp, CLAIM)


def release(d: Path) -> None:
    try:
        if Path(CLAIM.read_text().strip()) == d:
            CLAIM.unlink()
    except FileNotFoundError:
        pass


def device_plugins_in_use() -> str | None:
    """Another kubelet's socket in the shared device-plugins dir, if one answers."""
    sock = DEVICE_PLUGINS / "kubelet.sock"
    if not sock.exists():
        return None
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(sock))
        except OSError:
            return None
    return f"a kubelet already serves {sock} (one node per machine: its device-plugin dir is fixed)"


def kubelet_root(d: Path, host_root: Path | None) -> Path:
    return (host_root / "var/lib/kubelet") if host_root else d / "kubelet"


def node_processes(d: Path, bin_dir: Path, ports: dict[str, int], ip: str,
                   host_root: Path | None, process_type) -> dict:
    pki, logs = d / "pki", d / "logs"
    root = kubelet_root(d, host_root)
    return {
        "containerd": process_type("containerd", [
            str(bin_dir / "containerd"), "--config", str(d / "containerd/config.toml"),
        ], str(logs / "containerd.log")),
        "kubelet": process_type("kubelet", [
            str(bin_dir / "kubelet"),
            "--config", str(d / "kubelet-config.json"),
            "--kubeconfig", str(pki / "kubelet.kubeconfig"),
            "--root-dir", str(root),
            "--cert-dir", str(d / "kubelet-pki"),
            "--hostname-override", NODE_NAME,
            "--node-ip", ip,
            "--v", "2",
        ], str(logs / "kubelet.log"), port=ports["kubelet-healthz"]),
        "kube-proxy": process_type("kube-proxy", [
            str(bin_dir / "kube-proxy"),
            "--kubeconfig", str(pki / "kube-proxy.kubeconfig"),
            "--hostname-override", NODE_NAME,
            "--proxy-mode", "iptables",
            "--cluster-cidr", POD_CIDR,
            # Leave the host's conntrack table size alone.
            "--conntrack-max-per-core", "0",
            "--metrics-bind-address", f"127.0.0.1:{ports['kube-proxy-metrics']}",
            "--healthz-bind-address", f"127.0.0.1:{ports['kube-proxy']}",
        ], str(logs / "kube-proxy.log"), port=ports["kube-proxy"]),
    }


def containerd_env(bin_dir: Path, d: Path) -> dict[str, str]:
    """containerd finds its shim (ours, 2.x) on PATH before Debian's. The stand-in for Kata's
    shim (hack/containerd/kata-shim, where the node suite installs Kata as kata-deploy does)
    inherits this environment and keeps its runc state where the other handlers' is."""
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/sbin:/usr/bin')}",
            "KSM_STANDIN_RUNC_ROOT": str(d / "containerd/runc")}


def ctr(bin_dir: Path, d: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(bin_dir / "ctr"), "--address", str(d / "containerd/containerd.sock"),
         "--namespace", "k8s.io", *args], capture_output=True, text=True, timeout=timeout)


def containerd_ready(bin_dir: Path, d: Path) -> tuple[bool, str]:
    if not (d / "containerd/containerd.sock").exists():
        return False, "no socket yet"
    result = ctr(bin_dir, d, "version", timeout=10)
    return result.returncode == 0, (result.stderr or result.stdout).strip()[:200]


def import_images(bin_dir: Path, d: Path, images: list[Path]) -> list[str]:
    """`ctr images import` each OCI archive; returns the names containerd now holds."""
    for archive in images:
        result = ctr(bin_dir, d, "images", "import", "--no-unpack", str(archive), timeout=300)
        if result.returncode:
            raise RuntimeError(f"ctr images import {archive} failed: {result.stderr.strip()}")
    listed = ctr(bin_dir, d, "images", "ls", "-q")
    return listed.stdout.split()


def clean_up(d: Path, bin_dir: Path, made: str = "") -> list[str]:
    """After the processes stopped: what they leave on the host (``made``: the dir `up`
    made for the kubelet's device plugins). Returns what was done."""
    done = []
    if made and Path(made).is_dir() and Path(made) in (DEVICE_PLUGINS, *DEVICE_PLUGINS.parents):
        shutil.rmtree(made, ignore_errors=True)
        done.append(f"{made} removed")
    proxy = bin_dir / "kube-proxy"
    if proxy.exists():
        r = subprocess.run([str(proxy), "--cleanup"], capture_output=True, text=True, timeout=60)
        if r.returncode == 0:
            done.append("kube-proxy's iptables rules removed")
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True, timeout=30)
        done.append(f"bridge {BRIDGE} removed")
    ended = end_leftovers(d)
    if ended:
        done.append(f"{len(ended)} processes containerd left ended ({', '.join(ended)})")
    mounts = mounts_under(d)
    for target in mounts:
        subprocess.run(["umount", "--lazy", target], capture_output=True, timeout=30)
    if mounts:
        done.append(f"{len(mounts)} mounts under {d} unmounted")
    removed = remove_pod_cgroups()
    if removed:
        done.append(f"{removed} kubepods cgroups removed")
    return done


def mounts_under(d: Path) -> list[str]:
    """Mount points below ``d``, deepest first."""
    prefix = str(d).rstrip("/") + "/"
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        target = line.split()[4].replace("\\040", " ")
        if target.startswith(prefix):
            found.append(target)
    return sorted(set(found), key=lambda t: t.count("/"), reverse=True)


def remove_pod_cgroups() -> int:
    """The kubelet's kubepods cgroups (empty once every container is gone), deepest first."""
    removed = 0
    for controller in Path("/sys/fs/cgroup").glob("*/kubepods"):
        dirs = sorted((p for p in controller.rglob("*") if p.is_dir()),
                      key=lambda p: len(p.parts), reverse=True)
        for path in [*dirs, controller]:
            try:
                path.rmdir()
                removed += 1
            except OSError:
                pass
    return removed


def kill_containers(bin_dir: Path, d: Path) -> int:
    """Every task of our containerd, killed and deleted (pods would outlive the kubelet)."""
    listed = ctr(bin_dir, d, "tasks", "ls", "-q", timeout=30)
    if listed.returncode:
        return 0
    tasks = listed.stdout.split()
    for task in tasks:
        ctr(bin_dir, d, "tasks", "kill", "--signal", "SIGKILL", task, timeout=30)
    deadline = time.monotonic() + 20
    for task in tasks:
        while time.monotonic() < deadline:
            if ctr(bin_dir, d, "tasks", "delete", task, timeout=30).returncode == 0:
                break
            time.sleep(0.2)
    return len(tasks)


def leftovers(d: Path) -> dict[int, str]:
    """Processes containerd started for this node that still run once it stopped: its
    shims (``-address`` names our socket) and whatever is still in a ``kubepods`` cgroup
    (the containers). pid -> what it is."""
    socket_path = str(d / "containerd/containerd.sock")
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            cgroups = (entry / "cgroup").read_text()
        except OSError:
            continue  # gone
        args = [a.decode(errors="replace") for a in argv if a]
        if "-address" in args[:-1] and args[args.index("-address") + 1] == socket_path:
            found[int(entry.name)] = f"{Path(args[0]).name} {_flag(args, '-id')[:12]}".strip()
        elif "/kubepods" in cgroups:
            found[int(entry.name)] = Path(args[0]).name if args else "?"
    return found


def pod_processes() -> list[int]:
    """The processes in a ``kubepods`` cgroup: the pods' containers."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and "/kubepods" in (entry / "cgroup").read_text():
                found.append(int(entry.name))
        except OSError:
            continue  # gone
    return found


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1] if name in args[:-1] else ""


def end_leftovers(d: Path, timeout: float = 10.0) -> list[str]:
    """SIGTERM each leftover, SIGKILL what is left after ``timeout``; what was ended."""
    first = leftovers(d)
    for pid in first:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and set(leftovers(d)) & set(first):
        time.sleep(0.1)
    for pid in set(leftovers(d)):
        _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and leftovers(d):
        time.sleep(0.1)
    return [f"{what} (pid {pid})" for pid, what in sorted(first.items())]


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
