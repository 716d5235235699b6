"""The ``admission.k8s.io/v1`` AdmissionReview contract, as the API server speaks it.

A request body is an AdmissionReview whose ``request`` carries a ``uid`` (echoed back),
the ``kind`` of the object and the ``object`` itself; the response is an AdmissionReview
with the same apiVersion and kind and a ``response`` holding ``uid``, ``allowed`` and,
where it applies, a base64 ``patch`` with ``patchType: JSONPatch`` or a ``status``
(``message``, ``code``) explaining a denial. A body that is not such a review is a
``ReviewError``: the server answers it with an HTTP error and a message, never a review.
"""

from __future__ import annotations

import base64
import json
from typing import Any

API_VERSION = "admission.k8s.io/v1"
KIND = "AdmissionReview"
# The API server caps a request object at 3 MiB (etcd's default limit is 1.5 MiB); a review
# carries the object once more as oldObject on UPDATE, so this is generous for a Pod.
MAX_BODY = 3 * 1024 * 1024
POD_KIND = {"group": "", "version": "v1", "kind": "Pod"}
# A Pod's review nests about 20 levels at its deepest (metadata.managedFields' fieldsV1).
# Deeper is refused before the rules see it: their walks and messages (str of a value) must
# never meet Python's recursion limit.
MAX_DEPTH = 100
# '{' and '[' in a body, strings included: JSON objects and arrays at most. A Pod's review
# has a few thousand; 3 MiB of "[{},{},..." would be a million objects (70 MiB parsed).
MAX_CONTAINERS = 100_000


class ReviewError(ValueError):
    """A body that is not an AdmissionReview v1 request: answered with HTTP ``status``."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def parse_review(body: bytes | bytearray) -> dict[str, Any]:
    """The ``request`` of an AdmissionReview v1 body, or ReviewError saying what is wrong."""
    if len(body) > MAX_BODY:
        raise ReviewError(f"the request body is {len(body)} bytes, over the {MAX_BODY}-byte limit", 413)
    containers = body.count(b"{") + body.count(b"[")
    if containers > MAX_CONTAINERS:
        raise ReviewError(f"the request body has {containers} '{{' and '[', more JSON objects and "
                          f"arrays than the {MAX_CONTAINERS} a Pod's review could need")
    too_deep = (f"the request body nests JSON deeper than {MAX_DEPTH} levels (a Pod's review "
                f"needs about 20); send an {API_VERSION} {KIND}")
    try:
        review = json.loads(body)
    except RecursionError:
        raise ReviewError(too_deep) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int of 5,000 digits
        raise ReviewError(f"the request body is not JSON ({_one_line(exc)}); send an "
                          f"{API_VERSION} {KIND}") from None
    if _deeper_than(review, MAX_DEPTH):
        raise ReviewError(too_deep)
    if not isinstance(review, dict):
        raise ReviewError(f"the request body is a JSON {type(review).__name__}, not an {API_VERSION} {KIND}")
    if review.get("apiVersion") != API_VERSION or review.get("kind") != KIND:
        raise ReviewError(f"expected apiVersion {API_VERSION} kind {KIND}, got apiVersion "
                          f"{_shown(review.get('apiVersion'))} kind {_shown(review.get('kind'))} (set "
                          f"admissionReviewVersions: [v1] in the webhook configuration)")
    request = review.get("request")
    if not isinstance(request, dict):
        raise ReviewError(f"the {KIND} has no request object")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise ReviewError(f"the {KIND} request has no uid")
    return request


def _one_line(exc: Exception, limit: int = 200) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit] + "..."


def _shown(value: Any, limit: int = 100) -> str:
    """A value from the body in a message: its repr, cut (it may be megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` nests objects and arrays more than ``limit`` deep (a loop, not a
    recursion, so any depth json.loads returns is measured)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, dict | list):
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item)
                     if isinstance(child, dict | list))
    return False


def kind_of(request: dict[str, Any]) -> str:
    """``group/version Kind`` of the reviewed object, for messages."""
    kind = request.get("kind") or {}
    if not isinstance(kind, dict):
        return repr(kind)
    group_version = "/".join(p for p in (kind.get("group"), kind.get("version")) if p)
    return f"{group_version} {kind.get('kind')}".strip()


def is_pod(request: dict[str, Any]) -> bool:
    kind = request.get("kind")
    return isinstance(kind, dict) and all(kind.get(k) == v for k, v in POD_KIND.items())


def response(uid: str, *, allowed: bool = True, patch: list[dict[str, Any]] | None = None,
             message: str | None = None, code: int | None = None,
             warnings: list[str] | None = None) -> dict[str, Any]:
    """An AdmissionReview v1 response (a JSONPatch only when there is something to change)."""
    body: dict[str, Any] = {"uid": uid, "allowed": allowed}
    if patch:
        body["patchType"] = "JSONPatch"
        body["patch"] = base64.b64encode(json.dumps(patch, separators=(",", ":")).encode()).decode()
    if message is not None or code is not None:
        status: dict[str, Any] = {}
        if message is not None:
            status["message"] = message
        if code is not None:
            status["code"] = code
        if not allowed:
            status["status"] = "Failure"
            status["reason"] = {400: "BadRequest", 403: "Forbidden", 500: "InternalError"}.get(code or 0, "Forbidden")
        body["status"] = status
    if warnings:
        body["warnings"] = warnings
    return {"apiVersion": API_VERSION, "kind": KIND, "response": body}
