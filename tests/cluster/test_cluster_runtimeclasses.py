"""RuntimeClasses through the official client against the API server stand-in."""

from __future__ import annotations

import logging

import pytest
from kubernetes.client import ApiClient, Configuration
from support.apiserver import FakeApiServer
from support.apistore import APPLY

from gpunode.errors import GpuNodeError
from gpunode.kataclasses import offer_label
from katamgr.cluster import (
    FIELD_MANAGER,
    MANAGED_BY_LABEL,
    MANAGED_BY_VALUE,
    reconcile_runtime_classes,
)
from katamgr.cluster.runtimeclasses import delete_managed_runtime_classes
from katamgr.config import (
    DEFAULT_GPU_ARTIFACTS,
    Artifacts,
    RuntimeClassConfig,
    RuntimeClassOverhead,
    default_config,
)

GPU, SNP = "kata-qemu-nvidia-gpu", "kata-qemu-nvidia-gpu-snp"




def runtime_class(name, labels=None, handler=None, **spec) -> dict:
    return {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
            "metadata": {"name": name, "labels": labels or {}},
            "handler": handler or name, **spec}


def replace(config, **changes):
    """A copy of a (frozen) config model with some fields changed."""
    if "overhead_pod_fixed" in changes:
        changes["runtime_class_overhead"] = RuntimeClassOverhead(
            pod_fixed=changes.pop("overhead_pod_fixed"))
    return config.model_copy(update=changes)


def with_selector(config, name, selector):
    classes = tuple(replace(rc, node_selector=selector) if rc.name == name else rc
                    for rc in config.runtime_classes)
    return replace(config, runtime_classes=classes)


def test_first_reconcile_creates_each_class_by_server_side_apply(server, api):
    changes = reconcile_runtime_classes(api, default_config())

    assert changes.created == (GPU, SNP)
    assert changes.changed
    gpu = server.get("runtimeclasses", GPU)
    assert gpu["handler"] == GPU
    assert gpu["scheduling"]["nodeSelector"] == {"nvidia.com/gpu.workload.config": "vm-passthrough",
                                                 offer_label(GPU): "true"}
    assert gpu["metadata"]["labels"] == {MANAGED_BY_LABEL: MANAGED_BY_VALUE}
    assert "overhead" not in gpu
    snp = server.get("runtimeclasses", SNP)
    assert snp["scheduling"]["nodeSelector"] == {"nvidia.com/cc.capable": "true", "nvidia.com/cc.ready.state": "true",
                                                 offer_label(SNP): "true"}
    writes = server.writes()
    assert [(w.method, w.path) for w in writes] == [
        ("PATCH", f"/apis/node.k8s.io/v1/runtimeclasses/{GPU}"),
        ("PATCH", f"/apis/node.k8s.io/v1/runtimeclasses/{SNP}"),
    ]
    for w in writes:
        assert w.content_type == APPLY
        assert w.query["fieldManager"] == [FIELD_MANAGER]
        assert w.query["force"] == ["true"]
    assert [e["manager"] for e in gpu["metadata"]["managedFields"]] == [FIELD_MANAGER]


def test_second_reconcile_with_nothing_to_do_writes_nothing(server, api):
    reconcile_runtime_classes(api, default_config())
    versions = {n: server.get("runtimeclasses", n)["metadata"]["resourceVersion"]
                for n in (GPU, SNP)}
    server.clear_log()

    changes = reconcile_runtime_classes(api, default_config())

    assert changes.unchanged == (GPU, SNP)
    assert not changes.changed
    assert server.writes() == []
    assert len(server.requests) == 1  # one LIST
    assert {n: server.get("runtimeclasses", n)["metadata"]["resourceVersion"]
            for n in (GPU, SNP)} == versions


def test_changed_node_selector_updates_only_that_class_and_drops_the_old_key(server, api):
    reconcile_runtime_classes(api, default_config())
    server.clear_log()

    config = with_selector(default_config(), GPU, {"example.com/kata": "yes"})
    changes = reconcile_runtime_classes(api, config)

    assert changes.updated == (GPU,)
    assert changes.unchanged == (SNP,)
    assert [w.path.rsplit("/", 1)[1] for w in server.writes()] == [GPU]
    # The default selector we applied before is gone, not merged with the new one.
    assert server.get("runtimeclasses", GPU)["scheduling"]["nodeSelector"] == {
        "example.com/kata": "yes", offer_label(GPU): "true"}
    assert not reconcile_runtime_classes(api, config).changed


def test_overhead_is_applied_and_removed_with_the_config(server, api):
    with_overhead = replace(default_config(), overhead_pod_fixed={"memory": "160Mi", "cpu": "250m"})
    assert reconcile_runtime_classes(api, with_overhead).created == (GPU, SNP)
    assert server.get("runtimeclasses", GPU)["overhead"] == {
        "podFixed": {"memory": "160Mi", "cpu": "250m"}}
    assert not reconcile_runtime_classes(api, with_overhead).changed

    changes = reconcile_runtime_classes(api, default_config())

    assert changes.updated == (GPU, SNP)
    assert "overhead" not in server.get("runtimeclasses", GPU)
    assert not reconcile_runtime_classes(api, default_config()).changed


def test_quantities_the_server_canonicalised_count_as_unchanged(server, api):
    server.seed(runtime_class(
        GPU, labels={MANAGED_BY_LABEL: MANAGED_BY_VALUE},
        scheduling={"nodeSelector": {"nvidia.com/gpu.workload.config": "vm-passthrough",
                                     offer_label(GPU): "true"}},
        overhead={"podFixed": {"cpu": "0.25", "memory": "160Mi"}}))
    config = replace(default_config(), runtime_classes=default_config().runtime_classes[:1],
                     overhead_pod_fixed={"cpu": "250m", "memory": "160Mi"})

    assert reconcile_runtime_classes(api, config).unchanged == (GPU,)
    assert server.writes() == []


def test_fields_added_by_someone_else_do_not_cause_endless_writes(server, api):
    reconcile_runtime_classes(api, default_config())

    def add_toleration_and_label(obj):
        obj["scheduling"]["tolerations"] = [{"key": "gpu", "operator": "Exists"}]
        obj["metadata"]["labels"]["team"] = "ml"

    server.update("runtimeclasses", GPU, add_toleration_and_label)
    server.clear_log()

    assert reconcile_runtime_classes(api, default_config()).unchanged == (GPU, SNP)
    assert server.writes() == []


def test_managed_class_that_left_the_config_is_deleted_foreign_ones_stay(server, api):
    reconcile_runtime_classes(api, default_config())
    server.seed(runtime_class("kata-qemu"))  # installed by kata-deploy: no label
    server.seed(runtime_class("gvisor", handler="runsc",
                              labels={MANAGED_BY_LABEL: "someone-else"}))
    only_gpu = replace(default_config(), runtime_classes=default_config().runtime_classes[:1])
    server.clear_log()

    changes = reconcile_runtime_classes(api, only_gpu)

    assert changes.deleted == (SNP,)
    assert changes.unchanged == (GPU,)
    assert server.names("runtimeclasses") == ["gvisor", "kata-qemu", GPU]
    [delete] = server.writes()
    assert delete.method == "DELETE" and delete.path.endswith(f"/{SNP}")
    assert delete.body["preconditions"]["resourceVersion"]


def test_revert_deletes_only_our_classes(server, api):
    reconcile_runtime_classes(api, default_config())
    server.seed(runtime_class("kata-qemu"))

    changes = delete_managed_runtime_classes(api, default_config())

    assert changes.deleted == (GPU, SNP)
    assert server.names("runtimeclasses") == ["kata-qemu"]


def test_revert_finds_the_classes_katamgr_created_by_label_not_by_the_config(server, api):
    """The uninstall hook reverts with the config of the last upgrade; a class an earlier
    config created is ours by its label and goes too."""
    reconcile_runtime_classes(api, default_config())  # an earlier config: both classes
    server.seed(runtime_class("kata-qemu"))  # kata-deploy's, unlabeled
    server.clear_log()

    changes = delete_managed_runtime_classes(api, replace(default_config(), runtime_classes=()))

    assert changes.deleted == (GPU, SNP) and changes.refused == ()
    assert server.names("runtimeclasses") == ["kata-qemu"]
    [listing] = [r for r in server.requests if r.method == "GET"]
    assert listing.query["labelSelector"] == [f"{MANAGED_BY_LABEL}=kata-sandbox-manager"]


def test_a_labeled_class_this_account_may_not_delete_is_left_and_named(server, api):
    """RBAC grants the hook delete only on its release's class names (resourceNames): a class
    another release created carries the same label, and its 403 is not a failed revert."""
    from support.apiobjects import ApiError

    reconcile_runtime_classes(api, default_config())

    def forbid(method, path):
        if method == "DELETE" and path.endswith(f"/{SNP}"):
            raise ApiError(403, "Forbidden", f'runtimeclasses.node.k8s.io "{SNP}" is forbidden')

    server.on_request = forbid
    changes = delete_managed_runtime_classes(api)
    assert changes.deleted == (GPU,) and changes.refused == (SNP,)
    assert server.names("runtimeclasses") == [SNP]


def test_class_deleted_by_someone_else_meanwhile_is_not_an_error(server, api):
    reconcile_runtime_classes(api, default_config())

    def race(method, path):
        if method == "DELETE" and path.endswith(f"/{GPU}"):
            server.remove("runtimeclasses", SNP)

    server.on_request = race
    changes = reconcile_runtime_classes(api, replace(default_config(), runtime_classes=()))

    assert changes.deleted == (GPU,)  # SNP's delete got 404: already gone
    assert server.names("runtimeclasses") == []


def test_class_changed_before_delete_is_left_alone(server, api, caplog):
    reconcile_runtime_classes(api, default_config())

    def race(method, path):
        if method == "DELETE" and path.endswith(f"/{SNP}"):
            server.update("runtimeclasses", SNP,
                          lambda o: o["metadata"]["labels"].update(owner="admin"))

    server.on_request = race
    with caplog.at_level(logging.WARNING):
        changes = reconcile_runtime_classes(api, replace(default_config(), runtime_classes=()))

    assert changes.deleted == (GPU,)
    assert server.names("runtimeclasses") == [SNP]  # 409 on the precondition: kept
    assert f"RuntimeClass {SNP} changed while reconciling" in caplog.text


def test_unlabeled_class_with_our_name_is_adopted(server, api):
    server.seed(runtime_class(GPU, scheduling={"nodeSelector": {"old": "selector"}}))

    changes = reconcile_runtime_classes(api, default_config())

    assert changes.updated == (GPU,) and changes.created == (SNP,)
    gpu = server.get("runtimeclasses", GPU)
    assert gpu["metadata"]["labels"][MANAGED_BY_LABEL] == MANAGED_BY_VALUE


def test_class_with_another_handler_is_reported_and_the_rest_still_reconciled(server, api):
    server.seed(runtime_class(GPU, handler="kata"))

    with pytest.raises(GpuNodeError, match=rf"RuntimeClass {GPU} exists with handler 'kata'.*"
                                           r"kubectl delete runtimeclass"):
        reconcile_runtime_classes(api, default_config())

    assert server.get("runtimeclasses", GPU)["handler"] == "kata"
    assert server.get("runtimeclasses", SNP)["handler"] == SNP


def test_new_class_in_the_config_is_created_next_to_existing_ones(server, api):
    reconcile_runtime_classes(api, default_config())
    extra = RuntimeClassConfig(name="kata-qemu-nvidia-gpu-tdx",
                               artifacts=Artifacts(url=DEFAULT_GPU_ARTIFACTS),
                               node_selector={"nvidia.com/cc.capable": "true"})
    config = replace(default_config(),
                     runtime_classes=(*default_config().runtime_classes, extra))

    changes = reconcile_runtime_classes(api, config)

    assert changes.created == ("kata-qemu-nvidia-gpu-tdx",)
    assert changes.unchanged == (GPU, SNP)


def test_refused_credentials_give_an_rbac_hint():
    with FakeApiServer(token="s3cret") as server:
        api = ApiClient(Configuration(host=server.url))  # no token
        with pytest.raises(GpuNodeError, match=r"cannot list RuntimeClasses: HTTP 401.*grant"):
            reconcile_runtime_classes(api, default_config())


def test_unreachable_api_server_is_a_clear_error():
    with FakeApiServer() as server:
        url = server.url
    configuration = Configuration(host=url)
    configuration.retries = 0
    with pytest.raises(GpuNodeError, match="API server unreachable"):
        reconcile_runtime_classes(ApiClient(configuration), default_config())
