"""The router-side reader: an always-available, immutable snapshot of the cluster.

:func:`open_reader` picks the source from a spec:

- ``memory``: an in-process store passed as ``store`` (the embedded cluster);
- ``grpc://host:port``: a CMS's ``WatchClusterView`` stream, reconnecting with
  capped exponential backoff and jitter when it breaks or goes silent;
- ``redis://host:port/db``: the Redis store read directly, for routers that
  scale out without a CMS process in the path.

Every reader hands out the last snapshot it has: :meth:`ClusterReader.snapshot`
never blocks and never fails. When the source is lost (a broken stream, a store
that does not answer) the snapshot stays, marked with
``ClusterSnapshot.source_lost_at_s``: its status ages stop growing at the time
of the last view, because the CMS's silence says nothing about the instances
(static stability; the router stops using an instance only on evidence from
its own calls). An instance that was already stale in the last view stays
stale. The reader recovers on its own.

When the source comes back it may know less than before (a restarted CMS with
the memory store, a Redis that lost its data) until the agents re-register.
For ``rewarm_s`` after a recovery, an instance of the last view that is
missing from the new one (or has no status yet) is carried over as it was,
so a CMS restart does not empty the fleet; once every instance is back, or
the time is up, the new view is used as it is.

A reader's snapshot ``version`` counts the snapshots it installed (1 for the
first); it is local to the reader, so it keeps growing across CMS restarts.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

import grpc
from slorouter.v1 import cms_pb2, cms_pb2_grpc

from cms import limits
from cms.auth import bearer
from cms.backoff import channel_options, retrying, strip_grpc_scheme
from cms.errors import StoreUnavailableError
from cms.store import CmsStore, StoreReader
from cms.tasks import cancel_and_wait
from cms.transport import ClientTls, message_size_options, open_channel
from cms.view import PumpUpdate, ViewAssembler, ViewPump, view_to_snapshot
from fleet.snapshot import EMPTY_SNAPSHOT, ClusterSnapshot

logger = logging.getLogger(__name__)


class ClusterReader(abc.ABC):
    """Follows one CMS source and holds the newest snapshot of it.

    ``start()`` returns at once (``await wait_for_version(1, t)`` waits for the
    first view); ``stop()`` is idempotent. ``connected`` tells whether the
    last attempt to reach the source succeeded.
    """

    def __init__(self, *, rewarm_s: float = 10.0) -> None:
        if not rewarm_s >= 0:
            raise ValueError(f"rewarm_s must be >= 0, got {rewarm_s}")
        self._snapshot = EMPTY_SNAPSHOT
        self._waiters: set[asyncio.Future[None]] = set()
        self._snapshot_listeners: list[Callable[[ClusterSnapshot], None]] = []
        self._listeners: list[Callable[[], None]] = []
        self.connected = False
        self._rewarm_s = rewarm_s
        #: After a recovery: the last view before the loss, and when carrying it over ends.
        self._rewarm: tuple[ClusterSnapshot, float] | None = None
        #: Times the source was lost (for metrics and tests).
        self.losses = 0

    def add_snapshot_listener(self, listener: Callable[[ClusterSnapshot], None]) -> None:
        """Call ``listener(snapshot)`` with every new snapshot, synchronously, as it is installed.

        Listeners must be quick and must not raise (the router's calibration reads step samples here).
        """
        self._snapshot_listeners.append(listener)

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (synchronously, on the event loop) after every new snapshot is installed
        and its waiters are woken (the router queue re-runs admission here)."""
        self._listeners.append(callback)

    def snapshot(self) -> ClusterSnapshot:
        """The newest snapshot (``EMPTY_SNAPSHOT`` before the first one)."""
        return self._snapshot

    @property
    def source_lost(self) -> bool:
        """Whether the snapshot handed out is the last view of a lost source (ages frozen)."""
        return self._snapshot.source_lost_at_s is not None

    def _lose(self) -> None:
        """The source is gone: keep the last view with its ages frozen (see the module docstring)."""
        self.connected = False
        current = self._snapshot
        if current.source_lost_at_s is None and current is not EMPTY_SNAPSHOT:
            self.losses += 1
            self._rewarm = None
            self._snapshot = dataclasses.replace(current, source_lost_at_s=current.taken_at_s)

    def _install(self, snapshot: ClusterSnapshot) -> None:
        previous = self._snapshot
        now = snapshot.taken_at_s
        if previous.source_lost_at_s is not None and self._rewarm is None and self._rewarm_s > 0:
            self._rewarm = (previous, now + self._rewarm_s)
        if self._rewarm is not None:
            snapshot = self._carry_over(snapshot, now)
        self._snapshot = dataclasses.replace(snapshot, version=previous.version + 1)
        self.connected = True
        for listener in self._snapshot_listeners:
            listener(self._snapshot)
        waiters, self._waiters = self._waiters, set()
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)
        for callback in self._listeners:
            callback()

    async def wait_for_version(self, min_version: int, timeout_s: float) -> bool:
        """Wait until ``snapshot().version >= min_version``; ``False`` on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._snapshot.version < min_version:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters.add(fut)
            try:
                await asyncio.wait({fut}, timeout=remaining)
            finally:
                self._waiters.discard(fut)
                fut.cancel()
        return True

    def _carry_over(self, fresh: ClusterSnapshot, now: float) -> ClusterSnapshot:
        """``fresh`` plus the instances of the pre-loss view it lacks, while re-warming."""
        assert self._rewarm is not None
        before, until = self._rewarm
        if now >= until:
            self._rewarm = None
            return fresh
        present = {r.instance_id: r for r in fresh.instances if r.status is not None}
        carried = [
            dataclasses.replace(r, status_age_s=before.age_s(r, now))
            for r in before.instances
            if r.status is not None and r.instance_id not in present
        ]
        if not carried:
            self._rewarm = None
            logger.info("cms reader: every instance is back in the view; re-warming done")
            return fresh
        carried_ids = {r.instance_id for r in carried}
        records = tuple(r for r in fresh.instances if r.instance_id not in carried_ids) + tuple(carried)
        # Carried statuses are as old as when the source was lost; hold every age still meanwhile.
        return dataclasses.replace(fresh, instances=records, source_lost_at_s=fresh.taken_at_s)

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def stop(self) -> None: ...

    async def __aenter__(self) -> ClusterReader:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


class StoreClusterReader(ClusterReader):
    """Reads a store directly (``memory`` and ``redis://``) through a :class:`ViewPump`."""

    def __init__(
        self,
        store: StoreReader,
        *,
        owned_store: CmsStore | None = None,
        min_interval_s: float = 0.02,
        refresh_s: float = 0.5,
        rewarm_s: float = 10.0,
    ) -> None:
        super().__init__(rewarm_s=rewarm_s)
        self._owned_store = owned_store
        self._pump = ViewPump(store, min_interval_s=min_interval_s, refresh_s=refresh_s, name="cms reader")
        self._pump.add_listener(self._on_update)
        self._stopped = False

    def _on_update(self, update: PumpUpdate) -> None:
        if isinstance(update, StoreUnavailableError):
            self._lose()  # keep the last snapshot, ages frozen
        else:
            self._install(update)

    async def start(self) -> None:
        if not self._stopped:
            await self._pump.start()

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        await self._pump.stop()
        if self._owned_store is not None:
            await self._owned_store.close()


class _StreamLost(Exception):
    """The watch stream could not be opened, or ended before any view arrived."""


class GrpcClusterReader(ClusterReader):
    """Follows a CMS's ``WatchClusterView`` stream.

    A stream that stays silent for ``idle_timeout_s`` (the CMS pushes at least
    once a second) is treated as broken and reopened.
    """

    def __init__(
        self,
        target: str,
        *,
        auth_token: str | None = None,
        backoff_max_s: float = 2.0,
        idle_timeout_s: float = 3.0,
        rewarm_s: float = 10.0,
        tls: ClientTls | None = None,
    ) -> None:
        super().__init__(rewarm_s=rewarm_s)
        if not idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be > 0, got {idle_timeout_s}")
        self.target = strip_grpc_scheme(target)
        self._call_metadata = bearer(auth_token)
        self._tls = tls
        self._backoff_max_s = backoff_max_s
        self._idle_timeout_s = idle_timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self._outage_logged = False
        self.streams_opened = 0

    async def start(self) -> None:
        if self._task is not None or self._stopped:
            return
        self._channel = open_channel(
            self.target,
            [
                *channel_options(self._backoff_max_s),
                *message_size_options(limits.VIEW_MAX_MESSAGE_BYTES, limits.CMS_MAX_RECEIVE_BYTES),
            ],
            tls=self._tls,
        )
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"cms-reader:{self.target}")

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close(None)

    async def _run(self) -> None:
        while True:
            try:
                async for attempt in retrying(backoff_max_s=self._backoff_max_s, retry_on=_StreamLost):
                    with attempt:
                        await self._follow()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not end the reader, nor spin
                logger.exception("cms reader %s: unexpected error; continuing", self.target)
                await asyncio.sleep(self._backoff_max_s)

    async def _follow(self) -> None:
        """Follow one stream; returns after it delivered views and then broke."""
        assert self._channel is not None
        stub = cms_pb2_grpc.ClusterMetadataStub(self._channel)
        call = stub.WatchClusterView(cms_pb2.GetClusterViewRequest(), metadata=self._call_metadata)
        self.streams_opened += 1
        assembler = ViewAssembler()
        received = 0
        reason = "the stream ended"
        try:
            while True:
                try:
                    view = await asyncio.wait_for(call.read(), self._idle_timeout_s)
                except TimeoutError:
                    reason = f"no view for {self._idle_timeout_s:.1f} s"
                    break
                if view is grpc.aio.EOF:  # type: ignore[attr-defined]
                    break
                assert isinstance(view, cms_pb2.ClusterView)
                whole = assembler.add(view)
                if whole is None:
                    continue  # a chunk: the view is complete with its last one
                self._install(view_to_snapshot(whole, taken_at_s=time.monotonic(), version=0))
                if self._outage_logged:
                    self._outage_logged = False
                    logger.info("cms reader %s: receiving views again", self.target)
                received += 1
        except grpc.aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        finally:
            call.cancel()
        self._lose()
        if not self._outage_logged:
            self._outage_logged = True
            if self._snapshot.version == 0:
                logger.warning(
                    "cms reader %s: no cluster view yet (%s); retrying until the CMS answers",
                    self.target,
                    reason,
                )
            else:
                logger.warning(
                    "cms reader %s: lost the view stream (%s); keeping the last view", self.target, reason
                )
        if received == 0:
            raise _StreamLost(reason)


def open_reader(
    spec: str,
    *,
    store: StoreReader | None = None,
    cluster_name: str = "default",
    auth_token: str | None = None,
    backoff_max_s: float = 2.0,
    rewarm_s: float = 10.0,
    tls: ClientTls | None = None,
) -> ClusterReader:
    """A reader for ``memory`` (with ``store``), ``grpc://host:port`` or ``redis://host:port/db``.

    ``cluster_name`` selects the Redis namespace; ``auth_token`` is sent to a
    gRPC CMS (which needs it once it has tokens), ``tls`` makes that channel
    TLS; ``rewarm_s`` is how long instances of the last view are carried over
    after the source comes back (see the module docstring). Call
    ``await reader.start()`` next.
    """
    if spec == "memory":
        if store is None:
            raise ValueError(
                "the 'memory' CMS reader needs the in-process store: open_reader('memory', store=...)"
            )
        return StoreClusterReader(store, rewarm_s=rewarm_s)
    if spec.startswith("grpc://"):
        return GrpcClusterReader(
            spec, auth_token=auth_token, backoff_max_s=backoff_max_s, rewarm_s=rewarm_s, tls=tls
        )
    if spec.startswith(("redis://", "rediss://", "unix://")):
        from cms.redis_store import RedisStore

        redis_store = RedisStore(spec, cluster_name=cluster_name)
        return StoreClusterReader(redis_store, owned_store=redis_store, rewarm_s=rewarm_s)
    raise ValueError(f"CMS spec {spec!r} is not 'memory', 'grpc://host:port' or 'redis://host:port/db'")
