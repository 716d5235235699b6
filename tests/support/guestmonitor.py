"""The host side of QEMU's monitor for a guest that asks for it: faults injected while the
guest runs (AER errors, a hot-unplug), at the moment the guest's checks are ready for them.

QEMU serves QMP on a unix socket (``-qmp unix:PATH,server=on,wait=off``; QEMU's
docs/interop/qmp-spec: a greeting, ``qmp_capabilities``, then one JSON command per line,
answered by ``return`` or ``error``, with ``event`` lines in between). HMP commands such as
``pcie_aer_inject_error`` (hw/pci/pcie_aer.c; ``-c`` a correctable error) go through QMP's
``human-monitor-command``.

The handshake with the guest, over the writable 9p share both see: the guest writes
``monitor/<n>.request`` (``{"hmp": "..."}`` or ``{"qmp": {...}}``, renamed into place so it
is never read half-written); this relay runs it and writes ``monitor/<n>.answer`` (the
same way) with ``{"ok": ..., "return": ..., "error": ..., "at": <host time>}``. The guest
waits for the answer with a bound (``guest_health.ask``); the relay polls every 20 ms
and stops with the guest.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path


class QmpError(Exception):
    pass


def qmp_command(sock_path: Path, command: dict, timeout: float = 20.0) -> dict:
    """Run one QMP command on a fresh connection; its ``return`` or ``error`` object."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(timeout)
        sock.connect(str(sock_path))
        stream = sock.makefile("rw")

        def answer() -> dict:
            while True:
                line = stream.readline()
                if not line:
                    raise QmpError("QEMU closed the monitor")
                message = json.loads(line)
                if "event" not in message:
                    return message

        answer()  # the greeting
        for request in ({"execute": "qmp_capabilities"}, command):
            stream.write(json.dumps(request) + "\n")
            stream.flush()
            reply = answer()
        return reply


class MonitorRelay:
    """Runs the guest's monitor requests from ``share/monitor`` against ``sock_path``."""

    def __init__(self, share: Path, sock_path: Path) -> None:
        self.dir = share / "monitor"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.sock_path = sock_path
        self.done: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="monitor-relay", daemon=True)

    def __enter__(self) -> MonitorRelay:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            for request in sorted(self.dir.glob("*.request")):
                answer = request.with_suffix(".answer")
                if answer.exists():
                    continue
                self._answer(request, answer)

    def _answer(self, request: Path, answer: Path) -> None:
        try:
            asked = json.loads(request.read_text())
            if "hmp" in asked:
                command = {"execute": "human-monitor-command", "arguments": {"command-line": asked["hmp"]}}
            else:
                command = asked["qmp"]
            reply = qmp_command(self.sock_path, command)
            # HMP answers errors as text: pcie_aer_inject_error prints "OK id: ..." when done.
            ok = "return" in reply and not ("hmp" in asked and not str(reply["return"]).startswith("OK")
                                            and reply["return"] != "")
            result = {"ok": ok, "return": reply.get("return"), "error": reply.get("error")}
        except (OSError, ValueError, KeyError, QmpError) as exc:
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        result["at"] = time.time()
        self.done.append({"request": request.name, **result})
        tmp = answer.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, answer)
        with contextlib.suppress(OSError):
            os.chmod(answer, 0o666)
