"""The kubelet simulator's client of one registered device plugin (``nodesim.kubelet``): it
dials the plugin's socket, asks GetDevicePluginOptions and consumes ListAndWatch in a thread,
reporting each update and the stream's end to the simulator, as the kubelet's own client does
(k8s.io/kubernetes v1.35.4, pkg/kubelet/cm/devicemanager/plugin/v1beta1/client.go)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import grpc

from kubeletapi import deviceplugin_pb2 as pb
from kubeletapi import deviceplugin_pb2_grpc as pb_grpc
from nodesim.dial import dial
from nodesim.kubeletstate import PluginOptions, Registration
from nodesim.podresources import ListedDevice

log = logging.getLogger("nodesim.kubelet")


class PluginClient:
    """The kubelet's connection to one registered plugin."""

    def __init__(self, sim: Any, registration: Registration, socket: Path) -> None:
        self.sim = sim
        self.registration = registration
        self.channel = dial(socket)
        self.stub = pb_grpc.DevicePluginStub(self.channel)
        self._stream = None
        self._closed = threading.Event()
        # start() and close() may race (a stop() while a Register is being accepted).
        self._lifecycle = threading.Lock()
        self.thread = threading.Thread(
            target=self._run, name=f"kubelet-sim-{registration.resource_name}", daemon=True
        )

    def start(self) -> None:
        with self._lifecycle:
            if not self._closed.is_set():
                self.thread.start()

    def _run(self) -> None:
        name = self.registration.resource_name
        try:
            answer = self.stub.GetDevicePluginOptions(pb.Empty(), timeout=5)
            self.sim._record_options(
                name,
                PluginOptions(
                    get_preferred_allocation_available=answer.get_preferred_allocation_available,
                    pre_start_required=answer.pre_start_required,
                ),
            )
            self._stream = self.stub.ListAndWatch(pb.Empty())
            if self._closed.is_set():
                self._stream.cancel()
            for response in self._stream:
                devices = [
                    ListedDevice(
                        id=d.ID,
                        health=d.health,
                        numa_node=d.topology.nodes[0].ID if d.topology.nodes else None,
                    )
                    for d in response.devices
                ]
                self.sim._record_devices(self, devices)
        except grpc.RpcError as exc:
            if not self._closed.is_set():
                log.info("kubelet-sim: stream from %s ended: %s", name, exc.code().name)
        except ValueError:
            if not self._closed.is_set():  # "Cannot invoke RPC on closed channel": closed meanwhile
                raise
        finally:
            self.sim._record_disconnect(self)

    def close(self) -> None:
        with self._lifecycle:
            self._closed.set()
            started = self.thread.ident is not None
        if self._stream is not None:
            self._stream.cancel()
        self.channel.close()
        if started:
            self.thread.join(5)
