"""The dry run's random sources: the scheduler's next draws, the original untouched."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.core.rng import ForkOnFirstDraw, PeekableRandom, PeekView, dry_run_random

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


# ----------------------------------------------------------------------------- PeekableRandom

PEEKS = st.lists(st.integers(0, 8), max_size=4)


@given(seed=st.integers(0, 2**32), steps=st.lists(st.tuples(PEEKS, OPS), max_size=6))
def test_a_peekable_random_draws_what_a_random_of_the_same_seed_draws(
    seed: int, steps: list[tuple[list[int], list[str]]]
) -> None:
    peekable, plain = PeekableRandom(seed), random.Random(seed)
    for peeks, ops in steps:
        for i in peeks:  # looking ahead changes nothing that is drawn
            peekable.peek(i)
        assert [_draw(peekable, op) for op in ops] == [_draw(plain, op) for op in ops]


@given(seed=st.integers(0, 2**32), warmup=OPS, peeks=PEEKS, ops=OPS)
def test_a_peek_view_draws_what_the_source_draws_next_and_leaves_it_alone(
    seed: int, warmup: list[str], peeks: list[int], ops: list[str]
) -> None:
    source = PeekableRandom(seed)
    for op in warmup:
        _draw(source, op)
    for i in peeks:
        source.peek(i)
    view = dry_run_random(source)
    assert isinstance(view, PeekView)
    seen = [_draw(view, op) for op in ops]
    state = view.getstate()
    twice = dry_run_random(source)
    assert [_draw(twice, op) for op in ops] == seen  # the source did not move
    assert [_draw(source, op) for op in ops] == seen
    assert source.getstate() == state  # the view's state is the source's after those draws


@given(seed=st.integers(0, 2**32), peeks=PEEKS, ops=OPS)
def test_peekable_states_round_trip_with_what_was_looked_at(
    seed: int, peeks: list[int], ops: list[str]
) -> None:
    source = PeekableRandom(seed)
    for i in peeks:
        source.peek(i)
    restored = PeekableRandom()
    restored.setstate(source.getstate())
    assert [_draw(restored, op) for op in ops] == [_draw(source, op) for op in ops]
    plain = random.Random(seed)
    restored.setstate(plain.getstate())  # a plain Random's state too
    assert [_draw(restored, op) for op in ops] == [_draw(plain, op) for op in ops]


def test_reseeding_forgets_what_was_looked_at() -> None:
    source = PeekableRandom(1)
    source.peek(3)
    source.seed(2)
    assert source.random() == random.Random(2).random()


def test_bit_counts_across_word_boundaries() -> None:
    for k in (0, 1, 31, 32, 33, 63, 64, 65, 96, 97):
        source, plain = PeekableRandom(k), random.Random(k)
        source.peek(5)
        assert source.getrandbits(k) == plain.getrandbits(k)
        assert dry_run_random(source).getrandbits(k) == plain.getrandbits(k)
    with pytest.raises(ValueError, match="non-negative"):
        dry_run_random(PeekableRandom(1)).getrandbits(-1)


def test_a_peek_view_cannot_be_seeded_or_set() -> None:
    view = PeekableRandom(1).peek_view()
    with pytest.raises(TypeError, match="source"):
        view.seed(3)
    with pytest.raises(TypeError, match="source"):
        view.setstate(random.Random(1).getstate())


def test_any_other_random_is_forked() -> None:
    assert isinstance(dry_run_random(random.Random(1)), ForkOnFirstDraw)
