"""The exact prefix index over the wire: sim workers publish their cache's block events
(``Worker.KvEvents``), the router's feed (:mod:`router.kv_events`) follows them.

Real gRPC servers on 127.0.0.1 port 0, real sim engines; the truth the index is held to is
the engine's own cache (``SimCore.cached_block_hashes``).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from slorouter.v1 import worker_pb2

from fleet.prefix import lookup_block_hashes, token_block_hashes
from fleet.snapshot import ClusterSnapshot, InstanceRecord
from router.core.prefix import AutoPrefixIndex, ExactPrefixIndex
from router.kv_events import KvEventFeed
from router.pool import ChannelPool
from tests.workers.helpers import drain, make_engine, sampling, wait_for
from workers.kv_events import KvEventHub
from workers.service import WorkerServer, start_worker_server

BLOCK = 16


def view(*workers: WorkerServer) -> ClusterSnapshot:
    return ClusterSnapshot(
        instances=tuple(InstanceRecord(metadata=w.metadata, status=None, status_age_s=0.0) for w in workers),
        taken_at_s=time.monotonic(),
        version=1,
    )


async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait (bounded) until ``predicate()`` holds."""
    await wait_for(predicate, timeout_s, interval_s=0.005)


def truth(worker: WorkerServer) -> frozenset[int]:
    cached: frozenset[int] = worker.engine.core.cached_block_hashes()  # type: ignore[attr-defined]
    return cached


async def start(**overrides: object) -> WorkerServer:
    cfg: dict[str, object] = {
        "prefix_cache_block_tokens": BLOCK,
        "block_size": BLOCK,
        "kv_capacity_tokens": 2048,
        "max_model_len": 1024,
    }
    cfg.update(overrides)
    listen = str(cfg.pop("listen", "127.0.0.1:0"))
    return await start_worker_server(make_engine(**cfg), listen)


def family_prompt(family: int, turn: int, length: int) -> tuple[int, ...]:
    """A prompt of ``length`` tokens whose first 64 tokens are shared by its family."""
    head = tuple((family * 37 + i) % 240 + 1 for i in range(64))
    tail = tuple((family * 91 + turn * 13 + i) % 240 + 1 for i in range(max(length - 64, 0)))
    return (head + tail)[:length]


async def run_workload(worker: WorkerServer, seed: int, n: int, concurrency: int) -> None:
    rng = random.Random(seed)
    engine = worker.engine
    sem = asyncio.Semaphore(concurrency)

    async def one(k: int) -> None:
        async with sem:
            p = family_prompt(rng.randrange(4), rng.randrange(6), rng.randrange(20, 400))
            await drain(engine.generate(f"r{seed}-{k}", p, sampling(rng.randrange(1, 12))))

    await asyncio.gather(*(one(k) for k in range(n)))


async def index_matches_engine(seed: int, n: int, concurrency: int, routing: str) -> None:
    worker = await start()
    pool = ChannelPool()
    index: ExactPrefixIndex | AutoPrefixIndex = (
        ExactPrefixIndex(BLOCK) if routing == "exact" else AutoPrefixIndex(BLOCK)
    )
    exact = index if isinstance(index, ExactPrefixIndex) else index.exact
    feed = KvEventFeed(index, pool)
    try:
        feed.on_snapshot(view(worker))
        await until(lambda: worker.instance_id in feed.live)
        await run_workload(worker, seed, n, concurrency)
        # KV of 2,048 tokens against prompts up to 400: the workload evicted (REMOVED events went out).
        await until(lambda: exact.blocks_of(worker.instance_id) == truth(worker))
        assert feed.counters.gaps == 0
        # The index answers lookups as the engine's cache would.
        for family in range(4):
            hashes = token_block_hashes(family_prompt(family, 0, 256), BLOCK)
            held = 0
            while held < len(hashes) and hashes[held] in truth(worker):
                held += 1
            assert index.matched_blocks(hashes).get(worker.instance_id, 0) == held
    finally:
        await feed.stop()
        await pool.close()
        await worker.stop(0)


@settings(max_examples=6, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(1, 40),
    concurrency=st.integers(1, 8),
    routing=st.sampled_from(["exact", "auto"]),
)
def test_the_index_holds_exactly_what_the_engine_caches_after_a_workload(
    seed: int, n: int, concurrency: int, routing: str
) -> None:
    asyncio.run(index_matches_engine(seed, n, concurrency, routing))


async def test_a_missing_batch_makes_the_feed_resubscribe_and_resync() -> None:
    worker = await start()
    pool = ChannelPool()
    index = ExactPrefixIndex(BLOCK)
    feed = KvEventFeed(index, pool)
    try:
        feed.on_snapshot(view(worker))
        await until(lambda: worker.instance_id in feed.live)
        await run_workload(worker, 1, 10, 4)
        await until(lambda: index.blocks_of(worker.instance_id) == truth(worker))
        # A batch lost on the way: the publisher's numbering jumps.
        hub = worker.engine.kv_events  # type: ignore[attr-defined]
        hub.sequence_number += 3
        index.add(worker.instance_id, [12345])  # a block the engine does not hold: only a resync removes it
        await run_workload(worker, 2, 10, 4)
        await until(lambda: feed.counters.gaps >= 1)
        await until(lambda: index.blocks_of(worker.instance_id) == truth(worker))
        assert feed.counters.snapshots >= 2
    finally:
        await feed.stop()
        await pool.close()
        await worker.stop(0)


async def test_a_worker_restarted_on_its_address_is_followed_from_its_new_snapshot() -> None:
    worker = await start()
    address = worker.address
    pool = ChannelPool()
    index = ExactPrefixIndex(BLOCK)
    feed = KvEventFeed(index, pool, retry_min_s=0.02, retry_max_s=0.1)
    second: WorkerServer | None = None
    try:
        feed.on_snapshot(view(worker))
        await until(lambda: worker.instance_id in feed.live)
        await run_workload(worker, 3, 12, 4)
        await until(lambda: bool(truth(worker)) and index.blocks_of(worker.instance_id) == truth(worker))
        old = truth(worker)
        await worker.stop(0)
        await until(lambda: worker.instance_id not in feed.live)
        second = await start(listen=address)
        await run_workload(second, 4, 3, 1)
        # Same instance id in the view (the feed follows the address); the index now holds the new
        # engine's cache, nothing of the old one's.
        await until(lambda: index.blocks_of(worker.instance_id) == truth(second))
        assert not (old - truth(second)) & index.blocks_of(worker.instance_id)
        assert feed.counters.reconnects >= 1
    finally:
        await feed.stop()
        await pool.close()
        if second is not None:
            await second.stop(0)
        await worker.stop(0)


async def test_an_instance_that_leaves_is_dropped_and_a_silent_one_goes_stale() -> None:
    a, b = await start(), await start()
    pool = ChannelPool()
    index = ExactPrefixIndex(BLOCK)
    feed = KvEventFeed(index, pool, retry_min_s=0.02, retry_max_s=0.05, stale_s=0.2)
    try:
        feed.on_snapshot(view(a, b))
        await until(lambda: feed.live == {a.instance_id, b.instance_id})
        await run_workload(a, 5, 8, 4)
        await run_workload(b, 6, 8, 4)
        await until(lambda: bool(index.blocks_of(a.instance_id)) and bool(index.blocks_of(b.instance_id)))
        # a leaves the view: its subscription ends and nothing of it is kept.
        feed.on_snapshot(view(b))
        assert a.instance_id not in index.instances()
        assert a.instance_id not in feed.subscribed
        # b goes silent (its server stops, the view still lists it): exact keeps its entries for
        # stale_s, then clears them.
        await b.stop(0)
        await until(lambda: feed.counters.stale_clears >= 1, timeout_s=5.0)
        assert index.blocks_of(b.instance_id) == frozenset()
    finally:
        await feed.stop()
        await pool.close()
        await a.stop(0)
        await b.stop(0)


async def test_auto_falls_back_to_the_routing_history_while_a_stream_is_down() -> None:
    worker = await start()
    pool = ChannelPool()
    index = AutoPrefixIndex(BLOCK)
    feed = KvEventFeed(index, pool, retry_min_s=0.02, retry_max_s=0.05)
    try:
        feed.on_snapshot(view(worker))
        await until(lambda: worker.instance_id in feed.live)
        p = family_prompt(0, 0, 200)
        hashes = token_block_hashes(p, BLOCK)
        index.dispatched(worker.instance_id, hashes, 2048.0)  # the history learns every dispatch
        await drain(worker.engine.generate("x", p, sampling(2)))
        await until(lambda: index.matched_blocks(hashes).get(worker.instance_id) == len(hashes))
        await worker.stop(0)
        await until(lambda: not index.is_live(worker.instance_id))
        assert index.exact.blocks_of(worker.instance_id) == frozenset()
        assert index.matched_blocks(hashes).get(worker.instance_id) == len(hashes)  # from the history
    finally:
        await feed.stop()
        await pool.close()
        await worker.stop(0)


@pytest.mark.parametrize(
    ("overrides", "why"),
    [({"prefix_cache_block_tokens": 0}, "no cache"), ({"prefix_cache_block_tokens": 32}, "other block")],
)
async def test_a_worker_without_usable_events_is_left_to_the_approximate_index(
    overrides: dict[str, int], why: str
) -> None:
    worker = await start(**overrides)
    pool = ChannelPool()
    feed = KvEventFeed(AutoPrefixIndex(BLOCK), pool, resync_view_s=0.0)
    try:
        feed.on_snapshot(view(worker))
        await until(lambda: worker.instance_id not in feed.subscribed)
        assert worker.instance_id not in feed.live, why
        feed.on_snapshot(view(worker))  # not asked again at the same address
        assert worker.instance_id not in feed.subscribed
    finally:
        await feed.stop()
        await pool.close()
        await worker.stop(0)


async def test_memory_is_bounded_in_the_index_and_in_the_publishers_buffer() -> None:
    worker = await start(kv_capacity_tokens=8192)
    hub: KvEventHub = worker.engine.kv_events  # type: ignore[attr-defined]
    hub.max_buffered_hashes = 8
    pool = ChannelPool()
    index = ExactPrefixIndex(BLOCK, max_blocks_per_instance=10)
    feed = KvEventFeed(index, pool)
    try:
        feed.on_snapshot(view(worker))
        await until(lambda: worker.instance_id in feed.live)
        (sub,) = hub._subscribers
        # A burst the writer cannot keep up with (published in one turn of the loop).
        for k in range(50):
            hub.publish([("stored", [10_000 + 2 * k, 10_001 + 2 * k])])
            assert sub.buffered_hashes <= hub.max_buffered_hashes
        await run_workload(worker, 7, 30, 8)
        await until(lambda: sub.resyncs >= 1)
        assert len(index.blocks_of(worker.instance_id)) <= 10
        assert index.num_entries <= 10
        assert len(truth(worker)) > 10  # the engine holds more than the index may keep
        # What the index keeps is what the engine holds (the bound drops, never invents).
        await until(lambda: index.blocks_of(worker.instance_id) <= truth(worker) | set(range(10_000, 10_100)))
    finally:
        await feed.stop()
        await pool.close()
        await worker.stop(0)


def test_the_hub_resyncs_a_subscriber_that_overflows_and_numbers_batches_in_order() -> None:
    async def scenario() -> None:
        contents: set[int] = set()
        hub = KvEventHub(BLOCK, lambda: sorted(contents), max_buffered_hashes=4, chunk_hashes=3)
        sub = hub.subscribe()
        contents.update({1, 2, 3, 4})
        first = await sub.next()
        assert [b.snapshot for b in first] == [True, True]  # 4 hashes in chunks of 3
        assert first[0].events[0].kind == worker_pb2.KvEvent.CLEARED
        assert sorted(h for b in first for e in b.events for h in e.block_hashes) == [1, 2, 3, 4]
        hub.publish([("stored", [5])])
        hub.publish([("removed", [1])])
        deltas = await sub.next()
        assert [b.sequence_number for b in deltas] == [
            first[0].sequence_number + 1,
            first[0].sequence_number + 2,
        ]
        for k in range(3):
            hub.publish([("stored", [10 + k, 20 + k])])
        assert sub.resyncs == 1 and sub.buffered_hashes == 0
        contents.clear()
        contents.update({7})
        again = await sub.next()
        assert again[0].snapshot and list(again[0].events[1].block_hashes) == [7]

    asyncio.run(scenario())


async def test_with_a_worker_token_the_events_need_it() -> None:
    worker = await start_worker_server(
        make_engine(prefix_cache_block_tokens=BLOCK, block_size=BLOCK), "127.0.0.1:0", worker_token="s3cret"
    )
    bare, authed = ChannelPool(), ChannelPool(call_token="s3cret")
    refused = ExactPrefixIndex(BLOCK)
    index = ExactPrefixIndex(BLOCK)
    feeds = [KvEventFeed(refused, bare, retry_min_s=0.02, retry_max_s=0.05), KvEventFeed(index, authed)]
    try:
        stub = bare.stub(worker.address)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.KvEvents(worker_pb2.KvEventsRequest()):
                pass
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for feed in feeds:
            feed.on_snapshot(view(worker))
        await until(lambda: worker.instance_id in feeds[1].live)
        await until(lambda: feeds[0].counters.reconnects >= 2)
        assert worker.instance_id not in feeds[0].live
    finally:
        for feed in feeds:
            await feed.stop()
        await bare.close()
        await authed.close()
        await worker.stop(0)


@settings(max_examples=50, deadline=None)
@given(n=st.integers(0, 700), stride=st.sampled_from([1, 2, 4, 16]))
def test_lookup_hashes_are_the_engines_own_names_for_each_lookup_prefix(n: int, stride: int) -> None:
    ids = family_prompt(1, 2, n)
    fine = token_block_hashes(ids, BLOCK)
    coarse = lookup_block_hashes(ids, BLOCK, BLOCK * stride)
    assert coarse == fine[stride - 1 :: stride]
    assert len(coarse) == n // (BLOCK * stride)


async def test_a_swap_in_the_view_is_followed_within_the_view_resync_bound() -> None:
    a, b = await start(), await start()
    pool = ChannelPool()
    index = ExactPrefixIndex(BLOCK)
    feed = KvEventFeed(index, pool, resync_view_s=0.1)
    try:
        feed.on_snapshot(view(a))
        await until(lambda: a.instance_id in feed.live)
        feed.on_snapshot(view(b))  # same size, within the bound: not looked at yet
        assert feed.subscribed == {a.instance_id}
        await asyncio.sleep(0.15)
        feed.on_snapshot(view(b))
        assert feed.subscribed == {b.instance_id}
        await until(lambda: b.instance_id in feed.live)
    finally:
        await feed.stop()
        await pool.close()
        await a.stop(0)
        await b.stop(0)
