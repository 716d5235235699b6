"""The spec model (exact round trips, strict decoding) and the CDI rules on it."""

from __future__ import annotations

import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cdi
from cdi.version import version_key

# ---------------------------------------------------------------- arbitrary models

text = st.text(max_size=10)
int64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
small = st.lists(text, max_size=3)


def opt(strategy):
    return st.none() | strategy


any_edits = st.builds(
    cdi.ContainerEdits,
    env=small,
    device_nodes=st.lists(st.builds(
        cdi.DeviceNode, path=text, host_path=opt(text), type=opt(text), major=opt(int64),
        minor=opt(int64), file_mode=opt(int64), permissions=opt(text), uid=opt(int64),
        gid=opt(int64)), max_size=2),
    net_devices=st.lists(st.builds(cdi.NetDevice, host_interface_name=text, name=text),
                         max_size=2),
    hooks=st.lists(st.builds(cdi.Hook, hook_name=text, path=text, args=small, env=small,
                             timeout=opt(int64)), max_size=2),
    mounts=st.lists(st.builds(cdi.Mount, host_path=text, container_path=text, type=opt(text),
                              options=small), max_size=2),
    intel_rdt=opt(st.builds(
        cdi.IntelRdt, clos_id=opt(text), l3_cache_schema=opt(text), mem_bw_schema=opt(text),
        schemata=opt(small), enable_monitoring=opt(st.booleans()),
        enable_cmt=opt(st.booleans()), enable_mbm=opt(st.booleans()))),
    additional_gids=st.lists(int64, max_size=3),
)
any_annotations = st.dictionaries(text, text, max_size=3)
any_spec = st.builds(
    cdi.Spec, cdi_version=text, kind=text, annotations=any_annotations,
    devices=st.lists(st.builds(cdi.Device, name=text, annotations=any_annotations,
                               container_edits=any_edits), max_size=3),
    container_edits=any_edits,
)


@settings(max_examples=150, deadline=None)
@given(any_spec)
def test_model_dict_model_is_identity(spec):
    assert cdi.Spec.from_dict(spec.to_dict()) == spec


@settings(max_examples=150, deadline=None)
@given(any_spec, st.sampled_from(cdi.FORMATS))
def test_model_text_model_is_identity(spec, fmt):
    # Arbitrary strings ("yes", "0.5", "null", " x", unicode) must survive both encodings.
    assert cdi.parse_spec(cdi.dump_spec(spec, fmt), fmt, validate=False) == spec


def test_to_dict_uses_json_names_and_omits_absent_fields():
    spec = cdi.Spec(cdi_version="0.7.0", kind="nvidia.com/pgpu", devices=[cdi.Device(
        name="0", container_edits=cdi.ContainerEdits(
            device_nodes=[cdi.DeviceNode(path="/dev/vfio/7", host_path="/dev/vfio/7", major=0)],
            intel_rdt=cdi.IntelRdt(), additional_gids=[0]))])
    assert spec.to_dict() == {
        "cdiVersion": "0.7.0", "kind": "nvidia.com/pgpu",
        "devices": [{"name": "0", "containerEdits": {
            "deviceNodes": [{"path": "/dev/vfio/7", "hostPath": "/dev/vfio/7", "major": 0}],
            # present but empty: still there, since its presence needs cdiVersion 0.7.0
            "intelRdt": {},
            "additionalGids": [0]}}]}


def test_required_device_edits_are_written_even_when_empty():
    spec = cdi.Spec(cdi_version="0.3.0", kind="a/b", devices=[cdi.Device(name="x")])
    assert spec.to_dict()["devices"] == [{"name": "x", "containerEdits": {}}]


@pytest.mark.parametrize(("document", "field", "words"), [
    ({"cdiVersion": "0.5.0", "kind": "a/b", "devices": [], "extra": 1}, "extra", "not a known"),
    ({"cdiVersion": "0.5.0", "kind": "a/b", "devices": {}}, "devices", "must be a list"),
    ({"cdiVersion": "0.5.0", "kind": "a/b", "devices": [{"name": 0, "containerEdits": {}}]},
     "devices[0].name", "must be a string"),
    ({"cdiVersion": "0.5.0", "kind": "a/b", "devices": [{"name": "x", "containerEdits": {
        "deviceNodes": [{"path": "/x", "major": True}]}}]},
     "devices[0].containerEdits.deviceNodes[0].major", "must be an integer"),
    ({"cdiVersion": "0.5.0", "kind": "a/b", "devices": [{"name": "x", "containerEdits": {
        "deviceNodes": [{"path": "/x", "uid": 1.0}]}}]},
     "devices[0].containerEdits.deviceNodes[0].uid", "must be an integer"),
    ({"cdiVersion": "0.5.0", "kind": "a/b", "devices": [{"name": "x", "containerEdits": {
        "intelRdt": {"enableMonitoring": "yes"}}}]},
     "devices[0].containerEdits.intelRdt.enableMonitoring", "must be a boolean"),
    ({"cdiVersion": "0.5.0", "kind": "a/b", "devices": [{"name": "x", "containerEdits": {
        "env": ["A=1", 2]}}]}, "devices[0].containerEdits.env[1]", "must be a string"),
    ({"cdiVersion": "0.5.0", "kind": "a/b", "devices": [],
      "containerEdits": {"hooks": [{"hookName": "prestart", "path": "/x", "bogus": []}]}},
     "containerEdits.hooks[0].bogus", "not a known"),
    ({"cdiVersion": "0.5.0", "kind": "a/b", "devices": [], "annotations": {"a": None}},
     "annotations.a", "must be a string"),
    ({"cdiVersion": None, "kind": "a/b", "devices": []}, "cdiVersion", "must be a string"),
])
def test_from_dict_names_the_bad_field(document, field, words):
    with pytest.raises(cdi.SpecError) as caught:
        cdi.Spec.from_dict(document)
    assert caught.value.field == field
    assert str(caught.value).startswith(f"{field}: ")
    assert words in str(caught.value)


def test_null_optional_fields_read_as_absent():
    spec = cdi.Spec.from_dict({"cdiVersion": "0.5.0", "kind": "a/b", "annotations": None,
                               "devices": [{"name": "x", "containerEdits": {"env": None}}]})
    assert spec.annotations == {} and spec.devices[0].container_edits.env == []


# ---------------------------------------------------------------- versions

def _spec(version="0.3.0", kind="vendor.com/device", **edits):
    edits = edits or {"env": ["A=1"]}
    return cdi.Spec(cdi_version=version, kind=kind, devices=[
        cdi.Device(name="dev", container_edits=cdi.ContainerEdits(**edits))])


@pytest.mark.parametrize(("spec", "minimum", "field"), [
    (_spec(), "0.3.0", None),
    (_spec(mounts=[cdi.Mount(host_path="/a", container_path="/a", type="bind")]), "0.4.0",
     "devices[0].containerEdits.mounts[0].type"),
    (_spec(device_nodes=[cdi.DeviceNode(path="/dev/a", host_path="/dev/b")]), "0.5.0",
     "devices[0].containerEdits.deviceNodes[0].hostPath"),
    (_spec(kind="vendor.com/net.v1"), "0.6.0", "kind"),
    (_spec(intel_rdt=cdi.IntelRdt()), "0.7.0", "devices[0].containerEdits.intelRdt"),
    (_spec(additional_gids=[5]), "0.7.0", "devices[0].containerEdits.additionalGids"),
    (_spec(intel_rdt=cdi.IntelRdt(schemata=[])), "1.1.0",
     "devices[0].containerEdits.intelRdt.schemata"),
    (_spec(net_devices=[cdi.NetDevice(host_interface_name="eth1", name="n")]), "1.1.0",
     "devices[0].containerEdits.netDevices"),
])
def test_minimum_version_facts(spec, minimum, field):
    assert cdi.minimum_version(spec) == minimum
    if field:
        assert field in [r.field for r in cdi.requirements(spec) if r.version == minimum]


def test_digit_device_name_and_annotations_raise_the_minimum():
    spec = _spec()
    spec.devices[0].name = "0"
    assert cdi.minimum_version(spec) == "0.5.0"
    spec.devices[0].annotations = {"a": "b"}
    assert cdi.minimum_version(spec) == "0.6.0"


def test_pgpu_spec_needs_exactly_0_5_0():
    spec = cdi.Spec(cdi_version="0.5.0", kind="nvidia.com/pgpu",
                    container_edits=cdi.ContainerEdits(
                        device_nodes=[cdi.DeviceNode(path="/dev/vfio/vfio")]),
                    devices=[cdi.Device(name=str(i), container_edits=cdi.ContainerEdits(
                        device_nodes=[cdi.DeviceNode(path=f"/dev/vfio/{g}")]))
                             for i, g in enumerate((15, 27))])
    assert cdi.minimum_version(spec) == "0.5.0"
    cdi.validate_spec(spec)


def test_leading_v_is_accepted_like_the_reference():
    cdi.validate_spec(_spec(version="v0.5.0"))


def test_every_problem_is_reported_at_once():
    spec = _spec(version="0.3.0", kind="bad", env=["NOEQUALS"])
    spec.devices.append(cdi.Device(name="dev"))
    with pytest.raises(cdi.InvalidSpecError) as caught:
        cdi.validate_spec(spec)
    fields = [p.field for p in caught.value.problems]
    assert fields == ["kind", "devices[0].containerEdits.env[0]", "devices[1].name",
                      "devices[1].containerEdits"]
    for field in fields:
        assert field in str(caught.value)


# ---------------------------------------------------------------- generated valid specs

LETTERS, ALNUM = string.ascii_letters, string.ascii_letters + string.digits


def _name(first, inner):
    return st.builds(lambda a, mid, z: a + mid + z, st.sampled_from(first),
                     st.text(alphabet=inner, max_size=8), st.sampled_from(ALNUM))


annotation_keys = st.builds(lambda p, n: f"{p}/{n}" if p else n,
                            st.sampled_from(["", "example.com", "cdi.k8s.io"]),
                            _name(ALNUM, ALNUM + "-_."))
paths = st.sampled_from(["/dev/vfio/1", "/dev/nvidia0", "/usr/lib/x.so"])
valid_edits = st.builds(
    cdi.ContainerEdits,
    env=st.lists(st.sampled_from(["A=1", "PATH=/bin", "X="]), max_size=2),
    device_nodes=st.lists(st.builds(
        cdi.DeviceNode, path=paths, host_path=opt(paths), type=opt(st.sampled_from("bcup")),
        major=opt(st.integers(0, 511)), permissions=opt(st.sampled_from(["rw", "rwm", "none"]))),
        min_size=1, max_size=2),
    mounts=st.lists(st.builds(cdi.Mount, host_path=paths, container_path=paths,
                              type=opt(st.sampled_from(["bind", ""]))), max_size=1),
    hooks=st.lists(st.builds(cdi.Hook, hook_name=st.sampled_from(sorted(cdi.HOOK_NAMES)),
                             path=paths), max_size=1),
    intel_rdt=opt(st.builds(cdi.IntelRdt, clos_id=opt(st.sampled_from(["c1", "/"])),
                            schemata=opt(st.lists(st.just("L3:0=f"), max_size=1)),
                            enable_monitoring=opt(st.booleans()))),
    additional_gids=st.lists(st.integers(0, 2**32 - 1), max_size=2),
    net_devices=st.lists(st.builds(cdi.NetDevice, host_interface_name=st.just("eth1"),
                                   name=st.just("net1")), max_size=1),
)
valid_specs = st.builds(
    lambda vendor, class_, names, annotations, edits, spec_edits: cdi.Spec(
        cdi_version="", kind=f"{vendor}/{class_}", annotations=annotations,
        devices=[cdi.Device(name=n, container_edits=e) for n, e in zip(names, edits, strict=False)],
        container_edits=spec_edits),
    _name(LETTERS, ALNUM + "_-."), _name(LETTERS, ALNUM + "_-."),
    st.lists(_name(ALNUM, ALNUM + "_-.:"), min_size=1, max_size=3, unique=True),
    st.dictionaries(annotation_keys, text, max_size=2),
    st.lists(valid_edits, min_size=3, max_size=3),
    valid_edits,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_specs)
def test_generated_spec_is_valid_exactly_from_its_minimum_version(spec):
    spec.cdi_version = cdi.minimum_version(spec)
    assert cdi.spec_problems(spec) == []
    for fmt in cdi.FORMATS:
        assert cdi.parse_spec(cdi.dump_spec(spec, fmt), fmt) == spec
    needed = cdi.requirements(spec)
    for lower in cdi.KNOWN_VERSIONS:
        if version_key(lower) >= version_key(spec.cdi_version):
            break
        spec.cdi_version = lower
        expected = {r.field for r in needed if version_key(r.version) > version_key(lower)}
        assert {p.field for p in cdi.spec_problems(spec)} == expected
