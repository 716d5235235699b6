"""Pods built from the official ``kubernetes`` client's models and serialised as the API
server sends them (``ApiClient().sanitize_for_serialization``), and AdmissionReview v1
requests carrying them: the cases of the admission webhook and policy tests."""

from __future__ import annotations

import copy
import uuid
from typing import Any

from kubernetes import client as k8s

A10 = "nvidia.com/GA102GL_A10"
KATA = "kata-qemu-nvidia-gpu"
H100 = "nvidia.com/GH100H100_SXM5_80GB"
_API = k8s.ApiClient()


def container(name: str = "app", *, limits: dict[str, str] | None = None,
              env: dict[str, str] | None = None, claims: list[str] | None = None,
              mounts: dict[str, str] | None = None,
              sub_paths: dict[str, str] | None = None) -> k8s.V1Container:
    resources = None
    if limits is not None or claims:
        resources = k8s.V1ResourceRequirements(
            limits=limits, claims=[k8s.CoreV1ResourceClaim(name=c) for c in claims] if claims else None)
    return k8s.V1Container(
        name=name, image="nvcr.io/nvidia/k8s/cuda-sample:vectoradd-cuda12.5.0", resources=resources,
        env=[k8s.V1EnvVar(name=k, value=v) for k, v in env.items()] if env else None,
        volume_mounts=[k8s.V1VolumeMount(name=v, mount_path=p, sub_path=(sub_paths or {}).get(v))
                       for v, p in mounts.items()] if mounts else None)


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


# Paths the rules judge after dropping "." and empty segments, and refuse with "..": a mountPath
# with ".." (the API server checks hostPath and subPath only), and the node's GPU control
# points as hostPath volumes, at, under or above one (katamgr/admission/hostpaths.py).
def path_cases() -> dict[str, dict[str, Any]]:
    null = {"null": "/dev/null"}
    devlist = "/tmp/../var/run/nvidia-container-devices/all"
    return {
        "mountpath-dotdot": pod(container(mounts={"null": devlist}), host_paths=null),
        "mountpath-dotdot-init": pod(container(), init=[container("setup", mounts={"null": devlist})],
                                     host_paths=null),
        "mountpath-dotdot-sidecar": pod(container(limits={"nvidia.com/gpu": "1"}),
                                        container("sidecar", mounts={"null": "/run/x/../nvidia-container-devices/all"}),
                                        host_paths=null),
        "subpath-dotdot": pod(container(mounts={"data": "/data"}, sub_paths={"data": "a/../../b"}),
                              host_paths={"data": "/var/lib/data"}),
        "hostpath-dotdot": pod(container(mounts={"x": "/x"}), host_paths={"x": "/tmp/../dev"}),
        "hostpath-device-plugins": pod(container(mounts={"dp": "/dp"}),
                                       host_paths={"dp": "/var/lib/kubelet/device-plugins"}),
        "hostpath-pod-resources": pod(container(mounts={"pr": "/pr"}),
                                      host_paths={"pr": "/var/lib/kubelet/pod-resources/kubelet.sock"}),
        "hostpath-dra-plugins": pod(container(mounts={"p": "/p"}), host_paths={"p": "/var/lib/kubelet/plugins_registry/"}),
        "hostpath-kubelet": pod(container(mounts={"k": "/k"}), host_paths={"k": "/var/lib/kubelet"}),
        "hostpath-var": pod(container(mounts={"v": "/v"}), host_paths={"v": "/var"}),
        "hostpath-var-run-cdi": pod(container(mounts={"cdi": "/cdi"}), host_paths={"cdi": "/var/run/cdi"}),
        "hostpath-etc-cdi": pod(container(mounts={"cdi": "/cdi"}), host_paths={"cdi": "/etc/cdi/nvidia.yaml"}),
        "hostpath-etc": pod(container(mounts={"etc": "/host-etc"}), host_paths={"etc": "/etc/"}),
        "hostpath-containerd-sock": pod(container(mounts={"sock": "/sock"}),
                                        host_paths={"sock": "/run/containerd/containerd.sock"}),
        "hostpath-crio-sock": pod(container(mounts={"sock": "/sock"}), host_paths={"sock": "//var/run//crio/./crio.sock"}),
        "hostpath-run": pod(container(mounts={"run": "/run-host"}), host_paths={"run": "/run"}),
        "hostpath-sys-bus-pci": pod(container(mounts={"pci": "/pci"}), host_paths={"pci": "/sys/bus/pci"}),
        "hostpath-sys-devices-pci": pod(container(mounts={"d": "/d"}), host_paths={"d": "/sys/devices/pci0000:00"}),
        "hostpath-iommu-group": pod(container(mounts={"g": "/g"}), host_paths={"g": "/sys/kernel/iommu_groups/12"}),
        "hostpath-drm-device": pod(container(mounts={"g": "/g"}), host_paths={"g": "/sys/class/drm/card0/device"}),
        "hostpath-sys": pod(container(mounts={"sys": "/host-sys"}), host_paths={"sys": "/sys"}),
        "hostpath-dev-char": pod(container(mounts={"c": "/c"}), host_paths={"c": "/dev/char/511:12"}),
        # Not a control point: beside them, not above.
        "hostpath-var-log": pod(container(mounts={"log": "/var/log"}), host_paths={"log": "/var/log"}),
        "hostpath-kubelet-pods": pod(container(mounts={"p": "/p"}), host_paths={"p": "/var/lib/kubelet/pods"}),
        "hostpath-cgroup": pod(container(mounts={"cg": "/cg"}), host_paths={"cg": "/sys/fs/cgroup"}),
        "hostpath-run-user": pod(container(mounts={"u": "/u"}), host_paths={"u": "/run/user/1000"}),
        "hostpath-cdi-lookalike": pod(container(mounts={"c": "/c"}), host_paths={"c": "/etc/cdi-backup"}),
        "mountpath-dots-in-name": pod(container(mounts={"d": "/data/..hidden/x"}), empty_dirs=("d",)),
    }


def annotated(obj: dict[str, Any], annotations: dict[str, str | None]) -> dict[str, Any]:
    """``obj`` with annotations set (None: removed), as ``kubectl annotate`` updates a pod."""
    out = copy.deepcopy(obj)
    meta = out["metadata"]
    merged = {**(meta.get("annotations") or {}), **annotations}
    meta["annotations"] = {k: v for k, v in merged.items() if v is not None} or None
    if meta["annotations"] is None:
        del meta["annotations"]
    return out


# Plain pod UPDATEs, (oldObject, object): what they add, change or remove of the CDI
# annotations. The kubelet builds each new sandbox from the pod's annotations of the time.
def update_cases() -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    plain = pod(container())
    old_gpu = pod(container(), annotations={"cdi.k8s.io/gpu": "nvidia.com/gpu=all"})
    nic = pod(container(), annotations={"cdi.k8s.io/nic": "vendor.com/nic=eth1"})
    hostpath = path_cases()["hostpath-kubelet"]
    return {
        "annotate-gpu-all": (plain, annotated(plain, {"cdi.k8s.io/gpu": "nvidia.com/gpu=all"})),
        "annotate-toolkit": (plain, annotated(plain, {"nvidia.cdi.k8s.io/x": "nvidia.com/pgpu=0"})),
        "change-to-gpu": (nic, annotated(nic, {"cdi.k8s.io/nic": "vendor.com/nic=eth1,nvidia.com/gpu=0"})),
        "change-gpu-to-other": (old_gpu, annotated(old_gpu, {"cdi.k8s.io/gpu": "nvidia.com/gpu=1"})),
        # Left as they were (a pod made before the install), removed, or naming no GPU: admitted.
        "unchanged-gpu-label": (old_gpu, {**annotated(old_gpu, {}), "metadata": {
            **old_gpu["metadata"], "labels": {"team": "a"}}}),
        "removed-gpu": (old_gpu, annotated(old_gpu, {"cdi.k8s.io/gpu": None})),
        "annotate-other-vendor": (plain, annotated(plain, {"cdi.k8s.io/nic": "vendor.com/nic=eth1"})),
        "annotate-unrelated": (plain, annotated(plain, {"example.com/owner": "team-a"})),
        # The spec is not judged on a plain update: a pod made before the install stays updatable.
        "old-hostpath-label": (hostpath, {**hostpath, "metadata": {**hostpath["metadata"], "labels": {"a": "b"}}}),
    }
