"""The request lifecycle: the transition table, its checks, and tokens across pause/resume."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.errors import IllegalTransitionError
from router.core.lifecycle import PRODUCING, TRANSITIONS, Phase, RequestState, legal


def test_a_pd_request_walks_the_whole_path() -> None:
    seen: list[tuple[Phase, Phase]] = []
    state = RequestState("r", started=1.0, listener=lambda old, new: seen.append((old, new)))
    state.to(Phase.PLACED)
    state.to(Phase.PREFILLING)
    assert state.add_tokens([7], now=1.5) == 0
    state.to(Phase.TRANSFERRING)
    state.to(Phase.DECODING)
    assert state.add_tokens([8, 9], now=2.5) == 1
    state.end(Phase.DONE)
    assert state.phase is Phase.DONE
    assert state.tokens == [7, 8, 9]
    assert state.ttft_s == pytest.approx(0.5)
    assert state.tpot_s == pytest.approx(0.5)
    assert [new for _, new in seen] == [
        Phase.QUEUED,
        Phase.PLACED,
        Phase.PREFILLING,
        Phase.TRANSFERRING,
        Phase.DECODING,
        Phase.DONE,
    ]


def test_decode_failover_is_pause_requeue_resume() -> None:
    state = RequestState("r")
    for phase in (Phase.PLACED, Phase.PREFILLING):
        state.to(phase)
    state.add_tokens([1], now=0.1)
    state.to(Phase.DECODING)
    state.add_tokens([2, 3], now=0.2)
    state.pause("decode instance d0 failed")
    assert (state.phase, state.resume_from, state.pauses) == (Phase.PAUSED, 3, 1)
    with pytest.raises(IllegalTransitionError):
        state.add_tokens([4], now=0.3)  # a paused request has no leg
    state.requeue()
    state.to(Phase.PLACED)
    state.to(Phase.DECODING)  # the prefill instance still holds the KV
    state.add_tokens([4], now=0.3)
    state.end(Phase.DONE)
    assert state.tokens == [1, 2, 3, 4]


@pytest.mark.parametrize("terminal", [Phase.DONE, Phase.FAILED, Phase.CANCELLED])
def test_terminal_phases_are_absorbing(terminal: Phase) -> None:
    assert terminal.terminal
    assert not TRANSITIONS[terminal]
    state = RequestState("r")
    state.to(Phase.PLACED)
    state.to(Phase.PREFILLING)
    state.to(Phase.DONE) if terminal is Phase.DONE else state.end(terminal)
    state.end(Phase.FAILED)  # a second end keeps the first
    assert state.phase is terminal
    for phase in Phase:
        with pytest.raises(IllegalTransitionError, match="not a legal move"):
            state.to(phase)


def test_only_live_phases_may_fail_or_be_cancelled_and_end_needs_an_end() -> None:
    for phase in Phase:
        if not phase.terminal:
            assert {Phase.FAILED, Phase.CANCELLED} <= TRANSITIONS[phase]
    with pytest.raises(IllegalTransitionError, match="not an end"):
        RequestState("r").end(Phase.PAUSED)


# ---------------------------------------------------------------------- property


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(list(Phase)), st.integers(0, 3)), max_size=40))
def test_random_walks_obey_the_table_and_never_lose_or_repeat_a_token(
    moves: list[tuple[Phase, int]],
) -> None:
    """Any sequence of requested moves: legal ones happen, illegal ones raise and change nothing;
    tokens appear only while producing, and what each run emitted, concatenated, is the whole answer."""
    state = RequestState("r")
    emitted: list[list[int]] = [[]]
    counter = 0
    for target, produce in moves:
        before = (state.phase, list(state.tokens))
        if legal(state.phase, target):
            if target is Phase.PAUSED:
                state.pause("test")
                assert state.resume_from == len(state.tokens)
                emitted.append([])
            else:
                state.to(target)
            assert state.phase is target
        else:
            with pytest.raises(IllegalTransitionError):
                state.to(target)
            assert (state.phase, state.tokens) == before
        ids = list(range(counter, counter + produce))
        if state.phase in PRODUCING:
            state.add_tokens(ids, now=float(counter))
            counter += produce
            emitted[-1].extend(ids)
        elif ids:
            with pytest.raises(IllegalTransitionError):
                state.add_tokens(ids, now=0.0)
    whole = [t for run in emitted for t in run]
    assert state.tokens == whole
    assert state.tokens == list(range(len(state.tokens)))  # in order, none twice, none missing
    assert state.pauses == len(emitted) - 1


@given(st.sampled_from(list(Phase)), st.sampled_from(list(Phase)))
def test_legal_is_the_table(old: Phase, new: Phase) -> None:
    assert legal(old, new) == (new in TRANSITIONS[old])
    # Every live phase can reach an end; the only way back to the queue is through a pause.
    if new is Phase.QUEUED and legal(old, new):
        assert old is Phase.PAUSED
