"""An artifacts.url that is not an OCI reference fails the render, naming the value and the
fix, by the same rule the agent's config applies (katamgr.artifacts.refs): before, an
`artifacts.url: https://...` rendered and every agent crash-looped on its config. One table of
references, judged by the chart (the real Helm engine), by the agent's config loader and by the
pattern both share."""

from __future__ import annotations

import re

import pytest
from support.chartkit import CHART, FULL, merged, render

from katamgr.artifacts.refs import REFERENCE_PATTERN
from katamgr.config import InvalidConfig, config_from_dict

pytestmark = pytest.mark.integration

DIGEST = "sha256:" + "0123456789abcdef" * 4
GOOD = [
    "nvcr.io/nvidia/cloud-native/kata-gpu-artifacts:ubuntu22.04-535.54.03",
    "registry.local:5000/kata:1",
    "localhost/kata",
    f"localhost:5000/a/b@{DIGEST}",
    "[::1]:5000/kata:t",
    f"ghcr.io/a/b:tag@{DIGEST}",
    "nvcr.io/a__b/c-d.e:1",
    "10.0.0.7:5000/mirror/kata-gpu:v1",
    " nvcr.io/nvidia/kata:1 ",
    "oci-layout:///srv/kata-layouts/gpu:ubuntu22.04",
    f"oci-layout:///srv/layouts/gpu@{DIGEST}",
    "oci-layout:///srv/a:b/c",
    "oci-layout:///srv/layout",
    "oci-layout:///srv/layout:c:d",
]
BAD = [
    "https://nvcr.io/nvidia/cloud-native/kata-gpu-artifacts:ubuntu22.04-535.54.03",
    "http://registry.local:5000/kata:1",
    "docker://nvcr.io/nvidia/kata:1",
    "nvidia/kata:1",
    "kata",
    "nvcr.io",
    "nvcr.io/",
    "nvcr.io//kata",
    "nvcr.io/Nvidia/kata:1",
    "nvcr.io/nvidia/kata:bad tag",
    "nvcr.io/nvidia/kata:-1",
    "nvcr.io/nvidia/kata@sha256:abc",
    f"nvcr.io/nvidia/kata@{DIGEST.upper()}",
    "nvcr.io/nvidia/kata:1 2",
    "oci-layout://relative/dir:t",
    "oci-layout:///srv/layout:",
    "oci-layout:///srv/layout@sha256:zz",
    "oci-layout://",
]

# Refused by the config's rule for a layout dir (absolute, not /, no '..'), which the chart
# checks apart (ksm.ociLayoutDirs): the shared pattern takes them.
BAD_LAYOUT_DIRS = ["oci-layout:///srv/../etc:t", "oci-layout:///:t", "oci-layout:///..:t"]


def agent_accepts(url: str) -> bool:
    try:
        config_from_dict({"runtimeClasses": [{"name": "kata-gpu", "artifacts": {"url": url}}]})
    except InvalidConfig:
        return False
    return True


def values(url: str) -> dict:
    return merged(FULL, {"kataManager": {"config": {"runtimeClasses": [
        {"name": "kata-gpu", "artifacts": {"url": url}}]}}})


def chart_says(helm, chart, url: str) -> str | None:
    """None when the chart renders with this url, else its error."""
    try:
        render(chart, values(url))
    except helm.HelmError as exc:
        return str(exc)
    return None


def test_the_chart_holds_the_agents_pattern():
    text = (CHART / "templates" / "_validate.tpl").read_text()
    found = re.search(r"\$pattern := `([^`]*)`", text)
    assert found and found.group(1) == REFERENCE_PATTERN


@pytest.mark.parametrize(("url", "good"), [(u, True) for u in GOOD] + [(u, False) for u in BAD + BAD_LAYOUT_DIRS])
def test_the_pattern_the_agent_and_the_chart_agree(helm, chart, url, good):
    assert agent_accepts(url) is good, url
    assert (re.search(REFERENCE_PATTERN, url) is not None) is (good or url in BAD_LAYOUT_DIRS), url
    said = chart_says(helm, chart, url)
    assert (said is None) is good, said
    if not good:
        assert "kataManager.config.runtimeClasses[0].artifacts.url" in said, said
        assert url.strip() in said or repr(url) in said or f'"{url}"' in said, said
        assert "write " in said, said


def test_a_url_scheme_is_named_with_its_fix(helm, chart):
    said = chart_says(helm, chart, "https://nvcr.io/nvidia/cloud-native/kata-gpu-artifacts:1")
    assert "drop the https:// scheme" in said, said
