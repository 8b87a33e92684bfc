"""Piecewise-linear interpolation on sampled grids, with linear extrapolation.

Inside the sampled range the value is the linear (1-D) or bilinear (2-D)
blend of the surrounding samples. Outside it, the boundary cell's formula is
used with a weight below 0 or above 1, so the prediction keeps growing with
load instead of saturating or becoming "unknown". An axis with one sample is
constant along that axis. Results are clamped at 0.

Both grids evaluate numpy arrays element-wise (broadcasting), which is how the
router predicts for every instance in one call, and have a pure-Python scalar
path (:meth:`Grid1D.at`, :meth:`Grid2D.at`) for one point. The per-cell tables
are built once per grid, so an evaluation is one search per axis plus a few
gathers; the scalar path performs the same IEEE operations in the same order,
so both paths return bit-identical values.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class _Axis:
    """Cell tables of one strictly increasing axis with at least two samples.

    A point's cell is the number of *inner* samples (all but the first and
    the last) at or below it, which is the index of the cell's lower sample
    clamped to the first and last cell, so points outside the range land in
    a boundary cell with a weight below 0 or above 1.
    """

    inner: FloatArray
    lower: FloatArray
    width: FloatArray
    inner_list: list[float]
    lower_list: list[float]
    width_list: list[float]

    @classmethod
    def of(cls, axis: FloatArray) -> _Axis:
        inner = np.ascontiguousarray(axis[1:-1])
        lower = np.ascontiguousarray(axis[:-1])
        width = np.diff(axis)
        return cls(inner, lower, width, inner.tolist(), lower.tolist(), width.tolist())

    def cell(self, x: FloatArray) -> tuple[npt.NDArray[np.intp], FloatArray]:
        lo = self.inner.searchsorted(x, "right")
        return lo, (x - self.lower[lo]) / self.width[lo]

    def cell_at(self, x: float) -> tuple[int, float]:
        lo = bisect_right(self.inner_list, x)
        return lo, (x - self.lower_list[lo]) / self.width_list[lo]


def _clamp0(y: float) -> float:
    # Same as np.maximum(y, 0.0) for every float, NaN included.
    return y if (y > 0.0 or y != y) else 0.0


@dataclass(frozen=True)
class Grid1D:
    """Samples ``x -> y`` on a strictly increasing axis."""

    xs: FloatArray
    ys: FloatArray
    _axis: _Axis | None = field(init=False, repr=False, compare=False, default=None)
    _y0: FloatArray = field(init=False, repr=False, compare=False)
    _y1: FloatArray = field(init=False, repr=False, compare=False)
    _y0_list: list[float] = field(init=False, repr=False, compare=False)
    _y1_list: list[float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.xs.ndim != 1 or self.xs.shape != self.ys.shape or len(self.xs) == 0:
            raise ValueError("Grid1D needs two equal-length, non-empty 1-D arrays")
        if np.any(np.diff(self.xs) <= 0):
            raise ValueError("Grid1D axis must be strictly increasing")
        if len(self.xs) > 1:
            y0 = np.ascontiguousarray(self.ys[:-1], dtype=np.float64)
            y1 = np.ascontiguousarray(self.ys[1:], dtype=np.float64)
            object.__setattr__(self, "_axis", _Axis.of(np.asarray(self.xs, dtype=np.float64)))
        else:
            y0 = y1 = np.asarray(self.ys, dtype=np.float64)
        object.__setattr__(self, "_y0", y0)
        object.__setattr__(self, "_y1", y1)
        object.__setattr__(self, "_y0_list", y0.tolist())
        object.__setattr__(self, "_y1_list", y1.tolist())

    def __call__(self, x: npt.ArrayLike) -> FloatArray:
        xa = np.asarray(x, dtype=np.float64)
        axis = self._axis
        if axis is None:
            return np.broadcast_to(np.maximum(self.ys[0], 0.0), xa.shape).astype(np.float64)
        lo, w = axis.cell(xa)
        y = self._y0[lo] * (1.0 - w) + self._y1[lo] * w
        return np.asarray(np.maximum(y, 0.0), dtype=np.float64)

    def at(self, x: float) -> float:
        """The value at one point, as a Python float (same result as ``float(self(x))``)."""
        axis = self._axis
        if axis is None:
            return _clamp0(self._y0_list[0])
        lo, w = axis.cell_at(x)
        return _clamp0(self._y0_list[lo] * (1.0 - w) + self._y1_list[lo] * w)


@dataclass(frozen=True)
class Grid2D:
    """Samples ``(x, y) -> z`` on a rectangular grid; ``zs[i, j]`` is at ``(xs[i], ys[j])``."""

    xs: FloatArray
    ys: FloatArray
    zs: FloatArray
    _x_axis: _Axis | None = field(init=False, repr=False, compare=False, default=None)
    _y_axis: _Axis | None = field(init=False, repr=False, compare=False, default=None)
    _ny_cells: int = field(init=False, repr=False, compare=False, default=1)
    # First flat cell of each x cell (i * number of y cells), so a cell index is one gather and one add.
    _row_start: npt.NDArray[np.intp] = field(init=False, repr=False, compare=False)
    # Corner values of every cell, flattened row-major over (x cell, y cell).
    _corners: tuple[FloatArray, FloatArray, FloatArray, FloatArray] = field(
        init=False, repr=False, compare=False
    )
    _corner_lists: tuple[list[float], list[float], list[float], list[float]] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if self.zs.shape != (len(self.xs), len(self.ys)) or self.zs.size == 0:
            raise ValueError("Grid2D needs zs of shape (len(xs), len(ys))")
        if np.any(np.diff(self.xs) <= 0) or np.any(np.diff(self.ys) <= 0):
            raise ValueError("Grid2D axes must be strictly increasing")
        nx, ny = len(self.xs), len(self.ys)
        # A single-sample axis is constant: one cell whose upper corner is its lower one.
        i = np.arange(max(nx - 1, 1))
        j = np.arange(max(ny - 1, 1))
        i1 = np.minimum(i + 1, nx - 1)
        j1 = np.minimum(j + 1, ny - 1)
        zs = np.asarray(self.zs, dtype=np.float64)
        corners = (
            np.ascontiguousarray(zs[np.ix_(i, j)].ravel()),
            np.ascontiguousarray(zs[np.ix_(i, j1)].ravel()),
            np.ascontiguousarray(zs[np.ix_(i1, j)].ravel()),
            np.ascontiguousarray(zs[np.ix_(i1, j1)].ravel()),
        )
        object.__setattr__(self, "_corners", corners)
        object.__setattr__(self, "_corner_lists", tuple(c.tolist() for c in corners))
        object.__setattr__(self, "_ny_cells", len(j))
        object.__setattr__(self, "_row_start", np.arange(len(i), dtype=np.intp) * len(j))
        if nx > 1:
            object.__setattr__(self, "_x_axis", _Axis.of(np.asarray(self.xs, dtype=np.float64)))
        if ny > 1:
            object.__setattr__(self, "_y_axis", _Axis.of(np.asarray(self.ys, dtype=np.float64)))

    def __call__(self, x: npt.ArrayLike, y: npt.ArrayLike) -> FloatArray:
        xa = np.asarray(x, dtype=np.float64)
        ya = np.asarray(y, dtype=np.float64)
        if xa.shape != ya.shape:
            xa, ya = np.broadcast_arrays(xa, ya)
        z00, z01, z10, z11 = self._corners
        if self._x_axis is not None:
            i, wx = self._x_axis.cell(xa)
        else:
            i, wx = np.zeros(xa.shape, dtype=np.intp), np.zeros(xa.shape)
        if self._y_axis is not None:
            j, wy = self._y_axis.cell(ya)
            cell = self._row_start[i] + j if self._ny_cells > 1 else i
        else:
            cell, wy = i, np.zeros(ya.shape)
        ux = 1.0 - wx
        uy = 1.0 - wy
        z = z00[cell] * (ux * uy) + z01[cell] * (ux * wy) + z10[cell] * (wx * uy) + z11[cell] * (wx * wy)
        return np.asarray(np.maximum(z, 0.0), dtype=np.float64)

    def at(self, x: float, y: float) -> float:
        """The value at one point, as a Python float (same result as ``float(self(x, y))``)."""
        z00, z01, z10, z11 = self._corner_lists
        if self._x_axis is not None:
            i, wx = self._x_axis.cell_at(x)
        else:
            i, wx = 0, 0.0
        if self._y_axis is not None:
            j, wy = self._y_axis.cell_at(y)
        else:
            j, wy = 0, 0.0
        c = i * self._ny_cells + j
        ux = 1.0 - wx
        uy = 1.0 - wy
        return _clamp0(z00[c] * (ux * uy) + z01[c] * (ux * wy) + z10[c] * (wx * uy) + z11[c] * (wx * wy))
