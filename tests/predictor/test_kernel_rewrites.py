"""The small-fleet rewrites of the hot kernels give the values of the code they replaced, bit for bit.

Each reference below is the kernel as it was before its rewrite (fewer array
operations: no ``where``, no defensive copy). The properties compare the two on
random inputs, including the edge values a view can hold (zero and fractional
backlogs, infinite or NaN decode steps, extrapolation outside the profile),
by bit pattern: a ``-0.0`` for a ``0.0`` would fail. NaN is compared as NaN
(its payload is not a value).
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from predictor import Grid1D, Grid2D, LatencyPredictor
from predictor.interpolation import FloatArray
from predictor.profile import TpotProfile, TtftProfile
from tests.predictor.test_grid_paths import grids_1d, grids_2d

_ZERO = np.array(0.0)
_ONE = np.array(1.0)


def _same_bits(a: FloatArray, b: FloatArray) -> bool:
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    return bool(
        a.shape == b.shape
        and np.array_equal(nan_a, nan_b)
        and np.array_equal(a[~nan_a].view(np.uint64), b[~nan_b].view(np.uint64))
    )


def _old_positive_chunked_prefill_ms(
    lp: LatencyPredictor, p: FloatArray, step: FloatArray, m: FloatArray, full_step: FloatArray
) -> FloatArray:
    full_chunks = np.floor_divide(p, m)
    remainder = p - full_chunks * m
    tail_cost = np.where(remainder > _ZERO, lp.ttft_profile.grid(remainder) + step, _ZERO)
    result: FloatArray = full_chunks * full_step + tail_cost
    return result


def _old_with_x_cells(grid: Grid2D, i: np.ndarray, wx: FloatArray, ya: FloatArray) -> FloatArray:
    wx = wx.copy()  # (the old kernel wrote its ``wx``: its callers passed a copy)
    z00, z01, z10, z11 = grid._corners
    y_axis = grid._y_axis
    if y_axis is not None:
        j = y_axis.inner.searchsorted(ya, "right")
        wy = ya - y_axis.lower[j]
        wy /= y_axis.width[j]
        if grid._ny_cells > 1:
            cell = grid._row_start[i]
            cell += j
        else:
            cell = i
    else:
        cell, wy = i, np.zeros(ya.shape)
    ux = _ONE - wx
    uy = _ONE - wy
    z = ux * uy
    z *= z00[cell]
    ux *= wy
    ux *= z01[cell]
    z += ux
    uy *= wx
    uy *= z10[cell]
    z += uy
    wx *= wy
    wx *= z11[cell]
    z += wx
    clamped: FloatArray = np.maximum(z, _ZERO, out=z)
    return clamped


_backlogs = st.one_of(
    st.floats(1e-9, 2e6, allow_nan=False),
    st.integers(1, 200_000).map(float),
    st.just(float("inf")),
)
_steps = st.one_of(st.floats(0.0, 500.0), st.just(float("inf")), st.just(float("nan")))
_budgets = st.sampled_from([1.0, 7.0, 512.0, 2048.0, 8192.0, 3.5])


@settings(max_examples=300, deadline=None)
@given(grids_1d(), grids_2d(), st.lists(st.tuples(_backlogs, _steps, _budgets), min_size=1, max_size=20))
def test_positive_chunked_prefill_equals_the_where_form(
    g1: Grid1D, g2: Grid2D, rows: list[tuple[float, float, float]]
) -> None:
    lp = LatencyPredictor(TtftProfile(g1, "t"), TpotProfile(g2, "d"))
    p, step, m = (np.array(col, dtype=np.float64) for col in zip(*rows, strict=True))
    full_step = lp.prefill_step_ms(m) + step
    with np.errstate(invalid="ignore"):
        new = lp.positive_chunked_prefill_ms(p, step, m, full_step)
        old = _old_positive_chunked_prefill_ms(lp, p, step, m, full_step)
    assert _same_bits(new, old), (new, old)


_xs = st.lists(st.floats(-1000.0, 20000.0, allow_nan=False), min_size=1, max_size=16)


@settings(max_examples=300, deadline=None)
@given(grids_2d(), _xs, st.data())
def test_with_x_cells_reads_its_cells_and_equals_the_writing_form(
    grid: Grid2D, xs: list[float], data: st.DataObject
) -> None:
    xa = np.array(xs)
    i, wx = grid.x_cells(xa)
    kept_i, kept_wx = i.copy(), wx.copy()
    i.setflags(write=False)  # a write to the caller's cells raises
    wx.setflags(write=False)
    for _ in range(3):
        ya = np.array(data.draw(st.lists(st.floats(-1000.0, 20000.0), min_size=len(xs), max_size=len(xs))))
        assert _same_bits(grid.with_x_cells(i, wx, ya), _old_with_x_cells(grid, i, wx, ya))
    assert np.array_equal(i, kept_i) and np.array_equal(wx.view(np.uint64), kept_wx.view(np.uint64))


@settings(max_examples=200, deadline=None)
@given(grids_2d(), st.lists(st.tuples(st.integers(1, 300), st.integers(1, 10**6)), min_size=1, max_size=16))
def test_busy_decode_step_with_kept_cells_equals_the_lookup(
    grid: Grid2D, rows: list[tuple[int, int]]
) -> None:
    lp = LatencyPredictor(
        TtftProfile(Grid1D(np.array([1.0, 2.0]), np.array([1.0, 2.0])), "t"), TpotProfile(grid, "d")
    )
    batch, tokens = (np.array(col, dtype=np.float64) for col in zip(*rows, strict=True))
    cells = lp.decode_batch_cells(batch)
    for array in cells:
        array.setflags(write=False)  # as the router keeps them with the load
    first = lp.busy_decode_step_ms_cells(batch, cells, tokens)
    again = lp.busy_decode_step_ms_cells(batch, cells, tokens)  # the kept cells are still the lookup's
    expected = lp.busy_decode_step_ms(batch, tokens)
    assert _same_bits(first, expected) and _same_bits(again, expected)
