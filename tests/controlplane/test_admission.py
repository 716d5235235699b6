"""Isolation through the real API server: Pods created with the API, admitted (or refused)
by our webhook (``katamgr webhook`` as a local process the API server calls over TLS, with
the chart's own webhook configurations pointed at it by URL) and by the chart's
ValidatingAdmissionPolicy evaluated by the API server's cel-go.

What only the API server shows: that it calls /mutate and /validate with the reviews it
really sends and applies our JSON patch; that a webhook's runtimeClassName makes it re-run
its built-in RuntimeClass admission (overhead and scheduling from the RuntimeClass,
checked again at validation); that the policy's message reaches the user; that the
namespace selectors leave the excluded namespaces alone.
"""

from __future__ import annotations

import base64
import copy
import json
import subprocess
from typing import Any

import pytest
import yaml
from support.chartkit import render_release
from support.kubecluster import wait_for
from support.registry_server import free_port
from support.tlskit import make_ca
from support.webhookkit import Webhook

from gpunode.kataclasses import PASSTHROUGH_RUNTIME_CLASSES

pytestmark = pytest.mark.integration

RELEASE = "ksm-adm"
TENANT = "tenant"
A10 = "nvidia.com/GA102GL_A10"
KATA = "kata-qemu-nvidia-gpu"
SNP = "kata-qemu-nvidia-gpu-snp"
H100 = "nvidia.com/GH100H100_SXM5_80GB"
CONFIDENTIAL_DENIAL = (f'requests {A10}, but runtimeClassName "{SNP}" runs confidential VMs and the GPU model '
                       "GA102GL_A10 has no confidential-computing mode (Hopper and later only)")
VALUES = {"sandboxWorkloads": {"enabled": True},
          "isolation": {"webhook": {"enabled": True}, "admissionPolicy": {"enabled": True}}}
KATA_CLASSES = (f"a Kata GPU class (its handler kata-qemu-nvidia-gpu*, or one of "
                f"{', '.join(PASSTHROUGH_RUNTIME_CLASSES)})")
DENIAL = (f'requests the passthrough resource {A10}, but it sets no runtimeClassName; a '
          f"passthrough GPU is only given to a Kata VM: set spec.runtimeClassName to "
          f"{KATA_CLASSES}, or request nvidia.com/gpu for a container GPU")



def pod(name: str, *, resources: dict[str, Any] | None = None,
        runtime_class: str | None = None, init: bool = False) -> dict[str, Any]:
    container = {"name": "main", "image": "example.invalid/app:1"}
    if resources:
        container["resources"] = {"limits": resources}
    spec: dict[str, Any] = {"containers": [container, {"name": "side", "image": "example.invalid/side:1"}]}
    if init:
        spec["initContainers"] = [{"name": "setup", "image": "example.invalid/setup:1"}]
    if runtime_class:
        spec["runtimeClassName"] = runtime_class
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def create(kube, obj: dict[str, Any], namespace: str) -> subprocess.CompletedProcess:
    return kube.kubectl("create", "-n", namespace, "-f", "-", "-o", "json",
                        input=yaml.safe_dump(obj), check=False)


def envs(stored_pod: dict[str, Any]) -> dict[str, dict[str, str]]:
    spec = stored_pod["spec"]
    return {c["name"]: {e["name"]: e.get("value") for e in c.get("env", [])}
            for c in spec.get("initContainers", []) + spec["containers"]}


@pytest.fixture(scope="module")
def objects():
    return render_release(VALUES, RELEASE)


def of_kind(objects, *kinds):
    return [o for o in objects if o["kind"] in kinds]


@pytest.fixture(scope="module", autouse=True)
def runtime_classes(kube):
    """The Kata RuntimeClasses (as the agent makes them): the API server refuses a pod
    naming a RuntimeClass that does not exist."""
    from katamgr.cluster.runtimeclasses import desired_runtime_classes
    from katamgr.config import default_config

    classes = [{
        "apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
        "metadata": {"name": name}, "handler": name,
        "overhead": {"podFixed": {"cpu": "250m", "memory": "160Mi"}},
        # As katamgr makes them: the -snp class also selects CC-ready nodes.
        "scheduling": next(b["scheduling"] for b in desired_runtime_classes(default_config())
                           if b["metadata"]["name"] == name),
    } for name in (KATA, SNP)]
    kube.apply(classes, manager="test")
    yield
    kube.delete(classes)


@pytest.fixture
def layer(kube, objects, tmp_path):
    """Put one isolation layer in force (the webhook, or the policy alone) and take it
    away afterwards, so each test sees exactly the layers it names."""
    kube.namespace(TENANT)
    started: list[Webhook] = []
    applied: list[dict[str, Any]] = []

    def use(which: str, inject: bool = False, check_handlers: bool = False):
        if which == "webhook":
            hook = Webhook(tmp_path, inject=inject, kubeconfig=kube.kubeconfig if check_handlers else None)
            started.append(hook)
            configs = hook.point(of_kind(objects, "MutatingWebhookConfiguration",
                                         "ValidatingWebhookConfiguration"))
        else:
            hook = None
            configs = of_kind(objects, "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
        kube.apply(configs)
        applied.extend(configs)
        return hook

    yield use
    if applied:
        kube.delete(applied)
    for hook in started:
        hook.stop()
    kube.kubectl("delete", "pods", "--all", "-n", TENANT, "--wait=false", check=False)


def refused_until_in_force(kube, name: str, body: dict[str, Any]) -> str:
    """The API server loads new webhook configurations and policies asynchronously (an
    informer): retry the create until the layer answers, then return its refusal."""
    def attempt():
        result = create(kube, body, TENANT)
        if result.returncode == 0:
            kube.kubectl("delete", "pod", name, "-n", TENANT, "--wait=false", check=False)
            return None
        return result.stderr

    return wait_for(attempt, f"pod {name} refused", timeout=30, every=0.5)


def test_the_webhook_alone_voids_gpu_less_pods_and_refuses_passthrough_without_kata(kube, layer):
    hook = layer("webhook")
    refusal = refused_until_in_force(kube, "bad", pod("bad", resources={A10: 1}))
    assert 'admission webhook "' in refusal and DENIAL in refusal, refusal
    assert 'pod "bad"' in refusal

    plain = create(kube, pod("plain", init=True), TENANT)
    assert plain.returncode == 0, plain.stderr
    stored = json.loads(plain.stdout)
    assert all(env.get("NVIDIA_VISIBLE_DEVICES") == "void" for env in envs(stored).values()), envs(stored)

    # A pod with a GPU keeps its env; a Kata pod with the passthrough GPU is admitted as is.
    kata = create(kube, pod("kata", resources={A10: 1}, runtime_class=KATA), TENANT)
    assert kata.returncode == 0, kata.stderr
    assert "NVIDIA_VISIBLE_DEVICES" not in envs(json.loads(kata.stdout))["main"]
    log = hook.stop()
    assert "/mutate" in log and "/validate" in log, log


def test_the_policy_alone_refuses_passthrough_without_kata_with_our_message(kube, layer):
    layer("policy")
    refusal = refused_until_in_force(kube, "bad", pod("bad", resources={A10: 1}))
    assert "ValidatingAdmissionPolicy" in refusal, refusal
    assert f'container "main" {DENIAL}' in refusal, refusal
    # The policy validates only: a GPU-less pod is stored unchanged.
    plain = create(kube, pod("plain"), TENANT)
    assert plain.returncode == 0, plain.stderr
    assert envs(json.loads(plain.stdout))["main"] == {}


def test_an_injected_runtime_class_brings_its_overhead_and_scheduling(kube, layer):
    layer("webhook", inject=True)

    def admitted():
        result = create(kube, pod("injected", resources={A10: 1}), TENANT)
        return result.stdout if result.returncode == 0 else None

    stored = json.loads(wait_for(admitted, "the passthrough pod admitted with a class"))
    spec = stored["spec"]
    assert spec["runtimeClassName"] == KATA
    # Set by the API server's RuntimeClass admission plugin, re-run after our patch
    # (the pod had no class when it first ran).
    assert spec["overhead"] == {"cpu": "250m", "memory": "160Mi"}
    assert spec["nodeSelector"] == {"nvidia.com/gpu.workload.config": "vm-passthrough",
                                    f"runtimeclass.kata-sandbox-manager.io/{KATA}": "true"}


def test_excluded_namespaces_are_left_alone(kube, layer):
    layer("webhook")
    layer("policy")
    # kube-system is in isolation.excludedNamespaces, the release namespace always is.

    def stored_unchanged():
        result = create(kube, pod("system-plain"), "kube-system")
        if result.returncode:
            return None
        kube.kubectl("delete", "pod", "system-plain", "-n", "kube-system", "--wait=false", check=False)
        return json.loads(result.stdout)

    # First make sure the webhook is in force for other namespaces.
    refused_until_in_force(kube, "bad", pod("bad", resources={A10: 1}))
    stored = wait_for(stored_unchanged, "a pod in kube-system admitted")
    assert envs(stored)["main"] == {}
    passthrough = create(kube, pod("system-gpu", resources={A10: 1}), "kube-system")
    assert passthrough.returncode == 0, passthrough.stderr
    kube.kubectl("delete", "pod", "system-gpu", "-n", "kube-system", "--wait=false", check=False)


@pytest.mark.parametrize("which", ["webhook", "policy"])
def test_a_confidential_class_is_refused_a_gpu_model_without_cc_naming_it(kube, layer, which):
    """Refused: what can never work (an A10 has no CC mode: its confidential VM could never
    attest it); admitted: an H100 (the scheduler then waits for cc.ready.state=true). The policy's
    CEL uses the strings library (substring) as the real API server has it."""
    layer(which)
    refusal = refused_until_in_force(kube, "cc-a10", pod("cc-a10", resources={A10: 1}, runtime_class=SNP))
    assert CONFIDENTIAL_DENIAL in refusal, refusal
    admitted = create(kube, pod("cc-h100", resources={H100: 1}, runtime_class=SNP), TENANT)
    assert admitted.returncode == 0, admitted.stderr
    stored = json.loads(admitted.stdout)
    assert stored["spec"]["nodeSelector"]["nvidia.com/cc.ready.state"] == "true"  # the RuntimeClass's


# --- every container on its own, every way to a GPU, both layers alike ---------

def tenant(obj: dict[str, Any], name: str) -> dict[str, Any]:
    """A podkit pod as a tenant creates it in the tenant namespace."""
    obj = copy.deepcopy(obj)
    obj["metadata"] = {"name": name, **({"annotations": obj["metadata"]["annotations"]}
                                        if obj["metadata"].get("annotations") else {})}
    return obj


@pytest.mark.parametrize("which", ["webhook", "policy"])
def test_the_other_ways_to_a_gpu_are_refused_by_each_layer_with_one_message(kube, layer, which):
    """A CDI annotation, a hostPath of /dev/vfio, the toolkit's device-list mount: refused by
    either layer alone, in the same words (tests/chart/test_isolation.py checks the same
    sentences with cel-python; here the API server's cel-go evaluates them)."""
    from support import podkit

    from katamgr.admission.rules import Policy, validate

    layer(which)
    for case in ("cdi-gpu-all", "cdi-pgpu-kata", "hostpath-vfio", "devlist-emptydir"):
        body = tenant(podkit.cases()[case], case)
        refusal = refused_until_in_force(kube, case, body)
        expected = validate(body, Policy()).split(": ", 1)[1]
        assert expected in refusal, (case, refusal)


def test_the_webhook_voids_each_container_that_asked_for_none_where_the_api_server_stores_it(kube, layer):
    from support import podkit

    layer("webhook")
    refused_until_in_force(kube, "bad", pod("bad", resources={A10: 1}))
    expected = {
        "gpu-and-sidecar": {"app": None, "sidecar": "void"},
        "gpu-init-only": {"warmup": None, "app": "void"},
        "gpu-user-all": {"app": None},  # its own "all" is gone: the device plugin's value stands
        "kata-and-sidecar": {"app": None, "sidecar": "void"},
    }
    for case, want in expected.items():
        result = create(kube, tenant(podkit.cases()[case], case), TENANT)
        assert result.returncode == 0, (case, result.stderr)
        stored = envs(json.loads(result.stdout))
        assert {name: env.get("NVIDIA_VISIBLE_DEVICES") for name, env in stored.items()} == want, case


def _debug(kube, pod_name: str, *extra: str) -> subprocess.CompletedProcess:
    # kubectl debug adds an ephemeral container with a PATCH of pods/ephemeralcontainers;
    # without -i it returns once the API server stored it (no kubelet runs it here).
    return kube.kubectl("debug", "-n", TENANT, pod_name, "--image=nvcr.io/nvidia/cuda:12.5.0-base-ubuntu22.04",
                        "--container=debugger", *extra, "--", "nvidia-smi", check=False)


def test_kubectl_debug_gets_void_from_the_webhook_and_is_refused_all_by_the_policy(kube, layer):
    hook = layer("webhook")
    refused_until_in_force(kube, "bad", pod("bad", resources={A10: 1}))
    assert create(kube, pod("target", resources={"nvidia.com/gpu": 1}), TENANT).returncode == 0
    debugged = _debug(kube, "target", "--env=NVIDIA_VISIBLE_DEVICES=all")
    assert debugged.returncode == 0, debugged.stderr
    stored = kube.get("pod", "target", "-n", TENANT)
    (debugger,) = stored["spec"]["ephemeralContainers"]
    assert [e for e in debugger["env"] if e["name"] == "NVIDIA_VISIBLE_DEVICES"] == [
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}]
    assert "NVIDIA_VISIBLE_DEVICES" not in envs(stored)["main"]  # the GPU container untouched
    hook.stop()


def test_the_policy_alone_refuses_kubectl_debug_that_asks_for_every_gpu(kube, layer):
    layer("policy")
    refused_until_in_force(kube, "bad", pod("bad", resources={A10: 1}))
    assert create(kube, pod("target"), TENANT).returncode == 0

    def refused():
        result = _debug(kube, "target", "--env=NVIDIA_VISIBLE_DEVICES=all")
        return result.stderr if result.returncode else None

    refusal = wait_for(refused, "kubectl debug refused", timeout=30, every=0.5)
    assert 'ephemeral container "debugger" requests no GPU but sets NVIDIA_VISIBLE_DEVICES' in refusal, refusal
    assert _debug(kube, "target", "--env=NVIDIA_VISIBLE_DEVICES=void").returncode == 0


@pytest.fixture
def runc_handled_kata(kube):
    """kata-qemu-nvidia-gpu deleted and made again with handler runc (the attack of issue
    33: every "Kata" GPU pod would run under runc with raw /dev/vfio); put back after."""
    original = kube.get("runtimeclass", KATA)
    kube.kubectl("delete", "runtimeclass", KATA)
    forged = {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": KATA},
              "handler": "runc"}
    kube.apply([forged], manager="attacker")
    yield
    kube.kubectl("delete", "runtimeclass", KATA)
    for key in ("resourceVersion", "uid", "creationTimestamp", "managedFields"):
        original["metadata"].pop(key, None)
    kube.apply([original], manager="test")


@pytest.mark.parametrize("which", ["webhook", "policy"])
def test_a_kata_class_with_a_runc_handler_gets_no_passthrough_gpu(kube, layer, runc_handled_kata, which):
    layer(which, check_handlers=True)
    refusal = refused_until_in_force(kube, "forged", pod("forged", resources={A10: 1}, runtime_class=KATA))
    assert f'runtimeClassName "{KATA}" has handler "runc", which is not a Kata runtime' in refusal, refusal
    # A pod asking for no passthrough GPU is not this rule's business.
    assert create(kube, pod("plain-kata", runtime_class=KATA), TENANT).returncode == 0


@pytest.fixture
def kata_deploy_classes(kube):
    """RuntimeClasses as kata-deploy's chart makes them beside ours: its default class
    (runtimeClasses.createDefault, named "kata", the handler of its default shim, an NVIDIA GPU
    one in its try-kata-nvidia-gpu values: kata-deploy's templates/runtimeclasses.yaml) and
    its plain QEMU class, a Kata runtime with no GPU."""
    classes = [{"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": name},
                "handler": handler} for name, handler in (("kata", KATA), ("kata-qemu", "kata-qemu"))]
    kube.apply(classes, manager="kata-deploy")
    yield
    kube.delete(classes)


@pytest.mark.parametrize("which", ["webhook", "policy"])
def test_any_class_with_a_kata_gpu_handler_takes_a_passthrough_gpu(kube, layer, kata_deploy_classes, which):
    """The allow-list follows the classes present: "kata" is in no list, but its handler is
    Kata's GPU runtime; "kata-qemu" is a Kata runtime without the GPU one. The policy reads
    both as params, the webhook with its own client (--check-handlers)."""
    layer(which, check_handlers=True)
    refusal = refused_until_in_force(kube, "no-gpu-vm", pod("no-gpu-vm", resources={A10: 1},
                                                            runtime_class="kata-qemu"))
    assert (f'container "main" requests the passthrough resource {A10}, but runtimeClassName "kata-qemu" has '
            f'handler "kata-qemu", which is not a Kata GPU runtime; a passthrough GPU is only given to a Kata '
            f"VM: set spec.runtimeClassName to {KATA_CLASSES}") in refusal, refusal
    admitted = create(kube, pod("renamed", resources={A10: 1}, runtime_class="kata"), TENANT)
    assert admitted.returncode == 0, admitted.stderr


def test_with_every_webhook_replica_gone_only_the_excluded_namespaces_create_pods(kube, objects):
    """failurePolicy Fail with nothing answering (every replica killed): the API server
    refuses pod creation wherever the webhook matches (gpu-operator too: not listed), and creates
    pods in kube-system, the release namespace and a namespace the administrator labeled exempt
    (docs/isolation.md, "When every webhook replica is gone")."""
    dead = free_port()  # nothing listens there
    configs = copy.deepcopy(of_kind(objects, "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"))
    ca = make_ca()
    for config in configs:
        for hook in config["webhooks"]:
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{dead}/mutate",
                                    "caBundle": base64.b64encode(ca.pem).decode()}
    for name in (TENANT, "gpu-operator", "ksm-infra", "kata-sandbox-manager"):
        kube.namespace(name)
    kube.kubectl("label", "namespace", "ksm-infra", "isolation.kata-sandbox-manager.io/exempt=true",
                 "--overwrite")
    kube.apply(configs)
    try:
        def tenant_refused():
            result = create(kube, pod("t"), TENANT)
            if result.returncode == 0:
                kube.kubectl("delete", "pod", "t", "-n", TENANT, "--wait=false", check=False)
                return None
            return result.stderr

        refusal = wait_for(tenant_refused, "a tenant pod refused with the webhook down", timeout=30, every=0.5)
        assert "failed calling webhook" in refusal, refusal
        # The release namespace of this test's render (RELEASE's namespace) is excluded too.
        release_ns = configs[0]["webhooks"][0]["namespaceSelector"]["matchExpressions"][0]["values"][0]
        kube.namespace(release_ns)
        for namespace in ("kube-system", "ksm-infra", release_ns):
            result = create(kube, pod("infra"), namespace)
            assert result.returncode == 0, (namespace, result.stderr)
            kube.kubectl("delete", "pod", "infra", "-n", namespace, "--wait=false", check=False)
        assert "failed calling webhook" in create(kube, pod("infra"), "gpu-operator").stderr
    finally:
        kube.delete(configs)
