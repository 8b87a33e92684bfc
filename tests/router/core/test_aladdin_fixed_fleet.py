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
    return ResidentLegs(
        np.zeros(1, dtype=np.intp),
        np.array([800.0 + generated]),
        np.array([remaining]),
        np.ones(1, dtype=bool),
        np.array([generated]),
        np.array([40.0]),  # a deadline's pace of 28 ms over θ = 0.7
        np.array([True]),
        np.array([NOW - spent_s]),
        None if length is None else np.array([length]),
    )


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
