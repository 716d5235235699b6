"""``--workload auto`` with a cluster: serve what the node's labels ask for now, and switch
when they change, without a restart.

The node's labels say which workload it runs (``nvidia.com/gpu.workload.config``) and
which GPU Operator operands it opts out of (``nvidia.com/gpu.deploy.<operand>=false``);
``gpunode.policy.workload`` turns them into a ``Resolution`` by the same rule as
``katamgr run``, which follows the same labels to bind and unbind the GPUs. From that
``mode_for`` picks what this process serves:

- ``vm-passthrough``: the passthrough resources, unless the node opts out of the
  operator's sandbox device plugin (``sandbox-device-plugin`` or
  ``kata-sandbox-device-plugin``);
- ``container``: ``nvidia.com/gpu``, unless the node opts out of ``device-plugin``;
- ``vm-vgpu``: nothing (NVIDIA's vGPU device manager serves it);

and nothing for a mode left out of ``--auto-modes``. The chart's sandbox agent pod runs
with ``--auto-modes vm-passthrough``: on a container node ``nvidia.com/gpu`` is the
container plugin DaemonSet's (this chart's or the GPU Operator's), so this one stands
down and no GPU is ever advertised by two plugins. Standing down stops the plugin
servers of the devices no pod holds, which removes their sockets: the kubelet marks
their devices unhealthy at once and keeps what running pods were given. The devices
pods still hold stay listed, never allocated (``holds_for``; ``passthrough``, held-only),
until those pods are gone: a restarted kubelet admits its running pods again against the
Node's allocatable and would kill them otherwise.

``PluginRunner`` holds the running ``PluginManager`` (or none) and swaps it; one
``PluginMetrics`` registry outlives the swaps, so ``/metrics`` keeps its counters.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from gpunode.errors import GpuNodeError
from gpunode.policy.workload import (
    PASSTHROUGH_PLUGIN,
    Operand,
    Resolution,
    Workload,
    describe_opt_outs,
)
from sandbox_plugin.manager import Mode, PluginManager
from sandbox_plugin.metrics import PluginMetrics

log = logging.getLogger(__name__)
# The mode line is the command's own announcement: under its logger, as before the follower.
announce = logging.getLogger("sandbox_plugin")

ALL_MODES = frozenset(Mode)


def holds_for(resolved: Resolution, modes: frozenset[Mode] = ALL_MODES) -> bool:
    """Whether a plugin that serves vm-passthrough, on a node that runs another workload,
    keeps serving the passthrough devices pods still hold (held-only: listed, never
    allocated), so that a restarted kubelet keeps those pods; not where the node opts out
    of the sandbox device plugin."""
    return (Mode.VM_PASSTHROUGH in modes and resolved.workload is not Workload.VM_PASSTHROUGH
            and not resolved.opted_out & PASSTHROUGH_PLUGIN)


def mode_for(resolved: Resolution, modes: frozenset[Mode] = ALL_MODES, *,
             split: bool = False) -> tuple[Mode | None, str]:
    """What to serve for the node's workload and opt-outs; None: stand down. And why.
    ``split``: the node's split label leaves a container share (``splitshare``), which a
    plugin serving only containers serves on a vm-passthrough node."""
    why = resolved.why
    if resolved.workload is Workload.VM_VGPU:
        return None, f"{why}, which the vGPU device manager serves, not this plugin"
    mode = Mode(resolved.workload.value)
    if split and mode is Mode.VM_PASSTHROUGH and mode not in modes and Mode.CONTAINER in modes:
        mode, why = Mode.CONTAINER, f"{why}, split: the GPUs outside the VM share are for containers"
    if mode not in modes:
        return None, (f"{why}; this plugin serves only {', '.join(sorted(modes))} (--auto-modes): "
                      f"another plugin serves {mode} nodes")
    opted = resolved.opted_out & (PASSTHROUGH_PLUGIN if mode is Mode.VM_PASSTHROUGH
                                  else frozenset({Operand.DEVICE_PLUGIN}))
    if opted:
        return None, f"{why}; the node opts out of {describe_opt_outs(opted)}"
    return mode, why


class PluginRunner:
    """The plugins of one mode at a time (or none), swapped by ``serve()``."""

    def __init__(self, make: Callable[..., PluginManager]) -> None:
        """``make(mode, metrics, held_only=False)``: a ``PluginManager``."""
        self._make = make
        self.metrics = PluginMetrics()
        self.manager: PluginManager | None = None
        self.mode: Mode | None = None
        self.held = False  # mode None, serving only the passthrough devices pods still hold
        self.why = "not started"
        self._lock = threading.Lock()
        self._stopped = False  # stop() is final: a serve() racing it (a relabel at shutdown) starts nothing
        # The split label's shares (``splitshare``), handed to each manager made; None: not followed.
        self.share = None

    def split_changed(self) -> None:
        """The shares changed: the running plugins list again (the side a GPU leaves first)."""
        manager = self.manager
        if manager is None:
            return
        if manager.discovery is not None:
            manager.refresh()
        if manager.nvml_resource is not None:
            manager.nvml_resource.changes.notify()

    def _share(self, manager: PluginManager) -> PluginManager:
        if self.share is not None:
            if manager.discovery is not None:
                manager.discovery.share = self.share
            if manager.nvml_resource is not None:
                manager.nvml_resource.share = self.share
        return manager

    def serve(self, mode: Mode | None, why: str, held: bool = False) -> bool:
        """Run the plugins of ``mode`` (None: none, or with ``held`` only the passthrough
        devices pods still hold); True when that changed anything."""
        held = held and mode is None
        with self._lock:
            if self._stopped:
                return False
            self.why = why
            if (mode, held) == (self.mode, self.held) and (mode is None and not held or self.manager is not None):
                return False
            current = self.manager
            if (current is not None and current.mode is Mode.VM_PASSTHROUGH
                    and (mode is Mode.VM_PASSTHROUGH or held)):
                # vm-passthrough <-> held-only: the same servers, so the devices pods hold
                # never turn Unhealthy at the kubelet.
                self.mode, self.held = mode, held
                in_place = current
            else:
                in_place = None
                old, self.manager, self.mode, self.held = self.manager, None, mode, held
        if in_place is not None:
            announce.info("mode %s: %s", "none (advertising only the passthrough devices pods still hold)"
                          if held else mode.value, why)
            in_place.set_held_only(held)
            return True
        if old is not None:
            old.stop()
        if held:
            announce.info("mode none (advertising only the passthrough devices pods still hold): %s", why)
        else:
            announce.info("mode %s: %s", mode.value if mode else "none (advertising nothing)", why)
        if mode is not None or held:
            manager = self._share(self._make(Mode.VM_PASSTHROUGH, self.metrics, held_only=True) if held
                                  else self._make(mode, self.metrics))
            with self._lock:
                stopped = self._stopped
                if not stopped:
                    self.manager = manager
            if stopped:
                manager.stop()  # made before stop() ran, never started: its watchers and sockets too
                return False
            manager.start()
        return True

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            manager, self.manager = self.manager, None
        if manager is not None:
            manager.stop()

    def health(self) -> tuple[bool, str]:
        manager = self.manager
        return manager.health() if manager is not None else (True, f"nothing to serve: {self.why}")

    def readiness(self) -> tuple[bool, str]:
        manager = self.manager
        return manager.readiness() if manager is not None else (True, f"nothing to serve: {self.why}")


class LabelFollower:
    """Keeps a ``PluginRunner`` on what the node's labels ask for.

    ``resolve()`` turns the labels a ``gpunode.services.kube.NodeLabelWatch`` keeps into a
    ``Resolution``; ``check()`` (called when the watch reports a change, and as a safety
    net every few seconds) serves its mode. A label that cannot be read or names no
    workload keeps what runs, logged once.
    """

    def __init__(self, runner: PluginRunner, resolve: Callable[[], Resolution],
                 modes: frozenset[Mode] = ALL_MODES) -> None:
        self.runner = runner
        self.resolve = resolve
        self.modes = modes
        self.changed = threading.Event()  # set by the watch's on_change
        self._split_moved = False  # the sides changed, read by poll_split
        self._error: str | None = None

    def first(self) -> tuple[Mode | None, str, bool]:
        """What to serve at start: the mode, why, and whether held-only (errors raised)."""
        resolved = self.resolve()
        share = self.runner.share
        if share is not None:
            share.reload()
        mode, why = mode_for(resolved, self.modes, split=share is not None and share.split)
        return mode, why, holds_for(resolved, self.modes)

    def poll_split(self) -> bool:
        """Read the sides katamgr published (a cheap read, done often); serve them at once
        when they changed (True)."""
        share = self.runner.share
        if share is None or not share.reload():
            return False
        self._split_moved = True
        self.check()
        return True

    def check(self) -> bool:
        """Serve what the labels ask for now; True when the mode changed."""
        try:
            resolved = self.resolve()
            share = self.runner.share
            moved = share is not None and share.reload() or self._split_moved
            self._split_moved = False
            mode, why = mode_for(resolved, self.modes, split=share is not None and share.split)
        except GpuNodeError as exc:
            if str(exc) != self._error:
                log.warning("could not read the node's workload (%s); keeping mode %s", exc,
                            self.runner.mode.value if self.runner.mode else "none")
            self._error = str(exc)
            return False
        self._error = None
        served = self.runner.serve(mode, why, holds_for(resolved, self.modes))
        if moved and not served:
            self.runner.split_changed()
        return served or moved
