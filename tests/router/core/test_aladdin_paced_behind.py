"""binpack's (d) and a deadline-paced resident already behind its pace: it bounds its instance while
another bin (an empty instance) can take the prompt, and sets no bound when none can."""

from __future__ import annotations

import dataclasses

from router.core.columns import ResidentLegs, StaticResidents
from router.core.decision import Decision
from router.core.scheduler import Scheduler
from tests.router.core.helpers import NOW, busy_paced_leg, inst, make_request, make_scheduler, make_snapshot


def _behind(paced: bool) -> ResidentLegs:
    # One leg on "busy" (view index 0): need 40 ms over θ = 0.7 (a 28 ms pace when paced) over a
    # cautious length of 150 tokens; 100 tokens out in 4.5 s (45 ms each) with 50 to come: its
    # slack is gone whatever is placed beside it.
    return busy_paced_leg(need_ms=40.0, spent_s=4.5, paced=paced)


def _place(scheduler: Scheduler, legs: ResidentLegs, *, with_empty: bool) -> Decision:
    busy = inst("busy", "neutral", decode_requests=1, decode_tokens=900, used_kv_tokens=900)
    snapshot = make_snapshot(busy, inst("idle", "neutral")) if with_empty else make_snapshot(busy)
    view = scheduler.view(snapshot, NOW)
    assert view.instances.index["busy"] == 0
    view = dataclasses.replace(view, residents=StaticResidents(legs), load_memo={})
    # A TPOT-judged prompt of 1,500 tokens that (b), (c) and (e) let onto either instance.
    request = make_request("new", 1500, max_tokens=64, tpot_slo_ms=50.0, ttft_slo_ms=60_000.0)
    return scheduler.schedule(view, request, NOW, dry_run=True)


def test_a_paced_resident_behind_its_pace_sends_a_prompt_to_a_new_bin() -> None:
    """Best fit prefers the fuller instance; with the paced leg there behind its pace (d) refuses it
    while an empty instance (Aladdin's new bin) can take the prompt. Left unbounded, the prompt's
    chunks joined its steps, and at 64 neutral instances (`mixed`, seed 17, 12 req/s) binpack kept
    12 busy and missed 27 of 125 code deadlines (94.3 %, `plan` found no fleet); JSQ missed 4."""
    scheduler = make_scheduler("binpack", tpot_slo_ms=50.0, ttft_slo_ms=60_000.0)
    decision = _place(scheduler, _behind(paced=True), with_empty=True)
    assert decision.prefill is not None and decision.prefill.instance_id == "idle"


def test_without_another_bin_the_paced_resident_behind_sets_no_bound() -> None:
    """On a fleet with no instance (d) admits at first, the lost leg sets no bound, as before: the
    prompt is placed beside it rather than waiting until it ends."""
    scheduler = make_scheduler("binpack", tpot_slo_ms=50.0, ttft_slo_ms=60_000.0)
    decision = _place(scheduler, _behind(paced=True), with_empty=False)
    assert decision.prefill is not None and decision.prefill.instance_id == "busy"


def test_a_tpot_judged_resident_behind_still_sets_no_bound() -> None:
    """Only deadline-paced legs bound their instance when behind: a TPOT-judged leg behind its
    target leaves the prompt to best fit, the fuller instance."""
    scheduler = make_scheduler("binpack", tpot_slo_ms=50.0, ttft_slo_ms=60_000.0)
    decision = _place(scheduler, _behind(paced=False), with_empty=True)
    assert decision.prefill is not None and decision.prefill.instance_id == "busy"
