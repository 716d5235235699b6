"""The kubelet's side of Dynamic Resource Allocation, for the kubelet simulator.

No kubelet runs on our build machines, so the DRA driver is checked against this.
It plays kubelet 1.35 over real unix sockets in a host root, with grpcio (a gRPC
implementation that is not the driver's own):

- the plugin watcher (pkg/kubelet/pluginmanager ``pluginwatcher``): sockets in
  ``<root>/var/lib/kubelet/plugins_registry`` whose names do not start with ``.``
  are registered when they appear (or are replaced) and deregistered when they go;
  it looks every ``poll`` seconds where the kubelet asks inotify, which changes
  nothing a driver can see but the delay;
- registration (``operationexecutor/operation_generator.go``
  ``GenerateRegisterPluginFunc``): dial, ``GetInfo`` within 1 s; a type without a
  handler (only ``DRAPlugin`` has one here) is refused through
  ``NotifyRegistrationStatus(false, "RegisterPlugin error -- no handler registered
  for plugin type: ...")``; an empty endpoint means the registration socket; the
  DRA handler (pkg/kubelet/cm/dra/plugin ``DRAPluginManager``) takes the first of
  ``supported_versions`` it speaks (``v1.DRAPlugin``, ``v1beta1.DRAPlugin``: this
  stand-in speaks v1 only and says so) and refuses a second registration of the
  same endpoint for a driver; then ``NotifyRegistrationStatus(true, "")``. A socket
  whose GetInfo failed, or whose type or versions were refused, is tried again a
  second later (the plugin manager's reconciler, ``reconciler/reconciler.go``, retries
  every ``loopSleepDuration``: such a plugin never reached the actual state of the
  world); one refused for its endpoint is not (it did);
- preparing a pod (pkg/kubelet/cm/dra/manager.go ``prepareResources``): each of the
  pod's claims is read from the API server; it must list the pod in
  ``status.reservedFor``; its drivers are those of its allocation's results; the
  claims are sent per driver in one ``NodePrepareResources`` call (45 s deadline:
  ``defaultClientCallTimeout``); a claim's error, a missing answer or a call error
  fails the pod, and nothing is recorded; otherwise each container that uses a
  claim gets its prepared devices, which the PodResources service reports as
  ``dynamic_resources`` (``nodesim.podresources``);
- removing a pod unprepares the claims no other pod uses, with
  ``NodeUnprepareResources`` per driver.

A prepared claim is remembered by name (the kubelet's claim info cache), so a pod
sharing it is not prepared again, and a claim asked again after ``restart()`` is
(the kubelet asks the driver again for the claims of the pods it starts).
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
from kubernetes.client import ApiClient, ResourceV1Api

from gpunode.host.root import HostRoot
from kubeletapi import dra_pb2 as dra
from kubeletapi import dra_pb2_grpc as dra_grpc
from kubeletapi import pluginregistration_pb2 as reg
from kubeletapi import pluginregistration_pb2_grpc as reg_grpc
from nodesim.dial import dial
from nodesim.podresources import ClaimDevice, ClaimRecord, ContainerRecord, PodRecord

log = logging.getLogger(__name__)

PLUGINS_REGISTRY = "/var/lib/kubelet/plugins_registry"
DRA_PLUGIN_TYPE = "DRAPlugin"
# pkg/kubelet/cm/dra/plugin/dra_plugin.go servicesSupportedByKubelet, newest first.
KUBELET_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
SPOKEN = ("v1.DRAPlugin",)
CALL_TIMEOUT = 45.0  # defaultClientCallTimeout
GET_INFO_TIMEOUT = 1.0
NOTIFY_TIMEOUT = 5.0
RETRY = 1.0  # the plugin manager reconciler's loopSleepDuration


class PrepareError(Exception):
    """The kubelet would not start the pod: a claim could not be prepared."""


@dataclass(frozen=True)
class DraRegistration:
    driver: str
    endpoint: str  # as the driver named it (a host path)
    service: str  # the DRA service chosen from supported_versions
    socket: str  # the registration socket, a host path


@dataclass
class DraState:
    registrations: list[DraRegistration] = field(default_factory=list)
    # (registration socket, the error sent in NotifyRegistrationStatus)
    refusals: list[tuple[str, str]] = field(default_factory=list)
    deregistrations: list[str] = field(default_factory=list)  # driver names
    # driver -> NodePrepareResources / NodeUnprepareResources calls made
    prepare_calls: dict[str, int] = field(default_factory=dict)
    unprepare_calls: dict[str, int] = field(default_factory=dict)

    def current(self, driver: str) -> DraRegistration | None:
        gone = self.deregistrations.count(driver)
        mine = [r for r in self.registrations if r.driver == driver]
        return mine[-1] if len(mine) > gone else None


@dataclass
class _Prepared:
    uid: str
    namespace: str
    name: str
    devices: list[ClaimDevice]
    pods: set[str]  # pod UIDs using the claim


class DraKubelet:
    """The plugin watcher and DRA manager of a simulated kubelet (module doc).

    ``record_pod`` adds an admitted pod to the kubelet's records (PodResources
    answers from them); ``remove_pod`` takes one out.
    """

    def __init__(self, host_root: HostRoot, api: ApiClient,
                 record_pod: Callable[[PodRecord], None], remove_pod: Callable[[str, str], None],
                 *, poll: float = 0.05) -> None:
        self.host_root = host_root
        self.api = api
        self.registry = host_root.path(PLUGINS_REGISTRY)
        self.poll = poll
        self._record_pod = record_pod
        self._remove_pod = remove_pod
        self._cond = threading.Condition()
        self._state = DraState()
        self._sockets: dict[str, tuple[int, int]] = {}  # registry socket -> (inode, ctime)
        self._retry_at: dict[str, float] = {}  # registry socket -> when to try it again
        self._plugins: dict[str, tuple[DraRegistration, grpc.Channel]] = {}  # by socket
        self._prepared: dict[tuple[str, str], _Prepared] = {}  # (namespace, name) -> claim
        self._pods: dict[str, tuple[str, str, list[tuple[str, str]]]] = {}  # uid -> ns, name, claims
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------

    def start(self) -> None:
        self.registry.mkdir(parents=True, exist_ok=True)
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="kubelet-sim-pluginwatcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        with self._cond:
            plugins = list(self._plugins.values())
            self._plugins.clear()
            self._sockets.clear()
        for _, channel in plugins:
            channel.close()

    def restart(self) -> None:
        """A kubelet restart: registrations are made afresh from the sockets found, and
        the claim cache is lost (the driver is asked again for pods started again)."""
        self.stop()
        with self._cond:
            self._prepared.clear()
            self._pods.clear()
        self.start()

    @property
    def state(self) -> DraState:
        with self._cond:
            return DraState(list(self._state.registrations), list(self._state.refusals),
                            list(self._state.deregistrations), dict(self._state.prepare_calls),
                            dict(self._state.unprepare_calls))

    def wait_for(self, predicate: Callable[[DraState], bool], timeout: float = 5.0) -> DraState:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self._state):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"kubelet-sim DRA state never matched in {timeout} s: {self._state}")
                self._cond.wait(left)
            return self.state

    # -- the plugin watcher -------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                self._scan()
            except Exception:  # a bad socket must not end the watcher
                log.exception("kubelet-sim: plugin watcher scan failed")
            self._stop.wait(self.poll)

    def _scan(self) -> None:
        found: dict[str, tuple[int, int]] = {}
        for entry in os.scandir(self.registry):
            if entry.name.startswith("."):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISSOCK(st.st_mode):
                found[entry.path] = (st.st_ino, st.st_ctime_ns)
        for path in [p for p in self._sockets if p not in found or found[p] != self._sockets[p]]:
            self._deregister(path)
        for path, identity in found.items():
            if self._sockets.get(path) != identity and time.monotonic() >= self._retry_at.get(path, 0.0):
                self._sockets[path] = identity
                if not self._register(path):
                    del self._sockets[path]  # not in the actual state: tried again
                    self._retry_at[path] = time.monotonic() + RETRY
                else:
                    self._retry_at.pop(path, None)

    def _register(self, path: str) -> bool:
        """One registration; False when it is to be tried again."""
        host_socket = self.host_root.host_path(path)
        with dial(path) as channel:
            client = reg_grpc.RegistrationStub(channel)
            try:
                info = client.GetInfo(reg.InfoRequest(), timeout=GET_INFO_TIMEOUT)
            except grpc.RpcError as exc:
                log.info("kubelet-sim: GetInfo at %s failed: %s", path, exc.details())
                return False
            problem = self._validate(info, host_socket)
            if problem is None:
                endpoint = info.endpoint or host_socket
                service = next(s for s in info.supported_versions if s in KUBELET_SERVICES)
                registration = DraRegistration(info.name, endpoint, service, host_socket)
                # The kubelet dials the endpoint as named; here that is a path of the
                # simulated node (below its runtime root, when it has one).
                target = self.host_root.path(self.host_root.host_node(endpoint))
                with self._cond:
                    self._plugins[path] = (registration, dial(target))
                    self._state.registrations.append(registration)
                    self._cond.notify_all()
            try:
                client.NotifyRegistrationStatus(
                    reg.RegistrationStatus(plugin_registered=problem is None, error=problem or ""),
                    timeout=NOTIFY_TIMEOUT)
            except grpc.RpcError as exc:
                log.info("kubelet-sim: NotifyRegistrationStatus at %s failed: %s", path, exc.details())
        if problem is not None:
            with self._cond:
                self._state.refusals.append((host_socket, problem))
                self._cond.notify_all()
        return problem is None or "already registered" in problem

    def _validate(self, info: reg.PluginInfo, host_socket: str) -> str | None:
        if info.type != DRA_PLUGIN_TYPE:
            return (f"RegisterPlugin error -- no handler registered for plugin type: {info.type} "
                    f"at socket {host_socket}")
        endpoint = info.endpoint or host_socket
        prefix = ("RegisterPlugin error -- plugin validation failed with err: invalid supported gRPC "
                  f"versions of DRA driver plugin {info.name} at endpoint {endpoint}: ")
        versions = list(info.supported_versions)
        if not versions:
            return prefix + "empty list of supported gRPC services (aka supported versions)"
        chosen = next((s for s in versions if s in KUBELET_SERVICES), None)
        if chosen is None:
            return (prefix + f"none of services supported by the plugin ({versions}) are supported "
                    f"by the kubelet ({list(KUBELET_SERVICES)})")
        if chosen not in SPOKEN:
            return prefix + f"{chosen} is a service kubelet 1.35 speaks, but this simulator does not"
        with self._cond:
            taken = any(r.driver == info.name and r.endpoint == endpoint for r, _ in self._plugins.values())
        if taken:
            return ("RegisterPlugin error -- plugin registration failed with err: endpoint "
                    f"{endpoint} already registered for DRA driver plugin {info.name}")
        return None

    def _deregister(self, path: str) -> None:
        self._sockets.pop(path, None)
        with self._cond:
            plugin = self._plugins.pop(path, None)
            if plugin is not None:
                self._state.deregistrations.append(plugin[0].driver)
                self._cond.notify_all()
        if plugin is not None:
            plugin[1].close()

    def _stub(self, driver: str) -> dra_grpc.DRAPluginStub:
        with self._cond:
            # The newest registration of the driver (DRAPluginManager.get prefers a
            # connected one; every one here is).
            plugins = [c for r, c in self._plugins.values() if r.driver == driver]
        if not plugins:
            raise PrepareError(f"DRA driver {driver} is not registered")
        return dra_grpc.DRAPluginStub(plugins[-1])

    # -- pods -------------------------------------------------------------------

    def prepare_pod(self, namespace: str, name: str, uid: str,
                    containers: Mapping[str, Sequence[str]]) -> PodRecord:
        """Start a pod whose containers use ResourceClaims ``{container: [claim name]}``
        (the claims' names in the pod's namespace, as resourceclaim.Name resolves
        them): prepare what is not prepared yet, then record the pod."""
        names = list(dict.fromkeys(c for claims in containers.values() for c in claims))
        claims = {n: self._read(namespace, n, name, uid) for n in names}
        batches: dict[str, list[dra.Claim]] = {}
        for claim_name, claim in claims.items():
            if (namespace, claim_name) in self._prepared:
                continue
            meta = claim["metadata"]
            for driver in _drivers(claim):
                batches.setdefault(driver, []).append(
                    dra.Claim(namespace=namespace, uid=meta["uid"], name=claim_name))
        prepared: dict[str, list[ClaimDevice]] = {}
        for driver, batch in batches.items():
            stub = self._stub(driver)
            with self._cond:
                self._state.prepare_calls[driver] = self._state.prepare_calls.get(driver, 0) + 1
            try:
                answer = stub.NodePrepareResources(dra.NodePrepareResourcesRequest(claims=batch),
                                                   timeout=CALL_TIMEOUT)
            except grpc.RpcError as exc:
                raise PrepareError(f"NodePrepareResources: {exc.code().name}: {exc.details()}") from exc
            for claim_uid, result in answer.claims.items():
                asked = next((c for c in batch if c.uid == claim_uid), None)
                if asked is None:
                    raise PrepareError(f"NodePrepareResources returned result for unknown claim UID {claim_uid}")
                if result.error:
                    raise PrepareError(f"NodePrepareResources failed for ResourceClaim {asked.name}: {result.error}")
                prepared.setdefault(asked.name, []).extend(
                    ClaimDevice(driver, d.pool_name, d.device_name, tuple(d.cdi_device_ids),
                                d.share_id if d.HasField("share_id") else None)
                    for d in result.devices)
            if len(answer.claims) != len(batch):
                raise PrepareError(f"NodePrepareResources skipped {len(batch) - len(answer.claims)} ResourceClaims")
        with self._cond:
            for claim_name, devices in prepared.items():
                meta = claims[claim_name]["metadata"]
                self._prepared[(namespace, claim_name)] = _Prepared(meta["uid"], namespace, claim_name,
                                                                    devices, set())
            for claim_name in names:
                self._prepared[(namespace, claim_name)].pods.add(uid)
            self._pods[uid] = (namespace, name, [(namespace, c) for c in names])
            records = {c: ClaimRecord(namespace, c, list(self._prepared[(namespace, c)].devices))
                       for c in names}
        pod = PodRecord(namespace, name, [ContainerRecord(container, claims=[records[c] for c in used])
                                          for container, used in containers.items()])
        self._record_pod(pod)
        return pod

    def remove_pod(self, uid: str) -> None:
        """The pod is gone: unprepare each of its claims no other pod uses."""
        with self._cond:
            namespace, name, claims = self._pods.pop(uid)
            done = []
            for key in claims:
                claim = self._prepared[key]
                claim.pods.discard(uid)
                if not claim.pods:
                    done.append(claim)
        self._remove_pod(namespace, name)
        batches: dict[str, list[dra.Claim]] = {}
        for claim in done:
            for driver in dict.fromkeys(d.driver for d in claim.devices):
                batches.setdefault(driver, []).append(
                    dra.Claim(namespace=claim.namespace, uid=claim.uid, name=claim.name))
        for driver, batch in batches.items():
            self.unprepare(driver, batch)
        with self._cond:
            for claim in done:
                self._prepared.pop((claim.namespace, claim.name), None)

    def unprepare(self, driver: str, claims: Sequence[dra.Claim]) -> dra.NodeUnprepareResourcesResponse:
        with self._cond:
            self._state.unprepare_calls[driver] = self._state.unprepare_calls.get(driver, 0) + 1
        answer = self._stub(driver).NodeUnprepareResources(
            dra.NodeUnprepareResourcesRequest(claims=list(claims)), timeout=CALL_TIMEOUT)
        for claim in claims:
            result = answer.claims.get(claim.uid)
            if result is None:
                raise PrepareError(f"NodeUnprepareResources skipped ResourceClaim {claim.name}")
            if result.error:
                raise PrepareError(f"NodeUnprepareResources failed for ResourceClaim {claim.name}: {result.error}")
        return answer

    def call_prepare(self, driver: str, claims: Sequence[dra.Claim]) -> dra.NodePrepareResourcesResponse:
        """One raw NodePrepareResources call, as the kubelet makes it (for tests of the
        driver's answers to claims the kubelet itself would not send)."""
        return self._stub(driver).NodePrepareResources(
            dra.NodePrepareResourcesRequest(claims=list(claims)), timeout=CALL_TIMEOUT)

    def _read(self, namespace: str, name: str, pod_name: str, pod_uid: str) -> dict:
        try:
            response = ResourceV1Api(self.api).read_namespaced_resource_claim(
                name, namespace, _preload_content=False, _request_timeout=10)
        except Exception as exc:
            raise PrepareError(f"fetch ResourceClaim {name}: {exc}") from exc
        claim = json.loads(response.data)
        reserved = (claim.get("status") or {}).get("reservedFor") or []
        if not any(r.get("uid") == pod_uid for r in reserved):
            raise PrepareError(f"pod {pod_name} ({pod_uid}) is not allowed to use ResourceClaim {name} "
                               f"({claim['metadata'].get('uid')})")
        if not ((claim.get("status") or {}).get("allocation") or {}):
            raise PrepareError(f"ResourceClaim {name}: claim not allocated")
        return claim


def _drivers(claim: dict) -> list[str]:
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    return list(dict.fromkeys(r["driver"] for r in results))
