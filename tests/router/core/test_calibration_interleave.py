"""The calibrated interleave: recency-weighted prefill time per decode step (steady, step change, expiry)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.calibration import CalibrationConfig, Calibrator, StepSample
from tests.router.core.test_calibration import profile_step

PREDICT = profile_step("g")
BATCH, TOKENS = 8, 8 * 600


def chunk_ms(prefill: int) -> float:
    """The profile's prefill time of a ``prefill``-token chunk (0 for none)."""
    return float(PREDICT(np.array([float(prefill)]), np.zeros(1), np.zeros(1))[0][0]) if prefill else 0.0


def sample(prefill: int) -> StepSample:
    """A decode step of the fixed batch carrying ``prefill`` tokens, as long as the profile says."""
    pre, dec = PREDICT(np.array([float(prefill)]), np.array([float(BATCH)]), np.array([float(TOKENS)]))
    return StepSample(prefill, BATCH, TOKENS, float(pre[0] + dec[0]))


def interleave(cal: Calibrator) -> float:
    correction = cal.correction(("i0",))
    assert correction is not None
    return float(correction.interleave_ms[0])


def calibrator(window: int, half_life: int, stale_after_s: float = 60.0) -> Calibrator:
    # ``scale`` on steps exactly as the profile says: the TPOT factor stays 1, so the prefill time
    # beyond each step's decode part is exactly the chunk's profile time. Updated on every report.
    config = CalibrationConfig(
        mode="scale",
        window_samples=window,
        interleave_half_life_samples=half_life,
        update_every_samples=1,
        stale_after_s=stale_after_s,
    )
    return Calibrator(config, profile_step)


@settings(max_examples=60, deadline=None)
@given(
    period=st.integers(1, 8),
    phase=st.integers(0, 7),
    prefill=st.integers(1, 4096),
    steps=st.integers(256, 600),
)
def test_a_steady_regime_gives_the_plain_mean(period: int, phase: int, prefill: int, steps: int) -> None:
    # A chunk every ``period`` decode steps, whatever the phase at the newest step: the weighted
    # estimate stays within 5 % of the plain mean (chunk / period) on the default window/half-life.
    cal = calibrator(256, 128)
    cal.observe("i0", "g", [sample(prefill if (k + phase) % period == 0 else 0) for k in range(steps)], 1.0)
    assert interleave(cal) == pytest.approx(chunk_ms(prefill) / period, rel=0.05)


@settings(max_examples=80, deadline=None)
@given(
    before=st.integers(0, 4096),
    after=st.integers(0, 4096),
    old=st.integers(8, 300),
    new=st.integers(1, 64),
    half_life=st.integers(4, 64),
)
def test_after_a_step_change_the_estimate_reaches_the_new_regime(
    before: int, after: int, old: int, new: int, half_life: int
) -> None:
    # ``old`` steps of one chunk size, then ``new`` of another: the estimate lies between the two
    # regimes, and its distance to the new one is at most the jump x 2^(-new / half-life) (within
    # one half-life it has covered at least half the jump, within two three quarters ...).
    cal = calibrator(64, half_life)
    cal.observe("i0", "g", [sample(before)] * old, 1.0)
    cal.observe("i0", "g", [sample(after)] * new, 2.0)
    a, b = chunk_ms(before), chunk_ms(after)
    got = interleave(cal)
    assert min(a, b) - 1e-9 <= got <= max(a, b) + 1e-9
    assert abs(got - b) <= abs(a - b) * 2.0 ** (-new / half_life) + 1e-9


def test_plain_mean_would_lag_a_warming_cache() -> None:
    # A cold start: 128 steps of 2,048-token chunks, then 64 steps of 256-token ones (the prefixes
    # now cached). The weighted estimate is nearer the new regime than the window's plain mean.
    cal = calibrator(256, 128)
    cal.observe("i0", "g", [sample(2048)] * 128, 1.0)
    cal.observe("i0", "g", [sample(256)] * 64, 2.0)
    plain = (128 * chunk_ms(2048) + 64 * chunk_ms(256)) / 192
    assert chunk_ms(256) < interleave(cal) < plain - 0.1 * (plain - chunk_ms(256))


@settings(max_examples=40, deadline=None)
@given(
    stale=st.integers(1, 100),
    fresh=st.lists(st.integers(0, 4096), min_size=8, max_size=40),
)
def test_expiry_keeps_the_steps_in_order(stale: int, fresh: list[int]) -> None:
    # A wrapped ring (stale steps, then fresh ones) after its stale steps expire weighs the fresh
    # steps by age exactly as a calibrator that only ever saw them.
    expiring = calibrator(48, 8, stale_after_s=3.0)
    expiring.observe("i0", "g", [sample(2048)] * (48 + stale), 0.0)
    expiring.observe("i0", "g", [sample(p) for p in fresh], 2.0)
    expiring.expire(4.0)
    only_fresh = calibrator(48, 8, stale_after_s=3.0)
    only_fresh.observe("i0", "g", [sample(p) for p in fresh], 2.0)
    only_fresh.expire(4.0)
    assert interleave(expiring) == pytest.approx(interleave(only_fresh), rel=1e-9, abs=1e-9)


def test_bad_half_life_is_refused() -> None:
    with pytest.raises(ValueError, match="interleave_half_life_samples"):
        CalibrationConfig(interleave_half_life_samples=0)
