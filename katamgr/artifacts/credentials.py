"""Registry credentials from a ``kubernetes.io/dockerconfigjson`` pull secret.

Fetching the Secret is the cluster layer's job; this module only reads its
``.dockerconfigjson`` value (``{"auths": {"<registry>": {"auth": base64("user:pass")}}}``
or ``username``/``password`` fields) and picks the entry for one registry.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from gpunode.errors import ConfigError

DOCKERCONFIGJSON_KEY = ".dockerconfigjson"
# Docker Hub is written many ways in docker config files
_DOCKER_HUB = {"docker.io", "index.docker.io", "registry-1.docker.io"}


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str = field(repr=False)


def credentials_from_dockerconfigjson(
    data: bytes | str | Mapping[str, Any], registry: str, *, secret: str = "pull secret"
) -> Credentials | None:
    """Credentials for ``registry`` (``host[:port]``) in a dockerconfigjson, or None.

    ``data`` is the ``.dockerconfigjson`` value (bytes or str, as decoded from the
    Secret), the parsed JSON, or the Secret's data mapping holding that key (a value
    still base64-encoded, as the API returns it, is decoded). ``secret`` names the
    Secret in error messages.
    """
    config = _load(data, secret)
    auths = config.get("auths", config)  # a legacy .dockercfg has no "auths" level
    if not isinstance(auths, Mapping):
        raise ConfigError(f"{secret}: 'auths' is not a JSON object; recreate the pull secret")
    wanted = _normalize(registry)
    for key, entry in auths.items():
        if isinstance(key, str) and _normalize(key) == wanted:
            return _entry_credentials(entry, key, secret)
    return None


def _load(data: bytes | str | Mapping[str, Any], secret: str) -> Mapping[str, Any]:
    if isinstance(data, Mapping):
        if DOCKERCONFIGJSON_KEY not in data:
            return data
        data = data[DOCKERCONFIGJSON_KEY]
    if isinstance(data, str):
        data = data.encode()
    if not isinstance(data, bytes):
        raise ConfigError(
            f"{secret}: {DOCKERCONFIGJSON_KEY} is a {type(data).__name__}, not JSON text; "
            "recreate it with kubectl create secret docker-registry"
        )
    text = data.strip()
    if text[:1] != b"{":
        try:  # the API's Secret.data values are base64
            text = base64.b64decode(text, validate=True).strip()
        except (binascii.Error, ValueError):
            pass
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise ConfigError(
            f"{secret}: {DOCKERCONFIGJSON_KEY} is not valid JSON ({exc}); "
            "recreate it with kubectl create secret docker-registry"
        ) from exc
    if not isinstance(config, dict):
        raise ConfigError(
            f"{secret}: {DOCKERCONFIGJSON_KEY} is not a JSON object; "
            "recreate it with kubectl create secret docker-registry"
        )
    return config


def _normalize(name: str) -> str:
    name = name.strip()
    host = urlsplit(name).netloc if "://" in name else name.split("/", 1)[0]
    host = host.lower()
    return "docker.io" if host in _DOCKER_HUB else host


def _entry_credentials(entry: Any, key: str, secret: str) -> Credentials:
    if not isinstance(entry, Mapping):
        raise ConfigError(
            f"{secret}: the entry for registry {key!r} is not a JSON object; "
            "recreate the pull secret"
        )
    auth = entry.get("auth")
    if auth:
        try:
            decoded = base64.b64decode(str(auth), validate=True).decode()
        except (binascii.Error, ValueError) as exc:
            raise ConfigError(
                f"{secret}: the 'auth' of registry {key!r} is not base64 of 'user:password'; "
                "recreate the pull secret"
            ) from exc
        username, sep, password = decoded.partition(":")
        if not sep or not username:
            raise ConfigError(
                f"{secret}: the 'auth' of registry {key!r} does not decode to 'user:password'; "
                "recreate the pull secret"
            )
        return Credentials(username, password)
    username, password = entry.get("username"), entry.get("password")
    if isinstance(username, str) and username and isinstance(password, str):
        return Credentials(username, password)
    raise ConfigError(
        f"{secret}: the entry for registry {key!r} has neither 'auth' nor "
        "'username'/'password'; recreate the pull secret with a user and password"
    )
