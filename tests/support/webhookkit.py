"""``katamgr webhook`` on a loopback port with a CA of the test's own, for the real API server
to call (tests/controlplane): the chart's webhook configurations pointed at it."""

from __future__ import annotations

import base64
import copy
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from support.kubecluster import wait_for
from support.registry_server import free_port
from support.tlskit import make_ca, write_server_pair


class Webhook:
    """The webhook as its own process. With ``kubeconfig`` it runs as the chart runs it
    (``--check-handlers``: a pod's RuntimeClass is read from the API server with that
    identity); ``extra`` are further flags (``--dra-driver``, ``--runtime-class``)."""

    def __init__(self, tmp: Path, inject: bool = False, kubeconfig: Path | None = None,
                 extra: Sequence[str] = ()) -> None:
        self.ca = make_ca()
        cert, key = tmp / "tls.crt", tmp / "tls.key"
        write_server_pair(self.ca, cert, key)
        self.port = free_port()
        argv = [str(Path(sys.executable).parent / "katamgr"), "webhook", "-v",
                "--listen", f"127.0.0.1:{self.port}",
                "--tls-cert-file", str(cert), "--tls-private-key-file", str(key)]
        if inject:
            argv.append("--inject-runtime-class")
        env = dict(os.environ)
        if kubeconfig is not None:
            argv.append("--check-handlers")
            env["KUBECONFIG"] = str(kubeconfig)
            env.pop("KUBERNETES_SERVICE_HOST", None)  # the kubeconfig, not an in-cluster account
        argv.extend(extra)
        self.log = tmp / "webhook.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        wait_for(self._answers, "katamgr webhook serving")

    def _answers(self) -> bool:
        with socket.socket() as s:
            s.settimeout(1)
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def point(self, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The chart's webhook configurations, each webhook's Service swapped for this
        process's URL (same path) and CA; rules, selectors and policies as rendered."""
        bundle = base64.b64encode(self.ca.pem).decode()
        configs = copy.deepcopy(configs)
        for config in configs:
            for hook in config["webhooks"]:
                path = hook["clientConfig"]["service"]["path"]
                hook["clientConfig"] = {"url": f"https://127.0.0.1:{self.port}{path}",
                                        "caBundle": bundle}
        return configs

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        return self.log.read_text()
