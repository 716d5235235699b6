"""What the config tests share: bad configs, each with the fragment its one problem
message must contain (test_config checks the agent's messages, test_config_schema that
the chart's schema refuses the same)."""

from __future__ import annotations

from katamgr.config import DEFAULT_GPU_ARTIFACTS


def one_class(**fields) -> dict:
    entry = {"name": "kata-qemu-nvidia-gpu", "artifacts": {"url": DEFAULT_GPU_ARTIFACTS}}
    entry.update(fields)
    return {"runtimeClasses": [entry]}


# Each bad config and a fragment its single problem message must contain.
BAD_CASES = [
    (one_class(name=""), 'runtimeClasses[0].name is missing'),
    ({"runtimeClasses": [{"artifacts": {"url": DEFAULT_GPU_ARTIFACTS}}]},
     "runtimeClasses[0].name is missing"),
    (one_class(name="Kata_GPU"),
     'runtimeClasses[0].name "Kata_GPU" is not a DNS-1123 label '
     "(lowercase letters, digits, '-', at most 63)"),
    (one_class(name="k" * 64), "is not a DNS-1123 label"),
    (one_class(name=7), "runtimeClasses[0].name is a number; it must be a string"),
    (one_class(artifacts=None), "runtimeClasses[0].artifacts is missing"),
    (one_class(artifacts={"pullSecret": "x"}), "runtimeClasses[0].artifacts.url is missing"),
    (one_class(artifacts={"url": "kata-gpu-artifacts:v1"}),
     'runtimeClasses[0].artifacts.url "kata-gpu-artifacts:v1" is not an artifact reference: '
     "artifact ref 'kata-gpu-artifacts:v1' has no registry host"),
    (one_class(artifacts={"url": "nvidia/kata:v1"}), "'nvidia', which is not a registry host"),
    (one_class(artifacts={"url": "nvcr.io/Nvidia/kata:v1"}), "repository part 'Nvidia'"),
    (one_class(artifacts={"url": "nvcr.io/nvidia/kata@sha256:abc"}), "64 lower-case"),
    (one_class(artifacts={"url": "https://nvcr.io/nvidia/kata:v1"}), "has a URL scheme"),
    (one_class(artifacts={"url": "oci-layout://relative/dir:v1"}), "must be absolute"),
    (one_class(artifacts={"url": "oci-layout:///srv/../etc:v1"}), "must not contain '..'"),
    (one_class(artifacts={"url": DEFAULT_GPU_ARTIFACTS, "pullSecret": "Bad_Name"}),
     'runtimeClasses[0].artifacts.pullSecret "Bad_Name" is not a valid Secret name'),
    (one_class(artifacts={"url": DEFAULT_GPU_ARTIFACTS, "pulSecret": "x"}),
     "runtimeClasses[0].artifacts.pulSecret is not a known key"),
    (one_class(nodeSelector={"nvidia.com/cc.capable": True}),
     'runtimeClasses[0].nodeSelector["nvidia.com/cc.capable"] is a boolean; quote it ("true")'),
    (one_class(nodeSelector={"Bad_Prefix/x": "1"}),
     'runtimeClasses[0].nodeSelector key "Bad_Prefix/x" is not a valid label key'),
    (one_class(nodeSelector={"-x": "1"}), 'key "-x" is not a valid label key'),
    (one_class(nodeSelector={"a": "v" * 64}), 'runtimeClasses[0].nodeSelector["a"]'),
    (one_class(nodeSelector={"a": "bad value"}), '"bad value" is not a valid label value'),
    (one_class(nodeSelector=["a"]), "runtimeClasses[0].nodeSelector is a list"),
    (one_class(nodeSelctor={}), "runtimeClasses[0].nodeSelctor is not a known key"),
    ({"runtimeClases": []}, "runtimeClases is not a known key"),
    ({"runtimeClasses": {"name": "x"}}, "runtimeClasses is a mapping; it must be a list"),
    ({"runtimeClasses": ["x"]}, "runtimeClasses[0] is a string; it must be a mapping"),
    ({"artifactsDir": "opt/artifacts"}, 'artifactsDir "opt/artifacts" is not a usable path'),
    ({"artifactsDir": "/opt/../etc"}, "must not contain '..'"),
    ({"artifactsDir": "/"}, "must not be the root directory"),
    ({"artifactsDir": 5}, "artifactsDir is a number"),
    ({"containerd": {"restartMode": "kill"}},
     'containerd.restartMode "kill" is not a restart mode; use one of signal, systemd, none'),
    ({"containerd": {"version": 1}}, "containerd.version 1 is not a containerd config version"),
    ({"containerd": {"version": "2"}}, 'containerd.version "2" is not'),
    ({"containerd": {"version": True}}, "containerd.version True is not"),
    ({"containerd": {"socket": "run/containerd.sock"}}, "containerd.socket"),
    ({"containerd": {"podAnnotations": [""]}}, "containerd.podAnnotations[0]"),
    ({"containerd": {"restart": "signal"}}, "containerd.restart is not a known key"),
    ({"containerd": "signal"}, "containerd is a string; it must be a mapping"),
    ({"runtimeClassOverhead": {"podFixed": {"memory": "160MB"}}},
     'runtimeClassOverhead.podFixed["memory"] "160MB" is not a Kubernetes quantity'),
    ({"runtimeClassOverhead": {"podFixed": {"cpu": -1}}}, '"-1" is not a Kubernetes quantity'),
    ({"runtimeClassOverhead": {"podFixed": {"cpu": "NaN"}}}, '"NaN" is not'),
    ({"runtimeClassOverhead": {"podFixed": {"bad key!": "1"}}}, 'key "bad key!"'),
    ({"runtimeClassOverhead": {"fixed": {}}}, "runtimeClassOverhead.fixed is not a known key"),
    ({"insecureRegistries": ["http://registry.lab"]},
     'insecureRegistries[0] "http://registry.lab" is not a host or host:port'),
    ({"insecureRegistries": "registry.lab"}, "insecureRegistries is a string"),
    ({"devices": {"include": [{"ids": "1234:11e", "resource": "example.com/edu"}]}},
     'devices.include[0].ids "1234:11e" is not a PCI vendor:device pair (4 hex digits each'),
    ({"devices": {"include": [{"ids": "1234:11e8", "resource": "edu"}]}},
     'devices.include[0].resource "edu" is not an extended resource name (domain/name'),
    ({"devices": {"include": [{"ids": "1234:11e8", "resource": "kubernetes.io/edu"}]}},
     'devices.include[0].resource "kubernetes.io/edu" is not an extended resource name'),
    ({"devices": {"include": [{"ids": "1234:11e8", "resource": "example.com/3d"}]}},
     'devices.include[0].resource "example.com/3d" is not usable as a CDI kind'),
    ({"devices": {"include": [{"ids": "1234:11e8"}]}}, "devices.include[0].resource is missing"),
    ({"devices": {"include": ["1234:11e8=example.com/edu"]}},
     "devices.include[0] is a string; it must be a mapping"),
    ({"devices": {"exclude": ["01:00.0"]}},
     'devices.exclude[0] "01:00.0" is not a full PCI address such as 0000:01:00.0 '
     "(with its domain: 0000:01:00.0)"),
    ({"devices": {"exclude": ["nvidia"]}},
     'devices.exclude[0] "nvidia" is neither a full PCI address (0000:01:00.0) nor a '
     "vendor:device pair (10de:1eb8)"),
    ({"devices": {"exclude": "10de:1eb8"}}, "devices.exclude is a string; it must be a list"),
    ({"devices": {"exclud": []}}, "devices.exclud is not a known key"),
    ([], "the config is a list; it must be a mapping"),
]
