"""``katamgr webhook`` against hostile and unlucky clients, as its own process.

Anything that can reach the webhook's Service can connect to it, and with ``failurePolicy:
Fail`` a webhook that falls over stops every pod create it reviews. Before this server,
3,000 half-sent TLS connections took it from 28 to 213 MiB and 3,001 threads, and a review
nested 5,000 levels deep dropped the connection with a traceback. Here, what a user of the
cluster would notice:

- slow TLS clients (handshake done, half a head sent) hold neither threads nor memory,
  and a well-behaved client's reviews are answered throughout;
- a client sending a byte a second is cut off at the whole-request deadline, whatever
  phase it is in (TLS handshake, head, body), and an idle keep-alive connection at the idle
  timeout;
- a new connection over --max-connections closes the oldest waiting one; out of file
  descriptors, the server neither spins nor stops answering;
- bodies nested 5,000 deep and every other malformed body get an HTTP 400 with one line of
  JSON, and the connection goes on; large reviews from many connections at once stay within
  the server's byte budget, and a pod of thousands of containers is refused, not reviewed.

(TLS versions and suites, and HTTP's corner cases: test_webhook_wire.py.)

The servers here run with short clocks (seconds) so that the deadlines are seen within the
test. Bounds are functional and generous enough for a loaded 2-core machine; speed figures
are bench/bench_webhook.py's (docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import threading
import time

import pytest
from support import podkit
from webhookproc import (
    SHORT_IDLE_TIMEOUT,
    SHORT_REQUEST_TIMEOUT,
    Attack,
    Reviewer,
    Sampler,
    WebhookProcess,
    half_sent,
    raise_fd_limit,
)

SLOW_CLIENTS = int(os.environ.get("WEBHOOK_SLOW_CLIENTS", "1000"))
WORKERS = 2  # katamgr webhook's default --workers
# The most the slow clients may add to the webhook's memory: a TLS connection costs it
# about 20 KiB, and at most --max-connections (256) are held. (Before: +185 MiB for 3,000.)
RSS_CAP_MIB = 24
# A well-behaved review during an attack: answered within this (a few ms at rest).
ANSWERED_WITHIN = 5.0
# Large reviews: what two workers parse at once (40 MB each for 600,000 short strings) and
# the 32 MiB the server may hold for the rest. (Before: a thread and its parse per client.)
LARGE_BODIES_RSS_CAP_MIB = 160


def closed_within(tls: socket.socket, limit: float) -> tuple[float | None, bytes]:
    """Read until the server closes the connection: (when, what it sent), or (None, ...)
    when it is still open after ``limit`` s."""
    began, got = time.monotonic(), b""
    tls.settimeout(0.2)
    while time.monotonic() - began < limit:
        try:
            chunk = tls.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - began, got
        if not chunk:
            return time.monotonic() - began, got
        got += chunk
    return None, got


def test_slow_tls_clients_hold_no_threads_nor_memory_and_reviews_go_on(tmp_path):
    raise_fd_limit()
    webhook = WebhookProcess.launch(tmp_path, "--request-timeout", "4")
    try:
        sampler, reviewer = Sampler(webhook), Reviewer(webhook)
        attack = Attack(webhook.port, webhook.ca.client_context(), SLOW_CLIENTS).run()
        # The webhook holds --max-connections (256) at most: the oldest slow clients were
        # closed as newer ones came (each of them saw its handshake through).
        held = attack.outcome(wait=0.5)
        assert attack.refused == 0 and 0 < held["open"] <= 256, held
        assert held["closed"] >= SLOW_CLIENTS - 256, held
        reviewer.stop()
        sampler.stop()
        assert sampler.max_threads <= 1 + WORKERS, sampler.max_threads
        assert sampler.growth_mib < RSS_CAP_MIB, (sampler.base_rss, sampler.max_rss)
        assert not reviewer.failures, reviewer.failures[:5]
        assert len(reviewer.latencies) >= attack.seconds / 0.5, (len(reviewer.latencies), attack.seconds)
        assert max(reviewer.latencies) < ANSWERED_WITHIN, max(reviewer.latencies)
        # After the deadline every slow client has been closed by the server.
        time.sleep(4 + 1)
        assert attack.still_open() == 0
        attack.close()
        assert webhook.client().request("GET", "/healthz")[0] == 200
    finally:
        webhook.stop()
    # The log says what happened in a line per 10 s, not a line per connection.
    lines = [line for line in webhook.log_text().splitlines() if "denied:" not in line]
    assert len(lines) < 10, lines


def _client_hello(webhook: WebhookProcess) -> bytes:
    """The first bytes a TLS client sends, for sending them slowly over plain TCP."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = webhook.ca.client_context().wrap_bio(incoming, outgoing, server_hostname="localhost")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def _trickle(sock: socket.socket, data: bytes, out: dict) -> None:
    """Send ``data`` a byte a second until the server closes the connection."""
    began, got = time.monotonic(), b""
    sock.settimeout(1.0)
    try:
        for byte in data:
            sock.sendall(bytes([byte]))
            try:
                chunk = sock.recv(4096)
            except TimeoutError:
                continue
            got += chunk
            if not chunk or got.endswith(b"}\n"):
                break
    except OSError:
        pass
    out.update(after=time.monotonic() - began, got=got)


def test_a_byte_a_second_is_cut_off_at_the_request_deadline_in_every_phase(webhook_process):
    context = webhook_process.ca.client_context()
    body = json.dumps(podkit.review(podkit.cases()["no-request"])).encode()
    head = (f"POST /mutate HTTP/1.1\r\nHost: webhook\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    results: dict[str, dict] = {"handshake": {}, "head": {}, "body": {}}
    hello = _client_hello(webhook_process)
    address = ("127.0.0.1", webhook_process.port)
    raw = socket.create_connection(address, timeout=5)
    in_head = context.wrap_socket(socket.create_connection(address, timeout=5),
                                  server_hostname="localhost")
    in_body = context.wrap_socket(socket.create_connection(address, timeout=5),
                                  server_hostname="localhost")
    in_body.sendall(head)
    threads = [threading.Thread(target=_trickle, args=(raw, hello, results["handshake"])),
               threading.Thread(target=_trickle, args=(in_head, head, results["head"])),
               threading.Thread(target=_trickle, args=(in_body, body, results["body"]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SHORT_REQUEST_TIMEOUT + 15)
    for phase, result in results.items():
        # Cut off at the deadline, counted from the connection (the trickle began at once).
        assert SHORT_REQUEST_TIMEOUT - 0.5 <= result["after"] <= SHORT_REQUEST_TIMEOUT + 2.5, (phase, result)
    for phase in ("head", "body"):
        answer = results[phase]["got"]
        assert answer.startswith(b"HTTP/1.1 408"), (phase, answer)
        assert b"did not arrive within 3 s" in answer
    for sock in (raw, in_head, in_body):
        sock.close()
    assert webhook_process.client().request("GET", "/healthz")[0] == 200


def test_an_idle_keep_alive_connection_is_closed_at_the_idle_timeout(webhook_process):
    client = webhook_process.client()
    assert client.request("GET", "/healthz")[0] == 200
    assert client.conn is not None and client.conn.sock is not None
    after, got = closed_within(client.conn.sock, SHORT_IDLE_TIMEOUT + 5)
    client.close()
    assert after is not None and SHORT_IDLE_TIMEOUT - 0.5 <= after <= SHORT_IDLE_TIMEOUT + 2, after
    assert got == b""


def test_a_connection_over_the_cap_closes_the_oldest_waiting_one(tmp_path):
    webhook = WebhookProcess.launch(tmp_path, "--max-connections", "8", "--request-timeout", "60")
    try:
        context = webhook.ca.client_context()
        slow = [half_sent(webhook.port, context) for _ in range(8)]
        assert all(slow)
        time.sleep(0.2)  # all eight are in, the first the oldest
        reviewer = webhook.client()
        answer = reviewer.review("/validate", podkit.review(podkit.cases()["no-request"]))
        assert answer["response"]["allowed"] is True
        reviewer.close()
        after, _ = closed_within(slow[0], 2)
        assert after is not None, "the oldest waiting connection is still open"
        assert [closed_within(s, 0.3)[0] for s in slow[1:]] == [None] * 7
        for s in slow:
            s.close()
    finally:
        webhook.stop()


def test_out_of_file_descriptors_it_neither_spins_nor_stops_answering(tmp_path):
    webhook = WebhookProcess.launch(tmp_path, "--request-timeout", "30", nofile=48)
    held: list[socket.socket] = []
    try:
        # Plain TCP connections that never say anything: 200 against 48 descriptors.
        for _ in range(200):
            held.append(socket.create_connection(("127.0.0.1", webhook.port), timeout=5))
        time.sleep(1)
        cpu, began = webhook.cpu_seconds(), time.monotonic()
        reviewer = Reviewer(webhook, period=0.2)
        time.sleep(3)
        reviewer.stop()
        busy = (webhook.cpu_seconds() - cpu) / (time.monotonic() - began)
        assert busy < 0.5, f"the webhook used {busy:.0%} of a CPU out of file descriptors"
        assert reviewer.latencies and not reviewer.failures, reviewer.failures[:5]
    finally:
        for sock in held:
            sock.close()
        webhook.stop()


def test_large_reviews_from_many_connections_stay_within_the_byte_budget(tmp_path):
    # 24 reviews of 2.9 MB whose JSON parses to 600,000 strings (40 MB each in Python),
    # all at once: what is queued for the two workers stays within the 32 MiB byte budget
    # (the largest holders are closed past it), so memory does not grow with the clients.
    webhook = WebhookProcess.launch(tmp_path)
    body = b"[" + b'"ab",' * 600_000 + b'"ab"]'
    ends: list[bytes] = []

    def send() -> None:
        context = webhook.ca.client_context()
        try:
            with context.wrap_socket(socket.create_connection(("127.0.0.1", webhook.port), timeout=20),
                                     server_hostname="localhost") as tls:
                tls.sendall(b"POST /mutate HTTP/1.1\r\nHost: webhook\r\nContent-Length: %d\r\n\r\n"
                            % len(body) + body)
                ends.append(tls.recv(4096)[:12])
        except OSError:
            ends.append(b"")  # closed, past the budget

    try:
        sampler = Sampler(webhook)
        senders = [threading.Thread(target=send) for _ in range(24)]
        for t in senders:
            t.start()
        for t in senders:
            t.join(30)
        sampler.stop()
        assert sampler.growth_mib < LARGE_BODIES_RSS_CAP_MIB, (sampler.base_rss, sampler.max_rss)
        assert len(ends) == 24 and set(ends) <= {b"HTTP/1.1 400", b""}, ends
        assert ends.count(b"HTTP/1.1 400") >= 2  # the workers' share at least
        assert webhook.client().request("GET", "/healthz")[0] == 200
    finally:
        webhook.stop()


def test_a_pod_with_thousands_of_containers_is_refused_not_reviewed(webhook_process):
    obj = podkit.pod(podkit.container())
    obj["spec"]["containers"] = [{"name": f"c{i}", "image": "busybox"} for i in range(5000)]
    client = webhook_process.client()
    try:
        for path in ("/mutate", "/validate"):
            response = client.review(path, podkit.review(obj))["response"]
            assert response["allowed"] is False and response["status"]["code"] == 400
            assert "the pod has 5000 containers, more than the 1000" in response["status"]["message"]
            assert "patch" not in response
    finally:
        client.close()


def _nested(depth: int) -> object:
    value: object = "x"
    for _ in range(depth):
        value = [value]
    return value


def _deep_review(depth: int) -> bytes:
    obj = podkit.cases()["no-request"]
    obj["metadata"]["labels"] = {"deep": _nested(depth)}
    return json.dumps(podkit.review(obj)).encode()


BAD_BODIES = {
    "5,000 nested arrays": (b"[" * 5000 + b"]" * 5000, "nests JSON deeper than"),
    "5,000 nested objects": (b'{"a":' * 5000 + b"1" + b"}" * 5000, "nests JSON deeper than"),
    "5,000 open arrays": (b"[" * 5000, "nests JSON deeper than"),
    "a pod nested 500 deep": (_deep_review(500), "nests JSON deeper than"),
    "an int of 5,000 digits": (b'{"apiVersion": ' + b"1" * 5000 + b"}", "not JSON"),
    "invalid UTF-8": (b'{"apiVersion": "\xff"}', "not JSON"),
    "a million objects": (b"[" + b"{}," * 200_000 + b"{}]", "more JSON objects and arrays"),
    "cut short": (b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionRev', "not JSON"),
    "a JSON null": (b"null", "not an admission.k8s.io/v1"),
}


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
def test_a_malformed_body_gets_a_400_with_one_line_of_json_and_the_connection_goes_on(webhook_process, case):
    body, says = BAD_BODIES[case]
    client = webhook_process.client()
    try:
        for path in ("/mutate", "/validate"):
            status, data = client.request("POST", path, body)
            assert status == 400, (status, data[:200])
            assert data.count(b"\n") == 1 and data.endswith(b"\n")
            assert says in json.loads(data)["error"]
            assert client.conn is not None  # kept open
        assert client.request("GET", "/healthz") == (200, b"ok\n")
    finally:
        client.close()


@pytest.mark.parametrize("where", ["metadata.name", "container name", "limit", "env", "runtimeClassName"])
def test_a_pod_nested_just_under_the_limit_is_judged_not_crashed_on(webhook_process, where):
    # 90 levels where the rules look: they must answer (allow or deny), never fail (500).
    obj = podkit.pod(podkit.container(limits={podkit.A10: "1"}))
    container, deep = obj["spec"]["containers"][0], _nested(90)
    target = {"metadata.name": (obj["metadata"], "name"), "container name": (container, "name"),
              "limit": (container["resources"]["limits"], podkit.A10), "env": (container, "env"),
              "runtimeClassName": (obj["spec"], "runtimeClassName")}[where]
    target[0][target[1]] = deep
    client = webhook_process.client()
    try:
        for path in ("/mutate", "/validate"):
            response = client.review(path, podkit.review(obj))["response"]
            assert response.get("status", {}).get("code") != 500, response
    finally:
        client.close()


def test_the_cli_sets_the_limits_and_refuses_nonsense(capsys):
    from katamgr.admission.limits import DEFAULT, from_args
    from katamgr.cli import build_parser

    base = ["webhook", "--tls-cert-file", "c", "--tls-private-key-file", "k"]
    assert from_args(build_parser().parse_args(base)) == DEFAULT
    assert (DEFAULT.max_connections, DEFAULT.workers, DEFAULT.request_timeout,
            DEFAULT.idle_timeout) == (256, 2, 10.0, 120.0)
    limits = from_args(build_parser().parse_args([
        *base, "--max-connections", "64", "--workers", "4", "--request-timeout", "5",
        "--idle-timeout", "30"]))
    assert (limits.max_connections, limits.workers, limits.request_timeout,
            limits.idle_timeout) == (64, 4, 5.0, 30.0)
    for flag, value in [("--max-connections", "0"), ("--workers", "two"),
                        ("--request-timeout", "0"), ("--idle-timeout", "-1")]:
        with pytest.raises(SystemExit):
            build_parser().parse_args([*base, flag, value])
        assert flag in capsys.readouterr().err
