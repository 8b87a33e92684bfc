"""binpack on a fixed neutral fleet: constraint (b) holds a newcomer to the need it will record as a
resident, and constraint (d) counts a deadline-paced resident's whole decode budget."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from router.core.columns import ResidentLegs, StaticResidents
from router.core.inflight import InflightAccount
from router.core.packing import atgt_slack_ms
from router.core.plugins import DecisionContext
from router.core.request import Targets
from router.core.scheduler import Scheduler
from tests.router.core.helpers import NOW, inst, make_request, make_scheduler, make_snapshot


def _view(scheduler: Scheduler, legs: ResidentLegs | None = None):  # type: ignore[no-untyped-def]
    snapshot = make_snapshot(inst("n", "neutral", decode_requests=6, decode_tokens=6000, used_kv_tokens=6000))
    view = scheduler.view(snapshot, NOW)
    if legs is not None:
        view = dataclasses.replace(view, residents=StaticResidents(legs), load_memo={})
    return view


def test_b_holds_a_newcomer_to_its_own_target_not_the_queues_margin_under_theta() -> None:
    """The router queue offers yielding and late work on a neutral instance at 0.8 of its TPOT
    target. (b) holds the newcomer to θ times the need it will record as a resident (its own
    target), as it holds every resident: the ratio is the same as for the decision at its full
    target, not θ × 0.8 of it. A relaxed decision (the sa queue's) stays relaxed."""
    scheduler = make_scheduler("binpack", tpot_slo_ms=50.0, ttft_slo_ms=60_000.0)
    request = make_request("t", 800, tpot_slo_ms=40.0, ttft_slo_ms=600.0, expected_output_tokens=300)
    view = _view(scheduler)
    full = scheduler.context(view, request, targets=Targets(600.0, 40.0, 0.0, 600.0))
    margin = scheduler.context(view, request, targets=Targets(200.0, 32.0, 0.0, 600.0))
    relaxed = scheduler.context(view, request, targets=Targets(1e12, 1e12, 0.0, 600.0))
    horizon = float(full.metric("predicted_tpot_horizon")[0])
    assert float(full.metric("tpot_horizon_over_need")[0]) == pytest.approx(horizon / 40.0)
    assert float(margin.metric("tpot_horizon_over_need")[0]) == pytest.approx(horizon / 40.0)
    assert float(relaxed.metric("tpot_horizon_over_need")[0]) == pytest.approx(horizon / 1e12)


def _paced_leg(length: float | None, *, generated: float, remaining: float, spent_s: float) -> ResidentLegs:
    # A deadline's pace of 28 ms over θ = 0.7.
    return _leg(40.0, remaining=remaining, paced=True, generated=generated, spent_s=spent_s, length=length)


def _ctx(scheduler: Scheduler, legs: ResidentLegs) -> DecisionContext:
    return scheduler.context(_view(scheduler, legs), make_request("new", 1500, max_tokens=64))


def test_d_counts_a_paced_residents_decode_budget_up_to_the_length_its_pace_was_set_by() -> None:
    """A draft paced at 28 ms a token over its cautious length of 500 tokens has 28 × 499 ms to
    decode in. After 100 tokens in 3.0 s (30 ms each: behind that pace) with 200 expected to come at
    the γ-horizon step, its slack is that budget less what it spent and what the rest takes -- not the
    slack of a deadline at its expected length, which read it as nearly spent. Past its length (an
    answer longer than its bound) the deadline is nearer; without a recorded length (a source that
    records none) the slack is as before."""
    scheduler = make_scheduler("binpack", tpot_slo_ms=50.0, ttft_slo_ms=60_000.0)
    theta = scheduler.config.binpack_theta
    pace = 40.0 * theta
    unknown = _ctx(scheduler, _paced_leg(None, generated=100.0, remaining=200.0, spent_s=3.0))
    horizon = float(unknown.metric("predicted_tpot_horizon")[0])
    before = 99 * pace - 3000.0 + 200 * (pace - horizon)
    whole = pace * 499 - 3000.0 - 200 * horizon
    assert whole > before
    slack_unknown = float(atgt_slack_ms(unknown, 50.0, theta)[0])
    assert slack_unknown == (pytest.approx(before) if before > 0 else math.inf)
    long = _ctx(scheduler, _paced_leg(500.0, generated=100.0, remaining=200.0, spent_s=3.0))
    assert float(atgt_slack_ms(long, 50.0, theta)[0]) == pytest.approx(whole)
    past = _ctx(scheduler, _paced_leg(250.0, generated=100.0, remaining=200.0, spent_s=3.0))
    nearer = pace * 249 - 3000.0 - 200 * horizon
    assert float(atgt_slack_ms(past, 50.0, theta)[0]) == (pytest.approx(nearer) if nearer > 0 else math.inf)


def test_the_pacing_length_is_recorded_with_a_paced_resident_leg() -> None:
    account = InflightAccount(expiry_s=1.0)
    account.record(
        "a", "n", "n", 100, NOW, final_tokens=400, tpot_need_ms=30.0, tpot_paced=True, paced_tokens=480.0
    )
    account.record("b", "n", "n", 100, NOW, final_tokens=400, tpot_need_ms=40.0)
    legs = account.resident_legs({"n": 0}, 1)
    assert legs is not None and legs.paced_tokens is not None
    assert legs.paced_tokens[0] == 480.0 and np.isnan(legs.paced_tokens[1])
    account.release("a")
    legs = account.resident_legs({"n": 0}, 1)
    assert legs is not None and legs.paced_tokens is not None and np.isnan(legs.paced_tokens).all()


def _leg(
    need: float,
    *,
    remaining: float,
    paced: bool = False,
    generated: float = 100.0,
    spent_s: float = 3.0,
    length: float | None = math.nan,
) -> ResidentLegs:
    return ResidentLegs(
        np.zeros(1, dtype=np.intp),
        np.array([800.0 + generated]),
        np.array([remaining]),
        np.ones(1, dtype=bool),
        np.array([generated]),
        np.array([need]),
        np.array([paced]),
        np.array([NOW - spent_s]),
        None if length is None else np.array([length]),
    )


def _steps(ctx: DecisionContext) -> tuple[float, float]:
    """The γ-horizon step of instance 0 with the newcomer and without it."""
    assert ctx.predictors is not None
    table = ctx.view.instances
    without = ctx.predictors.decode_step_ms(
        table, ctx.metric("decode_batch_size"), ctx.metric("decode_tokens_horizon")
    )
    return float(ctx.metric("predicted_tpot_horizon")[0]), float(without[0])


def test_b_counts_a_short_newcomer_for_the_part_of_a_residents_remainder_it_shares() -> None:
    """A resident at TPOT 40 ms with 500 tokens to go decodes beside a 40-token answer for a
    twelfth of them: its mean step over its remainder rises by that share of the newcomer's part
    of the γ-horizon step, not by all of it. A newcomer as long as the resident's remainder counts
    whole, as before; the newcomer itself is held to its own target at the whole step."""
    scheduler = make_scheduler("binpack", tpot_slo_ms=50.0, ttft_slo_ms=60_000.0)
    legs = _leg(40.0, remaining=500.0)
    for out, share in ((40, 40 / 500), (800, 1.0)):
        request = make_request("s", 1200, tpot_slo_ms=60.0, ttft_slo_ms=300.0, expected_output_tokens=out)
        ctx = scheduler.context(_view(scheduler, legs), request)
        horizon, without = _steps(ctx)
        assert horizon > without
        expected = max((without + (horizon - without) * share) / 40.0, horizon / 60.0)
        assert float(ctx.metric("tpot_horizon_over_need")[0]) == pytest.approx(expected)
        if share < 1.0:
            assert expected < horizon / 40.0


def test_b_remakes_a_paced_residents_need_from_what_its_deadline_leaves_now() -> None:
    """A draft paced at 28 ms a token over its cautious length of 840 tokens (need 40 ms = 28 / θ),
    100 tokens in: (b) holds its instance to the pace its deadline leaves it now over the tokens
    left to that length; where its instance's step is past that pace already, to the pace over its
    expected remainder -- the rule a paced request's placement follows, with its progress -- but
    never to less than the need it recorded: behind its pace with the tail's pace still in reach, and
    out of reach for both lengths (a lost cause), it keeps the need it was placed with."""
    scheduler = make_scheduler("binpack", tpot_slo_ms=50.0, ttft_slo_ms=60_000.0)
    theta = scheduler.config.binpack_theta
    pace = 40.0 * theta
    newcomer = make_request("s", 1200, tpot_slo_ms=60.0, ttft_slo_ms=300.0, expected_output_tokens=2000)

    def ratio(spent_s: float, remaining: float) -> tuple[float, float, float]:
        legs = _leg(40.0, remaining=remaining, paced=True, spent_s=spent_s, length=840.0)
        ctx = scheduler.context(_view(scheduler, legs), newcomer)
        horizon, without = _steps(ctx)
        return float(ctx.metric("tpot_horizon_over_need")[0]), horizon, without

    # Ahead of its pace (1 s for 100 tokens): the tail's pace now is looser than the one it was set by.
    value, horizon, without = ratio(1.0, 400.0)
    tail = (pace * 839 - 1000.0) / 740
    assert tail > pace and tail >= without
    assert value == pytest.approx(max(horizon * theta / tail, horizon / 60.0))
    # Behind it so far that the tail's pace is under its instance's step, but the expected one is not.
    spent_s = (pace * 839 - (without - 2.0) * 740) / 1000.0
    value, horizon, _ = ratio(spent_s, 200.0)
    expected = (without - 2.0) * 740 / 200.0
    assert value == pytest.approx(max(horizon * theta / expected, horizon / 60.0))
    # Behind it, the tail's pace tighter than the one it was set by but within its instance's step:
    # the need it recorded, not the tighter one.
    assert without < pace
    behind = (without + pace) / 2.0
    value, horizon, _ = ratio((pace * 839 - behind * 740) / 1000.0, 400.0)
    assert value == pytest.approx(max(horizon / 40.0, horizon / 60.0))
    assert value < horizon * theta / behind
    # Both out of reach: the need it recorded (not the router's looser TPOT target).
    value, horizon, _ = ratio(22.0, 400.0)
    assert value == pytest.approx(horizon / 40.0)
