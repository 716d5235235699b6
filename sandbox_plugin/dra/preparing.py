"""Preparing a claim: which of this node's devices it was given, and the CDI names
by which the runtime, and Kata, reach them.

Nothing on the host changes when a claim is prepared: katamgr has already bound
each unit to vfio-pci and described it in a CDI spec, exactly as for the device
plugin. Preparing is checking and naming: the claim is read from the API server
(``claims``), the pods it is reserved for must run in a Kata GPU runtime class, judged
by the class's handler, on every prepare, a claim already prepared included (a runc
container would get the raw VFIO device; ``--any-runtime-class`` turns it off), each
device it was allocated must be one of this node's units, healthy
now (the sysfs and /dev re-check the device plugin's Allocate makes), held by no
other prepared claim, and named by a CDI spec on the host; the answer lists, per
device, the name ``<resource name>=<unit id>`` that katamgr's spec for the
resource defines (``sandbox_plugin.cdinames.HostCdiSpecs``) — the name Kata's
cold-plug forms for the device plugin's devices too. The claim is checkpointed
before the answer goes out. Unpreparing forgets it.

Every problem is the claim's own error (the kubelet retries the claim, shows the
message in the pod's events) and names the claim and the device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from gpunode.kataclasses import KATA_GPU_HANDLERS, KATA_HANDLERS
from sandbox_plugin.dra.checkpoint import Checkpoint, PreparedClaim, PreparedDevice
from sandbox_plugin.dra.claims import (
    ClaimError,
    ClaimRef,
    check_runtime_classes,
    our_devices,
    read_claim,
)

if TYPE_CHECKING:  # the client is imported where the API is talked to (claims, slices)
    from kubernetes.client import ApiClient

log = logging.getLogger(__name__)


class DeviceError(Exception):
    """A device of this node cannot be handed out now; the message says why."""


# device name -> its CDI names; DeviceError when it is gone, unhealthy or unnamed
Resolve = Callable[[str], tuple[str, ...]]


class ClaimPreparer:
    def __init__(self, api: ApiClient, driver: str, node: str, checkpoint: Checkpoint,
                 resolve: Resolve, runtime_classes: frozenset[str] | None = None,
                 handlers: tuple[tuple[str, ...], tuple[str, ...]] = (KATA_HANDLERS, KATA_GPU_HANDLERS),
                 activate: Callable[[list[str]], None] | None = None,
                 release: Callable[[list[str]], None] | None = None) -> None:
        """``activate(devices)``: the NVLink partition of exactly these devices made active
        (DeviceError saying why not), before the claim is checkpointed and answered;
        ``release(devices)``: it deactivated once the claim is unprepared."""
        self.activate = activate
        self.release = release
        self.api = api
        self.runtime_classes = runtime_classes  # None: any pod may have the devices
        # (Kata runtimes' handlers, Kata GPU runtimes' handlers), globs: how a class is judged.
        self.handlers = handlers
        self.driver = driver
        self.node = node
        self.checkpoint = checkpoint
        self.resolve = resolve

    def prepare(self, ref: ClaimRef) -> PreparedClaim:
        """The claim's devices with their CDI names; ClaimError saying why not."""
        # The pods are judged on every prepare, the claim held or not: a kubelet that restarted
        # asks again for a claim it prepared before, whose reservedFor may since have gained a
        # pod outside Kata (a claim shared by name), and a RuntimeClass may have been made again
        # with another handler.
        claim = read_claim(self.api, ref)
        if self.runtime_classes is not None:
            check_runtime_classes(self.api, claim, ref, self.runtime_classes,
                                  kata_handlers=self.handlers[0], gpu_handlers=self.handlers[1])
        held = self.checkpoint.get(ref.uid)
        if held is not None:
            # Asked again (a kubelet or driver restart): the same answer, if its devices
            # can still be used.
            for device in held.devices:
                self._resolve(ref, device.device)
            return held
        devices: dict[str, PreparedDevice] = {}
        for allocated in our_devices(claim, ref, self.driver, self.node):
            other = self.checkpoint.holder(allocated.device, allocated.pool)
            if other is not None and other.uid != ref.uid:
                raise ClaimError(
                    f"{ref}: device {allocated.device} is still prepared for ResourceClaim "
                    f"{other.ref} (UID {other.uid}), which the kubelet has not unprepared")
            earlier = devices.get(allocated.device)
            requests = (earlier.request_names if earlier else ()) + (allocated.request,)
            devices[allocated.device] = PreparedDevice(
                requests, allocated.pool, allocated.device,
                earlier.cdi_ids if earlier else self._resolve(ref, allocated.device))
        prepared = PreparedClaim(ref.uid, ref.namespace, ref.name, tuple(devices.values()))
        if self.activate is not None:  # before the VM starts (Fabric Manager User Guide §7)
            try:
                self.activate(sorted(devices))
            except DeviceError as exc:
                raise ClaimError(f"{ref}: {exc}") from exc
        self.checkpoint.add(prepared)
        log.info("prepared %s (UID %s): %s", ref, ref.uid, ", ".join(
            f"{d.device} as {' '.join(d.cdi_ids)}" for d in prepared.devices))
        return prepared

    def unprepare(self, ref: ClaimRef) -> None:
        held = self.checkpoint.get(ref.uid)
        if held is not None and self.release is not None:
            self.release([d.device for d in held.devices])
        if self.checkpoint.remove(ref.uid):
            log.info("unprepared %s (UID %s)", ref, ref.uid)

    def _resolve(self, ref: ClaimRef, device: str) -> tuple[str, ...]:
        try:
            return self.resolve(device)
        except DeviceError as exc:
            raise ClaimError(f"{ref}: device {device}: {exc}") from exc
