"""binpack's (b) and a request judged by its e2e deadline alone that the router queue offers with its
own pace waived: it has waited its share of the queue while no TPOT-judged request waits there, and
it takes an instance whose residents keep their needs with it, where its own pace would hold it."""

from __future__ import annotations

import dataclasses

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


def test_the_waiver_does_not_reach_a_tpot_judged_request() -> None:
    scheduler = make_scheduler("binpack")
    view = _view(scheduler)
    stream = make_request("stream", 200, tpot_slo_ms=30.0, max_tokens=300, arrival_s=NOW - 2.0)
    ratios = []
    for waived in (False, True):
        targets = Targets(60_000.0, 30.0, 0.0, DEFAULT_TTFT, waived)
        ratios.append(
            float(scheduler.context(view, stream, NOW, targets).metric("tpot_horizon_over_need")[0])
        )
    assert ratios[0] == ratios[1] > 0.7


# --------------------------------------------------------------------------- the router queue's side


def _queue() -> RouterQueue:
    return RouterQueue(QueueConfig(queue_policy="edf"), DEFAULT_TTFT, DEFAULT_TPOT)


def _waived(queue: RouterQueue, request: ScheduleInput, now_s: float = NOW) -> bool:
    entry = queue.get(request.request_id)
    assert entry is not None
    return queue.pace_waived(entry, resolve_targets(request, DEFAULT_TTFT, DEFAULT_TPOT), now_s)


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


def test_a_stream_that_waited_keeps_the_pace_for_a_hold_after_it_left() -> None:
    queue = _queue()
    request = _refactor(5.0)
    queue.push(request, NOW - 5.0)
    queue.push(
        make_request("review", 3000, ttft_slo_ms=2000.0, tpot_slo_ms=90.0, arrival_s=NOW - 1.0), NOW - 1.0
    )
    assert not _waived(queue, request)  # it waits, queued a second ago: seen waiting now
    queue.remove("review")
    hold_s = PACE_HOLD_SHARE * resolve_targets(request, DEFAULT_TTFT, DEFAULT_TPOT).full_ttft_ms * 1e-3
    assert not _waived(queue, request, NOW + 0.9 * hold_s)
    assert _waived(queue, request, NOW + 1.01 * hold_s)


def test_a_stream_placed_as_it_arrived_did_not_wait() -> None:
    queue = _queue()
    request = _refactor(5.0)
    queue.push(request, NOW - 5.0)
    queue.push(make_request("faq", 300, ttft_slo_ms=400.0, tpot_slo_ms=50.0, arrival_s=NOW), NOW)
    queue.note_streams(NOW)  # an offer pass at its arrival, which places it
    queue.remove("faq")
    assert _waived(queue, request)


def test_a_tpot_judged_entry_is_never_waived() -> None:
    queue = _queue()
    stream = make_request("review", 3000, ttft_slo_ms=2000.0, tpot_slo_ms=90.0, arrival_s=NOW - 10.0)
    queue.push(stream, NOW - 10.0)
    assert not _waived(queue, stream)


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
