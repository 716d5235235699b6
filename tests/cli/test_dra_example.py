"""The DRA example users copy from the README (examples/dra/two-gpus-kata.yaml): valid
Kubernetes 1.35 objects, asking the chart's DeviceClass for two GPUs in a Kata VM.
tests/controlplane/test_controlplane_dra.py has the real scheduler allocate it."""

from __future__ import annotations

import pytest
import yaml
from support.paths import EXAMPLES, REPO, REQUIRE_INTEGRATION

EXAMPLE = EXAMPLES / "dra" / "two-gpus-kata.yaml"
PARTITION = EXAMPLES / "dra" / "nvlink-partition-kata.yaml"  # tests/plugin/test_nvlink_gate.py runs its claim
DRIVER = "passthrough.kata-sandbox-manager.io"


def objects(example=EXAMPLE) -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all(example.read_text()) if d}


@pytest.mark.integration
def test_the_example_is_valid_for_kubernetes_1_35():
    try:
        import kubernetes_validate
    except ImportError as exc:
        if REQUIRE_INTEGRATION:
            pytest.fail(f"kubernetes-validate is not installed ({exc})")
        pytest.skip(f"kubernetes-validate is not installed ({exc})")
    for example in (EXAMPLE, PARTITION):
        for obj in objects(example).values():
            kubernetes_validate.validate(obj, "1.35.0", strict=True)


def test_two_gpus_of_the_charts_class_aligned_for_a_kata_pod():
    found = objects()
    assert set(found) == {"ResourceClaimTemplate", "Pod"}
    spec = found["ResourceClaimTemplate"]["spec"]["spec"]["devices"]
    (request,) = spec["requests"]
    assert request["exactly"]["deviceClassName"] == f"gpu.{DRIVER}"
    assert request["exactly"]["count"] == 2
    assert f'device.attributes["{DRIVER}"].model' in request["exactly"]["selectors"][0]["cel"]["expression"]
    assert spec["constraints"] == [{"requests": ["gpus"], "matchAttribute": "resource.kubernetes.io/pcieRoot"}]
    pod = found["Pod"]
    assert pod["spec"]["runtimeClassName"] == "kata-qemu-nvidia-gpu"
    assert pod["spec"]["resourceClaims"] == [
        {"name": "gpus", "resourceClaimTemplateName": found["ResourceClaimTemplate"]["metadata"]["name"]}]
    (container,) = pod["spec"]["containers"]
    assert container["resources"] == {"claims": [{"name": "gpus"}]}
    # The driver name and classes are the chart's defaults.
    values = yaml.safe_load((REPO / "deploy/helm/kata-sandbox-manager/values.yaml").read_text())
    assert values["dra"]["driverName"] == DRIVER
