"""Least-squares coefficients of a profile (``coefficients.json``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from predictor.fit import fit_decode, fit_prefill, fit_profile
from predictor.profile import load_tpot_profile, load_ttft_profile
from sim.fleet import BUNDLED_PROFILES, DEFAULT_PROFILE


@settings(max_examples=50, deadline=None)
@given(
    alpha=st.floats(0.0, 0.01),
    beta=st.floats(0.0, 2.0),
    gamma=st.floats(0.0, 0.01),
    delta=st.floats(0.5, 50.0),
)
def test_decode_fit_recovers_the_seed_model(alpha: float, beta: float, gamma: float, delta: float) -> None:
    b, per_req = (
        a.ravel() for a in np.meshgrid([1.0, 2, 4, 8, 16, 32], [128.0, 512, 1024, 2048], indexing="ij")
    )
    ms = alpha * b * per_req + beta * b + gamma * per_req + delta
    fit = fit_decode(b, per_req, ms)
    assert [fit["alpha_ms"], fit["beta_ms"], fit["gamma_ms"], fit["delta_ms"]] == pytest.approx(
        [alpha, beta, gamma, delta], rel=1e-6, abs=1e-6
    )
    assert fit["max_relative_error"] < 1e-6


def test_prefill_fit_and_its_error_on_a_curve() -> None:
    tokens = np.array([128.0, 256, 512, 1024, 2048])
    assert fit_prefill(tokens, 0.1 * tokens + 40)["a_ms_per_token"] == pytest.approx(0.1)
    curved = fit_prefill(tokens, 1e-4 * tokens**2 + 10)
    assert curved["max_relative_error"] > 0.05  # a quadratic is not a line: the fit says so


def test_the_bundled_linear_profile_gives_back_its_generator() -> None:
    d = BUNDLED_PROFILES / DEFAULT_PROFILE
    doc = fit_profile(load_ttft_profile(d / "ttft.json"), load_tpot_profile(d / "tpot.json"))
    assert doc["decode"]["alpha_ms"] == pytest.approx(0.0002, rel=1e-3)
    assert doc["decode"]["delta_ms"] == pytest.approx(15.85, rel=1e-3)
    assert doc["prefill"]["a_ms_per_token"] == pytest.approx(0.11, rel=1e-3)
