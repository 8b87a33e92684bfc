"""The prefix index's fast lookup and dispatch give exactly what the step-by-step code gave.

:mod:`tests.router.core.prefix_reference` is the index before its lookup was done in depth groups
and numpy, and its LRU updates in C loops. Both are driven through the same random traffic (both
index kinds and ``auto``; instances coming, going and being evicted past ``max_instances``; chains
and arbitrary hash lists, duplicates included) and must agree on every answer a decision reads
(matches per instance, the cached-token column on a view, the best case) and on their contents, in
LRU order, after every step.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import router.core.prefix as fast
import tests.router.core.prefix_reference as ref
from fleet.prefix import id_block_hashes

BLOCK = 16


def index_pair(kind: str, other: str, bounds: dict[str, int]) -> tuple[Any, Any]:
    """The fast index of ``kind`` (``approximate``, ``exact``, else the class named ``other``) and the
    step-by-step reference one, with the same bounds."""
    name = {"approximate": "ApproximatePrefixIndex", "exact": "ExactPrefixIndex"}.get(kind, other)
    return getattr(fast, name)(BLOCK, **bounds), getattr(ref, name)(BLOCK, **bounds)


# A step: (kind, instance, hashes, capacity in blocks, private tokens).
_STEP = st.tuples(
    st.sampled_from(
        [*["dispatched", "stored"] * 4, "removed", "cleared", "live", "down", "forget", "retain"]
    ),
    st.integers(0, 5),
    st.one_of(
        st.lists(st.integers(0, 6), max_size=9),  # arbitrary hash lists (gaps, duplicates)
        st.tuples(st.integers(0, 3), st.integers(0, 9)).map(
            lambda fc: list(id_block_hashes([fc[0] * 100 + j for j in range(fc[1])], 10**6, 1))
        ),  # chains of a few prompt families, as a router sees them
    ),
    st.integers(0, 8),
    st.integers(0, 4 * BLOCK),
)


def _queries(data: st.DataObject) -> list[list[int]]:
    free = data.draw(st.lists(st.lists(st.integers(0, 12), max_size=10), min_size=1, max_size=3))
    family, depth = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 10))
    chain = list(id_block_hashes([family * 100 + j for j in range(depth)], 10**6, 1))
    return [*free, chain]


def _state(index: Any) -> Any:
    """Contents in LRU order per instance, the holder bitsets by instance, pending blocks."""
    if isinstance(index, (fast.AutoPrefixIndex, ref.AutoPrefixIndex)):
        return (_state(index.exact), _state(index.approximate), sorted(index._live))
    blocks = {i: _lru(index, i) for i in index._slot}
    holders = {
        h: sorted(index._ids[s] for s in range(len(index._ids)) if bits >> s & 1)
        for h, bits in index._holders.items()
    }
    pending = None
    if hasattr(index, "_pending"):
        pending = {index._ids[s]: list(p) for s, p in index._pending.items() if p}
    return list(index._slot), blocks, holders, pending


def _lru(index: Any, instance_id: str) -> list[int]:
    """An instance's hashes, least recently used first (the reference keeps them in that order)."""
    if isinstance(index, fast.BlockIndex):
        return index.lru_order(instance_id)
    return list(index._blocks[index._slot[instance_id]])


def _step(index: Any, kind: str, who: str, hashes: list[int], cap: int, private: int, exact: bool) -> None:
    if kind == "dispatched":
        index.dispatched(who, hashes, float(cap * BLOCK) if cap else float("inf"), private)
    elif kind in ("stored", "removed", "cleared") and exact:
        index.apply(who, [(kind, hashes)])
    elif kind in ("live", "down") and hasattr(index, "set_live"):
        index.set_live(who, kind == "live")
    elif kind == "forget":
        index.forget(who)
    elif kind == "retain" and hasattr(index, "retain"):
        index.retain([f"i{k}" for k in range(0, 6, 2)])


def _agree(new: Any, old: Any, view: tuple[str, ...], queries: list[list[int]]) -> None:
    assert _state(new) == _state(old)
    positions = {i: k for k, i in enumerate(view)}
    for q in queries:
        found = new.matched_blocks(q)
        assert list(found.items()) == list(old.matched_blocks(q).items())
        for prompt in (len(q) * BLOCK, len(q) * BLOCK + 5, max(len(q) * BLOCK - 20, 0), 1):
            got = fast.cached_tokens_column(new, view, positions, q, prompt)
            want = ref.cached_tokens_column(old, view, positions, q, prompt)
            assert got.dtype == want.dtype and np.array_equal(got, want)
            assert fast.best_cached_tokens(new, q, prompt) == ref.best_cached_tokens(old, q, prompt)
        laid = new.matched_column(q, view)
        assert laid.tolist() == [found.get(i, 0) for i in view]


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(["approximate", "exact", "auto"]),
    steps=st.lists(_STEP, min_size=4, max_size=40),
    max_instances=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_fast_lookup_and_dispatch_equal_the_step_by_step_index(
    kind: str,
    steps: list[tuple[str, int, list[int], int, int]],
    max_instances: int,
    seed: int,
    data: st.DataObject,
) -> None:
    bounds = {"max_instances": max_instances, "max_blocks_per_instance": 7}
    new, old = index_pair(kind, "AutoPrefixIndex", bounds)
    # One view tuple kept across the steps (as a router's layout is while the fleet stands), in a
    # shuffled order and with an instance the index never hears of: slots change under it.
    names = [f"i{k}" for k in range(6)] + ["ghost"]
    random.Random(seed).shuffle(names)
    view = tuple(names)
    queries = _queries(data)
    for kind_, who, hashes, cap, private in steps:
        for index in (new, old):
            _step(index, kind_, f"i{who}", hashes, cap, private, kind != "approximate")
        _agree(new, old, view, queries)
    _agree(new, old, tuple(reversed(view)), queries)  # a new view object: its slots are read afresh


def test_a_lookup_holding_many_depths_lays_each_instance_at_its_own_depth() -> None:
    """Hand-checked: 300 instances (a bitset wider than a machine word), depths 0 to 4."""
    index = fast.ApproximatePrefixIndex(BLOCK)
    chain = list(id_block_hashes(list(range(4)), 10**6, 1))
    ids = tuple(f"n{k}" for k in range(300))
    for k, name in enumerate(ids):
        index.dispatched(name, chain[: k % 5], float("inf"))
    positions = {i: k for k, i in enumerate(ids)}
    column = fast.cached_tokens_column(index, ids, positions, chain, 4 * BLOCK + 1)
    assert column.tolist() == [float((k % 5) * BLOCK) for k in range(300)]
    # The engine computes at least the last prompt token: a fully cached prompt is charged one token.
    column = fast.cached_tokens_column(index, ids, positions, chain, 4 * BLOCK)
    assert column.tolist() == [float(min(k % 5 * BLOCK, 4 * BLOCK - 1)) for k in range(300)]
    assert fast.best_cached_tokens(index, chain, 10 * BLOCK) == 4 * BLOCK


def test_a_dispatch_refreshes_held_blocks_in_the_order_given_around_new_ones() -> None:
    """LRU order by hand: the hashes of one call become the most recent in the order given, held
    ones (moved) and new ones (inserted) alike."""
    for index in (fast.BlockIndex(BLOCK), ref.BlockIndex(BLOCK)):
        index.add("a", [1, 2, 3])
        index.add("a", [2, 9, 1])  # held, new, held
        assert _lru(index, "a") == [3, 2, 9, 1]
        index.add("a", [7, 8, 3])  # new ones leading, then a held one
        assert _lru(index, "a") == [2, 9, 1, 7, 8, 3]
        index.add("a", [5, 5, 2])  # a new one twice
        assert _lru(index, "a") == [9, 1, 7, 8, 3, 5, 2]
        index.add("a", [6, 4, 6], limit=4)  # the last mention counts; the oldest go past the limit
        assert _lru(index, "a") == [5, 2, 4, 6]


@settings(max_examples=200, deadline=None)
@given(
    adds=st.lists(
        st.tuples(st.integers(0, 2), st.lists(st.integers(0, 5), max_size=6), st.integers(1, 8)), max_size=25
    )
)
def test_lru_order_after_adds_equals_the_step_by_step_index(adds: list[tuple[int, list[int], int]]) -> None:
    new, old = fast.BlockIndex(BLOCK), ref.BlockIndex(BLOCK)
    for who, hashes, limit in adds:
        for index in (new, old):
            index.add(f"i{who}", hashes, limit=limit)
        assert _state(new) == _state(old)


def test_auto_column_follows_instances_going_live_and_down_on_one_view() -> None:
    """``auto`` on a view kept across calls: an instance going live answers from the exact index at
    once (nothing heard yet: no match), going down falls back to the routing history."""
    chain = list(id_block_hashes([1, 2, 3], 10**6, 1))
    view = ("a", "b")
    positions = {"a": 0, "b": 1}
    new, old = fast.AutoPrefixIndex(BLOCK), ref.AutoPrefixIndex(BLOCK)
    steps: list[tuple[str, bool | None]] = [("a", None), ("a", True), ("b", True), ("a", False), ("b", False)]
    for who, live in steps:
        for index in (new, old):
            if live is None:
                index.dispatched(who, chain, float("inf"))
                index.dispatched("b", chain[:2], float("inf"))
            else:
                index.set_live(who, live)
        got = fast.cached_tokens_column(new, view, positions, chain, 10 * BLOCK)
        assert got.tolist() == ref.cached_tokens_column(old, view, positions, chain, 10 * BLOCK).tolist()
    assert got.tolist() == [3.0 * BLOCK, 2.0 * BLOCK]
    new.set_live("a", True)
    assert fast.cached_tokens_column(new, view, positions, chain, 10 * BLOCK).tolist() == [0.0, 2.0 * BLOCK]
