"""The router queue's core: ordering per policy, shedding by value, late handling, release control, targets."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.core.errors import ConfigError, EmptyClusterError, LateError, QueueTimeoutError
from router.core.queue import (
    LATE_ALLOWANCE,
    QueueConfig,
    QueueEntry,
    QueuePolicy,
    RouterQueue,
    Verdict,
    offer,
)
from router.core.request import ScheduleInput, resolve_targets
from router.core.sa import SAPlanner
from tests.router.core.helpers import NOW, inst, make_request, make_scheduler, make_snapshot

PROPS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DEFAULT_TTFT, DEFAULT_TPOT = 6000.0, 50.0


def make_queue(policy: str = "edf", **kw: Any) -> RouterQueue:
    config = QueueConfig(queue_policy=policy, **kw)
    planner = SAPlanner(config) if config.policy is QueuePolicy.SA else None
    return RouterQueue(config, DEFAULT_TTFT, DEFAULT_TPOT, planner)


def req(rid: str, *, arrival: float = NOW, **kw: Any) -> ScheduleInput:
    return make_request(rid, arrival_s=arrival, **kw)


# --------------------------------------------------------------------------- config and targets


def test_every_queue_config_field_has_a_doc_a_flag_and_a_default() -> None:
    for f in fields(QueueConfig):
        assert f.metadata.get("doc"), f"QueueConfig.{f.name} has no doc"
        assert str(f.metadata.get("flag", "")).startswith("--")
        assert QueueConfig.doc(f.name)


@pytest.mark.parametrize(
    ("changes", "field_name"),
    [
        ({"queue_policy": "lifo"}, "queue_policy"),
        ({"late_policy": "drop"}, "late_policy"),
        ({"max_queue_size": 0}, "max_queue_size"),
        ({"max_queue_wait_ms": math.inf}, "max_queue_wait_ms"),
        ({"max_queue_wait_ms": 0.0}, "max_queue_wait_ms"),
        ({"release_window_requests": -1}, "release_window_requests"),
        ({"priority_headroom": 0.0}, "priority_headroom"),
    ],
)
def test_bad_queue_config_names_the_field(changes: dict[str, Any], field_name: str) -> None:
    with pytest.raises(ConfigError, match=field_name):
        QueueConfig(**changes)


def test_e2e_only_request_gets_a_ttft_target_from_it() -> None:
    r = make_request(e2e_slo_ms=4000.0, max_tokens=64)
    t = resolve_targets(r, DEFAULT_TTFT, DEFAULT_TPOT)
    # 4000 - 64 * 25 = 2400: above a quarter of 4000, under the default; TPOT stays the default
    # (the pace the deadline needs is packing's, see router.core.packing).
    assert (t.ttft_ms, t.tpot_ms, t.e2e_ms) == (pytest.approx(2400.0), DEFAULT_TPOT, 4000.0)
    long = resolve_targets(make_request(e2e_slo_ms=4000.0, max_tokens=1000), DEFAULT_TTFT, DEFAULT_TPOT)
    assert long.ttft_ms == 1000.0  # at least a quarter of the e2e target


def test_own_targets_win_and_the_ttft_budget_shrinks_with_time() -> None:
    r = make_request(ttft_slo_ms=1000.0, tpot_slo_ms=20.0, arrival_s=NOW)
    t = resolve_targets(r, DEFAULT_TTFT, DEFAULT_TPOT, NOW + 0.25)
    assert (t.ttft_ms, t.tpot_ms, t.full_ttft_ms) == (750.0, 20.0, 1000.0)
    assert resolve_targets(make_request(), DEFAULT_TTFT, DEFAULT_TPOT).ttft_ms == DEFAULT_TTFT


# --------------------------------------------------------------------------- ordering and shedding


def test_edf_orders_by_ttft_deadline_or_completion_deadline_for_e2e_only() -> None:
    q = make_queue("edf")
    q.push(req("loose", ttft_slo_ms=5000.0), NOW)
    q.push(req("e2e", e2e_slo_ms=3000.0, max_tokens=10), NOW)
    q.push(req("tight", ttft_slo_ms=500.0), NOW)
    assert [e.request_id for e in q.entries()] == ["tight", "e2e", "loose"]


def test_priority_orders_by_priority_then_deadline_and_fcfs_by_arrival() -> None:
    for policy, expected in (("priority", ["hi", "a", "b"]), ("fcfs", ["b", "a", "hi"])):
        q = make_queue(policy)
        q.push(req("b", ttft_slo_ms=900.0), NOW)
        q.push(req("a", ttft_slo_ms=100.0), NOW)
        q.push(req("hi", ttft_slo_ms=5000.0, priority=3), NOW)
        assert [e.request_id for e in q.entries()] == expected
        assert [q.position(rid) for rid in expected] == [0, 1, 2]


def test_full_queue_sheds_lowest_priority_then_most_slack_possibly_the_newcomer() -> None:
    q = make_queue("edf", max_queue_size=2)
    q.push(req("a", ttft_slo_ms=1000.0, priority=1), NOW)
    q.push(req("b", ttft_slo_ms=9000.0), NOW)
    _, shed = q.push(req("c", ttft_slo_ms=2000.0), NOW)
    assert [e.request_id for e in shed] == ["b"]  # same priority as c, more slack
    entry, shed = q.push(req("d", ttft_slo_ms=100.0, priority=-1), NOW)
    assert shed == [entry]  # the newcomer is the least valuable
    assert sorted(e.request_id for e in q.entries()) == ["a", "c"]


def test_late_entries_go_behind_on_time_ones_and_are_shed_first() -> None:
    q = make_queue("edf", max_queue_size=2)
    q.push(req("a", ttft_slo_ms=100.0), NOW)
    q.push(req("b", ttft_slo_ms=9000.0), NOW)
    q.mark_late("a")
    assert [e.request_id for e in q.entries()] == ["b", "a"]
    _, shed = q.push(req("c", ttft_slo_ms=5000.0), NOW)
    assert [e.request_id for e in shed] == ["a"]


def test_expire_and_overdue_follow_the_clock() -> None:
    q = make_queue("edf", max_queue_wait_ms=1000.0)
    q.push(req("a", ttft_slo_ms=200.0), NOW)
    q.push(req("b", ttft_slo_ms=5000.0, arrival=NOW + 0.5), NOW + 0.5)
    assert [e.request_id for e in q.overdue(NOW + 0.3)] == ["a"]
    assert [e.request_id for e in q.expire(NOW + 1.2)] == ["a"]
    assert len(q) == 1 and q.oldest_enqueued_s() == NOW + 0.5


def test_release_limit_is_the_tightest_queued_budget_or_recent_target() -> None:
    q = make_queue("edf", release_window_requests=2)
    assert q.release_limit_ms(NOW) == math.inf
    q.observe_arrival(req("x", ttft_slo_ms=3000.0))
    assert q.release_limit_ms(NOW) == 3000.0
    q.push(req("a", ttft_slo_ms=2000.0), NOW)
    assert q.release_limit_ms(NOW + 0.5) == pytest.approx(1500.0)
    q.observe_arrival(req("y", ttft_slo_ms=900.0))
    assert q.release_limit_ms(NOW + 0.5) == 900.0


def test_edf_release_limit_makes_looser_requests_yield_to_tighter_traffic() -> None:
    q = make_queue("edf", priority_headroom=0.5)
    q.observe_arrival(req("chat", ttft_slo_ms=1000.0))
    assert q.release_limit_ms(NOW, 0, 1000.0) == 1000.0  # the tightest class itself
    assert q.release_limit_ms(NOW, 0, 6000.0) == 500.0  # looser work leaves it room
    assert make_queue("fcfs").release_limit_ms(NOW, 0, 6000.0) == math.inf


def test_priority_release_limit_leaves_headroom_for_higher_priorities() -> None:
    q = make_queue("priority", priority_headroom=0.5)
    q.observe_arrival(req("hi", ttft_slo_ms=1000.0, priority=5))
    q.observe_arrival(req("lo", ttft_slo_ms=8000.0))
    assert q.release_limit_ms(NOW, 5) == 1000.0
    assert q.release_limit_ms(NOW, 0) == 500.0


# --------------------------------------------------------------------------- offering to the scheduler


def _fleet(prefill_tokens: int = 0) -> Any:
    return make_snapshot(inst("p0", "prefill", prefill_tokens=prefill_tokens), inst("d0", "decode"))


def test_offer_dispatches_what_fits_and_keeps_the_rest() -> None:
    s = make_scheduler()
    q = make_queue("edf")
    snap = _fleet()
    q.push(req("ok", prompt_tokens=256, ttft_slo_ms=5000.0), NOW)
    results = list(offer(q, s, lambda: snap, NOW))
    assert [(r.entry.request_id, r.verdict) for r in results] == [("ok", Verdict.DISPATCH)]
    assert len(q) == 0


def test_offer_marks_unreachable_targets_late_or_rejects_them() -> None:
    snap = _fleet(prefill_tokens=20000)  # seconds of backlog on the only prefill instance
    for late_policy, verdict in (("serve", Verdict.LATE), ("reject", Verdict.REJECT)):
        q = make_queue("edf", late_policy=late_policy)
        q.push(req("r", prompt_tokens=256, ttft_slo_ms=300.0), NOW)
        (result,) = list(offer(q, make_scheduler(), lambda: snap, NOW))
        assert result.verdict is verdict
        assert result.predicted_ttft_ms > 300.0
        if verdict is Verdict.REJECT:
            assert isinstance(result.error, LateError) and "300 ms" in str(result.error)
            assert len(q) == 0
        else:
            entry = q.get("r")
            assert entry is not None and entry.late


def test_late_entry_is_served_once_the_fleet_is_idle() -> None:
    """Late on a busy fleet, served when the fleet is idle within its late allowance (one more TTFT
    target past its deadline: LATE_ALLOWANCE)."""
    q = make_queue("edf")
    q.push(req("r", prompt_tokens=256, ttft_slo_ms=1000.0), NOW)
    busy = _fleet(prefill_tokens=20000)
    assert [r.verdict for r in offer(q, make_scheduler(), lambda: busy, NOW)] == [Verdict.LATE]
    entry = q.get("r")
    assert entry is not None and entry.late_until_s == pytest.approx(NOW + 1.0 + LATE_ALLOWANCE)
    idle = _fleet()
    (result,) = list(offer(q, make_scheduler(), lambda: idle, NOW + 1))
    assert result.verdict is Verdict.DISPATCH and result.entry.late
    assert result.decision is not None
    # Its own TPOT target (it takes only placements that pass every filter, see test_queue_hopeless).
    assert result.decision.context.tpot_slo_ms == pytest.approx(DEFAULT_TPOT)


def test_a_late_entry_without_a_placement_in_sight_is_refused_at_once_under_serve() -> None:
    """Under late_policy=serve a late request is served only while its first token can still come
    within its late allowance: behind seconds of backlog it is refused at once (LateError, so the
    client hears DEADLINE_EXCEEDED now), not held until the queue's wait bound."""
    q = make_queue("edf")
    q.push(req("r", prompt_tokens=256, ttft_slo_ms=1000.0), NOW)
    busy = _fleet(prefill_tokens=20000)
    assert [r.verdict for r in offer(q, make_scheduler(), lambda: busy, NOW)] == [Verdict.LATE]
    # Still late, the same backlog a moment later: its first token cannot come by NOW + 2 s.
    (result,) = list(offer(q, make_scheduler(), lambda: busy, NOW + 0.01))
    assert result.verdict is Verdict.REJECT and isinstance(result.error, LateError)
    assert "--late-policy serve" in str(result.error) and "1000 ms" in str(result.error)
    # The refusal says what its best case was made of: nothing queued in front here, so the fleet's
    # backlog (the 20,000 tokens on p0) and its own prefill of 256 tokens decided.
    message = str(result.error)
    assert "0 prompt tokens in 0 requests queued in front: " in message and "its own prefill " in message
    start = float(message.split("could come ")[1].split(" ms")[0])
    own = float(message.split("its own prefill ")[1].split(" ms")[0])
    assert 0.0 < own < start  # the rest is the backlog ahead of it on the only prefill instance
    assert len(q) == 0


def test_a_late_entry_is_refused_when_its_late_allowance_ends() -> None:
    """Past its allowance the entry leaves at the start of the next pass, whatever the fleet, and
    the queue's wake-up time says when that is."""
    q = make_queue("edf")
    q.push(req("r", prompt_tokens=256, ttft_slo_ms=1000.0), NOW)
    busy = _fleet(prefill_tokens=20000)
    list(offer(q, make_scheduler(), lambda: busy, NOW))
    assert q.wake_s() == pytest.approx(NOW + 2.0)
    (result,) = list(offer(q, make_scheduler(), _fleet, NOW + 2.0))
    assert result.verdict is Verdict.REJECT and isinstance(result.error, LateError)
    assert len(q) == 0 and q.wake_s() is None


def test_an_e2e_only_late_entry_keeps_its_e2e_deadline_and_allowance() -> None:
    """A request judged by its e2e target alone turns late at a derived TTFT deadline but may still
    meet its e2e target: its allowance runs from its e2e deadline."""
    q = make_queue("edf")
    q.push(req("r", prompt_tokens=256, e2e_slo_ms=20_000.0), NOW)
    entry = q.get("r")
    assert entry is not None
    q.mark_late("r", NOW + 0.1)
    assert entry.late_until_s == pytest.approx(NOW + 20.0 + 20.0 * LATE_ALLOWANCE)


def test_offer_expires_waiters_and_refuses_on_an_empty_fleet() -> None:
    q = make_queue("edf", max_queue_wait_ms=100.0)
    q.push(req("old", ttft_slo_ms=5000.0), NOW)
    (result,) = list(offer(q, make_scheduler(), _fleet, NOW + 1))
    assert result.verdict is Verdict.EXPIRED and isinstance(result.error, QueueTimeoutError)
    assert "--max-queue-wait-ms" in str(result.error)
    q.push(req("new", ttft_slo_ms=5000.0, arrival=NOW + 1), NOW + 1)
    (result,) = list(offer(q, make_scheduler(), make_snapshot, NOW + 1))
    assert result.verdict is Verdict.REJECT and isinstance(result.error, EmptyClusterError)


# --------------------------------------------------------------------------- properties

# qlm has its own queue (router.core.qlm; tests/router/core/test_qlm.py).
POLICIES = [p.value for p in QueuePolicy if p not in (QueuePolicy.NONE, QueuePolicy.QLM)]

ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("push"),
            st.integers(-2, 2),  # priority
            st.sampled_from([0.0, 100.0, 500.0, 2000.0]),  # ttft target (0 = default)
            st.sampled_from([0.0, 1500.0, 9000.0]),  # e2e target
            st.floats(0.0, 2.0),  # time step
        ),
        st.tuples(st.just("remove"), st.integers(0, 60)),
        st.tuples(st.just("late"), st.integers(0, 60)),
        st.tuples(st.just("expire"), st.floats(0.0, 3.0)),
        st.tuples(st.just("pop")),
    ),
    max_size=60,
)


def _order_key(policy: str, e: QueueEntry) -> tuple[Any, ...]:
    if policy == "edf":
        return (e.deadline_s, e.seq)
    if policy == "priority":
        return (-e.request.priority, e.deadline_s, e.seq)
    return (e.seq,)


@PROPS
@given(policy=st.sampled_from(POLICIES), size=st.integers(1, 6), script=ops)
def test_queue_invariants(policy: str, size: int, script: list[tuple[Any, ...]]) -> None:
    """Nothing lost or handed out twice; never over the bound; removals take effect; order per policy."""
    q = make_queue(policy, max_queue_size=size, max_queue_wait_ms=2500.0)
    now = NOW
    pushed: list[str] = []
    gone: set[str] = set()  # shed, removed, expired or popped: each exactly once
    for op in script:
        if op[0] == "push":
            _, priority, ttft, e2e, step = op
            now += step
            rid = f"r{len(pushed)}"
            pushed.append(rid)
            _, shed = q.push(
                ScheduleInput(rid, 64, ttft_slo_ms=ttft, e2e_slo_ms=e2e, priority=priority, arrival_s=now),
                now,
            )
            for e in shed:
                assert e.request_id not in gone and e.request_id not in q
                gone.add(e.request_id)
        elif op[0] in ("remove", "late") and pushed:
            rid = pushed[op[1] % len(pushed)]
            if op[0] == "remove":
                entry = q.remove(rid)
                assert (entry is not None) == (rid not in gone)
                gone.add(rid)
                assert rid not in q
            elif rid in q:
                q.mark_late(rid)
        elif op[0] == "expire":
            now += op[1]
            for e in q.expire(now):
                assert e.request_id not in gone and now - e.enqueued_s >= 2.5 - 1e-9
                gone.add(e.request_id)
            assert all(now - e.enqueued_s < 2.5 for e in q.entries())
        elif op[0] == "pop":
            first = next(q.entries(), None)
            if first is not None:
                assert q.remove(first.request_id) is first
                gone.add(first.request_id)
        assert len(q) <= size
        listed = [e.request_id for e in q.entries()]
        assert len(listed) == len(set(listed)) == len(q)
        assert set(listed) | gone == set(pushed) and not set(listed) & gone
        on_time = [e for e in q.entries() if not e.late]
        late = [e for e in q.entries() if e.late]
        assert [e.request_id for e in q.entries()] == [e.request_id for e in on_time + late]
        assert [_order_key(policy, e) for e in on_time] == sorted(_order_key(policy, e) for e in on_time)
        assert [e.seq for e in late] == sorted(e.seq for e in late)
        for k, rid in enumerate(listed):
            assert q.position(rid) == k


@PROPS
@given(
    size=st.integers(1, 5),
    entries=st.lists(
        st.tuples(st.integers(-2, 2), st.sampled_from([100.0, 1000.0, 5000.0])), min_size=1, max_size=12
    ),
)
def test_shedding_keeps_the_most_valuable(size: int, entries: list[tuple[int, float]]) -> None:
    """After any pushes, every kept entry is worth at least as much as every shed one."""
    q = make_queue("edf", max_queue_size=size)
    shed_all: list[QueueEntry] = []
    for k, (priority, ttft) in enumerate(entries):
        _, shed = q.push(req(f"r{k}", ttft_slo_ms=ttft, priority=priority), NOW)
        shed_all.extend(shed)
    assert len(q) == min(size, len(entries))
    value = RouterQueue._value_key
    if shed_all:
        worst_kept = min(value(e) for e in q.entries())
        assert all(value(e) <= worst_kept for e in shed_all)
