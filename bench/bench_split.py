"""A split node under churn: randomized changes of the split label
(``nvidia.com/gpu.workload.vm-passthrough.gpus``) with pods coming and going on both sides, on the
simulated a10-server node, with katamgr's agent and both plugins following the Node each by its own
watch (``tests/support/splitkit.py``).

Prints the overlap count (moments the kubelet's record of both ListAndWatch streams, replayed in
order, has one GPU offered by both plugins; target 0) and, for changes that move one free GPU,
the time from the relabel until both streams list the new split (target: p50 under 1 s).
Run: .venv/bin/python bench/bench_split.py [--changes 1000] [--seed 46]
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from support.splitkit import CONTAINER_GPU, Replay, split_node, uuid_of  # noqa: E402

from gpunode.policy.split import split  # noqa: E402
from katamgr.agent.settings import AgentSettings  # noqa: E402
from nodesim.kubelet import KubeletSimulator  # noqa: E402
from nodesim.kubeletstate import AdmissionError  # noqa: E402
from nodesim.materialise import materialise  # noqa: E402
from nodesim.profiles import find_profile  # noqa: E402

A10 = "nvidia.com/GA102GL_A10"
PROFILE = "a10-server"
# katamgr run's own check interval: a move must not wait for the next check.
CHECK_INTERVAL = {f.name: f.default for f in dataclasses.fields(AgentSettings)}["check_interval"]


def sim_host():
    """The tests' ``sim_host`` factory, outside pytest: a fresh root and its kubelet."""
    made = []

    def make(profile: str):
        directory = tempfile.mkdtemp(prefix="bs-")
        host = materialise(find_profile(profile), directory)
        kubelet = KubeletSimulator(host)
        kubelet.start()
        made.append((directory, kubelet))
        return host, kubelet
    return make, made


def offered(state, resource: str) -> set[str]:
    return set(state.healthy(resource))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--changes", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=46)
    parser.add_argument("--check-interval", type=float, default=CHECK_INTERVAL,
                        help="the agent's checks (default: katamgr run's own, %(default)g s)")
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # the figures, not each plugin's and the agent's lines
    rng = random.Random(args.seed)
    make, made = sim_host()
    samples: list[float] = []
    started = time.monotonic()
    try:
        with split_node(make, PROFILE, "2", check_interval=args.check_interval) as node:
            kubelet, gpus = node.kubelet, node.gpus
            replay = Replay(node)
            count, pods = 2, []
            for change in range(args.changes):
                if rng.random() < 0.3:  # pods on either side come and go
                    for _ in range(rng.randint(1, 3)):
                        if pods and rng.random() < 0.5:
                            name = pods.pop(rng.randrange(len(pods)))
                            kubelet.remove_pod("default", name)
                            continue
                        resource = rng.choice([A10, CONTAINER_GPU])
                        name = f"p{change}-{rng.randrange(10**6)}"
                        try:
                            kubelet.admit_pod("default", name, {"main": {resource: 1}})
                        except AdmissionError:
                            continue
                        pods.append(name)
                step = rng.choice((-1, 1))
                if rng.random() < 0.5 and 0 <= count + step <= len(gpus):
                    count += step  # one GPU to the other side
                    wanted = split(node.devices, str(count))
                    vm, box = {d.bdf for d in wanted.vm}, {uuid_of(d.bdf) for d in wanted.container}
                    free = not pods  # no pod holds a GPU: the one moved is free
                    at = time.monotonic()
                    node.relabel(str(count))
                    if free:
                        try:
                            kubelet.wait_for(lambda s, vm=vm, box=box: offered(s, A10) == vm and offered(s, CONTAINER_GPU) == box,
                                             timeout=15)
                            samples.append(time.monotonic() - at)
                        except TimeoutError:
                            print(f"change {change}: split {count} not reached in 15 s", file=sys.stderr)
                else:
                    count = rng.randint(0, len(gpus))
                    index = f"index.{len(gpus) - count}-{len(gpus) - 1}" if count else "0"
                    node.relabel(rng.choice([str(count), "all" if count == len(gpus) else index, index]))
                    time.sleep(rng.uniform(0.0, 0.1))  # racing: the next change before this one is done
                replay.feed(kubelet.state.history)
                if pods and rng.random() < 0.05:  # let every GPU go now and then, so moves are free
                    for name in pods:
                        kubelet.remove_pod("default", name)
                    pods.clear()
            time.sleep(1.0)
            replay.feed(kubelet.state.history)
    finally:
        for directory, kubelet in made:
            kubelet.stop()
            shutil.rmtree(directory, ignore_errors=True)
    elapsed = time.monotonic() - started
    print(f"split changes: {args.changes} on {PROFILE} ({elapsed:.0f} s), ListAndWatch updates replayed: "
          f"{replay.entries}")
    print(f"overlaps (a GPU offered by both plugins at once): {len(replay.overlaps)}")
    if samples:
        ordered = sorted(samples)
        p95 = ordered[max(0, int(len(ordered) * 0.95) - 1)]
        print(f"label to both ListAndWatch streams, one free GPU moved: p50 {statistics.median(ordered) * 1000:.0f} ms, "
              f"p95 {p95 * 1000:.0f} ms, max {ordered[-1] * 1000:.0f} ms ({len(ordered)} samples)")
    if replay.overlaps:
        for when, bdfs in replay.overlaps[:10]:
            print(f"  overlap at {when:.3f}: {', '.join(sorted(bdfs))}")
        sys.exit(1)


if __name__ == "__main__":
    main()
