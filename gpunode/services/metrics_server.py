"""The HTTP endpoints both long-running commands serve with ``--metrics-address``:
``/metrics`` (Prometheus text format), ``/healthz`` (the loop is alive) and
``/readyz`` (the work is done: the last reconcile succeeded, every resource is
registered with the kubelet).

It sits in ``gpunode.services`` (the services both programs share) because the device plugin imports it too.
Each check is a callable returning ``(ok, why)``: 200 with ``ok`` and the reason,
503 otherwise, so a failed probe's body says what is wrong.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)

Check = Callable[[], tuple[bool, str]]


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``:9400`` and ``[::]:9400`` too) as (host, port); ValueError when it is not one."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--metrics-address {address!r} is not HOST:PORT (e.g. 0.0.0.0:9400)")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


class MetricsServer:
    """Serves the endpoints from a daemon thread; ``stop()`` closes the socket."""

    def __init__(self, address: str, registry: CollectorRegistry, *, healthy: Check, ready: Check) -> None:
        # Loaded here, not with the module: checking an address at start-up (before the
        # device plugin registers with the kubelet, which waits for it) must not pay for them.
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        host, port = parse_address(address)
        checks = {"/healthz": healthy, "/readyz": ready}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif path in checks:
                    try:
                        ok, why = checks[path]()
                    except Exception as exc:  # noqa: BLE001 - a broken check is a failed probe
                        ok, why = False, f"check failed: {type(exc).__name__}: {exc}"
                    self._send(200 if ok else 503, f"{'ok' if ok else 'failing'}: {why}\n".encode(),
                               "text/plain; charset=utf-8")
                else:
                    self._send(404, b"not found: try /metrics, /healthz or /readyz\n", "text/plain; charset=utf-8")

            def _send(self, code: int, body: bytes, content_type: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                log.debug("metrics: " + format, *args)

        class Server6(ThreadingHTTPServer):
            address_family = socket.AF_INET6

        server_class = Server6 if ":" in host else ThreadingHTTPServer
        self._server = server_class((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-server", daemon=True)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def start(self) -> MetricsServer:
        """Serve from a daemon thread (once; a second call does nothing)."""
        if self._thread.is_alive():
            return self
        self._thread.start()
        log.info("serving /metrics, /healthz and /readyz on port %d", self.port)
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
