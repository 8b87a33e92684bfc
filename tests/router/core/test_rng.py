"""The dry run's random source: the draws of a copy of the scheduler's RNG, the original untouched."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.core.rng import ForkOnFirstDraw

OPS = st.lists(st.sampled_from(["random", "randrange", "sample", "choice", "getrandbits"]), max_size=20)


def _draw(rng: random.Random, op: str) -> object:
    if op == "random":
        return rng.random()
    if op == "randrange":
        return rng.randrange(1000)
    if op == "sample":
        return rng.sample(range(50), 2)
    if op == "choice":
        return rng.choice("abcdefgh")
    return rng.getrandbits(40)


@given(seed=st.integers(0, 2**32), warmup=st.integers(0, 5), ops=OPS)
def test_draws_match_a_copy_and_leave_the_source_alone(seed: int, warmup: int, ops: list[str]) -> None:
    source = random.Random(seed)
    for _ in range(warmup):
        source.random()
    before = source.getstate()
    copy = random.Random()
    copy.setstate(before)
    fork = ForkOnFirstDraw(source)
    assert [_draw(fork, op) for op in ops] == [_draw(copy, op) for op in ops]
    assert source.getstate() == before


def test_the_copy_is_taken_at_the_first_draw_not_at_creation() -> None:
    source = random.Random(5)
    fork = ForkOnFirstDraw(source)
    source.random()  # the scheduler's RNG moved on before the dry run drew
    expected = random.Random()
    expected.setstate(source.getstate())
    assert fork.random() == expected.random()


def test_it_cannot_be_seeded() -> None:
    with pytest.raises(TypeError, match="source"):
        ForkOnFirstDraw(random.Random(1)).seed(3)
