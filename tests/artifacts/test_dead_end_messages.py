"""Error messages that name the real file and the fix, never a dead end.

Before: garbage served as a manifest was reported as a "'utf-16-be' codec can't decode" error
(json.loads guesses UTF-16 or -32 from the first bytes of what is not UTF-8, RFC 8259 §8.1
asking for UTF-8 and the OCI image spec's manifests being JSON); a full disk during an
artifact's download said "No space left on device" with no path (write(2) and fsync(2) name
no file). /dev/full answers every write with ENOSPC (null(4)), as a full filesystem does.
"""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import pytest

from katamgr.artifacts import ArtifactError
from katamgr.artifacts.manifest import Layer, parse_manifest
from katamgr.artifacts.verified import write_verified


@pytest.mark.parametrize("garbage", [b"\x00\x01\xff\xfe garbage", b"\xff\xfe\x00\xd8", b"\x89PNG\r\n\x1a\n\x00\x00"])
def test_garbage_served_as_a_manifest_is_said_to_be_no_manifest(garbage):
    with pytest.raises(ArtifactError) as error:
        parse_manifest(garbage, "registry.example/kata:v1")
    message = str(error.value)
    assert "codec" not in message
    assert "registry.example/kata:v1: what was served as the manifest is not UTF-8 text" in message
    assert "check that the ref names a Kata artifact" in message


def test_a_full_disk_names_the_file_being_written():
    layer = Layer("vmlinux", "sha256:" + "0" * 64, 1 << 20, "")
    with pytest.raises(OSError) as error:
        write_verified(iter([b"\0" * (1 << 20)]), Path("/dev/full"), layer, "ref", threading.Event())
    assert error.value.errno == errno.ENOSPC
    assert error.value.filename == "/dev/full" and "/dev/full" in str(error.value)
