"""CDI names: vendor, class, kind, device names, qualified names and annotations.

Rules (from the CDI specification and its reference implementation):

- vendor and class: ASCII letters, digits, ``_``, ``-`` and ``.``; the first character is a
  letter and the last a letter or digit. A ``.`` in the class needs cdiVersion 0.6.0.
- kind: ``<vendor>/<class>``.
- device name: ASCII letters, digits, ``_``, ``-``, ``.`` and ``:``; first and last are a
  letter or digit. A leading digit needs cdiVersion 0.5.0.
- qualified device name: ``<vendor>/<class>=<name>``.
- annotation keys are Kubernetes qualified names; CDI injection requests use keys
  ``cdi.k8s.io/<plugin>_<device id>`` whose values are comma-separated qualified names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from cdi.errors import InvalidNameError

ANNOTATION_PREFIX = "cdi.k8s.io/"

# Kubernetes limits (apimachinery validation).
QUALIFIED_NAME_MAX = 63
DNS1123_SUBDOMAIN_MAX = 253
ANNOTATIONS_TOTAL_MAX = 256 * 1024

_LETTERS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
_DIGITS = frozenset("0123456789")
_ALNUM = _LETTERS | _DIGITS
_VENDOR_CLASS_INNER = _ALNUM | frozenset("_-.")
_DEVICE_INNER = _ALNUM | frozenset("_-.:")
_ANNOTATION_NAME_INNER = _ALNUM | frozenset("_-.")

_K8S_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = re.compile(rf"{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*")


def _check_chars(value: str, what: str, part: str, first: frozenset[str], first_desc: str,
                 inner: frozenset[str], inner_desc: str) -> None:
    if not value:
        raise InvalidNameError(part, f"{what} is empty")
    if value[0] not in first:
        raise InvalidNameError(part, f"{what} {value!r} must start with {first_desc}")
    for c in value[1:-1]:
        if c not in inner:
            raise InvalidNameError(
                part, f"{what} {value!r} contains {c!r}; only {inner_desc} are allowed")
    if value[-1] not in _ALNUM:
        raise InvalidNameError(part, f"{what} {value!r} must end with a letter or digit")


def validate_vendor(vendor: str) -> None:
    """Raise InvalidNameError(part="vendor") unless ``vendor`` is a valid CDI vendor."""
    _check_chars(vendor, "vendor", "vendor", _LETTERS, "a letter",
                 _VENDOR_CLASS_INNER, "letters, digits, '_', '-' and '.'")


def validate_class(class_: str) -> None:
    """Raise InvalidNameError(part="class") unless ``class_`` is a valid CDI class."""
    _check_chars(class_, "class", "class", _LETTERS, "a letter",
                 _VENDOR_CLASS_INNER, "letters, digits, '_', '-' and '.'")


def validate_device_name(name: str) -> None:
    """Raise InvalidNameError(part="name") unless ``name`` is a valid CDI device name.

    A leading digit is accepted here; it needs cdiVersion 0.5.0 in a spec.
    """
    _check_chars(name, "device name", "name", _ALNUM, "a letter or digit",
                 _DEVICE_INNER, "letters, digits, '_', '-', '.' and ':'")


def parse_kind(kind: str) -> tuple[str, str]:
    """Split and check ``vendor/class``; return ``(vendor, class)``."""
    vendor, sep, class_ = kind.partition("/")
    if not sep:
        raise InvalidNameError("kind", f"kind {kind!r} must have the form <vendor>/<class>")
    validate_vendor(vendor)
    validate_class(class_)
    return vendor, class_


def qualified_name(vendor: str, class_: str, name: str) -> str:
    """``vendor/class=name``, after checking each part."""
    validate_vendor(vendor)
    validate_class(class_)
    validate_device_name(name)
    return f"{vendor}/{class_}={name}"


def parse_qualified_name(device: str) -> tuple[str, str, str]:
    """Split ``vendor/class=name`` into ``(vendor, class, name)``.

    Raises InvalidNameError whose ``part`` is ``device`` when the shape is wrong, or the
    name of the bad part (``vendor``, ``class``, ``name``).
    """
    kind, sep, name = device.partition("=")
    vendor, slash, class_ = kind.partition("/")
    if not sep or not slash or device.startswith("/"):
        raise InvalidNameError(
            "device", f"CDI device {device!r} is not qualified; write it as vendor/class=name")
    for part, check, value in (("vendor", validate_vendor, vendor),
                               ("class", validate_class, class_),
                               ("name", validate_device_name, name)):
        try:
            check(value)
        except InvalidNameError as err:
            raise InvalidNameError(part, f"CDI device {device!r}: {err}") from None
    return vendor, class_, name


def is_qualified_name(device: str) -> bool:
    try:
        parse_qualified_name(device)
    except InvalidNameError:
        return False
    return True


def annotation_key_problem(key: str) -> str | None:
    """Why ``key`` is not a valid Kubernetes annotation key, or None when it is.

    Kubernetes checks annotation keys lower-cased, as qualified names: an optional
    DNS-1123 subdomain prefix and ``/``, then a name of at most 63 characters.
    """
    lowered = key.lower()
    prefix, slash, name = lowered.rpartition("/")
    if slash:
        if not prefix:
            return f"annotation key {key!r} has an empty prefix before '/'"
        if "/" in prefix:
            return f"annotation key {key!r} has more than one '/'"
        if len(prefix) > DNS1123_SUBDOMAIN_MAX or not _DNS1123_SUBDOMAIN.fullmatch(prefix):
            return (f"annotation key {key!r} has prefix {prefix!r}, which is not a DNS "
                    "subdomain (lower-case letters, digits, '-' and '.', at most 253)")
    if not name:
        return f"annotation key {key!r} has an empty name"
    if len(name) > QUALIFIED_NAME_MAX:
        return (f"annotation key {key!r} has a name of {len(name)} characters; "
                f"at most {QUALIFIED_NAME_MAX} are allowed")
    if not _K8S_NAME.fullmatch(name):
        return (f"annotation key {key!r}: the name must be letters, digits, '-', '_' or '.', "
                "starting and ending with a letter or digit")
    return None


def annotations_problems(annotations: Mapping[str, str]) -> list[tuple[str, str]]:
    """``(key, problem)`` for each bad key, and ``("", problem)`` when too large overall."""
    problems = []
    total = 0
    for key, value in annotations.items():
        problem = annotation_key_problem(key)
        if problem:
            problems.append((key, problem))
        total += len(key) + len(value)
    if total > ANNOTATIONS_TOTAL_MAX:
        problems.append(("", f"annotations take {total} bytes; at most "
                             f"{ANNOTATIONS_TOTAL_MAX} are allowed"))
    return problems


def annotation_key(plugin: str, device_id: str) -> str:
    """The ``cdi.k8s.io/<plugin>_<device id>`` key for a device plugin's CDI request.

    ``/`` in ``device_id`` becomes ``_``; the part after the prefix must be at most 63
    characters of letters, digits, ``_``, ``-`` and ``.``, starting and ending with a
    letter or digit.
    """
    if not plugin:
        raise InvalidNameError("plugin", "annotation key: the plugin name is empty")
    if not device_id:
        raise InvalidNameError("device", "annotation key: the device id is empty")
    name = f"{plugin}_{device_id.replace('/', '_')}"
    if len(name) > QUALIFIED_NAME_MAX:
        raise InvalidNameError(
            "device", f"annotation key name {name!r} has {len(name)} characters; at most "
                      f"{QUALIFIED_NAME_MAX} are allowed (use a shorter plugin or device id)")
    _check_chars(name, "annotation key name", "device", _ALNUM, "a letter or digit",
                 _ANNOTATION_NAME_INNER, "letters, digits, '_', '-' and '.'")
    return ANNOTATION_PREFIX + name


def annotation_value(devices: Iterable[str]) -> str:
    """Comma-join fully qualified device names, checking each one."""
    devices = list(devices)
    if not devices:
        raise InvalidNameError("device", "annotation value: no CDI devices given")
    for device in devices:
        parse_qualified_name(device)
    return ",".join(devices)


def parse_annotations(annotations: Mapping[str, str]) -> dict[str, list[str]]:
    """CDI injection requests in pod/container annotations: ``{key: [qualified names]}``."""
    requests: dict[str, list[str]] = {}
    for key, value in annotations.items():
        if not key.startswith(ANNOTATION_PREFIX):
            continue
        devices = value.split(",")
        for device in devices:
            parse_qualified_name(device)
        requests[key] = devices
    return requests
