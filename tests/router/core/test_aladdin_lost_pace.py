"""binpack's (b) on a colocated instance and a deadline-paced resident its deadline has left behind:
it bounds its instance while another bin can take the prompt, and sets no bound when none can."""

from __future__ import annotations

import dataclasses

import pytest

from router.core.columns import ResidentLegs, StaticResidents
from router.core.decision import Decision
from router.core.scheduler import Scheduler
from tests.router.core.helpers import NOW, busy_paced_leg, inst, make_request, make_scheduler, make_snapshot


def _leg(*, spent_s: float, paced: bool = True) -> ResidentLegs:
    # One leg on "busy" (view index 0): need 20 ms (a 14 ms pace over θ = 0.7 when paced) over 150
    # tokens, 100 out, 50 expected to come. Spent 4.5 s, its deadline has nothing left for them.
    return busy_paced_leg(need_ms=20.0, spent_s=spent_s, paced=paced)


def _view(scheduler: Scheduler, legs: ResidentLegs, *, with_empty: bool):  # type: ignore[no-untyped-def]
    busy = inst("busy", "neutral", decode_requests=1, decode_tokens=900, used_kv_tokens=900)
    snapshot = make_snapshot(busy, inst("idle", "neutral")) if with_empty else make_snapshot(busy)
    view = scheduler.view(snapshot, NOW)
    assert view.instances.index["busy"] == 0
    return dataclasses.replace(view, residents=StaticResidents(legs), load_memo={})


REQUEST = make_request("new", 1500, max_tokens=64, tpot_slo_ms=50.0, ttft_slo_ms=60_000.0)


def _scheduler() -> Scheduler:
    return make_scheduler("binpack", tpot_slo_ms=50.0, ttft_slo_ms=60_000.0)


def _ratios(legs: ResidentLegs) -> tuple[float, float, float]:
    scheduler = _scheduler()
    ctx = scheduler.context(_view(scheduler, legs, with_empty=False), REQUEST)
    horizon = float(ctx.metric("predicted_tpot_horizon")[0])
    strict = float(ctx.metric("tpot_horizon_over_need")[0])
    live = float(ctx.metric("tpot_horizon_over_need_live")[0])
    return strict, live, horizon


def test_a_paced_resident_out_of_reach_of_its_deadline_sets_no_bound_in_the_live_form() -> None:
    strict, live, horizon = _ratios(_leg(spent_s=4.5))
    assert strict == pytest.approx(horizon / 20.0) and strict > 0.7
    assert live == pytest.approx(horizon / 50.0)  # the newcomer at its own target only


def test_a_resident_in_reach_or_judged_by_tpot_bounds_both_forms_alike() -> None:
    for legs in (_leg(spent_s=0.1), _leg(spent_s=4.5, paced=False)):
        strict, live, _ = _ratios(legs)
        assert live == pytest.approx(strict)


def _place(legs: ResidentLegs, *, with_empty: bool) -> Decision:
    scheduler = _scheduler()
    return scheduler.schedule(_view(scheduler, legs, with_empty=with_empty), REQUEST, NOW, dry_run=True)


def test_while_another_bin_can_take_the_prompt_the_lost_resident_still_bounds() -> None:
    decision = _place(_leg(spent_s=4.5), with_empty=True)
    assert decision.prefill is not None and decision.prefill.instance_id == "idle"


def test_without_another_bin_the_prompt_is_placed_beside_the_lost_resident() -> None:
    """Held at the pace it was placed with, the lost leg kept every prompt off its instance until it
    ended, and on a fixed fleet with no bin to open the prompts lapsed in the router queue."""
    decision = _place(_leg(spent_s=4.5), with_empty=False)
    assert decision.prefill is not None and decision.prefill.instance_id == "busy"
    assert decision.prefill.fallback_pass == 1
