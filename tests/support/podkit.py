"""Pods built from the official ``kubernetes`` client's models and serialised as the API
server sends them (``ApiClient().sanitize_for_serialization``), and AdmissionReview v1
requests carrying them: the cases of the admission webhook and policy tests."""

from __future__ import annotations

import uuid
from typing import Any

from kubernetes import client as k8s

A10 = "nvidia.com/GA102GL_A10"
KATA = "kata-qemu-nvidia-gpu"
H100 = "nvidia.com/GH100H100_SXM5_80GB"
_API = k8s.ApiClient()


def container(name: str = "app", *, limits: dict[str, str] | None = None,
              env: dict[str, str] | None = None) -> k8s.V1Container:
    return k8s.V1Container(
        name=name, image="nvcr.io/nvidia/k8s/cuda-sample:vectoradd-cuda12.5.0",
        resources=k8s.V1ResourceRequirements(limits=limits) if limits is not None else None,
        env=[k8s.V1EnvVar(name=k, value=v) for k, v in env.items()] if env else None)


def pod(*containers: k8s.V1Container, init: list[k8s.V1Container] | None = None,
        runtime_class: str | None = None, name: str | None = "demo",
        generate_name: str | None = None, namespace: str = "default") -> dict[str, Any]:
    obj = k8s.V1Pod(
        api_version="v1", kind="Pod",
        metadata=k8s.V1ObjectMeta(name=name, generate_name=generate_name, namespace=namespace),
        spec=k8s.V1PodSpec(containers=list(containers) or [container()], init_containers=init,
                           runtime_class_name=runtime_class, restart_policy="OnFailure"))
    return serialise(obj)


def serialise(model: Any) -> dict[str, Any]:
    return _API.sanitize_for_serialization(model)


def deployment_pod(*containers: k8s.V1Container, runtime_class: str | None = None) -> dict[str, Any]:
    """The Pod the ReplicaSet controller makes from a Deployment's template: generateName,
    no name, labels and an ownerReference."""
    labels = {"app": "web", "pod-template-hash": "5d9c7b7f9"}
    deploy = k8s.V1Deployment(
        api_version="apps/v1", kind="Deployment", metadata=k8s.V1ObjectMeta(name="web", namespace="default"),
        spec=k8s.V1DeploymentSpec(
            replicas=2, selector=k8s.V1LabelSelector(match_labels={"app": "web"}),
            template=k8s.V1PodTemplateSpec(
                metadata=k8s.V1ObjectMeta(labels=labels),
                spec=k8s.V1PodSpec(containers=list(containers) or [container()],
                                   runtime_class_name=runtime_class))))
    template = deploy.spec.template
    made = k8s.V1Pod(
        api_version="v1", kind="Pod",
        metadata=k8s.V1ObjectMeta(
            generate_name="web-5d9c7b7f9-", namespace="default", labels=template.metadata.labels,
            owner_references=[k8s.V1OwnerReference(
                api_version="apps/v1", kind="ReplicaSet", name="web-5d9c7b7f9",
                uid=str(uuid.uuid4()), controller=True, block_owner_deletion=True)]),
        spec=template.spec)
    return serialise(made)


def review(obj: dict[str, Any], *, kind: dict[str, str] | None = None,
           operation: str = "CREATE") -> dict[str, Any]:
    """An AdmissionReview v1 request for ``obj``, as the API server posts it."""
    meta = obj.get("metadata") or {}
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": kind or {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": kind or {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": meta.get("name") or "",
            "namespace": meta.get("namespace", "default"),
            "operation": operation,
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller",
                         "uid": str(uuid.uuid4()), "groups": ["system:serviceaccounts"]},
            "object": obj,
            "oldObject": None,
            "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }


# The named pod cases shared by the webhook and the policy tests: (pod, requests a GPU,
# requests passthrough).
def cases() -> dict[str, dict[str, Any]]:
    return {
        "no-request": pod(container()),
        "request-0": pod(container(limits={"nvidia.com/gpu": "0"})),
        "cpu-only": pod(container(limits={"cpu": "1", "memory": "1Gi"})),
        "init-containers": pod(container(), init=[container("setup"), container("migrate")]),
        "user-all": pod(container(env={"NVIDIA_VISIBLE_DEVICES": "all", "OTHER": "x"})),
        "gpu": pod(container(limits={"nvidia.com/gpu": "1"})),
        "mig": pod(container(limits={"nvidia.com/mig-1g.10gb": "1"})),
        "passthrough-kata": pod(container(limits={A10: "1"}), runtime_class=KATA),
        "passthrough-snp": pod(container(limits={H100: "1"}), runtime_class="kata-qemu-nvidia-gpu-snp"),
        # A confidential class and a GPU model with no CC mode: refused, naming the model.
        "snp-a10": pod(container(limits={A10: "1"}), runtime_class="kata-qemu-nvidia-gpu-snp"),
        "snp-t4-init": pod(container(), init=[container("loader", limits={"nvidia.com/TU104GL_TESLA_T4": "1"})],
                           runtime_class="kata-qemu-nvidia-gpu-snp"),
        "snp-alias": pod(container(limits={"nvidia.com/pgpu": "1"}), runtime_class="kata-qemu-nvidia-gpu-snp"),
        "passthrough-none": pod(container(limits={A10: "1"})),
        "passthrough-runc": pod(container(limits={A10: "1"}), runtime_class="runc"),
        "passthrough-init": pod(container(), init=[container("loader", limits={"nvidia.com/pgpu": "1"})]),
        "deployment": deployment_pod(container()),
    }
