"""An OCI layout is as untrusted as a registry: odd files fail fast with their name.

Before: an ``oci-layout`` that is ``/dev/zero`` ate memory, and a FIFO ``index.json``
or blob hung the reader forever (and with it ``katamgr run``). Each case here runs
under an alarm, so a regression fails the test instead of hanging the suite.
"""

from __future__ import annotations

import os
import shutil
import signal
from contextlib import contextmanager

import pytest
from support.paths import EXAMPLES

from katamgr.artifacts import ArtifactError, install_artifact
from katamgr.artifacts.manifest import MAX_MANIFEST_BYTES

LAYOUT = EXAMPLES / "oci-layout"
TAG = "kata-qemu-nvidia-gpu"


@contextmanager
def deadline(seconds: int):
    def expired(signum, frame):
        raise TimeoutError(f"still reading after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def copy_layout(tmp_path):
    layout = tmp_path / "layout"
    shutil.copytree(LAYOUT, layout)
    return layout


@pytest.mark.parametrize("case, fragment", [
    ("marker-is-dev-zero", "oci-layout: is a device"),
    ("index-is-fifo", "index.json: is a FIFO"),
    ("index-is-a-dir", "index.json: is a directory"),
    ("index-too-big", f"over the {MAX_MANIFEST_BYTES}-byte cap"),
    ("blob-is-fifo", "is a FIFO"),
])
def test_odd_layout_files_fail_fast_naming_the_file(tmp_path, case, fragment):
    layout = copy_layout(tmp_path)
    if case == "marker-is-dev-zero":
        (layout / "oci-layout").unlink()
        os.symlink("/dev/zero", layout / "oci-layout")
    elif case == "index-is-fifo":
        (layout / "index.json").unlink()
        os.mkfifo(layout / "index.json")
    elif case == "index-is-a-dir":
        (layout / "index.json").unlink()
        (layout / "index.json").mkdir()
    elif case == "index-too-big":
        (layout / "index.json").write_bytes(b" " * (MAX_MANIFEST_BYTES + 1))
    elif case == "blob-is-fifo":
        for blob in (layout / "blobs" / "sha256").iterdir():
            if blob.stat().st_size > 1000:  # the kernel/initrd layers, not the manifests
                blob.unlink()
                os.mkfifo(blob)
    dest = tmp_path / "rc"
    with deadline(20), pytest.raises(ArtifactError) as refused:
        install_artifact(f"oci-layout://{layout}:{TAG}", dest)
    assert fragment in str(refused.value)
    assert not dest.exists() or not any(dest.iterdir())
