"""The container fallback (``nvidia.com/gpu`` from NVML) with the NVML stand-in.

No GPU or libnvidia-ml exists here, so NVML is ``nodesim.nvml``
(same calls, error codes and event-set semantics as pynvml); the kubelet side
is the simulator over real gRPC.
"""

from __future__ import annotations

import logging
import re
import time

import grpc
import pytest

import cdi
from cdi.names import annotation_key_problem
from gpunode.services.backoff import Backoff
from nodesim.materialise import materialise
from nodesim.nvml import NVML_ERROR_TIMEOUT, FakeGpu, FakeNvml, NVMLError
from nodesim.profiles import find_profile
from sandbox_plugin.cli import main as plugin_main
from sandbox_plugin.container import (
    DEFAULT_DEVICE_LIST_STRATEGIES,
    RESOURCE_NAME,
    DeviceListStrategy,
    NvmlResource,
    cdi_annotation_key,
    load_pynvml,
    normalise_bus_id,
    parse_device_list_strategies,
)
from sandbox_plugin.manager import Mode, PluginManager
from sandbox_plugin.resources import HEALTHY, UNHEALTHY

UUIDS = [
    "GPU-3b2c1d4e-0000-4a5b-8c9d-000000000017",
    "GPU-3b2c1d4e-0000-4a5b-8c9d-000000000031",
    "GPU-3b2c1d4e-0000-4a5b-8c9d-0000000000ca",
]
# Three of the a10-server's GPUs, as NVML prints their bus ids.
BUS_IDS = ["00000000:17:00.0", "00000000:31:00.0", "00000000:CA:00.0"]


def fake_gpus():
    return [FakeGpu(u, b) for u, b in zip(UUIDS, BUS_IDS, strict=True)]


@pytest.fixture
def serve_container(sim_host):
    managers: list[PluginManager] = []

    def start(nvml, **kwargs):
        host, kubelet = sim_host("a10-server")
        manager = PluginManager(host, Mode.CONTAINER, nvml=nvml, backoff=Backoff(0.05, 2, 0.4), **kwargs)
        managers.append(manager)
        manager.start()
        return manager, kubelet

    yield start
    for manager in managers:
        manager.stop()


def write_gpu_spec(host, uuids) -> None:
    """A ``nvidia.com/gpu`` spec naming ``uuids``, as the NVIDIA Container Toolkit generates it."""
    devices = [
        cdi.Device(name=uuid, container_edits=cdi.ContainerEdits(
            device_nodes=[cdi.DeviceNode(path=f"/dev/nvidia{i}")]))
        for i, uuid in enumerate(uuids)
    ]
    spec = cdi.Spec(cdi_version="0.5.0", kind="nvidia.com/gpu", devices=devices,
                    container_edits=cdi.ContainerEdits(device_nodes=[cdi.DeviceNode(path="/dev/nvidiactl")]))
    cdi.write_spec(spec, host.path("/var/run/cdi"))


def health(state):
    return {d.id: d.health for d in state.devices.get(RESOURCE_NAME, [])}


def test_advertises_gpus_by_uuid_with_numa(serve_container):
    _manager, kubelet = serve_container(FakeNvml(fake_gpus()))
    state = kubelet.wait_for(lambda s: len(s.devices.get(RESOURCE_NAME, [])) == 3)
    assert [(d.id, d.health, d.numa_node) for d in state.devices[RESOURCE_NAME]] == [
        (UUIDS[0], HEALTHY, 0), (UUIDS[1], HEALTHY, 0), (UUIDS[2], HEALTHY, 1),
    ]


def test_allocate_sets_visible_devices_and_cdi_names(serve_container):
    manager, kubelet = serve_container(FakeNvml(fake_gpus()))
    write_gpu_spec(manager.host, UUIDS)
    kubelet.wait_for(lambda s: len(s.healthy(RESOURCE_NAME)) == 3)
    answer = kubelet.allocate(RESOURCE_NAME, [UUIDS[2], UUIDS[0]])
    assert dict(answer.envs) == {"NVIDIA_VISIBLE_DEVICES": f"{UUIDS[2]},{UUIDS[0]}"}
    assert [c.name for c in answer.cdi_devices] == [f"nvidia.com/gpu={UUIDS[2]}", f"nvidia.com/gpu={UUIDS[0]}"]
    with pytest.raises(grpc.RpcError) as error:
        kubelet.allocate(RESOURCE_NAME, ["GPU-nope"])
    assert "GPU-nope" in error.value.details()


def test_cdi_names_only_when_a_spec_on_the_host_defines_them(serve_container, caplog):
    manager, kubelet = serve_container(FakeNvml(fake_gpus()))
    kubelet.wait_for(lambda s: len(s.healthy(RESOURCE_NAME)) == 3)
    caplog.set_level(logging.WARNING, logger="sandbox_plugin.cdinames")

    for _ in range(2):  # no spec on the host: the variable alone
        answer = kubelet.allocate(RESOURCE_NAME, [UUIDS[0]])
        assert dict(answer.envs) == {"NVIDIA_VISIBLE_DEVICES": UUIDS[0]}
        assert list(answer.cdi_devices) == []
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and f"nvidia.com/gpu={UUIDS[0]}" in warnings[0], warnings

    write_gpu_spec(manager.host, UUIDS[:2])  # a spec that knows two of the three GPUs
    answer = kubelet.allocate(RESOURCE_NAME, [UUIDS[1], UUIDS[2]])
    assert dict(answer.envs) == {"NVIDIA_VISIBLE_DEVICES": f"{UUIDS[1]},{UUIDS[2]}"}
    assert [c.name for c in answer.cdi_devices] == [f"nvidia.com/gpu={UUIDS[1]}"]


# ---- device-list strategies ---------------------------------------------------------

MOUNTS_ROOT = "/var/run/nvidia-container-devices"
ANNOTATION_KEY = re.compile(r"cdi\.k8s\.io/sandbox-device-plugin_[0-9a-f]{16}")


def allocate_with(serve_container, strategies, uuids, *, spec=UUIDS):
    """The kubelet's Allocate answer for ``uuids`` from a plugin using ``strategies``,
    with a toolkit CDI spec on the host naming ``spec`` (None: no spec)."""
    manager, kubelet = serve_container(FakeNvml(fake_gpus()), device_list_strategies=strategies)
    if spec is not None:
        write_gpu_spec(manager.host, spec)
    kubelet.wait_for(lambda s: len(s.healthy(RESOURCE_NAME)) == 3)
    return kubelet.allocate(RESOURCE_NAME, uuids)


def mounts(answer):
    return [(m.container_path, m.host_path) for m in answer.mounts]


def cdi_annotation(answer) -> list[str]:
    """The names of the one cdi.k8s.io annotation, checked as the CDI rules and containerd read it."""
    annotations = dict(answer.annotations)
    assert len(annotations) == 1, annotations
    [key] = annotations
    assert ANNOTATION_KEY.fullmatch(key), key
    assert annotation_key_problem(key) is None
    return cdi.parse_annotations(annotations)[key]


def test_envvar_names_the_uuids_in_the_variable_only(serve_container):
    answer = allocate_with(serve_container, ["envvar"], [UUIDS[2], UUIDS[0]])
    assert dict(answer.envs) == {"NVIDIA_VISIBLE_DEVICES": f"{UUIDS[2]},{UUIDS[0]}"}
    assert (mounts(answer), dict(answer.annotations), list(answer.cdi_devices)) == ([], {}, [])


def test_volume_mounts_mount_dev_null_per_gpu_and_point_the_variable_at_them(serve_container):
    answer = allocate_with(serve_container, ["volume-mounts"], [UUIDS[2], UUIDS[0]])
    assert dict(answer.envs) == {"NVIDIA_VISIBLE_DEVICES": MOUNTS_ROOT}
    assert mounts(answer) == [(f"{MOUNTS_ROOT}/{UUIDS[2]}", "/dev/null"), (f"{MOUNTS_ROOT}/{UUIDS[0]}", "/dev/null")]
    assert all(m.read_only for m in answer.mounts)
    assert (list(answer.devices), dict(answer.annotations), list(answer.cdi_devices)) == ([], {}, [])


def test_cdi_annotations_list_the_names_the_host_spec_defines(serve_container):
    answer = allocate_with(serve_container, ["cdi-annotations"], [UUIDS[1], UUIDS[2]], spec=UUIDS[:2])
    assert cdi_annotation(answer) == [f"nvidia.com/gpu={UUIDS[1]}"]  # UUIDS[2] is not in the spec
    assert (dict(answer.envs), mounts(answer), list(answer.cdi_devices)) == ({}, [], [])


def test_cdi_annotations_without_a_spec_add_no_annotation(serve_container):
    answer = allocate_with(serve_container, ["cdi-annotations"], [UUIDS[0]], spec=None)
    assert dict(answer.annotations) == {}


def test_cdi_annotation_key_is_stable_and_differs_per_gpu_set():
    key = cdi_annotation_key([UUIDS[0], UUIDS[1]])
    assert ANNOTATION_KEY.fullmatch(key)
    assert key == cdi_annotation_key([UUIDS[0], UUIDS[1]]) != cdi_annotation_key([UUIDS[2]])


def test_cdi_cri_hands_out_only_defined_names_and_no_variable(serve_container):
    answer = allocate_with(serve_container, ["cdi-cri"], [UUIDS[1], UUIDS[2]], spec=UUIDS[:2])
    assert [c.name for c in answer.cdi_devices] == [f"nvidia.com/gpu={UUIDS[1]}"]
    assert (dict(answer.envs), mounts(answer), dict(answer.annotations)) == ({}, [], {})


def test_strategies_combine(serve_container):
    answer = allocate_with(serve_container, ["envvar,volume-mounts", "cdi-annotations", "cdi-cri"], [UUIDS[0]])
    names = [f"nvidia.com/gpu={UUIDS[0]}"]
    # As NVIDIA's plugin does: with volume-mounts the variable points at the mounts.
    assert dict(answer.envs) == {"NVIDIA_VISIBLE_DEVICES": MOUNTS_ROOT}
    assert mounts(answer) == [(f"{MOUNTS_ROOT}/{UUIDS[0]}", "/dev/null")]
    assert cdi_annotation(answer) == names
    assert [c.name for c in answer.cdi_devices] == names


def test_the_default_is_the_answer_from_before_strategies():
    assert DEFAULT_DEVICE_LIST_STRATEGIES == (DeviceListStrategy.ENVVAR, DeviceListStrategy.CDI_CRI)
    assert parse_device_list_strategies([]) == DEFAULT_DEVICE_LIST_STRATEGIES


def test_strategy_values_split_on_commas_repeat_and_keep_their_order():
    assert parse_device_list_strategies(["volume-mounts, envvar", "cdi-cri", "envvar"]) == (
        DeviceListStrategy.VOLUME_MOUNTS, DeviceListStrategy.ENVVAR, DeviceListStrategy.CDI_CRI)
    with pytest.raises(ValueError, match="'volumes'"):
        parse_device_list_strategies(["envvar,volumes"])
    with pytest.raises(ValueError, match="''"):
        parse_device_list_strategies(["envvar,"])


@pytest.mark.parametrize("args", [["--device-list-strategy", "envvar,cdi"],
                                  ["--device-list-strategy", "envvar", "--device-list-strategy=cdi"]])
def test_a_bad_strategy_exits_2_naming_it(capsys, short_root, args):
    assert plugin_main(["--host-root", str(short_root), "--workload", "container", *args]) == 2
    err = capsys.readouterr().err
    assert "--device-list-strategy" in err and "'cdi'" in err and "volume-mounts" in err


def test_critical_xid_marks_only_that_gpu_unhealthy(serve_container):
    nvml = FakeNvml(fake_gpus())
    _manager, kubelet = serve_container(nvml)
    kubelet.wait_for(lambda s: len(s.healthy(RESOURCE_NAME)) == 3)

    nvml.xid(UUIDS[1], 43)  # an application error: the GPU stays in service
    nvml.xid(UUIDS[1], 79)  # fallen off the bus
    state = kubelet.wait_for(lambda s: health(s).get(UUIDS[1]) == UNHEALTHY, timeout=3)
    assert health(state) == {UUIDS[0]: HEALTHY, UUIDS[1]: UNHEALTHY, UUIDS[2]: HEALTHY}
    with pytest.raises(grpc.RpcError) as error:
        kubelet.allocate(RESOURCE_NAME, [UUIDS[1]])
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert UUIDS[1] in error.value.details()


def test_application_xids_leave_the_gpu_healthy(a10_host):
    nvml = FakeNvml(fake_gpus())
    resource = NvmlResource(a10_host, nvml)
    resource.start()
    try:
        _wait(lambda: len(resource.devices()) == 3)
        seen = resource.changes.generation
        for xid in (13, 31, 43, 45, 68):
            nvml.xid(UUIDS[0], xid)
        nvml.xid(UUIDS[2], 48)  # double-bit ECC: critical, and processed after the others
        _wait(lambda: resource.changes.generation != seen)
        assert {d.id: d.health for d in resource.devices()} == {
            UUIDS[0]: HEALTHY, UUIDS[1]: HEALTHY, UUIDS[2]: UNHEALTHY,
        }
    finally:
        resource.stop()


def test_an_xid_nvml_cannot_attribute_marks_every_gpu(serve_container):
    nvml = FakeNvml(fake_gpus())
    _manager, kubelet = serve_container(nvml)
    kubelet.wait_for(lambda s: len(s.healthy(RESOURCE_NAME)) == 3)
    nvml.xid(None, 79)
    kubelet.wait_for(lambda s: set(health(s).values()) == {UNHEALTHY}, timeout=3)


def test_without_nvml_nothing_is_advertised_and_the_plugin_stays_up(serve_container, caplog):
    nvml = FakeNvml.missing()
    caplog.set_level(logging.WARNING, logger="sandbox_plugin.container")
    manager, kubelet = serve_container(nvml, nvml_retry_interval=0.05)
    state = kubelet.wait_for(lambda s: RESOURCE_NAME in s.devices)
    assert state.devices[RESOURCE_NAME] == []
    _wait(lambda: nvml.init_calls >= 3)  # retried, not crashed
    assert manager.servers[RESOURCE_NAME].registered
    reasons = [r.getMessage() for r in caplog.records if "advertising no GPUs" in r.getMessage()]
    assert len(reasons) == 1, reasons  # said once, not on every retry
    assert "NVML Shared Library Not Found" in reasons[0]

    # The library shows up (driver installed): the GPUs follow without a restart.
    nvml.init_error = None
    nvml.gpus = fake_gpus()
    kubelet.wait_for(lambda s: len(s.healthy(RESOURCE_NAME)) == 3, timeout=3)


def test_missing_pynvml_package_is_reported_not_raised(a10_host):
    resource = NvmlResource(a10_host, None, retry_interval=60)
    resource.nvml = None  # as when nvidia-ml-py is not installed
    resource.start()
    try:
        _wait(lambda: resource.unavailable_reason is not None)
        assert "nvidia-ml-py" in resource.unavailable_reason
        assert resource.devices() == []
    finally:
        resource.stop()


def test_real_pynvml_without_a_driver_fails_init_as_the_stand_in_does():
    pynvml = load_pynvml()
    assert pynvml is not None, "nvidia-ml-py is a dependency"
    with pytest.raises(pynvml.NVMLError) as real:
        pynvml.nvmlInit()
    fake = FakeNvml.missing()
    with pytest.raises(NVMLError) as stand_in:
        fake.nvmlInit()
    assert real.value.value == stand_in.value.value == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    assert str(real.value) == str(stand_in.value)
    assert NVML_ERROR_TIMEOUT == pynvml.NVML_ERROR_TIMEOUT
    assert FakeNvml.nvmlEventTypeXidCriticalError == pynvml.nvmlEventTypeXidCriticalError


def test_stand_in_event_sets_follow_nvml():
    nvml = FakeNvml(fake_gpus())
    with pytest.raises(NVMLError) as early:
        nvml.nvmlDeviceGetCount()
    assert early.value.value == nvml.NVML_ERROR_UNINITIALIZED
    nvml.nvmlInit()
    first, second = nvml.nvmlEventSetCreate(), nvml.nvmlEventSetCreate()
    nvml.nvmlDeviceRegisterEvents(nvml.nvmlDeviceGetHandleByIndex(0), nvml.nvmlEventTypeXidCriticalError, first)
    nvml.xid(UUIDS[0], 79)
    event = nvml.nvmlEventSetWait(first, 100)
    assert (event.eventType, event.eventData) == (nvml.nvmlEventTypeXidCriticalError, 79)
    assert nvml.nvmlDeviceGetUUID(event.device) == UUIDS[0]
    with pytest.raises(NVMLError) as timeout:
        nvml.nvmlEventSetWait(second, 10)  # nothing registered on this set
    assert timeout.value.value == NVML_ERROR_TIMEOUT
    nvml.nvmlEventSetFree(first)
    with pytest.raises(NVMLError):
        nvml.nvmlEventSetWait(first, 10)


def test_bus_ids_map_to_sysfs_addresses():
    assert normalise_bus_id("00000000:CA:00.0") == "0000:ca:00.0"
    assert normalise_bus_id("0000:17:00.0") == "0000:17:00.0"
    assert normalise_bus_id("garbage") is None


# ---- helpers ------------------------------------------------------------------------


@pytest.fixture
def a10_host(short_root):
    return materialise(find_profile("a10-server"), short_root.root)


def _wait(predicate, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout} s")
        time.sleep(0.01)
