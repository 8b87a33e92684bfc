"""binpack's constraint (d) on the residents as the legs record them: which legs are deadline-paced,
the time a leg has really spent decoding (Aladdin's ``t_dec``), and a leg already behind."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.core.columns import ResidentLegs, StaticResidents
from router.core.inflight import InflightAccount
from router.core.packing import SURE_REMAINING_SHARE, atgt_slack_ms, resident_tpot_need
from router.core.plugins import DecisionContext
from router.core.scheduler import Scheduler
from tests.router.core.helpers import NOW, inst, make_request, make_scheduler, make_snapshot

PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _ctx(scheduler: Scheduler, legs: ResidentLegs, prompt: int = 2000) -> DecisionContext:
    snapshot = make_snapshot(inst("n", "neutral", decode_requests=1, decode_tokens=600, used_kv_tokens=600))
    view = dataclasses.replace(scheduler.view(snapshot, NOW), residents=StaticResidents(legs), load_memo={})
    return scheduler.context(view, make_request("new", prompt, max_tokens=64))


def _one_leg(
    need: float, *, generated: float = 100.0, paced: bool | None = None, first_s: float | None = None
) -> ResidentLegs:
    return ResidentLegs(
        np.zeros(1, dtype=np.intp),
        np.array([600.0]),
        np.array([200.0]),
        np.ones(1, dtype=bool),
        np.array([generated]),
        np.array([need]),
        None if paced is None else np.array([paced]),
        None if first_s is None else np.array([first_s]),
    )


def test_a_class_whose_own_tpot_target_is_below_the_default_is_not_read_as_a_deadlines_pace() -> None:
    """A resident of a class with its own TPOT target of 40 ms (below the router's 50): marked as a
    TPOT target, (d) prices it at that target over the remainder it is sure to reach, at the step
    it will run at; marked paced (the same number, a deadline's pace over θ), at θ of it over its
    expected remainder at the γ-horizon step. Without a marker the number alone decides (below the
    default: paced)."""
    scheduler = make_scheduler("binpack", tpot_slo_ms=50.0, ttft_slo_ms=60_000.0)
    theta = scheduler.config.binpack_theta
    own = _ctx(scheduler, _one_leg(40.0, paced=False))
    step_now = float(own.metric("decode_step_ms")[0])
    step_new = float(own.metric("predicted_tpot")[0])
    horizon = float(own.metric("predicted_tpot_horizon")[0])
    tpot_judged = 100 * (40 - step_now) + 200 * SURE_REMAINING_SHARE * (40 - step_new)
    as_pace = 100 * (40 * theta - step_now) + 200 * (40 * theta - horizon)
    assert tpot_judged != pytest.approx(as_pace)

    def expect(value: float) -> float:
        return pytest.approx(value) if value > 0 else math.inf  # type: ignore[no-any-return]

    assert float(atgt_slack_ms(own, 50.0, theta)[0]) == expect(tpot_judged)
    paced = _ctx(scheduler, _one_leg(40.0, paced=True))
    assert float(atgt_slack_ms(paced, 50.0, theta)[0]) == expect(as_pace)
    unmarked = _ctx(scheduler, _one_leg(40.0))
    assert float(atgt_slack_ms(unmarked, 50.0, theta)[0]) == expect(as_pace)


def test_resident_tpot_need_says_whether_the_need_is_a_deadlines_pace() -> None:
    scheduler = make_scheduler("binpack", tpot_slo_ms=50.0, ttft_slo_ms=1_000.0)
    snapshot = make_snapshot(inst("n", "neutral"))
    view = scheduler.view(snapshot, NOW)
    own = scheduler.context(view, make_request("a", 300, tpot_slo_ms=40.0, expected_output_tokens=60))
    assert resident_tpot_need(own, scheduler.config) == (40.0, False)
    # A 10 s deadline over a 300-token answer: about 33 ms a token (over θ, still below 50 ms).
    deadline = scheduler.context(
        view, make_request("b", 300, e2e_slo_ms=10_000.0, expected_output_tokens=300)
    )
    need, paced = resident_tpot_need(deadline, scheduler.config)
    assert paced and need < 50.0
    loose = scheduler.context(view, make_request("c", 300, e2e_slo_ms=600_000.0, expected_output_tokens=40))
    assert resident_tpot_need(loose, scheduler.config) == (50.0, False)


@PROPS
@given(
    generated=st.integers(2, 400),
    spent_per_token=st.floats(5.0, 80.0),
    need=st.floats(20.0, 120.0),
)
def test_the_saved_part_is_the_time_the_leg_really_spent_decoding(
    generated: int, spent_per_token: float, need: float
) -> None:
    """With its first token's time known, a TPOT-judged leg has saved ``(g − 1)·T − t_dec``: the
    prompts that stalled it before are paid out of it, whatever the instance's step is now."""
    scheduler = make_scheduler("binpack", tpot_slo_ms=50.0, ttft_slo_ms=60_000.0)
    spent_ms = (generated - 1) * spent_per_token
    legs = _one_leg(need, generated=float(generated), paced=False, first_s=NOW - spent_ms / 1e3)
    ctx = _ctx(scheduler, legs)
    future = 200 * SURE_REMAINING_SHARE * (need - float(ctx.metric("predicted_tpot")[0]))
    expected = (generated - 1) * need - spent_ms + future
    slack = float(atgt_slack_ms(ctx, 50.0)[0])
    if expected > 0:
        assert slack == pytest.approx(expected, rel=1e-6, abs=1e-6)
    else:
        assert slack == math.inf
    # The more it spent, the less it has saved.
    slower = _ctx(
        scheduler, _one_leg(need, generated=float(generated), paced=False, first_s=NOW - 2 * spent_ms / 1e3)
    )
    slower_slack = float(atgt_slack_ms(slower, 50.0)[0])
    assert slower_slack <= slack or slower_slack == math.inf


def test_a_stalled_resident_binds_where_the_current_step_says_it_has_time() -> None:
    """Two legs that produced the same tokens, the instance stepping 16.5 ms now: the one whose 99
    steps took 48 ms each (prompts stalled it) has less slack than the one at 30 ms, and a
    3,000-token prompt (d) admits beside the fresh one is refused beside it (priced at the
    current step, both had saved 33.5 ms a token)."""
    scheduler = make_scheduler("binpack", tpot_slo_ms=50.0, ttft_slo_ms=60_000.0)
    fresh = _ctx(scheduler, _one_leg(50.0, paced=False, first_s=NOW - 99 * 0.030), prompt=3000)
    stalled = _ctx(scheduler, _one_leg(50.0, paced=False, first_s=NOW - 99 * 0.048), prompt=3000)
    theta = scheduler.config.binpack_theta
    assert float(atgt_slack_ms(stalled, 50.0)[0]) < float(atgt_slack_ms(fresh, 50.0)[0])
    assert float(fresh.metric("prefill_over_atgt_slack")[0]) < theta
    assert float(stalled.metric("prefill_over_atgt_slack")[0]) > theta


def test_a_resident_already_behind_sets_no_bound_and_the_others_still_do() -> None:
    """A leg whose slack is gone misses whatever is placed: (d) is the least slack of the others."""
    scheduler = make_scheduler("binpack", tpot_slo_ms=50.0, ttft_slo_ms=60_000.0)
    legs = ResidentLegs(
        np.zeros(2, dtype=np.intp),
        np.array([600.0, 600.0]),
        np.array([200.0, 200.0]),
        np.ones(2, dtype=bool),
        np.array([100.0, 100.0]),
        np.array([50.0, 50.0]),
        np.array([False, False]),
        # The first spent 99 steps of 80 ms against a 50 ms target; the second of 30 ms.
        np.array([NOW - 99 * 0.080, NOW - 99 * 0.030]),
    )
    ctx = _ctx(scheduler, legs)
    future = 200 * SURE_REMAINING_SHARE * (50.0 - float(ctx.metric("predicted_tpot")[0]))
    assert 99 * 50.0 - 99 * 80.0 + future < 0
    assert float(atgt_slack_ms(ctx, 50.0)[0]) == pytest.approx(99 * 50.0 - 99 * 30.0 + future)
    only = _ctx(scheduler, ResidentLegs(*(None if c is None else c[:1] for c in legs)))
    assert float(atgt_slack_ms(only, 50.0)[0]) == math.inf
    assert float(only.metric("prefill_over_atgt_slack")[0]) == 0.0


def test_the_inflight_account_records_the_pace_marker_and_the_first_token() -> None:
    account = InflightAccount(expiry_s=1.0)
    account.record("a", "n", "n", 100, NOW, final_tokens=300, tpot_need_ms=21.5, tpot_paced=True)
    account.record("b", "n", "n", 100, NOW, final_tokens=300, tpot_need_ms=40.0)
    legs = account.resident_legs({"n": 0}, 1)
    assert legs is not None and legs.tpot_paced is not None and legs.first_token_s is not None
    assert legs.tpot_paced.tolist() == [True, False]
    assert np.isnan(legs.first_token_s).all()  # none has started
    account.advance("a", 100, now_s=NOW + 0.5)  # the prompt only: no output yet
    account.advance("a", 101, now_s=NOW + 1.0)  # its first token
    account.advance("a", 140, now_s=NOW + 3.0)
    account.advance("b", 120)  # no clock: not known
    account.expire(NOW + 5.0)  # the in-flight entries leave: both legs decode on their instance
    legs = account.resident_legs({"n": 0}, 1)
    assert legs is not None and legs.first_token_s is not None and legs.started.all()
    assert legs.first_token_s[0] == NOW + 1.0 and np.isnan(legs.first_token_s[1])
    account.release("a")
    legs = account.resident_legs({"n": 0}, 1)
    assert legs is not None and legs.tpot_paced is not None and legs.first_token_s is not None
    assert legs.tpot_paced.tolist() == [False] and np.isnan(legs.first_token_s).all()
    account.record("a", "n", "n", 100, NOW, final_tokens=300, tpot_need_ms=21.5)  # again, unmarked
    legs = account.resident_legs({"n": 0}, 1)
    assert legs is not None and legs.tpot_paced is not None and legs.first_token_s is not None
    assert legs.tpot_paced.tolist() == [False, False] and np.isnan(legs.first_token_s).all()


def test_the_simulators_resident_legs_carry_the_marker_and_the_first_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a seeded run on colocated instances, every leg (d) reads that decodes has its first token's
    time, at or before the decision, and the deadline-judged class's legs are the marked ones."""
    import router.core.packing as packing
    from router.core.config import SchedulerConfig
    from router.core.queue import QueueConfig
    from sim.cluster import SimFleet, simulate
    from sim.fleet import fleet_from_counts
    from sim.sweep import open_loop, policy_overrides
    from workload.spec import generate_requests, load_workload

    seen: list[tuple[float, ResidentLegs]] = []
    real = packing.atgt_slack_ms

    def spy(ctx: DecisionContext, tpot_target_ms: float, theta: float = 1.0, **kwargs: bool) -> np.ndarray:
        legs = ctx.view.resident_legs()
        if legs is not None and len(seen) < 400:
            seen.append((ctx.view.now_s, legs))
        return real(ctx, tpot_target_ms, theta, **kwargs)

    monkeypatch.setattr(packing, "atgt_slack_ms", spy)
    workload = load_workload("code=0.5,chat=0.5")
    plans = generate_requests(open_loop(workload).with_arrival(rate_per_s=6.0), rng=3, num_requests=60)
    config = SchedulerConfig(**policy_overrides("binpack"))
    fleet = SimFleet(fleet_from_counts(prefill=0, decode=0, neutral=2))
    simulate(fleet, config, plans, seed=3, queue=QueueConfig(queue_policy="edf"))
    started = [(now, legs) for now, legs in seen if legs.started.any()]
    assert started
    marked = 0
    for now, legs in started:
        assert legs.tpot_paced is not None and legs.first_token_s is not None
        first = legs.first_token_s[legs.started]
        assert np.isfinite(first).all() and (first <= now).all()
        assert np.isnan(legs.first_token_s[~legs.started]).all()
        # Chat (TPOT target 50 ms, the default) is never marked; what is marked is a deadline's pace.
        assert legs.tpot_need_ms is not None
        assert (legs.tpot_need_ms[legs.tpot_paced] < 50.0).all()
        marked += int(legs.tpot_paced.sum())
    assert marked > 0
