"""The hostile-review table of docs/isolation.md: what ``katamgr webhook`` answers to each case
of the security reviews, and how long it took, over real TLS on loopback.

    .venv/bin/python bench/bench_hostile_reviews.py [--repeat 20]

Runs the real ``katamgr webhook`` in its own process (a fresh CA in a temp dir), sends each
case --repeat times on one keep-alive connection, as the API server does, and prints a
Markdown table: the case, the path, the answer (HTTP status; allowed, patched or denied with
the start of its message) and the median time from send to the whole answer read. The pods
are the tests' (tests/support/podkit.py); the bodies that are not reviews are built here.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "tests" / "admission")]

from support import podkit  # noqa: E402
from webhookproc import WebhookProcess  # noqa: E402

POD_CASES = [
    ("sidecar of a GPU pod", "/mutate", "gpu-and-sidecar"),
    ("only an init container asks", "/mutate", "gpu-init-only"),
    ("GPU container sets NVIDIA_VISIBLE_DEVICES=all", "/mutate", "gpu-user-all"),
    ("same, policy or webhook /validate alone", "/validate", "gpu-user-all"),
    ("no-GPU sidecar sets =all, /validate", "/validate", "sidecar-user-all"),
    ("cdi.k8s.io annotation nvidia.com/gpu=all", "/validate", "cdi-gpu-all"),
    ("Kata pod + annotation nvidia.com/pgpu=0", "/validate", "cdi-pgpu-kata"),
    ("nvidia.cdi.k8s.io annotation", "/validate", "cdi-toolkit"),
    ("hostPath /dev/nvidia0", "/validate", "hostpath-nvidia0"),
    ("hostPath /dev/vfio/", "/validate", "hostpath-vfio"),
    ("hostPath //dev/./", "/validate", "hostpath-dev"),
    ("emptyDir at /var/run/nvidia-container-devices/all", "/validate", "devlist-emptydir"),
    ("passthrough GPU, runc", "/validate", "passthrough-runc"),
    ("/dev/null at /tmp/../var/run/nvidia-container-devices/all", "/validate", "mountpath-dotdot"),
    ("same, in an init container", "/validate", "mountpath-dotdot-init"),
    ("subPath a/../../b", "/validate", "subpath-dotdot"),
    ("hostPath /var/lib/kubelet/device-plugins", "/validate", "hostpath-device-plugins"),
    ("hostPath /var/lib/kubelet (above it)", "/validate", "hostpath-kubelet"),
    ("hostPath /var/run/cdi", "/validate", "hostpath-var-run-cdi"),
    ("hostPath /etc/cdi/nvidia.yaml", "/validate", "hostpath-etc-cdi"),
    ("hostPath /run/containerd/containerd.sock", "/validate", "hostpath-containerd-sock"),
    ("hostPath /sys/bus/pci", "/validate", "hostpath-sys-bus-pci"),
    ("hostPath /sys/devices/pci0000:00", "/validate", "hostpath-sys-devices-pci"),
    ("hostPath /var/log (beside them)", "/validate", "hostpath-var-log"),
]
# Plain pod UPDATEs (kubectl annotate): the validating webhook and the policy see them.
UPDATE_CASES = [
    ("annotate cdi.k8s.io/gpu=nvidia.com/gpu=all, UPDATE", "/validate", "annotate-gpu-all"),
    ("same UPDATE, /mutate", "/mutate", "annotate-gpu-all"),
    ("UPDATE removing that annotation", "/validate", "removed-gpu"),
    ("UPDATE of a label, the annotation kept", "/validate", "unchanged-gpu-label"),
]


def ephemeral_review() -> dict:
    old = podkit.pod(podkit.container())
    new = podkit.ephemeral(old, env={"NVIDIA_VISIBLE_DEVICES": "all"})
    return podkit.review(new, operation="UPDATE", subresource="ephemeralcontainers", old=old)


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def bodies() -> list[tuple[str, str, bytes]]:
    pods = {**podkit.cases(), **podkit.path_cases()}
    cases = [(name, path, json.dumps(podkit.review(pods[case])).encode()) for name, path, case in POD_CASES]
    updates = podkit.update_cases()
    cases += [(name, path, json.dumps(podkit.review(updates[case][1], operation="UPDATE",
                                                    old=updates[case][0])).encode())
              for name, path, case in UPDATE_CASES]
    cases.append(("kubectl debug, NVIDIA_VISIBLE_DEVICES=all", "/mutate", json.dumps(ephemeral_review()).encode()))
    cases += [
        ("JSON nested 5,000 deep", "/mutate", nested(5000)),
        ("review whose pod nests 5,000 deep", "/validate",
         json.dumps(podkit.review(podkit.cases()["no-request"]))[:-2].encode() + b',"x":' + nested(5000) + b"}}"),
        ("not JSON", "/mutate", b"{not json"),
        ("invalid UTF-8", "/mutate", b'{"apiVersion":"\xff"}'),
        ("integer of 5,000 digits", "/mutate", b'{"a":' + b"9" * 5000 + b"}"),
        ("AdmissionReview v1beta1", "/mutate", json.dumps({"apiVersion": "admission.k8s.io/v1beta1",
                                                         "kind": "AdmissionReview", "request": {}}).encode()),
    ]
    return cases


def answer_of(status: int, data: bytes) -> str:
    if status != 200:
        return f"HTTP {status}: {json.loads(data).get('error', '')[:60]}"
    response = json.loads(data)["response"]
    if not response["allowed"]:
        message = response["status"]["message"].split(": ", 1)[-1]
        return f"denied: {message[:70]}"
    if "patch" in response:
        ops = json.loads(base64.b64decode(response["patch"]))
        return "allowed, patched: " + "; ".join(f"{o['op']} {o['path']}" for o in ops)[:70]
    return "allowed"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        webhook = WebhookProcess.launch(Path(tmp))
        client = webhook.client()
        try:
            print("| case | path | answer | median ms |")
            print("|---|---|---|---|")
            for name, path, body in bodies():
                times, answer = [], ""
                for _ in range(args.repeat):
                    start = time.perf_counter()
                    status, data = client.request("POST", path, body)
                    times.append((time.perf_counter() - start) * 1000)
                    answer = answer_of(status, data)
                print(f"| {name} | {path} | {answer} | {statistics.median(times):.2f} |")
            alive = client.request("GET", "/healthz")[0] == 200
            print(f"\nthe webhook still answers /healthz after them all: {alive}; "
                  f"threads {webhook.threads()}, RSS {webhook.rss_mib():.1f} MiB")
        finally:
            client.close()
            webhook.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
