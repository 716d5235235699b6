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
    hack/local-cluster reboot DIR    the node powered off and on, the control plane left up:
                                     every node process and container killed (no SIGTERM:
                                     the kubelet's graceful node shutdown is off by default),
                                     the simulated host as it boots (nodesim.reboot), then
                                     the node's processes started again
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
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# Beside this script, not a package: localnode (the node) and nodeconfig (its files),
# clusterstate (the processes and their record), clusterpki, clusterflags, clusterready.
import localnode  # noqa: E402
import nodeconfig  # noqa: E402
from clusterflags import processes  # noqa: E402
from clusterpki import kubeconfig, make_pki  # noqa: E402
from clusterready import readiness, wait_node_ready, wait_ready  # noqa: E402
from clusterstate import COMPONENTS, HOST_COMPONENTS, Refused, State, alive, free_port, start, stop  # noqa: E402

REPO = HERE.parent
IMAGE_BUILD = HERE / "image" / "build"
BUILD = HERE / "kube" / "build"


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
        nodeconfig.write_configs(d, host_root, ports, node_ip)
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
    env = localnode.containerd_env(Path(state.bin), Path(state.dir)) if name == "containerd" else None
    start(proc, env)
    state.save()  # every pid recorded before the next wait, so `down` finds it
    check, what = readiness(state, name)
    wait_ready(proc, check, what)


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


def reboot(d: Path) -> None:
    """A power cycle of the node: what it kills, what its host loses, then the node's
    processes started in `up`'s order. The control plane runs on as another machine's would."""
    state = State.load(d)
    if not state.node_ip:
        raise Refused(f"{d} has no node to reboot (`hack/local-cluster up DIR --node` makes one)")
    bin_dir = Path(state.bin)
    node = [name for name in state.components if name not in COMPONENTS]
    # The power cut: the kubelet, kube-proxy and every container's processes frozen, then
    # killed, so that none sees another go first (an agent that saw the kubelet go would
    # take its labels off, which a power cut never lets it do).
    first = [name for name in ("kubelet", "kube-proxy") if alive(state.processes[name])]
    pids = [state.processes[name].pid for name in first] + localnode.pod_processes()
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass  # ended meanwhile
    for name in first:
        kill(state.processes[name])  # waits until it is gone
    killed = list(first)
    # What containerd still records of them, deleted while it answers; then the rest of the node.
    containers = localnode.kill_containers(bin_dir, d) if alive(state.processes["containerd"]) else 0
    killed += [name for name in node if name not in killed and kill(state.processes[name])]
    state.save()
    ended = localnode.end_leftovers(d)
    for target in localnode.mounts_under(d):  # the pods' tmpfs volumes do not survive a boot
        subprocess.run(["umount", "--lazy", target], capture_output=True, timeout=30)
    localnode.remove_pod_cgroups()
    print(f"powered off: killed {', '.join(killed)}, {containers} containers, "
          f"{len(ended)} processes containerd left")
    if state.host_root:
        booted = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-m", "nodesim.reboot", state.host_root],
                                capture_output=True, text=True, cwd=REPO, timeout=120)
        if booted.returncode:
            raise RuntimeError(f"the simulated host did not boot: {booted.stderr.strip()}")
        print("host booted: " + ("; ".join(booted.stdout.splitlines()) or "nothing changed"))
    for name in node:
        start_component(state, name)
        if name == "kubelet":
            wait_node_ready(state)
    print(f"powered on: started {', '.join(node)}")


def kill(proc) -> bool:
    """SIGKILL, as a power cut ends it; False if it was not running."""
    if not alive(proc):
        return False
    os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while alive(proc) and time.monotonic() < deadline:
        time.sleep(0.05)
    return True


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
    for command in ("up", "down", "status", "reboot"):
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
        p.add_argument("component", choices=COMPONENTS + HOST_COMPONENTS + localnode.NODE_COMPONENTS)
    args = parser.parse_args(argv)
    d = args.dir.resolve()
    try:
        if args.command == "up":
            up(d, node=args.node, host=args.host)
        elif args.command == "down":
            down(d)
        elif args.command == "reboot":
            reboot(d)
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
