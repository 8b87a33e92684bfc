"""A live router fed its sim workers' KV events (``Worker.KvEvents``) routes on their true caches."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from router.core.prefix import AutoPrefixIndex, ExactPrefixIndex
from tests.router.e2e.cluster import collect, embedded_cluster, prefix_family_request
from tests.workers.helpers import wait_for


async def until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait (bounded) until ``predicate()`` holds."""
    await wait_for(predicate, timeout_s, interval_s=0.01)


@pytest.mark.parametrize(("routing", "lookup_block"), [("exact", 16), ("auto", 16), ("auto", 128)])
async def test_the_router_follows_every_workers_cache_and_routes_prefixes_to_it(
    routing: str, lookup_block: int
) -> None:
    """The workers cache 16-token blocks; the router chains prompt hashes in 16 and looks them up
    in 16 or 128 (every 8th hash: the engine's own name for each 128-token prefix)."""
    async with embedded_cluster(
        neutral=3,
        engine_overrides={"prefix_cache_block_tokens": 16},
        scheduler_overrides={
            "prefix_cache_routing": routing,
            "prefix_block_tokens": lookup_block,
            "prefix_chain_block_tokens": 16,
        },
    ) as cluster:
        feed = cluster.router.kv_feed
        assert feed is not None
        await until(lambda: feed.live == set(cluster.engines))
        prefix_index = cluster.router.scheduler.prefix
        exact = prefix_index if isinstance(prefix_index, ExactPrefixIndex) else None
        if isinstance(prefix_index, AutoPrefixIndex):
            exact = prefix_index.exact
        assert exact is not None
        where: dict[int, set[str]] = {0: set(), 1: set(), 2: set()}
        for k in range(9):
            family, request = prefix_family_request(k)
            result = await collect(cluster.stub, request)
            where[family].add(result.first.route.prefill_instance_id)
        assert all(len(instances) == 1 for instances in where.values()), where
        hits = sum(e.load().prefix_cache_hit_tokens for e in cluster.engines.values())
        assert hits == 6 * 512
        # The router's index holds what each engine holds, no more, no less.
        index = exact

        def mirrored() -> bool:
            return all(index.blocks_of(i) == e.core.cached_block_hashes() for i, e in cluster.engines.items())

        await until(mirrored)
        # A worker that leaves: the router drops what it knew of its cache.
        gone = next(iter(where[0]))
        await cluster.kill_worker(gone)
        await until(lambda: gone not in exact.instances(), timeout_s=15.0)
