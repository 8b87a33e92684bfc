"""The ``slice`` dispatcher through the dispatcher protocol: caps, pause → resume, cancels, refusals.

A small driver here plays the engine (each placement produces up to its cap, or what is left of the
answer) over a real scheduler: what it checks is what both real drivers rely on.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.snapshot import ClusterSnapshot
from router.core.config import SchedulerConfig
from router.core.dispatch import (
    Action,
    Arrival,
    Cancel,
    Completion,
    DispatchSetup,
    Outcome,
    Paused,
    Timer,
    ViewChanged,
    make_dispatcher,
    waiting_delta,
)
from router.core.errors import EmptyClusterError, QueueFullError, RouterError, status_name
from router.core.queue import QueueConfig
from router.core.request import ScheduleInput
from router.core.scheduler import Scheduler
from router.core.slice_dispatch import Sliced
from router.core.slicing import SliceConfig
from tests.router.core.helpers import inst, make_predictor, make_snapshot
from tests.router.test_dispatch_conformance import Views

TWO = make_snapshot(inst("n0", "neutral"), inst("n1", "neutral"))
#: Two neutral instances of 2,048 KV tokens: continued slices run out of room (shortened, waiting).
TIGHT = make_snapshot(
    inst("n0", "neutral", meta={"kv_capacity_tokens": 2048}),
    inst("n1", "neutral", meta={"kv_capacity_tokens": 2048}),
)
PD_ONLY = make_snapshot(inst("p0", "prefill"), inst("d0", "decode"))


class Engines(Views):
    """The conformance suite's fleet over a real scheduler, whose statuses never go stale (the test's
    clock runs through many schedule points), with each running request's tokens (the engine's)."""

    def __init__(self, snapshot: ClusterSnapshot = TWO) -> None:
        super().__init__(snapshot)
        self._scheduler = Scheduler(
            SchedulerConfig(instance_staleness_s=math.inf), make_predictor(), random.Random(0)
        )
        self.tokens: dict[str, int] = {}

    def produced(self, request_id: str) -> int | None:
        return self.tokens.get(request_id)


def dispatcher(config: SliceConfig | None = None, *, max_queue_size: int = 4096) -> Sliced:
    d = make_dispatcher(
        DispatchSetup(
            QueueConfig(queue_policy="none", max_queue_size=max_queue_size),
            10_000.0,
            1000.0,
            slicing=config or SliceConfig(),
            dispatcher="slice",
        )
    )
    assert isinstance(d, Sliced)
    return d


def request(rid: str, max_tokens: int, prompt: int = 256) -> ScheduleInput:
    return ScheduleInput(
        rid, prompt, ttft_slo_ms=60_000.0, tpot_slo_ms=1000.0, max_tokens=max_tokens, arrival_s=100.0
    )


def serve(d: Sliced, fleet: Engines, answers: list[int]) -> tuple[dict[str, int], int]:
    """Play the engines for ``answers``: each placement produces up to its cap (one at a time, in
    the order placed), pausing or completing its request; the tokens each request ended with and
    the count of waiting requests the actions left."""
    now = 100.0
    waiting = 0
    running: dict[str, Action] = {}
    done: dict[str, int] = {}
    for k, answer in enumerate(answers):
        for a in d.handle(Arrival(request(f"r{k}", answer), k), now, fleet):
            waiting += waiting_delta(a)
            assert a.outcome is Outcome.QUEUED
    for _ in range(10_000):  # bounded: every round ends or pauses at least one slice
        wake = d.wake_s()
        events = [Timer()] if wake is not None and not running else []
        for event in events:
            now = max(now, wake or now)
            for a in d.handle(event, now, fleet):
                waiting += waiting_delta(a)
                if a.outcome is Outcome.DISPATCH:
                    running[a.request_id] = a
        if not running:
            if not len(d):
                break
            continue
        rid, action = next(iter(running.items()))
        del running[rid]
        answer = action.request.max_tokens
        have = fleet.tokens.get(rid, 0)
        assert action.tokens == have  # it resumes exactly after what it had
        assert action.cap >= 1
        have = min(answer, have + action.cap)
        fleet.tokens[rid] = have
        now += 0.01
        if have >= answer:
            done[rid] = have
            list(d.handle(Completion(rid, have), now, fleet))
        else:
            for a in d.handle(Paused(rid, have), now, fleet):
                waiting += waiting_delta(a)
                if a.outcome is Outcome.DISPATCH:
                    running[a.request_id] = a
        for a in d.handle(ViewChanged(), now, fleet):
            waiting += waiting_delta(a)
            if a.outcome is Outcome.DISPATCH:
                running[a.request_id] = a
    return done, waiting


@settings(max_examples=40, deadline=None)
@given(
    answers=st.lists(st.integers(1, 700), min_size=1, max_size=6),
    slice_tokens=st.integers(1, 64),
    at_once=st.booleans(),
    grow=st.booleans(),
    tight=st.booleans(),
)
def test_every_token_is_produced_once_across_pauses_and_resumes(
    answers: list[int], slice_tokens: int, at_once: bool, grow: bool, tight: bool
) -> None:
    """A request's placements, each resumed after the tokens its pause reported, cover its answer
    exactly: no token lost, none produced twice; nothing waits or stays planned at the end (on a
    KV tight enough for continued slices to be shortened or to wait, too)."""
    config = SliceConfig(slice_tokens=slice_tokens, resume_at_once=at_once, grow_with_answer=grow)
    d = dispatcher(config)
    done, waiting = serve(d, Engines(TIGHT if tight else TWO), answers)
    assert done == {f"r{k}": answer for k, answer in enumerate(answers)}
    assert waiting == len(d) == 0
    sched = d.sched
    assert sched is not None
    assert all(sched.planned_kv(i) == 0 and sched.load_ms(i) == 0.0 for i in sched.instances)


def test_a_dispatch_carries_the_slice_cap_and_a_placement_on_the_chosen_neutral_instance() -> None:
    d = dispatcher(SliceConfig(slice_tokens=16, recompute_share=None))
    fleet = Engines()
    assert [a.outcome for a in d.handle(Arrival(request("a", 100), "a"), 100.0, fleet)] == [Outcome.QUEUED]
    assert d.wake_s() == 100.0 and len(d) == 1  # a schedule point at once: nothing came before
    (placed,) = d.handle(Timer(), 100.0, fleet)
    assert placed.outcome is Outcome.DISPATCH and placed.cap == 16 and placed.tokens == 0
    assert placed.decision is not None and placed.decision.policy == "slice"
    assert placed.decision.instance_ids in {("n0",), ("n1",)}
    assert len(d) == 0
    # Its slice ends at the cap: the next one is placed at once, after the 16 tokens, at least as long.
    fleet.tokens["a"] = 16
    queued, resumed = d.handle(Paused("a", 16), 100.5, fleet)
    assert queued.outcome is Outcome.QUEUED and resumed.outcome is Outcome.DISPATCH
    assert resumed.tokens == 16 and resumed.cap == 16 and resumed.waited_s == 0.0


def test_a_full_pool_refuses_with_resource_exhausted_and_refuse_all_answers_the_waiting() -> None:
    d = dispatcher(max_queue_size=2)
    fleet = Engines()
    for k in range(2):
        list(d.handle(Arrival(request(f"r{k}", 50), k), 100.0, fleet))
    (refused,) = d.handle(Arrival(request("r2", 50), 2), 100.0, fleet)
    assert refused.outcome is Outcome.REFUSE and isinstance(refused.error, QueueFullError)
    assert status_name(refused.error) == "RESOURCE_EXHAUSTED" and not refused.waited
    error = RouterError("stopping")
    out = d.refuse_all(error)
    assert {a.request_id for a in out} == {"r0", "r1"} and all(a.error is error for a in out)
    assert len(d) == 0 and list(d.handle(Timer(), 100.0, fleet)) == []


def test_without_a_neutral_instance_a_request_is_refused_unavailable() -> None:
    d = dispatcher()
    (refused,) = d.handle(Arrival(request("a", 50), "a"), 100.0, Engines(PD_ONLY))
    assert isinstance(refused.error, EmptyClusterError) and status_name(refused.error) == "UNAVAILABLE"
    assert "neutral" in str(refused.error) and len(d) == 0


def test_a_request_cancelled_in_a_local_queue_is_never_placed() -> None:
    # One instance, slices big enough that the second waits in its local queue behind the first.
    fleet = Engines(make_snapshot(inst("n0", "neutral", meta={"kv_capacity_tokens": 4096})))
    d = dispatcher(SliceConfig(slice_tokens=1024, recompute_share=None, split_batches=False))
    for rid in ("a", "b"):
        list(d.handle(Arrival(request(rid, 2000, prompt=1500), rid), 100.0, fleet))
    placed = [a.request_id for a in d.handle(Timer(), 100.0, fleet) if a.outcome is Outcome.DISPATCH]
    assert len(placed) == 1 and len(d) == 1
    other = "b" if placed == ["a"] else "a"
    assert [a.outcome for a in d.handle(Cancel(other), 100.1, fleet)] == [Outcome.LEFT]
    list(d.handle(Completion(placed[0], 1024), 100.2, fleet))
    later = list(d.handle(ViewChanged(), 100.2, fleet))
    assert later == [] and len(d) == 0
    sched = d.sched
    assert sched is not None and sched.planned_kv("n0") == 0 and sched.load_ms("n0") == 0.0


@pytest.mark.parametrize("in_place", [True, False])
def test_a_next_slice_placed_where_its_request_runs_continues_that_leg(in_place: bool) -> None:
    """On an idle two-instance fleet the next slice stays where the first ran (its context is there
    and staying costs no prefill): that placement continues the running leg (``Action.continues``)
    unless ``continue_in_place`` is off; a placement on another instance never does."""
    d = dispatcher(SliceConfig(slice_tokens=16, recompute_share=None, continue_in_place=in_place))
    fleet = Engines()
    d.handle(Arrival(request("a", 100), "a"), 100.0, fleet)
    (placed,) = d.handle(Timer(), 100.0, fleet)
    assert not placed.continues  # a first slice starts a leg
    fleet.tokens["a"] = 16
    _queued, resumed = d.handle(Paused("a", 16), 100.5, fleet)
    assert resumed.decision is not None and placed.decision is not None
    assert resumed.decision.instance_ids == placed.decision.instance_ids
    assert resumed.continues is in_place


def test_on_a_tight_kv_continued_slices_shorten_and_wait_and_every_token_comes_once() -> None:
    """Two neutral instances of 2,048 KV tokens, long answers: continued slices are shortened to the
    room their instance's plan has, or wait for an instance with room and resume there after the
    tokens they had; every answer still comes whole, once, and nothing stays planned."""
    d = dispatcher(SliceConfig(slice_tokens=64))
    answers = [600, 700, 650, 500, 680, 620, 540, 690]
    done, waiting = serve(d, Engines(TIGHT), answers)
    assert done == {f"r{k}": answer for k, answer in enumerate(answers)}
    assert waiting == len(d) == 0
    sched = d.sched
    assert sched is not None
    assert sched.shortened > 0 and sched.waited > 0
    assert all(sched.planned_kv(i) == 0 and sched.load_ms(i) == 0.0 for i in sched.instances)
