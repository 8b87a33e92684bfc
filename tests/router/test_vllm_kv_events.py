"""A stock vLLM engine's KV events in the router's exact prefix index (router.vllm_grpc, router.kv_events).

vLLM names blocks by its own hash and publishes each stored block's token ids and its parent's
hash on ``SubscribeKvEvents``; the router re-hashes them into its chain hashes. The engine here is
a real gRPC server of vLLM's ``VllmEngine`` service on 127.0.0.1 port 0 whose ``SubscribeKvEvents``
streams the events of a small block cache with vLLM's naming (a hash of its own, parents before
children, evictions leaf first). The truth the index is held to is that cache's contents, named the
router's way (``fleet.prefix.token_block_hashes``). The real engine's stream is in
``tests/workers/test_vllm_grpc_kv_events.py``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from slorouter.v1 import cms_pb2
from smg_grpc_proto.generated import common_pb2 as smg_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_pb2_grpc

from fleet.prefix import token_block_hashes
from fleet.snapshot import ClusterSnapshot, InstanceRecord
from router.core.prefix import ExactPrefixIndex
from router.kv_events import KvEventFeed
from router.pool import ChannelPool
from router.vllm_grpc import KvEventGap, KvEventTranslator, follow_kv_events
from tests.workers.helpers import wait_for
from tests.workers.vllm_support import Entries

BLOCK = 4


class BlockCache:
    """Full blocks of prompts under vLLM-style names (not the router's), LRU-evicted leaf first."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        #: vLLM hash -> (parent vLLM hash or None, tokens); insertion/use order for the LRU.
        self.blocks: OrderedDict[int, tuple[int | None, tuple[int, ...]]] = OrderedDict()

    @staticmethod
    def name(parent: int | None, tokens: tuple[int, ...]) -> int:
        return hash(("vllm", parent, tokens)) & ((1 << 63) - 1)

    def store(self, prompt: tuple[int, ...]) -> list[smg_pb2.KvCacheEvent]:
        """Cache ``prompt``'s full blocks; the events: removals to make room, then the stores."""
        events: list[smg_pb2.KvCacheEvent] = []
        parent: int | None = None
        new: list[tuple[int, tuple[int, ...]]] = []
        first_parent: int | None = None
        chain: set[int] = set()
        for j in range(len(prompt) // BLOCK):
            tokens = prompt[j * BLOCK : (j + 1) * BLOCK]
            h = self.name(parent, tokens)
            chain.add(h)
            if h in self.blocks:
                self.blocks.move_to_end(h)
            else:
                if not new:
                    first_parent = parent
                new.append((h, tokens))
            parent = h
        while len(self.blocks) + len(new) > self.capacity:
            parents = {p for p, _ in self.blocks.values()}
            victim = next((h for h in self.blocks if h not in parents and h not in chain), None)
            if victim is None:
                break
            del self.blocks[victim]
            events.append(smg_pb2.KvCacheEvent(removed=smg_pb2.KvBlocksRemoved(block_hashes=[victim])))
        if new and len(self.blocks) + len(new) <= self.capacity:
            previous = first_parent
            for h, tokens in new:
                self.blocks[h] = (previous, tokens)
                previous = h
            stored = smg_pb2.KvBlocksStored(
                blocks=[smg_pb2.KvBlock(block_hash=h, token_ids=t, block_size=BLOCK) for h, t in new]
            )
            if first_parent is not None:
                stored.parent_block_hash = first_parent
            events.append(smg_pb2.KvCacheEvent(stored=stored))
        return events

    def ours(self) -> frozenset[int]:
        """What the cache holds, in the router's names."""
        out = set()
        for h in self.blocks:
            chain = []
            at: int | None = h
            while at is not None:
                parent, tokens = self.blocks[at]
                chain.append(tokens)
                at = parent
            prompt = tuple(t for tokens in reversed(chain) for t in tokens)
            out.add(token_block_hashes(prompt, BLOCK)[-1])
        return frozenset(out)


class FakeVllm(vllm_pb2_grpc.VllmEngineServicer):  # type: ignore[misc]
    """vLLM's service with only ``SubscribeKvEvents``: the batches put in ``outbox``, as they come."""

    def __init__(self) -> None:
        self.subscribers: list[asyncio.Queue[smg_pb2.KvEventBatch | None]] = []
        self.subscriptions = 0

    async def SubscribeKvEvents(self, request: Any, context: Any) -> AsyncIterator[smg_pb2.KvEventBatch]:
        queue: asyncio.Queue[smg_pb2.KvEventBatch | None] = asyncio.Queue(maxsize=10_000)
        self.subscribers.append(queue)
        self.subscriptions += 1
        try:
            while (batch := await queue.get()) is not None:
                yield batch
        finally:
            self.subscribers.remove(queue)

    def publish(self, batch: smg_pb2.KvEventBatch) -> None:
        for queue in self.subscribers:
            queue.put_nowait(batch)


async def serve() -> tuple[grpc.aio.Server, FakeVllm, str]:
    server = grpc.aio.server()
    fake = FakeVllm()
    vllm_pb2_grpc.add_VllmEngineServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, fake, f"127.0.0.1:{port}"


def view(instance_id: str, address: str) -> ClusterSnapshot:
    meta = cms_pb2.InstanceMetadata(instance_id=instance_id, endpoint=address, worker_protocol="vllm-grpc")
    return ClusterSnapshot(
        instances=(InstanceRecord(metadata=meta, status=None, status_age_s=0.0),),
        taken_at_s=time.monotonic(),
        version=1,
    )


async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    await wait_for(predicate, timeout_s, interval_s=0.005)


def prompt_of(rng: random.Random) -> tuple[int, ...]:
    family = rng.randrange(4)
    head = tuple((family * 31 + i) % 50 + 1 for i in range(8))
    tail = tuple(rng.randrange(1, 6) for _ in range(rng.randrange(0, 14)))
    return head + tail


def test_translator_names_blocks_as_the_router_hashes_prompts() -> None:
    cache = BlockCache(100)
    translator = KvEventTranslator(BLOCK)
    index = ExactPrefixIndex(BLOCK)
    prompt = tuple(range(1, 15))  # 3 full blocks and 2 tokens
    index.apply("v0", translator.events(smg_pb2.KvEventBatch(events=cache.store(prompt[:8]))))
    index.apply("v0", translator.events(smg_pb2.KvEventBatch(events=cache.store(prompt))))  # child of block 2
    assert index.blocks_of("v0") == frozenset(token_block_hashes(prompt, BLOCK)) == cache.ours()
    assert index.matched_blocks(token_block_hashes((*prompt, 9, 9), BLOCK)) == {"v0": 3}


def test_blocks_the_router_cannot_name_are_skipped_with_their_children() -> None:
    translator = KvEventTranslator(BLOCK)
    unknown_parent = smg_pb2.KvBlocksStored(
        blocks=[smg_pb2.KvBlock(block_hash=7, token_ids=[1, 2, 3, 4])], parent_block_hash=99
    )
    salted = smg_pb2.KvBlocksStored(
        blocks=[
            smg_pb2.KvBlock(
                block_hash=8, token_ids=[1, 2, 3, 4], extra_keys=[smg_pb2.KvBlockExtraKey(text="s")]
            ),
            smg_pb2.KvBlock(block_hash=9, token_ids=[5, 6, 7, 8]),
        ]
    )
    other_size = smg_pb2.KvBlocksStored(blocks=[smg_pb2.KvBlock(block_hash=10, token_ids=[1, 2, 3])])
    batch = smg_pb2.KvEventBatch(
        events=[smg_pb2.KvCacheEvent(stored=s) for s in (unknown_parent, salted, other_size)]
    )
    assert translator.events(batch) == []
    assert translator.skipped == 4
    assert len(translator) == 0
    # A removal of a block never named is dropped too.
    removed = smg_pb2.KvCacheEvent(removed=smg_pb2.KvBlocksRemoved(block_hashes=[7, 8]))
    assert translator.events(smg_pb2.KvEventBatch(events=[removed])) == []


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 100_000), n=st.integers(1, 60), capacity=st.integers(2, 12))
def test_the_index_holds_what_the_cache_holds_after_stores_and_evictions(
    seed: int, n: int, capacity: int
) -> None:
    rng = random.Random(seed)
    cache = BlockCache(capacity)
    translator = KvEventTranslator(BLOCK)
    index = ExactPrefixIndex(BLOCK)
    for _ in range(n):
        events = cache.store(prompt_of(rng))
        index.apply("v0", translator.events(smg_pb2.KvEventBatch(events=events)))
        assert index.blocks_of("v0") == cache.ours()
    assert len(translator) == len(cache.blocks)


async def _feed_follows_a_fake_engine() -> None:
    server, fake, address = await serve()
    entries = Entries()
    index = ExactPrefixIndex(BLOCK)
    feed = KvEventFeed(index, ChannelPool(), vllm=entries, retry_min_s=0.01, retry_max_s=0.05)
    cache = BlockCache(10)
    rng = random.Random(5)
    seq = 0

    def publish(events: list[smg_pb2.KvCacheEvent], *, skip: int = 0) -> None:
        nonlocal seq
        seq += 1 + skip
        fake.publish(smg_pb2.KvEventBatch(sequence_number=seq, events=events))

    try:
        feed.on_snapshot(view("v0", address))
        await until(lambda: fake.subscriptions == 1 and len(fake.subscribers) == 1)
        # A load-only batch carries no events and repeats the last number: not a gap.
        fake.publish(smg_pb2.KvEventBatch(sequence_number=0, load=smg_pb2.EngineLoad(load_only=True)))
        for _ in range(20):
            publish(cache.store(prompt_of(rng)))
        await until(lambda: index.blocks_of("v0") == cache.ours() and "v0" in feed.live)
        assert feed.counters.gaps == 0
        # A lost batch: the feed resubscribes and starts from nothing (this engine sends no snapshot).
        publish(cache.store(prompt_of(rng)), skip=1)
        await until(
            lambda: feed.counters.gaps == 1 and fake.subscriptions == 2 and len(fake.subscribers) == 1
        )
        await until(lambda: index.blocks_of("v0") == frozenset())
        cache = BlockCache(10)
        publish([smg_pb2.KvCacheEvent(cleared=smg_pb2.KvCacheCleared())])
        for _ in range(10):
            publish(cache.store(prompt_of(rng)))
        await until(lambda: index.blocks_of("v0") == cache.ours())
        # The instance leaves the view: its subscription ends and the index forgets it.
        feed.on_snapshot(
            ClusterSnapshot(instances=(), taken_at_s=time.monotonic() + 1, version=2)  # count changed
        )
        await until(lambda: not fake.subscribers)
        assert index.blocks_of("v0") == frozenset()
    finally:
        await feed.stop()
        await entries.close()
        await server.stop(0)


def test_the_feed_follows_a_vllm_engine_resubscribes_on_a_gap_and_forgets_one_that_left() -> None:
    asyncio.run(_feed_follows_a_fake_engine())


async def _gap_raises() -> None:
    server, fake, address = await serve()
    channel = grpc.aio.insecure_channel(address)
    applied: list[Any] = []
    try:
        task = asyncio.create_task(
            follow_kv_events(vllm_pb2_grpc.VllmEngineStub(channel), applied.extend, KvEventTranslator(BLOCK))
        )
        await until(lambda: len(fake.subscribers) == 1)
        fake.publish(smg_pb2.KvEventBatch(sequence_number=5))
        fake.publish(smg_pb2.KvEventBatch(sequence_number=6))
        fake.publish(smg_pb2.KvEventBatch(sequence_number=8))
        with pytest.raises(KvEventGap):
            await asyncio.wait_for(task, 10)
        assert applied == [("cleared", [])]  # a subscription starts by clearing the instance
    finally:
        await channel.close(None)
        await server.stop(0)


def test_a_missing_batch_ends_the_stream_with_a_gap() -> None:
    asyncio.run(_gap_raises())
