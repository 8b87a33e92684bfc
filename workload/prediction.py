"""Prediction error: how far the router's predicted TTFT and TPOT were from what each request saw.

For every successful request that carries a prediction (the router's ``route``
message, or the simulator's decision) and an observation, the relative error
is ``|observed - predicted| / predicted`` and the signed one
``(observed - predicted) / predicted``. A summary gives the median and p90 of
the relative error and the bias (mean signed error: > 0 means the router
predicts too fast). ``slo-router bench`` and ``slo-router simulate`` report the
same summary.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from workload.report import RequestResult


def error_summary(pairs: Iterable[tuple[float | None, float | None]]) -> dict[str, Any]:
    """``{median, p90, bias, count}`` over (predicted, observed) pairs; None figures without any pair."""
    pred: list[float] = []
    obs: list[float] = []
    for p, o in pairs:
        if p is None or o is None or not (math.isfinite(p) and math.isfinite(o)) or p <= 0:
            continue
        pred.append(p)
        obs.append(o)
    if not pred:
        return {"median": None, "p90": None, "bias": None, "count": 0}
    predicted = np.asarray(pred)
    signed = (np.asarray(obs) - predicted) / predicted
    relative = np.abs(signed)
    return {
        "median": float(np.median(relative)),
        "p90": float(np.percentile(relative, 90)),
        "bias": float(np.mean(signed)),
        "count": len(pred),
    }


def prediction_error(results: Sequence[RequestResult], *, skip_first: int = 0) -> dict[str, Any]:
    """``{"ttft": summary, "tpot": summary, "skipped": n}`` over successful requests.

    ``skip_first`` leaves out the requests with the lowest ``index`` (a warm-up
    during which an online calibration is still learning). The observed TTFT
    is counted from the request's placement: the time it waited in the router
    queue before (``queue_wait_ms``) is the queue's doing, not a prediction's.
    """
    ordered = sorted(results, key=lambda r: r.index)[max(0, skip_first) :]
    ok = [r for r in ordered if r.error_code is None]
    return {
        "ttft": error_summary(
            (r.predicted_ttft_ms, None if r.ttft_ms is None else r.ttft_ms - r.queue_wait_ms) for r in ok
        ),
        "tpot": error_summary((r.predicted_tpot_ms, r.tpot_ms) for r in ok),
        "skipped": len(results) - len(ordered),
    }


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100.0 * value:.1f}%"


def format_prediction_error(error: dict[str, Any]) -> str:
    """One line: ``TTFT error median / p90 / bias, TPOT ...``."""
    parts = []
    for key in ("ttft", "tpot"):
        s = error[key]
        parts.append(
            f"{key.upper()} error median {_pct(s['median'])} p90 {_pct(s['p90'])} bias {_pct(s['bias'])} "
            f"(n={s['count']})"
        )
    return "prediction " + "; ".join(parts)
