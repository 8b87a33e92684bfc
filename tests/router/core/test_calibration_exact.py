"""The calibration's fast paths give exactly (bit for bit) what the plain computations give.

The simulator's results must not move when the calibration gets faster, so these
compare with ``==`` on the float bits, never with a tolerance.
"""

from __future__ import annotations

import copy
import random

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from router.core.calibration import (
    NUM_COEFS,
    CalibrationConfig,
    Calibrator,
    Correction,
    StepPredictor,
    StepSample,
    _fit_normal,
    _fit_with_prior,
    _gram_of,
    _median,
    _pseudo_steps,
    _solve_normal,
    _step_rows,
    _Track,
    fit_step_model,
)
from router.core.columns import FloatArray


def same_bits(a: FloatArray | None, b: FloatArray | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return (
        a.shape == b.shape
        and np.array_equal(a, b, equal_nan=True)
        and np.array_equal(np.signbit(a), np.signbit(b))
    )


def same_correction(a: Correction | None, b: Correction | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return all(
        same_bits(getattr(a, name), getattr(b, name))
        for name in ("ttft_factor", "tpot_factor", "interleave_ms", "coefs")
    ) and np.array_equal(a.has_fit, b.has_fit)


def same_track(a: _Track, b: _Track) -> bool:
    return (
        (a.count, a.ttft_factor, a.tpot_factor, a.interleave_ms, a.ttft_samples, a.tpot_samples)
        == (b.count, b.ttft_factor, b.tpot_factor, b.interleave_ms, b.ttft_samples, b.tpot_samples)
        and same_bits(a.coefs, b.coefs)
        and same_bits(a.rows(), b.rows())
    )


def reference_fit(features: FloatArray, observed: FloatArray, weights: FloatArray) -> FloatArray | None:
    """The robust fit written out plainly: two weighted solves, the second on the rows kept."""
    keep = np.isfinite(observed) & (weights > 0)
    coefs = None
    for _ in range(2):
        if np.count_nonzero(keep) < NUM_COEFS:
            return coefs
        sw = np.sqrt(weights[keep])
        solution, *_ = np.linalg.lstsq(features[keep] * sw[:, None], observed[keep] * sw, rcond=None)
        coefs = np.asarray(solution, dtype=np.float64)
        residual = observed - features @ coefs
        mad = float(np.median(np.abs(residual[keep] - np.median(residual[keep]))))
        rms = float(np.sqrt(np.mean(np.square(observed[keep]))))
        kept = keep & (np.abs(residual) <= max(4.0 * 1.4826 * mad, 1e-3 * rms + 1e-2))
        # A column some row fitted and no kept row does: nothing is dropped (a regime is not an outlier).
        if (np.any(features[keep] != 0, axis=0) & ~np.any(features[kept] != 0, axis=0)).any():
            return coefs
        keep = kept
    return coefs


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.sampled_from([0.0, -0.0, 1.0, 2.5, float("nan")]),
            st.floats(min_value=-1e12, max_value=1e12),
        ),
        min_size=1,
        max_size=300,
    )
)
def test_median_is_numpys_bit_for_bit(values: list[float]) -> None:
    array = np.array(values)
    before = array.copy()
    assert same_bits(np.array(_median(array)), np.array(float(np.median(array))))
    assert same_bits(array, before)  # the caller's array is left as it was


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(min_value=0, max_value=80),
    prior=st.floats(min_value=1e-3, max_value=50.0),
    outliers=st.integers(min_value=0, max_value=5),
    noise=st.sampled_from([0.0, 1e-6, 0.05]),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_prior_weighted_fit_is_the_plain_fit(
    n: int, prior: float, outliers: int, noise: float, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    m = 12
    features = np.column_stack(
        [rng.integers(0, 2048, n + m), rng.integers(0, 2, n + m), rng.random((n + m, 4)) * 100]
    ).astype(np.float64)
    observed = features @ rng.normal(size=NUM_COEFS) + noise * rng.normal(size=n + m)
    observed[n:] = 0.0
    if n:
        observed[rng.integers(0, n, outliers)] += 500.0
    weights = np.ones(n + m)
    weights[n:] = prior
    expected = reference_fit(features, observed, weights)
    assert same_bits(fit_step_model(features, observed, weights), expected)
    assert same_bits(_fit_with_prior(features, observed, n, prior), expected)


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(min_value=NUM_COEFS, max_value=256),
    prefill_share=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
    outliers=st.sampled_from([0.0, 0.05, 0.2]),
    noise=st.sampled_from([0.0, 0.02, 0.2]),
    factors=st.tuples(st.floats(min_value=0.3, max_value=3.0), st.floats(min_value=0.3, max_value=3.0)),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_normal_equation_refit_is_the_least_squares_refit_within_rounding(
    n: int, prefill_share: float, outliers: float, noise: float, factors: tuple[float, float], seed: int
) -> None:
    """The refit solved from the window's normal equations (what the calibration runs) predicts
    what the least-squares fit over every row (``_fit_with_prior``) predicts, to 1e-6 of the
    step times, on windows of every shape: pure decode, pure prefill, mixed, with stalls."""
    rng = random.Random(seed)
    steps = []
    for _ in range(n):
        prefill = rng.randint(16, 8192) if rng.random() < prefill_share else 0
        batch = rng.randint(0 if prefill else 1, 64)
        tokens = batch * rng.randint(64, 4096)
        ms = (12.0 + 0.04 * prefill + 0.6 * batch + 2e-5 * tokens) * rng.uniform(1 - noise, 1 + noise)
        if rng.random() < outliers:
            ms *= 8  # a stalled step
        steps.append((prefill, batch, tokens, ms))
    array = np.array(steps, dtype=np.float64)
    pre, dec = profile_step("a")(array[:, 0], array[:, 1], array[:, 2])
    rows, _ = _step_rows(array, pre, dec, 0.0)
    maxima = rows[:, :5].max(axis=0)
    grid, grid_gram = _pseudo_steps(max(maxima[0], 2048.0), max(maxima[3], 32.0), max(maxima[4], 2048.0))
    prior = 0.1 * n / len(grid)
    ttft, tpot = factors
    window_gram = _gram_of(rows)
    fast = _fit_normal(window_gram, rows, grid, grid_gram, ttft, tpot, prior)
    features = np.concatenate([rows[:, :NUM_COEFS], grid])
    observed = np.concatenate([rows[:, 6] - pre * ttft - dec * tpot, np.zeros(len(grid))])
    plain = _fit_with_prior(features, observed, n, prior)
    assert plain is not None
    determined = _kept_rows_determine_the_fit(
        window_gram, features, observed, n, prior, ttft, tpot, grid_gram
    )
    if fast is None:
        # Singular normal equations: the calibration then solves from scratch (the plain fit);
        # that happens only where the rows kept leave the fit undetermined.
        assert not determined
        return
    scale = float(np.abs(observed).max()) + 1.0
    # Both fits drop the rows whose first-pass residual lies beyond the same limit, then solve
    # again over the rest. Two kinds of example have no single answer to agree on, and are told
    # apart here: a row within the first passes' rounding of the limit (dropped by one, kept by
    # the other), and a second system that has lost rank (say every prefill step was dropped and
    # the pseudo steps left cannot separate the prefill terms: any of a line of fits is a least-
    # squares fit, and the two solvers pick different ones).
    assume(determined)
    np.testing.assert_allclose(features @ fast, features @ plain, rtol=0, atol=1e-6 * scale)


def _kept_rows_determine_the_fit(
    window_gram: FloatArray,
    features: FloatArray,
    observed: FloatArray,
    n: int,
    prior: float,
    ttft: float,
    tpot: float,
    grid_gram: FloatArray,
) -> bool:
    """Whether both first passes drop the same rows and the rows kept leave the fit full rank.

    Asserts that any row the two passes dispute is a rounding case: its residual is within the
    passes' difference of the limit.
    """
    gram = window_gram[:, :NUM_COEFS] + prior * grid_gram
    xty = (
        window_gram[:, NUM_COEFS]
        - ttft * window_gram[:, NUM_COEFS + 1]
        - tpot * window_gram[:, NUM_COEFS + 2]
    )
    normal = _solve_normal(gram, xty)
    weighted = features.copy()
    weighted[n:] *= np.sqrt(prior)
    least, *_ = np.linalg.lstsq(weighted, observed, rcond=None)
    assert normal is not None
    outcomes = []
    for coefs in (normal, least):
        residual = observed - features @ coefs
        mad = float(np.median(np.abs(residual - np.median(residual))))
        rms = float(np.sqrt(np.sum(np.square(observed)) / len(observed)))
        limit = max(4.0 * 1.4826 * mad, 1e-3 * rms + 1e-2)
        outcomes.append((np.abs(residual), limit))
    (r_a, lim_a), (r_b, lim_b) = outcomes
    disputed = (r_a > lim_a) != (r_b > lim_b)
    if disputed.any():
        slack = np.abs(r_a - r_b) + abs(lim_a - lim_b) + 1e-9 * (float(np.abs(observed).max()) + 1.0)
        assert (np.abs(r_a - lim_a)[disputed] <= slack[disputed]).all(), "a disputed row far from the limit"
        return False
    keep = r_b <= lim_b
    if keep.all() or not np.any(features[keep] != 0, axis=0).all():
        return True  # nothing dropped (a dropped column keeps the first fit: no rows are dropped)
    return bool(np.linalg.matrix_rank(weighted[keep]) == NUM_COEFS)


def profile_step(group: str) -> StepPredictor:
    slope = 0.05 if group == "a" else 0.08

    def predict(prefill: FloatArray, batch: FloatArray, tokens: FloatArray) -> tuple[FloatArray, FloatArray]:
        pre = np.where(prefill > 0, slope * prefill + 4.0, 0.0)
        dec = np.where(batch > 0, 10.0 + 0.5 * batch + 0.001 * tokens, 0.0)
        return pre, dec

    return predict


def random_samples(rng: random.Random, speed: float) -> list[StepSample]:
    samples = []
    for _ in range(rng.choice([1, 2, 3, 5, 9, 30])):
        batch = rng.randint(0, 48)
        prefill = rng.choice([0, 0, rng.randint(1, 4096)])
        tokens = batch * rng.randint(16, 4096)
        ms = (12.0 + 0.06 * prefill + 0.6 * batch + 0.0012 * tokens) * speed * (1 + 0.05 * rng.gauss(0, 1))
        if rng.random() < 0.03:
            ms *= 8  # a stalled step: an outlier the fit drops
        if rng.random() < 0.01:
            ms = -1.0  # not a valid sample: left out
        samples.append(StepSample(prefill, batch, tokens, ms))
    return samples


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(min_value=0, max_value=2**16), mode=st.sampled_from(["scale", "refit"]))
def test_batched_observations_and_incremental_corrections_match_the_plain_ones(seed: int, mode: str) -> None:
    """observe_steps for many instances updates each instance's track as one observe per instance
    does, and each group's track once over all its instances' samples of the call (as one observe
    of them all); a correction rebuilt for the changed rows only equals one built from scratch."""
    rng = random.Random(seed)
    config = CalibrationConfig(mode=mode, window_samples=64, refit_min_samples=24, stale_after_s=3.0)
    batched = Calibrator(config, profile_step)
    plain = Calibrator(config, profile_step)
    # Fed one observe per group and call, with the samples of all its instances in the call.
    plain_groups = Calibrator(config, profile_step)
    ids = tuple(f"i{k}" for k in range(6))
    groups = tuple("a" if k % 3 else "b" for k in range(6))
    speeds = [rng.uniform(0.5, 2.0) for _ in ids]
    now = 0.0
    version = -1
    for _ in range(120):
        now += rng.choice([0.05, 0.3, 2.0])
        fed = sorted(rng.sample(range(len(ids)), rng.randint(0, len(ids))))
        batches = [(ids[k], groups[k], random_samples(rng, speeds[k])) for k in fed]
        for instance_id, group, samples in batches:
            plain.observe(instance_id, group, samples, now)
        for group in sorted(set(groups)):
            together = [s for _, g, samples in batches if g == group for s in samples]
            plain_groups.observe(f"all-{group}", group, together, now)
        batched.observe_steps(
            [
                (
                    instance_id,
                    group,
                    np.array(
                        [
                            (s.num_prefill_tokens, s.num_decode_requests, s.num_decode_tokens, s.duration_ms)
                            for s in samples
                        ],
                        dtype=np.float64,
                    ).reshape(-1, 4),
                )
                for instance_id, group, samples in batches
            ],
            now,
        )
        if rng.random() < 0.3:
            plain.expire(now)
            plain_groups.expire(now)
            batched.expire(now)
        if rng.random() < 0.02:
            plain.forget(ids[0])
            batched.forget(ids[0])
        correction = batched.correction(ids, groups)
        for key, track in batched._instances.items():
            assert same_track(track, plain._instances[key])
        assert batched._groups.keys() == plain_groups._groups.keys()
        for key, track in batched._groups.items():
            assert same_track(track, plain_groups._groups[key])
        if batched.version != version:
            # A new correction, rewritten for the changed rows only: the same as one built from
            # scratch (a copy asked with new ids and groups objects builds every row).
            assert same_correction(correction, copy.deepcopy(batched).correction(list(ids), list(groups)))
            version = batched.version
        assert batched.take_drift_events() == plain.take_drift_events()
