"""The Kata release label (``katacontainers.io/kata-version``) kept by the same record as the
GPU labels (set once, taken off on revert), and the agent following kata-deploy installing
or upgrading Kata after it started: the label, the plan and the NVSwitch decision follow."""

from __future__ import annotations

from support.agentkit import make_agent
from support.apiserver import FakeApiServer
from support.nodecontextkit import katamgr_context

from gpunode.host.pciids import PciIds
from gpunode.policy import gpulabels as facts
from gpunode.policy.inventory import discover
from gpunode.policy.katarelease import KataRelease
from gpunode.policy.naming import Naming
from gpunode.policy.workload import WORKLOAD_LABEL
from katamgr import cli
from katamgr.agent.katafound import KataFound
from katamgr.cluster import EventRecorder
from katamgr.commands import setup as cli_setup
from katamgr.pipeline import gpulabels
from katamgr.pipeline.reconcile import Steps
from nodesim.katadeploy import KataInstall, lay_out
from nodesim.materialise import materialise
from nodesim.profiles import find_profile

NAMING = Naming(PciIds.find())
NODE = "dgx-1"
KATA_LABEL = "katacontainers.io/kata-version"
CONTAINERD = "/etc/containerd/config.toml"
GPU_CLASSES = ("kata-qemu-nvidia-gpu", "kata-qemu-nvidia-gpu-snp")
NVSWITCHES = ("0000:05:00.0", "0000:15:00.0", "0000:85:00.0", "0000:95:00.0")  # dgx-h100's


def _node(api, labels):
    api.seed({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": dict(labels)}})


def _labels(api) -> dict[str, str]:
    return api.get("nodes", NODE)["metadata"].get("labels", {})


def _events(api, reason):
    found = [api.get("events", n, "default") for n in api.names("events")]
    return [e for e in found if e and e["reason"] == reason]


def _driver(host, bdf: str) -> str | None:
    link = host.path(f"/sys/bus/pci/devices/{bdf}/driver")
    return link.resolve().name if link.exists() else None


def test_the_release_label_is_recorded_and_comes_off_on_revert(tmp_path, monkeypatch, capsys):
    host = materialise(find_profile("dgx-h100"), tmp_path / "host")
    lay_out(host, KataInstall("kata-deploy", "3.25.0", ("go",)))
    context = katamgr_context(host)
    with FakeApiServer() as api:
        _node(api, {WORKLOAD_LABEL: "vm-passthrough"})
        node = cli_setup.node_labels(api.client(), NODE)
        report = gpulabels.publish(host, discover(host), context.naming, node, context.kata_found)
        assert report.ok and f"{KATA_LABEL}=3.25.0" in report.changes[0]
        assert _labels(api)[KATA_LABEL] == "3.25.0"
        assert set(facts.recorded(host)) == {*facts.KEYS, KATA_LABEL}
        assert facts.recorded(host)[KATA_LABEL] == "3.25.0"
        monkeypatch.setenv("KUBECONFIG", str(api.write_kubeconfig(tmp_path / "kubeconfig")))
        assert cli.main(["revert", "--host-root", str(host.root), "--node-name", NODE]) == 0
        assert "removed node labels" in capsys.readouterr().out
        assert _labels(api) == {WORKLOAD_LABEL: "vm-passthrough"}
        assert facts.recorded(host) == {}


def test_a_release_label_set_before_the_record_is_taken_as_katamgr_s(tmp_path):
    """An agent of before the record set the label without keeping it: the same value is
    adopted (no other writer puts it on a Node), so a revert takes it off; another value is
    left, and said."""
    host = materialise(find_profile("a10-server"), tmp_path / "host")
    lay_out(host, KataInstall("kata-deploy", "3.29.0", ("go",)))
    context = katamgr_context(host)
    naming, found = context.naming, context.kata_found
    with FakeApiServer() as api:
        _node(api, {KATA_LABEL: "3.29.0"})
        node = cli_setup.node_labels(api.client(), NODE)
        report = gpulabels.publish(host, discover(host), naming, node, found)
        assert report.ok and KATA_LABEL not in " ".join(report.changes)
        assert facts.recorded(host)[KATA_LABEL] == "3.29.0"
        assert "removed node labels" in gpulabels.revert(host, node).changes[0]
        assert KATA_LABEL not in _labels(api)
        api.update("nodes", NODE, lambda n: n["metadata"]["labels"].__setitem__(KATA_LABEL, "9.9"))
        report = gpulabels.publish(host, discover(host), naming, node, found)
        assert any(f"node label {KATA_LABEL}=9.9 is set by someone else" in w for w in report.warnings)
        assert KATA_LABEL not in facts.recorded(host)


def test_the_agent_follows_kata_deploy_installing_then_upgrading_kata(tmp_path):
    """kata-deploy lays Kata out after the agent started (3.29: NVSwitches stay on the host),
    then upgrades it to 4.1 (its shims cold-plug NVSwitches): the agent finds each at its next
    check, says so in an Event, moves the label, and reconciles the NVSwitches through."""
    host = materialise(find_profile("dgx-h100"), tmp_path / "host")
    with FakeApiServer() as api:
        _node(api, {WORKLOAD_LABEL: "vm-passthrough"})
        client = api.client()
        context = katamgr_context(host)  # no Kata yet
        assert context.kata_found.runtimes == ()
        agent = make_agent(host, context.naming, Steps(kata=False), None, events=EventRecorder(client, NODE),
                      node_labels=cli_setup.node_labels(client, NODE), kata_on_node=context.kata_found,
                      kata_found=KataFound(NAMING.nvswitch_rule, CONTAINERD, names=GPU_CLASSES))
        assert agent.run(once=True) == 0
        assert KATA_LABEL not in _labels(api)
        assert not agent.follow_kata()  # nothing changed

        lay_out(host, KataInstall("kata-deploy", "3.29.0", ("go", "runtime-rs")))
        assert agent.follow_kata()
        agent.follow_gpu_labels()
        assert _labels(api)[KATA_LABEL] == "3.29.0"
        assert agent.target.naming.nvswitch_rule.kata == KataRelease((3, 29, 0))
        assert all(_driver(host, bdf) != "vfio-pci" for bdf in NVSWITCHES)
        assert not agent.follow_kata()  # looked at once: the files are as detection read them

        lay_out(host, KataInstall("kata-deploy", "4.1.0", ("go", "runtime-rs")))
        assert agent.follow_kata()
        agent.follow_gpu_labels()
        assert _labels(api)[KATA_LABEL] == "4.1.0"
        assert agent.target.naming.nvswitch_rule.takes_nvswitches("auto")
        assert all(_driver(host, bdf) == "vfio-pci" for bdf in NVSWITCHES)
        (event, *_) = [e for e in _events(api, "KataChanged") if "4.1.0" in e["message"]]
        assert "deciding: Kata 3.29.0 before" in event["message"] and "deciding: Kata 4.1.0 now" in event["message"]
        plan = agent.target.plan()
        assert {d.bdf for d in plan.inventory.devices if d.is_nvswitch and plan.inventory.selected(d)} \
            == set(NVSWITCHES)


def test_a_typed_release_stays_the_override_when_kata_changes(tmp_path):
    from gpunode.policy.katarelease import parse_release
    from gpunode.policy.selection import NvswitchRule

    host = materialise(find_profile("dgx-h100"), tmp_path / "host")
    lay_out(host, KataInstall("kata-deploy", "3.29.0", ("go",)))
    typed = Naming(NAMING.pci_ids, nvswitch_rule=NvswitchRule(parse_release("3.29.0")))
    context = katamgr_context(host, None, "--kata-version", "3.29.0")
    agent = make_agent(host, context.naming, Steps(kata=False), None, kata_on_node=context.kata_found,
                  kata_found=KataFound(typed.nvswitch_rule, CONTAINERD, names=GPU_CLASSES))
    lay_out(host, KataInstall("kata-deploy", "4.1.0", ("go",)))
    assert agent.follow_kata()
    rule = agent.target.naming.nvswitch_rule
    assert rule.kata == KataRelease((3, 29, 0)) and not rule.takes_nvswitches("auto")
    assert "says the node runs Kata 3.29.0, but its Kata runtimes" in agent.target.kata_found.warning
