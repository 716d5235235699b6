"""The webhook's TLS: the server context (TLS 1.2 and later, AEAD cipher suites only) and
the certificate pair, read again when its files change.

The pair is read again when either file's mtime, size or inode changes (checked as each
connection is accepted), so a cert-manager or kubelet-updated Secret mount takes effect
without a restart; a pair that does not load (half-written) keeps the previous one in
service and is retried on a later connection (at most once a second, so that a flood of
connections does not parse it, and log it, once each).
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from pathlib import Path

from gpunode.errors import ConfigError

log = logging.getLogger("katamgr.webhook")

# TLS 1.2 suites with forward secrecy and an AEAD cipher (what the API server's Go client
# offers first); CBC and RSA key exchange are left out. TLS 1.3's suites are all AEAD and
# OpenSSL's defaults for them stand.
TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"


def server_context(cert_file: Path, key_file: Path) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_ciphers(TLS12_CIPHERS)
    # Client-started renegotiation (TLS 1.2) costs the server a handshake per request: none.
    context.options |= (ssl.OP_NO_RENEGOTIATION | ssl.OP_CIPHER_SERVER_PREFERENCE
                        | ssl.OP_NO_COMPRESSION)
    # No TLS 1.3 session tickets: the API server's client does not resume sessions, and
    # every connection (a flood's too) would cost two ticket encryptions and writes.
    context.num_tickets = 0
    context.load_cert_chain(cert_file, key_file)
    return context


class CertReloader:
    """An SSLContext for a cert/key pair, rebuilt when the files change."""

    def __init__(self, cert_file: str | os.PathLike, key_file: str | os.PathLike) -> None:
        self.cert_file, self.key_file = Path(cert_file), Path(key_file)
        self._lock = threading.Lock()
        self._stamp: tuple | None = None
        self._context: ssl.SSLContext | None = None
        self._failed: tuple | None = None  # the stamp that did not load, and when
        self._failed_at = 0.0
        self.loads = 0
        self.current()
        if self._context is None:
            raise ConfigError(f"cannot load the TLS pair {self.cert_file} / {self.key_file}; "
                              f"pass a PEM certificate and its private key")

    def _stat(self) -> tuple:
        out = []
        for path in (self.cert_file, self.key_file):
            st = path.stat()
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        # A Secret mount swaps the ..data symlink: follow it too.
        out.append(tuple(os.path.realpath(p) for p in (self.cert_file, self.key_file)))
        return tuple(out)

    def current(self) -> ssl.SSLContext:
        with self._lock:
            try:
                stamp = self._stat()
            except OSError as exc:
                if self._context is None:
                    raise ConfigError(f"cannot read the TLS files: {exc}") from None
                log.warning("cannot stat the TLS files (%s); keeping the loaded certificate", exc)
                return self._context
            retry_at = self._failed_at + 1.0
            if stamp != self._stamp and (stamp != self._failed or time.monotonic() >= retry_at):
                try:
                    context = server_context(self.cert_file, self.key_file)
                except (OSError, ssl.SSLError) as exc:
                    if self._context is None:
                        raise ConfigError(f"cannot load the TLS pair {self.cert_file} / "
                                          f"{self.key_file}: {exc}") from None
                    log.warning("the TLS pair changed but does not load (%s); keeping the "
                                "previous one", exc)
                    self._failed, self._failed_at = stamp, time.monotonic()
                    return self._context
                self._context, self._stamp = context, stamp
                self.loads += 1
                if self.loads > 1:
                    log.info("reloaded the TLS certificate from %s", self.cert_file)
            assert self._context is not None
            return self._context
