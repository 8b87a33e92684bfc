"""The calibrated interleave carried forward to the prefill still to come (``uncached_ratio``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.calibration import CalibrationConfig, Calibrator, uncached_ratio
from tests.router.core.test_calibration import profile_step
from tests.router.core.test_calibration_interleave import chunk_ms, interleave, sample

HALF_LIFE = 128


def dispatches(rows: list[tuple[float, float, float]]) -> np.ndarray:
    return np.array(rows, dtype=np.float64).reshape(-1, 3)


def steps_at(times: list[float]) -> np.ndarray:
    return np.array(times, dtype=np.float64)


def prefill_of(times: list[float] | np.ndarray, tokens: float = 8192.0) -> np.ndarray:
    """Each step computing ``tokens`` prefill tokens (more than any test's prompt: every dispatch
    before a step has had its prefill run)."""
    return np.full(len(times), tokens)


rows_strategy = st.lists(
    st.tuples(
        st.floats(0.0, 100.0),
        st.integers(1, 8192).map(float),
        st.floats(0.0, 1.0),
    ),
    min_size=1,
    max_size=64,
).map(lambda rows: sorted(rows))


@settings(max_examples=80, deadline=None)
@given(rows=rows_strategy, times=st.lists(st.floats(0.0, 100.0), min_size=1, max_size=300))
def test_without_a_cached_token_the_ratio_is_exactly_one(
    rows: list[tuple[float, float, float]], times: list[float]
) -> None:
    d = dispatches([(t, p, 0.0) for t, p, _ in rows])
    assert uncached_ratio(steps_at(times), prefill_of(times), d, HALF_LIFE, 4.0, 2.0) == 1.0


@settings(max_examples=80, deadline=None)
@given(
    rows=rows_strategy,
    times=st.lists(st.floats(0.0, 100.0), min_size=1, max_size=300),
    recent=st.floats(0.5, 64.0),
    max_ratio=st.floats(1.0, 16.0),
)
def test_the_ratio_stays_within_its_bounds(
    rows: list[tuple[float, float, float]], times: list[float], recent: float, max_ratio: float
) -> None:
    d = dispatches([(t, p, share * p) for t, p, share in rows])
    ratio = uncached_ratio(steps_at(times), prefill_of(times), d, HALF_LIFE, recent, max_ratio)
    assert 1.0 / max_ratio - 1e-12 <= ratio <= max_ratio + 1e-12


@settings(max_examples=60, deadline=None)
@given(
    share=st.floats(0.05, 1.0),
    prompts=st.lists(st.integers(64, 8192), min_size=4, max_size=64),
    recent=st.floats(0.5, 32.0),
)
def test_a_steady_share_gives_one(share: float, prompts: list[int], recent: float) -> None:
    # Every dispatch computes the same share of its prompt: the coming prefill is the measured one.
    d = dispatches([(0.5 + k, float(p), (1.0 - share) * p) for k, p in enumerate(prompts)])
    times = steps_at([0.1 * k for k in range(10 * (len(prompts) + 1))])
    assert uncached_ratio(times, prefill_of(times), d, HALF_LIFE, recent, 100.0) == pytest.approx(
        1.0, rel=1e-9
    )


@pytest.mark.parametrize(("old", "new"), [(1.0, 0.25), (0.5, 0.1), (0.2, 0.6)])
def test_a_change_of_share_scales_by_the_new_over_the_old(old: float, new: float) -> None:
    # 40 dispatches computing ``old`` of their prompt ran in the window (steps reported after each);
    # the 16 latest compute ``new`` of theirs and no step has reported them yet.
    past = [(k * 0.25, 1000.0, (1.0 - old) * 1000.0) for k in range(40)]
    latest = [(10.0 + k * 0.01, 1000.0, (1.0 - new) * 1000.0) for k in range(16)]
    times = steps_at([0.01 + k * 0.04 for k in range(250)])  # 0.01 .. 9.97 s: before the latest
    ratio = uncached_ratio(times, prefill_of(times), dispatches(past + latest), HALF_LIFE, 2.0, 100.0)
    # The latest weigh 1 - 2^-8 of the recent share; the past inside the window are all at ``old``.
    expected = (new * (1 - 2**-8) + old * 2**-8) / old
    assert ratio == pytest.approx(expected, rel=1e-6)


def test_dispatches_outside_the_window_do_not_count_as_measured() -> None:
    # Dispatches before the window's oldest step, or after its newest, are not what it measured.
    before = [(0.0, 1000.0, 0.0)]  # all computed, before the window
    inside = [(2.0 + k * 0.1, 1000.0, 500.0) for k in range(10)]  # half computed
    times = steps_at([1.0 + 0.01 * k for k in range(256)])  # 1.0 .. 3.55 s
    after = [(4.0, 1000.0, 500.0)]
    d = dispatches(before + inside + after)
    ratio = uncached_ratio(times, prefill_of(times), d, HALF_LIFE, 1.0, 100.0)
    # Measured: 0.5 (the inside ones only); recent: mostly 0.5, the oldest (1.0) at 2^-11.
    weights = 2.0 ** -np.arange(12)
    recent = float(np.dot(weights, [0.5] * 11 + [1.0]) / weights.sum())
    assert ratio == pytest.approx(recent / 0.5, rel=1e-9)


def test_no_recent_weighting_or_no_window_gives_one() -> None:
    d = dispatches([(1.0, 1000.0, 900.0), (2.0, 1000.0, 0.0)])
    assert uncached_ratio(steps_at([1.5, 2.5]), prefill_of([1.5, 2.5]), d, HALF_LIFE, 0.0, 2.0) == 1.0
    assert uncached_ratio(steps_at([]), prefill_of([]), d, HALF_LIFE, 4.0, 2.0) == 1.0
    assert uncached_ratio(steps_at([1.5]), prefill_of([1.5]), dispatches([]), HALF_LIFE, 4.0, 2.0) == 1.0


def calibrator(recent: float, max_ratio: float = 8.0) -> Calibrator:
    config = CalibrationConfig(
        mode="scale",
        window_samples=256,
        interleave_half_life_samples=HALF_LIFE,
        update_every_samples=1,
        interleave_recent_dispatches=recent,
        interleave_max_ratio=max_ratio,
    )
    return Calibrator(config, profile_step)


def warm_start(cal: Calibrator, cached_later: float) -> None:
    """Cold prompts of 2,000 tokens, one per second, their chunk every 4th step, then cached ones."""
    for second in range(8):
        cal.dispatched("i0", 2000, 0, float(second))
        cal.observe("i0", "g", [sample(500 if k % 4 == 0 else 0) for k in range(32)], second + 0.5)
    # The fleet's prefix index now finds 1,500 of each prompt's 2,000 tokens cached.
    for k in range(8):
        cal.dispatched("i0", 2000, int(cached_later), 8.0 + 0.1 * k)
    cal.observe("i0", "g", [sample(0)] * 4, 9.0)


def test_cache_hits_at_dispatch_lower_the_interleave_to_the_coming_prefill() -> None:
    measured = calibrator(0.0)
    warm_start(measured, 1500)
    forward = calibrator(2.0)
    warm_start(forward, 1500)
    # Recent dispatches compute a quarter of their prompt where the measured ones computed all.
    recent_weights = 2.0 ** (-np.arange(16) / 2.0)  # half-life 2 dispatches, newest first
    share = float(np.dot(recent_weights, [0.25] * 8 + [1.0] * 8) / recent_weights.sum())
    assert interleave(forward) == pytest.approx(interleave(measured) * share, rel=1e-9)
    assert interleave(measured) == pytest.approx(chunk_ms(500) / 4, rel=0.1)


def test_the_scaling_stays_within_the_max_ratio() -> None:
    measured = calibrator(0.0)
    warm_start(measured, 1990)
    capped = calibrator(1.0, max_ratio=2.0)
    warm_start(capped, 1990)
    assert interleave(capped) == pytest.approx(interleave(measured) / 2.0, rel=1e-12)


def test_without_cache_hits_the_interleave_is_the_measured_one_bit_for_bit() -> None:
    measured = calibrator(0.0)
    warm_start(measured, 0)
    forward = calibrator(4.0)
    warm_start(forward, 0)
    assert interleave(forward) == interleave(measured)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("interleave_recent_dispatches", -1.0),
        ("interleave_recent_dispatches", float("nan")),
        ("interleave_max_ratio", 0.5),
        ("interleave_max_ratio", float("inf")),
    ],
)
def test_config_rejects_bad_values(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        CalibrationConfig(**{field: value})  # type: ignore[arg-type]


def test_a_prompt_still_queued_in_the_engine_is_not_measured() -> None:
    # The steps reported after the last dispatch computed fewer tokens than its uncached part: its
    # prefill has not run, so the measured share is the earlier dispatches' alone.
    d = dispatches([(1.0, 1000.0, 0.0), (2.0, 1000.0, 0.0), (3.0, 1000.0, 900.0)])
    times = steps_at([0.5, 1.5, 2.5, 3.5])
    prefill = np.array([0.0, 1000.0, 1000.0, 50.0])
    ratio = uncached_ratio(times, prefill, d, HALF_LIFE, 1.0, 100.0)
    weights = np.array([0.25, 0.5, 1.0])
    assert ratio == pytest.approx(float(np.dot(weights, [1.0, 1.0, 0.1]) / weights.sum()), rel=1e-9)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40), size=st.integers(1, 16))
def test_the_dispatch_ring_keeps_the_latest_oldest_first(n: int, size: int) -> None:
    from router.core.calibration import _Dispatches

    ring = _Dispatches(size)
    for k in range(n):
        ring.add((float(k), 100.0, 0.0))
    assert ring.array()[:, 0].tolist() == [float(k) for k in range(max(0, n - size), n)]


def test_the_scheduler_tells_the_calibration_what_each_prompt_computes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A seeded prefix-heavy run with the scaling on: every prefill dispatch reaches the calibration
    # with the cached tokens the router counted there, and some of them hit.
    import router.core.scheduler as scheduler_module
    from tests.sim.test_seeded_outcomes import run_scenario

    def config(**kwargs: object) -> CalibrationConfig:
        return CalibrationConfig(**{**kwargs, "interleave_recent_dispatches": 4.0})  # type: ignore[arg-type]

    seen: list[tuple[int, int]] = []
    original = Calibrator.dispatched

    def spy(self: Calibrator, instance_id: str, prompt_tokens: int, cached_tokens: int, now_s: float) -> None:
        seen.append((prompt_tokens, cached_tokens))
        original(self, instance_id, prompt_tokens, cached_tokens, now_s)

    monkeypatch.setattr(scheduler_module, "CalibrationConfig", config)
    monkeypatch.setattr(Calibrator, "dispatched", spy)
    outcome = run_scenario("neutral-slo-prefix")
    served = sum(1 for r in outcome.results if r.error_code is None)
    assert len(seen) >= served > 0
    assert all(0 <= cached < prompt for prompt, cached in seen)
    assert sum(1 for _, cached in seen if cached > 0) > len(seen) // 2


def test_off_by_default_the_scheduler_sends_no_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.sim.test_seeded_outcomes import run_scenario

    calls: list[str] = []
    monkeypatch.setattr(Calibrator, "dispatched", lambda self, i, *a: calls.append(i))
    run_scenario("neutral-slo-prefix")
    assert calls == []
