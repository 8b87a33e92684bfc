"""Prediction error summaries (bench and simulate share them)."""

from __future__ import annotations

import dataclasses

import pytest

from workload.prediction import error_summary, format_prediction_error, prediction_error
from workload.report import RequestResult
from workload.spec import SloTarget


def result(index: int, ttft: tuple[float | None, float | None], ok: bool = True) -> RequestResult:
    return RequestResult(
        index=index,
        class_name="chat",
        slo=SloTarget(),
        prompt_tokens=10,
        max_tokens=4,
        completion_tokens=4,
        start_s=0.0,
        ttft_ms=ttft[1],
        tpot_ms=11.0,
        e2e_ms=100.0,
        error_code=None if ok else "UNAVAILABLE",
        predicted_ttft_ms=ttft[0],
        predicted_tpot_ms=10.0,
    )


def test_relative_error_median_p90_and_bias() -> None:
    summary = error_summary([(100.0, 110.0), (100.0, 80.0), (100.0, 100.0), (None, 5.0), (0.0, 3.0)])
    assert summary["count"] == 3
    assert summary["median"] == pytest.approx(0.1)
    assert summary["bias"] == pytest.approx((0.1 - 0.2 + 0.0) / 3)
    assert summary["p90"] == pytest.approx(0.18)
    assert error_summary([]) == {"median": None, "p90": None, "bias": None, "count": 0}


def test_warm_up_and_failures_are_left_out() -> None:
    results = [result(0, (100.0, 500.0)), result(1, (100.0, 120.0)), result(2, (100.0, 900.0), ok=False)]
    error = prediction_error(results, skip_first=1)
    assert error["skipped"] == 1
    assert error["ttft"]["count"] == 1 and error["ttft"]["median"] == pytest.approx(0.2)
    assert error["tpot"]["bias"] == pytest.approx(0.1)
    assert "TTFT error median 20.0%" in format_prediction_error(error)


def test_ttft_is_judged_from_the_placement_not_from_the_arrival() -> None:
    # 2 s in the router queue, then 120 ms to the first token against 100 ms predicted at placement.
    queued = dataclasses.replace(result(0, (100.0, 2120.0)), queue_wait_ms=2000.0)
    error = prediction_error([queued])
    assert error["ttft"]["median"] == pytest.approx(0.2)
    assert error["ttft"]["bias"] == pytest.approx(0.2)
