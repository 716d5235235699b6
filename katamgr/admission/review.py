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


class ReviewError(ValueError):
    """A body that is not an AdmissionReview v1 request: answered with HTTP ``status``."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def parse_review(body: bytes) -> dict[str, Any]:
    """The ``request`` of an AdmissionReview v1 body, or ReviewError saying what is wrong."""
    if len(body) > MAX_BODY:
        raise ReviewError(f"the request body is {len(body)} bytes, over the {MAX_BODY}-byte limit", 413)
    try:
        review = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ReviewError(f"the request body is not JSON ({exc}); send an {API_VERSION} {KIND}") from None
    if not isinstance(review, dict):
        raise ReviewError(f"the request body is a JSON {type(review).__name__}, not an {API_VERSION} {KIND}")
    if review.get("apiVersion") != API_VERSION or review.get("kind") != KIND:
        raise ReviewError(f"expected apiVersion {API_VERSION} kind {KIND}, got apiVersion "
                          f"{review.get('apiVersion')!r} kind {review.get('kind')!r} (set "
                          f"admissionReviewVersions: [v1] in the webhook configuration)")
    request = review.get("request")
    if not isinstance(request, dict):
        raise ReviewError(f"the {KIND} has no request object")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise ReviewError(f"the {KIND} request has no uid")
    return request


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
