"""Kubernetes name rules, in one place (k8s.io/apimachinery/pkg/util/validation).

DNS-1123 labels and subdomains (object names, RuntimeClass handlers, Secret names),
qualified names and label keys/values, extended resource names (what a device
plugin registers) and resource quantities. Each rule is given twice from one
source: a ``*_PATTERN`` (anchored, RE2-compatible, with the length limit inside the
pattern where a regular expression can say it) for JSON schemas such as the Helm
chart's, and a function for Python callers.

Standard library only, so that every layer can use it: the config, the cluster
layer, the containerd layer and the device plugin (which must not import
katamgr's pipeline). ``cdi/`` keeps its own rules: CDI names are not Kubernetes'.
"""

from __future__ import annotations

import json
import re

DNS1123_LABEL_MAX = 63
DNS1123_SUBDOMAIN_MAX = 253
QUALIFIED_NAME_MAX = 63  # the name part of a qualified name (after an optional prefix/)
LABEL_VALUE_MAX = 63

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_SUBDOMAIN = rf"{_LABEL}(\.{_LABEL})*"
# The name part of a qualified name, its length limit inside the pattern (1 + 61 + 1).
_QUALIFIED = rf"[A-Za-z0-9]([-A-Za-z0-9_.]{{0,{QUALIFIED_NAME_MAX - 2}}}[A-Za-z0-9])?"

# Anchored patterns (JSON Schema ``pattern`` strings). Where a limit cannot be put in
# the pattern, the ``*_MAX`` above goes into ``maxLength`` next to it.
DNS1123_LABEL_PATTERN = rf"^{_LABEL}$"  # with maxLength DNS1123_LABEL_MAX
DNS1123_SUBDOMAIN_PATTERN = rf"^{_SUBDOMAIN}$"  # with maxLength DNS1123_SUBDOMAIN_MAX
QUALIFIED_NAME_PART_PATTERN = rf"^{_QUALIFIED}$"
# A label key is a qualified name: an optional DNS-1123 subdomain prefix and "/", then
# the name part. (The prefix's own limit of 253 is the function's to check.)
LABEL_KEY_PATTERN = rf"^({_SUBDOMAIN}/)?{_QUALIFIED}$"
LABEL_KEY_MAX = DNS1123_SUBDOMAIN_MAX + 1 + QUALIFIED_NAME_MAX
LABEL_VALUE_PATTERN = rf"^({_QUALIFIED})?$"
# Non-negative quantities only: an overhead or a request below zero makes no sense.
QUANTITY_PATTERN = (
    r"^\+?(\d+(\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][-+]?\d+)?$"
)

_DNS_LABEL_RE = re.compile(_LABEL)
_DNS_SUBDOMAIN_RE = re.compile(_SUBDOMAIN)
_QUALIFIED_RE = re.compile(_QUALIFIED)
_QUANTITY_RE = re.compile(QUANTITY_PATTERN)

# Extended resources (IsExtendedResourceName): a domain, not in the *kubernetes.io/
# namespace, not starting with the quota prefix, and the quota name "requests.<name>" a
# qualified name (so the domain is a DNS-1123 subdomain, the name part at most 63).
NATIVE_RESOURCE_PREFIX = "kubernetes.io/"
# What NVIDIA's container device plugin advertises (whole GPUs, time-sliced
# shares, MIG slices): the resources a container, not a VM, is given. Here, in
# the base layer, because the webhook and the device selection both need it.
NVIDIA_CONTAINER_RESOURCES = ("nvidia.com/gpu", "nvidia.com/gpu.shared", "nvidia.com/mig-*")
QUOTA_REQUESTS_PREFIX = "requests."


def is_dns1123_label(value: str) -> bool:
    """An object name such as a RuntimeClass or its handler: ``kata-qemu-nvidia-gpu``."""
    return len(value) <= DNS1123_LABEL_MAX and _DNS_LABEL_RE.fullmatch(value) is not None


def is_dns1123_subdomain(value: str) -> bool:
    """An object name such as a Secret's, or a label key's prefix: ``nvidia.com``."""
    return (len(value) <= DNS1123_SUBDOMAIN_MAX
            and _DNS_SUBDOMAIN_RE.fullmatch(value) is not None)


def _is_qualified_part(value: str) -> bool:
    return _QUALIFIED_RE.fullmatch(value) is not None  # the pattern holds the limit


def qualified_name_problem(value: str) -> str | None:
    """Why ``value`` is not a qualified name (``[prefix/]name``, as label keys are), or None."""
    prefix, slash, name = value.rpartition("/")
    if slash and not is_dns1123_subdomain(prefix):
        return f"its prefix {_quote(prefix)} is not a DNS-1123 subdomain"
    if not _is_qualified_part(name):
        return (
            f"its name part must be 1-{QUALIFIED_NAME_MAX} characters of letters, digits, "
            "'-', '_' or '.', starting and ending with a letter or digit"
        )
    return None


def label_key_problem(key: str) -> str | None:
    """Why ``key`` is not a valid Kubernetes label key, or None."""
    return qualified_name_problem(key)


def label_value_problem(value: str) -> str | None:
    """Why ``value`` is not a valid Kubernetes label value, or None (empty is valid)."""
    if value == "" or _is_qualified_part(value):
        return None
    return (
        f"a label value must be at most {LABEL_VALUE_MAX} characters of letters, digits, "
        "'-', '_' or '.', starting and ending with a letter or digit"
    )


def is_extended_resource_name(name: str) -> bool:
    """A name the kubelet accepts from a device plugin: ``nvidia.com/GA102GL_A10``."""
    if "/" not in name or NATIVE_RESOURCE_PREFIX in name:
        return False  # a native resource (cpu, memory, kubernetes.io/...)
    if name.startswith(QUOTA_REQUESTS_PREFIX):
        return False
    return qualified_name_problem(QUOTA_REQUESTS_PREFIX + name) is None


def is_quantity(value: str) -> bool:
    """A non-negative Kubernetes quantity: ``250m``, ``160Mi``, ``1``."""
    return _QUANTITY_RE.fullmatch(value) is not None


def _quote(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)
