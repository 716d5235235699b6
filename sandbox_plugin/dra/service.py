"""The kubelet's DRA plugin service v1 on the driver's endpoint socket.

kubelet 1.35 (pkg/kubelet/cm/dra/manager.go) batches the claims of a pod per
driver into one ``NodePrepareResources`` call before the pod's containers are
created, and one ``NodeUnprepareResources`` once the pod is gone; it reads the
answer per claim UID and counts a missing entry as a claim to ask again. Each
claim here is answered on its own: its devices, or its error. The calls run on the
transport's one thread, one after another, so two calls never race over the
checkpoint.
"""

from __future__ import annotations

import logging

from kubeletapi import dra_pb2 as pb
from sandbox_plugin.dra.claims import ClaimError, ClaimRef
from sandbox_plugin.dra.preparing import ClaimPreparer
from sandbox_plugin.served import ServedSocket

log = logging.getLogger(__name__)

_SERVICE = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/"


def _ref(claim: pb.Claim) -> ClaimRef:
    return ClaimRef(claim.namespace, claim.name, claim.uid)


class DraService:
    def __init__(self, preparer: ClaimPreparer) -> None:
        self.preparer = preparer

    def unary(self) -> dict:
        return {_SERVICE + "NodePrepareResources": self.prepare,
                _SERVICE + "NodeUnprepareResources": self.unprepare}

    def prepare(self, request: bytes) -> bytes:
        answer = pb.NodePrepareResourcesResponse()
        for claim in pb.NodePrepareResourcesRequest.FromString(request).claims:
            entry = answer.claims[claim.uid]
            try:
                prepared = self.preparer.prepare(_ref(claim))
            except ClaimError as exc:
                log.warning("cannot prepare: %s", exc)
                entry.error = str(exc)
                continue
            except OSError as exc:  # the checkpoint could not be written
                entry.error = f"{_ref(claim)}: cannot record the prepared claim: {exc}"
                continue
            entry.devices.extend(pb.Device(request_names=d.request_names, pool_name=d.pool,
                                           device_name=d.device, cdi_device_ids=d.cdi_ids)
                                 for d in prepared.devices)
        return answer.SerializeToString()

    def unprepare(self, request: bytes) -> bytes:
        answer = pb.NodeUnprepareResourcesResponse()
        for claim in pb.NodeUnprepareResourcesRequest.FromString(request).claims:
            entry = answer.claims[claim.uid]
            try:
                self.preparer.unprepare(_ref(claim))
            except OSError as exc:  # the checkpoint could not be written
                entry.error = f"{_ref(claim)}: cannot record the unprepare: {exc}"
        return answer.SerializeToString()


def dra_socket(path, preparer: ClaimPreparer, driver: str, on_failure=None) -> ServedSocket:
    return ServedSocket(path, DraService(preparer).unary(), name=f"dra-{driver}",
                        fix="use a shorter --kubelet-dir or --driver-name", on_failure=on_failure)
