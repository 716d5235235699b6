"""The agent's own first install of the Kata runtimes is its own doing: the next look at the
node's Kata finds nothing changed, and no KataChanged Event blames kata-deploy.

Before: the agent remembered the node's Kata before its first reconcile, then took the
containerd entries and artifacts that reconcile wrote for "the node's Kata changed
(kata-deploy installed or upgraded it?)".
"""

from __future__ import annotations

from support.agentkit import make_agent
from support.kataconfig import kata_manager_yaml, prepare_node
from support.nodecontextkit import kata_found, katamgr_context

from gpunode.host.pciids import PciIds
from gpunode.policy.naming import Naming
from katamgr.config import parse_config
from katamgr.pipeline.kata_runtime import KataContext
from katamgr.pipeline.reconcile import Steps
from nodesim.materialise import materialise
from nodesim.profiles import find_profile

NAMING = Naming(PciIds.find())


class Said:
    """The agent's Events, as NodeEvents would send them (reason, message)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def kata_changed(self, message: str) -> None:
        self.events.append(("KataChanged", message))


def test_the_agent_s_first_install_is_not_taken_for_kata_deploy_s(tmp_path, caplog):
    host = prepare_node(materialise(find_profile("workstation-a6000"), tmp_path / "host"))
    config = parse_config(kata_manager_yaml())
    node = katamgr_context(host, config)
    naming = node.naming
    assert node.kata_found.runtimes == ()  # nothing yet: the agent installs its own
    agent = make_agent(host, naming, Steps(), KataContext(config),
                       kata_on_node=node.kata_found, kata_found=kata_found(node))
    said = Said()
    agent.events.kata_changed = said.kata_changed
    caplog.set_level("INFO", logger="katamgr.agent")
    assert agent.run(once=True) == 0
    assert host.path(f"{config.artifacts_dir}/kata-qemu-nvidia-gpu").is_dir()

    assert not agent.follow_kata()  # the install was the agent's: nothing of kata-deploy's to follow
    assert said.events == []
    assert "kata-deploy installed or upgraded it" not in caplog.text
