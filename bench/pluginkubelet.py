"""The kubelet's side of bench_plugin.py: a Registration server on kubelet.sock that
records when each Register came (the plugin's launch time ends there), and a ListAndWatch
stream read in a thread of its own that timestamps each message as it arrives (a health
change's time ends there)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from gpunode.host.root import HostRoot
from sandbox_plugin.resources import HEALTHY

LIST_AND_WATCH = "/v1beta1.DevicePlugin/ListAndWatch"
REGISTER = "/v1beta1.Registration/Register"


class Kubelet:
    """Serves Registration on kubelet.sock and records when each Register came."""

    def __init__(self, host: HostRoot) -> None:
        from grpcwire.server import GrpcServer
        from kubeletapi.deviceplugin_paths import DEVICE_PLUGIN_DIR

        directory = host.path(DEVICE_PLUGIN_DIR)
        directory.mkdir(parents=True, exist_ok=True)
        self._cond = threading.Condition()
        self.registrations: list[tuple[float, str]] = []  # (monotonic, resource name)
        self._server = GrpcServer(str(directory / "kubelet.sock"), {REGISTER: self._register}, name="kubelet")
        self._server.start()

    def _register(self, request: bytes) -> bytes:
        from kubeletapi import deviceplugin_pb2 as pb

        arrived = time.monotonic()
        name = pb.RegisterRequest.FromString(request).resource_name
        with self._cond:
            self.registrations.append((arrived, name))
            self._cond.notify_all()
        return b""  # Empty

    def first_register(self, name: str, after: float, timeout: float = 60.0) -> float:
        """When the first Register since ``after`` came, once ``name`` has registered too."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not any(t >= after and n == name for t, n in self.registrations):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{name} did not register")
                self._cond.wait(left)
            return min(t for t, _ in self.registrations if t >= after)

    def stop(self) -> None:
        self._server.stop()


class HealthWatch:
    """A ListAndWatch stream (grpcio) read in a thread, each message timestamped as it arrives;
    ``device``'s health in each is what ``wait`` looks for."""

    def __init__(self, socket: Path, device: str) -> None:
        import grpc

        self.device = device
        self._channel = grpc.insecure_channel(f"unix://{socket}")
        self._cond = threading.Condition()
        self.seen: list[tuple[float, str | None]] = []  # (perf_counter, health of device)
        self.healthy: list[str] = []  # in the latest list
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from kubeletapi import deviceplugin_pb2 as pb

        try:
            for message in self._channel.unary_stream(LIST_AND_WATCH)(pb.Empty().SerializeToString()):
                arrived = time.perf_counter()
                devices = pb.ListAndWatchResponse.FromString(message).devices
                health = next((d.health for d in devices if d.ID == self.device), None)
                with self._cond:
                    self.seen.append((arrived, health))
                    self.healthy = [d.ID for d in devices if d.health == HEALTHY]
                    self._cond.notify_all()
        except Exception:  # the plugin stopped: the stream is over
            pass

    def wait_healthy(self, count: int, timeout: float = 30.0) -> list[str]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self.healthy) != count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"never {count} healthy devices: {self.healthy}")
                self._cond.wait(left)
            return list(self.healthy)

    def wait(self, health: str, after: float, timeout: float = 5.0) -> float:
        """When the stream first said ``health`` after ``after``; TimeoutError if it did not."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                hit = next((t for t, h in self.seen if t >= after and h == health), None)
                if hit is not None:
                    return hit
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.device} never turned {health}")
                self._cond.wait(left)

    def close(self) -> None:
        self._channel.close()
