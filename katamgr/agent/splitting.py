"""The split label followed: a vm-passthrough node's GPUs moved between VMs and containers one
GPU at a time, live (``gpunode.policy.split``; the label ``nvidia.com/gpu.workload.vm-passthrough.gpus``).

A change of the split moves only free GPUs, each in the order that never lets two plugins offer
one GPU at once: off the side it leaves, then its driver changed, then on the side it joins. The
sides are what this module publishes (``splitnode.write_sides``), which both plugins list from
(``sandbox_plugin.splitshare``); a GPU that moves is on neither side in between.

- A GPU leaving the VM share: off the VM side; the kubelet is asked until it no longer offers it
  to new pods (``wait_not_offered``), then whether a pod was given it (PodResources ``List``) and
  whether a VM holds its VFIO group open; a free one is given back to its driver and put on the
  container side. A held one stays on vfio-pci and is looked at every second (``poll``), given
  back once its pod and VM are gone.
- A GPU joining the VM share: off the container side; once the kubelet lists none of its UUIDs
  as ``nvidia.com/gpu`` and no pod holds it, the reconcile binds its IOMMU group to vfio-pci,
  never one a process holds open (the container's CUDA program: ``vfiodecide``'s in-use rule;
  the agent's ``bind_freed`` binds it once let go), and it is put on the VM side.

Each change is a log line, a ``WorkloadSwitched`` Event and the ``katamgr_workload_switches``
counter by side, per GPU, as the whole-node switch; a bad value a ``WorkloadLabelInvalid`` Event.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from gpunode.errors import ConfigError
from gpunode.host import holders, vfio
from gpunode.policy.inventory import discover
from gpunode.policy.naming import Naming
from gpunode.policy.passthrough import resource_units
from gpunode.policy.split import SPLIT_ORIGIN, Moves, Split, dra_refusal, moves, selection_for
from gpunode.policy.splitnode import clear_sides, node_split, write_sides
from gpunode.policy.workload import Workload
from gpunode.services.lock import node_lock
from gpunode.services.podresources import (
    PodDevices,
    allocatable_of,
    assigned_functions,
    list_pod_devices,
    wait_not_offered,
)
from katamgr.agent.events import NodeEvents
from katamgr.agent.metrics import AgentMetrics
from katamgr.agent.target import Target
from katamgr.pipeline import cdi_specs
from katamgr.pipeline.report import Report

log = logging.getLogger("katamgr.agent")

VM, CONTAINER = Workload.VM_PASSTHROUGH.value, Workload.CONTAINER.value
CONTAINER_RESOURCE = "nvidia.com/gpu"  # the container plugin's resource


class SplitKeeper:
    """Keeps the target's naming on the node's split and moves GPUs when it changes."""

    def __init__(self, target: Target, metrics: AgentMetrics, events: NodeEvents,
                 reconcile: Callable[[str], Report], *,
                 pod_devices: Callable[[], PodDevices] | None = None, offer_wait: float = 5.0) -> None:
        self.target = target
        self.metrics = metrics
        self.events = events
        self.reconcile = reconcile
        self.value: str | None = None
        self.share: Split | None = None
        self.leaving: set[str] = set()  # BDFs out of the VM share still on vfio-pci (held)
        self.joining: set[str] = set()  # BDFs into the VM share the container plugin still lists
        self._joined = ""
        self.container_listed = lambda: allocatable_of(target.host, CONTAINER_RESOURCE)
        self.pod_devices = pod_devices or (lambda: list_pod_devices(target.host))
        self.offer_wait = offer_wait
        self._refused: str | None = None
        # The DRA driver serves the node's passthrough GPUs: a split is refused (see ``follow``).
        self.dra = False

    def follow(self, value: str | None, origin: str | None = None) -> bool:
        """Carry the node to the split ``value`` (the label's, or the node pool ``origin``'s); True
        when GPUs moved or the split changed."""
        if value == self.value and self.share is not None:
            return False  # the GPUs still waiting are the agent's poll's (``poll``)
        t = self.target
        try:
            if self.dra and value:
                # katamgr waits for the kubelet's device plugins only, not for the DRA driver's
                # ResourceSlice to be republished, before it gives a leaving GPU back.
                raise ConfigError(dra_refusal(value, origin))
            share = node_split(t.host, self.unsplit, value, origin)
        except ConfigError as exc:
            if str(exc) != self._refused:
                log.warning("%s; nothing was moved", exc)
                self.events.label_refused(f"{exc}; nothing was moved")
            self._refused = str(exc)
            return False
        self._refused = None
        started = time.monotonic()
        # The first look compares with the node unsplit: GPUs bound before the label came are
        # given back as a change would.
        old = self.share if self.share is not None else node_split(t.host, self.unsplit, None)
        change = moves(old, share)
        recorded = set(vfio.bound_by_us(t.host))
        if self.share is None:  # the VM share is bound by the reconcile that follows
            change = Moves((), tuple(d for d in change.to_container if d.bdf in recorded))
        # NVSwitches go to VMs only with every GPU: once a container share exists they belong to
        # the host again, where Fabric Manager trains the container GPUs' NVLinks, and leave
        # vfio-pci as a leaving GPU does (once no VM holds them).
        switches = ({d.bdf for d in share.nvswitches} & recorded
                    if old.nvswitches_to_vm and not share.nvswitches_to_vm else set())
        old_naming = t.naming
        self.value, self.share = value, share
        vm = {d.bdf for d in share.vm} | ({d.bdf for d in share.nvswitches} if share.nvswitches_to_vm else set())
        self.joining = (self.joining | {d.bdf for d in change.to_vm}) & vm
        self.leaving = (self.leaving - vm) | {d.bdf for d in change.to_container} | switches
        t.naming = self._naming()
        self._publish()  # first: each GPU that moves is off the side it leaves
        if not (change.to_vm or change.to_container or switches) and old.value == value:
            return False
        what = [change.describe()]
        if self.leaving:  # with those an earlier change left held, now perhaps let go
            what.append(self._give_back(old_naming))
        if self.joining:
            self._join(wait=self.offer_wait)
            what.append(self._joined)
        summary = f"split now {share.describe()}: {'; '.join(what)}"
        log.info("%s", summary)
        if change.to_vm or change.to_container:
            self.metrics.workload_switch_seconds.labels(VM).observe(time.monotonic() - started)
            self.events.switched(True, summary)
        return True

    @property
    def waiting(self) -> bool:
        """GPUs of a change wait for a pod or VM to let go (or for the kubelet): looked at every
        second, as the whole-node switch's held GPUs are, since a pod's or VM's end sends no event."""
        return self.share is not None and bool(self.leaving or self.joining)

    def poll(self) -> bool:
        """Move the waiting GPUs that were let go; True when any moved."""
        if self.share is None:
            return False
        went = bool(self.leaving) and self.retry()
        joined = bool(self.joining) and self._join()
        return went or joined

    @property
    def unsplit(self) -> Naming:
        """The target's naming without the split's exclusions: the operator's selection, as the
        Kata found on the node (``katafound``) may have replaced it since."""
        t = self.target
        rules = tuple(r for r in t.naming.selection.exclude if r.origin != SPLIT_ORIGIN)
        return dataclasses.replace(t.naming, selection=dataclasses.replace(t.naming.selection, exclude=rules))

    def reapply(self) -> None:
        """Narrow the target's naming to the VM share again (after something replaced it)."""
        if self.share is not None:
            self.target.naming = self._naming()

    def reset(self) -> None:
        """The node left vm-passthrough: no split is carried out any more."""
        if self.share is not None or self.leaving or self.joining:
            self.share, self.value, self.leaving, self.joining = None, None, set(), set()
            self.target.naming = self.unsplit
            clear_sides(self.target.host)

    def _publish(self) -> None:
        """The sides the plugins list from: a GPU leaving the VM side is on neither until it is
        back on its driver, one joining it on neither until it is bound."""
        assert self.share is not None
        share, host = self.share, self.target.host
        if not share.is_split and not self.leaving and not self.joining:
            clear_sides(host)
            return
        write_sides(host, {d.bdf for d in share.vm} - self.joining,
                    {d.bdf for d in share.container} - self.leaving, share.origin)

    def _naming(self) -> Naming:
        """The naming of the VM share less the GPUs still joining it (not bound until the
        container plugin no longer lists them)."""
        assert self.share is not None
        share = self.share
        if self.joining:
            waiting = tuple(d for d in share.vm if d.bdf in self.joining)
            share = dataclasses.replace(share, vm=tuple(d for d in share.vm if d.bdf not in self.joining),
                                        container=(*share.container, *waiting), nvswitches_to_vm=False)
        return dataclasses.replace(self.unsplit, selection=selection_for(self.unsplit.selection, share))

    def _join(self, wait: float = 0.0) -> bool:
        """Bind the GPUs joining the VM share once the container plugin withdrew them and no pod
        holds them: the kubelet lists none of their UUIDs (the driver's, as NVIDIA's plugin
        advertises them) as ``nvidia.com/gpu``, nor gave one to a pod (PodResources ``List``);
        where a UUID cannot be read, it lists no more such devices than the container share has
        GPUs (the plugin lists only GPUs of its share, so one more is a joining GPU still offered).

        Right after a change the kubelet is asked again every 50 ms for up to ``wait`` s: the
        container plugin withdraws a GPU within a fraction of a second of the sides being
        published, and the next check is seconds away. Later checks ask once."""
        assert self.share is not None
        host = self.target.host
        uuids = {bdf: (holders.gpu_uuid(host, bdf) or "").lower() for bdf in self.joining}
        container = len(self.share.container)

        def still_listed(listed: frozenset[str] | None) -> bool:
            return listed is not None and bool(
                set(uuids.values()) & listed if all(uuids.values()) else len(listed) > container)

        deadline = time.monotonic() + wait
        listed = self.container_listed()
        while still_listed(listed) and time.monotonic() < deadline:
            time.sleep(0.05)
            listed = self.container_listed()
        if still_listed(listed):
            assert listed is not None
            self._joined = (f"{', '.join(sorted(self.joining))} wait until the container plugin no "
                            f"longer lists them (the kubelet lists {len(listed)} {CONTAINER_RESOURCE})")
            return False
        given = {a.device_id.lower() for a in self.pod_devices().assignments if a.resource == CONTAINER_RESOURCE}
        kept = {bdf for bdf, uuid in uuids.items() if uuid and uuid in given}
        joining, self.joining = self.joining - kept, kept
        if not joining:
            self._joined = f"{', '.join(sorted(kept))} given to container pods, bound once they are gone"
            return False
        self.target.naming = self._naming()
        report = self.reconcile(f"split changed: {', '.join(sorted(joining))} to VMs")
        self._publish()  # then: on the VM side, listed by the passthrough plugin once on vfio-pci
        bound = sorted(set(report.moved) & joining)
        busy = sorted(b for b in joining if b not in bound and not self._on_vfio(b))
        self._joined = f"bound {', '.join(bound)} to vfio-pci" if bound else "no GPU bound yet"
        if busy:
            self._joined += f"; {', '.join(busy)} in use, bound once let go"
        if kept:
            self._joined += f"; {', '.join(sorted(kept))} given to container pods, bound once they are gone"
        for _ in bound:
            self.metrics.workload_switches.labels(CONTAINER, VM).inc()
        return bool(bound)

    def retry(self) -> bool:
        """Give back the GPUs that left the VM share while held, once free; True when any went."""
        before = set(self.leaving)
        line = self._give_back(self.unsplit)
        gone = before - self.leaving
        if gone:
            message = f"GPUs out of the VM share given back once free: {', '.join(sorted(gone))}"
            log.info("%s (%s)", message, line)
            self.events.given_back(message)
        return bool(gone)

    def _on_vfio(self, bdf: str) -> bool:
        return bdf in vfio.bound_by_us(self.target.host)

    def _give_back(self, old_naming: Naming) -> str:
        """Give back the free GPUs of ``leaving`` (withdrawn first), keeping the held ones."""
        t = self.target
        host = t.host
        recorded = vfio.bound_by_us(host)
        if self.leaving - set(recorded):  # not on vfio-pci by us: on the container side already
            self.leaving &= set(recorded)
            self._publish()
        if not self.leaving:
            return "nothing to give back"
        inv = discover(host, old_naming.selection, old_naming.nvswitch_rule)
        units = [u for u in resource_units(host, inv, old_naming) if set(u.functions) & self.leaving]
        still = set(wait_not_offered(host, [u.id for u in units], timeout=self.offer_wait))
        offered = {bdf for u in units if u.id.lower() in still for bdf in u.functions}
        asked = self.pod_devices()
        # A GPU an earlier change left held is in no unit of ``old_naming`` (out of its share):
        # the pods given it are found by the operator's whole selection.
        # (Each second's poll passes the whole selection already: one scan then.)
        unsplit = self.unsplit
        given = assigned_functions(host, inv, old_naming, asked.assignments)
        if old_naming != unsplit:
            whole = discover(host, unsplit.selection, unsplit.nvswitch_rule)
            given = {**assigned_functions(host, whole, unsplit, asked.assignments), **given}
        held = {bdf for bdf in self.leaving if bdf in given or bdf in offered
                or vfio.vfio_holders(host, bdf, recorded[bdf].get("group"))}
        free = self.leaving - held
        if not free:
            return f"kept on vfio-pci while held: {', '.join(sorted(held))}"
        keep = set(recorded) - free
        with node_lock(host, "katamgr run (split change)", t.lock_wait):
            result = vfio.unbind_all(host, force=False, keep=keep)
            if t.steps.cdi:
                cdi_specs.write_specs(host, discover(host, t.naming.selection, t.naming.nvswitch_rule), t.naming)
        now = set(vfio.bound_by_us(host))
        gone = free - now
        self.leaving -= gone
        self._publish()  # then: on the container side, listed by the container plugin
        switch_bdfs = {d.bdf for d in self.share.nvswitches} if self.share else set()
        for _ in gone - switch_bdfs:  # the counter is of GPUs
            self.metrics.workload_switches.labels(VM, CONTAINER).inc()
        said = f"gave {', '.join(sorted(gone))} back to their drivers" if gone else "no free GPU given back"
        if held:
            said += f"; kept on vfio-pci while held: {', '.join(sorted(held))}"
        if result.failures:
            said += f"; failed: {'; '.join(result.failures)}"
        return said

