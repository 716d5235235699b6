"""Image pull secrets for artifact registries."""

from __future__ import annotations

import base64
import binascii
import logging

from kubernetes.client import ApiClient, CoreV1Api
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from gpunode.errors import ConfigError, GpuNodeError
from gpunode.services.kube import api_error_message

log = logging.getLogger(__name__)

DOCKERCONFIGJSON_TYPE = "kubernetes.io/dockerconfigjson"
DOCKERCONFIGJSON_KEY = ".dockerconfigjson"
# A docker config with a handful of registries is a few KiB; anything near the
# Secret size limit is not a credential file we want to parse.
MAX_DOCKERCONFIG_BYTES = 256 * 1024


def read_pull_secret(api: ApiClient, namespace: str, name: str) -> bytes:
    """The ``.dockerconfigjson`` of Secret ``namespace/name``, decoded (JSON bytes)."""
    try:
        secret = CoreV1Api(api).read_namespaced_secret(name, namespace)
    except ApiException as e:
        if e.status == 404:
            raise ConfigError(
                f"pull secret {namespace}/{name} does not exist; create it "
                f"(kubectl -n {namespace} create secret docker-registry {name} ...) "
                "or clear artifacts.pullSecret"
            ) from e
        hint = (f"; grant the agent's service account get on secrets in {namespace}"
                if e.status in (401, 403) else "")
        raise GpuNodeError(
            f"cannot read pull secret {namespace}/{name}: {api_error_message(e)}{hint}"
        ) from e
    except HTTPError as e:
        raise GpuNodeError(
            f"cannot read pull secret {namespace}/{name}: API server unreachable ({e})"
        ) from e
    if secret.type != DOCKERCONFIGJSON_TYPE:
        raise ConfigError(
            f"pull secret {namespace}/{name} has type {secret.type!r}, not "
            f"{DOCKERCONFIGJSON_TYPE!r}; recreate it with kubectl create secret docker-registry"
        )
    encoded = (secret.data or {}).get(DOCKERCONFIGJSON_KEY)
    if not encoded:
        raise ConfigError(
            f"pull secret {namespace}/{name} has no {DOCKERCONFIGJSON_KEY} key; "
            "recreate it with kubectl create secret docker-registry"
        )
    if len(encoded) > MAX_DOCKERCONFIG_BYTES * 4 // 3 + 4:
        raise ConfigError(
            f"pull secret {namespace}/{name} holds more than {MAX_DOCKERCONFIG_BYTES} bytes; "
            "it is not a docker config"
        )
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ConfigError(
            f"pull secret {namespace}/{name}: {DOCKERCONFIGJSON_KEY} is not valid base64"
        ) from e
