"""image.digest: the chart names its image by digest (repository/name@sha256:...), so every
node runs exactly the bytes the release published whatever its tag points at later; and a
value that is no digest fails the render, naming it."""

from __future__ import annotations

import shutil

import pytest
from chartvalues import VALUE_SETS
from support.chartkit import (
    CHART,
    FULL,
    NAMESPACE,
    RELEASE,
    merged,
    notes,
    pod_containers,
    render,
    workloads,
)

pytestmark = pytest.mark.integration

DIGEST = "sha256:" + "0123456789abcdef" * 4
# Every workload the chart can render: each value set (sandbox on and off, the webhook, the
# uninstall hooks included, since workloads() takes hooks too).
SETS = sorted(VALUE_SETS)


def images(rendered) -> dict[str, set[str]]:
    """workload kind/name -> the images of its containers and init containers."""
    return {f"{w['kind']}/{w['metadata']['name']}": {c["image"] for c in pod_containers(w)}
            for w in workloads(rendered)}


def test_the_digest_is_empty_by_default_and_the_tag_is_used(chart):
    assert chart.merge_values({})["image"]["digest"] == ""
    used = set().union(*images(render(chart, FULL)).values())
    assert len(used) == 1 and "@" not in used.pop()


@pytest.mark.parametrize("name", SETS)
def test_every_container_of_every_workload_runs_the_digest(chart, name):
    values = merged(VALUE_SETS[name], {"image": {"digest": DIGEST, "tag": "0.2.0-rc1"}})
    found = images(render(chart, values))
    assert found, "no workload rendered"
    image = chart.merge_values(values)["image"]  # some sets name a mirror
    want = f"{image['repository']}/{image['name']}@{DIGEST}"
    # By digest alone: the tag, which the runtime would ignore beside it, is not rendered.
    assert {name: used for name, used in found.items() if used != {want}} == {}


def test_the_digest_follows_a_mirror_and_is_listed(chart):
    values = merged(FULL, {"image": {"repository": "registry.local:5000/mirror", "name": "ksm",
                                     "digest": DIGEST}})
    want = f"registry.local:5000/mirror/ksm@{DIGEST}"
    assert set().union(*images(render(chart, values)).values()) == {want}
    assert f"Image of every agent: {want}" in notes(chart, values)


@pytest.mark.parametrize("digest", [
    "sha256:" + "0" * 63,  # short
    "sha256:" + "A" * 64,  # upper case
    "sha512:" + "0" * 64,
    "0" * 64,  # no algorithm
    "latest",
])
def test_a_bad_digest_is_refused_by_the_schema_naming_it(helm, chart, digest):
    with pytest.raises(helm.HelmValuesError) as caught:
        chart.render(merged(FULL, {"image": {"digest": digest}}), name=RELEASE,
                     namespace=NAMESPACE)
    message = str(caught.value)
    assert "/image/digest" in message and digest in message, message


def test_a_bad_digest_fails_the_render_without_the_schema_too(helm, tmp_path):
    """Where the schema is not checked (helm template --skip-schema-validation, or a copy of
    the chart without it), ksm.image refuses the value itself, naming it."""
    copy = tmp_path / "chart"
    shutil.copytree(CHART, copy)
    (copy / "values.schema.json").unlink()
    with helm.Chart.load(copy) as unchecked:
        with pytest.raises(helm.HelmError) as caught:
            render(unchecked, merged(FULL, {"image": {"digest": "sha256:latest"}}))
        message = str(caught.value)
        assert 'image.digest="sha256:latest" is not an image digest' in message, message
        used = set().union(*images(render(unchecked, merged(FULL, {"image": {
            "digest": DIGEST}}))).values())
        assert used == {f"ghcr.io/kata-sandbox-manager/kata-sandbox-manager@{DIGEST}"}
