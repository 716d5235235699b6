"""Our device plugin .proto and its committed stubs.

The stubs must be what generate.py makes from the .proto today, and the .proto
must put the same bytes on the wire as the kubelet's v1beta1 definition.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import SHARED_REFERENCE
from google.protobuf import descriptor_pb2

from sandbox_plugin.api import generate

REFERENCE = SHARED_REFERENCE / "deviceplugin-v1beta1.proto"


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    fresh = generate.generate(tmp_path)
    for path in fresh:
        committed = generate.API_DIR / path.name
        assert committed.exists(), (
            f"{committed} is missing: run python -m sandbox_plugin.api.generate"
        )
        assert committed.read_text() == path.read_text(), (
            f"{committed.name} is stale: run python -m sandbox_plugin.api.generate and commit it"
        )


def test_stubs_import_as_a_package():
    from sandbox_plugin.api import deviceplugin_pb2, deviceplugin_pb2_grpc

    assert deviceplugin_pb2_grpc.deviceplugin__pb2 is deviceplugin_pb2
    assert deviceplugin_pb2.DESCRIPTOR.package == "v1beta1"


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
    shapes = {}

    def walk(prefix: str, messages) -> None:
        for message in messages:
            name = f"{prefix}.{message.name}"
            shapes[name] = {
                field.number: (field.name, field.type, field.label, field.type_name)
                for field in message.field
            }
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
    work = tmp_path_factory.mktemp("protos")
    reference = work / "reference" / "deviceplugin-v1beta1.proto"
    reference.parent.mkdir()
    reference.write_text(strip_gogoproto(REFERENCE.read_text()))
    ours = compile_descriptor(generate.PROTO, work)
    theirs = compile_descriptor(reference, work)
    return ours, theirs


def test_strip_gogoproto_leaves_plain_proto():
    text = (
        'import "github.com/gogo/protobuf/gogoproto/gogo.proto";\n'
        "option (gogoproto.sizer_all) = true;\n"
        'message D { string ID = 1 [(gogoproto.customname) = "ID", (gogoproto.nullable) = false]; }\n'
    )
    assert strip_gogoproto(text).strip() == "message D { string ID = 1; }"


def test_same_package_and_messages_as_the_kubelet(descriptors):
    ours, theirs = descriptors
    assert ours.package == theirs.package == "v1beta1"
    assert ours.syntax == theirs.syntax == "proto3"
    assert message_shapes(ours) == message_shapes(theirs)


def test_same_services_as_the_kubelet(descriptors):
    ours, theirs = descriptors
    assert service_shapes(ours) == service_shapes(theirs)
    assert service_shapes(ours)["DevicePlugin.ListAndWatch"][3] is True


def test_wire_compatibility_check_notices_a_changed_field(descriptors, tmp_path):
    _, theirs = descriptors
    changed = tmp_path / "deviceplugin.proto"
    changed.write_text(
        generate.PROTO.read_text().replace("int32 allocation_size = 3", "int64 allocation_size = 3")
    )
    assert message_shapes(compile_descriptor(changed, tmp_path)) != message_shapes(theirs)
