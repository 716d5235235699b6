"""The value sets the chart tests render: every one of VALUE_SETS must give valid objects
and a clean lint (test_chart_objects.py); other tests pick the sets they need."""

from __future__ import annotations

from typing import Any

import yaml
from support.chartkit import FULL, SANDBOX, merged
from support.paths import EXAMPLES, TEST_DATA

CUSTOM_CLASSES = merged(FULL, {
    "kataManager": {"config": {
        "artifactsDir": "/var/lib/kata-artifacts",
        "runtimeClasses": [
            {"name": "kata-gpu", "artifacts": {"url": "registry.local/kata:1", "pullSecret": "mirror"}},
            {"name": "kata-gpu-cc", "nodeSelector": {"nvidia.com/cc.capable": "true"},
             "artifacts": {"url": "registry.local/kata:1-snp", "pullSecret": "mirror"}},
            {"name": "kata-gpu-test", "artifacts": {"url": "registry.local/kata:test", "pullSecret": "lab"}},
        ],
        "runtimeClassOverhead": {"podFixed": {"memory": "160Mi", "cpu": "250m"}},
        "insecureRegistries": ["registry.local:5000"],
    }, "imagePullSecrets": ["ghcr-creds"]},
})

# The air-gapped config shape: artifacts from OCI image layouts copied onto the nodes.
AIR_GAPPED_CONFIG = yaml.safe_load((EXAMPLES / "configs" / "air-gapped.yaml").read_text())
AIR_GAPPED = merged(FULL, {"kataManager": {"config": {
    "artifactsDir": AIR_GAPPED_CONFIG["artifactsDir"],
    "runtimeClasses": AIR_GAPPED_CONFIG["runtimeClasses"],
}}})

TOLERATIONS = [
    {"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"},
    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
]

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "sandbox": SANDBOX,
    "sandbox-kata-cdi": FULL,
    "kata-off": merged(FULL, {"kataManager": {"enabled": False}}),
    "vfio-off": merged(FULL, {"vfioManager": {"enabled": False}}),
    "custom-classes": CUSTOM_CLASSES,
    # k0s's kubelet root: every mount of the kubelet's dirs but the device plugins' moves.
    "k0s-kubelet": merged(FULL, {"hostPaths": {"kubeletRootDir": "/var/lib/k0s/kubelet"}}),
    "tolerations-rootfs-vm-default": merged(FULL, {
        "sandboxWorkloads": {"defaultWorkload": "vm-passthrough"},
        "daemonsets": {"tolerations": TOLERATIONS, "updateStrategy": "OnDelete"},
        "hostPaths": {"rootFS": "/node/"},
    }),
    "alias-no-restart": merged(FULL, {
        "sandboxDevicePlugin": {"alias": "pgpu"},
        "containerd": {"restartMode": "none"},
        "devicePlugin": {"runtimeClassName": "nvidia"},
    }),
    "vfio-off-no-restart": merged(FULL, {"vfioManager": {"enabled": False},
                                         "containerd": {"restartMode": "none"}}),
    "plugin-only-annotated": merged(SANDBOX, {"vfioManager": {"enabled": False},
                                              "cdi": {"enabled": False},
                                              "daemonsets": {"annotations": {"team": "gpu"},
                                                             "labels": {"tier": "node"}}}),
    "agent-only": merged(FULL, {"sandboxDevicePlugin": {"enabled": False},
                                "devicePlugin": {"enabled": False}}),
    "sandbox-nothing-enabled": merged(SANDBOX, {"vfioManager": {"enabled": False},
                                                "cdi": {"enabled": False},
                                                "sandboxDevicePlugin": {"enabled": False}}),
    "air-gapped": merged(AIR_GAPPED, {"kataManager": {"ociLayoutDirs": ["/srv/kata-layouts"]}}),
    "example-mixed-cluster": yaml.safe_load((EXAMPLES / "values" / "mixed-cluster.yaml").read_text()),
    "example-air-gapped": yaml.safe_load((EXAMPLES / "values" / "air-gapped.yaml").read_text()),
    "example-gpu-operator": yaml.safe_load((EXAMPLES / "values" / "gpu-operator.yaml").read_text()),
    # The GPU Operator's own values file, unchanged, with its sandbox workloads turned on.
    "gpu-operator-v26.7.0": merged(yaml.safe_load((TEST_DATA / "gpu-operator" / "values-v26.7.0.yaml").read_text()),
                                   {"sandboxWorkloads": {"enabled": True, "mode": "kata"}}),
    # What the GPU Operator's users switch on: CDI comes from its default.
    "sandbox-kata-default-cdi": {"sandboxWorkloads": {"enabled": True}, "kataManager": {"enabled": True}},
}

# The options the three node programs share (gpunode.services.options), as the chart renders
# them for its default values (ksm.nodeArgs): each value passed as values.yaml writes it.
NODE_ARGS = ["--host-root", "/host", "--runtime-root", "/", "--kubelet-dir", "/var/lib/kubelet",
             "--node-name", "$(NODE_NAME)",
             "--default-workload", "container", "--log-format", "text", "--resource-naming", "nvidia",
             "--nvswitches", "auto", "--kata-version", "", "--nvlink-fabric", "auto",
             "--fabric-manager-address", "127.0.0.1:6666", "--fabric-manager-library", "libnvfm.so.1",
             "--gpu-module-ids", "", "--link-policy", "degrade"]
