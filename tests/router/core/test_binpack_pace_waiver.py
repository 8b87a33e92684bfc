"""binpack's (b) and a request judged by its e2e deadline alone that the router queue offers with its
own pace waived: it has waited its share of the queue while no TPOT-judged request waits there, and
it takes an instance whose residents keep their needs with it, where its own pace would hold it."""

from __future__ import annotations

import dataclasses
import math

import pytest

from router.core.columns import ClusterView, StaticResidents
from router.core.errors import NoInstanceError
from router.core.packing import resident_tpot_pacing
from router.core.queue import PACE_HOLD_SHARE, QueueConfig, RouterQueue, Verdict, offer
from router.core.request import ScheduleInput, Targets, resolve_targets
from router.core.scheduler import Scheduler
from tests.router.core.helpers import NOW, busy_paced_leg, inst, make_request, make_scheduler, make_snapshot

E2E_MS = 10_000.0
DEFAULT_TTFT, DEFAULT_TPOT = 6000.0, 50.0


def _refactor(waited_s: float, rid: str = "refactor") -> ScheduleInput:
    # Its deadline's pace over 300 tokens: about 26 ms after 2 s in the queue, under the 27 ms the
    # loaded instance's γ-horizon step comes to with it (and over the 13.5 ms of an idle one).
    return make_request(
        rid, 200, e2e_slo_ms=E2E_MS, expected_output_tokens=300, max_tokens=300, arrival_s=NOW - waited_s
    )


def _view(scheduler: Scheduler, resident_need_ms: float = 200.0) -> ClusterView:
    busy = inst(
        "busy", "neutral", decode_requests=12, decode_tokens=12_000, used_kv_tokens=12_000, running=12
    )
    view = scheduler.view(make_snapshot(busy), NOW)
    legs = busy_paced_leg(need_ms=resident_need_ms, spent_s=0.5, paced=False)
    return dataclasses.replace(view, residents=StaticResidents(legs), load_memo={})


def _targets(request: ScheduleInput, waived: bool) -> Targets:
    # As the router queue offers it (a loose bound: the TTFT bound plays no part here).
    return Targets(60_000.0, DEFAULT_TPOT, request.e2e_slo_ms, E2E_MS / 4, waived)


def _place(request: ScheduleInput, *, waived: bool, resident_need_ms: float = 200.0) -> str:
    scheduler = make_scheduler("binpack")
    view = _view(scheduler, resident_need_ms)
    decision = scheduler.schedule(view, request, NOW, dry_run=True, targets=_targets(request, waived))
    assert decision.prefill is not None
    return decision.prefill.instance_id


def test_held_by_its_own_pace_the_request_waits() -> None:
    with pytest.raises(NoInstanceError, match="tpot_horizon"):
        _place(_refactor(2.0), waived=False)


def test_with_its_pace_waived_it_takes_the_instance_its_residents_keep_their_needs_on() -> None:
    assert _place(_refactor(2.0), waived=True) == "busy"


def test_a_waived_request_still_keeps_a_tighter_residents_need() -> None:
    # A resident streaming at a 20 ms TPOT need: the step with the newcomer (27 ms) breaks it.
    with pytest.raises(NoInstanceError, match="tpot_horizon"):
        _place(_refactor(2.0), waived=True, resident_need_ms=20.0)


def test_a_waived_request_is_recorded_at_the_tpot_target_not_at_the_pace_it_was_not_given() -> None:
    scheduler = make_scheduler("binpack")
    view = _view(scheduler)
    request = _refactor(2.0)
    held = resident_tpot_pacing(
        scheduler.context(view, request, NOW, _targets(request, False)), scheduler.config
    )
    assert held[1] and held[0] < DEFAULT_TPOT  # its deadline's pace over θ
    need, paced, _ = resident_tpot_pacing(
        scheduler.context(view, request, NOW, _targets(request, True)), scheduler.config
    )
    assert (need, paced) == (scheduler.config.tpot_slo_ms, False)


def _stream_ratio(
    metric: str, *, waived: bool, tpot_ms: float = 30.0, resident_need_ms: float = 200.0, paced: bool = False
) -> float:
    scheduler = make_scheduler("binpack")
    busy = inst(
        "busy", "neutral", decode_requests=12, decode_tokens=12_000, used_kv_tokens=12_000, running=12
    )
    view = scheduler.view(make_snapshot(busy), NOW)
    legs = busy_paced_leg(need_ms=resident_need_ms, spent_s=0.5, paced=paced)
    view = dataclasses.replace(view, residents=StaticResidents(legs), load_memo={})
    stream = make_request("stream", 200, tpot_slo_ms=tpot_ms, max_tokens=300, arrival_s=NOW - 0.1)
    targets = Targets(60_000.0, tpot_ms, 0.0, DEFAULT_TTFT, waived)
    return float(scheduler.context(view, stream, NOW, targets).metric(metric)[0])


def test_a_stream_offered_without_its_margin_is_held_to_its_own_target_not_theta_of_it() -> None:
    theta = make_scheduler("binpack").config.binpack_theta
    held = _stream_ratio("tpot_horizon_over_need", waived=False)
    waived = _stream_ratio("tpot_horizon_over_need", waived=True)
    assert held > theta >= waived  # the γ-horizon step over θ of its 30 ms, within the 30 ms
    assert waived == pytest.approx(held * theta)


def test_a_waived_stream_holds_a_resident_stream_to_its_target_and_a_paced_one_to_its_pace() -> None:
    theta = make_scheduler("binpack").config.binpack_theta
    # The newcomer loose (200 ms): the resident's term binds.
    stream = _stream_ratio("tpot_horizon_over_need", waived=False, tpot_ms=200.0, resident_need_ms=33.0)
    eased = _stream_ratio("tpot_horizon_over_need", waived=True, tpot_ms=200.0, resident_need_ms=33.0)
    assert stream > theta >= eased and eased == pytest.approx(stream * theta)
    paced = [
        _stream_ratio("tpot_horizon_over_need", waived=w, tpot_ms=200.0, resident_need_ms=33.0, paced=True)
        for w in (False, True)
    ]
    # Its need is its pace over θ already: the waiver leaves its term (the one that binds) as it is.
    assert paced[0] == paced[1] > _stream_ratio("tpot_horizon_over_need", waived=True, tpot_ms=200.0)


def test_a_waived_streams_prefill_may_use_the_residents_whole_slack() -> None:
    theta = make_scheduler("binpack").config.binpack_theta
    held = _stream_ratio("prefill_over_atgt_slack", waived=False, resident_need_ms=40.0)
    waived = _stream_ratio("prefill_over_atgt_slack", waived=True, resident_need_ms=40.0)
    assert 0 < held < math.inf and waived == pytest.approx(held * theta)


# --------------------------------------------------------------------------- the router queue's side


def _queue() -> RouterQueue:
    return RouterQueue(QueueConfig(queue_policy="edf"), DEFAULT_TTFT, DEFAULT_TPOT)


def _waived(queue: RouterQueue, request: ScheduleInput, now_s: float = NOW) -> bool:
    entry = queue.get(request.request_id)
    assert entry is not None
    return queue.margin_waived(entry, resolve_targets(request, DEFAULT_TTFT, DEFAULT_TPOT), now_s)


def test_the_queue_waives_the_pace_after_its_share_of_the_ttft_target_with_no_stream_waiting() -> None:
    queue = _queue()
    request = _refactor(0.0)
    queue.push(request, NOW)
    hold_s = PACE_HOLD_SHARE * resolve_targets(request, DEFAULT_TTFT, DEFAULT_TPOT).full_ttft_ms * 1e-3
    assert not _waived(queue, request, NOW + 0.9 * hold_s)
    assert _waived(queue, request, NOW + hold_s)


def test_a_stream_waiting_on_time_or_late_keeps_the_pace() -> None:
    queue = _queue()
    request = _refactor(5.0)
    queue.push(request, NOW)
    queue.push(make_request("faq", 300, ttft_slo_ms=400.0, tpot_slo_ms=50.0, arrival_s=NOW), NOW)
    assert queue.streams == 1 and not _waived(queue, request)
    queue.mark_late("faq", NOW)
    assert queue.streams == 1 and not _waived(queue, request)
    queue.remove("faq")
    assert queue.streams == 0 and _waived(queue, request)


def test_once_the_waiting_stream_is_placed_the_pace_is_waived_again() -> None:
    queue = _queue()
    request = _refactor(5.0)
    queue.push(request, NOW - 5.0)
    queue.push(
        make_request("review", 3000, ttft_slo_ms=2000.0, tpot_slo_ms=90.0, arrival_s=NOW - 1.0), NOW - 1.0
    )
    assert not _waived(queue, request)
    queue.remove("review")
    assert _waived(queue, request)


def test_a_stream_is_offered_without_its_margin_once_what_it_can_wait_is_half_its_target() -> None:
    queue = _queue()
    stream = make_request("completion", 1200, ttft_slo_ms=300.0, tpot_slo_ms=35.0, arrival_s=NOW)
    queue.push(stream, NOW)
    entry = queue.get("completion")
    assert entry is not None
    targets = resolve_targets(stream, DEFAULT_TTFT, DEFAULT_TPOT)
    # 300 ms less a 140 ms prefill: 160 ms to wait at best, over the 150 ms hold.
    assert not queue.margin_waived(entry, targets, NOW, own_ms=140.0)
    assert queue.margin_waived(entry, targets, NOW, own_ms=150.0)
    # Without its prefill's estimate (late, yielding, no predictor) it keeps the margin.
    assert not queue.margin_waived(entry, targets, NOW)
    # A loose stream (2 s) waits for room until its own budget says it cannot.
    loose = make_request("review", 3000, ttft_slo_ms=2000.0, tpot_slo_ms=90.0, arrival_s=NOW)
    queue.push(loose, NOW)
    review = queue.get("review")
    assert review is not None
    assert not queue.margin_waived(
        review, resolve_targets(loose, DEFAULT_TTFT, DEFAULT_TPOT), NOW, own_ms=400.0
    )
    spent = Targets(1300.0, 90.0, 0.0, 2000.0)  # 700 ms of it spent waiting
    assert queue.margin_waived(review, spent, NOW + 0.7, own_ms=400.0)


def _offer_once(queue: RouterQueue) -> Verdict:
    scheduler = make_scheduler("binpack")
    view = _view(scheduler)
    verdicts = {o.entry.request_id: o.verdict for o in offer(queue, scheduler, lambda: view, NOW)}
    return verdicts["refactor"]


def test_offered_with_its_pace_waived_the_request_is_dispatched() -> None:
    queue = _queue()
    queue.push(_refactor(2.0), NOW - 2.0)
    assert _offer_once(queue) is Verdict.DISPATCH


def test_with_a_stream_waiting_behind_it_the_request_keeps_waiting() -> None:
    queue = _queue()
    queue.push(_refactor(2.0), NOW - 2.0)
    # A loose stream (a TTFT deadline a minute away) queued behind it in deadline order.
    queue.push(make_request("digest", 300, ttft_slo_ms=60_000.0, tpot_slo_ms=90.0, arrival_s=NOW), NOW)
    assert _offer_once(queue) is Verdict.WAIT
