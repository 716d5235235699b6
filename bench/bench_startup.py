"""Start-up time of `katamgr plan` on a simulated node, with and without the
Kubernetes client imported.

`plan` on a node talks to no cluster unless it must read the Node's workload
label, so the Kubernetes client (over a second to import in a slow guest) is
imported only on the code paths that talk to the API server. "before" runs the
same command with the client imported first, as every run paid before the
lazy import; "after" is the command as it is. Also shown: the bare
interpreter's start, the floor under both.

Target: `katamgr plan` under 0.5 s on this machine. Prints figures; asserts nothing.
Run: .venv/bin/python bench/bench_startup.py [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from nodesim.materialise import materialise  # noqa: E402
from nodesim.profiles import find_profile  # noqa: E402

EAGER = "import kubernetes.client, kubernetes.config, sys; from katamgr.cli import main; sys.exit(main())"
LAZY = "import sys; from katamgr.cli import main; sys.exit(main())"


def run_times(argv: list[str], rounds: int) -> list[float]:
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
        samples.append(time.perf_counter() - started)
        if done.returncode not in (0, 3):
            raise SystemExit(f"{' '.join(argv[:3])}... failed ({done.returncode}): {done.stderr.strip()}")
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        host = materialise(find_profile("dgx-h100"), Path(tmp) / "host")
        plan = ["plan", "--host-root", str(host.root)]
        python = sys.executable
        figures = {
            "python -c pass (floor)": run_times([python, "-c", "pass"], args.rounds),
            "katamgr plan, Kubernetes client imported (before)": run_times([python, "-c", EAGER, *plan], args.rounds),
            "katamgr plan (after: lazy import)": run_times([python, "-c", LAZY, *plan], args.rounds),
        }
    print(f"katamgr plan start-up on a simulated DGX H100 node, {args.rounds} runs each (median, min):")
    for name, samples in figures.items():
        print(f"  {name:52s} {statistics.median(samples):6.3f} s  {min(samples):6.3f} s")
    after = statistics.median(figures["katamgr plan (after: lazy import)"])
    print(f"target: under 0.5 s -> {'met' if after < 0.5 else 'NOT met'} ({after:.3f} s)")


if __name__ == "__main__":
    main()
