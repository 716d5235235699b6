"""The GPU Operator's opt-out labels (``nvidia.com/gpu.deploy.<operand>=false``, or
``nvidia.com/gpu.deploy.operands=false`` for all) take katamgr's parts away on a followed
Node, and lifting them brings the parts back, without a restart."""

from __future__ import annotations

from support.hostkit import GPU_A10, dev, driver_of, hold, make_host
from support.switchkit import (
    CONFIG,
    FREE,
    HELD,
    cdi_text,
    driver_now,
    events,
    followed_node,
    kata_node,
    relabel,
    run_loop,
    stop_loop,
    switch_lines,
)
from support.waiting import wait_for

from gpunode.policy.readiness import VFIO_READY, WORKLOAD_TYPE
from gpunode.policy.workload import OPERANDS_LABEL, Operand, Workload
from katamgr.config import parse_config
from katamgr.pipeline.kata_runtime import KataContext
from katamgr.pipeline.reconcile import Steps


def set_label(api, key: str, value: str | None) -> None:
    relabel(api, value, key=key)


def test_opting_out_of_the_vfio_manager_gives_gpus_back_and_lifting_it_binds_again(tmp_path, caplog):
    caplog.set_level("INFO", logger="katamgr.agent")
    host = make_host(tmp_path, [dev(FREE, GPU_A10, "nvidia", 5)])
    with followed_node(host, Steps(kata=False), events=True) as (api, agent, watch):
        assert agent.reconcile("start").ok and host.path(VFIO_READY).exists()
        thread = run_loop(agent)
        try:
            # As the GPU Operator's vfio-manager leaving the node unbinds (its preStop hook).
            set_label(api, Operand.VFIO_MANAGER.label, "false")
            assert wait_for(lambda: agent.target.opted_out == {Operand.VFIO_MANAGER})
            assert driver_of(host, FREE) == "nvidia"
            assert agent.target.steps.workload is Workload.VM_PASSTHROUGH and not agent.target.steps.vfio
            assert not host.path(VFIO_READY).exists()
            assert host.path(WORKLOAD_TYPE).read_text() == "vm-passthrough\n"
            assert "/dev/vfio/5" not in cdi_text(host)
            line = next(iter(switch_lines(caplog, "opt-outs now")))
            assert line.startswith("opt-outs now nvidia.com/gpu.deploy.vfio-manager=false (were none): "
                                   f"gave {FREE} back to their drivers")
            assert agent.metrics.registry.get_sample_value("katamgr_opted_out", {"operand": "vfio-manager"}) == 1
            assert wait_for(lambda: [e["message"] for e in events(api, "OptOutsChanged")] == [line])
            # A periodic reconcile does not bind while opted out.
            assert agent.reconcile("check").ok and driver_of(host, FREE) == "nvidia"

            set_label(api, Operand.VFIO_MANAGER.label, None)
            assert wait_for(lambda: host.path(VFIO_READY).exists())
            assert driver_of(host, FREE) == "vfio-pci"
            assert agent.metrics.registry.get_sample_value("katamgr_opted_out", {"operand": "vfio-manager"}) == 0
        finally:
            stop_loop(agent, thread, watch)


def test_opting_out_of_the_sandbox_validator_removes_the_readiness_files_only(tmp_path):
    host = make_host(tmp_path, [dev(FREE, GPU_A10, "nvidia", 5)])
    with followed_node(host, Steps(kata=False)) as (api, agent, watch):
        assert agent.reconcile("start").ok
        thread = run_loop(agent)
        try:
            set_label(api, Operand.SANDBOX_VALIDATOR.label, "false")
            assert wait_for(lambda: agent.target.opted_out == {Operand.SANDBOX_VALIDATOR})
            assert not host.path(WORKLOAD_TYPE).exists()
            assert not host.path(VFIO_READY).exists()
            assert driver_of(host, FREE) == "vfio-pci"  # the GPUs stay bound
            assert agent.reconcile("check").ok and not host.path(VFIO_READY).exists()
            set_label(api, Operand.SANDBOX_VALIDATOR.label, "true")  # the operator's own value
            assert wait_for(lambda: host.path(VFIO_READY).exists())
        finally:
            stop_loop(agent, thread, watch)


def test_all_operands_off_stands_every_step_down_and_kata_entries_stay(tmp_path):
    host = kata_node(tmp_path)
    with followed_node(host, Steps(), ctx=KataContext(parse_config(CONFIG))) as (api, agent, watch):
        assert agent.reconcile("start").ok
        containerd = host.path("/etc/containerd/config.toml").read_text()
        thread = run_loop(agent)
        try:
            set_label(api, OPERANDS_LABEL, "false")
            assert wait_for(lambda: agent.target.opted_out == frozenset(Operand))
            assert driver_of(host, FREE) == driver_of(host, HELD) == "nvidia"
            assert not agent.target.steps.kata and not host.path(WORKLOAD_TYPE).exists()
            # The Kata entries stay for running VMs; with kata-manager opted out nothing
            # repairs them either: an edit someone makes is left alone.
            assert host.path("/etc/containerd/config.toml").read_text() == containerd
            assert agent.containerd_drift() is None
        finally:
            stop_loop(agent, thread, watch)


def test_an_opt_out_change_on_a_container_node_keeps_following_a_held_gpu(tmp_path):
    host = make_host(tmp_path, [dev(HELD, GPU_A10, "nvidia", 4)])
    with followed_node(host, Steps(kata=False)) as (api, agent, watch):
        assert agent.reconcile("start").ok
        vm = hold(host, 4)
        thread = run_loop(agent)
        try:
            relabel(api, "container")
            assert wait_for(lambda: agent.target.steps.workload is Workload.CONTAINER)
            assert agent.give_backs.held == {HELD}
            # A change that gives nothing back (the readiness files' opt-out) forgets nothing.
            set_label(api, Operand.SANDBOX_VALIDATOR.label, "false")
            assert wait_for(lambda: agent.target.opted_out == {Operand.SANDBOX_VALIDATOR})
            assert agent.give_backs.held == {HELD}
            vm.unlink()
            assert wait_for(lambda: driver_now(host, HELD) == "nvidia")
        finally:
            stop_loop(agent, thread, watch)
