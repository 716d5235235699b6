"""HTTP/2 conformance of the device plugin's socket: h2spec, the suite, against the live plugin.

h2spec (github.com/summerwind/h2spec v2.2.1, pinned in hack/h2spec/go.mod and built by
hack/h2spec/build into the user's cache dir) speaks HTTP/2 over TCP only, so it reaches
the plugin's unix socket through a loopback forwarder (forwarder.py) that passes every
byte and every close through as it comes. It runs all of its 146 cases, strict mode
(-S) included, with its defaults otherwise; every one must pass. h2spec asks for ``/``
with GET and expects an answer: the plugin answers any request that is not a gRPC call
with HTTP 415 (or 405, 400) and a line of text, after the whole request came (so that
the request's own errors are found first), as gRPC's HTTP/2 mapping asks.
"""

from __future__ import annotations

import shutil
import subprocess
import xml.etree.ElementTree as ET

import pytest
from forwarder import Forwarder
from support.paths import REPO, REQUIRE_INTEGRATION

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def h2spec() -> str:
    go = shutil.which("go") or (REPO / ".venv/bin/go").exists()
    if not go:
        why = "no Go toolchain to build h2spec (hack/h2spec/build)"
        if REQUIRE_INTEGRATION:
            pytest.fail(why)
        pytest.skip(why)
    built = subprocess.run([str(REPO / "hack/h2spec/build")], capture_output=True, text=True,
                           timeout=1800, check=False)
    assert built.returncode == 0, built.stderr
    return built.stdout.strip()


def test_the_plugin_passes_every_h2spec_case(h2spec, start_plugin, tmp_path):
    plugin = start_plugin()
    report = tmp_path / "h2spec.xml"
    with Forwarder(str(plugin.socket)) as forwarder:
        done = subprocess.run([h2spec, "-S", "-p", str(forwarder.port), "-o", "5", "-j", str(report)],
                              capture_output=True, text=True, timeout=600, check=False)
    cases = ET.parse(report).getroot().iter("testcase")
    failed, passed = [], 0
    for case in cases:
        name = f"{case.get('package')}: {case.get('classname')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(name)
        elif case.find("skipped") is None:
            passed += 1
    assert not failed, f"h2spec failed {len(failed)}: {failed}\n{done.stdout[-3000:]}"
    assert passed == 146, done.stdout[-3000:]
    assert done.returncode == 0
    assert plugin.process.poll() is None
