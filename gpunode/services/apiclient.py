"""How both programs reach the cluster: one rule, the same for the agent and the plugins.

An explicit ``KUBECONFIG`` is the operator's choice and wins; then the pod's service
account (the chart's DaemonSets); then ``~/.kube/config`` (a run from an admin's shell),
except on a simulated node, which talks to a cluster only when one is named, so that a
demo in an admin's shell never writes to the admin's cluster. A kubeconfig or service
account that exists but cannot be used is a ConfigError: the operator pointed us at it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from kubernetes.client import ApiClient, Configuration
from kubernetes.config import ConfigException
from kubernetes.config.incluster_config import (
    SERVICE_HOST_ENV_NAME,
    SERVICE_PORT_ENV_NAME,
    InClusterConfigLoader,
)
from kubernetes.config.kube_config import load_kube_config

from gpunode.errors import ConfigError
from gpunode.policy.workload import NoCluster

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
DEFAULT_KUBECONFIG = "~/.kube/config"
# (connect, read) seconds for a call that names no timeout of its own. The client's default
# is none: a request to an API server that accepted the connection and never answered (one
# shutting down or starting) would hold its thread for good, an Event's retries with it.
REQUEST_TIMEOUT = (10.0, 30.0)


class BoundedApiClient(ApiClient):
    """An ``ApiClient`` whose every call is bounded (REQUEST_TIMEOUT unless the call says)."""

    def call_api(self, method, url, header_params=None, body=None, post_params=None,
                 _request_timeout=None):
        return super().call_api(method, url, header_params, body, post_params,
                                _request_timeout=_request_timeout or REQUEST_TIMEOUT)


def connect(
    environ: Mapping[str, str] | None = None,
    service_account_dir: Path = SERVICE_ACCOUNT_DIR,
    *,
    home_kubeconfig: bool = True,
) -> ApiClient | None:
    """An API client for the cluster: KUBECONFIG, else in-cluster, else ~/.kube/config
    (unless ``home_kubeconfig`` is False: a simulated node uses a cluster only when it
    is named, so a demo in an admin's shell never writes to the admin's cluster).

    None when there is no cluster to talk to (a node-only run).

    A kubeconfig or service account that exists but cannot be used is a
    ConfigError (the operator pointed us at it).
    """
    env = os.environ if environ is None else environ
    # An explicit KUBECONFIG is the operator's choice and wins; then the pod's
    # service account; then ~/.kube/config (a run from an admin's shell).
    explicit = _kubeconfig_paths(env) if env.get("KUBECONFIG") else []
    if explicit:
        return _from_kubeconfig(explicit)
    if env.get("KUBECONFIG"):
        log.warning("KUBECONFIG=%s names no existing file; ignoring it", env["KUBECONFIG"])
    if _in_cluster(env, service_account_dir):
        return _from_service_account(env, service_account_dir)
    fallback = [] if env.get("KUBECONFIG") else _kubeconfig_paths(env)
    if fallback and not home_kubeconfig:
        log.info("a simulated node: not using %s (set KUBECONFIG to use that cluster)",
                 fallback[0])
        return None
    if fallback:
        return _from_kubeconfig(fallback)
    log.info("no cluster reachable: no KUBECONFIG, no in-cluster service account, no %s",
             DEFAULT_KUBECONFIG)
    return None


def _from_service_account(env: Mapping[str, str], service_account_dir: Path) -> ApiClient:
    configuration = Configuration()
    try:
        InClusterConfigLoader(
            token_filename=str(service_account_dir / "token"),
            cert_filename=str(service_account_dir / "ca.crt"),
            environ=env,
        ).load_and_set(configuration)
    except ConfigException as e:
        raise ConfigError(
            f"the service account in {service_account_dir} is unusable ({e}); "
            "check the pod's automountServiceAccountToken"
        ) from e
    log.info("using the in-cluster service account for %s", configuration.host)
    return BoundedApiClient(configuration)


def _from_kubeconfig(paths: list[str]) -> ApiClient:
    joined = os.pathsep.join(paths)
    configuration = Configuration()
    try:
        # persist_config=False: never rewrite the operator's kubeconfig (token refreshes).
        load_kube_config(
            config_file=joined, client_configuration=configuration, persist_config=False
        )
    except (ConfigException, OSError, ValueError) as e:
        raise ConfigError(
            f"kubeconfig {joined} is unusable ({e}); fix it or unset KUBECONFIG"
        ) from e
    log.info("using kubeconfig %s for %s", joined, configuration.host)
    return BoundedApiClient(configuration)


def _in_cluster(env: Mapping[str, str], service_account_dir: Path) -> bool:
    return bool(
        env.get(SERVICE_HOST_ENV_NAME)
        and env.get(SERVICE_PORT_ENV_NAME)
        and (service_account_dir / "token").is_file()
    )


def _kubeconfig_paths(env: Mapping[str, str]) -> list[str]:
    """The kubeconfig files that exist, from KUBECONFIG (a path list) or ~/.kube/config."""
    raw = env.get("KUBECONFIG")
    candidates = raw.split(os.pathsep) if raw else [DEFAULT_KUBECONFIG]
    home = env.get("HOME")
    paths = []
    for candidate in candidates:
        if not candidate:
            continue
        if candidate.startswith("~") and home:
            candidate = home + candidate[1:]
        path = Path(candidate).expanduser()
        if path.is_file():
            paths.append(str(path))
    return paths


def required(
    environ: Mapping[str, str] | None = None,
    service_account_dir: Path = SERVICE_ACCOUNT_DIR,
    *,
    home_kubeconfig: bool = True,
) -> ApiClient:
    """``connect()``'s client, or NoCluster (the callers' fallback decides) without one."""
    api = connect(environ, service_account_dir, home_kubeconfig=home_kubeconfig)
    if api is None:
        raise NoCluster(f"no KUBECONFIG, no in-cluster service account and no usable {DEFAULT_KUBECONFIG}")
    return api
