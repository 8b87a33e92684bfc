"""Hypothesis properties of the predictor."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from predictor import Grid1D, Grid2D, LatencyPredictor
from predictor.profile import parse_tpot_profile, parse_ttft_profile
from tests.predictor.helpers import WORKED_TTFT, tpot_doc, ttft_doc

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "profiling_data" / "qwen2.5-7b-2xv100-linear"


@st.composite
def increasing_axis(draw: st.DrawFn, min_size: int = 1, max_size: int = 6) -> list[int]:
    values = draw(st.lists(st.integers(1, 20000), min_size=min_size, max_size=max_size, unique=True))
    return sorted(values)


@st.composite
def monotone_ttft(draw: st.DrawFn) -> dict[int, float]:
    xs = draw(increasing_axis())
    steps = draw(st.lists(st.floats(0, 500), min_size=len(xs), max_size=len(xs)))
    return dict(zip(xs, np.cumsum(steps).tolist(), strict=True))


@st.composite
def separable_monotone_tpot(draw: st.DrawFn) -> list[tuple[int, int, float]]:
    """f(b, t) = g(b) + h(t) with g, h non-decreasing: monotone everywhere, extrapolation included."""
    bs = draw(increasing_axis(max_size=5))
    ts = draw(increasing_axis(max_size=5))
    g = np.cumsum(draw(st.lists(st.floats(0, 50), min_size=len(bs), max_size=len(bs))))
    h = np.cumsum(draw(st.lists(st.floats(0, 50), min_size=len(ts), max_size=len(ts))))
    return [(b, t, float(g[i] + h[j])) for i, b in enumerate(bs) for j, t in enumerate(ts)]


def _predictor(ttft: dict[int, float], tpot: list[tuple[int, int, float]]) -> LatencyPredictor:
    return LatencyPredictor(
        parse_ttft_profile(json.dumps(ttft_doc(ttft))), parse_tpot_profile(json.dumps(tpot_doc(tpot)))
    )


tokens = st.integers(0, 200_000)
budgets = st.integers(1, 16384)


@settings(max_examples=200, deadline=None)
@given(
    monotone_ttft(),
    separable_monotone_tpot(),
    tokens,
    tokens,
    budgets,
    st.integers(0, 300),
    st.integers(0, 10**6),
)
def test_ttft_monotone_in_prefill_tokens(
    ttft: dict[int, float], tpot: list[tuple[int, int, float]], p1: int, p2: int, m: int, d: int, t: int
) -> None:
    lp = _predictor(ttft, tpot)
    lo, hi = sorted((p1, p2))
    assert lp.predict_ttft_ms(lo, d, t, m) <= lp.predict_ttft_ms(hi, d, t, m) + 1e-6


@settings(max_examples=200, deadline=None)
@given(
    monotone_ttft(),
    separable_monotone_tpot(),
    tokens,
    budgets,
    st.integers(1, 300),
    st.integers(1, 300),
    st.integers(1, 20000),
)
def test_monotone_in_decode_batch_at_fixed_context(
    ttft: dict[int, float], tpot: list[tuple[int, int, float]], p: int, m: int, d1: int, d2: int, per_req: int
) -> None:
    lp = _predictor(ttft, tpot)
    lo, hi = sorted((d1, d2))
    assert lp.predict_tpot_ms(lo, lo * per_req) <= lp.predict_tpot_ms(hi, hi * per_req) + 1e-6
    assert lp.predict_ttft_ms(p, lo, lo * per_req, m) <= lp.predict_ttft_ms(p, hi, hi * per_req, m) + 1e-6


@settings(max_examples=200, deadline=None)
@given(
    monotone_ttft(),
    separable_monotone_tpot(),
    st.integers(1, 300),
    st.integers(0, 10**6),
    st.integers(0, 10**6),
)
def test_monotone_in_decode_tokens(
    ttft: dict[int, float], tpot: list[tuple[int, int, float]], d: int, t1: int, t2: int
) -> None:
    lp = _predictor(ttft, tpot)
    lo, hi = sorted((t1, t2))
    assert lp.predict_tpot_ms(d, lo) <= lp.predict_tpot_ms(d, hi) + 1e-6


@st.composite
def monotone_grid(draw: st.DrawFn) -> Grid2D:
    """Any grid non-decreasing along both axes (not necessarily separable)."""
    xs = draw(increasing_axis(min_size=2, max_size=5))
    ys = draw(increasing_axis(min_size=2, max_size=5))
    steps = np.array(draw(st.lists(st.floats(0, 20), min_size=len(xs) * len(ys), max_size=len(xs) * len(ys))))
    zs = np.cumsum(np.cumsum(steps.reshape(len(xs), len(ys)), axis=0), axis=1)
    return Grid2D(np.array(xs, float), np.array(ys, float), zs)


@settings(max_examples=200, deadline=None)
@given(monotone_grid(), st.floats(0, 1), st.floats(0, 1), st.floats(0, 1))
def test_bilinear_monotone_inside_any_monotone_grid(grid: Grid2D, fx: float, fy: float, fy2: float) -> None:
    x = grid.xs[0] + fx * (grid.xs[-1] - grid.xs[0])
    y_lo, y_hi = sorted(grid.ys[0] + f * (grid.ys[-1] - grid.ys[0]) for f in (fy, fy2))
    assert grid(x, y_lo) <= grid(x, y_hi) + 1e-9


@settings(max_examples=200, deadline=None)
@given(monotone_grid())
def test_grid_exact_at_every_sample(grid: Grid2D) -> None:
    for i, x in enumerate(grid.xs):
        for j, y in enumerate(grid.ys):
            assert float(grid(x, y)) == grid.zs[i, j]


@settings(max_examples=100, deadline=None)
@given(monotone_ttft())
def test_grid1d_exact_at_every_sample(points: dict[int, float]) -> None:
    xs = np.array(sorted(points), float)
    grid = Grid1D(xs, np.array([points[int(x)] for x in xs]))
    for x in xs:
        assert float(grid(x)) == points[int(x)]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(tokens, st.integers(0, 400), st.integers(0, 10**6), budgets), min_size=1, max_size=40)
)
def test_array_and_scalar_calls_agree(rows: list[tuple[int, int, int, int]]) -> None:
    lp = LatencyPredictor.from_files(BUNDLED / "ttft.json", BUNDLED / "tpot.json")
    p, d, t, m = (np.array(col) for col in zip(*rows, strict=True))
    ttft = lp.predict_ttft_ms(p, d, t, m)
    tpot = lp.predict_tpot_ms(d, t)
    for i, (pi, di, ti, mi) in enumerate(rows):
        assert ttft[i] == lp.predict_ttft_ms(pi, di, ti, mi)
        assert tpot[i] == lp.predict_tpot_ms(di, ti)


@settings(max_examples=100, deadline=None)
@given(tokens, st.integers(0, 400), st.integers(0, 10**6), budgets)
def test_predictions_are_finite_and_non_negative(p: int, d: int, t: int, m: int) -> None:
    lp = _predictor(dict(WORKED_TTFT), [(1, 8, 11.0), (1, 1024, 20.0), (16, 8, 18.0), (16, 1024, 30.0)])
    for value in (lp.predict_ttft_ms(p, d, t, m), lp.predict_tpot_ms(d, t)):
        assert np.isfinite(value) and value >= 0
