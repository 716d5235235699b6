"""The device plugin's facts as the kubelet's v1beta1 messages: the devices ListAndWatch
advertises (a bad ID left out and logged once) and one container's Allocate answer."""

from __future__ import annotations

import logging

from kubeletapi import deviceplugin_pb2 as pb
from sandbox_plugin.resources import MAX_DEVICE_ID_LENGTH, ContainerAllocation, PluginDevice

log = logging.getLogger(__name__)


def to_proto_devices(devices: list[PluginDevice], resource_name: str, warned: set[str]):
    """The advertisable devices as protobuf, dropping (and logging once) bad IDs."""
    out = []
    seen: set[str] = set()
    for device in devices:
        problem = None
        if not device.id:
            problem = "is empty"
        elif len(device.id) > MAX_DEVICE_ID_LENGTH:
            problem = f"is {len(device.id)} characters, over the kubelet's {MAX_DEVICE_ID_LENGTH}"
        elif device.id in seen:
            problem = "is listed twice"
        if problem:
            if device.id not in warned:
                warned.add(device.id)
                log.warning(
                    "%s: not advertising device ID %r: it %s", resource_name, device.id, problem
                )
            continue
        seen.add(device.id)
        message = pb.Device(ID=device.id, health=device.health)
        if device.numa_node is not None:
            message.topology.nodes.add(ID=device.numa_node)
        out.append(message)
    return out


def to_proto_allocation(allocation: ContainerAllocation) -> pb.ContainerAllocateResponse:
    return pb.ContainerAllocateResponse(
        envs=allocation.envs,
        annotations=allocation.annotations,
        devices=[
            pb.DeviceSpec(
                container_path=d.container_path, host_path=d.host_path, permissions=d.permissions
            )
            for d in allocation.devices
        ],
        mounts=[
            pb.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
            for m in allocation.mounts
        ],
        cdi_devices=[pb.CDIDevice(name=name) for name in allocation.cdi_devices],
    )


def container_answer(allocation: ContainerAllocation) -> bytes:
    """One container's part of an AllocateResponse, encoded: the response holds its
    containers' answers as one repeated field, so an answer for several containers is
    these parts concatenated (protobuf's encoding of a repeated field), each encoded once."""
    return pb.AllocateResponse(container_responses=[to_proto_allocation(allocation)]).SerializeToString()
