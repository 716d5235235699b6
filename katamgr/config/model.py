"""The kataManager config as pydantic models (the GPU Operator's ``kataManager.config`` shape).

``extra="forbid"`` (a typo like ``runtimeClases`` is an error, not the defaults), frozen,
camelCase aliases for the YAML keys and snake_case attributes for Python. A ``null`` stands
for the field's default (for ``runtimeClasses`` and ``containerd.podAnnotations``: none).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from gpunode import k8snames, kataclasses
from gpunode.policy import health, katarelease, split
from gpunode.policy import selection as device_selection
from gpunode.policy.workload import WORKLOAD_LABEL, Workload
from gpunode.services import fabricmanager, nvlinkfabric
from katamgr.artifacts.refs import ArtifactRef, parse_ref
from katamgr.config.fields import (
    NULL_IS_DEFAULT,
    NULL_IS_EMPTY,
    NULL_IS_MISSING,
    AbsolutePath,
    AnnotationGlob,
    ArtifactUrl,
    ContainerdVersion,
    DeviceSource,
    ExcludedDevice,
    GpuModuleIds,
    KataDeployMode,
    KataRelease,
    LinkPolicy,
    NodeSelector,
    NvlinkFabricModel,
    NvswitchMode,
    PciIds,
    PodFixed,
    RegistryHost,
    ResourceName,
    RestartModeField,
    RuntimeClassName,
    SecretName,
    SplitValue,
)
from katamgr.config.messages import Says, quote
from katamgr.runtime.settings import (
    DEFAULT_CONFIG_PATH,
    DEFAULT_POD_ANNOTATIONS,
    DEFAULT_RESTART_MODE,
    DEFAULT_SOCKET,
)

DEFAULT_ARTIFACTS_DIR = "/opt/nvidia-gpu-operator/artifacts/runtimeclasses"
# A RuntimeClass with an empty nodeSelector in the config still must only
# schedule onto nodes prepared for passthrough, like the GPU Operator does.
DEFAULT_NODE_SELECTOR: Mapping[str, str] = MappingProxyType(
    {WORKLOAD_LABEL: Workload.VM_PASSTHROUGH.value}
)

DEFAULT_GPU_ARTIFACTS = "nvcr.io/nvidia/cloud-native/kata-gpu-artifacts:ubuntu22.04-535.54.03"
DEFAULT_SNP_ARTIFACTS = "nvcr.io/nvidia/cloud-native/kata-gpu-artifacts:ubuntu22.04-535.86.10-snp"


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        alias_generator=to_camel,  # pull_secret <-> pullSecret
        validate_by_name=True,  # Python callers use the attribute names
        validate_by_alias=True,
    )


class Artifacts(_Model):
    url: Annotated[
        ArtifactUrl, Says(missing=f"give the artifacts image, e.g. {DEFAULT_GPU_ARTIFACTS}")
    ] = Field(description="The artifacts image (host/repo:tag or @sha256:...), or "
                          "oci-layout:///PATH[:TAG] for an OCI layout on the node.")
    # a kubernetes.io/dockerconfigjson Secret in the agent's namespace
    pull_secret: Annotated[SecretName, NULL_IS_DEFAULT] = ""

    @property
    def source(self) -> ArtifactRef:
        """The parsed reference: a RegistryRef, or a LayoutRef for oci-layout://."""
        return parse_ref(self.url)


class RuntimeClassConfig(_Model):
    name: Annotated[RuntimeClassName, Says(missing="every runtime class needs a name")]
    node_selector: Annotated[NodeSelector, NULL_IS_DEFAULT] = Field(default_factory=dict)
    artifacts: Annotated[
        Artifacts, NULL_IS_MISSING,
        Says(missing="every runtime class needs artifacts.url"),
    ]
    confidential: Annotated[bool | None, NULL_IS_DEFAULT] = Field(
        default=None, description="Whether the class runs confidential VMs (SEV-SNP, TDX) that need the "
                                  "GPUs in CC mode; unset: classes named *-snp or *-tdx are.")

    @property
    def handler(self) -> str:
        return self.name

    @property
    def is_confidential(self) -> bool:
        return kataclasses.confidential_by_name(self.name) if self.confidential is None else self.confidential

    @property
    def scheduling_node_selector(self) -> dict[str, str]:
        """The RuntimeClass's scheduling.nodeSelector: the configured one or the default; a
        confidential class also selects nodes whose GPUs are CC-ready (cc.ready.state=true); every
        class only nodes where the agent installed it (``kataclasses.offer_label``)."""
        selector = dict(self.node_selector or DEFAULT_NODE_SELECTOR)
        selector[kataclasses.offer_label(self.name)] = "true"
        if self.is_confidential:
            selector[kataclasses.CC_READY_LABEL] = "true"
        return selector


class ContainerdConfig(_Model):
    config_path: Annotated[AbsolutePath, NULL_IS_DEFAULT] = DEFAULT_CONFIG_PATH
    socket: Annotated[AbsolutePath, NULL_IS_DEFAULT] = DEFAULT_SOCKET
    version: ContainerdVersion = None  # None: detect from the existing config
    restart_mode: Annotated[RestartModeField, NULL_IS_DEFAULT] = DEFAULT_RESTART_MODE
    pod_annotations: Annotated[tuple[AnnotationGlob, ...], NULL_IS_EMPTY] = DEFAULT_POD_ANNOTATIONS


class RuntimeClassOverhead(_Model):
    # e.g. {"memory": "160Mi", "cpu": "250m"}; empty = none
    pod_fixed: Annotated[PodFixed, NULL_IS_DEFAULT] = Field(default_factory=dict)


class IncludedDevice(_Model):
    ids: Annotated[PciIds, Says(missing="give the PCI ids as vendor:device, e.g. 1234:11e8")] = Field(
        description="PCI vendor:device ids (4 hex digits each) of the devices to pass through.")
    resource: Annotated[ResourceName, Says(missing="give the resource to advertise, e.g. example.com/edu")] = Field(
        description="The extended resource (domain/name) they are advertised as; also the CDI "
                    "kind of their spec.")


class FabricManagerConfig(_Model):
    """How katamgr and the device plugin reach NVIDIA Fabric Manager (Shared NVSwitch model)."""

    address: Annotated[str, NULL_IS_DEFAULT] = Field(
        default=fabricmanager.DEFAULT_ADDRESS,
        description="FM's API address: host:port (FM's default 127.0.0.1:6666, its FM_CMD_BIND_INTERFACE "
                    "and FM_CMD_PORT_NUMBER) or the host path of its unix socket (FM_CMD_UNIX_SOCKET_PATH).")
    library: Annotated[str, NULL_IS_DEFAULT] = Field(
        default=fabricmanager.DEFAULT_LIBRARY,
        description="FM's SDK library: a soname the dynamic linker finds, or a host path.")
    gpu_module_ids: Annotated[GpuModuleIds, NULL_IS_DEFAULT] = Field(
        default="",
        description="Each GPU's module ID (nvidia-smi -q, \"Module ID\": fixed by the baseboard) and PCI "
                    "address, as 1=0000:1b:00.0,2=0000:43:00.0,...; needed on HGX H100 and later, where FM "
                    "names a partition's GPUs by module ID only.")


class DevicesConfig(_Model):
    """Which PCI devices are passthrough devices (``gpunode.policy.selection``). By default
    NVIDIA GPUs and NVSwitches; the command line's --include-device and --exclude-device
    add to these lists."""

    include: Annotated[
        tuple[IncludedDevice, ...], NULL_IS_EMPTY,
        Says(expect="it must be a list of {ids, resource}"),
    ] = Field(default=(), description="Devices to pass through besides NVIDIA GPUs and NVSwitches.")
    exclude: Annotated[
        tuple[ExcludedDevice, ...], NULL_IS_EMPTY,
        Says(expect="it must be a list of PCI addresses (0000:01:00.0) or vendor:device ids"),
    ] = Field(default=(), description="Devices never to pass through, by full PCI address "
                                      "(0000:01:00.0) or vendor:device ids (10de:1eb8); they "
                                      "stay on their drivers. Wins over include.")

    @field_validator("include", mode="after")
    @classmethod
    def _one_resource_per_ids(cls, value: tuple[IncludedDevice, ...]) -> tuple[IncludedDevice, ...]:
        first: dict[str, IncludedDevice] = {}
        for entry in value:
            seen = first.setdefault(entry.ids, entry)
            if seen.resource != entry.resource:
                raise ValueError(f"includes {quote(entry.ids)} twice, as {quote(seen.resource)} and "
                                 f"{quote(entry.resource)}; a device is advertised under one resource")
        return value

    nvswitches: Annotated[NvswitchMode, NULL_IS_DEFAULT] = Field(
        default="auto",
        description="Pass NVIDIA NVSwitches through: auto where the node's Kata cold-plugs them "
                    "(kataVersion 4.1 or later), true always, false never. Kata before 4.1 fails "
                    "every sandbox given an NVSwitch.")
    nvlink_fabric: Annotated[NvlinkFabricModel, NULL_IS_DEFAULT] = Field(
        default="auto",
        description="NVIDIA's virtualization model for NVSwitch boards (Fabric Manager User Guide §4): "
                    "sharedNvswitch (FM on the host activates one GPU partition per pod, §7), "
                    "fullPassthrough (GPUs with their NVSwitches, FM in the guest, §6), off, or auto "
                    "(sharedNvswitch where FM answers, else fullPassthrough where Kata cold-plugs NVSwitches).")
    fabric_manager: Annotated[FabricManagerConfig, NULL_IS_DEFAULT] = Field(
        default_factory=FabricManagerConfig, description="Where Fabric Manager is (Shared NVSwitch model).")
    kata_version: Annotated[KataRelease, NULL_IS_DEFAULT] = Field(
        default="",
        description="The Kata Containers release the nodes run (containerd-shim-kata-v2 "
                    "--version), e.g. 3.25.0; empty: the agent, the device plugin and the DRA "
                    "driver find it on each node (its Kata runtimes in containerd's config), each "
                    "alike. Set, it overrides what they find.")
    link_policy: Annotated[LinkPolicy, NULL_IS_DEFAULT] = Field(
        default=health.DEFAULT_LINK_POLICY, description=health.LINK_POLICY_MEANING[0].upper()
        + health.LINK_POLICY_MEANING[1:] + ".")

    @property
    def fabric(self) -> nvlinkfabric.FabricSettings:
        """The NVLink fabric settings these devices give (the flags of the same names override them)."""
        fm = self.fabric_manager
        return nvlinkfabric.FabricSettings(self.nvlink_fabric, fm.address, fm.library, fm.gpu_module_ids)

    @property
    def selection(self) -> device_selection.Selection:
        return device_selection.Selection(
            tuple(device_selection.include_rule(e.ids, e.resource, device_selection.INCLUDE_CONFIG)
                  for e in self.include),
            tuple(device_selection.parse_exclude(e, device_selection.EXCLUDE_CONFIG) for e in self.exclude),
            self.nvswitches,
        )

    @property
    def kata_release(self) -> katarelease.KataRelease:
        """devices.kataVersion: the release typed by hand (UNKNOWN where empty: found on each node)."""
        return katarelease.parse_release(self.kata_version)


class PoolSelector(_Model):
    match_labels: Annotated[NodeSelector, NULL_IS_DEFAULT] = Field(
        default_factory=dict, description="The labels a node of the pool has, all of them (none: every node).")


class SplitPoolConfig(_Model):
    """One node pool's split (gpunode.policy.split): its nodes' VM share where they have no split
    label nvidia.com/gpu.workload.vm-passthrough.gpus (the label wins)."""

    node_selector: Annotated[PoolSelector, NULL_IS_DEFAULT] = Field(default_factory=PoolSelector)
    vm_gpus: Annotated[SplitValue, Says(
        missing="give vmGpus, the pool's VM share, as the split label's value (2, all, index.6_7, ...)")] = Field(
        description="The VM share, as the label nvidia.com/gpu.workload.vm-passthrough.gpus says it: a count "
                    "(the last GPUs in bus order), all, index.I_J, pci.B_B or model.M; the rest for containers.")


def default_runtime_classes() -> tuple[RuntimeClassConfig, ...]:
    return (
        RuntimeClassConfig(
            name=kataclasses.GPU, artifacts=Artifacts(url=DEFAULT_GPU_ARTIFACTS)
        ),
        RuntimeClassConfig(
            name=kataclasses.GPU_SNP,
            artifacts=Artifacts(url=DEFAULT_SNP_ARTIFACTS),
            node_selector={"nvidia.com/cc.capable": "true"},
        ),
    )


class KataManagerConfig(_Model):
    artifacts_dir: Annotated[AbsolutePath, NULL_IS_DEFAULT] = DEFAULT_ARTIFACTS_DIR
    # Absent: the GPU Operator's two classes; null or []: none.
    runtime_classes: Annotated[tuple[RuntimeClassConfig, ...], NULL_IS_EMPTY] = Field(
        default_factory=default_runtime_classes)
    containerd: Annotated[ContainerdConfig, NULL_IS_DEFAULT] = Field(
        default_factory=ContainerdConfig)
    runtime_class_overhead: Annotated[RuntimeClassOverhead, NULL_IS_DEFAULT] = Field(
        default_factory=RuntimeClassOverhead,
        description="Added to every RuntimeClass as overhead (what each Kata VM costs "
                    "beyond its containers).")
    insecure_registries: Annotated[
        tuple[RegistryHost, ...], NULL_IS_DEFAULT,
        Says(expect="it must be a list of host[:port]"),
    ] = Field(default=(), description="Registries (host[:port]) that may be reached over "
                                      "plain HTTP.")
    devices: Annotated[DevicesConfig, NULL_IS_DEFAULT] = Field(
        default_factory=DevicesConfig,
        description="Which PCI devices are passed through (default: NVIDIA GPUs, and NVSwitches "
                    "where the node's Kata cold-plugs them).")
    kata_deploy: Annotated[KataDeployMode, NULL_IS_DEFAULT] = Field(
        default="auto",
        description="Where kata-deploy installed Kata on a node and provides a configured runtime class "
                    "(a containerd runtime of that name): auto (default) and true use its runtime, pulling "
                    "no artifacts and registering nothing in containerd for that class, and write only the "
                    "GPU settings (pcie_root_port, pod_resource_device_sources) as a drop-in in its "
                    "config.d; true also fails a class kata-deploy does not provide; false always pulls "
                    "katamgr's own artifacts.")
    pod_resource_device_sources: Annotated[
        tuple[DeviceSource, ...], NULL_IS_DEFAULT,
        Says(expect='it must be a list of "device-plugin" and "dra"'),
    ] = Field(
        default=("device-plugin",), min_length=1,
        description="What the rendered Kata configs set as [runtime] pod_resource_device_sources: "
                    "where Kata's cold-plug takes a pod's devices from (device-plugin, and dra for "
                    "DRA claims; Kata releases without the setting ignore it).")

    splits: Annotated[
        tuple[SplitPoolConfig, ...], NULL_IS_EMPTY, Says(expect="it must be a list of {nodeSelector, vmGpus}"),
    ] = Field(default=(), description="The split of a vm-passthrough node's GPUs between VMs and containers "
                                      "per node pool: the first pool whose nodeSelector.matchLabels a node has "
                                      "gives its vmGpus, where the node has no split label (the label wins).")

    @property
    def split_pools(self) -> tuple[split.SplitPool, ...]:
        return tuple(split.SplitPool(dict(p.node_selector.match_labels), p.vm_gpus, f"splits[{i}]")
                     for i, p in enumerate(self.splits))

    @property
    def dra(self) -> bool:
        """The DRA driver serves the node's passthrough GPUs (the chart's dra.enabled sets dra here)."""
        return "dra" in self.pod_resource_device_sources

    @field_validator("pod_resource_device_sources", mode="after")
    @classmethod
    def _each_source_once(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(value)) != len(value):
            raise ValueError(f"lists a source twice ({', '.join(value)}); list each once")
        return value

    @field_validator("runtime_classes", mode="wrap")
    @classmethod
    def _names_are_unique(cls, value: Any, handler: Callable[[Any], Any]) -> Any:
        """A repeated name is reported next to the entries' own problems."""
        failure: ValidationError | None = None
        try:
            result = handler(value)
        except ValidationError as e:
            failure, result = e, None
        duplicates = []
        first: dict[str, int] = {}
        for i, entry in enumerate(value if isinstance(value, list | tuple) else ()):
            name = entry.name if isinstance(entry, RuntimeClassConfig) else (
                entry.get("name") if isinstance(entry, dict) else None)
            if not isinstance(name, str) or not k8snames.is_dns1123_label(name):
                continue  # no name, or a bad one: reported as such
            if name not in first:
                first[name] = i
                continue
            message = (f"{quote(name)} duplicates runtimeClasses[{first[name]}].name; "
                       "runtime class names must be unique")
            duplicates.append({"type": PydanticCustomError("duplicate", "{message}",
                                                           {"message": message}),
                               "loc": (i, "name"), "input": name})
        if not duplicates:
            if failure is not None:
                raise failure
            return result
        errors = [*(failure.errors(include_url=False) if failure else ()), *duplicates]
        raise ValidationError.from_exception_data(cls.__name__, errors)

    @property
    def overhead_pod_fixed(self) -> Mapping[str, str]:
        """RuntimeClass overhead.podFixed, e.g. {"memory": "160Mi", "cpu": "250m"}; empty = none."""
        return self.runtime_class_overhead.pod_fixed

    def runtime_class(self, name: str) -> RuntimeClassConfig | None:
        return next((rc for rc in self.runtime_classes if rc.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        """The YAML shape (camelCase keys) this config was loaded from."""
        return self.model_dump(mode="json", by_alias=True)


def default_config() -> KataManagerConfig:
    return KataManagerConfig()
