"""The router's side of ``Worker.KvEvents``: one subscription per instance, feeding the prefix index.

For every instance in the cluster view that speaks this project's Worker
protocol, a task subscribes to the worker's prefix-cache events
(:mod:`workers.kv_events`) and applies them to the scheduler's exact index
(``--prefix-cache-routing exact``, or ``auto``'s exact part). The worker starts
every stream with a snapshot of its whole cache, so a (re)connect always ends
in the engine's true contents; after it, batches must come numbered one after
the other, and a jump (a batch lost on the way) makes the task resubscribe for
a fresh snapshot.

- An instance that leaves the view (deregistered, lease lapsed) is dropped:
  its task ends and the index forgets it. While the CMS itself is lost the view
  is the last one known, and nothing is dropped on its account.
- A worker whose engine publishes nothing (``UNIMPLEMENTED``, a vLLM engine in
  process) or caches nothing (``block_tokens`` 0), or whose cache block differs
  from the block the router chains prompt hashes in (``--prefix-chain-block-tokens``,
  default ``--prefix-block-tokens``: its hashes would never match a prompt's), is left to the approximate index (``auto``) and not asked again
  until it registers anew.
- A broken stream is retried with backoff. Under ``auto`` the instance falls
  back to the routing history at once; under ``exact`` its entries are kept for
  ``stale_s`` (the engine keeps most of its cache across a short blip) and then
  cleared, so a silent instance does not keep attracting prompts it may no
  longer hold.

Memory: the index bounds itself (per instance LRU, ``--prefix-index-max-blocks``);
the stream holds at most one batch being applied; gRPC's flow control stops the
worker writing while the router is behind, and the worker's bounded buffer then
turns into a snapshot (:mod:`workers.kv_events`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Protocol

import grpc
from slorouter.v1 import worker_pb2

from fleet.snapshot import ClusterSnapshot
from router.core.prefix import AutoPrefixIndex, ExactPrefixIndex
from router.core.protocols import VLLM_GRPC, VLLM_GRPC_SCHEME
from router.vllm_grpc import KvEventGap, KvEventTranslator, follow_kv_events

logger = logging.getLogger(__name__)

_KINDS = {
    worker_pb2.KvEvent.STORED: "stored",
    worker_pb2.KvEvent.REMOVED: "removed",
    worker_pb2.KvEvent.CLEARED: "cleared",
}
#: Protocols whose endpoint serves ``Worker.KvEvents`` ("" is the Worker service too).
_WORKER_PROTOCOLS = frozenset({"", "worker"})


class _Stubs(Protocol):
    def stub(self, endpoint: str) -> object: ...


class _VllmEntries(Protocol):
    def entry(self, endpoint: str) -> tuple[object, object]: ...


@dataclass
class FeedCounters:
    """What the feed did (tests, logs)."""

    snapshots: int = 0
    batches: int = 0
    gaps: int = 0
    reconnects: int = 0
    stale_clears: int = 0


class _Gap(Exception):
    pass


class KvEventFeed:
    """Subscribes to every publishing instance in the view and feeds ``index`` (module doc)."""

    def __init__(
        self,
        index: ExactPrefixIndex | AutoPrefixIndex,
        pool: _Stubs,
        *,
        retry_min_s: float = 0.05,
        retry_max_s: float = 2.0,
        stale_s: float = 10.0,
        resync_view_s: float = 0.5,
        vllm: _VllmEntries | None = None,
    ) -> None:
        if not 0 < retry_min_s <= retry_max_s:
            raise ValueError(f"need 0 < retry_min_s <= retry_max_s, got {retry_min_s}, {retry_max_s}")
        if stale_s < 0:
            raise ValueError(f"stale_s must be >= 0, got {stale_s}")
        self.index = index
        self._pool = pool
        #: The client of stock vLLM engines (``vllm-grpc`` instances): their ``SubscribeKvEvents``
        #: is followed through it and re-hashed (router.vllm_grpc.KvEventTranslator); None: not followed.
        self._vllm = vllm
        self._retry_min_s = retry_min_s
        self._retry_max_s = retry_max_s
        self._stale_s = stale_s
        self._resync_view_s = resync_view_s
        self._view_count = -1
        self._view_at_s = 0.0
        self._tasks: dict[str, tuple[str, asyncio.Task[None]]] = {}  # instance -> (endpoint, task)
        #: Instances that publish nothing usable, by endpoint (not asked again at that endpoint).
        self._silent: dict[str, str] = {}
        self._live: set[str] = set()
        #: Since when each instance's stream is down (monotonic s), and those cleared for it.
        self._down_since: dict[str, float] = {}
        self._stale: set[str] = set()
        self._announced: set[str] = set()
        self.counters = FeedCounters()
        self._stopped = False

    # ------------------------------------------------------------------ the view

    def on_snapshot(self, snapshot: ClusterSnapshot) -> None:
        """Follow the view: subscribe to new instances, drop those that left (a reader listener).

        A pass over the view costs a few milliseconds at 4,096 instances and views come on every
        status change, so while the number of instances stays the same it runs at most every
        ``resync_view_s`` (the CMS sends a view at least every second, so a swap of one instance
        for another is seen within about that).
        """
        if self._stopped:
            return
        now_s = asyncio.get_running_loop().time()
        count = len(snapshot.instances)
        if count == self._view_count and now_s - self._view_at_s < self._resync_view_s:
            return
        self._view_count, self._view_at_s = count, now_s
        now: dict[str, str] = {}
        for record in snapshot.instances:
            meta = record.metadata
            if meta.worker_protocol in _WORKER_PROTOCOLS and meta.endpoint:
                now[meta.instance_id] = meta.endpoint
            elif meta.worker_protocol == VLLM_GRPC and meta.endpoint and self._vllm is not None:
                now[meta.instance_id] = VLLM_GRPC_SCHEME + meta.endpoint
        if snapshot.source_lost_at_s is None:
            for instance_id in [i for i in self._tasks if i not in now]:
                self._drop(instance_id)
            for instance_id in [i for i in self._silent if i not in now]:
                del self._silent[instance_id]
        for instance_id, endpoint in now.items():
            current = self._tasks.get(instance_id)
            if current is not None and current[0] == endpoint:
                continue
            if self._silent.get(instance_id) == endpoint:
                continue
            if current is not None:
                self._drop(instance_id)  # re-registered at another endpoint: a new engine
            task = asyncio.get_running_loop().create_task(
                self._follow(instance_id, endpoint), name=f"kv-events-{instance_id}"
            )
            self._tasks[instance_id] = (endpoint, task)

    def _drop(self, instance_id: str) -> None:
        entry = self._tasks.pop(instance_id, None)
        if entry is not None:
            entry[1].cancel()
        self._live.discard(instance_id)
        self._down_since.pop(instance_id, None)
        self._stale.discard(instance_id)
        self._announced.discard(instance_id)
        self.index.forget(instance_id)

    @property
    def subscribed(self) -> frozenset[str]:
        """Instances with a subscription task (up or retrying)."""
        return frozenset(self._tasks)

    @property
    def live(self) -> frozenset[str]:
        """Instances whose stream is up and in sync."""
        return frozenset(self._live)

    async def stop(self) -> None:
        self._stopped = True
        tasks = [t for _, t in self._tasks.values()]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ one instance

    def _set_live(self, instance_id: str, live: bool) -> None:
        if live:
            self._live.add(instance_id)
        else:
            self._live.discard(instance_id)
        self.index.set_live(instance_id, live)

    async def _follow(self, instance_id: str, endpoint: str) -> None:
        loop = asyncio.get_running_loop()
        delay = self._retry_min_s
        first = True
        while True:
            if not first:
                self.counters.reconnects += 1
            first = False
            try:
                if endpoint.startswith(VLLM_GRPC_SCHEME):
                    await self._read_vllm(instance_id, endpoint)
                elif await self._read(instance_id, endpoint):
                    return  # publishes nothing usable
            except (_Gap, KvEventGap):
                self.counters.gaps += 1
                logger.info("KV events of %s: a batch went missing; resubscribing", instance_id)
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                    self._give_up(instance_id, endpoint, "its engine publishes no prefix-cache events")
                    return
                logger.debug("KV events of %s: %s; retrying in %.2f s", instance_id, exc.code(), delay)
            if instance_id in self._live:
                delay = self._retry_min_s  # it was in sync: a fresh break, retry soon
            self._set_live(instance_id, False)
            now = loop.time()
            down_since = self._down_since.setdefault(instance_id, now)
            if now - down_since >= self._stale_s and instance_id not in self._stale:
                # Heard nothing for stale_s: what the index holds of it may be long gone.
                self.index.clear(instance_id)
                self.counters.stale_clears += 1
                self._stale.add(instance_id)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._retry_max_s)

    async def _read(self, instance_id: str, endpoint: str) -> bool:
        """Follow one stream until it ends; True when the instance publishes nothing usable."""
        stub = self._pool.stub(endpoint)
        call = stub.KvEvents(worker_pb2.KvEventsRequest())  # type: ignore[attr-defined]
        index = self.index
        last: int | None = None
        try:
            async for batch in call:
                if not batch.block_tokens:
                    self._give_up(instance_id, endpoint, "it has no prefix cache")
                    return True
                if batch.block_tokens != index.chain_block_tokens:
                    self._give_up(
                        instance_id,
                        endpoint,
                        f"its cache block is {batch.block_tokens} tokens and the router chains prompt hashes "
                        f"in {index.chain_block_tokens} (--prefix-chain-block-tokens, or --prefix-block-tokens "
                        "without it)",
                    )
                    return True
                seq = batch.sequence_number
                if batch.snapshot:
                    if batch.events and batch.events[0].kind == worker_pb2.KvEvent.CLEARED:
                        self.counters.snapshots += 1
                    elif last != seq:
                        raise _Gap  # a snapshot's later chunk without its start
                elif last is None or seq != last + 1:
                    raise _Gap
                last = seq
                events = []
                for e in batch.events:
                    kind = _KINDS.get(e.kind)
                    if kind is None:
                        raise _Gap  # an event kind this router does not know: start over from a snapshot
                    events.append((kind, e.block_hashes))
                index.apply(instance_id, events)
                self.counters.batches += 1
                if instance_id not in self._live:
                    self._following(instance_id, f"its KV events ({batch.block_tokens}-token blocks)")
        finally:
            call.cancel()
        return False

    async def _read_vllm(self, instance_id: str, endpoint: str) -> None:
        """Follow a stock vLLM engine's ``SubscribeKvEvents`` until the stream ends (router.vllm_grpc)."""
        assert self._vllm is not None
        index = self.index
        translator = KvEventTranslator(index.chain_block_tokens)

        def apply(events: list[tuple[str, list[int]]]) -> None:
            index.apply(instance_id, events)
            self.counters.batches += 1

        def synced() -> None:
            self._following(
                instance_id, f"its vLLM KV events (re-hashed in {index.chain_block_tokens}-token blocks)"
            )

        _, stub = self._vllm.entry(endpoint)
        await follow_kv_events(stub, apply, translator, synced)

    def _following(self, instance_id: str, source: str) -> None:
        """``instance_id``'s events are in the index from now on: it is live, neither down nor stale.

        ``source`` names what is followed, logged once per instance (a resubscribe stays quiet).
        """
        if instance_id not in self._announced:
            self._announced.add(instance_id)
            logger.info("exact prefix index for %s: following %s", instance_id, source)
        self._set_live(instance_id, True)
        self._down_since.pop(instance_id, None)
        self._stale.discard(instance_id)

    def _give_up(self, instance_id: str, endpoint: str, why: str) -> None:
        logger.info("no exact prefix index for %s (%s): %s", instance_id, endpoint, why)
        self._silent[instance_id] = endpoint
        self._tasks.pop(instance_id, None)
        self._set_live(instance_id, False)
