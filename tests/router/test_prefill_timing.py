"""A stock engine's prefill steps, timed by the router, calibrate its TTFT prediction.

A stock vLLM reports no prefill steps (its agent's samples are decode steps estimated from
``GetLoads``); the router times a prefill leg that runs alone on such an engine and hands it to
the calibration as one step (:class:`router.placement.PrefillTiming`), alone or beside running decodes.
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


def _profile_step_ms(placer: Placer, prefill: int, batch: int = 0, tokens: int = 0) -> tuple[float, float]:
    """The profile's (prefill part, decode part) of one step, ms."""
    predictors = placer.scheduler.predictors
    assert predictors is not None
    pre, dec = predictors.step_predictor("g")(
        np.array([float(prefill)]), np.array([float(batch)]), np.array([float(tokens)])
    )
    return float(pre[0]), float(dec[0])


def _teach(
    placer: Placer, clock: list[float], batch: int, tokens: int, n: int = 60, late_s: float = 0.0
) -> None:
    """``n`` legs on an engine at 3x the profile, each arriving half a decode step into a step; with
    ``late_s``, handed over that long after the first token arrived (as the service does, once the
    token went out), with the arrival time."""
    for k in range(n):
        prompt = 16 + k  # short: the decode part of the step (and the wait for it) weighs
        placer.scheduler.inflight.record(f"r{k}", "a", "a", prompt, clock[0])
        timing = placer.time_prefill(_choice())
        assert timing is not None and timing.group == "g"
        assert (timing.decode_requests, timing.decode_tokens) == (batch, tokens)
        pre, dec = _profile_step_ms(placer, prompt, batch, tokens)
        clock[0] += (0.5 * dec + 3.0 * (pre + dec)) / 1000.0
        if late_s:
            arrived = placer.now()
            clock[0] += late_s
            placer.prefill_timed(timing, prompt, arrived)
        else:
            placer.prefill_timed(timing, prompt)
        placer.scheduler.inflight.release(f"r{k}")


def test_legs_on_an_idle_stock_engine_teach_its_ttft_factor() -> None:
    placer, clock = _placer(running=0, waiting=0)
    assert placer.calibration is not None
    assert placer.calibration.factors("a") == (1.0, 1.0)
    _teach(placer, clock, 0, 0)
    ttft_factor, tpot_factor = placer.calibration.factors("a")
    assert 2.85 < ttft_factor < 3.15
    assert tpot_factor == 1.0  # a prefill sample says nothing of the decode steps


def test_a_sample_handed_over_late_is_timed_to_the_first_tokens_arrival() -> None:
    placer, clock = _placer(running=0, waiting=0)
    assert placer.calibration is not None
    _teach(placer, clock, 0, 0, late_s=0.5)  # half a second later: 100x a step, if it counted
    assert 2.85 < placer.calibration.factors("a")[0] < 3.15


def test_legs_beside_running_decodes_are_timed_as_mixed_steps() -> None:
    placer, clock = _placer(running=6, waiting=0, decode_requests=6, decode_tokens=6 * 700)
    assert placer.calibration is not None
    _teach(placer, clock, 6, 6 * 700)
    assert 2.85 < placer.calibration.factors("a")[0] < 3.15


def test_legs_queued_behind_prompts_or_on_a_worker_are_not_timed() -> None:
    queued, _ = _placer(running=0, waiting=1)
    assert queued.time_prefill(_choice()) is None
    computing, _ = _placer(running=1, waiting=0, prefill_tokens=300)
    assert computing.time_prefill(_choice()) is None
    idle, clock = _placer(running=0, waiting=0)
    # Our own Worker service reports its prefill steps itself.
    assert idle.time_prefill(_choice("a.local:50051")) is None
    # Another prefill leg of this router is in flight there (its status does not show it yet).
    idle.scheduler.inflight.record("r1", "a", "a", 512, clock[0])
    idle.scheduler.inflight.record("r2", "a", "a", 512, clock[0])
    assert idle.time_prefill(_choice()) is None
    idle.scheduler.inflight.release("r1")
    assert idle.time_prefill(_choice()) is not None
