"""The online output-length predictor: bounded, deterministic, learned only from what it is told."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.lengths import LengthConfig, LengthPredictor, censored_moments

observations = st.lists(
    st.tuples(
        st.sampled_from(["chat", "code", "batch", "x"]),
        st.integers(min_value=0, max_value=20_000),
        st.integers(min_value=0, max_value=5_000),
    ),
    max_size=300,
)


def _fed(obs: list[tuple[str, int, int]], config: LengthConfig | None = None) -> LengthPredictor:
    lp = LengthPredictor(config)
    for cls, prompt, out in obs:
        lp.observe(cls, prompt, out)
    return lp


@settings(max_examples=60, deadline=None)
@given(observations, st.sampled_from(["chat", "code", "new"]), st.integers(0, 20_000), st.integers(0, 4096))
def test_estimates_are_deterministic_bounded_and_capped(
    obs: list[tuple[str, int, int]], cls: str, prompt: int, cap: int
) -> None:
    a, b = _fed(obs), _fed(obs)
    ea, eb = a.estimate(cls, prompt, cap), b.estimate(cls, prompt, cap)
    assert ea == eb
    assert ea.mean >= 1.0 and ea.quantile >= 1.0 and ea.tokens >= 1
    if cap > 0:
        assert ea.mean <= max(cap, 1) and ea.quantile <= max(cap, 1)
    seen = [o for _, _, o in obs if o >= 1]
    if ea.samples > 0:
        # A learned estimate lies within what was seen (before the cap).
        assert min(seen) - 1e-9 <= ea.mean or ea.mean == cap
        assert ea.mean <= max(seen) + 1e-9
    for generated in (0, 1, 50, 10_000):
        rem = a.remaining(cls, prompt, generated, cap)
        assert rem >= 1.0
        assert rem == b.remaining(cls, prompt, generated, cap)


@settings(max_examples=40, deadline=None)
@given(observations)
def test_memory_is_bounded(obs: list[tuple[str, int, int]]) -> None:
    config = LengthConfig(window=16, min_samples=4, max_keys=30, num_buckets=4)
    lp = _fed(obs * 3, config)
    assert len(lp._windows) <= config.max_keys
    assert all(len(w.samples) <= config.window for w in lp._windows.values())


def test_learns_per_class_and_per_prompt_bucket() -> None:
    lp = LengthPredictor(LengthConfig(min_samples=4))
    for k in range(50):
        lp.observe("chat", 100, 200 + k % 5)  # short prompts, ~200 tokens
        lp.observe("chat", 3000, 40 + k % 3)  # long prompts (summaries), ~40 tokens
        lp.observe("code", 500, 900)
    short, long_ = lp.estimate("chat", 110, 1024), lp.estimate("chat", 2900, 1024)
    assert short.source == long_.source == "class+bucket"
    assert 200 <= short.mean <= 204 and 40 <= long_.mean <= 42
    assert lp.estimate("code", 500, 1024).mean == 900
    # An unseen bucket falls back to the class, an unseen class to everyone.
    assert lp.estimate("chat", 20, 1024).source == "class"
    assert lp.estimate("other", 100, 0).source == "all"


def test_prior_is_the_hint_then_max_tokens_then_the_default() -> None:
    lp = LengthPredictor(LengthConfig(default_tokens=77))
    assert lp.estimate("c", 10, 512, hint=40).mean == 40
    assert lp.estimate("c", 10, 512).mean == 512
    assert lp.estimate("c", 10).mean == 77
    assert lp.estimate("c", 10).source == "prior"


def test_quantile_and_conditional_remaining() -> None:
    lp = LengthPredictor(LengthConfig(min_samples=1, quantile=0.9))
    for out in range(1, 101):  # 1..100
        lp.observe("c", 10, out)
    est = lp.estimate("c", 10)
    assert est.mean == pytest.approx(50.5)
    assert est.quantile == 90
    # Having produced 80, the mean of the longer answers (81..100) is 90.5: 10.5 to go.
    assert lp.remaining("c", 10, 80) == pytest.approx(statistics.mean(range(81, 101)) - 80)
    # Outlived every answer seen: about as long again as the longest.
    assert lp.remaining("c", 10, 150) == pytest.approx(150.0)
    assert lp.remaining("c", 10, 150, max_tokens=160) == pytest.approx(10.0)


def test_window_forgets_old_answers() -> None:
    lp = LengthPredictor(LengthConfig(window=10, min_samples=5))
    for _ in range(10):
        lp.observe("c", 10, 1000)
    for _ in range(10):
        lp.observe("c", 10, 10)
    assert lp.estimate("c", 10).mean == 10


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="min_samples"):
        LengthConfig(window=4, min_samples=8)
    with pytest.raises(ValueError, match="quantile"):
        LengthConfig(quantile=1.0)


@settings(max_examples=60, deadline=None)
@given(
    observations,
    st.lists(
        st.tuples(
            st.sampled_from(["chat", "code", "new"]),
            st.integers(0, 20_000),
            st.integers(0, 5_000),
            st.integers(0, 4096),
        ),
        max_size=30,
    ),
)
def test_remaining_many_is_remaining_of_each(
    obs: list[tuple[str, int, int]], legs: list[tuple[str, int, int, int]]
) -> None:
    lp = _fed(obs)
    many = lp.remaining_many(
        [c for c, _, _, _ in legs],
        [lp.bucket(p) for _, p, _, _ in legs],
        [g for _, _, g, _ in legs],
        [m for _, _, _, m in legs],
    )
    assert many == [lp.remaining(c, p, g, m) for c, p, g, m in legs]


def test_censored_moments_without_censoring_are_the_samples_moments() -> None:
    mean, std = censored_moments([10, 20, 30, 40], [], 100.0)
    assert mean == pytest.approx(25.0)
    assert std == pytest.approx(statistics.pstdev([10, 20, 30, 40]))
    with pytest.raises(ValueError):
        censored_moments([], [], 1.0)


def test_censored_moments_count_a_running_request_at_risk_until_the_length_it_reached() -> None:
    # Two ended at 10; two still run past 30: half the mass lies beyond 30, spread to 3x (90).
    mean, _ = censored_moments([10, 10], [30, 30], 100.0)
    assert mean == pytest.approx(0.5 * 10 + 0.5 * 60)
    # A running request below a finished one moves its mass to the longer samples (product limit).
    assert censored_moments([10, 50], [20], 100.0)[0] == pytest.approx(10 / 3 + 2 / 3 * 50)
    # The tail never goes past the cap.
    assert censored_moments([0.1], [0.9], 1.0)[0] <= 1.0


@settings(max_examples=80, deadline=None)
@given(
    events=st.lists(st.integers(min_value=1, max_value=1000), min_size=1, max_size=40),
    extra=st.lists(st.integers(min_value=0, max_value=1000), max_size=40),
)
def test_censored_moments_stay_in_range_and_bounds_past_every_sample_raise_the_mean(
    events: list[int], extra: list[int]
) -> None:
    cap = 2000.0
    plain, _ = censored_moments(events, [], cap)
    mean, std = censored_moments(events, extra, cap)
    assert min(events + extra) - 1e-9 <= mean <= cap and std >= 0.0
    # Running requests that have already passed every finished one can only lengthen the estimate.
    beyond = [max(events) + x for x in extra]
    assert censored_moments(events, beyond, cap)[0] >= plain - 1e-9
