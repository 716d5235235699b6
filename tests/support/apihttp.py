"""HTTP for the API server stand-in (``support.apiserver``): what the official client sends
and reads on the wire. A bearer token checked (401), the body read as JSON or, for an apply
patch, YAML (400 when malformed), every answer JSON with its status code, a watch written
as a chunked stream of JSON lines; and every request recorded, for the tests to assert what
was asked, and how often.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

import yaml

from support.apiobjects import ApiError
from support.apistore import APPLY
from support.apiwatch import is_watch, open_watch

if TYPE_CHECKING:
    from support.apiserver import FakeApiServer


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str
    query: dict[str, list[str]]
    content_type: str
    body: Any
    status: int


class Handler(BaseHTTPRequestHandler):
    api: FakeApiServer  # set on the subclass each start() makes
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in two writes

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # quiet: the request log is in FakeApiServer.requests

    def _check_token(self) -> None:
        if self.api.token and self.headers.get("Authorization") != f"Bearer {self.api.token}":
            raise ApiError(401, "Unauthorized", "Unauthorized")

    def _record(self, request: RecordedRequest) -> None:
        with self.api.store.lock:
            self.api.requests.append(request)

    def _reply(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _serve(self) -> None:
        split = urlsplit(self.path)
        query = parse_qs(split.query)
        if self.command == "GET" and is_watch(query):
            self._watch(split.path, query)
            return
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
        body: Any = None
        status, payload = 500, {}
        try:
            if raw:
                try:
                    body = yaml.safe_load(raw) if content_type == APPLY else json.loads(raw)
                except (ValueError, yaml.YAMLError) as e:
                    raise ApiError(400, "BadRequest", f"the request body is malformed: {e}") from e
            self._check_token()
            with self.api.store.lock:
                if self.api.on_request:
                    self.api.on_request(self.command, split.path)
                status, payload = self.api.handle(self.command, split.path, query,
                                                  content_type, body)
        except ApiError as e:
            status, payload = e.code, e.status()
        except Exception as e:  # a stand-in bug must surface as a 500, not a dropped socket
            status, payload = 500, ApiError(500, "InternalError", repr(e)).status()
        self._record(RecordedRequest(self.command, split.path, query, content_type, body, status))
        self._reply(status, payload)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve

    def _watch(self, path: str, query: dict) -> None:
        try:
            self._check_token()
            watch = open_watch(self.api, path, query)
        except ApiError as e:
            self._record(RecordedRequest("GET", path, query, "", None, e.code))
            self._reply(e.code, e.status())
            return
        self._record(RecordedRequest("GET", path, query, "", None, 200))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for event in watch.events():
                self._chunk(json.dumps(event).encode() + b"\n")
            self._chunk(b"")
        except OSError:
            pass  # the client went away

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()
