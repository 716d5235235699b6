"""``katamgr webhook``'s DRA rules (``--dra-driver``) over real TLS on loopback, reading
claims, templates, pods and RuntimeClasses from the API server stand-in with the client
the webhook runs (``katamgr.cluster.claimreads``, ``handlers``).

A pod's create that names a claim or template of the driver's passthrough DeviceClasses,
and a write of a claim's ``status.reservedFor`` that adds a pod, are refused outside a
Kata GPU runtime class. The status write is the one kube-scheduler's DRA plugin makes in
PreBind (pkg/scheduler/framework/plugins/dynamicresources bindClaim: ``UpdateStatus`` with
the allocation and the pod appended to ``reservedFor``), sent to admission as an UPDATE of
``resourceclaims/status``.
"""

from __future__ import annotations

import copy

import pytest
from support.apiserver import FakeApiServer
from support.podkit import KATA, container, pod, review

from katamgr.admission.draclaims import DraChecks
from katamgr.admission.rules import Policy
from katamgr.cluster.claimreads import claim_reads
from katamgr.cluster.handlers import handler_lookup

DRIVER = "passthrough.kata-sandbox-manager.io"
GPU_CLASS = f"gpu.{DRIVER}"
CLAIM_KIND = {"group": "resource.k8s.io", "version": "v1", "kind": "ResourceClaim"}

@pytest.fixture
def api():
    server = FakeApiServer().start()
    for name, handler in ((KATA, KATA), ("kata", "kata-qemu-nvidia-gpu-tdx"),
                          ("kata-qemu-nvidia-gpu-snp", "runc"), ("gvisor", "runsc")):
        server.seed({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": name},
                     "handler": handler})
    yield server
    server.stop()


@pytest.fixture
def client(api, start_webhook):
    checks = DraChecks(DRIVER, (GPU_CLASS, f"nvswitch.{DRIVER}"), *claim_reads(api.client()))
    _, client = start_webhook(Policy(handler_of=handler_lookup(api.client()), dra=checks))
    return client


def claim_spec(device_class: str = GPU_CLASS, *, first_available: bool = False) -> dict:
    if first_available:
        return {"devices": {"requests": [{"name": "gpu", "firstAvailable": [
            {"name": "small", "deviceClassName": "gpu.nvidia.com"},
            {"name": "vm", "deviceClassName": device_class}]}]}}
    return {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": device_class}}]}}


def seed_claim(api, name: str, spec: dict, *, driver: str | None = None, reserved: list | None = None) -> dict:
    obj = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
           "metadata": {"name": name, "namespace": "default"}, "spec": spec}
    if driver:
        obj["status"] = {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": driver, "pool": "node-1", "device": "gpu-0"}]}},
            "reservedFor": reserved or []}
    return api.seed(obj)


def claim_pod(runtime_class: str | None, **entry) -> dict:
    obj = pod(container(claims=["gpu"]), runtime_class=runtime_class)
    obj["spec"]["resourceClaims"] = [{"name": "gpu", **entry}]
    return obj


def denial(client, sent: dict) -> str | None:
    response = client.review("/validate", sent)["response"]
    assert response["uid"] == sent["request"]["uid"]
    return None if response["allowed"] else response["status"]["message"]


def test_a_runc_pod_naming_a_passthrough_claim_is_refused_naming_the_claim_and_the_fix(api, client):
    seed_claim(api, "shared", claim_spec())
    message = denial(client, review(claim_pod(None, resourceClaimName="shared")))
    assert message.startswith(
        'pod "demo": its resourceClaims entry "gpu" names ResourceClaim "shared", which requests '
        f"passthrough GPUs of DRA driver {DRIVER}, but the pod sets no runtimeClassName (runc); a "
        "passthrough GPU is only given to a Kata VM: set spec.runtimeClassName to a Kata GPU class")
    assert message.endswith("or use a claim of a container GPU DeviceClass")


@pytest.mark.parametrize(("runtime_class", "refused"), [
    (None, "the pod sets no runtimeClassName (runc)"),
    ("gvisor", "runtime class gvisor has handler runsc, which is not a Kata GPU runtime's"),
    # A class of the allowed name made again with handler runc: judged by the handler.
    ("kata-qemu-nvidia-gpu-snp", "runtime class kata-qemu-nvidia-gpu-snp has handler runc, which is not a "
                                 "Kata runtime's (kata, kata-*): recreate the RuntimeClass"),
    (KATA, None),
    ("kata", None),  # kata-deploy's default class: another name, a Kata GPU handler
])
def test_a_template_or_claim_of_a_passthrough_class_needs_a_kata_gpu_class(api, client, runtime_class, refused):
    api.seed({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
              "metadata": {"name": "vm-gpu", "namespace": "default"},
              "spec": {"spec": claim_spec(first_available=True)}})
    seed_claim(api, "held", claim_spec("gpu.nvidia.com"), driver=DRIVER)  # allocated ours
    for entry, what in (({"resourceClaimTemplateName": "vm-gpu"}, 'ResourceClaimTemplate "vm-gpu"'),
                        ({"resourceClaimName": "held"}, 'ResourceClaim "held"')):
        message = denial(client, review(claim_pod(runtime_class, **entry)))
        if refused is None:
            assert message is None
        else:
            assert f"names {what}, which requests passthrough GPUs" in message and refused in message


def test_claims_of_other_drivers_and_claims_not_made_yet_are_left_alone(api, client):
    seed_claim(api, "container-gpu", claim_spec("gpu.nvidia.com"), driver="gpu.nvidia.com")
    assert denial(client, review(claim_pod(None, resourceClaimName="container-gpu"))) is None
    # Not there yet: the pod waits for it; its reservation is judged when the scheduler writes it.
    assert denial(client, review(claim_pod(None, resourceClaimName="later"))) is None


def status_update(claim: dict, added: list[dict]) -> dict:
    new = copy.deepcopy(claim)
    new["status"]["reservedFor"] = claim["status"]["reservedFor"] + [
        {"resource": "pods", "name": p["metadata"]["name"], "uid": p["metadata"]["uid"]} for p in added]
    return review(new, kind=CLAIM_KIND, operation="UPDATE", subresource="status", old=claim)


def seed_pod(api, name: str, runtime_class: str | None) -> dict:
    return api.seed({**claim_pod(runtime_class, resourceClaimName="shared"),
                     "metadata": {"name": name, "namespace": "default"}})


def test_the_scheduler_may_not_reserve_a_passthrough_claim_for_a_runc_pod(api, client):
    """A claim shared by name: the Kata pod's reservation passes, a second Kata pod's too, a
    runc pod's is refused (so the scheduler's PreBind fails and the pod stays Pending)."""
    vm, vm2, plain = seed_pod(api, "vm", KATA), seed_pod(api, "vm-2", "kata"), seed_pod(api, "plain", None)
    fresh = seed_claim(api, "shared", claim_spec(), driver=DRIVER)
    assert denial(client, status_update(fresh, [vm])) is None
    held = status_update(fresh, [vm])["request"]["object"]
    assert denial(client, status_update(held, [vm2])) is None
    message = denial(client, status_update(held, [plain]))
    assert message.startswith(
        f'ResourceClaim "default/shared" holds passthrough GPUs of DRA driver {DRIVER}: pod default/plain '
        "may not be added to its reservedFor: the pod sets no runtimeClassName (runc); a passthrough GPU "
        "is only given to a Kata VM: set spec.runtimeClassName to a Kata GPU class")
    # Entries removed (the resourceclaim controller's), and claims of other drivers: never judged.
    released = copy.deepcopy(held)
    released["status"]["reservedFor"] = []
    assert denial(client, review(released, kind=CLAIM_KIND, operation="UPDATE", subresource="status",
                                 old=held)) is None
    other = seed_claim(api, "other", claim_spec("gpu.nvidia.com"), driver="gpu.nvidia.com")
    assert denial(client, status_update(other, [plain])) is None
    # A pod named that is not there (or by another UID) is refused.
    ghost = {"metadata": {"name": "ghost", "uid": "0000"}}
    assert "pod default/ghost may not be added to its reservedFor: there is no such pod" in denial(
        client, status_update(fresh, [ghost]))


def test_a_reservation_that_cannot_be_checked_is_refused(api, client):
    plain = seed_pod(api, "plain", KATA)
    fresh = seed_claim(api, "shared", claim_spec(), driver=DRIVER)
    api.stop()  # fail closed: the webhook cannot read the pod
    response = client.review("/validate", status_update(fresh, [plain]))["response"]
    assert not response["allowed"]
    assert response["status"]["code"] == 500
    assert "cannot read Pod default/plain: API server unreachable" in response["status"]["message"]
