"""The grids' array evaluation (inlined, in place) equals their one-point evaluation exactly."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from predictor import Grid1D, Grid2D, LatencyPredictor
from predictor.profile import TpotProfile, TtftProfile

_axis = st.lists(st.integers(-50, 5000), min_size=1, max_size=6, unique=True).map(sorted)
_values = st.floats(-100.0, 1000.0, allow_nan=False)
_points = st.lists(st.floats(-1000.0, 20000.0, allow_nan=False), min_size=1, max_size=12)


@st.composite
def grids_1d(draw: st.DrawFn) -> Grid1D:
    xs = draw(_axis)
    ys = draw(st.lists(_values, min_size=len(xs), max_size=len(xs)))
    return Grid1D(np.array(xs, float), np.array(ys, float))


@st.composite
def grids_2d(draw: st.DrawFn) -> Grid2D:
    xs, ys = draw(_axis), draw(_axis)
    zs = draw(st.lists(_values, min_size=len(xs) * len(ys), max_size=len(xs) * len(ys)))
    return Grid2D(np.array(xs, float), np.array(ys, float), np.array(zs).reshape(len(xs), len(ys)))


@settings(max_examples=200, deadline=None)
@given(grids_1d(), _points)
def test_grid1d_array_equals_points(grid: Grid1D, xs: list[float]) -> None:
    values = grid(np.array(xs))
    assert values.dtype == np.float64 and values.shape == (len(xs),)
    assert values.tolist() == [grid.at(x) for x in xs]
    assert grid(xs[0]).shape == () and float(grid(xs[0])) == grid.at(xs[0])
    assert grid([int(x) for x in xs]).tolist() == [grid.at(float(int(x))) for x in xs]


@settings(max_examples=200, deadline=None)
@given(grids_2d(), _points, _points)
def test_grid2d_array_equals_points(grid: Grid2D, xs: list[float], ys: list[float]) -> None:
    n = min(len(xs), len(ys))
    x, y = np.array(xs[:n]), np.array(ys[:n])
    assert grid(x, y).tolist() == [grid.at(a, b) for a, b in zip(xs[:n], ys[:n], strict=True)]
    # Broadcasting and 0-d inputs take the same path.
    assert grid(x, ys[0]).tolist() == [grid.at(a, ys[0]) for a in xs[:n]]
    assert grid(xs[0], ys[0]).shape == () and float(grid(xs[0], ys[0])) == grid.at(xs[0], ys[0])
    assert x.tolist() == xs[:n] and y.tolist() == ys[:n]  # inputs are never written


@settings(max_examples=200, deadline=None)
@given(
    grids_1d(),
    grids_2d(),
    st.lists(
        st.tuples(st.integers(1, 40000), st.integers(1, 300), st.integers(1, 10**6), st.integers(1, 8192)),
        min_size=1,
        max_size=10,
    ),
)
def test_hot_path_methods_equal_the_scalar_predictions(
    g1: Grid1D, g2: Grid2D, rows: list[tuple[int, int, int, int]]
) -> None:
    lp = LatencyPredictor(TtftProfile(g1, "t"), TpotProfile(g2, "d"))
    p, d, t, m = (np.array(col, dtype=np.float64) for col in zip(*rows, strict=True))
    step = lp.decode_step_ms(d, t)
    full = lp.prefill_step_ms(m)
    assert lp.busy_decode_step_ms(d, t).tolist() == step.tolist()
    assert lp.chunked_prefill_ms(p, step, m, full).tolist() == lp.chunked_prefill_ms(p, step, m).tolist()
    assert lp.positive_chunked_prefill_ms(p, step, m, full + step).tolist() == [
        lp.predict_ttft_ms(*row) for row in rows
    ]
    assert step.tolist() == [lp.predict_tpot_ms(row[1], row[2]) for row in rows]


@settings(max_examples=200, deadline=None)
@given(grids_2d(), st.data())
def test_grid2d_kept_x_cells_give_the_same_values(grid: Grid2D, data: st.DataObject) -> None:
    # The router keeps the batch axis's cells with the load and evaluates every request's context
    # against them: the values must be the full evaluation's, bit for bit, and the cells unchanged.
    xs = data.draw(_points)
    xa = np.array(xs)
    i, wx = grid.x_cells(xa)
    kept = wx.copy()
    for _ in range(2):
        ys = np.array(data.draw(st.lists(_values, min_size=len(xs), max_size=len(xs))))
        assert grid.with_x_cells(i, wx.copy(), ys).tolist() == grid(xa, ys).tolist()
    assert wx.tolist() == kept.tolist()
    lp = LatencyPredictor(
        TtftProfile(Grid1D(np.array([1.0, 2.0]), np.array([1.0, 2.0])), "t"), TpotProfile(grid, "p")
    )
    batch = np.abs(xa) + 1.0
    tokens = np.abs(np.array(data.draw(st.lists(_values, min_size=len(xs), max_size=len(xs))))) + 1.0
    cells = lp.decode_batch_cells(batch)
    assert (
        lp.busy_decode_step_ms_cells(batch, cells, tokens).tolist()
        == lp.busy_decode_step_ms(batch, tokens).tolist()
    )
