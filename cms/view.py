"""Moving views around: proto conversions, a latest-wins slot, and the view pump.

The :class:`ViewPump` is the one loop that follows a store: it reads the view
when the store says it changed (at most once per ``min_interval_s``, so a
burst of writes costs one read) and at least every ``refresh_s`` even without
change (fresh ages, and lease expiries that no write announces). It hands each
snapshot to its listeners; a listener that feeds a slow consumer puts it into
a :class:`LatestSlot`, so the consumer skips to the newest view and nothing
queues up behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from slorouter.v1 import cms_pb2

from cms.errors import StoreUnavailableError
from cms.store import StoreReader
from cms.tasks import cancel_and_wait
from fleet.snapshot import ClusterSnapshot, InstanceRecord

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: What a pump hands its listeners: a fresh snapshot, or the store failure that prevented one.
PumpUpdate = ClusterSnapshot | StoreUnavailableError


def snapshot_to_view(
    snapshot: ClusterSnapshot, *, now_s: float, generated_at_ms: int, model: str = ""
) -> cms_pb2.ClusterView:
    """The wire form of ``snapshot`` as of ``now_s`` (same clock as ``snapshot.taken_at_s``).

    Ages are advanced to ``now_s``; ``model``, when set, keeps only instances serving it.
    """
    view = cms_pb2.ClusterView(version=snapshot.version, generated_at_ms=generated_at_ms)
    for record in snapshot.instances:
        if model and record.metadata.model != model:
            continue
        state = view.instances.add()
        state.metadata.CopyFrom(record.metadata)
        if record.status is not None:
            state.status.CopyFrom(record.status)
            state.has_status = True
            state.status_age_ms = math.floor(snapshot.age_s(record, now_s) * 1000)
    return view


def chunk_view(view: cms_pb2.ClusterView, chunk_bytes: int) -> list[cms_pb2.ClusterView]:
    """``view`` as one message, or cut into chunks of about ``chunk_bytes`` each.

    Chunks share ``version`` and ``generated_at_ms`` and carry
    ``chunk_index``/``chunk_count``; instances keep their order. One instance
    is never split (the limits keep it far below ``chunk_bytes``).
    """
    if view.ByteSize() <= chunk_bytes:
        return [view]
    chunks: list[cms_pb2.ClusterView] = []
    current = cms_pb2.ClusterView(version=view.version, generated_at_ms=view.generated_at_ms)
    size = 0
    for state in view.instances:
        state_size = state.ByteSize() + 6  # the field tag and length prefix
        if size and size + state_size > chunk_bytes:
            chunks.append(current)
            current = cms_pb2.ClusterView(version=view.version, generated_at_ms=view.generated_at_ms)
            size = 0
        current.instances.append(state)
        size += state_size
    chunks.append(current)
    for i, chunk in enumerate(chunks):
        chunk.chunk_index = i
        chunk.chunk_count = len(chunks)
    return chunks


class ViewAssembler:
    """Puts chunked views back together on the reader side.

    :meth:`add` returns the whole view once its last chunk arrived (a view
    sent in one message is returned at once), else None. A chunk that does
    not continue the view being assembled (another version, a gap) drops
    what was gathered; the next complete view replaces it.
    """

    def __init__(self, max_chunks: int = 4096) -> None:
        self._max_chunks = max_chunks
        self._parts: list[cms_pb2.ClusterView] = []

    def add(self, chunk: cms_pb2.ClusterView) -> cms_pb2.ClusterView | None:
        if chunk.chunk_count <= 1:
            self._parts.clear()
            return chunk
        if chunk.chunk_count > self._max_chunks or chunk.chunk_index >= chunk.chunk_count:
            self._parts.clear()
            return None
        if chunk.chunk_index == 0:
            self._parts = [chunk]
        elif (
            not self._parts
            or chunk.chunk_index != len(self._parts)
            or chunk.version != self._parts[0].version
            or chunk.generated_at_ms != self._parts[0].generated_at_ms
            or chunk.chunk_count != self._parts[0].chunk_count
        ):
            self._parts.clear()
            return None
        else:
            self._parts.append(chunk)
        if len(self._parts) < chunk.chunk_count:
            return None
        whole = cms_pb2.ClusterView(version=chunk.version, generated_at_ms=chunk.generated_at_ms)
        for part in self._parts:
            whole.instances.extend(part.instances)
        self._parts = []
        return whole


def view_to_snapshot(view: cms_pb2.ClusterView, *, taken_at_s: float, version: int) -> ClusterSnapshot:
    """A snapshot of a received ``view``; the view must not be mutated afterwards."""
    return ClusterSnapshot(
        instances=tuple(
            InstanceRecord(
                metadata=state.metadata,
                status=state.status if state.has_status else None,
                status_age_s=state.status_age_ms / 1000.0 if state.has_status else 0.0,
            )
            for state in view.instances
        ),
        taken_at_s=taken_at_s,
        version=version,
    )


class LatestSlot(Generic[T]):
    """A one-item mailbox: ``put`` replaces what is there, ``get`` waits for an item.

    Memory stays at one item however slow the consumer is.
    """

    def __init__(self) -> None:
        self._item: T | None = None
        self._full = False
        self._event = asyncio.Event()
        self.overwritten = 0

    def put(self, item: T) -> None:
        if self._full:
            self.overwritten += 1
        self._item = item
        self._full = True
        self._event.set()

    async def get(self) -> T:
        while not self._full:
            self._event.clear()
            await self._event.wait()
        item = self._item
        self._item = None
        self._full = False
        return item  # type: ignore[return-value]


class ViewPump:
    """Background loop that follows one store and publishes its snapshots.

    ``start()`` returns at once; ``stop()`` is idempotent. Listeners are
    plain callables run on the loop; they must be quick (put into a slot).
    A store failure is published as :class:`StoreUnavailableError` and retried
    every ``refresh_s``; ``latest`` keeps the last good snapshot.
    """

    def __init__(
        self,
        store: StoreReader,
        *,
        min_interval_s: float = 0.02,
        refresh_s: float = 0.5,
        name: str = "cms view pump",
    ) -> None:
        if not min_interval_s >= 0:
            raise ValueError(f"min_interval_s must be >= 0, got {min_interval_s}")
        if not refresh_s > 0:
            raise ValueError(f"refresh_s must be > 0, got {refresh_s}")
        self._store = store
        self._min_interval_s = min_interval_s
        self._refresh_s = refresh_s
        self._name = name
        self._listeners: list[Callable[[PumpUpdate], None]] = []
        self._task: asyncio.Task[None] | None = None
        self.latest: ClusterSnapshot | None = None
        self.error: StoreUnavailableError | None = None
        self.reads = 0

    def add_listener(self, listener: Callable[[PumpUpdate], None]) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[PumpUpdate], None]) -> None:
        with contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self._name)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)

    def _emit(self, update: PumpUpdate) -> None:
        for listener in list(self._listeners):
            try:
                listener(update)
            except Exception:
                logger.exception("%s: a listener failed", self._name)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        last_read = -math.inf
        while True:
            delay = last_read + self._min_interval_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            last_read = loop.time()
            try:
                snapshot = await self._store.read_view()
            except Exception as exc:
                error = exc if isinstance(exc, StoreUnavailableError) else StoreUnavailableError(str(exc))
                if self.error is None:
                    if isinstance(exc, StoreUnavailableError):
                        logger.warning("%s: store unavailable, keeping the last view: %s", self._name, exc)
                    else:
                        logger.exception("%s: reading the view failed", self._name)
                self.error = error
                self._emit(error)
                await asyncio.sleep(self._refresh_s)
                continue
            self.reads += 1
            if self.error is not None:
                logger.info("%s: store available again", self._name)
            self.error = None
            self.latest = snapshot
            self._emit(snapshot)
            remaining = last_read + self._refresh_s - loop.time()
            if remaining > 0:
                await self._store.wait_changed(snapshot.version, remaining)


def epoch_ms(clock: Callable[[], float] = time.time) -> int:
    return int(clock() * 1000)
