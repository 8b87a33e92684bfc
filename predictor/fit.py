"""Closed-form latency models fitted to a profile by least squares (written beside it as ``coefficients.json``).

The profile's grids are what the router interpolates; the coefficients are a
compact, extrapolable summary an operator can compare between fleets:

- prefill: ``t_p(l) = a·l + c`` ms for one prefill step of ``l`` tokens (the
  prefill time follows the batch's total input tokens: a step's chunk);
- decode: ``t_d(b, l) = α·b·l + β·b + γ·l + δ`` ms per decode step of ``b``
  requests with ``l`` tokens of context each: a linear model with an
  interaction term, fitted by ordinary least squares over the TPOT grid.

Each fit reports its largest relative error over the profile's points, so a
model that does not describe the hardware is visible.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from predictor.profile import TpotProfile, TtftProfile


def _max_relative_error(fitted: np.ndarray[Any, Any], observed: np.ndarray[Any, Any]) -> float:
    scale = np.maximum(np.abs(observed), 1e-9)
    return float(np.max(np.abs(fitted - observed) / scale))


def fit_prefill(tokens: np.ndarray[Any, Any], ms: np.ndarray[Any, Any]) -> dict[str, float]:
    """``a`` (ms per token) and ``c`` (ms) of ``t_p(l) = a·l + c``, and the largest relative error."""
    x = np.column_stack([tokens, np.ones_like(tokens)])
    (a, c), *_ = np.linalg.lstsq(x, ms, rcond=None)
    return {
        "a_ms_per_token": float(a),
        "c_ms": float(c),
        "max_relative_error": _max_relative_error(x @ [a, c], ms),
    }


def fit_decode(
    batch: np.ndarray[Any, Any], tokens_per_request: np.ndarray[Any, Any], ms: np.ndarray[Any, Any]
) -> dict[str, float]:
    """``α, β, γ, δ`` of ``t_d(b, l) = α·b·l + β·b + γ·l + δ``, and the largest relative error."""
    x = np.column_stack([batch * tokens_per_request, batch, tokens_per_request, np.ones_like(batch)])
    coefs, *_ = np.linalg.lstsq(x, ms, rcond=None)
    alpha, beta, gamma, delta = (float(v) for v in coefs)
    return {
        "alpha_ms": alpha,
        "beta_ms": beta,
        "gamma_ms": gamma,
        "delta_ms": delta,
        "max_relative_error": _max_relative_error(x @ coefs, ms),
    }


def fit_profile(ttft: TtftProfile, tpot: TpotProfile) -> dict[str, Any]:
    """The coefficients document of a loaded profile."""
    t_tokens = np.asarray(ttft.grid.xs, dtype=np.float64)
    t_ms = np.asarray(ttft.grid.ys, dtype=np.float64)
    g = tpot.grid
    b, per_req = np.meshgrid(
        np.asarray(g.xs, dtype=np.float64), np.asarray(g.ys, dtype=np.float64), indexing="ij"
    )
    z = np.asarray(g.zs, dtype=np.float64)
    return {
        "model": {
            "prefill": "t_p(l) = a*l + c  (ms; l = tokens of one prefill step)",
            "decode": "t_d(b, l) = alpha*b*l + beta*b + gamma*l + delta  (ms; b = batch, l = tokens per request)",
        },
        "prefill": fit_prefill(t_tokens, t_ms),
        "decode": fit_decode(b.ravel(), per_req.ravel(), z.ravel()),
    }


def write_coefficients(out_dir: str | Path, ttft: TtftProfile, tpot: TpotProfile) -> Path:
    """Fit and write ``coefficients.json`` into ``out_dir``; its path."""
    path = Path(out_dir) / "coefficients.json"
    path.write_text(json.dumps(fit_profile(ttft, tpot), indent=1) + "\n", encoding="utf-8")
    return path
