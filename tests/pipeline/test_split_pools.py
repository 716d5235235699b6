"""The split per node pool (the config's ``splits``, the chart's ``sandboxWorkloads.splits``):
``katamgr run`` applies the first matching pool's value where the node has no split label, the
label wins, and a bad value or a split on a DRA node moves nothing and says why, naming the
value, where it came from and the fix."""

from __future__ import annotations

from support.hostkit import GPU_A10, dev, driver_of, make_host
from support.switchkit import events, followed_node, relabel
from support.waiting import wait_for

from gpunode.policy.split import SPLIT_LABEL, SplitPool
from gpunode.policy.splitnode import SIDES_FILE, read_sides
from katamgr.pipeline.reconcile import Steps
from katamgr.pipeline.splitplan import split_plan
from katamgr.pipeline.status import node_status
from katamgr.render import status_text

GPUS = [f"0000:{bus:02x}:00.0" for bus in (1, 2, 3, 4)]  # IOMMU groups 11 to 14, bus order
POOLS = (SplitPool({"pool": "other"}, "all", "splits[0]"), SplitPool({"pool": "mixed"}, "2", "splits[1]"))


def four_gpus(tmp_path):
    return make_host(tmp_path, [dev(bdf, GPU_A10, "nvidia", 11 + i) for i, bdf in enumerate(GPUS)])


def drivers(host) -> list[str]:
    return [driver_of(host, bdf) for bdf in GPUS]


def test_the_first_matching_pool_splits_a_node_without_the_label_and_the_label_wins(tmp_path):
    host = four_gpus(tmp_path)
    with followed_node(host, Steps(kata=False), splits=POOLS) as (api, agent, watch):
        relabel(api, "mixed", key="pool")
        assert wait_for(lambda: agent.switcher.read_workload().split == "2")
        read = agent.switcher.read_workload()
        assert read.split_from == "node pool splits[1] (matchLabels pool=mixed)"
        agent.switcher.split_at_start()
        assert agent.reconcile("start").ok
        assert drivers(host) == ["nvidia", "nvidia", "vfio-pci", "vfio-pci"]
        # katamgr plan says where the split came from.
        _, section = split_plan(host, agent.splitter.unsplit, read.split, read.split_from)
        assert section is not None and section.data["from"] == read.split_from
        assert "node pool splits[1] (matchLabels pool=mixed): vmGpus 2" in section.lines[0]
        # katamgr status too, from the sides the plugins list from.
        shown = status_text(node_status(host), width=200)
        assert "  from: node pool splits[1] (matchLabels pool=mixed)" in shown

        relabel(api, "3", key=SPLIT_LABEL)  # the label, set, wins over the pool
        assert wait_for(lambda: agent.switcher.read_workload().split == "3")
        assert agent.switcher.read_workload().split_from is None
        assert agent.follow_workload()
        assert wait_for(lambda: drivers(host) == ["nvidia", "vfio-pci", "vfio-pci", "vfio-pci"])
        watch.stop()


def test_a_pool_value_the_node_cannot_meet_is_named_with_its_pool(tmp_path):
    host = four_gpus(tmp_path)
    pools = (SplitPool({"pool": "mixed"}, "6", "splits[0]"),)
    with followed_node(host, Steps(kata=False), events=True, splits=pools) as (api, agent, watch):
        relabel(api, "mixed", key="pool")
        assert wait_for(lambda: agent.switcher.read_workload().split == "6")
        agent.switcher.split_at_start()
        refused = events(api, "WorkloadLabelInvalid")
        assert refused and refused[0]["message"].startswith(
            "node pool splits[0] (matchLabels pool=mixed): vmGpus '6' asks for 6 GPUs but the node has 4; "
            "set it to a count or a selector")
        assert f"or label the node {SPLIT_LABEL}=VALUE (the label wins over the pool)" in refused[0]["message"]
        assert read_sides(host) is None  # nothing moved
        watch.stop()


def test_a_split_on_a_node_the_dra_driver_serves_is_refused_and_moves_nothing(tmp_path):
    host = four_gpus(tmp_path)
    with followed_node(host, Steps(kata=False), events=True) as (api, agent, watch):
        agent.splitter.dra = True  # the config's podResourceDeviceSources lists dra (dra.enabled)
        relabel(api, "2", key=SPLIT_LABEL)
        assert wait_for(lambda: agent.switcher.read_workload().split == "2")
        agent.switcher.split_at_start()
        refused = events(api, "WorkloadLabelInvalid")
        assert refused and refused[0]["message"].startswith(
            f"{SPLIT_LABEL}='2' splits a node whose passthrough GPUs the DRA driver serves")
        assert "remove the label, or serve the node with the device plugins (dra.enabled=false)" in refused[0]["message"]
        assert not host.path(SIDES_FILE).exists()
        assert agent.splitter.share is None
        watch.stop()
