"""Registry talk through oras-py: manifests and blobs of one ref, with pull-secret auth.

oras-py's ``Registry`` builds the URLs, holds the session and runs the bearer-token
exchange. Three things it does not do the way a node agent needs, so ``_OrasClient``
replaces ``do_request`` (and only that):
- oras retries any failure up to 5 times, sleeping 2+3**n seconds (minutes on a refused
  connection) and sends no timeout, so a silent registry hangs forever; we bound both,
  and bound each whole transfer too: a registry that sends one byte every few seconds
  never trips a per-read timeout, so a watchdog cuts every connection the request uses
  (its token request's too), whatever their keep-alive, at the deadline (``Deadlines``:
  connect 10 s, each read 60 s, a manifest 60 s, a blob 30 min, each covering the
  whole exchange from the TCP connect to the last body byte);
- its token backend cannot answer a ``Basic`` challenge (htpasswd registries such as
  distribution's own), which we answer with the pull secret's user and password;
- ``get_manifest`` returns parsed JSON, but the digest must be taken over the exact
  bytes, and a hostile registry must not make us read an endless body.
Blob bodies are streamed (``get_blob(stream=True)``) so the installer can hash and cap
them while writing.
"""

from __future__ import annotations

import base64
import ipaddress
import logging
import socket
import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import oras.container
import oras.provider
import requests
import requests.adapters
import urllib3.connection
import urllib3.connectionpool
import urllib3.exceptions

from .causes import cause as _reason
from .credentials import Credentials
from .deadlines import DEFAULT_DEADLINES, Deadlines
from .errors import ArtifactError
from .manifest import INDEX_MEDIA_TYPES, MANIFEST_MEDIA_TYPES, MAX_MANIFEST_BYTES, Layer
from .refs import RegistryRef
from .source import FetchedManifest, TransientError
from .verified import Stopped

log = logging.getLogger(__name__)

CHUNK_BYTES = 1024 * 1024


_STREAM_ERRORS = (
    requests.exceptions.ChunkedEncodingError,
    requests.exceptions.ConnectionError,
    requests.exceptions.Timeout,
    urllib3.exceptions.ProtocolError,
    urllib3.exceptions.ReadTimeoutError,
)


def use_plain_http(registry: str, insecure_registries: Iterable[str] = ()) -> bool:
    """Plain HTTP only for loopback registries or ones the operator listed as insecure."""
    if registry.startswith("["):  # [::1]:5000
        host = registry[1 : registry.index("]")] if "]" in registry else registry
    else:
        host = registry.rsplit(":", 1)[0]
    listed = set(insecure_registries)
    if registry in listed or host in listed:
        return True
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Watchdog:
    """Cuts the connections of one request when its whole-transfer deadline passes.

    A blocked read cannot be interrupted from its own thread; shutting the socket
    down from a timer thread makes it return, and ``expired`` tells the reader the
    transfer was cut on purpose. The sockets are taken as urllib3 opens or reuses
    them (``_WatchedConnection``), not from the response: when a response will close
    (HTTP/1.0, ``Connection: close``) http.client hands its socket to the response
    and the connection's ``sock`` is None, and before the response exists (a token
    request, trickled headers, a TLS handshake) there is none to ask. Each socket is
    held as a duplicate descriptor, so the one to cut stays reachable whatever
    http.client or ssl do with their socket objects, and no closed descriptor number
    (perhaps reused by then) is ever shut down.
    """

    def __init__(self, seconds: float, url: str) -> None:
        self.seconds = seconds
        self.url = url  # the URL being read: the request's, or its token endpoint's
        self.expired = threading.Event()
        self._lock = threading.Lock()
        self._held: dict[object, socket.socket] = {}  # connection -> duplicate of its socket
        self._done = False
        self.stopped = False  # cut by a stop signal (``cut_transfers``), not by the deadline
        self._outer: _Watchdog | None = None
        self._timer = threading.Timer(seconds, self._cut)
        self._timer.daemon = True

    def __enter__(self) -> _Watchdog:
        self._outer = getattr(_watching, "dog", None)
        _watching.dog = self
        _live.add(self)
        self._timer.start()
        return self

    def __exit__(self, *exc_info) -> None:
        _watching.dog = self._outer
        _live.discard(self)
        self._timer.cancel()
        with self._lock:
            self._done = True
            held, self._held = self._held, {}
        for dup in held.values():
            dup.close()

    def hold(self, connection: object, sock: socket.socket | None, url: str | None) -> None:
        """Watch ``connection`` (whose socket is ``sock``) for this request."""
        with self._lock:
            if self._done:
                return
            if url is not None:
                self.url = url
            # A pooled connection serves one request at a time: the latest holder owns it,
            # and an earlier request's watchdog firing late must not cut it.
            connection._katamgr_dog = self  # type: ignore[attr-defined]
            if sock is None or connection in self._held:
                return
            try:
                dup = socket.fromfd(sock.fileno(), sock.family, sock.type)
            except OSError:
                return  # closed already: nothing left to cut
            self._held[connection] = dup
            expired = self.expired.is_set()
        if expired:
            _shut(dup)

    def _cut(self) -> None:
        with self._lock:
            if self._done:
                return
            self.expired.set()
            for connection, dup in self._held.items():
                if getattr(connection, "_katamgr_dog", None) is self:
                    _shut(dup)


def cut_transfers() -> None:
    """Cut every transfer under way in this process, as a passed deadline does: a stop
    signal must not wait for a layer thread's chunk read to fill (a slow registry's blob)."""
    for dog in list(_live):
        dog.stopped = True
        dog._cut()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed: the reader has finished or failed


_live: weakref.WeakSet[_Watchdog] = weakref.WeakSet()  # the watchdogs of the requests under way
_watching = threading.local()  # .dog: the watchdog of the request this thread is making


class _WatchedConnection:
    """Hands every socket urllib3 opens or reuses to the current request's watchdog."""

    def _new_conn(self) -> socket.socket:
        # right after the TCP connect, before any TLS handshake or HTTP byte
        sock = super()._new_conn()  # type: ignore[misc]
        dog = getattr(_watching, "dog", None)
        if dog is not None:
            dog.hold(self, sock, None)
        return sock

    def request(self, method, url, *args, **kwargs):  # noqa: ANN001 - urllib3's signature
        dog = getattr(_watching, "dog", None)
        if dog is not None:
            dog.hold(self, self.sock, _full_url(self, url))  # type: ignore[attr-defined]
        return super().request(method, url, *args, **kwargs)  # type: ignore[misc]


def _full_url(connection, target: str) -> str:  # noqa: ANN001 - a urllib3 connection
    if "://" in target:
        return target
    scheme = "https" if isinstance(connection, urllib3.connection.HTTPSConnection) else "http"
    return f"{scheme}://{connection.host}:{connection.port}{target}"


class _WatchedHTTPConnection(_WatchedConnection, urllib3.connection.HTTPConnection):
    pass


class _WatchedHTTPSConnection(_WatchedConnection, urllib3.connection.HTTPSConnection):
    pass


class _WatchedHTTPPool(urllib3.connectionpool.HTTPConnectionPool):
    ConnectionCls = _WatchedHTTPConnection


class _WatchedHTTPSPool(urllib3.connectionpool.HTTPSConnectionPool):
    ConnectionCls = _WatchedHTTPSConnection


class _TimeoutAdapter(requests.adapters.HTTPAdapter):
    """Every request on the session (token endpoint included) gets a timeout, and its
    connections are watched by the deadline of the request it belongs to."""

    def __init__(self, deadlines: Deadlines, **kwargs) -> None:
        super().__init__(**kwargs)
        self.timeout = (deadlines.connect, deadlines.read)

    def init_poolmanager(self, *args, **kwargs) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {"http": _WatchedHTTPPool,
                                                   "https": _WatchedHTTPSPool}

    def send(self, request, **kwargs):  # noqa: ANN001 - requests' signature
        if kwargs.get("timeout") is None:
            kwargs["timeout"] = self.timeout
        return super().send(request, **kwargs)


class _OrasClient(oras.provider.Registry):
    def __init__(self, registry: str, *, insecure: bool, credentials: Credentials | None,
                 deadlines: Deadlines = DEFAULT_DEADLINES):
        super().__init__(hostname=registry, insecure=insecure, auth_backend="token")
        # credentials come from the pull secret only, never this process's ~/.docker/config.json
        self.auth._auth_config = {"auths": {}}
        if credentials:
            self.auth.set_basic_auth(credentials.username, credentials.password)
        self.credentials = credentials
        self._authorization: str | None = None
        adapter = _TimeoutAdapter(deadlines, pool_connections=2, pool_maxsize=4, max_retries=0)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)

    def do_request(self, url, method="GET", data=None, headers=None, json=None, stream=False):
        headers = dict(headers or {})
        if self._authorization:
            headers["Authorization"] = self._authorization
        response = self._send(method, url, data, headers, json, stream)
        if response.status_code != 401:
            return response
        challenge = response.headers.get("WWW-Authenticate", "")
        scheme = challenge.split(" ", 1)[0].lower()
        if scheme == "basic" and self.credentials:
            pair = f"{self.credentials.username}:{self.credentials.password}".encode()
            authorization = "Basic " + base64.b64encode(pair).decode()
        elif scheme == "bearer":
            # oras's token flow: anonymous, or basic-auth exchange when we have credentials
            token_headers, changed = self.auth.authenticate_request(response, {}, refresh=True)
            if not changed:
                return response
            authorization = token_headers["Authorization"]
        else:
            return response
        if authorization == self._authorization:
            return response  # these credentials were just refused
        response.close()
        self._authorization = authorization
        headers["Authorization"] = authorization
        return self._send(method, url, data, headers, json, stream)

    def _send(self, method, url, data, headers, json, stream) -> requests.Response:
        return self.session.request(
            method, url, data=data, json=json, headers=headers, stream=stream,
            verify=self._tls_verify,
        )


class RegistrySource:
    """One registry ref; every method is one attempt (the installer retries)."""

    def __init__(
        self,
        ref: RegistryRef,
        *,
        credentials: Credentials | None = None,
        insecure_registries: Iterable[str] = (),
        deadlines: Deadlines = DEFAULT_DEADLINES,
    ) -> None:
        self.ref = ref
        self.description = str(ref)
        self.deadlines = deadlines
        self.plain_http = use_plain_http(ref.registry, insecure_registries)
        self.client = _OrasClient(ref.registry, insecure=self.plain_http, credentials=credentials,
                                  deadlines=deadlines)
        self.container = oras.container.Container(f"{ref.registry}/{ref.repository}:x")

    def fetch_manifest(self) -> FetchedManifest:
        url = f"{self.client.prefix}://{self.container.manifest_url(self.ref.reference)}"
        accept = ", ".join(MANIFEST_MEDIA_TYPES + INDEX_MEDIA_TYPES)
        what = f"the manifest of {self.ref.reference}"
        with self._request(url, what, {"Accept": accept}, self.deadlines.manifest) as (response, dog):
            declared = response.headers.get("Content-Length")
            if declared and declared.isdigit() and int(declared) > MAX_MANIFEST_BYTES:
                raise ArtifactError(
                    f"{self.description}: the registry offers a {declared}-byte manifest, over "
                    f"the {MAX_MANIFEST_BYTES}-byte cap; this is not a Kata artifact, check the ref"
                )
            body = bytearray()
            try:
                for chunk in response.iter_content(64 * 1024):
                    body += chunk
                    if len(body) > MAX_MANIFEST_BYTES:
                        raise ArtifactError(
                            f"{self.description}: the manifest is over the {MAX_MANIFEST_BYTES}"
                            "-byte cap; this is not a Kata artifact, check the ref"
                        )
            except _STREAM_ERRORS as exc:
                raise self._dropped(what, exc, dog) from exc
            self._check_deadline(what, dog)
            media_type = response.headers.get("Content-Type", "").split(";")[0].strip() or None
        return FetchedManifest(bytes(body), media_type, self.ref.digest)

    @contextmanager
    def open_blob(self, layer: Layer) -> Iterator[Iterator[bytes]]:
        url = f"{self.client.prefix}://{self.container.get_blob_url(layer.digest)}"
        what = f"blob {layer.digest} ({layer.name})"
        with self._request(url, what, {}, self.deadlines.blob) as (response, dog):
            yield self._chunks(response, what, dog)

    def _chunks(self, response: requests.Response, what: str, dog: _Watchdog) -> Iterator[bytes]:
        try:
            for chunk in response.iter_content(CHUNK_BYTES):
                self._check_deadline(what, dog)
                yield chunk
        except _STREAM_ERRORS as exc:
            raise self._dropped(what, exc, dog) from exc
        self._check_deadline(what, dog)

    def _check_deadline(self, what: str, dog: _Watchdog) -> None:
        if dog.expired.is_set():
            raise self._too_slow(what, dog)

    def _too_slow(self, what: str, dog: _Watchdog) -> ArtifactError:
        if dog.stopped:  # never retried, never blamed on the registry
            return Stopped(f"{self.description}: {what} was cut: katamgr is stopping")
        return TransientError(
            f"{self.description}: {what} took longer than its {dog.seconds:g} s deadline "
            f"({dog.url} was still sending when it was cut; registry {self.ref.registry} "
            "too slow)",
            "check the network and the registry, or raise the deadline",
            unreachable=False,
        )

    @contextmanager
    def _request(self, url: str, what: str, headers: dict,
                 seconds: float) -> Iterator[tuple[requests.Response, _Watchdog]]:
        # The deadline covers the whole exchange: connect, a token request, headers, body.
        with _Watchdog(seconds, url) as dog:
            try:
                response = self.client.do_request(url, "GET", headers=headers, stream=True)
            except Exception as exc:
                # a cut token request fails in many ways (a broken stream, JSON cut short)
                if dog.expired.is_set():
                    raise self._too_slow(what, dog) from exc
                if isinstance(exc, (requests.exceptions.ConnectionError,
                                    requests.exceptions.Timeout)):
                    raise self._unreachable(what, exc) from exc
                raise
            try:
                self._check_deadline(what, dog)
                self._check_status(response, what)
                yield response, dog
            finally:
                response.close()

    def _unreachable(self, what: str, exc: Exception) -> TransientError:
        return TransientError(
            f"{self.description}: cannot reach registry {self.ref.registry} for {what} "
            f"({_reason(exc)})",
            "check that the registry is up and reachable from this node"
            + ("" if self.plain_http else " over HTTPS"),
            unreachable=True,
        )

    def _check_status(self, response: requests.Response, what: str) -> None:
        status = response.status_code
        if status == 200:
            return
        where = f"{self.description}: registry {self.ref.registry} answered HTTP {status} for {what}"
        if status >= 500:
            raise TransientError(where, "the registry failed; retry later or check its logs",
                                 unreachable=False)
        if status == 401:
            if self.client.credentials is None:
                fix = "it needs credentials: set the runtime class's artifacts pullSecret"
            else:
                fix = (f"it refused user {self.client.credentials.username!r}: fix the "
                       "user/password in the pull secret")
            raise ArtifactError(f"{where}; {fix}")
        if status == 403:
            raise ArtifactError(f"{where}; the pull secret's user may not pull "
                                f"{self.ref.repository}, grant it pull access")
        if status == 404:
            raise ArtifactError(f"{where} (not found); check the repository, tag or digest in "
                                "the ref and that it was pushed")
        raise ArtifactError(f"{where}; expected 200, check the ref and the registry")

    def _dropped(self, what: str, exc: Exception, dog: _Watchdog) -> ArtifactError:
        if dog.expired.is_set():
            return self._too_slow(what, dog)
        return TransientError(
            f"{self.description}: the connection to {self.ref.registry} broke while reading "
            f"{what} ({_reason(exc)})",
            "check the network and the registry",
            unreachable=False,
        )
