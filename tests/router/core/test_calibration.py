"""Online calibration: convergence on synthetic samples, robustness, bounds, fallback, and its use by the metrics."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from router.core.calibration import (
    CalibrationConfig,
    Calibrator,
    Correction,
    StepPredictor,
    StepSample,
    fit_step_model,
    fitted_step_ms,
    step_features,
)
from router.core.columns import FloatArray

# A synthetic profile: prefill 0.05 ms/token + 4 ms; decode 10 ms + 0.5 ms/request + 0.001 ms/context token.
PROFILE = np.array([0.05, 4.0, 0.001, 0.5, 0.0, 10.0])


def profile_step(group: str) -> StepPredictor:
    def predict(prefill: FloatArray, batch: FloatArray, tokens: FloatArray) -> tuple[FloatArray, FloatArray]:
        zero = np.zeros_like(prefill)
        pre = fitted_step_ms(PROFILE * np.array([1, 1, 0, 0, 0, 0]), prefill, zero, zero)
        dec = fitted_step_ms(PROFILE * np.array([0, 0, 1, 1, 1, 1]), zero, batch, tokens)
        return pre, dec

    return predict


def random_steps(rng: random.Random, n: int, *, neutral: bool = True) -> list[tuple[int, int, int]]:
    steps = []
    for _ in range(n):
        batch = rng.randint(0, 64)
        prefill = rng.choice([0, 0, rng.randint(1, 2048)]) if neutral else 0
        if batch == 0 and prefill == 0:
            batch = 1
        steps.append((prefill, batch, batch * rng.randint(16, 2048)))
    return steps


def true_ms(coefs: FloatArray, prefill: int, batch: int, tokens: int) -> float:
    a = np.array([float(prefill)])
    return float(fitted_step_ms(coefs, a, np.array([float(batch)]), np.array([float(tokens)]))[0])


def predicted_step(cal: Calibrator, p: int, b: int, t: int, instance: str = "i0") -> float:
    """What the calibrated predictions say one step ``(p, b, t)`` of ``instance`` takes."""
    correction = cal.correction((instance,))
    assert correction is not None
    correction = dataclasses.replace(correction, interleave_ms=np.zeros(1))
    pre, dec = profile_step("g")(np.array([float(p)]), np.array([float(b)]), np.array([float(t)]))
    one = np.array
    if p > 0:
        return float(
            correction.ttft_ms(
                pre + dec, one([float(p)]), one([float(b)]), one([float(t)]), one([float(p)]), dec
            )[0]
        )
    return float(correction.tpot_ms(dec, one([float(b)]), one([float(t)]))[0])


def feed(
    cal: Calibrator,
    steps: list[tuple[int, int, int]],
    duration: object,
    *,
    instance: str = "i0",
    group: str = "g",
    start_s: float = 0.0,
    per_call: int = 8,
) -> float:
    """Feed ``steps`` (``duration(prefill, batch, tokens) -> ms``) in calls of ``per_call``; the last time."""
    now = start_s
    for k in range(0, len(steps), per_call):
        chunk = steps[k : k + per_call]
        samples = [StepSample(p, b, t, duration(p, b, t)) for p, b, t in chunk]  # type: ignore[operator]
        now += 0.1
        cal.observe(instance, group, samples, now)
    return now


@settings(max_examples=40, deadline=None)
@given(
    ttft_speed=st.floats(min_value=0.3, max_value=3.0),
    tpot_speed=st.floats(min_value=0.3, max_value=3.0),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_scale_converges_to_the_true_slowdown(ttft_speed: float, tpot_speed: float, seed: int) -> None:
    rng = random.Random(seed)
    cal = Calibrator(CalibrationConfig(mode="scale"), profile_step)
    predict = profile_step("g")

    def duration(p: int, b: int, t: int) -> float:
        pre, dec = predict(np.array([float(p)]), np.array([float(b)]), np.array([float(t)]))
        if p > 0:
            return float(pre[0] + dec[0]) * ttft_speed
        return float(dec[0]) * tpot_speed

    feed(cal, random_steps(rng, 400), duration)
    ttft, tpot = cal.factors("i0")
    assert ttft == pytest.approx(ttft_speed, rel=0.02)
    assert tpot == pytest.approx(tpot_speed, rel=0.02)
    correction = cal.correction(("i0", "unseen"), ("g", "other"))
    assert correction is not None
    assert correction.tpot_factor.tolist() == pytest.approx([tpot_speed, 1.0], rel=0.02)


@settings(max_examples=30, deadline=None)
@given(
    # Hardware of another shape: every term of the profile's model scaled by its own factor (within
    # the calibration's bounds, so the predictions are not clipped), some terms switched on from 0.
    scales=st.tuples(*(st.floats(0.5, 2.0) for _ in range(6))),
    gamma=st.floats(0.0, 0.01),
    seed=st.integers(min_value=0, max_value=2**16),
)
# Once every prefill step of the window was off by a little more than the outlier floor (the
# decode steps fitting exactly): the pass dropped them all and the refit's prefill constant
# became 70 ms of rounding where the truth adds 4.
@example(scales=(1.0, 2.0, 0.75, 1.0, 1.0, 0.5), gamma=0.0, seed=155)
def test_refit_recovers_known_coefficients(scales: tuple[float, ...], gamma: float, seed: int) -> None:
    truth = PROFILE * np.array(scales) + np.array([0, 0, 0, 0, gamma, 0])
    rng = random.Random(seed)
    cal = Calibrator(CalibrationConfig(mode="refit", prior_weight=0.001), profile_step)
    feed(cal, random_steps(rng, 600), lambda p, b, t: true_ms(truth, p, b, t))
    assert cal.coefficients("i0") is not None
    # Judged by predictions over the sampled range (collinear columns may trade coefficients).
    for p, b, t in random_steps(random.Random(seed + 1), 50):
        expected = true_ms(truth, p, b, t)
        assert predicted_step(cal, p, b, t) == pytest.approx(expected, rel=0.05, abs=0.5)


def test_least_squares_ignores_outliers() -> None:
    rng = np.random.default_rng(3)
    truth = np.array([0.05, 5.0, 0.002, 0.3, 0.004, 12.0])
    prefill = rng.integers(0, 2048, 300).astype(float)
    batch = rng.integers(1, 64, 300).astype(float)
    tokens = batch * rng.integers(16, 2048, 300)
    x = step_features(prefill, batch, tokens)
    observed = x @ truth
    observed[::10] *= 8.0  # one step in ten stalled
    fitted = fit_step_model(x, observed)
    assert fitted is not None
    assert np.allclose(x @ fitted, x @ truth, rtol=1e-6, atol=1e-6)


def test_outlier_pass_never_drops_a_whole_regime() -> None:
    """Decode steps that fit exactly and prefill steps each a little off: the prefill steps are
    not outliers to drop (that would leave their terms unfitted), while a stalled step still is."""
    rng = np.random.default_rng(11)
    truth = np.array([0.05, 5.0, 0.002, 0.3, 0.004, 12.0])
    prefill = np.where(rng.random(200) < 0.25, rng.integers(1, 2048, 200), 0).astype(float)
    batch = rng.integers(1, 64, 200).astype(float)
    tokens = batch * rng.integers(16, 2048, 200)
    x = step_features(prefill, batch, tokens)
    observed = x @ truth
    observed[prefill > 0] += 0.3 * np.sign(rng.normal(size=int(np.count_nonzero(prefill))))
    fitted = fit_step_model(x, observed)
    assert fitted is not None
    with_prefill = prefill > 0
    assert np.allclose(x[with_prefill] @ fitted, x[with_prefill] @ truth, atol=0.5)
    observed[np.flatnonzero(~with_prefill)[0]] *= 8.0  # a stalled decode step is still dropped
    stalled = fit_step_model(x, observed)
    assert stalled is not None
    assert np.allclose(x[~with_prefill][1:] @ stalled, x[~with_prefill][1:] @ truth, atol=0.1)


def test_scale_ignores_outliers() -> None:
    rng = random.Random(5)
    cal = Calibrator(CalibrationConfig(mode="scale"), profile_step)
    predict = profile_step("g")
    stalls = iter(range(10**6))

    def duration(p: int, b: int, t: int) -> float:
        pre, dec = predict(np.array([float(p)]), np.array([float(b)]), np.array([float(t)]))
        ms = float(pre[0] + dec[0]) * 1.4
        return ms * 20.0 if next(stalls) % 5 == 0 else ms  # 20 % of the steps stall

    feed(cal, random_steps(rng, 400), duration)
    ttft, tpot = cal.factors("i0")
    assert ttft == pytest.approx(1.4, rel=0.03)
    assert tpot == pytest.approx(1.4, rel=0.03)


def test_factors_stay_within_bounds_and_move_at_a_bounded_rate() -> None:
    config = CalibrationConfig(
        mode="scale", max_factor=4.0, max_change_per_update=0.25, update_every_samples=8
    )
    cal = Calibrator(config, profile_step)
    predict = profile_step("g")

    def duration(p: int, b: int, t: int) -> float:
        pre, dec = predict(np.array([float(p)]), np.array([float(b)]), np.array([float(t)]))
        return float(pre[0] + dec[0]) * 50.0  # far slower than any bound allows

    rng = random.Random(1)
    steps = random_steps(rng, 400)
    feed(cal, steps[:8], duration, per_call=8)
    first = cal.factors("i0")
    assert all(f <= 1.25 + 1e-9 for f in first)  # one update: at most x1.25
    feed(cal, steps[8:], duration, start_s=1.0)
    assert cal.factors("i0") == (4.0, 4.0)
    assert "i0" in cal.drifted()
    events = cal.take_drift_events()
    assert [(e[0], e[1]) for e in events] == [("i0", True)]
    # Refit predictions are clipped to the same bounds relative to the profile.
    correction = Correction(
        ttft_factor=np.ones(1),
        tpot_factor=np.ones(1),
        interleave_ms=np.zeros(1),
        coefs=np.array([[0.0, 0.0, 0.0, 0.0, 0.0, 1e6]]),
        has_fit=np.ones(1, dtype=bool),
        min_factor=0.5,
        max_factor=2.0,
    )
    out = correction.tpot_ms(np.array([10.0]), np.array([4.0]), np.array([400.0]))
    assert out.tolist() == [20.0]
    low = dataclasses.replace(correction, coefs=-np.array([[0.0, 0.0, 0.0, 0.0, 0.0, 1e6]]))
    assert low.tpot_ms(np.array([10.0]), np.array([4.0]), np.array([400.0])).tolist() == [5.0]


def test_falls_back_to_the_profile_when_samples_stop() -> None:
    config = CalibrationConfig(mode="scale", stale_after_s=30.0)
    cal = Calibrator(config, profile_step)
    predict = profile_step("g")

    def duration(p: int, b: int, t: int) -> float:
        pre, dec = predict(np.array([float(p)]), np.array([float(b)]), np.array([float(t)]))
        return float(pre[0] + dec[0]) * 2.0

    last = feed(cal, random_steps(random.Random(2), 200), duration)
    assert cal.factors("i0") == pytest.approx((2.0, 2.0), rel=0.02)
    ids = ("i0",)
    assert cal.correction(ids) is not None
    cal.expire(last + 10.0)  # still fresh
    assert cal.factors("i0") == pytest.approx((2.0, 2.0), rel=0.02)
    cal.expire(last + 31.0)  # samples stopped: back to the profile
    assert cal.factors("i0") == (1.0, 1.0)
    assert cal.correction(ids) is None
    assert cal.drifted() == {}


def test_few_samples_use_the_group_then_the_profile() -> None:
    cal = Calibrator(CalibrationConfig(mode="scale", min_samples=8), profile_step)
    predict = profile_step("g")

    def duration(p: int, b: int, t: int) -> float:
        pre, dec = predict(np.array([float(p)]), np.array([float(b)]), np.array([float(t)]))
        return float(pre[0] + dec[0]) * 1.5

    feed(cal, random_steps(random.Random(4), 200), duration, instance="a")
    feed(cal, random_steps(random.Random(5), 3), duration, instance="b")
    assert cal.factors("b") == pytest.approx((1.5, 1.5), rel=0.02)  # too few of its own: the group's
    assert cal.factors("never-seen") == (1.0, 1.0)
    correction = cal.correction(("a", "new"), ("g", "g"))
    assert correction is not None  # a new instance of a known group gets the group's correction
    assert correction.ttft_factor.tolist() == pytest.approx([1.5, 1.5], rel=0.02)


def test_off_learns_nothing_and_bad_config_is_refused() -> None:
    cal = Calibrator(CalibrationConfig(mode="off"), profile_step)
    cal.observe("i0", "g", [StepSample(0, 4, 400, 99.0)] * 64, 1.0)
    assert cal.correction(("i0",)) is None
    assert cal.factors("i0") == (1.0, 1.0)
    with pytest.raises(ValueError, match="mode"):
        CalibrationConfig(mode="magic")
    with pytest.raises(ValueError, match="max_factor"):
        CalibrationConfig(min_factor=0.5, max_factor=0.9)
    with pytest.raises(ValueError, match="window_samples"):
        CalibrationConfig(window_samples=0)


@pytest.mark.parametrize("speed", [1.0, 4.0])
def test_interleaved_prefill_is_part_of_tpot(speed: float) -> None:
    cal = Calibrator(CalibrationConfig(mode="scale"), profile_step)
    predict = profile_step("g")

    def duration(p: int, b: int, t: int) -> float:
        pre, dec = predict(np.array([float(p)]), np.array([float(b)]), np.array([float(t)]))
        return float(pre[0] + dec[0]) / speed

    # Every other decode step carries a 512-token prefill chunk.
    steps = [(512 if k % 2 else 0, 8, 8 * 600) for k in range(64)]
    feed(cal, steps, duration)
    correction = cal.correction(("i0",))
    assert correction is not None
    # The interleaved time is measured: the chunks as long as they really took.
    chunk_ms = float(predict(np.array([512.0]), np.zeros(1), np.zeros(1))[0][0]) / speed
    # Within 1 %: the newest step (a chunk) weighs a little more than the one before it.
    assert correction.interleave_ms[0] == pytest.approx(chunk_ms / 2, rel=0.01)
    out = correction.tpot_ms(np.array([20.0]), np.array([9.0]), np.array([5400.0]))
    assert out[0] == pytest.approx(20.0 / speed + chunk_ms / 2, rel=0.01)


def test_refit_follows_the_scaled_profile_where_the_window_has_no_data() -> None:
    # Only pure decode steps at 2x the profile: the prefill part cannot be fitted from them.
    cal = Calibrator(CalibrationConfig(mode="refit"), profile_step)
    predict = profile_step("g")

    def duration(p: int, b: int, t: int) -> float:
        _, dec = predict(np.array([float(p)]), np.array([float(b)]), np.array([float(t)]))
        return float(dec[0]) * 2.0

    feed(cal, random_steps(random.Random(9), 300, neutral=False), duration)
    assert cal.coefficients("i0") is not None
    # No prefill seen: the TTFT factor follows the TPOT one, and the fit follows the scaled profile.
    assert predicted_step(cal, 1024, 0, 0) == pytest.approx(2.0 * true_ms(PROFILE, 1024, 0, 0), rel=0.05)
    assert predicted_step(cal, 0, 16, 16000) == pytest.approx(2.0 * true_ms(PROFILE, 0, 16, 16000), rel=0.02)


def test_updates_are_spaced_by_update_every_s() -> None:
    """A track's correction is recomputed at most once per ``update_every_s``; 0 recomputes on every call."""

    def slow(p: int, b: int, t: int) -> float:
        pre, dec = profile_step("g")(np.array([float(p)]), np.array([float(b)]), np.array([float(t)]))
        return 2.0 * float(pre[0] + dec[0])

    steps = [(0, 8, 8 * 600)] * 8
    samples = [StepSample(p, b, t, slow(p, b, t)) for p, b, t in steps]
    spaced = Calibrator(CalibrationConfig(mode="scale", update_every_s=1.0), profile_step)
    every_call = Calibrator(CalibrationConfig(mode="scale", update_every_s=0.0), profile_step)
    history: list[tuple[float, float]] = []
    for k in range(12):
        now = 0.1 * k  # a view every 0.1 s, 8 steps each
        spaced.observe("i0", "g", samples, now)
        every_call.observe("i0", "g", samples, now)
        history.append((spaced.factors("i0")[1], every_call.factors("i0")[1]))
    spaced_tpot = [s for s, _ in history]
    # Updates at 0.0 s and 1.0 s only (the factor moves then, by at most x1.25 each time) ...
    assert len(set(spaced_tpot)) == 2
    assert spaced_tpot[0] == spaced_tpot[9] == pytest.approx(1.25)
    assert spaced_tpot[10] == spaced_tpot[11] == pytest.approx(1.25**2)
    # ... while without the limit every call moves it, up to the observed 2x.
    assert history[-1][1] == pytest.approx(2.0)
    # A clock that went back does not hold the updates off.
    spaced.observe("i0", "g", samples, 0.0)
    assert spaced.factors("i0")[1] == pytest.approx(1.25**3)


@pytest.mark.parametrize("value", [-0.1, float("nan"), float("inf"), 3601.0])
def test_update_every_s_is_bounded(value: float) -> None:
    with pytest.raises(ValueError, match="update_every_s"):
        CalibrationConfig(update_every_s=value)


def test_the_schedulers_calibration_spaces_its_updates_as_configured() -> None:
    """``--calibration-update-every-s`` reaches the calibrator the scheduler builds (router and simulator)."""
    from tests.router.core.helpers import make_scheduler

    for every in (0.0, 0.25):
        scheduler = make_scheduler("slo", calibration="refit", calibration_update_every_s=every)
        assert scheduler.predictors is not None and scheduler.predictors.calibration is not None
        assert scheduler.predictors.calibration.config.update_every_s == every
