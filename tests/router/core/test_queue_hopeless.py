"""Hopeless requests turn late at once: the fleet drain's best case, early late verdicts, their properties."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet.prefix import token_block_hashes
from router.core.columns import ClusterView
from router.core.errors import EmptyClusterError, LateError
from router.core.queue import (
    LATE_TPOT_FRACTION,
    FleetDrain,
    QueueConfig,
    RouterQueue,
    Verdict,
    hopeless,
    offer,
)
from router.core.request import ScheduleInput, resolve_targets
from tests.router.core.helpers import NOW, inst, make_request, make_scheduler, make_snapshot

PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DEFAULT_TTFT, DEFAULT_TPOT = 6000.0, 50.0


def make_queue(policy: str = "edf", **kw: Any) -> RouterQueue:
    return RouterQueue(QueueConfig(queue_policy=policy, **kw), DEFAULT_TTFT, DEFAULT_TPOT)


def req(rid: str, *, arrival: float = NOW, **kw: Any) -> ScheduleInput:
    return make_request(rid, arrival_s=arrival, **kw)


def _drain(snapshot: Any, now: float = NOW) -> FleetDrain:
    s = make_scheduler()
    drain = FleetDrain.of(s, s.view(snapshot, now), now)
    assert drain is not None
    return drain


# --------------------------------------------------------------------------- the drain model


def test_drain_start_is_the_first_free_instance_then_grows_with_the_work_ahead() -> None:
    idle = make_snapshot(inst("p0", "prefill"), inst("p1", "prefill"), inst("d0", "decode"))
    busy = make_snapshot(
        inst("p0", "prefill", prefill_tokens=8192), inst("p1", "prefill"), inst("d0", "decode")
    )
    d_idle, d_busy = _drain(idle), _drain(busy)
    assert d_idle.start_ms(0) == 0.0 and d_busy.start_ms(0) == 0.0  # p1 is free now
    # Work ahead shares the two idle instances; with one busy, the first tokens go to p1 alone.
    assert 0 < d_idle.start_ms(4096) < d_busy.start_ms(4096)
    assert d_idle.start_ms(8192) == pytest.approx(2 * d_idle.start_ms(4096))
    # The own prefill on an idle instance: the profile's (256 tokens: 60 ms in the worked profile).
    assert d_idle.idle_ms(256) == pytest.approx(60.0)
    assert d_idle.min_tpot_ms(256) > 0


def test_a_mostly_cached_prompt_is_judged_by_its_uncached_part() -> None:
    # 16k tokens prefilled in full miss a 600 ms TTFT even on an idle fleet; with all but its last
    # block cached on p0 (as the router knows it) its best case is a few hundred tokens' prefill.
    s = make_scheduler(prefix_cache_routing="approximate", prefix_block_tokens=256)
    snapshot = make_snapshot(inst("p0", "prefill"), inst("p1", "prefill"), inst("d0", "decode"))
    hashes = token_block_hashes(list(range(16_384)), 256)
    r = req("r", prompt_tokens=16_384, ttft_slo_ms=600.0, tpot_slo_ms=1000.0, prefix_hashes=hashes)
    targets = resolve_targets(r, DEFAULT_TTFT, DEFAULT_TPOT, NOW)
    drain = FleetDrain.of(s, s.view(snapshot, NOW), NOW)
    assert drain is not None and hopeless(drain, r, targets, 0, NOW) is not None
    assert s.prefix is not None
    s.prefix.dispatched("p0", hashes[:-1], 1_000_000)
    drain = FleetDrain.of(s, s.view(snapshot, NOW), NOW)
    assert drain is not None and drain.compute_tokens(r) == 256
    assert hopeless(drain, r, targets, 0, NOW) is None


def test_no_drain_without_a_prefill_or_decode_side() -> None:
    s = make_scheduler()
    only_decode = make_snapshot(inst("d0", "decode"))
    assert FleetDrain.of(s, s.view(only_decode, NOW), NOW) is None
    no_predictors = make_scheduler("round-robin", predictors=None)
    snap = make_snapshot(inst("p0", "prefill"), inst("d0", "decode"))
    assert FleetDrain.of(no_predictors, no_predictors.view(snap, NOW), NOW) is None


def _capacity(free: np.ndarray, rate: np.ndarray, t: float) -> float:
    return float(np.sum(rate * np.maximum(t - free, 0.0)))


@PROPS
@given(
    instances=st.lists(
        st.tuples(st.floats(0.0, 5000.0), st.floats(0.5, 50.0)), min_size=1, max_size=6
    ),  # (free at ms, tokens per ms)
    ahead=st.floats(0.0, 200_000.0),
)
def test_drain_start_is_the_earliest_time_the_fleet_has_taken_the_work_ahead(
    instances: list[tuple[float, float]], ahead: float
) -> None:
    """start_ms(A) is the smallest t with sum(rate * max(t - free, 0)) >= A (checked against bisection)."""
    free = np.array([f for f, _ in instances])
    rate = np.array([r for _, r in instances])
    drain = FleetDrain(free, rate, lambda _p: 0.0, lambda _c: 0.0)
    t = drain.start_ms(ahead)
    assert t >= float(free.min()) - 1e-9
    assert _capacity(free, rate, t) == pytest.approx(ahead, rel=1e-9, abs=1e-6)
    lo, hi = float(free.min()), float(free.max()) + ahead / float(rate.sum()) + 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _capacity(free, rate, mid) < ahead else (lo, mid)
    assert t == pytest.approx(hi, rel=1e-6, abs=1e-6)
    assert drain.start_ms(ahead + 1.0) >= t  # more work ahead never starts earlier


# --------------------------------------------------------------------------- early late verdicts


def _pd(prefill_tokens: int = 0) -> Any:
    return make_snapshot(inst("p0", "prefill", prefill_tokens=prefill_tokens), inst("d0", "decode"))


def test_request_behind_a_long_queue_turns_late_at_enqueue_not_at_its_deadline() -> None:
    for late_policy, verdict in (("serve", Verdict.LATE), ("reject", Verdict.REJECT)):
        q = make_queue("fcfs", late_policy=late_policy)
        for k in range(6):
            q.push(req(f"big{k}", prompt_tokens=8000, ttft_slo_ms=60_000.0), NOW)
        q.push(req("tight", prompt_tokens=256, ttft_slo_ms=1000.0), NOW)
        s = make_scheduler()
        results = {r.entry.request_id: r for r in offer(q, s, lambda: _pd(), NOW)}
        tight = results["tight"]
        assert tight.verdict is verdict
        assert tight.hopeless is not None
        assert tight.predicted_ttft_ms > 1000.0 and tight.budget_ms == pytest.approx(1000.0)
        if verdict is Verdict.REJECT:
            assert isinstance(tight.error, LateError)
            assert "TTFT target of 1000 ms" in str(tight.error) and "queued in front" in str(tight.error)
            assert "tight" not in q
        else:
            entry = q.get("tight")
            assert entry is not None and entry.late


def test_e2e_target_out_of_reach_at_any_pace_turns_late_at_once() -> None:
    q = make_queue("edf", late_policy="reject")
    # 600 tokens at >= 10 ms a step (the worked profile) cannot finish within 2 s.
    q.push(req("long", prompt_tokens=256, e2e_slo_ms=2000.0, max_tokens=600), NOW)
    (result,) = list(offer(q, make_scheduler(), lambda: _pd(), NOW))
    assert result.verdict is Verdict.REJECT and result.hopeless is not None
    assert result.hopeless.predicted_e2e_ms > 2000.0
    assert "e2e target of 2000 ms" in str(result.error)


def test_request_that_fits_on_an_idle_fleet_is_not_flagged() -> None:
    q = make_queue("edf", late_policy="reject")
    q.push(req("ok", prompt_tokens=1024, ttft_slo_ms=500.0, e2e_slo_ms=20_000.0, max_tokens=100), NOW)
    (result,) = list(offer(q, make_scheduler(), lambda: _pd(), NOW))
    assert result.verdict is Verdict.DISPATCH and result.hopeless is None


def test_long_prompt_yielding_to_tight_traffic_takes_an_idle_instance() -> None:
    """Release control caps a loose request at half the tightest recent target; a prompt whose own
    prefill is over that cap still goes to an idle instance while another one stays idle, instead of
    waiting out its deadline."""

    def fleet(p1_backlog: int) -> Any:
        return make_snapshot(
            inst("p0", "prefill"), inst("p1", "prefill", prefill_tokens=p1_backlog), inst("d0", "decode")
        )

    def one(snapshot: Any) -> Any:
        q = make_queue("edf")
        q.observe_arrival(req("chat", ttft_slo_ms=200.0))  # cap for looser work: 0.5 * 200 = 100 ms
        q.observe_arrival(req("doc", prompt_tokens=1024, ttft_slo_ms=5000.0))
        q.push(req("doc", prompt_tokens=1024, ttft_slo_ms=5000.0), NOW)  # 180 ms prefill when idle
        (result,) = list(offer(q, make_scheduler(), lambda: snapshot, NOW))
        return result

    result = one(fleet(0))
    assert result.verdict is Verdict.DISPATCH and not result.entry.late
    assert result.decision is not None  # ... held to its own TPOT target, as any on-time request
    assert result.decision.context.tpot_slo_ms == pytest.approx(DEFAULT_TPOT)
    # The other instance is past the 100 ms limit (170 ms of backlog): it still yields.
    assert one(fleet(1024)).verdict is Verdict.WAIT
    # A nearly idle instance is enough of a reserve: it goes although no other instance is idle (the
    # old rule kept the only idle prefill instance empty, and so the engines idle near capacity).
    assert _drain(fleet(256)).free_within(100.0) == 2 and _drain(fleet(256)).idle_instances == 1
    busy = one(fleet(256))
    assert busy.verdict is Verdict.DISPATCH and busy.decision is not None
    assert busy.decision.prefill is not None and busy.decision.prefill.instance_id == "p0"


def test_yielding_and_late_work_take_no_placement_that_relaxes_a_filter() -> None:
    """The decoder's KV is past the headroom were both its residents at their final length at once
    (1100 + 500 of growth + 512), within it at their exact peak (1140 + 512 < 1900): only slo's
    fallback pass, which drops the sums' bound, places decode there. An on-time request takes it
    (as plain slo would), late or yielding work waits instead."""
    s = make_scheduler()
    residents = {"old-a": 480, "old-b": 20}  # 300-token prompts, 500-token answers, tokens generated
    for rid in residents:
        s.inflight.record(rid, None, "d0", 300, NOW - 1, final_tokens=800)
    snap = make_snapshot(
        inst("p0", "prefill"),
        inst("p1", "prefill"),
        inst(
            "d0",
            "decode",
            meta={"kv_capacity_tokens": 2000},
            used_kv_tokens=1100,
            decode_tokens=1100,
            decode_requests=2,
            running=2,
            admitted=list(residents),
        ),
    )
    s.inflight.reconcile(snap)
    for rid, generated in residents.items():
        s.inflight.advance(rid, 300 + generated)
    on_time = make_queue("edf")
    on_time.push(req("chat", prompt_tokens=256, max_tokens=256, ttft_slo_ms=1000.0), NOW)
    (result,) = list(offer(on_time, s, lambda: snap, NOW))
    assert result.verdict is Verdict.DISPATCH
    assert result.decision is not None and result.decision.decode is not None
    assert result.decision.decode.fallback_pass == 1

    late = make_queue("edf")
    late.push(req("old", prompt_tokens=256, max_tokens=256, ttft_slo_ms=1000.0), NOW)
    late.mark_late("old")
    (result,) = list(offer(late, s, lambda: snap, NOW))
    assert result.verdict is Verdict.WAIT and "old" in late

    yielding = make_queue("edf")
    yielding.observe_arrival(req("chat", ttft_slo_ms=200.0))  # cap for looser work: 100 ms
    yielding.push(req("doc", prompt_tokens=1024, max_tokens=256, ttft_slo_ms=5000.0), NOW)
    (result,) = list(offer(yielding, s, lambda: snap, NOW))
    assert result.verdict is Verdict.WAIT and "doc" in yielding
    # With room in the decoder's KV both go, without a relaxed filter.
    roomy = make_snapshot(inst("p0", "prefill"), inst("p1", "prefill"), inst("d0", "decode"))
    (result,) = list(offer(late, s, lambda: roomy, NOW))
    assert result.verdict is Verdict.DISPATCH and result.decision is not None
    assert result.decision.decode is not None and result.decision.decode.fallback_pass == 0


def test_late_work_on_a_neutral_instance_keeps_clear_of_its_tpot_target() -> None:
    """On neutral instances a late request's prefill runs between the decode steps there: it is held to
    LATE_TPOT_FRACTION of its TPOT target, where on a PD fleet it keeps the whole target."""
    q = make_queue("edf")
    q.push(req("old", prompt_tokens=256, ttft_slo_ms=1000.0), NOW)
    q.mark_late("old")
    (result,) = list(offer(q, make_scheduler(), lambda: make_snapshot(inst("n0"), inst("n1")), NOW))
    assert result.verdict is Verdict.DISPATCH and result.decision is not None
    assert result.decision.context.tpot_slo_ms == pytest.approx(LATE_TPOT_FRACTION * DEFAULT_TPOT)
    q.push(req("pd", prompt_tokens=256, ttft_slo_ms=1000.0), NOW)
    q.mark_late("pd")
    pd = make_snapshot(inst("p0", "prefill"), inst("d0", "decode"))
    (result,) = list(offer(q, make_scheduler(), lambda: pd, NOW))
    assert result.verdict is Verdict.DISPATCH and result.decision is not None
    assert result.decision.context.tpot_slo_ms == pytest.approx(DEFAULT_TPOT)


# --------------------------------------------------------------------------- properties

requests = st.lists(
    st.tuples(
        st.sampled_from([64, 256, 1024, 4000]),  # prompt tokens
        st.sampled_from([0.0, 150.0, 600.0, 3000.0]),  # TTFT target (0: default or e2e-derived)
        st.sampled_from([0.0, 1500.0, 8000.0]),  # e2e target
        st.sampled_from([16, 128, 600]),  # max tokens
        st.integers(0, 2),  # priority
        st.floats(0.0, 0.3),  # arrival step (s)
    ),
    min_size=1,
    max_size=14,
)


@PROPS
@given(
    policy=st.sampled_from(["fcfs", "edf", "priority"]),
    late_policy=st.sampled_from(["serve", "reject"]),
    backlogs=st.lists(st.sampled_from([0, 512, 4096, 20000]), min_size=1, max_size=3),
    script=requests,
    passes=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=4),
)
def test_early_late_verdicts_are_hopeless_in_the_model_and_nothing_is_lost_or_dispatched_twice(
    policy: str,
    late_policy: str,
    backlogs: list[int],
    script: list[tuple[int, float, float, int, int, float]],
    passes: list[float],
) -> None:
    s = make_scheduler()
    q = make_queue(policy, late_policy=late_policy, max_queue_wait_ms=30_000.0)
    snap = make_snapshot(
        *(inst(f"p{k}", "prefill", prefill_tokens=b) for k, b in enumerate(backlogs)), inst("d0", "decode")
    )
    now = NOW
    pushed: list[str] = []
    for k, (prompt, ttft, e2e, max_tokens, priority, step) in enumerate(script):
        now += step
        r = ScheduleInput(
            f"r{k}",
            prompt,
            ttft_slo_ms=ttft,
            e2e_slo_ms=e2e,
            max_tokens=max_tokens,
            priority=priority,
            arrival_s=now,
        )
        q.observe_arrival(r)
        _, shed = q.push(r, now)
        assert not shed
        pushed.append(r.request_id)
    ended: dict[str, Verdict] = {}
    for step in passes:
        now += step
        view = s.view(snap, now)
        floor_drain = FleetDrain.of(s, view, now)
        assert floor_drain is not None
        for result in offer(q, s, lambda: snap, now):
            rid = result.entry.request_id
            assert rid not in ended, f"{rid} left the queue twice"
            if result.verdict is Verdict.DISPATCH:
                assert result.decision is not None
                s.record(result.decision, now)
            if result.verdict in (Verdict.DISPATCH, Verdict.REJECT, Verdict.EXPIRED):
                ended[rid] = result.verdict
                assert rid not in q
            why = result.hopeless
            if why is None:
                continue
            # Flagged hopeless: its best case misses a target in the model's own prediction ...
            assert result.verdict is (Verdict.REJECT if late_policy == "reject" else Verdict.LATE)
            ttft_miss = why.predicted_ttft_ms > why.budget_ms
            e2e_miss = why.e2e_ms == why.e2e_ms and why.predicted_e2e_ms > why.e2e_ms
            assert ttft_miss or e2e_miss
            # ... that best case is at least its own prefill on the fastest idle instance ...
            request = result.entry.request
            assert why.predicted_ttft_ms >= floor_drain.idle_ms(request.prompt_tokens) - 1e-9
            # ... and the budget is the one the request really has left now.
            targets = resolve_targets(request, DEFAULT_TTFT, DEFAULT_TPOT, now)
            assert why.budget_ms == pytest.approx(targets.ttft_ms)
            if late_policy == "serve":
                entry = q.get(rid)
                assert entry is not None and entry.late
        # Nothing lost: every request is still queued or ended exactly once.
        queued = {e.request_id for e in q.entries()}
        assert queued.isdisjoint(ended)
        assert queued | set(ended) == set(pushed)
        assert len(queued) == len(q)


@PROPS
@given(prompt=st.sampled_from([64, 256, 1024]), ttft=st.floats(300.0, 5000.0))
def test_sole_request_that_fits_an_idle_fleet_is_never_hopeless(prompt: int, ttft: float) -> None:
    s = make_scheduler()
    snap = _pd()
    drain = FleetDrain.of(s, s.view(snap, NOW), NOW)
    assert drain is not None
    q = make_queue("edf", late_policy="reject")
    q.push(req("r", prompt_tokens=prompt, ttft_slo_ms=ttft), NOW)
    (result,) = list(offer(q, s, lambda: snap, NOW))
    assert result.hopeless is None
    assert result.verdict is (Verdict.DISPATCH if drain.idle_ms(prompt) < ttft else Verdict.REJECT)
    assert math.isfinite(drain.idle_ms(prompt))


def test_drain_of_a_view_matches_the_snapshot_path() -> None:
    s = make_scheduler()
    snap = _pd(prefill_tokens=4096)
    view = s.view(snap, NOW)
    assert isinstance(view, ClusterView)
    a = FleetDrain.of(s, view, NOW)
    assert a is not None
    assert a.start_ms(1000) > a.start_ms(0) > 0


def test_new_request_deep_in_the_queue_is_judged_when_it_arrives() -> None:
    """Offer passes stop deciding after ``max_failures`` waits, but a newcomer behind them is still
    judged against the work in front of it; without a newcomer the full scan runs only every so often."""
    q = make_queue("fcfs", late_policy="reject")
    q.observe_arrival(req("chat", ttft_slo_ms=200.0))  # release limit for looser work: 100 ms
    snap = _pd(prefill_tokens=2000)
    s = make_scheduler()
    for k in range(10):  # each waits: its prefill behind the backlog is over the limit
        q.push(req(f"doc{k}", prompt_tokens=4000, ttft_slo_ms=60_000.0), NOW)
    first = list(offer(q, s, lambda: snap, NOW, max_failures=2))
    assert [r.verdict for r in first] == [Verdict.WAIT, Verdict.WAIT]
    q.push(req("tight", prompt_tokens=256, ttft_slo_ms=2000.0), NOW)
    results = list(offer(q, s, lambda: snap, NOW, max_failures=2))
    assert [(r.entry.request_id, r.verdict) for r in results] == [
        ("doc0", Verdict.WAIT),
        ("doc1", Verdict.WAIT),
        ("tight", Verdict.REJECT),
    ]
    assert results[-1].hopeless is not None and results[-1].predicted_ttft_ms > 2000.0
    # Alone at the head of the same fleet it would have fitted: the work in front is what fails it.
    alone = make_queue("fcfs", late_policy="reject")
    alone.push(req("tight", prompt_tokens=256, ttft_slo_ms=2000.0), NOW)
    assert [r.verdict for r in offer(alone, make_scheduler(), lambda: snap, NOW)] == [Verdict.DISPATCH]


def test_drain_rate_is_measured_only_while_the_fleet_limited_dispatch() -> None:
    """The rate counts the time after a pass the fleet limited (note_pass) up to the next pass, and
    the dispatches of that next pass; a stretch the queue held for its own reasons counts for nothing."""
    q = make_queue("fcfs", drain_window_ms=1000.0)
    assert q.drain_rate(NOW) is None
    q.push(req("a", ttft_slo_ms=60_000.0), NOW)
    q.note_pass(NOW, fleet_limited=True)
    q.note_backlog(NOW + 0.05)
    q.note_dispatch(NOW + 0.05, 1000)
    q.note_pass(NOW + 0.05, fleet_limited=True)
    assert q.drain_rate(NOW + 0.05) is None  # limited for under a tenth of the window
    q.note_backlog(NOW + 0.5)
    q.note_dispatch(NOW + 0.5, 4000)
    q.note_pass(NOW + 0.5, fleet_limited=False)  # the queue's own hold from here on
    assert q.drain_rate(NOW + 0.5) == pytest.approx(5000 / 500.0)  # tokens per ms of limited time
    q.note_backlog(NOW + 0.9)
    q.note_dispatch(NOW + 0.9, 100_000)  # ends a stretch the fleet did not limit: not counted
    q.note_pass(NOW + 0.9, fleet_limited=True)
    assert q.drain_rate(NOW + 0.9) == pytest.approx(5000 / 500.0)
    assert q.drain_rate(NOW + 2.0) is None  # the limited stretches left the window
    q.remove("a")
    q.note_backlog(NOW + 2.0)  # nothing on time waits: the time since counts for nothing
    assert q.drain_rate(NOW + 2.0) is None
    off = make_queue("fcfs", drain_window_ms=0.0)
    off.push(req("a", ttft_slo_ms=60_000.0), NOW)
    off.note_pass(NOW, fleet_limited=True)
    off.note_backlog(NOW + 5.0)
    off.note_dispatch(NOW + 5.0, 1000)
    assert off.drain_rate(NOW + 5.0) is None


def test_the_queue_drain_is_measured_in_entries_too_and_the_sooner_unit_counts() -> None:
    """Over the same fleet-limited time the queue counts its dispatches as well as their tokens; the
    work ahead takes the sooner of tokens / token rate and entries / entry rate (never less than the
    fleet's full prefill rate allows). Decode-limited, a queue that dispatched mostly cached prompts
    (a few hundred tokens each) does not charge a cold prompt in front its tokens at that rate."""
    q = make_queue("fcfs", drain_window_ms=1000.0)
    q.push(req("a", ttft_slo_ms=60_000.0), NOW)
    assert q.drain_request_rate(NOW) is None
    q.note_pass(NOW, fleet_limited=True)
    q.note_backlog(NOW + 0.5)
    for _ in range(5):  # five mostly cached prompts dispatched in 500 ms of fleet-limited time
        q.note_dispatch(NOW + 0.5, 200)
    assert q.drain_rate(NOW + 0.5) == pytest.approx(1000 / 500.0)  # 2 tokens per ms
    assert q.drain_request_rate(NOW + 0.5) == pytest.approx(5 / 500.0)  # one entry per 100 ms
    idle = make_snapshot(inst("p0", "prefill"), inst("p1", "prefill"), inst("d0", "decode"))
    s = make_scheduler()
    view = s.view(idle, NOW + 0.5)
    drain = FleetDrain.of(s, view, NOW + 0.5, q.drain_rate(NOW + 0.5), q.drain_request_rate(NOW + 0.5))
    assert drain is not None
    # One cold 4,000-token prompt in front: 2,000 ms at the token rate, 100 ms at the entry rate.
    assert drain.start_ms(4000) == pytest.approx(2000.0)  # entries unknown: tokens alone, as before
    assert drain.start_ms(4000, 1) == pytest.approx(max(100.0, drain.fluid_start_ms(4000)))
    # Forty small entries (40 x 50 tokens): the token rate is the sooner one.
    assert drain.start_ms(2000, 40) == pytest.approx(1000.0)
    # A request with a 1 s target behind that cold prompt is not hopeless; by tokens alone it was.
    targets = resolve_targets(req("r", prompt_tokens=256, ttft_slo_ms=1000.0), DEFAULT_TTFT, DEFAULT_TPOT)
    r = req("r", prompt_tokens=256, ttft_slo_ms=1000.0)
    assert hopeless(drain, r, targets, 4000, NOW + 0.5) is not None
    assert hopeless(drain, r, targets, 4000, NOW + 0.5, 1) is None


def test_a_pass_held_by_release_control_does_not_measure_the_drain() -> None:
    """An on-time entry refused under a release limit below its own budget, where its budget would let
    it through, waits for the queue's own reason: the time after that pass does not lower the rate.
    The same entry refused at its own budget by the fleet (its TPOT target) does measure it."""
    s = make_scheduler()
    snap = _pd(prefill_tokens=6000)  # about a second of backlog on the one prefill instance
    q = make_queue("edf", drain_window_ms=1000.0)
    q.observe_arrival(req("tight", ttft_slo_ms=400.0))  # release control: at most 200 ms for looser work
    q.push(req("loose", prompt_tokens=256, ttft_slo_ms=20_000.0), NOW)
    (result,) = list(offer(q, s, lambda: snap, NOW))
    assert result.verdict is Verdict.WAIT
    q.note_backlog(NOW + 0.5)
    q.note_dispatch(NOW + 0.5, 100)
    assert q.drain_rate(NOW + 0.5) is None
    q2 = make_queue("edf", drain_window_ms=1000.0)
    q2.push(req("slow", prompt_tokens=256, ttft_slo_ms=20_000.0, tpot_slo_ms=0.001), NOW)
    (result,) = list(offer(q2, s, lambda: snap, NOW))
    assert result.verdict is Verdict.WAIT
    q2.note_backlog(NOW + 0.5)
    q2.note_dispatch(NOW + 0.5, 100)
    assert q2.drain_rate(NOW + 0.5) == pytest.approx(100 / 500.0)


def test_drain_window_is_bounded() -> None:
    from router.core.errors import ConfigError

    with pytest.raises(ConfigError, match="drain_window_ms"):
        QueueConfig(drain_window_ms=-1.0)


def test_e2e_only_request_is_judged_by_its_e2e_target_not_the_derived_ttft() -> None:
    s = make_scheduler()
    q = make_queue("fcfs", late_policy="reject")
    for k in range(8):  # seconds of prefill in front of the two requests below
        q.push(req(f"big{k}", prompt_tokens=8000, ttft_slo_ms=120_000.0), NOW)
    q.push(req("e2e", prompt_tokens=256, e2e_slo_ms=20_000.0, max_tokens=16), NOW)
    q.push(req("ttft", prompt_tokens=256, ttft_slo_ms=6000.0), NOW)
    drain = FleetDrain.of(s, s.view(_pd(), NOW), NOW)
    assert drain is not None and 6000.0 < drain.start_ms(8 * 8000) < 19_000.0
    verdicts = {r.entry.request_id: r.verdict for r in offer(q, s, lambda: _pd(), NOW, max_failures=1)}
    assert verdicts.get("ttft") is Verdict.REJECT  # its own TTFT target is out of reach
    assert "e2e" not in verdicts and "e2e" in q  # its derived 6 s TTFT too, but not its 20 s e2e target


def test_empty_fleet_is_still_refused_as_unavailable() -> None:
    """No fleet to build a drain from: the decision reports the empty cluster, as before."""

    def empty() -> Any:
        raise EmptyClusterError("no instances")

    q = make_queue("edf")
    q.push(req("r", ttft_slo_ms=5000.0), NOW)
    (result,) = list(offer(q, make_scheduler(), empty, NOW))
    assert result.verdict is Verdict.REJECT and isinstance(result.error, EmptyClusterError)
    assert len(q) == 0


@pytest.mark.parametrize("late_policy", ["serve", "reject"])
def test_an_impossible_target_stops_capping_release_once_it_turns_late(late_policy: str) -> None:
    """Release control keeps room for the tightest recent arrival; one whose target no instance can meet
    (1 ms) must not hold every looser request back for the next window of arrivals."""
    q = make_queue("edf", late_policy=late_policy)
    q.observe_arrival(req("absurd", prompt_tokens=2000, ttft_slo_ms=1.0))
    q.push(req("absurd", prompt_tokens=2000, ttft_slo_ms=1.0), NOW)
    assert q.release_limit_ms(NOW) == pytest.approx(1.0)
    list(offer(q, make_scheduler(), lambda: _pd(), NOW))
    assert q.release_limit_ms(NOW) == math.inf
    q.observe_arrival(req("next", ttft_slo_ms=6000.0))
    q.push(req("next", ttft_slo_ms=6000.0), NOW)
    verdicts = {r.entry.request_id: r.verdict for r in offer(q, make_scheduler(), lambda: _pd(), NOW)}
    assert verdicts["next"] is Verdict.DISPATCH


@settings(max_examples=200, deadline=None)
@given(
    gaps=st.lists(st.floats(min_value=0.0, max_value=0.4), min_size=1, max_size=60),
    tokens=st.lists(st.integers(min_value=0, max_value=8192), min_size=60, max_size=60),
    limited=st.lists(st.booleans(), min_size=60, max_size=60),
    window_ms=st.floats(min_value=50.0, max_value=5000.0),
    later=st.floats(min_value=0.0, max_value=3.0),
)
def test_drain_rate_sums_exactly_the_limited_stretches_inside_its_window(
    gaps: list[float], tokens: list[int], limited: list[bool], window_ms: float, later: float
) -> None:
    """Passes at random moments, each dispatching some tokens and ending limited or not: the rate is
    the tokens of the passes that ended a limited stretch over those stretches' length, both counted
    by the moment the stretch ended, within the window."""
    q = make_queue("fcfs", drain_window_ms=window_ms)
    q.push(req("a", ttft_slo_ms=60_000.0), NOW)
    stretches: list[tuple[float, float, int]] = []  # (end, length s, tokens dispatched at its end)
    t = NOW
    q.note_pass(t, fleet_limited=True)
    before = True
    for gap, n, lim in zip(gaps, tokens, limited, strict=False):
        start = t
        t += gap
        q.note_backlog(t)
        if n:
            q.note_dispatch(t, n)
        q.note_pass(t, fleet_limited=lim)
        if before:
            stretches.append((t, t - start, n))
        before = lim
    now = t + later
    cut = now - window_ms * 1e-3
    span_us = sum(round(length * 1e6) for end, length, _ in stretches if end >= cut)
    expected_tokens = sum(n for end, _, n in stretches if end >= cut)
    rate = q.drain_rate(now)
    if span_us * 1e-3 < 0.1 * window_ms or expected_tokens == 0:
        assert rate is None
    else:
        assert rate == expected_tokens / (span_us * 1e-3)


def test_a_prior_length_does_not_make_an_e2e_request_hopeless() -> None:
    """4,000 tokens cannot be decoded within 2 s, but a length that is only the cap (nothing of the class
    ended yet) is no grounds to give up: only the prefill is certain, as in the arrival check."""
    s = make_scheduler()
    snap = _pd()
    drain = FleetDrain.of(s, s.view(snap, NOW), NOW)
    assert drain is not None
    for prior, pooled, hopeless_expected in (
        (False, False, True),
        (True, False, False),
        (False, True, False),
    ):
        request = req(
            "r",
            prompt_tokens=256,
            e2e_slo_ms=2000.0,
            max_tokens=4000,
            output_tokens_prior=prior,
            output_tokens_pooled=pooled,  # every class's mean: not the class's own length either
        )
        targets = resolve_targets(request, DEFAULT_TTFT, DEFAULT_TPOT, NOW)
        why = hopeless(drain, request, targets, 0.0, NOW)
        assert (why is not None) is hopeless_expected


# --------------------------------------------------------------------------- cached prefixes in the queue


def _cached_family(s: Any, prompt: int, instance: str = "p0") -> tuple[int, ...]:
    """Block hashes of a ``prompt``-token prompt whose every block but the last ``instance`` holds."""
    hashes = tuple(token_block_hashes(list(range(prompt)), 256))
    assert s.prefix is not None
    s.prefix.dispatched(instance, hashes[:-1], 1_000_000)
    return hashes


def test_work_in_front_counts_only_the_uncached_part_of_each_queued_prompt() -> None:
    """Six 8,000-token prompts queued in front make a 1 s request hopeless when they must prefill in
    full (see test_request_behind_a_long_queue_turns_late_at_enqueue_not_at_its_deadline); when the
    router knows all but their last 320 tokens cached on p0 they are 1,920 tokens of work, and the
    request behind them is not judged late."""
    s = make_scheduler(prefix_cache_routing="approximate", prefix_block_tokens=256)
    hashes = _cached_family(s, 8000)
    q = make_queue("fcfs", late_policy="reject")
    for k in range(6):
        q.push(req(f"big{k}", prompt_tokens=8000, ttft_slo_ms=60_000.0, prefix_hashes=hashes), NOW)
    q.push(req("tight", prompt_tokens=256, ttft_slo_ms=1000.0), NOW)
    results = {r.entry.request_id: r for r in offer(q, s, lambda: _pd(), NOW)}
    assert results["tight"].hopeless is None and results["tight"].verdict is not Verdict.REJECT
    entry = q.get("big0")
    assert entry is None or q.work_tokens(entry) == 8000 - 30 * 256
    # The same queue without the prefix knowledge: the tight request is hopeless, as before.
    plain = make_scheduler()
    q = make_queue("fcfs", late_policy="reject")
    for k in range(6):
        q.push(req(f"big{k}", prompt_tokens=8000, ttft_slo_ms=60_000.0, prefix_hashes=hashes), NOW)
    q.push(req("tight", prompt_tokens=256, ttft_slo_ms=1000.0), NOW)
    results = {r.entry.request_id: r for r in offer(q, plain, lambda: _pd(), NOW)}
    assert results["tight"].verdict is Verdict.REJECT and results["tight"].hopeless is not None


def test_the_drain_rate_counts_each_dispatch_by_its_uncached_part() -> None:
    """What a dispatch adds to the measured drain is its work (uncached part), the unit the work in
    front of a request is counted in."""
    s = make_scheduler(prefix_cache_routing="approximate", prefix_block_tokens=256)
    hashes = _cached_family(s, 8000)
    q = make_queue("fcfs", drain_window_ms=1000.0)
    big = req("big", prompt_tokens=8000, ttft_slo_ms=60_000.0, tpot_slo_ms=1000.0, prefix_hashes=hashes)
    q.push(big, NOW)
    q.push(req("other", prompt_tokens=256, ttft_slo_ms=60_000.0), NOW)
    q.note_pass(NOW, fleet_limited=True)
    results = list(offer(q, s, lambda: _pd(), NOW + 0.5))
    assert results[0].verdict is Verdict.DISPATCH
    rate = q.drain_rate(NOW + 0.5)
    assert rate is not None and rate * 500.0 <= 320 + 256
