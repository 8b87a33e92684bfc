"""``auto`` (:mod:`router.core.auto_dispatch`): request dispatch, a pilot over the engines'
preemption counts, then slices for new arrivals where they pay; events follow their request."""

from __future__ import annotations

import logging

import pytest

from fleet.snapshot import ClusterSnapshot
from router.core.auto_dispatch import Auto
from router.core.dispatch import (
    DISPATCHERS,
    Action,
    Arrival,
    Cancel,
    Completion,
    DispatchSetup,
    Outcome,
    Preempted,
    Timer,
    make_dispatcher,
)
from router.core.queue import QueueConfig
from router.core.request import ScheduleInput
from router.core.slicing import SliceConfig, slices_pay_recomputed
from tests.router.core.helpers import inst, make_snapshot
from tests.router.core.test_slice_dispatch import Engines

NOW = 100.0


def fleet_with(counts: dict[str, int | None], tokens: dict[str, int] | None = None) -> ClusterSnapshot:
    """Neutral instances whose statuses carry these cumulative preemption counts (None: not reported)
    and, for those in ``tokens``, the tokens their engines recomputed for the requests they preempted."""
    records = []
    for instance, count in counts.items():
        record = inst(instance, "neutral")
        assert record.status is not None
        if count is not None:
            record.status.num_preemptions = count
        if tokens is not None and instance in tokens:
            record.status.num_preemption_recompute_tokens = tokens[instance]
        records.append(record)
    return make_snapshot(*records)


def auto(pilot: int = 10, *, queue_policy: str = "none", timeout_s: float = 120.0) -> Auto:
    setup = DispatchSetup(
        QueueConfig(queue_policy=queue_policy), 10_000.0, 1000.0, slicing=SliceConfig(), dispatcher="auto"
    )
    return Auto(setup, pilot_requests=pilot, pilot_timeout_s=timeout_s)


def request(rid: str) -> ScheduleInput:
    return ScheduleInput(rid, 256, ttft_slo_ms=60_000.0, tpot_slo_ms=1000.0, max_tokens=64, arrival_s=NOW)


def arrive(d: Auto, fleet: Engines, rid: str, now: float = NOW) -> list[Action]:
    return list(d.handle(Arrival(request(rid), rid), now, fleet))


def pilot(d: Auto, fleet: Engines, n: int) -> None:
    """``n`` arrivals, each placed at once, whole, by request dispatch."""
    for k in range(n):
        *_, action = arrive(d, fleet, f"r{k}")
        assert action.outcome is Outcome.DISPATCH and action.cap == 0 and action.request_id == f"r{k}"


def test_registered_and_built_from_the_flag() -> None:
    assert "auto" in DISPATCHERS.names()
    setup = DispatchSetup(QueueConfig(queue_policy="edf"), 10_000.0, 1000.0, dispatcher="auto")
    d = make_dispatcher(setup)
    assert isinstance(d, Auto) and d.mode == "request" and d.request.name == "edf"


def test_stays_on_request_dispatch_where_the_engines_rarely_preempt() -> None:
    # 4 preemptions before the pilot (not counted), then 0 over 10 requests: the KV holds.
    fleet = Engines(fleet_with({"n0": 4, "n1": 0}))
    d = auto(10)
    pilot(d, fleet, 10)
    for k in range(10):
        list(d.handle(Completion(f"r{k}", 64), NOW + 1 + k, fleet))
    assert d.decided and d.mode == "request"
    assert d.counters()["auto_pilot_preemptions"] == 0
    (action,) = arrive(d, fleet, "late", NOW + 20)
    assert action.outcome is Outcome.DISPATCH and action.cap == 0  # a whole request


def test_a_preemption_short_of_one_per_ten_does_not_switch() -> None:
    fleet = Engines(fleet_with({"n0": 0, "n1": 0}))
    d = auto(20)
    pilot(d, fleet, 20)
    fleet.current = fleet_with({"n0": 1, "n1": 0})  # 1 over 20 requests
    for k in range(20):
        list(d.handle(Completion(f"r{k}", 64), NOW + 1, fleet))
    assert d.decided and d.mode == "request" and d.pilot_preemptions == 1


def test_switches_to_slices_once_the_engines_preempt_once_per_ten_requests() -> None:
    fleet = Engines(fleet_with({"n0": 7, "n1": 0}))
    d = auto(10)
    pilot(d, fleet, 10)
    assert not d.decided
    fleet.current = fleet_with({"n0": 7, "n1": 1})  # one preemption over 10 requests dispatched
    list(d.handle(Completion("r0", 64), NOW + 1, fleet))
    # Decided at once (the other nine still run): the count only grows.
    assert d.decided and d.mode == "slice" and d.pilot_preemptions == 1
    assert d.counters()["auto_slice"] == 1
    (queued,) = arrive(d, fleet, "s0", NOW + 2)
    assert queued.outcome is Outcome.QUEUED  # the slice pool: placed at the next schedule point
    wake = d.wake_s()
    assert wake is not None
    placed = list(d.handle(Timer(), max(wake, NOW + 2), fleet))
    assert [(a.request_id, a.outcome) for a in placed] == [("s0", Outcome.DISPATCH)]
    assert placed[0].cap > 0  # a slice: capped (here at its whole answer, 64 tokens)


def test_events_go_to_the_dispatcher_that_took_the_request() -> None:
    fleet = Engines(fleet_with({"n0": 0, "n1": 0}))
    d = auto(10, queue_policy="edf")
    pilot(d, fleet, 10)
    fleet.current = fleet_with({"n0": 3, "n1": 0})
    list(d.handle(Completion("r0", 64), NOW + 1, fleet))
    assert d.mode == "slice"
    arrive(d, fleet, "s0", NOW + 2)
    assert len(d.slice) == 1 and len(d.request) == 0
    # A request placed by request dispatch ends there: nothing reaches the slice dispatcher.
    assert list(d.handle(Completion("r1", 64), NOW + 3, fleet)) == []
    assert "r1" not in d._owner and len(d.slice) == 1
    # The waiting slice's cancel goes to the slice dispatcher, which lets it leave.
    (left,) = d.handle(Cancel("s0"), NOW + 4, fleet)
    assert left.outcome is Outcome.LEFT and left.request_id == "s0"
    assert len(d) == 0 and "s0" not in d._owner


def test_stays_on_request_dispatch_and_says_why_where_the_engines_do_not_count_preemptions(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fleet = Engines(fleet_with({"n0": None, "n1": None}))
    d = auto(10)
    pilot(d, fleet, 10)
    with caplog.at_level(logging.WARNING, logger="router.core.auto_dispatch"):
        for k in range(10):
            list(d.handle(Completion(f"r{k}", 64), NOW + 1, fleet))
        arrive(d, fleet, "late", NOW + 2)
        list(d.handle(Completion("late", 64), NOW + 3, fleet))
    assert d.decided and d.mode == "request"
    assert "preemption count" in d.reason
    assert [r.levelno for r in caplog.records] == [logging.WARNING]  # once


def test_a_pilot_that_outlasts_its_time_decides_on_what_it_counted() -> None:
    fleet = Engines(fleet_with({"n0": 0, "n1": 0}))
    d = auto(10, timeout_s=5.0)
    pilot(d, fleet, 3)
    assert not d.decided
    (action,) = arrive(d, fleet, "after", NOW + 6)
    assert d.decided and d.mode == "request"
    assert action.outcome is Outcome.DISPATCH and action.cap == 0


def test_an_engine_restart_counts_from_its_new_start() -> None:
    fleet = Engines(fleet_with({"n0": 50, "n1": 0}))
    d = auto(10)
    pilot(d, fleet, 10)
    fleet.current = fleet_with({"n0": 2, "n1": 0})  # n0 restarted: 2 since then
    list(d.handle(Completion("r0", 64), NOW + 1, fleet))
    assert d.decided and d.mode == "slice" and d.pilot_preemptions == 2


def test_preemptions_behind_cached_prefixes_count_for_the_tokens_they_recompute() -> None:
    # 3 preemptions over 20 requests of 256-token prompts (past one per ten), but the engines
    # recomputed 300 tokens for them (the rest was in their prefix caches): 6 % of 5,120 prompt tokens.
    fleet = Engines(fleet_with({"n0": 5, "n1": 0}, {"n0": 9_000, "n1": 0}))
    d = auto(20)
    pilot(d, fleet, 20)
    fleet.current = fleet_with({"n0": 7, "n1": 1}, {"n0": 9_200, "n1": 100})
    for k in range(20):
        list(d.handle(Completion(f"r{k}", 64), NOW + 1, fleet))
    assert d.decided and d.mode == "request" and d.pilot_preemptions == 3
    assert d.pilot_recomputed_tokens == 300 and "recomputing 300 tokens (0.06 per prompt token)" in d.reason
    # Unweighed (no instance says what its preemptions cost), the same count switches.
    fleet = Engines(fleet_with({"n0": 5, "n1": 0}))
    d = auto(20)
    pilot(d, fleet, 20)
    fleet.current = fleet_with({"n0": 7, "n1": 1})
    list(d.handle(Completion("r0", 64), NOW + 1, fleet))
    assert d.decided and d.mode == "slice"


def test_where_prompts_share_prefixes_the_count_decides() -> None:
    # The same cheap preemptions (300 tokens recomputed, 3 over 20 requests), but every prompt after the
    # first leads with the 512 tokens of a system prompt an earlier one had: the slice plan holds such a
    # prefix once per instance and the count says slices pay.
    def shared(rid: str) -> ScheduleInput:
        return ScheduleInput(
            rid,
            768,
            ttft_slo_ms=60_000.0,
            tpot_slo_ms=1000.0,
            max_tokens=64,
            arrival_s=NOW,
            prefix_hashes=(7, 8),
        )

    for hashes_shared in (True, False):
        fleet = Engines(fleet_with({"n0": 5, "n1": 0}, {"n0": 9_000, "n1": 0}))
        d = auto(20)
        for k in range(20):
            r = shared(f"r{k}") if hashes_shared else request(f"r{k}")
            *_, action = d.handle(Arrival(r, r.request_id), NOW, fleet)
            assert action.outcome is Outcome.DISPATCH
        fleet.current = fleet_with({"n0": 7, "n1": 1}, {"n0": 9_200, "n1": 100})
        for k in range(20):
            list(d.handle(Completion(f"r{k}", 64), NOW + 1, fleet))
        assert d.decided and d.mode == ("slice" if hashes_shared else "request")


def test_a_long_request_preempted_weighs_more_than_its_count() -> None:
    # One preemption over 20 requests (under one per ten), but it recomputed 1,500 tokens: 29 % of
    # the prompt tokens dispatched.
    fleet = Engines(fleet_with({"n0": 0, "n1": 0}, {"n0": 0, "n1": 0}))
    d = auto(20)
    pilot(d, fleet, 20)
    fleet.current = fleet_with({"n0": 1, "n1": 0}, {"n0": 1_500, "n1": 0})
    list(d.handle(Completion("r0", 64), NOW + 1, fleet))
    assert d.decided and d.mode == "slice" and d.pilot_preemptions == 1


def test_the_raw_count_decides_where_an_instance_does_not_say_what_its_preemptions_cost() -> None:
    fleet = Engines(fleet_with({"n0": 0, "n1": 0}, {"n0": 0}))
    d = auto(20)
    pilot(d, fleet, 20)
    fleet.current = fleet_with({"n0": 1, "n1": 1}, {"n0": 10})  # 10 tokens, but n1 does not say
    list(d.handle(Completion("r0", 64), NOW + 1, fleet))
    assert d.decided and d.mode == "slice" and "recomputing" not in d.reason


def test_slices_pay_from_a_quarter_of_the_prompt_tokens_recomputed() -> None:
    assert slices_pay_recomputed(250, 1000) and not slices_pay_recomputed(249, 1000)
    assert not slices_pay_recomputed(100, 0)


def switched_to_slices(fleet: Engines) -> Auto:
    """A pilot of ten whole requests, three preemptions on ``n0``: ``auto`` switched to slices, and the
    first arrival after the switch placed (r1-r9 still run whole where request dispatch put them)."""
    d = auto(10)
    pilot(d, fleet, 10)
    fleet.current = fleet_with({"n0": 3, "n1": 0})
    list(d.handle(Completion("r0", 64), NOW + 1, fleet))
    assert d.mode == "slice"
    arrive(d, fleet, "s0", NOW + 2)
    wake = d.wake_s()
    assert wake is not None
    list(d.handle(Timer(), max(wake, NOW + 2), fleet))
    return d


def test_after_the_switch_the_slice_plan_counts_the_whole_requests_still_running() -> None:
    """The requests request dispatch placed before the switch keep running where they are: the slice
    plan counts each beside its slices (its prompt and tokens so far, growing to its expected end),
    a preemption beside them leaves the plan's preemption cap alone, and each one's end frees its
    instance for the slices queued there."""
    fleet = Engines(fleet_with({"n0": 0, "n1": 0}))
    d = switched_to_slices(fleet)
    sched = d.slice.sched
    assert sched is not None and sched.residents is not None
    where = {rid: instance for rid, (instance, _) in d._placed.items()}
    assert sorted(where) == [f"r{k}" for k in range(1, 10)]
    fleet.tokens["r1"] = 10
    held = sched.residents(where["r1"])
    assert (256.0 + 10, 64.0 - 10) in held and (256.0, 64.0) in held
    assert len(held) == sum(1 for i in where.values() if i == where["r1"])
    # Their preemptions are not the plan's: its cap on that instance holds.
    list(d.handle(Preempted(where["r1"]), NOW + 3, fleet))
    assert sched.models(where["r1"]).memory_fit.zeta == 1.0
    for k in range(1, 10):
        list(d.handle(Completion(f"r{k}", 64), NOW + 4, fleet))
    assert not d._placed and sched.residents(where["r1"]) == []
    assert where["r1"] in d.slice._freed
    # Alone with its slices again, a preemption there is the plan's.
    list(d.handle(Preempted(where["r1"]), NOW + 5, fleet))
    assert sched.models(where["r1"]).memory_fit.zeta < 1.0


class Evicting(Engines):
    """:class:`Engines` whose running requests may be stopped (the driver's evict)."""

    def __init__(self, snapshot: ClusterSnapshot) -> None:
        super().__init__(snapshot)
        self.evicted: list[str] = []

    def evict(self, request_id: str) -> int | None:
        tokens = self.tokens.pop(request_id, None)
        if tokens is not None:
            self.evicted.append(request_id)
        return tokens


def test_after_the_switch_a_preemption_beside_whole_requests_hands_the_newest_to_slices() -> None:
    """SCLS runs every request in slices: once an engine preempts beside the whole requests request
    dispatch left running, the newest of them there is stopped and resumed after its tokens as a
    slice, owned by the slice plan from then on."""
    fleet = Evicting(fleet_with({"n0": 0, "n1": 0}))
    d = switched_to_slices(fleet)
    where = {rid: instance for rid, (instance, _) in d._placed.items()}
    for rid in where:
        fleet.tokens[rid] = 20
    there = [rid for rid in where if where[rid] == where["r1"]]
    newest = there[-1]
    out = list(d.handle(Preempted(where["r1"]), NOW + 3, fleet))
    evicts = [a for a in out if a.outcome is Outcome.EVICT]
    assert [(a.request_id, a.tokens) for a in evicts] == [(newest, 20)]
    assert fleet.evicted == [newest]
    # The others stay whole where they run; the newest is the slice plan's now.
    assert newest not in d._placed and all(rid in d._placed for rid in there[:-1])
    assert d._owner[newest] is d.slice and d.counters()["auto_handed_over"] == 1
    wake = d.wake_s()
    assert wake is not None
    placed = [a for a in d.handle(Timer(), max(wake, NOW + 3), fleet) if a.outcome is Outcome.DISPATCH]
    resumed = [a for a in placed if a.request_id == newest]
    assert len(resumed) == 1 and resumed[0].tokens == 20 and 0 < resumed[0].cap <= 64 - 20
    # Its end is the slice plan's.
    assert list(d.handle(Completion(newest, 64), NOW + 4, fleet)) == []
    assert newest not in d.slice._slices
