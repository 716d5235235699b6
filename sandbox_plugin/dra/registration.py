"""How the kubelet finds the driver: a registration socket in its plugins_registry.

kubelet 1.35's plugin watcher (pkg/kubelet/pluginmanager: ``pluginwatcher`` watches
``<kubelet dir>/plugins_registry`` for sockets, ``operationexecutor``'s
``GenerateRegisterPluginFunc`` registers each) dials a new socket, calls
``GetInfo``, hands the answer to the handler of its ``type`` (``DRAPlugin``: the DRA
manager, pkg/kubelet/cm/dra/plugin ``DRAPluginManager``), which checks that one of
``supported_versions`` is a DRA service it speaks (``v1.DRAPlugin`` first, then
``v1beta1.DRAPlugin``: ``servicesSupportedByKubelet``) and dials ``endpoint``; then it
calls ``NotifyRegistrationStatus`` with the outcome. Removing the socket
deregisters the driver. A kubelet that restarts finds the socket again by walking
the directory, so the socket only has to stay where it is.

The layout is the one k8s.io/dynamic-resource-allocation's ``kubeletplugin`` uses:
``<kubelet dir>/plugins_registry/<driver>-reg.sock`` for registration and
``<kubelet dir>/plugins/<driver>/dra.sock`` for the DRA service (with this driver's
checkpoint beside it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from gpunode.host.root import HostRoot
from kubeletapi import pluginregistration_pb2 as reg
from sandbox_plugin.served import ServedSocket

log = logging.getLogger(__name__)

DRA_PLUGIN_TYPE = "DRAPlugin"
# k8s.io/kubelet pkg/apis/dra/v1/types.go DRAPluginService: the name a driver lists
# in supported_versions for the v1 DRAPlugin service.
DRA_SERVICE = "v1.DRAPlugin"
_SERVICE = "/pluginregistration.Registration/"
_SHORTER = "use a shorter --kubelet-dir or --driver-name"


@dataclass(frozen=True)
class Layout:
    """Where one driver's files are, as the host sees them."""

    kubelet_dir: str
    driver: str

    @property
    def registration_socket(self) -> str:
        return f"{self.kubelet_dir}/plugins_registry/{self.driver}-reg.sock"

    @property
    def plugin_dir(self) -> str:
        return f"{self.kubelet_dir}/plugins/{self.driver}"

    @property
    def endpoint(self) -> str:
        return f"{self.plugin_dir}/dra.sock"

    @property
    def checkpoint(self) -> str:
        return f"{self.plugin_dir}/checkpoint.json"


class Registration:
    """Serves the registration socket and remembers the kubelet's verdict."""

    def __init__(self, host: HostRoot, layout: Layout,
                 on_failure: Callable[[], None] | None = None) -> None:
        self.layout = layout
        # The endpoint as the kubelet dials it: the kubelet sees the node's / where the
        # container runtime does (``HostRoot.runtime_root``: / on a node; hack/local-cluster's
        # node runs its kubelet with --root-dir below a simulated root).
        self.endpoint = host.runtime_node(layout.endpoint)
        self.registered = threading.Event()
        self.error = ""  # the kubelet's last refusal
        self.notifications = 0
        self.socket = ServedSocket(host.path(layout.registration_socket), {
            _SERVICE + "GetInfo": self._get_info,
            _SERVICE + "NotifyRegistrationStatus": self._notify,
        }, name=f"dra-registration-{layout.driver}", fix=_SHORTER, on_failure=on_failure)

    def _get_info(self, request: bytes) -> bytes:
        reg.InfoRequest.FromString(request)
        return reg.PluginInfo(type=DRA_PLUGIN_TYPE, name=self.layout.driver,
                              endpoint=self.endpoint,
                              supported_versions=[DRA_SERVICE]).SerializeToString()

    def _notify(self, request: bytes) -> bytes:
        status = reg.RegistrationStatus.FromString(request)
        self.notifications += 1
        if status.plugin_registered:
            self.error = ""
            self.registered.set()
            log.info("registered with the kubelet as DRA driver %s (%s)", self.layout.driver,
                     self.layout.endpoint)
        else:
            self.error = status.error
            self.registered.clear()
            log.error("the kubelet refused DRA driver %s: %s", self.layout.driver, status.error)
        return reg.RegistrationStatusResponse().SerializeToString()
