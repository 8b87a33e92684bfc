"""The index's LRU kept in segments, and its lookups resumed from a kept walk, answer exactly as the
step-by-step index (:mod:`tests.router.core.prefix_reference`) does, within bounded memory.

The bounds that decide when the shortcuts engage (the kept walk's least length, the stale entries a
slot may carry, how many walks and shared holder sets are kept) are shrunk here so that short random
sequences cross them all: compactions, walks kept from two blocks on and forgotten, holder sets
shared and started over. The traffic is a router's (prompt families sharing heads, resent to the
instances that hold them, tails and placeholders evicted under small capacities) mixed with engine
events and arbitrary hash lists (gaps, duplicates).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import router.core.prefix as fast
import tests.router.core.prefix_reference as ref
from fleet.prefix import id_block_hashes
from tests.router.core.test_prefix_fast import _state, index_pair

BLOCK = 16


def _chain(family: int, depth: int, tail: int) -> list[int]:
    """A prompt of ``family``, ``depth`` blocks: the family's head, then from block ``2 + tail`` on a
    continuation of its own (prompts of a family diverge at different depths)."""
    split = 2 + tail
    ids = [family * 100 + j for j in range(min(depth, split))]
    ids += [family * 100 + 50 + tail * 10 + j for j in range(depth - split)]
    return list(id_block_hashes(ids, 10**6, 1))


_STEP = st.tuples(
    st.sampled_from([*["dispatched"] * 8, "stored", "stored", "removed", "cleared", "forget"]),
    st.integers(0, 4),  # instance
    st.one_of(
        st.tuples(st.integers(0, 2), st.integers(0, 10), st.integers(0, 3)).map(lambda f: _chain(*f)),
        st.lists(st.integers(0, 8), max_size=8),  # arbitrary lists: gaps, duplicates
    ),
    st.integers(0, 12),  # capacity in blocks (0: unbounded)
    st.integers(0, 3 * BLOCK),  # private tokens (placeholders)
)


@contextmanager
def _small_bounds(slack: int) -> Iterator[None]:
    with (
        mock.patch.object(fast, "_WALK_MIN", 2),
        mock.patch.object(fast, "_WALKS", 3),
        mock.patch.object(fast, "_WALK_BLOCKS", 12),
        mock.patch.object(fast, "_SHARED_SETS", 2),
        mock.patch.object(fast, "_SEGMENT_SLACK", slack),
    ):
        yield


def _check_segments(index: fast.BlockIndex, slack: int) -> None:
    """Every hash held is live in exactly the segment it maps to; the counts and the bound hold."""
    for instance_id, slot in index._slot.items():
        blocks = index._blocks[slot]
        segments = index._segments[slot]
        live = [h for sid, s in segments.items() for h in s.hashes if blocks.get(h) == sid]
        assert sorted(live) == sorted(blocks)  # each held hash live once, nothing else live
        for sid, segment in segments.items():
            assert segment.live == sum(1 for h in segment.hashes if blocks.get(h) == sid) >= 1
        stored = sum(len(s.hashes) for s in segments.values())
        assert index._stored[slot] == stored <= 2 * len(blocks) + slack, instance_id


def _step(index: Any, kind: str, who: str, hashes: list[int], cap: int, private: int) -> None:
    if kind == "dispatched" and hasattr(index, "dispatched"):
        index.dispatched(who, hashes, float(cap * BLOCK) if cap else float("inf"), private)
    elif kind in ("stored", "removed", "cleared", "dispatched"):
        if isinstance(index, (fast.ExactPrefixIndex, ref.ExactPrefixIndex)):
            index.apply(who, [(kind, hashes)])
        elif kind in ("stored", "dispatched"):
            index.add(who, hashes, limit=cap or None)
        elif kind == "removed":
            index.remove(who, hashes)
        else:
            index.clear(who)
    else:
        index.forget(who)


@settings(max_examples=250, deadline=None)
@given(
    kind=st.sampled_from(["approximate", "exact", "block"]),
    steps=st.lists(_STEP, min_size=1, max_size=50),
    slack=st.sampled_from([0, 3]),
    lookups=st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 12), st.integers(0, 3)), min_size=1, max_size=4
    ),
)
def test_segments_and_kept_walks_answer_as_the_step_by_step_index(
    kind: str,
    steps: list[tuple[str, int, list[int], int, int]],
    slack: int,
    lookups: list[tuple[int, int, int]],
) -> None:
    bounds = {"max_instances": 4, "max_blocks_per_instance": 10}
    new, old = index_pair(kind, "BlockIndex", bounds)
    view = ("i3", "i0", "ghost", "i4", "i1", "i2")
    queries = [_chain(*q) for q in lookups]
    with _small_bounds(slack):
        for kind_, who, hashes, cap, private in steps:
            for index in (new, old):
                _step(index, kind_, f"i{who}", hashes, cap, private)
            assert _state(new) == _state(old)
            _check_segments(new, slack)
            for q in queries * 2:  # the second round resumes the walks the first kept
                assert new.matched_blocks(q) == old.matched_blocks(q)
                got = new.matched_column(q, view)
                assert got.tolist() == [old.matched_blocks(q).get(i, 0) for i in view]
            assert sum(len(w[1]) for w in new._walks.values()) <= new._walked <= fast._WALK_BLOCKS
            assert len(new._walks) <= fast._WALKS and len(new._shared) <= fast._SHARED_SETS


@settings(max_examples=60, deadline=None)
@given(
    families=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 200)), min_size=50, max_size=300),
    cap=st.integers(8, 40),
)
def test_memory_stays_bounded_under_long_traffic(families: list[tuple[int, int]], cap: int) -> None:
    """Many prompts of a few families resent across 3 instances of small capacity: what the index
    keeps (hashes, segment entries, kept walks, shared sets) stays within its bounds."""
    index = fast.ApproximatePrefixIndex(BLOCK, max_blocks_per_instance=cap)
    for k, (family, tail) in enumerate(families):
        chain = _chain(family, 6 + tail % 9, tail)
        index.dispatched(f"i{k % 3}", chain, float("inf"), private_tokens=(tail % 3) * BLOCK)
        index.matched_blocks(chain)
        for slot in range(len(index._blocks)):
            assert len(index._blocks[slot]) <= cap
            assert index._stored[slot] <= 2 * len(index._blocks[slot]) + fast._SEGMENT_SLACK
    assert len(index._walks) <= fast._WALKS and len(index._shared) <= fast._SHARED_SETS
    assert sum(len(w[1]) for w in index._walks.values()) <= index._walked <= fast._WALK_BLOCKS
    assert len(index._holders) <= 3 * cap


def test_a_resent_prefix_moves_its_segment_and_a_lookup_resumes_its_kept_walk() -> None:
    """By hand: a family's head resent with a new tail takes the fast way (the head's segment moved,
    no new entry for it), and a lookup of the family after it reads only the blocks past the kept walk."""
    index = fast.ApproximatePrefixIndex(BLOCK)
    head = list(id_block_hashes(list(range(6)), 10**6, 1))
    first = list(id_block_hashes([*range(6), 11, 12, 13], 10**6, 1))
    second = list(id_block_hashes([*range(6), 21, 22, 23], 10**6, 1))
    for who in ("a", "b"):
        index.dispatched(who, head, float("inf"))
    index.dispatched("a", first, float("inf"))  # head held: the head's segment stays whole
    segments = index._segments[0]
    assert [len(s.hashes) for s in segments.values()] == [3, 6]  # first's tail, then the head
    stored = index._stored[0]
    index.dispatched("a", second, float("inf"))
    assert [len(s.hashes) for s in segments.values()] == [3, 3, 6] and index._stored[0] == stored + 3
    assert index.lru_order("a") == [*first[6:][::-1], *second[6:][::-1], *head[::-1]]
    with mock.patch.object(fast, "_WALK_MIN", 2):
        assert index.matched_blocks(second) == {"a": 9, "b": 6}
        assert index._walks[second[0]][1] == second[:6]  # kept where a and b both still held all
        reads: list[int] = []
        with mock.patch.object(index, "_holders", _Counting(index._holders, reads)):
            assert index.matched_blocks(first) == {"a": 9, "b": 6}
        assert reads == first[6:]  # the head was compared, not read
        index.remove("b", head[3:4])  # a holder set changes: the kept walk no longer stands
        assert index.matched_blocks(first) == {"a": 9, "b": 3}
    column = fast.cached_tokens_column(index, ("b", "a"), {"b": 0, "a": 1}, first, 20 * BLOCK)
    assert np.array_equal(column, [3.0 * BLOCK, 9.0 * BLOCK])


class _Counting(dict[int, int]):
    """A holders map that notes every hash a walk reads."""

    def __init__(self, inner: dict[int, int], reads: list[int]) -> None:
        super().__init__(inner)
        self.reads = reads

    def get(self, key: int, default: Any = None) -> Any:
        self.reads.append(key)
        return super().get(key, default)
