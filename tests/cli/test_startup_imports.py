"""`katamgr plan` on a node loads no library it does not use.

The Kubernetes client alone took 13 of the 15 s of one `katamgr apply` in a guest
under emulation, and once crept back in through the Node reader
(tests/kernel saw every command start in 30-45 s). bench/bench_startup.py
measures the time; this test keeps the heavy imports out of the plain plan.
"""

from __future__ import annotations

import json
import subprocess
import sys

from support.paths import REPO

HEAVY = ("kubernetes", "pydantic", "oras", "requests", "ssl", "grpc", "tomlkit")

PROBE = f"""
import json, sys
from katamgr.cli import main
code = main(sys.argv[1:])
print(json.dumps({{"code": code, "loaded": sorted(m for m in {HEAVY!r} if m in sys.modules)}}))
"""


def _loaded(*argv: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_plan_on_a_node_imports_no_cluster_registry_or_config_library(tmp_path):
    result = _loaded("plan", "--host", "a10-server")
    assert result == {"code": 0, "loaded": []}


def test_plan_json_with_a_workload_given_stays_light(tmp_path):
    result = _loaded("plan", "--host", "a10-server", "--output", "json", "--workload", "vm-passthrough")
    assert result["loaded"] == []



def test_a_real_node_loads_nothing_of_the_simulated_node(tmp_path):
    # The image keeps nodesim, so every program start on a real node would find it through
    # the installed packages' metadata and import it: about 15 ms and 1.4 MiB of the device
    # plugin's start for nothing (bench_plugin.py). An unmarked root is not offered to it.
    probe = ("import json, os, sys; os.environ.pop('KATAMGR_SIMULATOR', None); "
             "from gpunode.services.simulator import open_host, REAL_NODE; "
             "from katamgr.commands.parser import build_parser; "
             f"build_parser().parse_args(['plan', '--host-root', {str(tmp_path)!r}]); "
             f"host, extras = open_host({str(tmp_path)!r}); "
             "print(json.dumps({'real': extras == REAL_NODE, 'loaded': sorted(m for m in sys.modules "
             "if m.startswith('nodesim') or m == 'importlib.metadata')}))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                          timeout=60, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"real": True, "loaded": []}
