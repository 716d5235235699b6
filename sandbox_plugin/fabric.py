"""The device plugin's side of NVIDIA's Shared NVSwitch model (Fabric Manager User Guide §7):
a pod gets exactly one FM partition's GPUs, and the partition is active before its VM starts.

- GetPreferredAllocation answers one free partition of the asked size
  (``nvlinkfabric.Fabric.prefer``: the one that blocks fewest larger partitions); a partition
  of ours still active though the kubelet offers all its GPUs (its pod ended within the
  release loop's second) counts free;
- Allocate refuses GPUs that are not exactly one partition (the reason names the sizes the
  node offers) and activates the partition before answering (§5.7), so the VM Kata starts
  next finds its fabric set up;
- a partition whose GPUs the kubelet no longer lists for any pod (PodResources ``List``) is
  deactivated (§5.9), looked at every ``RELEASE_INTERVAL`` s;
- the partitions activated are recorded (``RECORD``, a host path); after FM restarted
  (``--restart``: it answers FM_ST_NOT_CONFIGURED until told) or this plugin restarted,
  FM is given that record (``fmSetActivatedFabricPartitions``, §5.10).

GPUs are matched to partitions by PCI address (``gpunode.services.nvlinkfabric``), so they stay
on vfio-pci: no host driver is needed on them.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from gpunode.host.files import read_json, write_json
from gpunode.host.root import STATE_DIR, HostRoot
from gpunode.services import nvlinkfabric as nf
from gpunode.services.fabricmanager import (
    CONNECTION_NOT_VALID,
    IN_USE,
    NOT_CONFIGURED,
    TIMEOUT,
    UNINITIALIZED,
    FabricManager,
    FabricManagerError,
)
from sandbox_plugin.resources import AllocationError

log = logging.getLogger(__name__)

RECORD = f"{STATE_DIR}/nvlink-partitions.json"
DRA_RECORD = f"{STATE_DIR}/nvlink-partitions-dra.json"  # the DRA driver's claims' partitions
RELEASE_INTERVAL = 1.0
# The kubelet lists a pod's devices in PodResources only after Allocate answered (its device
# manager records them then: pkg/kubelet/cm/devicemanager/manager.go, allocateContainerResources),
# so a partition activated this recently is not released for want of a pod.
GRACE = 5.0


class FabricGuard:
    """One node's partitions, shared by its passthrough resources. ``given()``: the device IDs
    the kubelet gave pods (None when it cannot be asked: nothing is deactivated then)."""

    def __init__(self, host: HostRoot, settings: nf.FabricSettings,
                 given: Callable[[], set[str] | None] | None = None, record: str = RECORD) -> None:
        """``record``: the host path of this process's record (the DRA driver keeps its own,
        releasing at NodeUnprepareResources rather than by PodResources)."""
        self.host = host
        self.record_path = record
        self.settings = settings
        self.module_ids = settings.module_ids
        self._given = given or self._ask_kubelet
        self._lock = threading.Lock()  # one FM conversation at a time (the record follows FM)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fm: FabricManager | None = None
        self._activated: dict[str, float] = {}  # partition ID -> when this process activated it
        self._unrecorded = False

    # -- what the plugin asks ---------------------------------------------------

    def preferred(self, gpus_of: dict[str, tuple[str, ...]], available: Sequence[str],
                  must_include: Sequence[str], size: int) -> list[str] | None:
        """The unit IDs of the partition to give (``gpus_of``: each unit's GPU addresses);
        None when no free partition fits (the kubelet then picks, and Allocate says why not)."""
        units_of = {g: unit for unit, gpus in gpus_of.items() for g in gpus}
        offered = [g for u in available for g in gpus_of.get(u, ())]
        try:
            with self._lock:
                fabric = self._unheld(self._fabric(), offered)
        except AllocationError as e:  # FM not answering: Allocate will refuse, saying so
            log.warning("GetPreferredAllocation without partitions: %s", e.message)
            return None
        part = fabric.prefer(offered, [g for u in must_include for g in gpus_of.get(u, ())], size)
        if part is None:
            return None
        chosen = list(dict.fromkeys(units_of[g] for g in part.gpus))
        return [u for u in must_include if u in chosen] + [u for u in chosen if u not in must_include]

    def _unheld(self, fabric: nf.Fabric, offered: Sequence[str]) -> nf.Fabric:
        """``fabric`` with our active partitions whose GPUs the kubelet offers all of counted
        free: it offers only devices no pod holds, so such a partition was left by a pod that
        ended before the release loop (every ``RELEASE_INTERVAL`` s) saw it; Allocate
        deactivates it when a new partition needs its GPUs. Partitions not in our record (the
        DRA driver's, or another's) stay busy."""
        offered = set(offered)
        record = self._record()
        stale = {p.partition_id for p in fabric.partitions
                 if p.active and str(p.partition_id) in record and set(p.gpus) <= offered}
        if not stale:
            return fabric
        return dataclasses.replace(fabric, partitions=tuple(
            dataclasses.replace(p, active=False) if p.partition_id in stale else p for p in fabric.partitions))

    def activate(self, units: dict[str, tuple[str, ...]]) -> int:
        """The partition of exactly ``units``' GPUs, active (``units``: unit ID -> its GPU
        addresses); AllocationError saying why not. Returns the partition's ID."""
        gpus = sorted(g for gs in units.values() for g in gs)
        with self._lock:
            fabric = self._fabric()
            part = fabric.exactly(gpus)
            if part is None:
                raise AllocationError(fabric.refusal(gpus))
            if not part.active:
                self._activate(fabric, part)
            record = self._record()
            record[str(part.partition_id)] = sorted(units)
            self._activated[str(part.partition_id)] = time.monotonic()
            self._write(record)
        log.info("NVLink partition %d (%s) is active for %s", part.partition_id, ", ".join(part.gpus),
                 ", ".join(sorted(units)))
        return part.partition_id

    def deactivate(self, units: Iterable[str]) -> list[int]:
        """Deactivate the recorded partitions activated for any of ``units`` (§5.9; a claim
        unprepared); their IDs."""
        units = {u.lower() for u in units}
        with self._lock:
            held = {u.lower() for pid, us in self._record().items() for u in us if not units & {x.lower() for x in us}}
            self._activated.clear()  # asked by name: no grace
            return self._release(held)

    def release_unheld(self) -> list[int]:
        """Deactivate the recorded partitions none of whose devices a pod holds; their IDs."""
        given = self._given()
        if given is None:
            return []
        with self._lock:
            return self._release(given)

    def _release(self, given: set[str]) -> list[int]:
        released = []
        record = self._record()
        for pid, units in sorted(record.items()):
            if any(u.lower() in given for u in units) or time.monotonic() - self._activated.get(pid, -GRACE) < GRACE:
                continue
            try:
                self._call(lambda fm, p=int(pid): fm.deactivate(p))
            except FabricManagerError as e:
                if e.code != UNINITIALIZED:  # §5.9: "specified partition is not activated"
                    log.warning("NVLink partition %s stays active: %s", pid, e)
                    continue
            del record[pid]
            released.append(int(pid))
            log.info("NVLink partition %s deactivated: the kubelet lists none of its devices for a pod", pid)
        if released:
            self._write(record)
        return released

    def restore(self) -> None:
        """FM told which partitions are active, from our record (§5.10): after its restart
        it waits for this list, an empty one included."""
        with self._lock:
            self._restore()

    # -- the release loop ----------------------------------------------------------

    def start(self) -> None:
        self._stop.clear()  # started again after a relabel swapped the plugin managers
        try:
            with self._lock:
                self._fabric()  # restores the record if FM restarted meanwhile
        except (FabricManagerError, AllocationError) as e:
            log.warning("NVLink fabric: %s", e)
        self._thread = threading.Thread(target=self._loop, name="nvlink-release", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        with self._lock:
            if self._fm is not None:
                self._fm.close()
                self._fm = None

    def _loop(self) -> None:
        while not self._stop.wait(RELEASE_INTERVAL):
            try:
                self.release_unheld()
            except Exception:  # noqa: BLE001 - the loop outlives one bad turn
                log.exception("NVLink fabric: releasing partitions failed")

    # -- FM, under self._lock -------------------------------------------------------

    def ask(self, gpus: Sequence[str]) -> tuple[nf.Fabric | None, str | None]:
        """``nvlinkfabric.read_fabric``'s answer, but an FM waiting after its restart is given
        our record first (§5.10): it answers then, where a plain read would find it not ready."""
        try:
            with self._lock:
                reported = self._call(lambda fm: fm.partitions())
        except FabricManagerError as e:
            return None, f"Fabric Manager did not answer: {e}"
        return nf.fabric_from(reported, gpus, self.module_ids), None

    def _fabric(self) -> nf.Fabric:
        """FM's partitions matched to the node's GPUs; AllocationError where FM does not answer."""
        try:
            reported = self._call(lambda fm: fm.partitions())
        except FabricManagerError as e:
            raise AllocationError(f"the NVLink fabric cannot be set up: {e}") from None
        gpus = [self.module_ids[n] for n in sorted(self.module_ids)] or [
            nf.bus_id(g.pci_bus_id) for p in reported for g in p.gpus if nf.bus_id(g.pci_bus_id)]
        return nf.fabric_from(reported, gpus, self.module_ids)

    def _activate(self, fabric: nf.Fabric, part: nf.Partition) -> None:
        try:
            self._call(lambda fm: fm.activate(part.partition_id))
            return
        except FabricManagerError as e:
            if e.code != IN_USE:
                raise AllocationError(f"NVLink partition {part.partition_id} cannot be activated: {e}") from None
        # A partition of ours sharing a GPU is active: left by a pod that ended before the
        # release loop saw it. The kubelet hands out only devices no live pod holds, so the
        # GPUs it gave this Allocate are free: that partition's VM is gone.
        record = self._record()
        for other in fabric.partitions:
            pid = str(other.partition_id)
            if other.active and pid in record and set(other.gpus) & set(part.gpus):
                try:
                    self._call(lambda fm, p=other.partition_id: fm.deactivate(p))
                except FabricManagerError as e:
                    if e.code != UNINITIALIZED:
                        continue
                del record[pid]
                log.info("NVLink partition %s deactivated: the kubelet gave its GPUs to a new pod", pid)
        self._write(record)
        try:
            self._call(lambda fm: fm.activate(part.partition_id))
        except FabricManagerError as e:
            blocking = [p.partition_id for p in fabric.partitions if p.active and set(p.gpus) & set(part.gpus)]
            raise AllocationError(f"NVLink partition {part.partition_id} cannot be activated: {e} "
                                  f"(active: {', '.join(map(str, blocking)) or 'none'})") from None

    def _call(self, call):
        """``call(fm)`` on the connection, reconnecting once when it went bad; FM waiting after
        a restart is given our record first."""
        for attempt in range(3):
            try:
                if self._fm is None:
                    self._fm = nf.connect(self.host, self.settings)
                return call(self._fm)
            except FabricManagerError as e:
                if e.code == NOT_CONFIGURED and attempt < 2:
                    self._restore()
                    continue
                if self._fm is not None and e.code in (None, TIMEOUT, CONNECTION_NOT_VALID) and attempt < 2:  # broken, or FM came back
                    self._fm.close()
                    self._fm = None
                    continue
                raise
        raise AssertionError("unreachable")

    def _restore(self) -> None:
        ids = [int(p) for p in self._record()]
        if self._fm is None:
            self._fm = nf.connect(self.host, self.settings)
        self._fm.set_activated(ids)
        log.info("Fabric Manager told the active NVLink partitions from our record: %s",
                 ", ".join(map(str, ids)) or "none")

    def _record(self) -> dict[str, list[str]]:
        try:
            found = read_json(self.host.path(self.record_path), {})
        except ValueError as e:  # unreadable: Allocate goes on, FM's own state still holds
            if not self._unrecorded:
                log.warning("NVLink fabric: %s", e)
            self._unrecorded = True
            return {}
        return {str(k): list(v) for k, v in found.items()} if isinstance(found, dict) else {}

    def _write(self, record: dict[str, list[str]]) -> None:
        """The record kept; where it cannot be (a read-only state dir: the chart mounts it only
        with devices.nvlinkFabric sharedNvswitch or FM at a unix socket) the partitions are
        still activated and released, but a restarted FM cannot be told them: said once."""
        path = self.host.path(self.record_path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json(path, record)
        except OSError as e:
            if not self._unrecorded:
                log.warning("NVLink fabric: the record of active partitions %s cannot be written (%s): after a "
                            "Fabric Manager restart they cannot be restored", self.record_path, e)
            self._unrecorded = True

    def _ask_kubelet(self) -> set[str] | None:
        from gpunode.services.podresources import list_pod_devices

        asked = list_pod_devices(self.host, timeout=2.0)
        return None if asked.unknown else {a.device_id.lower() for a in asked.assignments}


def gpus_of_units(units: Iterable) -> dict[str, tuple[str, ...]]:
    """Each passthrough unit's GPU addresses (a unit is one IOMMU group)."""
    return {u.id: tuple(d.bdf for d in u.devices if d.is_gpu) for u in units}
