"""Dead ends fixed at the command line: a failure before the report prints the ``-o json`` /
``-o yaml`` document too (kind ``Error``, with the message and the exit code), and
``--pci-ids`` naming something that is not a file says what it is.

Before: a busy node lock or a bad config printed no document on stdout, so a script reading
``-o json`` got nothing to parse; ``--pci-ids /dev/null`` was reported as "does not exist".
"""

from __future__ import annotations

import json

import yaml

from gpunode.services.lock import node_lock
from katamgr.cli import main
from nodesim.materialise import materialise
from nodesim.profiles import find_profile


def test_a_bad_config_prints_an_error_document(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("runtimeClasses: 7\n")
    code = main(["apply", "--host", "workstation-a6000", "--config", str(config), "-o", "json"])
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert code == 2
    assert (doc["kind"], doc["command"], doc["succeeded"], doc["exitCode"]) == ("Error", "apply", False, 2)
    assert doc["message"] and doc["message"] in err


def test_a_busy_node_lock_prints_an_error_document(tmp_path, capsys):
    host = materialise(find_profile("workstation-a6000"), tmp_path / "host")
    with node_lock(host, "katamgr apply (another)", 0):
        code = main(["apply", "--host-root", str(host.root), "--wait", "0", "-o", "yaml"])
    doc = yaml.safe_load(capsys.readouterr().out)
    assert code == 1 and (doc["kind"], doc["exitCode"]) == ("Error", 1)
    assert "another katamgr holds the node lock" in doc["message"] and "(katamgr apply (another))" in doc["message"]


def test_pci_ids_naming_a_device_says_so(capsys):
    code = main(["plan", "--host", "workstation-a6000", "--pci-ids", "/dev/null"])
    err = capsys.readouterr().err
    assert code == 2
    assert "pci.ids file /dev/null is not a regular file (a device, pipe or socket)" in err
    assert "does not exist" not in err
