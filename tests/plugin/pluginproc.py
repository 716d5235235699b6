"""The device plugin as its own process, as the chart runs it (``sandbox-device-plugin
--workload vm-passthrough --metrics-address``), for the tests that watch it from outside:
its memory, its log, its socket under attack (test_hostile_clients.py) and under h2spec
(test_h2spec.py).

It runs with shorter clocks than its defaults (``wire.limits``: 2 s for a request to
arrive or an answer to be taken, 3 s for an idle connection unless told), so that those
limits are seen within a test, and optionally with a lower file descriptor limit.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from support.paths import REPO
from support.registry_server import free_port

LAUNCH = """
import dataclasses, resource, sys
from grpcwire import limits
limits.DEFAULT = dataclasses.replace(limits.DEFAULT, request_timeout=2.0, write_timeout=2.0,
                                     idle_timeout=float(sys.argv[2]))
if int(sys.argv[1]):
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[1])))
from sandbox_plugin.cli import main
sys.exit(main(sys.argv[3:]))
"""


@dataclass
class Plugin:
    process: subprocess.Popen
    socket: Path
    log: Path

    @classmethod
    def launch(cls, host_root: Path, socket: Path, log: Path, nofile: int = 0, idle_timeout: float = 3.0) -> Plugin:
        with log.open("wb") as output:
            process = subprocess.Popen(
                # --nvlink-fabric off: these tests are about the gRPC server; on the dgx-h100
                # board with auto and no FM at the default address no GPU would be advertised.
                [sys.executable, "-c", LAUNCH, str(nofile), str(idle_timeout), "--workload", "vm-passthrough", "--nvlink-fabric", "off",
                 "--host-root", str(host_root), "--metrics-address", f"127.0.0.1:{free_port()}"],
                cwd=REPO, stdout=output, stderr=subprocess.STDOUT)
        return cls(process, socket, log)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def log_lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines()
