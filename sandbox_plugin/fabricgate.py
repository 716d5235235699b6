"""Whether an NVSwitch board's GPUs are advertised for Kata, and in which of NVIDIA's models
(Fabric Manager User Guide §4): the device plugin's and the DRA driver's one decision.

``nvlinkfabric.decide`` is ``katamgr plan``'s rule. Where it finds a model, the GPUs are
advertised (in the Shared NVSwitch model through a ``FabricGuard``: one partition per pod).
Where neither model holds (FM not answering, and a Kata that cannot cold-plug NVSwitches), a
Kata pod given any of the board's GPUs could not start CUDA (``cuInit`` fails with 802), so
none of them is advertised: ``withheld`` is the problem ``plan`` shows, logged once. The
operator's way out is ``devices.nvlinkFabric: off`` ("no fabric setup, I know"): that skips
this gate (``gate_for`` returns None).

While withheld, FM is asked again every ``RECHECK_INTERVAL`` s (each ask bounded by FM's
timeout): an FM started after the plugin (the GPU Operator's driver container coming up
later) switches the board to the Shared NVSwitch model and its GPUs are advertised, without
a restart.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from gpunode.host.root import HostRoot
from gpunode.services import nvlinkfabric as nf
from sandbox_plugin.fabric import FabricGuard

log = logging.getLogger(__name__)

RECHECK_INTERVAL = 30.0  # the plugins' rescan interval: FM is asked no more often

Decide = Callable[[], nf.ModelChoice]


class FabricGate:
    """One NVSwitch board's model for the plugins. ``decide()``: the model now (asks FM);
    None for a gate fixed on ``guard`` (``sharedNvswitch`` configured, or a test's guard)."""

    def __init__(self, host: HostRoot, settings: nf.FabricSettings, decide: Decide | None = None,
                 guard: FabricGuard | None = None, make_guard: Callable[[], FabricGuard] | None = None,
                 first: nf.ModelChoice | None = None) -> None:
        self.host = host
        self.settings = settings
        self._make_guard = make_guard or (lambda: FabricGuard(host, settings))
        self._decide = decide
        if first is not None:  # decided already (the node's context): FM is not asked twice
            self.choice = first
        else:
            self.choice = decide() if decide is not None else nf.ModelChoice(nf.SHARED, "given")
        self.guard = guard
        if self.choice.model == nf.SHARED and self.guard is None:
            self.guard = self._make_guard()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_change: Callable[[], None] = lambda: None
        self._metrics = None
        self.rechecks = 0
        if self.withheld:
            log.warning("%s. None of this board's GPUs is advertised for Kata until that is fixed "
                        "(Fabric Manager is asked again every %g s), or devices.nvlinkFabric is off",
                        self.withheld, RECHECK_INTERVAL)
        else:
            log.info("NVLink fabric: %s (%s)", nf.MODEL_TITLES.get(self.choice.model, self.choice.model),
                     self.choice.reason)

    @classmethod
    def fixed(cls, guard: FabricGuard) -> FabricGate:
        return cls(guard.host, guard.settings, None, guard)

    @property
    def withheld(self) -> str | None:
        """Why the board's GPUs are not advertised (the problem ``plan`` names); None: they are."""
        choice = self.choice
        return (choice.problem or choice.reason) if choice.model is None else None

    @property
    def model(self) -> str:
        return self.choice.model or "none"

    def start(self, on_change: Callable[[], None], metrics=None) -> None:
        """The guard's release loop, and while withheld the re-check; ``on_change()`` is
        called once the board's GPUs may be advertised (the caller rescans)."""
        self._on_change = on_change
        self._metrics = metrics
        if metrics is not None:
            metrics.nvlink_model = self.model
        if self.guard is not None:
            self.guard.start()
        if self.withheld and self._decide is not None and (self._thread is None or not self._thread.is_alive()):
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="nvlink-recheck", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
        if self.guard is not None:
            self.guard.stop()

    def recheck(self) -> bool:
        """Decide again while withheld; True when the board's GPUs are advertised from now on."""
        if not self.withheld or self._decide is None:
            return False
        choice = self._decide()
        self.rechecks += 1
        if choice.model is None:
            return False
        with self._lock:
            if choice.model == nf.SHARED and self.guard is None:
                self.guard = self._make_guard()
                self.guard.start()
            self.choice = choice
        if self._metrics is not None:
            self._metrics.nvlink_model = self.model
        log.info("NVLink fabric: %s now (%s); this board's GPUs are advertised",
                 nf.MODEL_TITLES.get(choice.model, choice.model), choice.reason)
        self._on_change()
        return True

    def _loop(self) -> None:
        while not self._stop.wait(RECHECK_INTERVAL):
            try:
                if self.recheck() or not self.withheld:
                    return
            except Exception:  # noqa: BLE001 - the re-check outlives one bad turn
                log.exception("NVLink fabric: asking Fabric Manager again failed")


def ask_guarded(host: HostRoot, settings: nf.FabricSettings, gpus: list[str]) -> tuple[nf.Fabric | None, str | None]:
    """FM asked as the plugins ask it (``FabricGuard.ask``: our record restored into an FM
    waiting after its restart first): the node context's fabric step for both plugin programs."""
    asking = FabricGuard(host, settings)
    try:
        return asking.ask(gpus)
    finally:
        asking.stop()


def gate_for(host: HostRoot, settings: nf.FabricSettings, inventory,
             make_guard: Callable[[], FabricGuard] | None = None,
             choice: nf.ModelChoice | None = None) -> FabricGate | None:
    """The gate of the node's NVSwitch board (``inventory``: ``gpunode.policy.inventory``'s,
    with the Kata release its NVSwitch rule decides by); None without NVSwitches, with
    ``devices.nvlinkFabric: off`` (the operator's documented opt-out), or full passthrough
    configured where Kata takes NVSwitches (nothing to set up on the host). ``choice``: the
    model the node's context decided at start (``gpunode.services.nodecontext``; None: decided
    here); FM is asked again only while neither model holds."""
    nvswitches = sum(1 for d in inventory.devices if d.is_nvswitch)
    if nvswitches == 0 or settings.model == nf.OFF:
        return None
    if settings.model == nf.SHARED:  # asked for: Allocate says why when FM does not answer
        return FabricGate(host, settings, None, (make_guard or (lambda: FabricGuard(host, settings)))())
    kata = inventory.nvswitch_rule.kata
    gpus = [d.bdf for d in inventory.devices if d.is_gpu]

    def decide() -> nf.ModelChoice:
        return nf.decide(host, settings, nvswitches=nvswitches, gpus=gpus,
                         kata_takes_nvswitches=kata.cold_plugs_nvswitches, kata=str(kata),
                         ask=lambda: ask_guarded(host, settings, gpus))[0]

    gate = FabricGate(host, settings, decide, make_guard=make_guard, first=choice)
    return None if gate.choice.model == nf.FULL else gate
