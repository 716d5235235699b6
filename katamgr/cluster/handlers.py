"""The handler of a RuntimeClass, read from the API server for ``katamgr webhook``'s handler
rule (a passthrough pod's class must have a Kata handler). A handler never changes (the API
server refuses the update), but a class may be deleted and made again with another one, so an
answer is kept for a short while only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kubernetes.client import ApiClient, NodeV1Api
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from gpunode.errors import GpuNodeError
from gpunode.services.kube import READ_TIMEOUT, api_error_message

CACHE_SECONDS = 10.0


def handler_lookup(api: ApiClient, ttl: float = CACHE_SECONDS,
                   clock: Callable[[], float] = time.monotonic) -> Callable[[str], str | None]:
    """A function giving a RuntimeClass's handler by name (None: there is no such class). A
    refusal or an API server that does not answer is a GpuNodeError, which the webhook turns
    into a denial (the rule fails closed, as the webhook's failurePolicy does)."""
    node_api = NodeV1Api(api)
    cache: dict[str, tuple[float, str | None]] = {}
    lock = threading.Lock()

    def handler_of(name: str) -> str | None:
        now = clock()
        with lock:
            hit = cache.get(name)
        if hit and now - hit[0] < ttl:
            return hit[1]
        try:
            handler: str | None = node_api.read_runtime_class(name, _request_timeout=READ_TIMEOUT).handler
        except ApiException as e:
            if e.status != 404:
                raise GpuNodeError(f"cannot read RuntimeClass {name}: {api_error_message(e)}"
                                   + ("; grant the webhook's service account get on runtimeclasses"
                                      if e.status in (401, 403) else "")) from e
            handler = None
        except HTTPError as e:
            raise GpuNodeError(f"cannot read RuntimeClass {name}: API server unreachable ({e})") from e
        with lock:
            cache[name] = (now, handler)
        return handler

    return handler_of
