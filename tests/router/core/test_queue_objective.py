"""Queue objective g: the shedding limit follows the misses, and the longest requests are refused first."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.core.errors import ConfigError, QueueFullError, ShedError
from router.core.queue import (
    SHED_DOWN,
    SHED_LIMIT_CEILING_MS,
    SHED_LIMIT_FLOOR_MS,
    SHED_MEMORY_S,
    QueueConfig,
    RouterQueue,
    Verdict,
    offer,
    slo_met,
)
from router.core.request import ScheduleInput
from tests.router.core.helpers import NOW, inst, make_request, make_scheduler, make_snapshot

PROPS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DEFAULT_TTFT, DEFAULT_TPOT = 6000.0, 50.0


def make_queue(policy: str = "edf", objective: str = "g", **kw: Any) -> RouterQueue:
    config = QueueConfig(queue_policy=policy, queue_objective=objective, **kw)
    return RouterQueue(config, DEFAULT_TTFT, DEFAULT_TPOT)


def req(rid: str, **kw: Any) -> ScheduleInput:
    return make_request(rid, arrival_s=NOW, **kw)


def missing(q: RouterQueue, n: int) -> None:
    for k in range(n):
        q.note_outcome(f"done{k}", met=False, now_s=NOW)


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("policy", ["none", "qlm", "sa"])
def test_objective_g_needs_a_queue_that_offers_requests_in_order(policy: str) -> None:
    with pytest.raises(ConfigError, match=r"queue_objective.*fcfs, edf or priority"):
        QueueConfig(queue_policy=policy, queue_objective="g")


@pytest.mark.parametrize(("field", "value"), [("queue_objective", "goodput"), ("shed_miss_target", 0.0)])
def test_objective_fields_are_bounded(field: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=field):
        QueueConfig(**{field: value})


# --------------------------------------------------------------------------- the shedding limit


def test_no_limit_until_requests_miss_and_none_again_once_they_meet() -> None:
    q = make_queue()
    assert q.shed_limit_ms(NOW) == math.inf
    q.note_outcome("a", met=False, now_s=NOW)
    assert q.shed_limit_ms(NOW) == pytest.approx(SHED_LIMIT_CEILING_MS * SHED_DOWN)
    missing(q, 200)
    assert q.shed_limit_ms(NOW) == SHED_LIMIT_FLOOR_MS
    for k in range(20_000):
        q.note_outcome(f"ok{k}", met=True, now_s=NOW)
    assert q.shed_limit_ms(NOW) == math.inf


def test_the_limit_lapses_once_no_request_missed_for_a_while() -> None:
    q = make_queue()
    missing(q, 30)
    assert q.shed_limit_ms(NOW) < 20_000.0
    assert q.shed_limit_ms(NOW + SHED_MEMORY_S) < 20_000.0
    assert q.shed_limit_ms(NOW + SHED_MEMORY_S + 0.1) == math.inf  # the overload ended: nothing shed
    q.note_outcome("again", met=False, now_s=NOW + 60.0)  # a new miss: the learnt limit is back
    assert q.shed_limit_ms(NOW + 60.0) < 20_000.0


def test_other_objectives_keep_nothing() -> None:
    q = make_queue(objective="attainment")
    missing(q, 50)
    q.note_outcome("x", met=True, now_s=NOW, tpot_ms=30.0)
    assert q.shed_limit_ms(NOW) == math.inf and q.decode_ms_per_token() is None


def test_requests_the_limit_refused_do_not_steer_it() -> None:
    q = make_queue()
    missing(q, 10)
    before = q.shed_limit_ms(NOW)
    q.note_shed("victim")
    q.note_outcome("victim", met=False, now_s=NOW)
    assert q.shed_limit_ms(NOW) == before
    q.note_outcome("victim", met=False, now_s=NOW)  # a second outcome of the same id is an ordinary one
    assert q.shed_limit_ms(NOW) < before


def test_decode_speed_is_the_mean_of_the_latest_served_requests() -> None:
    q = make_queue()
    q.note_outcome("a", met=True, now_s=NOW, tpot_ms=20.0)
    q.note_outcome("b", met=True, now_s=NOW, tpot_ms=40.0)
    q.note_outcome("c", met=True, now_s=NOW, tpot_ms=None)  # one-token reply: no TPOT
    q.note_outcome("d", met=True, now_s=NOW, tpot_ms=math.nan)
    assert q.decode_ms_per_token() == pytest.approx(30.0)


@PROPS
@given(outcomes=st.lists(st.booleans(), max_size=400), target=st.floats(0.001, 0.5))
def test_limit_stays_in_range_and_moves_the_way_each_outcome_says(
    outcomes: list[bool], target: float
) -> None:
    q = make_queue(shed_miss_target=target)
    for k, met in enumerate(outcomes):
        before = q.shed_limit_ms(NOW)
        q.note_outcome(str(k), met=met, now_s=NOW)
        after = q.shed_limit_ms(NOW)
        assert after == math.inf or SHED_LIMIT_FLOOR_MS <= after < SHED_LIMIT_CEILING_MS
        assert (after >= before) if met else (after <= before)


@PROPS
@given(mets_per_miss=st.integers(1, 99), cycles=st.integers(1, 30), start_misses=st.integers(5, 20))
def test_limit_holds_still_when_misses_run_at_the_target(
    mets_per_miss: int, cycles: int, start_misses: int
) -> None:
    """One miss per k met requests is a miss fraction of 1 / (k + 1): at that target the limit returns
    to where it was after every cycle (away from its bounds)."""
    q = make_queue(shed_miss_target=1.0 / (mets_per_miss + 1))
    missing(q, start_misses)
    start = q.shed_limit_ms(NOW)
    for c in range(cycles):
        q.note_outcome(f"m{c}", met=False, now_s=NOW)
        for k in range(mets_per_miss):
            q.note_outcome(f"ok{c}-{k}", met=True, now_s=NOW)
        assert q.shed_limit_ms(NOW) == pytest.approx(start, rel=1e-9)


# --------------------------------------------------------------------------- refusing the longest first


def _backlogged() -> Any:
    # A prefill backlog over the release limit a 200 ms request leaves looser work: everything waits.
    return make_snapshot(inst("p0", "prefill", prefill_tokens=2000), inst("d0", "decode"))


def _waiting_pair(q: RouterQueue) -> list[Any]:
    q.observe_arrival(req("chat", ttft_slo_ms=200.0))
    q.push(req("long", prompt_tokens=4000, ttft_slo_ms=60_000.0, max_tokens=2000), NOW)
    q.push(req("short", prompt_tokens=4000, ttft_slo_ms=60_000.0, max_tokens=10), NOW)
    return list(offer(q, make_scheduler(), _backlogged, NOW))


def test_while_requests_miss_the_longest_waiting_request_is_refused_and_the_short_one_waits() -> None:
    q = make_queue("fcfs")
    missing(q, 20)  # limit ~14.6 s: 2000 tokens at the 50 ms default TPOT need ~100 s
    results = {r.entry.request_id: r for r in _waiting_pair(q)}
    long, short = results["long"], results["short"]
    assert long.verdict is Verdict.REJECT and isinstance(long.error, ShedError)
    assert isinstance(long.error, QueueFullError)  # RESOURCE_EXHAUSTED, like a shed from a full queue
    assert "--queue-objective g" in str(long.error) and "long" not in q
    assert short.verdict is Verdict.WAIT and "short" in q


def test_without_misses_or_under_attainment_both_wait() -> None:
    attainment = make_queue("fcfs", objective="attainment")
    missing(attainment, 20)
    for q in (make_queue("fcfs"), attainment):
        assert [r.verdict for r in _waiting_pair(q)] == [Verdict.WAIT, Verdict.WAIT]
        assert len(q) == 2


def test_measured_decode_speed_sets_the_predicted_remaining_time() -> None:
    q = make_queue("fcfs")
    missing(q, 20)
    q.note_outcome("fast", met=True, now_s=NOW, tpot_ms=1.0)  # 2000 tokens at 1 ms: within the limit
    assert [r.verdict for r in _waiting_pair(q)] == [Verdict.WAIT, Verdict.WAIT]


def test_a_more_important_request_is_not_shed_while_a_less_important_one_waits() -> None:
    q = make_queue("priority")
    missing(q, 20)
    q.observe_arrival(req("chat", ttft_slo_ms=200.0))
    q.push(req("vip", prompt_tokens=4000, ttft_slo_ms=60_000.0, max_tokens=2000, priority=5), NOW)
    q.push(req("low", prompt_tokens=4000, ttft_slo_ms=60_000.0, max_tokens=2000), NOW)
    verdicts = {r.entry.request_id: r.verdict for r in offer(q, make_scheduler(), _backlogged, NOW)}
    assert verdicts == {"vip": Verdict.WAIT, "low": Verdict.REJECT}


def test_late_requests_are_refused_under_g_even_with_late_policy_serve() -> None:
    q = make_queue("fcfs", late_policy="serve")
    q.push(req("late", ttft_slo_ms=100.0), NOW - 1.0)  # its TTFT deadline passed
    (result,) = list(offer(q, make_scheduler(), _backlogged, NOW))
    assert result.verdict is Verdict.REJECT and "late" not in q


def test_while_requests_miss_even_a_request_an_instance_would_take_now_is_judged() -> None:
    """Shedding spares capacity for the shorter requests, so it judges requests an instance would take
    at once as well, until no request has missed for a while."""
    idle = make_snapshot(inst("p0", "prefill"), inst("d0", "decode"))
    long = {"prompt_tokens": 256, "ttft_slo_ms": 5000.0, "max_tokens": 200}  # ~10 s to finish
    q = make_queue("fcfs")
    missing(q, 100)
    q.push(make_request("now", arrival_s=NOW, **long), NOW)
    (shed,) = list(offer(q, make_scheduler(), lambda: idle, NOW))
    assert shed.verdict is Verdict.REJECT and isinstance(shed.error, ShedError)
    later = NOW + SHED_MEMORY_S + 1.0
    fresh = make_snapshot(inst("p0", "prefill"), inst("d0", "decode"), taken_at_s=later)
    q.push(make_request("later", arrival_s=later, **long), later)
    assert [r.verdict for r in offer(q, make_scheduler(), lambda: fresh, later)] == [Verdict.DISPATCH]


# --------------------------------------------------------------------------- met or missed


@pytest.mark.parametrize(
    ("targets", "measured", "met"),
    [
        ((1000.0, 50.0, 0.0), (900.0, 40.0, 9000.0), True),
        ((1000.0, 50.0, 0.0), (1100.0, 40.0, 9000.0), False),
        ((1000.0, 50.0, 0.0), (900.0, 60.0, 9000.0), False),
        ((1000.0, 50.0, 0.0), (None, None, 10.0), False),  # no first token
        ((1000.0, 50.0, 0.0), (900.0, None, 900.0), True),  # one-token reply: no TPOT to miss
        ((0.0, 0.0, 4000.0), (3000.0, 90.0, 3900.0), True),  # e2e only: TTFT/TPOT do not count
        ((0.0, 0.0, 4000.0), (300.0, 9.0, 4100.0), False),
        ((0.0, 0.0, 0.0), (5000.0, 49.0, 20000.0), True),  # no targets: the defaults (6 s, 50 ms)
        ((0.0, 0.0, 0.0), (7000.0, 49.0, 20000.0), False),
    ],
)
def test_slo_met_checks_the_targets_the_request_sets(
    targets: tuple[float, float, float], measured: tuple[float | None, float | None, float], met: bool
) -> None:
    ttft, tpot, e2e = measured
    assert slo_met(*targets, DEFAULT_TTFT, DEFAULT_TPOT, ttft_ms=ttft, tpot_ms=tpot, e2e_ms=e2e) is met


def test_a_more_important_request_is_not_shed_while_less_important_traffic_arrives() -> None:
    q = make_queue("priority")
    missing(q, 20)
    q.observe_arrival(req("chat", ttft_slo_ms=200.0))  # priority 0 traffic, lately
    q.push(req("vip", prompt_tokens=4000, ttft_slo_ms=60_000.0, max_tokens=2000, priority=5), NOW)
    verdicts = {r.entry.request_id: r.verdict for r in offer(q, make_scheduler(), _backlogged, NOW)}
    assert verdicts == {"vip": Verdict.WAIT}


def test_a_prior_length_is_no_grounds_to_shed() -> None:
    """Before any answer of its class ended, a request's length is only its cap: the long request of
    the pair is no longer known to be long, so neither is shed (both wait for the backlog)."""
    q = make_queue("fcfs")
    missing(q, 20)
    q.observe_arrival(req("chat", ttft_slo_ms=200.0))
    q.push(
        req("long", prompt_tokens=4000, ttft_slo_ms=60_000.0, max_tokens=2000, output_tokens_prior=True), NOW
    )
    results = list(offer(q, make_scheduler(), _backlogged, NOW))
    assert [r.verdict for r in results] == [Verdict.WAIT] and "long" in q


def test_every_class_s_mean_length_is_no_grounds_to_shed() -> None:
    """A length learned over every class (the request's own has too few answers) is no more its own
    than the cap: the request is not shed on it."""
    q = make_queue("fcfs")
    missing(q, 20)
    q.observe_arrival(req("chat", ttft_slo_ms=200.0))
    long = req(
        "long",
        prompt_tokens=4000,
        ttft_slo_ms=60_000.0,
        max_tokens=2000,
        expected_output_tokens=2000,
        output_tokens_pooled=True,
    )
    q.push(long, NOW)
    results = list(offer(q, make_scheduler(), _backlogged, NOW))
    assert [r.verdict for r in results] == [Verdict.WAIT] and "long" in q
