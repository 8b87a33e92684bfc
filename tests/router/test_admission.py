"""The router shell's admission: requests wait on the queue and leave it on events, cancels and timers.

Real scheduler, real snapshots; the snapshot source is a small object with the
reader's ``snapshot()`` interface whose view the test swaps (as a CMS push would).
"""

from __future__ import annotations

import asyncio
import random

import pytest

from fleet.snapshot import ClusterSnapshot
from router.admission import Admission
from router.core.config import SchedulerConfig
from router.core.errors import NoInstanceError, QueueFullError, QueueTimeoutError
from router.core.qlm import QlmConfig
from router.core.queue import QueueConfig
from router.core.request import ScheduleInput
from router.core.scheduler import Scheduler
from router.placement import PlacementRequest, Placer
from router.telemetry import RequestObserver
from tests.router.core.helpers import inst, make_predictor, make_request, make_snapshot

BUSY = make_snapshot(inst("p0", "prefill", prefill_tokens=40000), inst("d0", "decode"))
IDLE = make_snapshot(inst("p0", "prefill"), inst("d0", "decode"))


class Source:
    """The reader interface the placer reads (``snapshot()``); the test installs views."""

    def __init__(self, snapshot: ClusterSnapshot) -> None:
        self.current = snapshot

    def snapshot(self) -> ClusterSnapshot:
        return self.current


def make_admission(source: Source, **queue: object) -> tuple[Admission, RequestObserver]:
    scheduler = Scheduler(SchedulerConfig(scheduling_policy="slo"), make_predictor(), random.Random(0))
    observer = RequestObserver()
    placer = Placer(scheduler, source, clock=lambda: 100.0, observer=observer)
    return Admission(placer, QueueConfig(**queue), clock=lambda: 100.0, observer=observer), observer  # type: ignore[arg-type]


def request(rid: str, *, ttft_ms: float = 300.0, priority: int = 0) -> PlacementRequest:
    return PlacementRequest(
        request_id=rid,
        prompt_token_ids=(1,) * 256,
        model="",
        ttft_slo_ms=ttft_ms,
        tpot_slo_ms=50.0,
        priority=priority,
        max_tokens=8,
        slo_class="chat",
        arrival_s=100.0,
    )


def gauge(observer: RequestObserver) -> float:
    return sum(
        sample.value
        for metric in observer.queue_length.collect()
        for sample in metric.samples
        if sample.name == "slo_router_queue_requests"
    )


async def test_a_waiting_request_leaves_the_queue_when_a_new_view_arrives() -> None:
    source = Source(BUSY)
    admission, observer = make_admission(source)
    task = asyncio.create_task(admission.place(request("a")))
    await asyncio.sleep(0)
    assert not task.done() and "a" in admission.queue and gauge(observer) == 1
    source.current = IDLE
    admission.notify()  # what the reader's listener does on a push
    admitted = await asyncio.wait_for(task, 5)
    assert admitted.route.prefill.instance_id == "p0" and admitted.late
    assert len(admission.queue) == 0 and gauge(observer) == 0
    assert len(admission.placer.scheduler.inflight) == 1  # recorded at dispatch
    admission.release("a")
    assert len(admission.placer.scheduler.inflight) == 0


async def test_cancel_takes_a_queued_request_out_at_once() -> None:
    admission, observer = make_admission(Source(BUSY))
    task = asyncio.create_task(admission.place(request("a")))
    await asyncio.sleep(0)
    assert "a" in admission.queue
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "a" not in admission.queue and gauge(observer) == 0
    assert len(admission.placer.scheduler.inflight) == 0


async def test_a_full_queue_sheds_the_least_valuable_request() -> None:
    admission, observer = make_admission(Source(BUSY), max_queue_size=1)
    low = asyncio.create_task(admission.place(request("low")))
    await asyncio.sleep(0)
    high = asyncio.create_task(admission.place(request("high", priority=5)))
    with pytest.raises(QueueFullError, match="--max-queue-size"):
        await asyncio.wait_for(low, 5)
    assert not high.done() and "high" in admission.queue and gauge(observer) == 1
    assert observer.registry.get_sample_value("slo_router_queue_events_total", {"event": "shed"}) == 1
    high.cancel()
    with pytest.raises(asyncio.CancelledError):
        await high


async def test_the_wait_bound_fires_without_any_other_event() -> None:
    loop_clock = asyncio.get_running_loop().time
    # Decode too loaded for the request's TPOT target (20 ms; 13 ms alone on an idle instance): it
    # waits on time, not late.
    decode_busy = inst("d0", "decode", decode_requests=200, decode_tokens=400000)
    source = Source(make_snapshot(inst("p0", "prefill"), decode_busy, taken_at_s=loop_clock()))
    scheduler = Scheduler(SchedulerConfig(scheduling_policy="slo"), make_predictor(), random.Random(0))
    placer = Placer(scheduler, source, clock=loop_clock)
    admission = Admission(placer, QueueConfig(max_queue_wait_ms=50.0), clock=loop_clock)
    req = request("a", ttft_ms=60000.0)  # on time for a minute: only the wait bound can end it
    req = PlacementRequest(**{**req.__dict__, "arrival_s": loop_clock(), "tpot_slo_ms": 20.0})
    with pytest.raises(QueueTimeoutError, match="--max-queue-wait-ms"):
        await asyncio.wait_for(admission.place(req), 5)
    assert len(admission.queue) == 0
    admission.close()


async def test_queue_none_refuses_at_once() -> None:
    from router.core.errors import NoInstanceError

    admission, _ = make_admission(Source(BUSY), queue_policy="none")
    with pytest.raises(NoInstanceError):
        await admission.place(request("a"))
    assert admission.queue is None and len(admission.dispatcher) == 0


async def test_sa_hands_the_next_request_over_as_soon_as_one_ends() -> None:
    # A burst in one loop iteration is planned in one pass; at most sa_max_batch requests run at a time,
    # and each end lets the plan's next request go at once (continuous batching, not whole batches).
    admission, observer = make_admission(Source(IDLE), queue_policy="sa", sa_max_batch=2, sa_pool_ms=0.0)
    tasks = {rid: asyncio.create_task(admission.place(request(rid, ttft_ms=60000.0))) for rid in "abcde"}

    async def settle() -> list[str]:
        for _ in range(5):  # the coalesced pass runs within a few loop iterations
            await asyncio.sleep(0)
        return sorted(rid for rid, t in tasks.items() if t.done())

    out = await settle()
    assert len(out) == 2 and len(admission.queue) == 3
    for rid in out:
        assert (await tasks[rid]).route.prefill.instance_id == "p0"
    admission.release(out[0])
    now = await settle()
    assert len(now) == 3 and set(out) <= set(now)  # one ended, exactly one more went
    for rid in list(now):
        admission.release(rid)
    assert len(await settle()) == 5  # the rest went as the slots freed
    for rid in "abcde":
        admission.release(rid)
    assert len(admission.queue) == 0 and gauge(observer) == 0
    assert len(admission.placer.scheduler.inflight) == 0
    assert admission.queue.planner.stats.runs >= 1


def long_request(rid: str) -> PlacementRequest:
    return PlacementRequest(
        request_id=rid,
        prompt_token_ids=(1,) * 256,
        model="",
        ttft_slo_ms=60_000.0,
        tpot_slo_ms=50.0,
        max_tokens=2000,
        slo_class="batch",
        arrival_s=100.0,
    )


def counter(observer: RequestObserver, name: str, **labels: str) -> float:
    return sum(
        sample.value
        for metric in observer.registry.collect()
        for sample in metric.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


async def test_objective_g_learns_from_outcomes_and_refuses_the_longest_waiting_request() -> None:
    source = Source(BUSY)
    admission, observer = make_admission(source, queue_policy="edf", queue_objective="g")
    assert counter(observer, "slo_router_queue_shed_limit_seconds") == float("inf")
    for k in range(20):  # requests that ended missing their SLO (TTFT 2 s against 300 ms)
        admission.outcome(request(f"done{k}"), finished=True, ttft_s=2.0, tpot_s=0.01, e2e_s=2.1)
    limit = counter(observer, "slo_router_queue_shed_limit_seconds")
    assert 0 < limit < 20  # 120 s x 0.9^20 (the test's clock stands still: the misses stay recent)
    # Tight traffic lately: release control keeps the busy instance for it, so the long request would wait.
    admission.queue.observe_arrival(make_request("chat", ttft_slo_ms=200.0))
    # Its class is known to answer at length (a prior length, the cap alone, would be no grounds to shed).
    for _ in range(admission.placer.lengths.config.min_samples):
        admission.placer.lengths.observe("batch", 256, 2000)
    with pytest.raises(QueueFullError, match="--queue-objective g"):
        await asyncio.wait_for(admission.place(long_request("long")), 5)
    assert counter(observer, "slo_router_queue_events_total", event="overlong") == 1
    assert "long" not in admission.queue
    # The refusal's own outcome does not move the limit; a met request raises it a little.
    admission.outcome(long_request("long"), finished=False, ttft_s=None, tpot_s=None, e2e_s=0.0)
    assert counter(observer, "slo_router_queue_shed_limit_seconds") == limit
    admission.outcome(request("fine"), finished=True, ttft_s=0.1, tpot_s=0.01, e2e_s=0.2)
    assert counter(observer, "slo_router_queue_shed_limit_seconds") > limit


async def test_objective_attainment_ignores_outcomes() -> None:
    source = Source(BUSY)
    admission, _ = make_admission(source, queue_policy="edf")
    for k in range(20):
        admission.outcome(request(f"done{k}"), finished=True, ttft_s=2.0, tpot_s=0.01, e2e_s=2.1)
    admission.queue.observe_arrival(make_request("chat", ttft_slo_ms=200.0))
    task = asyncio.create_task(admission.place(long_request("long")))
    await asyncio.sleep(0)
    assert not task.done() and "long" in admission.queue
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_qlm_dispatches_to_the_instance_its_plan_chose_even_where_slo_thresholds_would_refuse() -> None:
    """The qlm plan chose the instance: its dispatch checks health, not the scheduler's SLO thresholds.

    One neutral instance whose running requests are already past the residents' TPOT target: the
    ``slo`` policy's own decision refuses any new prompt there (``tpot_residents``), which made the
    router answer a request the qlm plan had placed with RESOURCE_EXHAUSTED.
    """
    crowded = make_snapshot(inst("n0", "neutral", decode_requests=180, decode_tokens=360000))
    scheduler = Scheduler(SchedulerConfig(scheduling_policy="slo"), make_predictor(), random.Random(0))
    placer = Placer(scheduler, Source(crowded), clock=lambda: 100.0)  # type: ignore[arg-type]
    with pytest.raises(NoInstanceError, match="tpot_residents"):
        placer.place(request("direct", ttft_ms=60000.0))
    admission = Admission(
        placer, QueueConfig(queue_policy="qlm"), QlmConfig(streams="qlm"), clock=lambda: 100.0
    )  # type: ignore[arg-type]
    admitted = await asyncio.wait_for(admission.place(request("a", ttft_ms=60000.0)), 5)
    assert admitted.route.prefill.instance_id == "n0"
    assert len(placer.scheduler.inflight) == 1  # recorded at dispatch, like any placement
    admission.release("a")
    assert len(placer.scheduler.inflight) == 0


async def test_a_request_placed_at_once_never_moves_the_queue_gauge() -> None:
    """Queued and dispatched in one dispatcher call: the gauge's +1 and -1 are both left out."""
    changes: list[int] = []

    class Counting(RequestObserver):
        def queue_changed(self, request: ScheduleInput, delta: int) -> None:
            changes.append(delta)
            super().queue_changed(request, delta)

    scheduler = Scheduler(SchedulerConfig(scheduling_policy="slo"), make_predictor(), random.Random(0))
    observer = Counting()
    source = Source(IDLE)
    placer = Placer(scheduler, source, clock=lambda: 100.0, observer=observer)
    admission = Admission(placer, QueueConfig(), clock=lambda: 100.0, observer=observer)
    admitted = await asyncio.wait_for(admission.place(request("a")), 5)
    assert admitted.route.prefill.instance_id == "p0"
    assert changes == [] and gauge(observer) == 0
    # One that waits still counts while it waits, and leaves the count when it goes.
    source.current = BUSY
    task = asyncio.create_task(admission.place(request("b")))
    await asyncio.sleep(0)
    assert not task.done() and changes == [1] and gauge(observer) == 1
    source.current = IDLE
    admission.notify()
    await asyncio.wait_for(task, 5)
    assert changes == [1, -1] and gauge(observer) == 0
