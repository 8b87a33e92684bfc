"""A stock engine's prefill steps, timed by the router, calibrate its TTFT prediction.

A stock vLLM reports no prefill steps (its agent's samples are decode steps estimated from
``GetLoads``); the router times a prefill leg that runs alone on such an engine and hands it to
the calibration as one step (:class:`router.placement.PrefillTiming`).
"""

from __future__ import annotations

import numpy as np

from fleet.snapshot import ClusterSnapshot
from router.core.decision import Choice
from router.core.request import Stage
from router.placement import Placer
from tests.router.core.helpers import NOW, inst, make_scheduler, make_snapshot

STOCK = "vllm-grpc://a.local:50051"


class _Source:
    def __init__(self, snapshot: ClusterSnapshot) -> None:
        self.current = snapshot

    def snapshot(self) -> ClusterSnapshot:
        return self.current


def _placer(**status: int) -> tuple[Placer, list[float]]:
    scheduler = make_scheduler("slo", calibration="scale", instance_staleness_s=float("inf"))
    clock = [NOW]
    record = inst("a", meta={"labels": {"profile": "g"}}, **status)
    return Placer(scheduler, _Source(make_snapshot(record)), clock=lambda: clock[0]), clock


def _choice(endpoint: str = STOCK) -> Choice:
    return Choice("a", endpoint, Stage.PREFILL, 100.0, 10.0)


def _profile_prefill_ms(placer: Placer, tokens: int) -> float:
    predictors = placer.scheduler.predictors
    assert predictors is not None
    prefill, decode = predictors.step_predictor("g")(
        np.array([float(tokens)]), np.array([0.0]), np.array([0.0])
    )
    return float(prefill[0] + decode[0])


def test_legs_run_alone_on_a_stock_engine_teach_its_ttft_factor() -> None:
    placer, clock = _placer(running=0, waiting=0)
    assert placer.calibration is not None
    assert placer.calibration.factors("a") == (1.0, 1.0)
    for k in range(60):
        prompt = 200 + 37 * k
        placer.scheduler.inflight.record(f"r{k}", "a", "a", prompt, clock[0])
        timing = placer.time_prefill(_choice())
        assert timing is not None and timing.group == "g"
        clock[0] += 3.0 * _profile_prefill_ms(placer, prompt) / 1000.0  # the engine: 3x the profile
        placer.prefill_timed(timing, prompt)
        placer.scheduler.inflight.release(f"r{k}")
    ttft_factor, tpot_factor = placer.calibration.factors("a")
    assert 2.5 < ttft_factor < 3.5
    assert tpot_factor == 1.0  # a prefill sample says nothing of the decode steps


def test_legs_beside_other_work_or_on_a_worker_are_not_timed() -> None:
    busy, _ = _placer(running=2, waiting=0)
    assert busy.time_prefill(_choice()) is None
    queued, _ = _placer(running=0, waiting=1)
    assert queued.time_prefill(_choice()) is None
    idle, clock = _placer(running=0, waiting=0)
    # Our own Worker service reports its prefill steps itself.
    assert idle.time_prefill(_choice("a.local:50051")) is None
    # Another leg of this router is in flight there (its status does not show it yet).
    idle.scheduler.inflight.record("r1", "a", "a", 512, clock[0])
    idle.scheduler.inflight.record("r2", "a", "a", 512, clock[0])
    assert idle.time_prefill(_choice()) is None
    idle.scheduler.inflight.release("r1")
    assert idle.time_prefill(_choice()) is not None
