"""What the webhook answers, as the bytes of an HTTP answer.

``route`` decides from a request's head alone (probes, unknown paths, methods; the
connection's loop answers these at once); ``review`` parses an AdmissionReview body and
runs the rules (a worker thread's job). A review of something other than a Pod gets
``allowed: false`` with a status saying to fix the webhook's rules; a failure in the rules
gets ``allowed: false`` with code 500 (the webhook configuration's ``failurePolicy``
decides nothing here: the API server got an answer). A body that is not a review gets an
HTTP 4xx with a one-line JSON message, whatever it holds.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from katamgr.admission import draclaims, httpio, review, rules

log = logging.getLogger("katamgr.webhook")

REVIEW_PATHS = ("/mutate", "/validate")
# The rules' work and their patch grow with a pod's containers (a patch op of about 110 bytes
# for each); a pod has a handful. 1.4 MB of {"name":"a"} would be 99,000 of them: a second of
# a worker's time and a 14 MB answer. No node runs a pod with more than this.
MAX_POD_CONTAINERS = 1000
CONTAINER_LISTS = ("initContainers", "containers", "ephemeralContainers")
PROBE_PATHS = ("/healthz", "/readyz", "/livez")


def route(head: httpio.Head) -> httpio.Reply | None:
    """The answer a head gets without its body being looked at; None for a review."""
    path, shown = head.path, httpio.shorten(head.target)
    if head.method == "GET":
        if path in PROBE_PATHS:
            return httpio.Reply(200, b"ok\n", "text/plain")
        return httpio.error(404, f"no such path {shown}; use GET /healthz, POST /mutate or "
                                 f"POST /validate")
    if head.method == "POST":
        if path in REVIEW_PATHS:
            return None
        return httpio.error(404, f"no such path {shown}; use POST /mutate or POST /validate")
    return httpio.error(405, f"method {httpio.shorten(head.method)} is not served; use GET "
                             f"/healthz, POST /mutate or POST /validate")


def review_answer(path: str, body: bytes | bytearray, policy: rules.Policy) -> httpio.Reply:
    """The HTTP answer to a review's body (a worker thread runs this)."""
    try:
        request = review.parse_review(body)
    except review.ReviewError as exc:
        return httpio.error(exc.status, str(exc))
    verdict = judge(path, request, policy)
    return httpio.Reply(200, json.dumps(verdict, separators=(",", ":")).encode())


def judge(path: str, request: dict[str, Any], policy: rules.Policy) -> dict[str, Any]:
    """The AdmissionReview answering ``request`` on ``path`` (/mutate or /validate)."""
    uid = request["uid"]
    if draclaims.is_claim(request) and policy.dra is not None:
        return _judge_claim(path, request, policy, policy.dra)
    if not review.is_pod(request):
        return review.response(uid, allowed=False, code=400, message=(
            f"katamgr webhook reviews Pods only, got {httpio.shorten(review.kind_of(request))}; "
            f"fix the rules of the webhook configuration (resources: [pods], apiGroups: [\"\"])"))
    pod = request.get("object")
    if request.get("operation") not in (None, "CREATE", "UPDATE") or pod is None:
        return review.response(uid)  # DELETE/CONNECT: nothing to look at
    if not isinstance(pod, dict):
        return review.response(uid, allowed=False, code=400,
                               message="the review's object is not a Pod object")
    spec = pod.get("spec")
    count = sum(len(spec.get(k) or ()) for k in CONTAINER_LISTS
                if isinstance(spec.get(k), list)) if isinstance(spec, dict) else 0
    if count > MAX_POD_CONTAINERS:
        return review.response(uid, allowed=False, code=400, message=(
            f"the pod has {count} containers, more than the {MAX_POD_CONTAINERS} katamgr "
            f"webhook reviews"))
    # pods/ephemeralcontainers (kubectl debug): only the ephemeral containers may change.
    subresource = request.get("subResource") or ""
    old = request.get("oldObject")
    if not isinstance(subresource, str):
        return review.response(uid, allowed=False, code=400,
                               message="the review's subResource is not a string")
    try:
        if path == "/mutate":
            if request.get("operation") == "UPDATE" and not subresource:
                # A container's env cannot change after create: a patch on a plain UPDATE
                # would make the API server refuse every later update of the pod.
                return review.response(uid)
            patch = rules.mutate(pod, policy, subresource=subresource,
                                 old=old if isinstance(old, dict) else None)
            return review.response(uid, patch=patch)
        if request.get("operation") == "UPDATE" and not subresource:
            # A plain update: the CDI annotations it adds or changes (a missing oldObject,
            # which the API server always sends, counts every one as added).
            denial = rules.validate_update(pod, old if isinstance(old, dict) else None, policy)
        else:
            denial = rules.validate(pod, policy, subresource=subresource)
            if not denial and policy.dra is not None and not subresource:
                namespace = request.get("namespace") or (pod.get("metadata") or {}).get("namespace") or ""
                denial = draclaims.pod_problem(pod, str(namespace), policy, policy.dra)
    except RecursionError:
        # parse_review bounds the depth, so the rules should never meet this; if they do,
        # the pod is refused as malformed, in one line.
        log.warning("cannot review a pod: it nests too deeply for the rules")
        return review.response(uid, allowed=False, code=400,
                               message="the pod nests too deeply to be reviewed")
    except Exception as exc:  # noqa: BLE001 - a bug must deny, never crash the server
        log.exception("cannot review pod %s", httpio.shorten(_name(pod)))
        return review.response(uid, allowed=False, code=500, message=(
            f"katamgr webhook failed reviewing this pod: {httpio.shorten(str(exc))}"))
    return _verdict(uid, denial)


def _judge_claim(path: str, request: dict[str, Any], policy: rules.Policy,
                 dra: draclaims.DraChecks) -> dict[str, Any]:
    """A ResourceClaim's status write (the scheduler reserving it for a pod), on /validate."""
    uid = request["uid"]
    if path != "/validate" or request.get("operation") != "UPDATE":
        return review.response(uid)  # nothing to change, nothing else judged
    try:
        denial = draclaims.status_problem(request, policy, dra)
    except Exception as exc:  # noqa: BLE001 - a read that failed, or a bug: deny, fail closed
        log.warning("cannot review a ResourceClaim status write: %s", exc)
        return review.response(uid, allowed=False, code=500, message=(
            f"katamgr webhook failed reviewing this ResourceClaim: {httpio.shorten(str(exc))}"))
    return _verdict(uid, denial)


def _name(pod: dict[str, Any]) -> str:
    try:
        return rules.pod_name(pod)
    except Exception:  # noqa: BLE001 - a name for a log line, of a pod the rules choked on
        return "(unnamed)"


def _verdict(uid: str, denial: str | None) -> dict[str, Any]:
    """The review's answer: allowed, or refused with the rule's sentence (HTTP 403)."""
    if denial:
        log.info("denied: %s", httpio.shorten(denial, 1000))
        return review.response(uid, allowed=False, code=403, message=denial)
    return review.response(uid)
