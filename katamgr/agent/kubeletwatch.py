"""The offer gate's ears: the kubelet's device-plugin dir and the servers on its sockets, so
that the offer labels follow a kubelet or device plugin restart at once, not at the next check.

What the kubelet does (k8s.io/kubernetes v1.35.4, pkg/kubelet/cm/devicemanager):

- A kubelet starting serves its registration socket anew: ``plugin/v1beta1/server.go``
  ``Start`` first removes every file in /var/lib/kubelet/device-plugins but its checkpoint
  (``manager.go`` ``CleanupPluginDirectory``: each plugin's socket, and kubelet.sock), then
  listens on kubelet.sock again. Until a plugin registers again, the resources it read from
  its checkpoint have no healthy device (``readCheckpoint``). A kubelet that stops leaves its
  sockets behind; its PodResources socket answers no more.
- A plugin whose ListAndWatch stream ends (the plugin stopped, or its process died) has all
  its devices marked Unhealthy at once (``plugin/v1beta1/client.go`` ``Run`` ->
  ``manager.go`` ``PluginDisconnected``). A plugin killed leaves its socket behind too; the
  next one removes it and serves a new one.

So the gate hears: inotify on that dir (kubelet.sock or a plugin's socket made or removed),
and a connection held open to the kubelet's PodResources socket and to each of our plugins'
sockets (``grpcwire.client.HeldConnection``): a process that ends has its sockets closed by
the kernel, and the connection's other end reads end-of-file then, as the kubelet's stream
from the plugin ends. Either wakes the agent's loop, which asks the gate again
(``follow_offers``) at once and then every ``POLL`` s while the change is pending: until the
gate has stayed open ``SETTLE`` s, and at most ``PENDING`` s after the last thing heard.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from inotify_simple import flags as inflags

from gpunode.host.root import HostRoot
from gpunode.services.podresources import SOCKET_BELOW_KUBELET_DIR
from gpunode.services.watching import Watcher
from grpcwire.client import HeldConnection
from kubeletapi.deviceplugin_paths import DEVICE_PLUGIN_DIR, socket_name_for

log = logging.getLogger("katamgr.agent")

POLL = 0.25  # the gate asked again this often while a change is pending
SETTLE = 2.0  # open this long after the last thing heard: the change is over
PENDING = 30.0  # and at most this long after it (a plugin in CrashLoopBackOff: the checks go on)

# A socket made (bind), removed (unlink), or moved in or out.
_SOCKETS = inflags.CREATE | inflags.DELETE | inflags.MOVED_TO | inflags.MOVED_FROM


class Heard:
    """What a held connection says when its server closed it (an event of the loop's wait)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __repr__(self) -> str:
        return f"Heard({self.path!r})"


class KubeletWatch:
    """Inotify on the kubelet's device-plugin dir, held connections to the kubelet and to our
    plugins, and when to ask the offer gate again; ``start`` on the loop's ``Watcher``."""

    def __init__(self, host: HostRoot, resources: Callable[[], Iterable[str]], is_open: Callable[[], bool | None],
                 *, clock: Callable[[], float] = time.monotonic) -> None:
        self.host = host
        self.resources = resources  # the passthrough resources of the gate's last scan
        self.is_open = is_open  # the gate's last verdict
        self.clock = clock
        self.dir = host.path(DEVICE_PLUGIN_DIR)
        self.pod_resources = host.path(f"{host.kubelet_dir.rstrip('/')}/{SOCKET_BELOW_KUBELET_DIR}")
        self.watcher: Watcher | None = None
        self.wd: int | None = None
        self.held: dict[Path, HeldConnection] = {}
        self.heard_at: float | None = None  # None: nothing pending
        self.open_since: float | None = None
        self.next_look = 0.0

    def start(self, watcher: Watcher) -> None:
        self.watcher = watcher
        try:
            self.wd = watcher.add_watch(self.dir, _SOCKETS)
            log.info("watching %s for the kubelet's and the device plugins' sockets", DEVICE_PLUGIN_DIR)
        except OSError as exc:
            log.warning("cannot watch %s (%s); the offer gate follows the kubelet at each check only",
                        DEVICE_PLUGIN_DIR, exc.strerror)
        self.hold()

    def stop(self) -> None:
        for path in list(self.held):
            self._drop(path)

    # -- the held connections -------------------------------------------------------

    def targets(self) -> list[Path]:
        return [self.pod_resources, *(self.dir / socket_name_for(r) for r in sorted(self.resources()))]

    def hold(self) -> None:
        """Connect to each target not held yet (one nobody serves: not now)."""
        if self.watcher is None:
            return
        wanted = self.targets()
        for path in [p for p in self.held if p not in wanted]:
            self._drop(path)
        for path in wanted:
            if path in self.held or not path.exists():
                continue
            try:
                held = HeldConnection(str(path))
            except OSError:
                continue  # its server is gone or not yet there: inotify says when a new one is
            self.held[path] = held
            self.watcher.add_source(held.fileno(), lambda p=path: self._read(p))

    def _read(self, path: Path) -> list:
        held = self.held.get(path)
        if held is None or held.feed():
            return []
        self._drop(path)
        return [Heard(str(path))]

    def _drop(self, path: Path) -> None:
        held = self.held.pop(path)
        if self.watcher is not None:
            self.watcher.remove_source(held.fileno())
        held.close()

    # -- when to look -----------------------------------------------------------------

    def due(self) -> float | None:
        """When the gate is to be asked again (time.monotonic), or None: nothing pending."""
        return self.next_look if self.heard_at is not None else None

    def follow(self, events: list | None, follow_offers: Callable[[], object]) -> list | None:
        """After the loop's wait: on something heard, or a look due, ask the gate again
        (``follow_offers``); the events that are not this watch's."""
        if events is None:
            return None  # woken: a whole check follows, the gate's look with it
        mine = [e for e in events if self._mine(e)]
        rest = [e for e in events if not self._mine(e)]
        now = self.clock()
        if mine:
            if self.watcher is not None:  # a kubelet starting removes every socket: one look for all
                more = self.watcher.settle(0.02, 0.2)
                mine += [e for e in more if self._mine(e)]
                rest += [e for e in more if not self._mine(e)]
            if self.heard_at is None:
                log.info("the kubelet's device-plugin sockets changed (%s): following the offers every %g s",
                         _said(mine), POLL)
            self.heard_at = now
        elif self.heard_at is None or now < self.next_look:
            if self.heard_at is None:
                self.hold()  # one not there at the last look (a plugin that had not served yet)
            return rest
        self.hold()
        # Before the look: one that fails (a scan, the API) is tried again at the next POLL,
        # and the pending change ends PENDING s after the last thing heard all the same.
        self.next_look = now + POLL
        if now - self.heard_at >= PENDING:
            self.heard_at = self.open_since = None
        follow_offers()
        now = self.clock()
        if self.is_open():
            self.open_since = self.open_since if self.open_since is not None else now
        else:
            self.open_since = None
        if (self.heard_at is not None and self.open_since is not None
                and now - self.heard_at >= SETTLE and now - self.open_since >= SETTLE):
            self.heard_at = self.open_since = None
        return rest

    def _mine(self, event) -> bool:
        return isinstance(event, Heard) or (self.wd is not None and getattr(event, "wd", None) == self.wd)


def _said(events: list) -> str:
    names = []
    for e in events:
        name = Path(e.path).name if isinstance(e, Heard) else e.name
        said = f"{name} ended" if isinstance(e, Heard) else f"{name} {'made' if e.mask & _MADE else 'removed'}"
        if said not in names:
            names.append(said)
    return ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")


_MADE = inflags.CREATE | inflags.MOVED_TO
