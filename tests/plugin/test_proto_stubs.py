"""Our kubelet API .proto files and their committed stubs.

The stubs must be what generate.py makes from the .proto files today, and each
.proto must put the same bytes on the wire as the kubelet's own definition, kept
as a reference copy in tests/data/reference: the device plugin API v1beta1
(deviceplugin.proto), the PodResources API v1 (podresources.proto), the DRA plugin
service v1 (dra.proto) and the plugin registration API v1 (pluginregistration.proto).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from support.paths import TEST_DATA

from kubeletapi import generate

REFERENCE_DIR = TEST_DATA / "reference"

# name: (our .proto, the kubelet's reference copy, protobuf package)
APIS = {
    "deviceplugin": (generate.DEVICEPLUGIN_PROTO, REFERENCE_DIR / "deviceplugin-v1beta1.proto", "v1beta1"),
    "podresources": (generate.PODRESOURCES_PROTO, REFERENCE_DIR / "podresources-v1.proto", "v1"),
    "dra": (generate.DRA_PROTO, REFERENCE_DIR / "dra-v1.proto", "k8s.io.kubelet.pkg.apis.dra.v1"),
    "pluginregistration": (generate.PLUGINREGISTRATION_PROTO,
                           REFERENCE_DIR / "pluginregistration-v1.proto", "pluginregistration"),
}


def test_every_proto_here_is_generated_and_checked():
    assert set(generate.PROTOS) == set(generate.API_DIR.glob("*.proto"))
    assert {ours for ours, _, _ in APIS.values()} == set(generate.PROTOS)


def test_reference_files_are_in_the_repository_and_described():
    readme = (REFERENCE_DIR / "README.md").read_text()
    for _, reference, _ in APIS.values():
        assert reference.is_file(), f"{reference} is missing"
        assert reference.name in readme, f"README.md should say where {reference.name} comes from"


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    fresh = generate.generate(tmp_path)
    assert len(fresh) == 3 * len(generate.PROTOS)
    for path in fresh:
        committed = generate.API_DIR / path.name
        assert committed.exists(), (
            f"{committed} is missing: run python -m kubeletapi.generate"
        )
        assert committed.read_text() == path.read_text(), (
            f"{committed.name} is stale: run python -m kubeletapi.generate and commit it"
        )


@pytest.mark.parametrize("name", sorted(APIS))
def test_stubs_import_as_a_package(name):
    _, _, package = APIS[name]
    messages = importlib.import_module(f"kubeletapi.{name}_pb2")
    grpc_module = importlib.import_module(f"kubeletapi.{name}_pb2_grpc")
    assert getattr(grpc_module, f"{name}__pb2") is messages
    assert messages.DESCRIPTOR.package == package


def test_podresources_stubs_offer_the_lister_and_share_id_presence():
    import grpc

    from kubeletapi import podresources_pb2, podresources_pb2_grpc

    # Creating a channel does not connect; the stub only binds its methods.
    with grpc.insecure_channel("unix:///nonexistent/kubelet.sock") as channel:
        stub = podresources_pb2_grpc.PodResourcesListerStub(channel)
        for method in ("List", "GetAllocatableResources", "Get"):
            assert callable(getattr(stub, method))
            assert hasattr(podresources_pb2_grpc.PodResourcesListerServicer, method)
    claim = podresources_pb2.ClaimResource()
    assert not claim.HasField("share_id")
    claim.share_id = ""
    assert claim.HasField("share_id")
    # An explicitly set empty string is sent (tag 5, length 0); an unset one is not.
    assert claim.SerializeToString() == b"\x2a\x00"


def strip_gogoproto(text: str) -> str:
    """Drop gogoproto imports and options: Go code-generation hints, not wire facts."""
    text = re.sub(r'^\s*import\s+"[^"]*gogo[^"]*";\s*$', "", text, flags=re.MULTILINE)
    text = re.sub(r"^\s*option\s+\(gogoproto\.[^;]*;\s*$", "", text, flags=re.MULTILINE)
    # field options such as [(gogoproto.customname) = "ID", (gogoproto.nullable) = false]
    return re.sub(r"\s*\[\s*\(gogoproto\.[^\]]*\]", "", text)


def compile_descriptor(proto: Path, workdir: Path) -> descriptor_pb2.FileDescriptorProto:
    out = workdir / (proto.stem + ".pb")
    generate.protoc([f"-I{proto.parent}", f"--descriptor_set_out={out}", proto.name])
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    (only,) = files
    return only


def message_shapes(file: descriptor_pb2.FileDescriptorProto) -> dict:
    """Per message: each field's number, name, type, label and presence.

    A proto3 ``optional`` field has the same label as a plain one; what marks it
    is ``proto3_optional`` and membership of a synthetic oneof, so both count.
    """
    shapes = {}

    def walk(prefix: str, messages) -> None:
        for message in messages:
            name = f"{prefix}.{message.name}"
            shapes[name] = {
                field.number: (
                    field.name,
                    field.type,
                    field.label,
                    field.type_name,
                    field.proto3_optional,
                    message.oneof_decl[field.oneof_index].name
                    if field.HasField("oneof_index")
                    else None,
                )
                for field in message.field
            }
            shapes[name + ":oneofs"] = [oneof.name for oneof in message.oneof_decl]
            shapes[name + ":map_entry"] = message.options.map_entry
            walk(name, message.nested_type)

    walk(file.package, file.message_type)
    return shapes


def service_shapes(file: descriptor_pb2.FileDescriptorProto) -> dict:
    return {
        f"{service.name}.{method.name}": (
            method.input_type,
            method.output_type,
            method.client_streaming,
            method.server_streaming,
        )
        for service in file.service
        for method in service.method
    }


@pytest.fixture(scope="module")
def descriptors(tmp_path_factory):
    """name -> (our compiled descriptor, the kubelet's compiled descriptor)."""
    work = tmp_path_factory.mktemp("protos")
    (work / "reference").mkdir()
    compiled = {}
    for name, (ours, reference, _) in APIS.items():
        plain = work / "reference" / reference.name
        plain.write_text(strip_gogoproto(reference.read_text()))
        compiled[name] = (compile_descriptor(ours, work), compile_descriptor(plain, work))
    return compiled


def test_strip_gogoproto_leaves_plain_proto():
    text = (
        'import "github.com/gogo/protobuf/gogoproto/gogo.proto";\n'
        "option (gogoproto.sizer_all) = true;\n"
        'message D { string ID = 1 [(gogoproto.customname) = "ID", (gogoproto.nullable) = false]; }\n'
    )
    assert strip_gogoproto(text).strip() == "message D { string ID = 1; }"


@pytest.mark.parametrize("name", sorted(APIS))
def test_same_package_and_messages_as_the_kubelet(descriptors, name):
    ours, theirs = descriptors[name]
    assert ours.package == theirs.package == APIS[name][2]
    assert ours.syntax == theirs.syntax == "proto3"
    assert message_shapes(ours) == message_shapes(theirs)


@pytest.mark.parametrize("name", sorted(APIS))
def test_same_services_as_the_kubelet(descriptors, name):
    ours, theirs = descriptors[name]
    assert service_shapes(ours) == service_shapes(theirs)


def test_services_are_the_ones_we_call(descriptors):
    deviceplugin, _ = descriptors["deviceplugin"]
    assert service_shapes(deviceplugin)["DevicePlugin.ListAndWatch"][3] is True
    podresources, _ = descriptors["podresources"]
    assert set(service_shapes(podresources)) == {
        "PodResourcesLister.List",
        "PodResourcesLister.GetAllocatableResources",
        "PodResourcesLister.Get",
    }


def test_dra_services_are_the_paths_the_kubelet_calls(descriptors):
    # kubelet 1.35 calls /k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/<Method> on the endpoint
    # (k8s.io/kubelet pkg/apis/dra/v1/api_grpc.pb.go) and the plugin watcher calls
    # /pluginregistration.Registration/<Method> on the registration socket.
    dra, _ = descriptors["dra"]
    assert {f"/{dra.package}.{name}" for name in service_shapes(dra)} == {
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin.NodePrepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin.NodeUnprepareResources",
    }
    registration, _ = descriptors["pluginregistration"]
    assert set(service_shapes(registration)) == {
        "Registration.GetInfo", "Registration.NotifyRegistrationStatus"}
    shape = message_shapes(dra)["k8s.io.kubelet.pkg.apis.dra.v1.Device"][5]
    assert (shape[0], shape[4]) == ("share_id", True)


def test_share_id_is_proto3_optional_on_both_sides(descriptors):
    for compiled in descriptors["podresources"]:
        shape = message_shapes(compiled)["v1.ClaimResource"][5]
        assert shape[0] == "share_id"
        assert shape[4] is True
        assert shape[5] == "_share_id"


def test_wire_compatibility_check_notices_a_changed_field(descriptors, tmp_path):
    _, theirs = descriptors["deviceplugin"]
    changed = tmp_path / "deviceplugin.proto"
    text = generate.DEVICEPLUGIN_PROTO.read_text()
    assert "int32 allocation_size = 3" in text
    changed.write_text(text.replace("int32 allocation_size = 3", "int64 allocation_size = 3"))
    assert message_shapes(compile_descriptor(changed, tmp_path)) != message_shapes(theirs)


def test_wire_compatibility_check_notices_lost_presence(descriptors, tmp_path):
    _, theirs = descriptors["podresources"]
    changed = tmp_path / "podresources.proto"
    text = generate.PODRESOURCES_PROTO.read_text()
    assert "optional string share_id = 5" in text
    changed.write_text(text.replace("optional string share_id = 5", "string share_id = 5"))
    assert message_shapes(compile_descriptor(changed, tmp_path)) != message_shapes(theirs)
