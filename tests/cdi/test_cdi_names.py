"""CDI names: vendor/class/kind, device names, qualified names, annotations."""

from __future__ import annotations

import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

import cdi
from cdi.names import annotation_key_problem

LETTERS = string.ascii_letters
ALNUM = string.ascii_letters + string.digits


def _name(first: str, inner: str, max_inner: int = 20) -> st.SearchStrategy[str]:
    single = st.sampled_from(first).filter(lambda c: c in ALNUM)
    longer = st.builds(lambda a, mid, z: a + mid + z, st.sampled_from(first),
                       st.text(alphabet=inner, max_size=max_inner), st.sampled_from(ALNUM))
    return st.one_of(single, longer)


vendors = _name(LETTERS, ALNUM + "_-.")
classes = _name(LETTERS, ALNUM + "_-.")
device_names = _name(ALNUM, ALNUM + "_-.:")
# Characters no part may contain.
forbidden = st.sampled_from(list("/=!@#$%^&*() +,;'\"\\\t\né"))


@given(vendors, classes, device_names)
def test_generated_valid_names_pass_and_round_trip(vendor, class_, name):
    cdi.validate_vendor(vendor)
    cdi.validate_class(class_)
    cdi.validate_device_name(name)
    assert cdi.parse_kind(f"{vendor}/{class_}") == (vendor, class_)
    qualified = cdi.qualified_name(vendor, class_, name)
    assert qualified == f"{vendor}/{class_}={name}"
    assert cdi.parse_qualified_name(qualified) == (vendor, class_, name)
    assert cdi.is_qualified_name(qualified)


@given(vendors, st.integers(min_value=0, max_value=30), forbidden)
def test_a_forbidden_character_anywhere_in_the_vendor_fails(vendor, at, bad):
    broken = vendor[:at] + bad + vendor[at:]
    with pytest.raises(cdi.InvalidNameError) as caught:
        cdi.validate_vendor(broken)
    assert caught.value.part == "vendor"
    with pytest.raises(cdi.InvalidNameError) as caught:
        cdi.parse_qualified_name(f"{broken}/gpu=0")
    # "/" and "=" change how the name splits, so the blame may land on another part.
    if bad not in "/=":
        assert caught.value.part == "vendor"
        assert repr(broken) in str(caught.value)


@given(classes, st.sampled_from(string.digits + "_-."))
def test_class_must_start_with_a_letter(class_, first):
    with pytest.raises(cdi.InvalidNameError) as caught:
        cdi.parse_kind(f"nvidia.com/{first}{class_}")
    assert caught.value.part == "class"


@given(device_names, st.sampled_from("_-.:"))
def test_device_name_must_end_with_a_letter_or_digit(name, last):
    with pytest.raises(cdi.InvalidNameError) as caught:
        cdi.parse_qualified_name(f"nvidia.com/pgpu={name}{last}")
    assert caught.value.part == "name"


@given(device_names, st.integers(min_value=0, max_value=30),
       forbidden.filter(lambda c: c not in "/="))
def test_a_forbidden_character_in_a_device_name_fails(name, at, bad):
    with pytest.raises(cdi.InvalidNameError) as caught:
        cdi.parse_qualified_name(f"nvidia.com/pgpu={name[:at]}{bad}{name[at:]}")
    assert caught.value.part == "name"


@pytest.mark.parametrize(("device", "part"), [
    ("nvidia.com/pgpu", "device"),
    ("pgpu=0", "device"),
    ("/dev/vfio/1", "device"),
    ("nvidia.com/=0", "class"),
    ("/pgpu=0", "device"),
    ("1nvidia.com/pgpu=0", "vendor"),
    ("nvidia.com/pgpu=", "name"),
    ("nvidia.com/pgpu=-0", "name"),
    ("nvidia.com/p/gpu=0", "class"),
])
def test_parse_qualified_name_names_the_bad_part(device, part):
    with pytest.raises(cdi.InvalidNameError) as caught:
        cdi.parse_qualified_name(device)
    assert caught.value.part == part
    assert repr(device) in str(caught.value)


def test_pgpu_names_by_index_and_iommu_group():
    assert cdi.parse_qualified_name("nvidia.com/pgpu=0") == ("nvidia.com", "pgpu", "0")
    assert cdi.qualified_name("nvidia.com", "pgpu", "127") == "nvidia.com/pgpu=127"


@pytest.mark.parametrize(("plugin", "device_id", "key"), [
    ("vfio-manager", "gpu0", "cdi.k8s.io/vfio-manager_gpu0"),
    ("nvidia.com.pgpu", "15", "cdi.k8s.io/nvidia.com.pgpu_15"),
    ("plugin", "pod/uid/ctr", "cdi.k8s.io/plugin_pod_uid_ctr"),
])
def test_annotation_key(plugin, device_id, key):
    assert cdi.annotation_key(plugin, device_id) == key
    assert annotation_key_problem(key) is None


@pytest.mark.parametrize(("plugin", "device_id"), [
    ("", "gpu0"),
    ("plugin", ""),
    ("p" * 60, "gpu0"),            # 65 characters after the prefix
    ("-plugin", "gpu0"),
    ("plugin", "gpu0-"),
    ("plugin", "0000:41:00.0"),    # ':' is not allowed in an annotation key name
])
def test_annotation_key_rejects(plugin, device_id):
    with pytest.raises(cdi.InvalidNameError):
        cdi.annotation_key(plugin, device_id)


def test_annotation_key_length_limit_is_63():
    assert cdi.annotation_key("p" * 61, "g") == "cdi.k8s.io/" + "p" * 61 + "_g"
    with pytest.raises(cdi.InvalidNameError, match="64 characters"):
        cdi.annotation_key("p" * 62, "g")


def test_annotation_value_and_parse():
    devices = ["nvidia.com/pgpu=0", "nvidia.com/pgpu=1"]
    value = cdi.annotation_value(devices)
    assert value == "nvidia.com/pgpu=0,nvidia.com/pgpu=1"
    key = cdi.annotation_key("nvidia.pgpu", "req1")
    annotations = {key: value, "io.katacontainers.config.hypervisor.default_memory": "8192"}
    assert cdi.parse_annotations(annotations) == {key: devices}


@pytest.mark.parametrize("devices", [[], ["nvidia.com/pgpu"], ["nvidia.com/pgpu=0", "0"]])
def test_annotation_value_rejects(devices):
    with pytest.raises(cdi.InvalidNameError):
        cdi.annotation_value(devices)
