"""Why a registry could not be reached, in a few words, from what requests and urllib3 raise.

requests wraps urllib3, which wraps the socket's error in a message of its own
("HTTPSConnectionPool(host=..., port=443): Max retries exceeded with url: ... (Caused by
NewConnectionError(...))"); shown whole it is a paragraph, cut short it ends mid-word.
The operator needs the cause: ``cause`` names it the way ``curl`` or ``crictl pull`` would.
"""

from __future__ import annotations

import socket
import ssl


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it wraps: requests wraps urllib3's MaxRetryError in ``args``, which
    holds the real failure in ``reason``, which chains the socket's error as its cause."""
    seen: list[BaseException] = []
    todo = [exc]
    while todo and len(seen) < 16:
        current = todo.pop(0)
        if current in seen:
            continue
        seen.append(current)
        todo += [e for e in (current.__cause__, current.__context__, getattr(current, "reason", None),
                             *current.args) if isinstance(e, BaseException)]
    return seen


# Words in a wrapped error's text, for errors that reach us only as text (urllib3 turns a
# socket error into a message), and what to call each in our one sentence.
_TEXTS = (
    ("CERTIFICATE_VERIFY_FAILED", "TLS: certificate verify failed"),
    ("Name or service not known", "name does not resolve"),
    ("Temporary failure in name resolution", "name does not resolve"),
    ("nodename nor servname", "name does not resolve"),
    ("No address associated with hostname", "name does not resolve"),
    ("Failed to resolve", "name does not resolve"),
    ("Connection refused", "connection refused"),
    ("No route to host", "no route to host"),
    ("Network is unreachable", "network unreachable"),
    ("timed out", "timed out"),
    ("Remote end closed connection", "the registry closed the connection"),
    ("Connection reset", "connection reset"),
    ("Connection broken", "connection broken"),
    ("IncompleteRead", "connection broken"),
)


def cause(exc: BaseException) -> str:
    """The cause of a requests/urllib3 failure in a few words ("connection refused", "name
    does not resolve", "TLS: certificate verify failed (self-signed certificate)"), never
    urllib3's nested text (long, and cut mid-word when shortened)."""
    chain = _chain(exc)
    for error in chain:
        if isinstance(error, ssl.SSLCertVerificationError):
            detail = getattr(error, "verify_message", "")
            return "TLS: certificate verify failed" + (f" ({detail})" if detail else "")
    for error in chain:
        if isinstance(error, socket.gaierror):
            return "name does not resolve"
        if isinstance(error, ConnectionRefusedError):
            return "connection refused"
    text = " ".join(str(e) for e in chain)
    for marker, said in _TEXTS:
        if marker in text:
            return said
    for error in chain:
        if isinstance(error, ssl.SSLError):
            return "TLS: " + str(error.reason or error.strerror or "handshake failed").lower().replace("_", " ")
    innermost = chain[-1]
    if isinstance(innermost, OSError) and innermost.strerror:
        return innermost.strerror[:1].lower() + innermost.strerror[1:]
    return type(innermost).__name__
