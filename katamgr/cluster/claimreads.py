"""The reads ``katamgr webhook``'s DRA rules make (``katamgr.admission.draclaims``): a
ResourceClaim, a ResourceClaimTemplate and a Pod, each by namespace and name, as JSON (what
the API server sends, not the client's models). Nothing is kept: a claim's reservation
changes from one write to the next, and a pod named in ``reservedFor`` is read as it is now.
The webhook's ServiceAccount may get these three, nothing more (no list, no watch).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kubernetes.client import ApiClient, CoreV1Api, ResourceV1Api
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from gpunode.errors import GpuNodeError
from gpunode.services.kube import READ_TIMEOUT, api_error_message

Read = Callable[[str, str], "dict[str, Any] | None"]


def _reader(kind: str, plural: str, read: Callable[..., Any]) -> Read:
    def read_one(namespace: str, name: str) -> dict[str, Any] | None:
        """The object, None when there is none; GpuNodeError when it cannot be read (the
        webhook denies: fail closed)."""
        try:
            response = read(name, namespace, _preload_content=False, _request_timeout=READ_TIMEOUT)
        except ApiException as e:
            if e.status == 404:
                return None
            raise GpuNodeError(f"cannot read {kind} {namespace}/{name}: {api_error_message(e)}"
                               + (f"; grant the webhook's service account get on {plural}"
                                  if e.status in (401, 403) else "")) from e
        except HTTPError as e:
            raise GpuNodeError(f"cannot read {kind} {namespace}/{name}: API server unreachable ({e})") from e
        return json.loads(response.data)

    return read_one


def claim_reads(api: ApiClient) -> tuple[Read, Read, Read]:
    """The readers of ResourceClaims, ResourceClaimTemplates (resource.k8s.io/v1) and Pods."""
    resource, core = ResourceV1Api(api), CoreV1Api(api)
    return (_reader("ResourceClaim", "resourceclaims", resource.read_namespaced_resource_claim),
            _reader("ResourceClaimTemplate", "resourceclaimtemplates",
                    resource.read_namespaced_resource_claim_template),
            _reader("Pod", "pods", core.read_namespaced_pod))
