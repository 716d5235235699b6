"""An artifact upgrade is gated on the node: the new agent is ready only once the node runs the
new artifacts, whole (each file's sha256 as installed) and loadable (the rendered Kata config
names only installed files).

The chart's DaemonSet rolls its agents one node at a time and waits for each new pod's
readiness (``/readyz``, ``Agent.readiness``) before the next (Kubernetes' DaemonSet
RollingUpdate, maxUnavailable 1): an agent that stays unready holds the rollout on its node.
Here the agent runs on a simulated node whose OCI layout gains a good tag and a tag whose
blob is corrupt, as a registry serving a bad push would.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

from support.agentkit import make_agent
from support.hostkit import GPU_A10, dev, make_host
from support.kataconfig import LAYOUT_ON_NODE, kata_manager_yaml, prepare_node

from gpunode.host.pciids import PciIds
from gpunode.kataclasses import GPU
from gpunode.policy.naming import Naming
from katamgr.config import DEFAULT_ARTIFACTS_DIR, parse_config
from katamgr.pipeline import kata_verify
from katamgr.pipeline.kata_runtime import KataContext
from katamgr.pipeline.reconcile import Steps

NAMING = Naming(PciIds.find())
CONFIG_NAME = "configuration-qemu-nvidia-gpu.toml"


def _blob(layout, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return "sha256:" + digest


def add_tag(host, tag: str, *, config_extra: str = "", corrupt: bool = False) -> None:
    """A new version of the GPU class's artifact in the node's layout: its Kata config with
    ``config_extra`` appended; ``corrupt``: the blob stored under its digest is not those bytes."""
    layout = host.path(LAYOUT_ON_NODE)
    index = json.loads((layout / "index.json").read_text())
    entry = next(m for m in index["manifests"] if m["annotations"]["org.opencontainers.image.ref.name"] == GPU)
    manifest = json.loads((layout / "blobs" / "sha256" / entry["digest"].split(":")[1]).read_text())
    layer = next(la for la in manifest["layers"] if la["annotations"]["org.opencontainers.image.title"] == CONFIG_NAME)
    data = (layout / "blobs" / "sha256" / layer["digest"].split(":")[1]).read_bytes() + config_extra.encode()
    layer["digest"], layer["size"] = _blob(layout, data), len(data)
    if corrupt:  # the registry's storage went bad: same length, other bytes
        (layout / "blobs" / "sha256" / layer["digest"].split(":")[1]).write_bytes(data[:-1] + b"#")
    body = json.dumps(manifest).encode()
    index["manifests"].append({**entry, "digest": _blob(layout, body), "size": len(body),
                               "annotations": {"org.opencontainers.image.ref.name": tag}})
    (layout / "index.json").write_text(json.dumps(index))


class Recorder:
    """The Node's Events as ``katamgr.cluster.EventRecorder`` takes them: (reason, message, type)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []

    def record(self, reason: str, message: str, type_: str = "Normal", limited: bool = True) -> bool:
        self.events.append((reason, message, type_))
        return True


def ctx_for(tag: str) -> KataContext:
    return KataContext(parse_config(kata_manager_yaml((GPU,), url=f"oci-layout://{LAYOUT_ON_NODE}:{tag}")),
                       manage_runtime_classes=False)


def node(tmp_path):
    host = prepare_node(make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4)]))
    add_tag(host, "v2", config_extra="\n# v2\n")
    add_tag(host, "v3-bad", config_extra="\n# v3\n", corrupt=True)
    return host


def class_dir(host):
    return host.path(f"{DEFAULT_ARTIFACTS_DIR}/{GPU}")


def test_the_new_agent_is_ready_only_once_the_node_runs_the_new_artifact_verified(tmp_path):
    host = node(tmp_path)
    agent = make_agent(host, NAMING, Steps(), ctx_for(GPU))
    agent.reconcile("start")
    ready, why = agent.readiness()
    assert ready, why
    assert f"Kata artifacts verified ({GPU})" in why
    written = json.loads(host.state_path("verified.json").read_text())
    assert written["ok"] and written["writer"] == agent.verifier.writer
    assert written["runtimeClasses"][0]["ref"].endswith(f":{GPU}")
    # The same verdict again is no host write: the file (its inode and time) is the one written.
    before = host.state_path("verified.json").stat()
    agent.reconcile("nothing changed")
    after = host.state_path("verified.json").stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert agent.readiness()[0]

    # A running VM holds its files open (QEMU its kernel, initrd and image; the shim read its
    # config at start): the install swaps a whole new dir in beside them.
    booted = (class_dir(host) / CONFIG_NAME).open("rb")
    old = (class_dir(host) / CONFIG_NAME).read_bytes()

    # The chart's upgrade: a new agent with the config naming the new, good version.
    upgraded = make_agent(host, NAMING, Steps(), ctx_for("v2"))
    assert not upgraded.readiness()[0]  # before its first reconcile: the old verdict is not its own
    upgraded.reconcile("start")
    ready, why = upgraded.readiness()
    assert ready, why
    assert (class_dir(host) / CONFIG_NAME).read_text().endswith("# v2\n")
    with booted:
        assert booted.read() == old  # the VM still reads what it booted


def test_a_corrupt_artifact_keeps_the_new_agent_unready_and_the_old_artifacts_in_place(tmp_path):
    host = node(tmp_path)
    make_agent(host, NAMING, Steps(), ctx_for("v2")).reconcile("start")
    before = {p.name: p.read_bytes() for p in class_dir(host).iterdir() if p.is_file()}

    recorder = Recorder()
    upgraded = make_agent(host, NAMING, Steps(), ctx_for("v3-bad"), events=recorder)
    report = upgraded.reconcile("start")
    # The reconcile keeps the class running on what was installed (the old artifact) ...
    assert report.ok and any("keeping the artifacts already installed" in w for w in report.warnings)
    assert {p.name: p.read_bytes() for p in class_dir(host).iterdir() if p.is_file()} == before
    # ... but the node is not upgraded: the agent stays unready, and says why and what to do.
    ready, why = upgraded.readiness()
    assert not ready
    assert f"holds oci-layout://{LAYOUT_ON_NODE}:v2" in why and ":v3-bad as the config asks" in why
    assert "helm rollback" in why
    # The kubelet's "Readiness probe failed" Event says only "statuscode: 503": a Warning on the
    # Node names the class and the way back, once for the verdict.
    (event,) = [e for e in recorder.events if e[0] == "KataArtifactsUnverified"]
    assert event[2] == "Warning" and f"runtime class {GPU}: " in event[1] and ":v3-bad as the config asks" in event[1]
    assert "a rollout of the agent waits on this node" in event[1] and "helm rollback" in event[1]
    # It stays unready on every later reconcile while the source serves the bad blob (no new Event).
    upgraded.reconcile("check")
    assert not upgraded.readiness()[0]
    assert [e[0] for e in recorder.events].count("KataArtifactsUnverified") == 1

    # helm rollback: the DaemonSet's pod is the old one again, with the old config: ready.
    rolled_back = make_agent(host, NAMING, Steps(), ctx_for("v2"))
    rolled_back.reconcile("start")
    assert rolled_back.readiness()[0]

    # A revert takes the verdict away with the artifacts it was about.
    from katamgr.pipeline.reconcile import revert_all

    assert revert_all(host, Steps(), rolled_back.target.ctx).ok
    assert not host.state_path("verified.json").exists()


def test_a_file_changed_after_the_install_fails_its_hash_and_a_broken_config_fails_its_load(tmp_path):
    host = node(tmp_path)
    agent = make_agent(host, NAMING, Steps(), ctx_for(GPU))
    agent.reconcile("start")
    assert agent.readiness()[0]
    kernel = class_dir(host) / "vmlinux-nvidia-gpu"
    stat = kernel.stat()
    kernel.write_bytes(b"x" * stat.st_size)  # same size
    os.utime(kernel, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the recorded time: only a hash tells
    found = kata_verify.verify_class(host, agent.target.ctx, GPU, agent.target.ctx.config.runtime_classes[0].artifacts.url)
    assert not found.ok
    assert found.problems == (f"runtime class {GPU}: {DEFAULT_ARTIFACTS_DIR}/{GPU}/vmlinux-nvidia-gpu is not the "
                              "installed file (sha256 " + found.problems[0].split("(sha256 ")[1],)

    rendered = class_dir(host) / "rendered" / CONFIG_NAME
    shutil.copy(rendered, tmp_path / "good.toml")
    rendered.write_text(rendered.read_text().replace("vmlinux-nvidia-gpu", "vmlinux-missing"))
    problems = kata_verify.verify_class(host, agent.target.ctx, GPU, f"oci-layout://{LAYOUT_ON_NODE}:{GPU}").problems
    assert any("hypervisor.qemu.kernel" in p and "vmlinux-missing" in p and "not an installed file" in p
               for p in problems), problems


def test_a_node_without_kata_has_nothing_to_verify_and_is_ready(tmp_path):
    host = node(tmp_path)
    agent = make_agent(host, NAMING, Steps(kata=False), ctx_for(GPU))
    agent.reconcile("start")
    ready, why = agent.readiness()
    assert ready and "none installed here" in why, why
