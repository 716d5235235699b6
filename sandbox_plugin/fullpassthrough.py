"""The device plugin's side of NVIDIA's full passthrough model (Fabric Manager User Guide §6):
a pod gets one of §6.1's VM configurations, the board's GPUs with the NVSwitches they need.

``gpunode.policy.nvlinkunits`` makes the units: on an HGX H100 board whose NVSwitches are on
vfio-pci, the whole board (8 GPUs, 4 NVSwitches) is one device of its own resource
(``nvidia.com/<GPU>_x8``), and each GPU is one device of the GPU resource (§6.1's 1-GPU VM).
The kubelet sees two resources and does not know they share GPUs, so ``BoardGuard`` keeps
them apart at Allocate:

- the GPU resource gives one GPU per pod: a set of another size is no §6.1 configuration,
  and Allocate refuses it, naming the sizes (``Board.refusal``);
- the board unit is refused while a pod holds any of its GPUs, and a GPU while a pod holds
  the board unit. "Holds": the kubelet lists it for a pod (PodResources ``List``), or this
  plugin answered its Allocate in the last ``GRACE`` s (the kubelet lists a pod's devices
  only after Allocate answered).

ListAndWatch shows the same: the board unit is Unhealthy while a pod holds one of its GPUs,
and the GPUs while a pod holds the board unit (``BoardGuard.blocked``, applied at each rescan
and every ``WATCH_INTERVAL`` s), so the scheduler does not count a device it could not give.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from gpunode.policy import nvlinkunits
from sandbox_plugin.resources import HEALTHY, UNHEALTHY, AllocationError

log = logging.getLogger(__name__)

GRACE = 5.0  # as sandbox_plugin.fabric: an answered Allocate counts as held this long
WATCH_INTERVAL = 1.0


class BoardGuard:
    """One full passthrough board: ``board_id`` (its unit of ``unit_resource``) and the GPU
    units of ``gpu_resource`` it is made of. ``given()``: the device IDs the kubelet gave pods
    (None when it cannot be asked: then only this plugin's own recent answers count)."""

    def __init__(self, board: nvlinkunits.Board, board_id: str, unit_resource: str, gpu_resource: str,
                 gpu_ids: Iterable[str], given: Callable[[], set[str] | None]) -> None:
        self.board = board
        self.board_id = board_id
        self.unit_resource = unit_resource
        self.gpu_resource = gpu_resource
        self.gpu_ids = frozenset(i.lower() for i in gpu_ids)
        self._given = given
        self._lock = threading.RLock()  # check() takes it around held()
        self._answered: dict[str, float] = {}  # device ID -> when Allocate gave it

    def same(self, other: BoardGuard) -> bool:
        return (self.board_id, self.unit_resource, self.gpu_resource, self.gpu_ids) == (
            other.board_id, other.unit_resource, other.gpu_resource, other.gpu_ids)

    def held(self) -> set[str]:
        """The board's device IDs a pod holds now."""
        given = self._given() or set()
        now = time.monotonic()
        with self._lock:
            recent = {i for i, at in self._answered.items() if now - at < GRACE}
        return {i.lower() for i in given | recent} & (self.gpu_ids | {self.board_id})

    def blocked(self, held: set[str] | None = None) -> dict[str, str]:
        """Device ID -> why it cannot be given now, for ListAndWatch (Unhealthy)."""
        held = self.held() if held is None else held
        if self.board_id in held:
            why = (f"a pod holds the whole board ({self.unit_resource}={self.board_id}), which takes this GPU "
                   f"({nvlinkunits.GUIDE})")
            return dict.fromkeys(self.gpu_ids - held, why)
        taken = sorted(held & self.gpu_ids)
        if taken:
            return {self.board_id: f"GPU(s) {', '.join(taken)} of the board are held by a pod as {self.gpu_resource}: "
                                   f"the board's {self.board.size}-GPU unit needs all of them ({nvlinkunits.GUIDE})"}
        return {}

    def check(self, resource_name: str, device_ids: Sequence[str]) -> None:
        """Allocate's check for ``device_ids`` of ``resource_name``; AllocationError saying why not.
        The IDs count as held from now on (until the kubelet lists them, or ``GRACE``)."""
        ids = [i.lower() for i in dict.fromkeys(device_ids)]
        if resource_name == self.gpu_resource and ids and set(ids) <= self.gpu_ids:
            if len(ids) != 1:
                raise AllocationError(self.board.refusal(ids, self.gpu_resource, self.unit_resource))
        elif resource_name != self.unit_resource or ids != [self.board_id]:
            return
        with self._lock:  # one check-and-take at a time: two Allocates must not both pass
            blocked = self.blocked(self.held())
            for device_id in ids:
                if device_id in blocked:
                    raise AllocationError(f"{resource_name} device {device_id} cannot be given: {blocked[device_id]}")
            now = time.monotonic()
            self._answered.update(dict.fromkeys(ids, now))
        log.info("full passthrough: %s %s given (%s)", resource_name, ", ".join(ids), nvlinkunits.GUIDE)


def guard_for(units: Sequence, given: Callable[[], set[str] | None]) -> BoardGuard | None:
    """The guard of the board unit among ``units`` (``PassthroughUnit``s), or None."""
    whole = next((u for u in units if u.id.startswith(nvlinkunits.UNIT_ID_PREFIX)), None)
    board = nvlinkunits.board_from(whole.devices) if whole is not None else None
    if whole is None or board is None:
        return None
    gpus = {d.bdf for d in board.gpus}
    parts = [u for u in units if u is not whole and set(u.bdfs) & gpus]
    if not parts:
        return None
    return BoardGuard(board, whole.id, whole.resource_name, parts[0].resource_name, (u.id for u in parts), given)


class BoardWatch:
    """The discovery's board: its guard (kept while the board is the same), the units a pod's
    holding of others keeps from being given marked Unhealthy, and a thread that asks for a
    rescan (``refresh()``) when that changes."""

    def __init__(self, given: Callable[[], set[str] | None], refresh: Callable[[], object]) -> None:
        self.guard: BoardGuard | None = None
        self._given = given
        self._refresh = refresh
        self._blocked: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def units(self, units: list) -> list:
        guard = guard_for(units, self._given)
        if guard is None or self.guard is None or not self.guard.same(guard):
            if guard is not None:
                log.info("NVLink fabric: full passthrough (%s, %s): a Kata pod takes 1 GPU of %s, or the whole "
                         "board (%d GPUs, %d NVSwitches) as %s=%s", guard.board.model.name, nvlinkunits.GUIDE,
                         guard.gpu_resource, guard.board.size, len(guard.board.nvswitches), guard.unit_resource,
                         guard.board_id)
            self.guard = guard
        if self.guard is None:
            return units
        if self._thread is None:
            self._thread = threading.Thread(target=self._follow, name="nvlink-board", daemon=True)
            self._thread.start()
        self._blocked = self.guard.blocked()
        return [dataclasses.replace(u, health=UNHEALTHY, reason=self._blocked[u.id])
                if u.id in self._blocked and u.health == HEALTHY else u for u in units]

    def stop(self) -> None:
        self._stop.set()

    def _follow(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL):
            guard = self.guard
            try:
                if guard is not None and guard.blocked() != self._blocked:
                    self._refresh()
            except Exception:  # noqa: BLE001 - the watch outlives one bad turn
                log.exception("full passthrough: looking at the board's held devices failed")
