"""``--qlm-streams edf`` in the router's driver: streams in the router queue, e2e work in the virtual queues."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np
import pytest

from router.core.errors import status_name
from router.core.qlm import QlmConfig
from router.placement import PlacementRequest
from tests.router.test_admission import gauge
from tests.router.test_dispatch_conformance import (
    BUSY,
    IDLE,
    REFUSAL_CODES,
    Source,
    answer_all,
    end_all,
    fill_until_one_waits,
    request,
    router_driver,
)


def e2e(rid: str) -> PlacementRequest:
    """An e2e-judged request (no TTFT or TPOT target): the virtual queues'."""
    return dataclasses.replace(request(rid), ttft_slo_ms=0.0, tpot_slo_ms=0.0, e2e_slo_ms=60_000.0)


def assert_answered_and_nothing_left(
    admission: Any, observer: Any, tasks: dict[str, asyncio.Future[Any]]
) -> None:
    """Every request placed or refused with a refusal's code; no request left in the router queue,
    the queue-depth gauge, the virtual queues' running batches or the in-flight account."""
    for task in tasks.values():
        exc = task.exception()
        assert exc is None or status_name(exc) in REFUSAL_CODES  # type: ignore[arg-type]
    assert len(admission.dispatcher) == 0 and gauge(observer) == 0
    assert not any(admission.dispatcher.qlm.running)
    assert len(admission.placer.scheduler.inflight) == 0


async def test_streams_and_e2e_requests_are_each_answered_once_and_nothing_stays_behind() -> None:
    source = Source(BUSY)
    admission, observer = router_driver("qlm", source, qlm=QlmConfig(streams="edf"))
    dispatcher = admission.dispatcher
    tasks = {
        f"r{k}": asyncio.ensure_future(admission.place(request(f"r{k}") if k % 2 else e2e(f"r{k}")))
        for k in range(8)
    }
    await asyncio.sleep(0)
    qlm = dispatcher.qlm  # type: ignore[attr-defined]
    streams = dispatcher.streams  # type: ignore[attr-defined]
    # Each kind waits in its own queue: the streams in the router queue, the e2e work in the groups.
    assert all(f"r{k}" in streams.queue or f"r{k}" in qlm.running[0] for k in range(1, 8, 2))
    assert not any(f"r{k}" in streams.queue for k in range(0, 8, 2))
    source.current = IDLE
    seen_running: set[str] = set()

    def running_in_the_batch(rid: str) -> None:
        if int(rid[1:]) % 2:
            # A stream placed by the slo policy runs in the virtual queues' batch too.
            assert rid in qlm.running[0]
            seen_running.add(rid)

    placed = await answer_all(admission, tasks, running_in_the_batch)
    assert len(placed) == len(tasks) and seen_running
    assert_answered_and_nothing_left(admission, observer, tasks)


async def test_a_stream_cancelled_in_the_router_queue_leaves_no_trace() -> None:
    source = Source(BUSY)
    admission, observer = router_driver("qlm", source, qlm=QlmConfig(streams="edf"), max_queue_size=8)
    held = await fill_until_one_waits(admission, 256)  # fill the instance until a stream waits
    rid, waiting = list(held.items())[-1]
    assert not waiting.done() and rid in admission.dispatcher.streams.queue  # type: ignore[attr-defined]
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await end_all(admission, held)
    assert gauge(observer) == 0 and len(admission.dispatcher) == 0
    assert len(admission.placer.scheduler.inflight) == 0


async def test_auto_hands_streams_to_the_router_queue_until_e2e_work_arrives() -> None:
    # --qlm-streams auto (the default): with no e2e-judged request seen lately a stream waits in the
    # router queue (nothing for the virtual queues to plan); once one has arrived, the next stream joins
    # the virtual queues beside it unless the prefix index finds its prompt cached. Every request is
    # answered once and nothing stays behind.
    source = Source(BUSY)
    admission, observer = router_driver("qlm", source, qlm=QlmConfig())
    assert QlmConfig().streams == "auto"
    dispatcher = admission.dispatcher
    tasks = {"s0": asyncio.ensure_future(admission.place(request("s0")))}
    await asyncio.sleep(0)
    tasks["e1"] = asyncio.ensure_future(admission.place(e2e("e1")))
    await asyncio.sleep(0)
    # A prompt the prefix index finds nowhere (every other request here sends the same 256 tokens).
    fresh = dataclasses.replace(request("s2"), prompt_token_ids=tuple(range(2, 258)))
    tasks["s2"] = asyncio.ensure_future(admission.place(fresh))
    await asyncio.sleep(0)
    # A prompt the index finds cached goes to the router queue and the slo placement, which prices it.
    tasks["s3"] = asyncio.ensure_future(admission.place(request("s3")))
    await asyncio.sleep(0)
    qlm = dispatcher.qlm  # type: ignore[attr-defined]
    streams = dispatcher.streams  # type: ignore[attr-defined]
    assert "s0" in streams.queue or "s0" in qlm.running[0]
    assert "s0" not in qlm.queued
    assert "s2" in qlm.queued or "s2" in qlm.running[0]
    assert "s2" not in streams.queue
    assert "s3" in streams.queue or "s3" in qlm.running[0]
    assert "s3" not in qlm.queued
    source.current = IDLE
    placed = await answer_all(admission, tasks, lambda rid: None)
    assert len(placed) == len(tasks)
    assert_answered_and_nothing_left(admission, observer, tasks)


async def test_the_virtual_queues_stream_checks_read_the_routers_calibration() -> None:
    # The stream-side checks predict a stream's step as the ``slo`` policy does: with the scheduler's
    # calibration of the instance (fed by the agents' step samples here, by the engines' in the
    # simulator), read through the same dispatcher in both.
    source = Source(IDLE)
    admission, _ = router_driver("qlm", source)
    task = asyncio.ensure_future(admission.place(e2e("r0")))
    await asyncio.sleep(0)
    dispatcher: Any = admission.dispatcher
    qlm = dispatcher.qlm
    predictors = admission.placer.scheduler.predictors
    assert predictors is not None and predictors.calibration is not None
    assert qlm.calibration is not None and qlm.calibration() is None  # nothing measured yet
    profile_s = qlm.models[0].step_s(8, 8000.0)
    assert qlm._stream_step_s(0, 8, 8000.0) == pytest.approx(profile_s * qlm.inefficiency[0])
    # The instance's decode steps run at twice the profile's step.
    steps = np.array([[0.0, 8.0, 8000.0, 2e3 * profile_s]] * 64)
    predictors.calibration.observe_steps([(dispatcher.ids[0], "", steps)], 100.0)
    assert qlm.calibration() is not None
    assert qlm._stream_step_s(0, 8, 8000.0) == pytest.approx(2 * profile_s, rel=0.05)
    await task
