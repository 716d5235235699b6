"""The flags of a local cluster's components: the control plane's, and the node's
(localnode.py) with the simulated host's udev. Part of hack/local-cluster."""

from __future__ import annotations

import os
from pathlib import Path

import localnode
from clusterstate import ISSUER, SERVICE_CIDR, Process

REPO = Path(__file__).resolve().parent.parent


def processes(d: Path, bin_dir: Path, ports: dict[str, int], node_ip: str = "",
              host_root: Path | None = None) -> dict[str, Process]:
    procs = control_plane(d, bin_dir, ports, node_ip)
    if node_ip:
        if host_root:
            # The simulated host's udev (nodesim.udev), from the repo's .venv.
            python = os.path.realpath(REPO / ".venv" / "bin" / "python")
            procs["udev"] = Process("udev", [python, "-m", "nodesim.udev", str(host_root)],
                                    str(d / "logs" / "udev.log"))
            # Its Fabric Manager's socket (nodesim.fabricmanager.daemon), which a pod given FM's
            # directory read-only (the chart's mount) reaches as it would reach FM's.
            procs["fabricmanager"] = Process(
                "fabricmanager", [python, "-m", "nodesim.fabricmanager.daemon", str(host_root)],
                str(d / "logs" / "fabricmanager.log"))
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
