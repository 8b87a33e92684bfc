"""Every registered dispatcher under both drivers: answers, cancels, refusal codes, order, tokens.

The same checks run for each name in :data:`router.core.dispatch.DISPATCHERS`:

- the router's asyncio driver (:class:`router.admission.Admission` over a real placer and
  scheduler; the test swaps the cluster view as a CMS push would);
- the simulator's virtual-time driver (:func:`sim.cluster.simulate`);
- the pure protocol, with a fleet that takes one placement per pass, for the order each
  ordering dispatcher promises.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import pytest

from engine.model import SimConfig
from fleet.snapshot import ClusterSnapshot
from router.admission import Admission
from router.core.columns import ClusterView
from router.core.config import SchedulerConfig
from router.core.decision import Decision
from router.core.dispatch import (
    DISPATCHERS,
    Action,
    Arrival,
    Cancel,
    Completion,
    DispatchSetup,
    Outcome,
    ViewChanged,
    make_dispatcher,
    waiting_delta,
)
from router.core.errors import NoInstanceError, QueueFullError, RouterError, status_name
from router.core.plugins import Policy
from router.core.qlm import QlmConfig
from router.core.queue import QueueConfig
from router.core.request import ScheduleInput, Targets
from router.core.scheduler import Scheduler
from router.core.slicing import SliceConfig
from router.placement import PlacementRequest, Placer
from router.telemetry import RequestObserver
from sim.cluster import SimFleet, simulate
from sim.fleet import fleet_from_counts
from sim.slicing import simulate_slices
from tests.router.core.helpers import inst, make_predictor, make_snapshot
from tests.router.test_admission import gauge
from tests.router.test_admission import request as admission_request
from tests.sim.test_simulate import policy
from workload.spec import RequestPlan, SloTarget

NAMES = DISPATCHERS.names()
WAITING = [n for n in NAMES if n != "none"]
#: What a refusal may be answered with (never INTERNAL: that would be a bug).
REFUSAL_CODES = {"RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "UNAVAILABLE"}

# One neutral instance (qlm places whole requests): idle, or with a long prefill backlog.
IDLE = make_snapshot(inst("n0", "neutral"))
BUSY = make_snapshot(inst("n0", "neutral", prefill_tokens=60000))


def test_every_policy_is_a_registered_dispatcher() -> None:
    assert set(NAMES) >= {"none", "fcfs", "edf", "priority", "sa", "qlm", "slice"}


# ---------------------------------------------------------------------- the router's driver


class Source:
    def __init__(self, snapshot: ClusterSnapshot) -> None:
        self.current = snapshot

    def snapshot(self) -> ClusterSnapshot:
        return self.current


def setup_of(name: str, ttft_ms: float = 10_000.0, tpot_ms: float = 1000.0, **options: Any) -> DispatchSetup:
    """The dispatcher ``name``'s setup: a queue policy's, or ``slice`` (``--dispatch-mode slice``), or
    ``auto`` over ``edf`` (``--dispatch-mode auto``)."""
    qlm = options.pop("qlm", QlmConfig())
    if name == "slice":
        return DispatchSetup(
            QueueConfig(queue_policy="none", **options), ttft_ms, tpot_ms, qlm, dispatcher=name
        )
    if name == "auto":
        return DispatchSetup(
            QueueConfig(queue_policy="edf", **options), ttft_ms, tpot_ms, qlm, dispatcher=name
        )
    return DispatchSetup(QueueConfig(queue_policy=name, **options), ttft_ms, tpot_ms, qlm)


def router_driver(name: str, source: Source, **queue: Any) -> tuple[Admission, RequestObserver]:
    scheduler = Scheduler(SchedulerConfig(scheduling_policy="slo"), make_predictor(), random.Random(0))
    observer = RequestObserver()
    placer = Placer(scheduler, source, clock=lambda: 100.0, observer=observer)  # type: ignore[arg-type]
    # The test's clock stands still: sa must not wait for a pooling window to pass.
    options = {"sa_pool_ms": 0.0} if name == "sa" else {}
    setup = setup_of(name, scheduler.config.ttft_slo_ms, scheduler.config.tpot_slo_ms, **{**options, **queue})
    dispatcher = make_dispatcher(setup)
    admission = Admission(placer, setup.queue, clock=lambda: 100.0, observer=observer, dispatcher=dispatcher)
    return admission, observer


def request(rid: str, *, ttft_ms: float = 60_000.0, priority: int = 0) -> PlacementRequest:
    """The admission tests' request, with a TTFT target loose enough that only the order decides."""
    return admission_request(rid, ttft_ms=ttft_ms, priority=priority)


async def answer_all(
    admission: Admission,
    tasks: dict[str, asyncio.Task[Any]],
    on_placed: Callable[[str], None] | None = None,
) -> set[str]:
    """Let the driver answer ``tasks``: each round tells it the fleet may have room, then finishes
    what was placed (``on_placed`` sees each placed request first). The ids answered."""
    placed: set[str] = set()
    for _ in range(200):  # bounded: each round frees what was placed and tells the driver
        admission.notify()
        await asyncio.sleep(0.001)
        for rid, task in tasks.items():
            if task.done() and rid not in placed:
                placed.add(rid)
                if task.exception() is None:
                    if on_placed is not None:
                        on_placed(rid)
                    admission.release(rid, 8)
        if len(placed) == len(tasks):
            break
    return placed


@pytest.mark.parametrize("name", NAMES)
async def test_router_driver_answers_every_request_once_and_leaves_nothing_behind(name: str) -> None:
    source = Source(BUSY)
    admission, observer = router_driver(name, source)
    placer = admission.placer
    tasks = {
        f"r{k}": asyncio.ensure_future(admission.place(request(f"r{k}", priority=k % 2))) for k in range(6)
    }
    await asyncio.sleep(0)
    source.current = IDLE
    placed = await answer_all(admission, tasks)
    assert len(placed) == len(tasks)
    for task in tasks.values():
        exc = task.exception()
        assert exc is None or status_name(exc) in REFUSAL_CODES  # type: ignore[arg-type]
    assert len(admission.dispatcher) == 0 and gauge(observer) == 0
    assert len(placer.scheduler.inflight) == 0


async def fill_until_one_waits(admission: Admission, at_most: int) -> dict[str, asyncio.Task[Any]]:
    """Place requests ``h0``, ``h1``, ... until one waits (at most ``at_most``); the last one waits."""
    held: dict[str, asyncio.Task[Any]] = {}
    for k in range(at_most):  # bounded
        task = asyncio.ensure_future(admission.place(request(f"h{k}")))
        held[f"h{k}"] = task
        await asyncio.sleep(0)
        if not task.done():
            break
    return held


async def end_all(admission: Admission, held: dict[str, asyncio.Task[Any]]) -> None:
    """Finish what was placed of ``held`` and cancel what still waits."""
    for rid, task in held.items():
        if task.done() and not task.cancelled() and task.exception() is None:
            admission.release(rid, None)
        elif not task.done():
            task.cancel()
    await asyncio.gather(*held.values(), return_exceptions=True)


@pytest.mark.parametrize("name", WAITING)
async def test_router_driver_cancel_while_waiting_leaves_no_trace(name: str) -> None:
    source = Source(BUSY)
    admission, observer = router_driver(name, source, max_queue_size=8)
    # qlm pulls up to its batch at once whatever the load (streams on any instance with room, up to
    # the step their TPOT target allows): fill the batches first, so the next one waits.
    held = await fill_until_one_waits(admission, 1024)
    rid, waiting = list(held.items())[-1]
    assert not waiting.done() and gauge(observer) >= 1
    before = gauge(observer)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert gauge(observer) == before - 1
    # Whatever the others became, ending them leaves nothing waiting and nothing recorded.
    await end_all(admission, held)
    assert gauge(observer) == 0 and len(admission.dispatcher) == 0
    assert len(admission.placer.scheduler.inflight) == 0 and rid not in admission.placer.scheduler.inflight


@pytest.mark.parametrize("name", WAITING)
async def test_router_driver_refuses_a_full_queue_with_resource_exhausted(name: str) -> None:
    source = Source(BUSY)
    admission, _ = router_driver(name, source, max_queue_size=1)
    tasks = [asyncio.ensure_future(admission.place(request(f"r{k}", priority=0))) for k in range(80)]
    await asyncio.sleep(0.01)
    refused = [t for t in tasks if t.done() and isinstance(t.exception(), QueueFullError)]
    assert refused, "a queue of one never shed anything"
    assert all(status_name(t.exception()) == "RESOURCE_EXHAUSTED" for t in refused)  # type: ignore[arg-type]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_none_refuses_at_once_with_placements_error() -> None:
    admission, observer = router_driver("none", Source(BUSY))
    with pytest.raises(NoInstanceError) as info:
        await admission.place(request("a", ttft_ms=300.0))
    assert status_name(info.value) == "RESOURCE_EXHAUSTED" and gauge(observer) == 0


# ---------------------------------------------------------------------- the simulator's driver

TIGHT = SloTarget(ttft_ms=800.0, tpot_ms=100.0)
LOOSE = SloTarget(e2e_ms=600_000.0)


def tight_behind_loose() -> list[RequestPlan]:
    """Long loose requests fill the instance, then a burst of tight ones arrives behind them."""

    def plan(k: int, arrival: float, prompt: int, out: int, slo: SloTarget, name: str) -> RequestPlan:
        return RequestPlan(
            index=k,
            arrival_s=arrival,
            class_name=name,
            prompt_tokens=prompt,
            max_tokens=out,
            slo=slo,
            prompt_seed=k,
        )

    plans = [plan(k, 0.001 * k, 512, 600, LOOSE, "batch") for k in range(8)]
    plans += [plan(8 + k, 3.0 + 0.001 * k, 256, 32, TIGHT, "interactive") for k in range(4)]
    return plans


@pytest.mark.parametrize("name", NAMES)
def test_sim_driver_keeps_every_token_across_pauses_and_refuses_with_legal_codes(name: str) -> None:
    plans = tight_behind_loose()
    fleet = SimFleet(fleet_from_counts(neutral=1, engine=SimConfig(max_num_seqs=8)))
    if name == "slice":
        # Every request is paused at each slice's end and resumed after its tokens so far.
        sliced = simulate_slices(fleet, plans, SliceConfig(slice_tokens=16))
        results, decisions = sliced.results, sliced.figures.slices
        assert sliced.figures.slices > len(plans)
    elif name == "auto":
        queue = QueueConfig(queue_policy="edf")
        outcome = simulate(
            fleet, policy("slo"), plans, queue=queue, slicing=SliceConfig(slice_tokens=16), dispatch_mode=name
        )
        results, decisions = outcome.results, outcome.stats.decisions
    else:
        outcome = simulate(fleet, policy("slo"), plans, queue=QueueConfig(queue_policy=name))
        results, decisions = outcome.results, outcome.stats.decisions
    for result, p in zip(results, plans, strict=True):
        if result.ok:
            # Whatever paused it (qlm evicts), the answer is the whole answer: none lost, none twice.
            assert result.completion_tokens == p.max_tokens, (name, p.index)
        else:
            assert result.error_code in REFUSAL_CODES, (name, result.error_code, result.error_message)
    assert decisions >= sum(r.ok for r in results)


# ---------------------------------------------------------------------- the protocol: order


class OnePerPass:
    """A fleet that takes one placement per pass (the next pass: one more), over a real scheduler."""

    def __init__(self) -> None:
        self._scheduler = Scheduler(
            SchedulerConfig(scheduling_policy="load-balance"), make_predictor(), random.Random(0)
        )
        self.budget = 0

    @property
    def scheduler(self) -> Scheduler:
        return self._scheduler

    def view(self) -> ClusterView | ClusterSnapshot:
        return IDLE

    def snapshot(self) -> ClusterSnapshot:
        return IDLE

    def decide(
        self,
        view: ClusterView | ClusterSnapshot,
        request: ScheduleInput,
        now: float,
        *,
        targets: Targets | None = None,
        policy: Policy | None = None,
    ) -> Decision:
        if self.budget <= 0:
            raise NoInstanceError("full", stage="neutral", candidates=1, drops={})
        self.budget -= 1
        return self._scheduler.schedule(view, request, now, policy=policy)

    def evict(self, request_id: str) -> int | None:
        return None

    def produced(self, request_id: str) -> int | None:
        return None


#: (request id, priority, TTFT target ms) in arrival order, and the order each policy promises.
ARRIVALS = [("a", 0, 9000.0), ("b", 1, 5000.0), ("c", 0, 2000.0), ("d", 1, 8000.0)]
ORDERS = {"fcfs": ["a", "b", "c", "d"], "edf": ["c", "b", "d", "a"], "priority": ["b", "d", "c", "a"]}


@pytest.mark.parametrize("name", sorted(ORDERS))
def test_ordering_dispatchers_release_in_their_order(name: str) -> None:
    dispatcher = make_dispatcher(
        DispatchSetup(QueueConfig(queue_policy=name, max_queue_wait_ms=600_000.0), 10_000.0, 1000.0)
    )
    fleet = OnePerPass()
    waiting = 0
    for rid, priority, ttft in ARRIVALS:
        req = ScheduleInput(
            rid, 256, ttft_slo_ms=ttft, tpot_slo_ms=1000.0, priority=priority, arrival_s=100.0
        )
        waiting += sum(waiting_delta(a) for a in list(dispatcher.handle(Arrival(req, rid), 100.0, fleet)))
    assert waiting == len(dispatcher) == len(ARRIVALS)
    order: list[str] = []
    for step in range(len(ARRIVALS)):
        fleet.budget = 1  # a request ended: room for one more
        list(dispatcher.handle(Completion(f"earlier-{step}"), 100.0 + 0.001 * step, fleet))
        actions = list(dispatcher.handle(ViewChanged(), 100.0 + 0.001 * step, fleet))
        order += [a.request_id for a in actions if a.outcome is Outcome.DISPATCH]
    assert order == ORDERS[name]


def one_placed(name: str, fleet: OnePerPass) -> Any:
    """A dispatcher of ``name`` that placed (or, sa, holds) a first request: the next one waits.

    qlm pulls whatever its batch has room for at once: a batch of one is full after the first.
    """
    dispatcher = make_dispatcher(setup_of(name, qlm=QlmConfig(batch=1)))
    fleet.budget = 1
    first = ScheduleInput("first", 256, ttft_slo_ms=60_000.0, tpot_slo_ms=1000.0, arrival_s=100.0)
    list(dispatcher.handle(Arrival(first, "first"), 100.0, fleet))
    fleet.budget = 0
    return dispatcher


@pytest.mark.parametrize("name", WAITING)
def test_cancel_takes_a_request_out_and_a_completion_of_an_unknown_one_is_harmless(name: str) -> None:
    fleet = OnePerPass()
    dispatcher = one_placed(name, fleet)
    waiting = len(dispatcher)
    req = ScheduleInput("x", 256, ttft_slo_ms=60_000.0, tpot_slo_ms=1000.0, arrival_s=100.0)
    actions: list[Action] = list(dispatcher.handle(Arrival(req, "x"), 100.0, fleet))
    assert [a.outcome for a in actions] == [Outcome.QUEUED]
    left = list(dispatcher.handle(Cancel("x"), 100.0, fleet))
    assert [a.outcome for a in left] == [Outcome.LEFT] and len(dispatcher) == waiting
    assert list(dispatcher.handle(Cancel("x"), 100.0, fleet)) == []
    assert list(dispatcher.handle(Completion("nobody", 3), 100.0, fleet)) == []
    fleet.budget = 10
    later = list(dispatcher.handle(ViewChanged(), 100.1, fleet))
    assert "x" not in {a.request_id for a in later}  # the cancelled one never comes back


@pytest.mark.parametrize("name", WAITING)
def test_refuse_all_answers_every_waiting_request_with_the_error(name: str) -> None:
    fleet = OnePerPass()
    dispatcher = one_placed(name, fleet)
    for k in range(3):
        req = ScheduleInput(f"r{k}", 256, ttft_slo_ms=60_000.0, tpot_slo_ms=1000.0, arrival_s=100.0)
        list(dispatcher.handle(Arrival(req, k), 100.0, fleet))
    error = RouterError("stopping")
    refused = dispatcher.refuse_all(error)
    assert {"r0", "r1", "r2"} <= {a.request_id for a in refused}
    assert all(a.outcome is Outcome.REFUSE and a.error is error for a in refused) and len(dispatcher) == 0


# ---------------------------------------------------------------------- incremental dispatch


class Views:
    """A fleet over a real scheduler whose current snapshot the test sets; decisions are counted."""

    def __init__(self, snapshot: ClusterSnapshot) -> None:
        self._scheduler = Scheduler(
            SchedulerConfig(scheduling_policy="slo"), make_predictor(), random.Random(0)
        )
        self.current = snapshot
        self.decisions = 0

    @property
    def scheduler(self) -> Scheduler:
        return self._scheduler

    def view(self) -> ClusterView | ClusterSnapshot:
        return self.current

    def snapshot(self) -> ClusterSnapshot:
        return self.current

    def decide(
        self,
        view: ClusterView | ClusterSnapshot,
        request: ScheduleInput,
        now: float,
        *,
        targets: Targets | None = None,
        policy: Policy | None = None,
    ) -> Decision:
        self.decisions += 1
        return self._scheduler.schedule(view, request, now, targets=targets, policy=policy)

    def evict(self, request_id: str) -> int | None:
        return None

    def produced(self, request_id: str) -> int | None:
        return None


@pytest.mark.parametrize("name", sorted(ORDERS))
def test_a_view_whose_loads_only_grew_costs_no_decision_after_a_blocked_pass(name: str) -> None:
    def loaded(tokens: int, *, version: int) -> ClusterSnapshot:
        return make_snapshot(inst("n0", "neutral", prefill_tokens=tokens), version=version)

    dispatcher = make_dispatcher(DispatchSetup(QueueConfig(queue_policy=name), 10_000.0, 1000.0))
    fleet = Views(loaded(60_000, version=1))
    req = ScheduleInput("a", 256, ttft_slo_ms=3000.0, tpot_slo_ms=1000.0, arrival_s=100.0)
    first = [x.outcome for x in list(dispatcher.handle(Arrival(req, "a"), 100.0, fleet))]
    assert first[0] is Outcome.QUEUED and Outcome.DISPATCH not in first and len(dispatcher) == 1
    tried = fleet.decisions
    fleet.current = loaded(70_000, version=2)  # more load: nothing it could unblock
    assert list(dispatcher.handle(ViewChanged(), 100.01, fleet)) == []
    assert fleet.decisions == tried
    fleet.current = loaded(0, version=3)  # the backlog drained: the request goes
    placed = list(dispatcher.handle(ViewChanged(), 100.02, fleet))
    assert [x.outcome for x in placed] == [Outcome.DISPATCH] and fleet.decisions > tried


class Logged(OnePerPass):
    """:class:`OnePerPass` that logs each decision, so a test sees what came before it."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def decide(
        self,
        view: ClusterView | ClusterSnapshot,
        request: ScheduleInput,
        now: float,
        *,
        targets: Targets | None = None,
        policy: Policy | None = None,
    ) -> Decision:
        self.log.append(f"decide {request.request_id}")
        return super().decide(view, request, now, targets=targets, policy=policy)


@pytest.mark.parametrize("name", sorted(ORDERS))
def test_each_dispatch_is_carried_out_before_the_next_decision(name: str) -> None:
    """The next decision of a pass must see the load of the dispatch before it: a driver records a
    ``DISPATCH`` as it takes it, and the pass decides the next request only after that."""
    log: list[str] = []
    fleet = Logged(log)
    dispatcher = make_dispatcher(
        DispatchSetup(QueueConfig(queue_policy=name, max_queue_wait_ms=600_000.0), 10_000.0, 1000.0)
    )
    for rid, priority, ttft in ARRIVALS:
        req = ScheduleInput(
            rid, 256, ttft_slo_ms=ttft, tpot_slo_ms=1000.0, priority=priority, arrival_s=100.0
        )
        list(dispatcher.handle(Arrival(req, rid), 100.0, fleet))
    fleet.budget = len(ARRIVALS)
    list(dispatcher.handle(Completion("earlier"), 100.0, fleet))
    log.clear()
    for action in dispatcher.handle(ViewChanged(), 100.001, fleet):
        if action.outcome is Outcome.DISPATCH:
            log.append(f"carry {action.request_id}")
    assert log == [x for rid in ORDERS[name] for x in (f"decide {rid}", f"carry {rid}")]
