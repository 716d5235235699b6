"""The local node's configuration files: containerd's (runc as the Kata handlers' shim,
CDI on), the bridge CNI's, the kubelet's. Part of hack/local-cluster's node half
(localnode.py says why each is so)."""

from __future__ import annotations

import json
from pathlib import Path

from localnode import BRIDGE, CNI_BIN, KATA_HANDLERS, PAUSE_IMAGE, POD_CIDR, RUNC


def cdi_dirs(host_root: Path | None) -> list[str]:
    base = host_root if host_root else Path("/")
    return [str(base / "etc/cdi"), str(base / "var/run/cdi")]


def write_configs(d: Path, host_root: Path | None, ports: dict[str, int], ip: str) -> None:
    (d / "containerd").mkdir(parents=True, exist_ok=True)
    (d / "cni/net.d").mkdir(parents=True, exist_ok=True)
    (d / "containerd/config.toml").write_text(containerd_config(d, host_root))
    (d / "cni/net.d/10-local.conflist").write_text(json.dumps(cni_config(d), indent=2) + "\n")
    (d / "kubelet-config.json").write_text(
        json.dumps(kubelet_config(d, ports, ip), indent=2) + "\n")


def containerd_config(d: Path, host_root: Path | None) -> str:
    c = d / "containerd"
    runtimes = []
    for name in ("runc", *KATA_HANDLERS):
        table = f'plugins."io.containerd.cri.v1.runtime".containerd.runtimes.{json.dumps(name)}'
        runtimes.append(f"""
[{table}]
  runtime_type = "io.containerd.runc.v2"
[{table}.options]
  BinaryName = "{RUNC}"
  Root = "{c / 'runc'}"
  SystemdCgroup = false
""")
    cdi = ", ".join(json.dumps(p) for p in cdi_dirs(host_root))
    return f"""# Written by hack/local-cluster up --node; containerd 2.x (config version 3).
version = 3
root = "{c / 'root'}"
state = "{c / 'state'}"

[grpc]
  address = "{c / 'containerd.sock'}"

[ttrpc]
  address = "{c / 'containerd.sock.ttrpc'}"

[debug]
  # debug: containerd logs the CDI names the kubelet hands it (tests/node reads them).
  level = "debug"

[plugins."io.containerd.cri.v1.runtime"]
  enable_cdi = true
  cdi_spec_dirs = [{cdi}]
  # Network namespaces under our state dir, so that `down` finds every mount under DIR.
  netns_mounts_under_state_dir = true
  # These machines' capability bounding set lacks CAP_SYS_RESOURCE, so no process may
  # lower an oom_score_adj: runc fails every pod sandbox the kubelet asks for at -998
  # ("failed to update /proc/self/oom_score_adj: Permission denied"). containerd then
  # raises each score to its own instead.
  restrict_oom_score_adj = true

[plugins."io.containerd.cri.v1.runtime".containerd]
  default_runtime_name = "runc"

[plugins."io.containerd.cri.v1.runtime".cni]
  bin_dirs = ["{CNI_BIN}"]
  conf_dir = "{d / 'cni/net.d'}"
  max_conf_num = 1
{''.join(runtimes)}
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"

[plugins."io.containerd.cri.v1.images".pinned_images]
  sandbox = "{PAUSE_IMAGE}"

[plugins."io.containerd.grpc.v1.cri"]
  disable_tcp_service = true
"""


def cni_config(d: Path) -> dict:
    return {
        "cniVersion": "1.0.0",
        "name": "local-cluster",
        "plugins": [
            {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False,
             "hairpinMode": True,
             "ipam": {"type": "host-local", "dataDir": str(d / "cni/ipam"),
                      "ranges": [[{"subnet": POD_CIDR}]],
                      "routes": [{"dst": "0.0.0.0/0"}]}},
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def kubelet_config(d: Path, ports: dict[str, int], ip: str) -> dict:
    pki = d / "pki"
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": ip,
        "port": ports["kubelet"],
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": ports["kubelet-healthz"],
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(pki / "ca.crt")},
        },
        "authorization": {"mode": "Webhook"},
        "containerRuntimeEndpoint": f"unix://{d / 'containerd/containerd.sock'}",
        # These machines: cgroup v1, PID 1 not systemd. 1.35 refuses v1 unless told.
        "cgroupDriver": "cgroupfs",
        "failCgroupV1": False,
        "failSwapOn": False,
        "clusterDomain": "cluster.local",
        "resolvConf": "/etc/resolv.conf",
        "podCIDR": POD_CIDR,
        # A shared CI disk: never evict the test's pods for a full-ish disk.
        "evictionHard": {"memory.available": "50Mi", "nodefs.available": "1%",
                         "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "shutdownGracePeriod": "0s",
        "containerLogMaxSize": "10Mi",
        # Not the machine's /var/log/pods.
        "podLogsDirectory": str(d / "pod-logs"),
        "nodeStatusReportFrequency": "10s",
    }
