"""Artifact refs, pull-secret credentials, manifest validation and the plain-HTTP rule."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from gpunode.errors import ConfigError
from katamgr.artifacts import (
    ArtifactError,
    Credentials,
    LayoutRef,
    RegistryRef,
    credentials_from_dockerconfigjson,
    parse_ref,
)
from katamgr.artifacts.manifest import MAX_MANIFEST_BYTES, parse_manifest, sha256_digest
from katamgr.artifacts.remote import use_plain_http

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("nvcr.io/nvidia/kata-gpu-artifacts:v1.2",
         RegistryRef("nvcr.io", "nvidia/kata-gpu-artifacts", "v1.2", None)),
        (f"127.0.0.1:5000/kata/gpu@{DIGEST}", RegistryRef("127.0.0.1:5000", "kata/gpu", None, DIGEST)),
        (f"localhost/kata:t@{DIGEST}", RegistryRef("localhost", "kata", "t", DIGEST)),
        ("[::1]:5000/kata", RegistryRef("[::1]:5000", "kata", "latest", None)),
        ("oci-layout:///srv/layout:kata-qemu-nvidia-gpu",
         LayoutRef(Path("/srv/layout"), "kata-qemu-nvidia-gpu", None)),
        (f"oci-layout://rel/dir@{DIGEST}", LayoutRef(Path("rel/dir"), None, DIGEST)),
        ("oci-layout:///srv/layout", LayoutRef(Path("/srv/layout"), None, None)),
    ],
)
def test_parse_ref_accepts_the_three_forms(text, expected):
    assert parse_ref(text) == expected


def test_registry_ref_reference_prefers_the_digest():
    ref = parse_ref(f"nvcr.io/kata:v1@{DIGEST}")
    assert ref.reference == DIGEST
    assert str(ref) == f"nvcr.io/kata:v1@{DIGEST}"


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("kata-artifacts:v1", "kata-artifacts:v1"),  # no registry host
        ("nvcr.io/Kata:v1", "'Kata'"),
        ("nvcr.io/kata:bad tag", "'bad tag'"),
        ("nvcr.io/kata@sha256:1234", "'sha256:1234'"),
        ("https://nvcr.io/kata:v1", "https://nvcr.io/kata:v1"),
        ("oci-layout://", "oci-layout://"),
        ("", "''"),
    ],
)
def test_parse_ref_names_the_bad_value(text, named):
    with pytest.raises(ConfigError) as error:
        parse_ref(text)
    assert named in str(error.value)


def _config(auths: dict) -> bytes:
    return json.dumps({"auths": auths}).encode()


def test_credentials_from_auth_field():
    auth = base64.b64encode(b"robot$kata:pa:ss").decode()
    data = _config({"nvcr.io": {"auth": auth}, "other.io": {"auth": "eDp5"}})
    assert credentials_from_dockerconfigjson(data, "nvcr.io") == Credentials("robot$kata", "pa:ss")


def test_credentials_from_username_password_and_url_keys():
    data = _config(
        {"https://registry.example.com:5000/v2/": {"username": "u", "password": "hunter2"}}
    )
    creds = credentials_from_dockerconfigjson(data, "registry.example.com:5000")
    assert creds == Credentials("u", "hunter2")
    assert "hunter2" not in repr(creds)  # the password never reaches a log


def test_credentials_docker_hub_aliases_and_missing_registry():
    data = _config({"https://index.docker.io/v1/": {"username": "u", "password": "p"}})
    assert credentials_from_dockerconfigjson(data, "docker.io") == Credentials("u", "p")
    assert credentials_from_dockerconfigjson(data, "nvcr.io") is None


def test_credentials_from_secret_data_mapping_as_the_api_returns_it():
    inner = _config({"nvcr.io": {"username": "u", "password": "p"}})
    secret_data = {".dockerconfigjson": base64.b64encode(inner).decode()}
    assert credentials_from_dockerconfigjson(secret_data, "nvcr.io") == Credentials("u", "p")


@pytest.mark.parametrize(
    ("data", "named"),
    [
        (b"{not json", "not valid JSON"),
        (b"[]", "not a JSON object"),
        (_config({"nvcr.io": {"auth": "!!!not-base64"}}), "'nvcr.io'"),
        (_config({"nvcr.io": {"auth": base64.b64encode(b"nocolon").decode()}}), "'nvcr.io'"),
        (_config({"nvcr.io": {"identitytoken": "x"}}), "'nvcr.io'"),
    ],
)
def test_malformed_pull_secret_names_secret_and_registry(data, named):
    with pytest.raises(ConfigError) as error:
        credentials_from_dockerconfigjson(data, "nvcr.io", secret="gpu-operator/ngc-secret")
    assert "gpu-operator/ngc-secret" in str(error.value)
    assert named in str(error.value)


@pytest.mark.parametrize(
    ("registry", "insecure", "plain"),
    [
        ("127.0.0.1:5000", (), True),
        ("127.1.2.3", (), True),
        ("localhost:5000", (), True),
        ("[::1]:5000", (), True),
        ("nvcr.io", (), False),
        ("10.0.0.5:5000", (), False),
        ("10.0.0.5:5000", ("10.0.0.5:5000",), True),
        ("mirror.local:5000", ("mirror.local",), True),
    ],
)
def test_plain_http_only_for_loopback_or_listed_registries(registry, insecure, plain):
    assert use_plain_http(registry, insecure) is plain


def _manifest(layers: list[dict], **extra) -> bytes:
    doc = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.empty.v1+json", "size": 2,
                   "digest": sha256_digest(b"{}")},
        "layers": layers,
        **extra,
    }
    return json.dumps(doc).encode()


def _layer(title: str | None, size: int = 3, digest: str = DIGEST) -> dict:
    layer = {"mediaType": "application/vnd.kata-containers.artifact.v1", "size": size,
             "digest": digest}
    if title is not None:
        layer["annotations"] = {"org.opencontainers.image.title": title}
    return layer


def test_parse_manifest_gives_files_digest_and_sizes():
    data = _manifest([_layer("vmlinux", 10), _layer("kata.toml", 5, "sha256:" + "cd" * 32)])
    manifest = parse_manifest(data, "ref")
    assert manifest.digest == sha256_digest(data)
    assert [(layer.name, layer.size) for layer in manifest.layers] == [("vmlinux", 10),
                                                                       ("kata.toml", 5)]


@pytest.mark.parametrize(
    "title", ["../../etc/passwd", "/etc/passwd", "..", ".", "sub/file", "a\\b",
              ".katamgr-artifact.json", ""],
)
def test_parse_manifest_refuses_file_names_that_escape(title):
    with pytest.raises(ArtifactError) as error:
        parse_manifest(_manifest([_layer(title)]), "nvcr.io/kata:v1")
    assert "nvcr.io/kata:v1" in str(error.value)
    assert DIGEST in str(error.value)


@pytest.mark.parametrize(
    ("data", "named"),
    [
        (_manifest([_layer("a"), _layer("a")]), "'a'"),
        (_manifest([_layer("big", 11)]), "10-byte cap"),
        (_manifest([_layer("a", -1)]), "-1"),
        (_manifest([_layer("a", digest="md5:00")]), "md5:00"),
        (_manifest([]), "no layers"),
        (json.dumps({"schemaVersion": 2, "manifests": []}).encode(), "image index"),
        (b"x" * (MAX_MANIFEST_BYTES + 1), "cap"),
        (b"not json", "not valid JSON"),
    ],
)
def test_parse_manifest_refuses_bad_manifests(data, named):
    with pytest.raises(ArtifactError) as error:
        parse_manifest(data, "nvcr.io/kata:v1", max_layer_bytes=10)
    assert named in str(error.value)


def test_parse_manifest_checks_the_expected_digest():
    data = _manifest([_layer("a")])
    with pytest.raises(ArtifactError) as error:
        parse_manifest(data, "nvcr.io/kata@" + DIGEST, expected_digest=DIGEST)
    assert sha256_digest(data) in str(error.value) and DIGEST in str(error.value)
