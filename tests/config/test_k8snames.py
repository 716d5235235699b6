"""Kubernetes name rules (gpunode.k8snames): the functions, and the patterns the chart's
schema gets, say the same."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpunode import k8snames
from sandbox_plugin.resources import validate_resource_name

NAMEISH = st.text(alphabet="aZ09-_./", max_size=70)


@pytest.mark.parametrize("value, label, subdomain", [
    ("kata-qemu-nvidia-gpu", True, True),
    ("nvidia.com", False, True),
    ("a", True, True),
    ("k" * 63, True, True),
    ("k" * 64, False, True),
    ("Kata", False, False),
    ("-kata", False, False),
    ("kata-", False, False),
    ("a..b", False, False),
    ("", False, False),
    ("kata\n", False, False),
    (".".join(["a" * 63] * 4), False, False),  # 255 characters
])
def test_dns1123(value, label, subdomain):
    assert k8snames.is_dns1123_label(value) is label
    assert k8snames.is_dns1123_subdomain(value) is subdomain


@pytest.mark.parametrize("key, problem", [
    ("nvidia.com/gpu.workload.config", None),
    ("pool", None),
    ("a_b.c-d", None),
    ("Bad_Prefix/x", 'its prefix "Bad_Prefix" is not a DNS-1123 subdomain'),
    ("-x", "its name part must be 1-63 characters"),
    ("example.com/", "its name part must be 1-63 characters"),
    ("x" * 64, "its name part must be 1-63 characters"),
])
def test_label_keys(key, problem):
    found = k8snames.label_key_problem(key)
    assert (found is None) if problem is None else (problem in found), found


@pytest.mark.parametrize("value, ok", [
    ("", True), ("true", True), ("vm-passthrough", True), ("v" * 63, True), ("v" * 64, False),
    ("bad value", False), ("-x", False), ("x.", False),
])
def test_label_values(value, ok):
    assert (k8snames.label_value_problem(value) is None) is ok


@pytest.mark.parametrize("name, ok", [
    ("nvidia.com/GA102GL_A10", True),
    ("nvidia.com/gpu", True),
    ("nvidia.com/PCI_22a3", True),
    ("example.com/" + "n" * 63, True),
    ("example.com/" + "n" * 64, False),
    ("gpu", False),  # no domain: a native resource
    ("kubernetes.io/gpu", False),
    ("foo.kubernetes.io/gpu", False),  # the *kubernetes.io/ namespace is native
    ("requests.nvidia.com/gpu", False),
    ("Nvidia.com/gpu", False),
    ("nvidia.com/GA102GL [A10]", False),
    ("nvidia.com/_gpu", False),
])
def test_extended_resource_names_are_what_the_kubelet_accepts(name, ok):
    assert k8snames.is_extended_resource_name(name) is ok
    if ok:
        validate_resource_name(name)
    else:
        with pytest.raises(ValueError, match="is not a valid extended resource name"):
            validate_resource_name(name)


@pytest.mark.parametrize("value, ok", [
    ("250m", True), ("160Mi", True), ("1", True), ("0.25", True), (".5", True), ("1e3", True),
    ("+1", True), ("-1", False), ("160MB", False), ("NaN", False), ("", False), ("1 Gi", False),
])
def test_quantities(value, ok):
    assert k8snames.is_quantity(value) is ok


@given(NAMEISH)
def test_patterns_say_what_the_functions_say(value):
    def match(pattern: str, limit: int | None = None) -> bool:
        return re.search(pattern, value) is not None and (limit is None or len(value) <= limit)

    assert match(k8snames.DNS1123_LABEL_PATTERN, k8snames.DNS1123_LABEL_MAX) == (
        k8snames.is_dns1123_label(value))
    assert match(k8snames.DNS1123_SUBDOMAIN_PATTERN, k8snames.DNS1123_SUBDOMAIN_MAX) == (
        k8snames.is_dns1123_subdomain(value))
    assert match(k8snames.LABEL_VALUE_PATTERN) == (k8snames.label_value_problem(value) is None)
    # The prefix's own limit (253) is beyond a pattern; these values are shorter.
    assert match(k8snames.LABEL_KEY_PATTERN, k8snames.LABEL_KEY_MAX) == (
        k8snames.label_key_problem(value) is None)
