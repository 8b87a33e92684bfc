"""The prefix cache's block events, published to subscribers (``Worker.KvEvents``).

An engine with prefix caching stores and evicts blocks named by their chained
content hash (:mod:`fleet.prefix`). A router that hears of every change keeps
an exact index of what the instance holds (:class:`router.core.prefix.ExactPrefixIndex`)
instead of guessing from its own routing history. vLLM offers the same through
its ``SubscribeKvEvents`` stream (batches of ``BlockStored`` / ``BlockRemoved``
/ ``AllBlocksCleared`` with a sequence number); this is our engine's
equivalent, on our own ``Worker`` service.

Why a stream of its own from the worker, and not through the CMS: the CMS holds
each instance's *latest state* (one small status, size-bounded, pushed to every
router on every change, mirrored in Redis). Cache events are a high-rate log
(a batch per engine step) and the state they describe is the whole cache (tens
of thousands of hashes per instance); putting either into views would multiply
every view's size and every router's parsing by the fleet's cache size. A
direct server stream is one hop, and gRPC's flow control gives the backpressure:
a slow router stops reading, the worker's ``write`` waits, and the batches pile
up in that subscriber's buffer only.

Bounded memory and no stall of the engine:

- the engine's step loop hands each step's events to :meth:`KvEventHub.publish`,
  which never waits: it appends the batch to every subscriber's buffer;
- a buffer holds at most ``max_buffered_hashes`` hashes; past that it is dropped
  and the subscriber is marked for a *resync*: the next thing it is sent is a
  snapshot of the whole cache (``CLEARED`` then ``STORED`` of every block, in
  chunks of ``chunk_hashes``), taken when the writer is ready for it, so the
  memory is at most the bound plus one snapshot being written;
- every subscription starts with such a snapshot (a reconnecting router loses
  nothing it cannot rebuild), and at most ``max_subscribers`` are open at once.

Sequence numbers count batches (consecutive within a stream, shared by the
chunks of one snapshot), so a subscriber can check that it missed nothing.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from slorouter.v1 import worker_pb2

#: Default bound on the hashes one subscriber's buffer holds before it is resynchronised.
DEFAULT_MAX_BUFFERED_HASHES = 65536
#: Default bound on the subscribers of one worker (routers, tools).
DEFAULT_MAX_SUBSCRIBERS = 64
#: Hashes per snapshot chunk (8 bytes each on the wire: 512 KiB a message, far under the message limit).
DEFAULT_CHUNK_HASHES = 65536

_KINDS = {
    "stored": worker_pb2.KvEvent.STORED,
    "removed": worker_pb2.KvEvent.REMOVED,
    "cleared": worker_pb2.KvEvent.CLEARED,
}


class TooManySubscribersError(Exception):
    """The worker already serves ``max_subscribers`` event streams."""


def _event_message(kind: str, hashes: Sequence[int]) -> worker_pb2.KvEvent:
    try:
        proto_kind = _KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown KV event kind {kind!r}; use stored, removed or cleared") from None
    return worker_pb2.KvEvent(kind=proto_kind, block_hashes=hashes)


class Subscription:
    """One subscriber's buffer: batches not yet written, or a pending resync."""

    __slots__ = ("_batches", "_hashes", "_hub", "_wake", "resync", "resyncs")

    def __init__(self, hub: KvEventHub) -> None:
        self._hub = hub
        self._batches: deque[worker_pb2.KvEventBatch] = deque()
        self._hashes = 0
        self._wake = asyncio.Event()
        #: The next thing to send is a snapshot (set at the start and after an overflow).
        self.resync = True
        #: Snapshots sent after an overflow (for tests and logs).
        self.resyncs = 0

    @property
    def buffered_hashes(self) -> int:
        return self._hashes

    def _push(self, batch: worker_pb2.KvEventBatch, hashes: int) -> None:
        if self.resync:
            return  # the snapshot to come covers it
        if self._hashes + hashes > self._hub.max_buffered_hashes:
            self._batches.clear()
            self._hashes = 0
            self.resync = True
            self.resyncs += 1
        else:
            self._batches.append(batch)
            self._hashes += hashes
        self._wake.set()

    async def next(self) -> list[worker_pb2.KvEventBatch]:
        """The batches to write next (waits until there are some): a snapshot's chunks, or the deltas."""
        while not self.resync and not self._batches:
            self._wake.clear()
            await self._wake.wait()
        if self.resync:
            # Events the engine has not handed over yet first (while ``resync`` is set they are not
            # buffered here): they are in the snapshot's contents, and its number must count them.
            self._hub.flush()
            self.resync = False
            self._batches.clear()
            self._hashes = 0
            return self._hub.snapshot()
        out = list(self._batches)
        self._batches.clear()
        self._hashes = 0
        return out


class KvEventHub:
    """Fans an engine's cache events out to subscribers, each with a bounded buffer (module doc).

    ``contents()`` returns every block hash the cache holds now; ``flush()``
    (optional) hands the engine's not yet published events to :meth:`publish`
    first, so a snapshot and the sequence number it carries agree.
    """

    def __init__(
        self,
        block_tokens: int,
        contents: Callable[[], Iterable[int]],
        *,
        flush: Callable[[], None] | None = None,
        max_buffered_hashes: int = DEFAULT_MAX_BUFFERED_HASHES,
        max_subscribers: int = DEFAULT_MAX_SUBSCRIBERS,
        chunk_hashes: int = DEFAULT_CHUNK_HASHES,
    ) -> None:
        for name, value in (
            ("max_buffered_hashes", max_buffered_hashes),
            ("max_subscribers", max_subscribers),
            ("chunk_hashes", chunk_hashes),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if block_tokens < 0:
            raise ValueError(f"block_tokens must be >= 0, got {block_tokens}")
        self.block_tokens = block_tokens
        self.max_buffered_hashes = max_buffered_hashes
        self.max_subscribers = max_subscribers
        self.chunk_hashes = chunk_hashes
        self._contents = contents
        self._flush = flush
        self._subscribers: set[Subscription] = set()
        #: Number of the last batch published (0 before any).
        self.sequence_number = 0

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def subscribe(self) -> Subscription:
        """A new subscription; its first :meth:`Subscription.next` is a snapshot."""
        if len(self._subscribers) >= self.max_subscribers:
            raise TooManySubscribersError(
                f"this worker already serves {self.max_subscribers} KV event streams; close one first"
            )
        sub = Subscription(self)
        self._subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subscribers.discard(sub)

    def publish(self, events: Iterable[tuple[str, Sequence[int]]]) -> None:
        """One batch of ``(kind, hashes)`` events (one engine step's), oldest first. Never waits."""
        if not self._subscribers:
            self.sequence_number += 1  # nobody to tell: a subscriber starts from a snapshot anyway
            return
        messages = [_event_message(str(getattr(kind, "value", kind)), hashes) for kind, hashes in events]
        if not messages:
            return
        self.sequence_number += 1
        batch = worker_pb2.KvEventBatch(
            sequence_number=self.sequence_number, events=messages, block_tokens=self.block_tokens
        )
        size = max(sum(len(m.block_hashes) for m in messages), 1)
        for sub in self._subscribers:
            sub._push(batch, size)

    def flush(self) -> None:
        """Have the engine publish the events it has not handed over yet."""
        if self._flush is not None:
            self._flush()

    def snapshot(self) -> list[worker_pb2.KvEventBatch]:
        """The whole cache as batches numbered with the current sequence number (``CLEARED`` first);
        call :meth:`flush` first so the number counts every event the contents reflect."""
        hashes = list(self._contents())
        seq, bt, step = self.sequence_number, self.block_tokens, self.chunk_hashes
        out = [
            worker_pb2.KvEventBatch(
                sequence_number=seq,
                snapshot=True,
                block_tokens=bt,
                events=[worker_pb2.KvEvent(kind=worker_pb2.KvEvent.CLEARED)],
            )
        ]
        for i in range(0, len(hashes), step):
            stored = worker_pb2.KvEvent(kind=worker_pb2.KvEvent.STORED, block_hashes=hashes[i : i + step])
            if i == 0:
                out[0].events.append(stored)
            else:
                out.append(
                    worker_pb2.KvEventBatch(
                        sequence_number=seq, snapshot=True, block_tokens=bt, events=[stored]
                    )
                )
        return out
