"""The cached-token column stays exactly the step-by-step index's while the lookup reuses holder
membership rows on a kept view: over a fleet wider than a machine word, with instances joining,
leaving and being evicted past ``max_instances`` under the same view tuple (slots change under it),
and many lookups per holder set (rows reused) between dispatches that change the sets."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import router.core.prefix as fast
import tests.router.core.prefix_reference as ref
from fleet.prefix import id_block_hashes

BLOCK = 16

_STEP = st.tuples(
    st.sampled_from(["dispatched"] * 6 + ["forget"]),
    st.integers(0, 79),  # instance
    st.integers(0, 3),  # prompt family
    st.integers(0, 8),  # blocks of the family's chain
    st.integers(0, 6),  # capacity in blocks (0: unbounded)
)


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(_STEP, min_size=1, max_size=60),
    max_instances=st.integers(40, 90),
    seed=st.integers(0, 999),
)
def test_lookups_on_a_kept_view_equal_the_step_by_step_index(
    steps: list[tuple[str, int, int, int, int]], max_instances: int, seed: int
) -> None:
    new = fast.ApproximatePrefixIndex(BLOCK, max_instances=max_instances)
    old = ref.ApproximatePrefixIndex(BLOCK, max_instances=max_instances)
    names = [f"i{k}" for k in range(80)] + ["ghost"]
    random.Random(seed).shuffle(names)
    view = tuple(names)
    positions = {name: k for k, name in enumerate(view)}
    chains = [list(id_block_hashes([f * 100 + j for j in range(8)], 10**6, 1)) for f in range(4)]
    queries = [c[:d] for c in chains for d in (1, 4, 8)]
    for kind, who, family, depth, cap in steps:
        for index in (new, old):
            if kind == "forget":
                index.forget(f"i{who}")
            else:
                index.dispatched(
                    f"i{who}", chains[family][:depth], float(cap * BLOCK) if cap else float("inf")
                )
        for q in queries * 2:  # the second round reads the rows the first kept
            for prompt in (len(q) * BLOCK, len(q) * BLOCK + 3):
                got = fast.cached_tokens_column(new, view, positions, q, prompt)
                want = ref.cached_tokens_column(old, view, positions, q, prompt)
                assert got.dtype == want.dtype and np.array_equal(got, want)


def test_a_kept_row_is_not_handed_out_for_another_view_or_after_the_slots_change() -> None:
    index = fast.ApproximatePrefixIndex(BLOCK)
    chain = list(id_block_hashes(list(range(3)), 10**6, 1))
    ids = tuple(f"n{k}" for k in range(70))
    positions = {name: k for k, name in enumerate(ids)}
    for name in ids[::2]:
        index.dispatched(name, chain, float("inf"))
    first = fast.cached_tokens_column(index, ids, positions, chain, 10 * BLOCK)
    assert first.tolist() == [3.0 * BLOCK if k % 2 == 0 else 0.0 for k in range(70)]
    backwards = tuple(reversed(ids))
    flipped = fast.cached_tokens_column(
        index, backwards, {n: k for k, n in enumerate(backwards)}, chain, 10 * BLOCK
    )
    assert flipped.tolist() == first.tolist()[::-1]
    index.forget("n0")  # its slot is freed: the same holder set now reads differently
    index.dispatched("late", chain, float("inf"))  # and taken by a newcomer outside the view
    again = fast.cached_tokens_column(index, ids, positions, chain, 10 * BLOCK)
    assert again[0] == 0.0 and again[2] == 3.0 * BLOCK
