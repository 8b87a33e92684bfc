"""While requests come and nothing waits, a new cluster view is prepared for the next arrival when it
arrives (``Admission._warm_soon``): the arrival check's drain and the instance table are built then,
not on the next request's path. Real scheduler and snapshots; the snapshot source is swapped by the
test as a CMS push would swap it, and ``notify()`` is what the reader's listener calls."""

from __future__ import annotations

import asyncio
import random

from router.admission import WARM_AFTER_ARRIVAL_S, Admission
from router.core.config import SchedulerConfig
from router.core.queue import QueueConfig
from router.core.scheduler import Scheduler
from router.placement import PlacementRequest, Placer
from router.telemetry import RequestObserver
from tests.router.core.helpers import inst, make_predictor, make_snapshot
from tests.router.test_admission import Source


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def build(clock: Clock, queue_policy: str = "edf") -> tuple[Admission, Source]:
    source = Source(make_snapshot(inst("n0", "neutral"), inst("n1", "neutral")))
    scheduler = Scheduler(SchedulerConfig(scheduling_policy="slo"), make_predictor(), random.Random(0))
    placer = Placer(scheduler, source, clock=clock, observer=RequestObserver())
    admission = Admission(placer, QueueConfig(queue_policy=queue_policy), clock=clock)
    return admission, source


def request(rid: str, clock: Clock) -> PlacementRequest:
    return PlacementRequest(
        request_id=rid,
        prompt_token_ids=(1,) * 128,
        model="",
        ttft_slo_ms=1000.0,
        tpot_slo_ms=50.0,
        max_tokens=8,
        slo_class="chat",
        arrival_s=clock.now,
    )


def drain_view(admission: Admission) -> object:
    """The view the dispatcher's arrival check last built its drain for (None: none yet)."""
    check = admission.dispatcher._check  # type: ignore[attr-defined]
    return None if check is None or check._cached is None else check._cached[0]


async def test_a_new_view_is_prepared_for_the_next_arrival_while_requests_come() -> None:
    clock = Clock()
    admission, source = build(clock)
    await admission.place(request("a", clock))
    admission.release("a", 8)
    fresh = make_snapshot(inst("n0", "neutral", decode_requests=3), inst("n1", "neutral"))
    source.current = fresh
    admission.notify()  # the reader's listener, on the push
    assert drain_view(admission) is not fresh  # not on the listener's own path
    await asyncio.sleep(0)
    assert drain_view(admission) is fresh
    assert admission.placer.scheduler.views._table.snapshot is fresh  # the instance table too
    await admission.place(request("b", clock))  # the arrival on it is placed as ever


async def test_an_idle_router_does_not_prepare_views() -> None:
    clock = Clock()
    admission, source = build(clock)
    await admission.place(request("a", clock))
    admission.release("a", 8)
    clock.now += WARM_AFTER_ARRIVAL_S + 1.0
    fresh = make_snapshot(inst("n0", "neutral"), inst("n1", "neutral", decode_requests=2))
    source.current = fresh
    admission.notify()
    await asyncio.sleep(0)
    assert drain_view(admission) is not fresh


async def test_a_failing_preparation_leaves_the_router_serving() -> None:
    clock = Clock()
    admission, source = build(clock)
    await admission.place(request("a", clock))
    admission.release("a", 8)
    source.current = make_snapshot()  # no instance registered: the view cannot be read
    admission.notify()
    await asyncio.sleep(0)  # the preparation fails quietly
    source.current = make_snapshot(inst("n0", "neutral"))
    admitted = await admission.place(request("b", clock))
    assert admitted.route.decode.instance_id == "n0"
