"""grpcwire's connection window after streams it refused or that were reset, and a
status too long for a client's header list.

RFC 9113 section 6.9: DATA counts against the connection's flow-control window whatever
becomes of its stream, so a receiver that drops the DATA of a refused, failed or reset
stream must still give its length back (WINDOW_UPDATE on stream 0), or the sender's
window shrinks with every such stream until the connection stalls: the next ordinary
call waits for its deadline. h2 hands its user the length of every DATA frame it reads
(``flow_controlled_length``) and credits those on streams it has closed itself; the
rest is ours to give back with ``acknowledge_received_data``. The client here is h2's,
whose ``outbound_flow_control_window`` is what the server has let it send.
"""

from __future__ import annotations

from test_wire_protocol import ECHO, REQUEST_HEADERS, Client, server

import grpcwire.status as st
from grpcwire.limits import Limits
from grpcwire.status import StatusCode

# Small windows so that a few streams spend all of them: the connection's window is
# h2's 65535 plus the buffer, a stream's the message limit plus its 5-byte prefix.
LIMITS = Limits(max_message=16 * 1024, max_connection_buffer=20 * 1024)
CHUNK = 15 * 1024
ROUNDS = 40  # 40 x 3 streams x 15 KiB: over 20 times the connection's window


def _open(client: Client, headers=REQUEST_HEADERS) -> int:
    stream = client.h2.get_next_available_stream_id()
    client.h2.send_headers(stream, headers)
    return stream


def _echo_works(client: Client, proto) -> None:
    stream, got = client.call(b"after")
    assert [c.path for c in got.ready] == [ECHO]
    proto.respond(got.ready[0], b"ok")
    fields, data = client.answer(stream)
    assert fields[b"grpc-status"] == b"0" and st.split_messages(data) == [b"ok"]


def test_data_of_refused_failed_and_reset_streams_is_given_back_to_the_connection():
    proto = server(LIMITS)
    client = Client(proto)
    client.push()
    client.pull()
    start = client.h2.outbound_flow_control_window
    not_grpc = [h if h[0] != b"content-type" else (b"content-type", b"text/html") for h in REQUEST_HEADERS]
    sent = 0
    for _ in range(ROUNDS):
        # Refused: not gRPC, answered 415 once its request ends.
        refused = _open(client, not_grpc)
        client.h2.send_data(refused, b"x" * CHUNK, end_stream=True)
        # Reset by the client halfway through its request.
        reset = _open(client)
        client.h2.send_data(reset, b"\x00" + (CHUNK - 5).to_bytes(4, "big") + b"y" * (CHUNK // 2))
        client.h2.reset_stream(reset)
        # Failed by the server: two requests held at once pass the connection's buffer,
        # the second is RESOURCE_EXHAUSTED and reset while its client still sends.
        held, failed = _open(client), _open(client)
        client.h2.send_data(held, st.message(b"h" * (CHUNK - 5))[:CHUNK - 1])
        client.h2.send_data(failed, st.message(b"f" * (CHUNK - 5))[:CHUNK - 1])
        assert client.push().broken is None
        client.pull()
        assert client.answer(failed)[0][b"grpc-status"] == b"%d" % StatusCode.RESOURCE_EXHAUSTED
        assert client.answer(refused)[0][b":status"] == b"415"
        client.h2.reset_stream(held)
        client.push()
        client.pull()
        sent += CHUNK + 5 + CHUNK // 2 + 2 * (CHUNK - 1)
        # What the server dropped it gave back: the window never shrinks for good.
        assert client.h2.outbound_flow_control_window >= start - 64 * 1024
    assert sent > 20 * start
    assert proto.inbound == 0 and not proto.calls
    _echo_works(client, proto)


def test_a_status_too_long_for_a_header_list_is_cut_and_the_connection_serves_on():
    proto = server()
    client = Client(proto)
    stream, got = client.call(b"x")
    proto.fail(got.ready[0], StatusCode.INVALID_ARGUMENT, f"device {'x' * 65536!r} is not known")
    fields, _ = client.answer(stream)
    assert fields[b"grpc-status"] == b"%d" % StatusCode.INVALID_ARGUMENT
    # grpc-core refuses a header list over 8 KiB (its default GRPC_ARG_MAX_METADATA_SIZE):
    # a longer reason never reaches the caller, who waits for its deadline instead.
    assert len(fields[b"grpc-message"]) < 8 * 1024
    assert st.status_of(fields).details.endswith("characters)")
    _echo_works(client, proto)
