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
              env: dict[str, str] | None = None, claims: list[str] | None = None,
              mounts: dict[str, str] | None = None) -> k8s.V1Container:
    resources = None
    if limits is not None or claims:
        resources = k8s.V1ResourceRequirements(
            limits=limits, claims=[k8s.CoreV1ResourceClaim(name=c) for c in claims] if claims else None)
    return k8s.V1Container(
        name=name, image="nvcr.io/nvidia/k8s/cuda-sample:vectoradd-cuda12.5.0", resources=resources,
        env=[k8s.V1EnvVar(name=k, value=v) for k, v in env.items()] if env else None,
        volume_mounts=[k8s.V1VolumeMount(name=v, mount_path=p) for v, p in mounts.items()] if mounts else None)


def pod(*containers: k8s.V1Container, init: list[k8s.V1Container] | None = None,
        runtime_class: str | None = None, name: str | None = "demo",
        generate_name: str | None = None, namespace: str = "default",
        annotations: dict[str, str] | None = None, host_paths: dict[str, str] | None = None,
        empty_dirs: tuple[str, ...] = (), claims: tuple[str, ...] = ()) -> dict[str, Any]:
    volumes = [k8s.V1Volume(name=v, host_path=k8s.V1HostPathVolumeSource(path=p))
               for v, p in (host_paths or {}).items()]
    volumes += [k8s.V1Volume(name=v, empty_dir=k8s.V1EmptyDirVolumeSource()) for v in empty_dirs]
    obj = k8s.V1Pod(
        api_version="v1", kind="Pod",
        metadata=k8s.V1ObjectMeta(name=name, generate_name=generate_name, namespace=namespace,
                                  annotations=annotations),
        spec=k8s.V1PodSpec(containers=list(containers) or [container()], init_containers=init,
                           runtime_class_name=runtime_class, restart_policy="OnFailure",
                           volumes=volumes or None,
                           resource_claims=[k8s.V1PodResourceClaim(name=c, resource_claim_template_name=c)
                                            for c in claims] or None))
    return serialise(obj)


def ephemeral(obj: dict[str, Any], name: str = "debugger", *, env: dict[str, str] | None = None,
              mounts: dict[str, str] | None = None) -> dict[str, Any]:
    """``obj`` with an ephemeral container added, as ``kubectl debug`` adds one (through the
    pods/ephemeralcontainers subresource; an ephemeral container takes no resources)."""
    added = k8s.V1EphemeralContainer(
        name=name, image="nvcr.io/nvidia/cuda:12.5.0-base-ubuntu22.04", stdin=True, tty=True,
        target_container_name=obj["spec"]["containers"][0]["name"],
        env=[k8s.V1EnvVar(name=k, value=v) for k, v in env.items()] if env else None,
        volume_mounts=[k8s.V1VolumeMount(name=v, mount_path=p) for v, p in mounts.items()] if mounts else None)
    out = {**obj, "spec": {**obj["spec"]}}
    out["spec"]["ephemeralContainers"] = [*obj["spec"].get("ephemeralContainers", []), serialise(added)]
    return out


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
           operation: str = "CREATE", subresource: str | None = None,
           old: dict[str, Any] | None = None) -> dict[str, Any]:
    """An AdmissionReview v1 request for ``obj``, as the API server posts it (``subResource``
    only on a subresource's request, ``oldObject`` on an UPDATE)."""
    meta = obj.get("metadata") or {}
    sent = {
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
    if subresource:
        sent["request"]["subResource"] = sent["request"]["requestSubResource"] = subresource
        sent["request"]["options"]["kind"] = "UpdateOptions"
    if old is not None:
        sent["request"]["oldObject"] = old
    return sent


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
        # Each container judged on its own, and the other ways to a GPU.
        "gpu-and-sidecar": pod(container(limits={"nvidia.com/gpu": "1"}), container("sidecar")),
        "gpu-init-only": pod(container(), init=[container("warmup", limits={"nvidia.com/gpu": "1"})]),
        "gpu-user-all": pod(container(limits={"nvidia.com/gpu": "1"}, env={"NVIDIA_VISIBLE_DEVICES": "all"})),
        "sidecar-user-all": pod(container(limits={"nvidia.com/gpu": "1"}),
                                container("sidecar", env={"NVIDIA_VISIBLE_DEVICES": "all"})),
        "kata-and-sidecar": pod(container(limits={A10: "1"}), container("sidecar"), runtime_class=KATA),
        "dra-claim": pod(container(claims=["gpu"]), container("sidecar"), claims=("gpu",)),
        "cdi-gpu-all": pod(container(), annotations={"cdi.k8s.io/gpu": "nvidia.com/gpu=all"}),
        "cdi-pgpu-kata": pod(container(limits={A10: "1"}), runtime_class=KATA,
                             annotations={"cdi.k8s.io/extra": "nvidia.com/pgpu=0"}),
        "cdi-toolkit": pod(container(), annotations={"nvidia.cdi.k8s.io/x": "vendor.com/nic=0,nvidia.com/gpu=0"}),
        "cdi-other-vendor": pod(container(), annotations={"cdi.k8s.io/nic": "vendor.com/nic=eth1"}),
        "hostpath-nvidia0": pod(container(mounts={"dev": "/dev/nvidia0"}), host_paths={"dev": "/dev/nvidia0"}),
        "hostpath-vfio": pod(container(mounts={"vfio": "/dev/vfio"}), host_paths={"vfio": "/dev/vfio/"}),
        "hostpath-dev": pod(container(mounts={"dev": "/host-dev"}), host_paths={"dev": "//dev/./"}),
        "hostpath-data": pod(container(mounts={"data": "/data"}), host_paths={"data": "/var/lib/data"}),
        "hostpath-dev-shm": pod(container(mounts={"shm": "/dev/shm"}), host_paths={"shm": "/dev/shm"}),
        "devlist-emptydir": pod(container(mounts={"all": "/var/run/nvidia-container-devices/all"}),
                                empty_dirs=("all",)),
        "devlist-run": pod(container(mounts={"x": "/run/nvidia-container-devices"}), empty_dirs=("x",)),
    }
