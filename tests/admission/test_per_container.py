"""Isolation's grains, each judged as a security reviewer would: every container, init
container and ephemeral container on its own; CDI annotations, hostPath volumes and the
toolkit's device-list mounts as other ways to a GPU. The webhook's answers over real TLS,
the patch applied and the result checked against the Kubernetes API schema.

Facts these rest on:
- the kubelet puts a container's own env after the device plugin's Allocate envs
  (pkg/kubelet/kubelet_pods.go, GenerateRunContainerOptions: ``opts.Envs = append(opts.Envs,
  envs...)``), and the runtime takes the last value of a name: a user-set
  NVIDIA_VISIBLE_DEVICES beats the plugin's;
- ``kubectl debug`` adds an ephemeral container with an UPDATE of the pods/ephemeralcontainers
  subresource whose object is the whole Pod; the API server keeps only ephemeral-container
  changes from it and refuses a change to one that exists (pkg/registry/core/pod/strategy.go,
  podEphemeralContainersStrategy; validation.ValidatePodEphemeralContainersUpdate);
- containerd and CRI-O read CDI device names from ``cdi.k8s.io/`` annotations, the NVIDIA
  Container Toolkit from ``nvidia.cdi.k8s.io/`` ones; the toolkit's volume-mounts strategy
  reads mounts under /var/run/nvidia-container-devices.
"""

from __future__ import annotations

import base64
import copy
import json

import jsonpatch
import pytest
from support import podkit
from support.podkit import A10, KATA, container, ephemeral, pod, review

from katamgr.admission.rules import Policy, mutate, validate

VOID = {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}


def applied(obj: dict, ops: list[dict]) -> dict:
    return jsonpatch.JsonPatch(ops).apply(copy.deepcopy(obj))


def visible(obj: dict) -> dict[str, list]:
    """Each container's NVIDIA_VISIBLE_DEVICES entries, by container name."""
    spec = obj["spec"]
    every = spec.get("initContainers", []) + spec["containers"] + spec.get("ephemeralContainers", [])
    return {c["name"]: [e for e in c.get("env") or [] if e["name"] == "NVIDIA_VISIBLE_DEVICES"]
            for c in every}


# case -> each container's NVIDIA_VISIBLE_DEVICES after /mutate
MUTATED = {
    "gpu-and-sidecar": {"app": [], "sidecar": [VOID]},
    "gpu-init-only": {"warmup": [], "app": [VOID]},
    "gpu-user-all": {"app": []},
    "sidecar-user-all": {"app": [], "sidecar": [VOID]},
    "kata-and-sidecar": {"app": [], "sidecar": [VOID]},
    "dra-claim": {"app": [], "sidecar": [VOID]},
    "passthrough-init": {"loader": [], "app": [VOID]},
}


@pytest.mark.parametrize("case", sorted(MUTATED))
def test_each_container_is_voided_unless_it_asks_for_a_gpu(webhook, case):
    _, client = webhook
    obj = podkit.cases()[case]
    answer = client.review("/mutate", review(obj))["response"]
    assert answer["allowed"] is True
    result = applied(obj, json.loads(base64.b64decode(answer["patch"])))
    assert visible(result) == MUTATED[case]
    # The mutated pod then passes /validate (the API server sends validating webhooks the
    # object the mutating ones made); a passthrough pod outside Kata is still refused.
    allowed = client.review("/validate", review(result))["response"]["allowed"]
    assert allowed is (case != "passthrough-init")


def test_a_gpu_container_keeps_its_other_env():
    obj = pod(container(limits={"nvidia.com/gpu": "1"}, env={"A": "1", "NVIDIA_VISIBLE_DEVICES": "all", "B": "2"}))
    result = applied(obj, mutate(obj, Policy()))
    assert result["spec"]["containers"][0]["env"] == [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]


# case -> what /validate says of the pod as sent (the admission policy says the same:
# tests/chart/test_isolation.py), before any mutation.
DENIED = {
    "gpu-user-all": 'container "app" sets NVIDIA_VISIBLE_DEVICES itself',
    "sidecar-user-all": 'container "sidecar" requests no GPU but sets NVIDIA_VISIBLE_DEVICES',
    "cdi-gpu-all": 'annotation "cdi.k8s.io/gpu" names the CDI device kind nvidia.com/gpu',
    "cdi-pgpu-kata": 'annotation "cdi.k8s.io/extra" names the CDI device kind nvidia.com/pgpu',
    "cdi-toolkit": 'annotation "nvidia.cdi.k8s.io/x" names the CDI device kind nvidia.com/gpu',
    "hostpath-nvidia0": 'volume "dev" is the host path /dev/nvidia0',
    "hostpath-vfio": 'volume "vfio" is the host path /dev/vfio/',
    "hostpath-dev": 'volume "dev" is the host path //dev/./',
    "devlist-emptydir": ('container "app" mounts volume "all" at /var/run/nvidia-container-devices/all, '
                         "where the NVIDIA container runtime reads which GPUs"),
    "devlist-run": 'container "app" mounts volume "x" at /run/nvidia-container-devices',
}
ALLOWED = ["cdi-other-vendor", "hostpath-data", "hostpath-dev-shm", "gpu-and-sidecar", "kata-and-sidecar",
           "dra-claim", "gpu-init-only"]


@pytest.mark.parametrize("case", sorted(DENIED))
def test_validate_refuses_the_other_ways_to_a_gpu(webhook, case):
    _, client = webhook
    response = client.review("/validate", review(podkit.cases()[case]))["response"]
    assert response["allowed"] is False
    assert response["status"]["code"] == 403
    assert response["status"]["message"].startswith('pod "demo": ' + DENIED[case])


@pytest.mark.parametrize("case", ["sidecar-user-all", "hostpath-nvidia0", "hostpath-vfio", "devlist-emptydir"])
def test_a_refusal_node_software_may_meet_names_the_setting_that_spares_it(case):
    # A GPU Operator component or a monitoring agent mounts /dev or sets NVIDIA_VISIBLE_DEVICES
    # without requesting a GPU: its operator reads which chart value (or namespace label) spares it.
    message = validate(podkit.cases()[case], Policy())
    assert "list it in the chart's isolation.excludedNamespaces, or label the namespace " \
           "isolation.kata-sandbox-manager.io/exempt=true" in message, message


@pytest.mark.parametrize("case", ALLOWED)
def test_validate_allows_what_is_no_way_to_a_gpu(case):
    assert validate(podkit.cases()[case], Policy()) is None


def test_a_mutated_pod_with_cdi_or_a_device_mount_is_still_refused(webhook):
    # Mutation fixes env, never an annotation or a volume.
    _, client = webhook
    for case in ("cdi-gpu-all", "hostpath-vfio", "devlist-emptydir"):
        obj = podkit.cases()[case]
        result = applied(obj, mutate(obj, Policy()))
        assert client.review("/validate", review(result))["response"]["allowed"] is False, case


def _ephemeral_review(old: dict, new: dict) -> dict:
    return review(new, operation="UPDATE", subresource="ephemeralcontainers", old=old)


def test_kubectl_debug_gets_void_and_nothing_else_is_patched(webhook):
    _, client = webhook
    # A pod whose app asks for a GPU and whose own env predates the webhook: on the subresource
    # only the new ephemeral container is touched (the API server refuses any other change).
    old = pod(container(limits={"nvidia.com/gpu": "1"}, env={"NVIDIA_VISIBLE_DEVICES": "all"}))
    new = ephemeral(old, env={"NVIDIA_VISIBLE_DEVICES": "all"})
    answer = client.review("/mutate", _ephemeral_review(old, new))["response"]
    ops = json.loads(base64.b64decode(answer["patch"]))
    assert all(op["path"].startswith("/spec/ephemeralContainers/0/") for op in ops), ops
    result = applied(new, ops)
    assert visible(result)["debugger"] == [VOID]
    assert client.review("/validate", _ephemeral_review(old, result))["response"]["allowed"] is True


def test_an_ephemeral_container_added_later_leaves_the_earlier_one_alone():
    first = ephemeral(pod(container()))
    first["spec"]["ephemeralContainers"][0]["env"] = [VOID]
    second = ephemeral(first, "second")
    ops = mutate(second, Policy(), subresource="ephemeralcontainers", old=first)
    assert ops == [{"op": "add", "path": "/spec/ephemeralContainers/1/env", "value": [VOID]}]


def test_an_ephemeral_container_unvoided_or_mounting_the_device_list_is_refused():
    old = pod(container(), empty_dirs=("all",))
    assert "ephemeral container \"debugger\" requests no GPU but sets" in validate(
        ephemeral(old, env={"NVIDIA_VISIBLE_DEVICES": "0"}), Policy(), subresource="ephemeralcontainers")
    assert "ephemeral container \"debugger\" mounts volume \"all\"" in validate(
        ephemeral(old, mounts={"all": "/var/run/nvidia-container-devices/all"}), Policy(),
        subresource="ephemeralcontainers")


def test_a_plain_pod_update_is_never_patched(webhook):
    # Container env is immutable after create: a patch on a plain UPDATE would make the API
    # server refuse every later update of a pod created before the webhook.
    _, client = webhook
    obj = podkit.cases()["no-request"]
    answer = client.review("/mutate", review(obj, operation="UPDATE", old=obj))["response"]
    assert answer == {"uid": answer["uid"], "allowed": True}


def test_kata_handler_rule_reads_the_runtime_class():
    handlers = {KATA: "runc", "kata-qemu-nvidia-gpu-snp": "kata-qemu-nvidia-gpu-snp"}
    policy = Policy(handler_of=handlers.get)
    denial = validate(pod(container(limits={A10: "1"}), runtime_class=KATA), policy)
    assert denial and f'runtimeClassName "{KATA}" has handler "runc", which is not a Kata runtime' in denial
    h100 = {podkit.H100: "1"}
    assert validate(pod(container(limits=h100), runtime_class="kata-qemu-nvidia-gpu-snp"), policy) is None
    # A pod asking for no passthrough GPU is not the rule's business.
    assert validate(pod(container(), runtime_class=KATA), policy) is None
