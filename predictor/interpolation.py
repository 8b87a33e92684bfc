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

# 0-d operands: a ufunc resolves them faster than a Python float, with the same values.
_ZERO = np.array(0.0)
_ONE = np.array(1.0)


@dataclass(frozen=True)
class _Axis:
    """Cell tables of one strictly increasing axis with at least two samples.

    A point's cell is the number of *inner* samples (all but the first and
    the last) at or below it, which is the index of the cell's lower sample
    clamped to the first and last cell, so points outside the range land in
    a boundary cell with a weight below 0 or above 1: cell ``lo =
    searchsorted(inner, x, "right")`` (``bisect_right`` for one point), weight
    ``(x - lower[lo]) / width[lo]``. The grids inline this lookup (it is
    evaluated per decision on the router's hot path).
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
        xa = x if type(x) is np.ndarray and x.dtype == np.float64 else np.asarray(x, dtype=np.float64)
        axis = self._axis
        if axis is None:
            return np.broadcast_to(np.maximum(self.ys[0], 0.0), xa.shape).astype(np.float64)
        if xa.ndim == 0:
            return self(xa.reshape(1)).reshape(())
        # The router calls this per decision on small arrays, where every numpy call costs more
        # than its arithmetic: the cell lookup is inlined and temporaries are updated in place
        # (the same operations in the same order as ``at``).
        lo = axis.inner.searchsorted(xa, "right")
        w = xa - axis.lower[lo]
        w /= axis.width[lo]
        y = self._y0[lo] * (_ONE - w)
        w *= self._y1[lo]
        y += w
        clamped: FloatArray = np.maximum(y, _ZERO, out=y)
        return clamped

    def at(self, x: float) -> float:
        """The value at one point, as a Python float (same result as ``float(self(x))``)."""
        axis = self._axis
        if axis is None:
            return _clamp0(self._y0_list[0])
        lo = bisect_right(axis.inner_list, x)
        w = (x - axis.lower_list[lo]) / axis.width_list[lo]
        y = self._y0_list[lo] * (1.0 - w) + self._y1_list[lo] * w
        return y if (y > 0.0 or y != y) else 0.0


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
        xa = x if type(x) is np.ndarray and x.dtype == np.float64 else np.asarray(x, dtype=np.float64)
        ya = y if type(y) is np.ndarray and y.dtype == np.float64 else np.asarray(y, dtype=np.float64)
        if xa.shape != ya.shape:
            xa, ya = np.broadcast_arrays(xa, ya)
        if xa.ndim == 0:
            return self(xa.reshape(1), ya.reshape(1)).reshape(())
        i, wx = self.x_cells(xa)
        return self.with_x_cells(i, wx, ya)  # (fresh arrays: no copy needed)

    def x_cells(self, xa: FloatArray) -> tuple[npt.NDArray[np.intp], FloatArray]:
        """The x axis's part of :meth:`__call__` at the float64 array ``xa``: each point's cell and weight.

        A caller evaluating many ``y`` at the same ``x`` (the router: the same decode batches,
        every request's own context) keeps them and calls :meth:`with_x_cells`.
        """
        x_axis = self._x_axis
        if x_axis is None:
            return np.zeros(xa.shape, dtype=np.intp), np.zeros(xa.shape)
        i = x_axis.inner.searchsorted(xa, "right")
        wx = xa - x_axis.lower[i]
        wx /= x_axis.width[i]
        return i, wx

    def x_cell_at(self, x: float) -> tuple[int, float]:
        """:meth:`x_cells` at one point (a Python float): its cell and weight, the same values."""
        x_axis = self._x_axis
        if x_axis is None:
            return 0, 0.0
        i = bisect_right(x_axis.inner_list, x)
        return i, (x - x_axis.lower_list[i]) / x_axis.width_list[i]

    def with_x_cells(self, i: npt.NDArray[np.intp], wx: FloatArray, ya: FloatArray) -> FloatArray:
        """:meth:`__call__` from :meth:`x_cells`'s ``(i, wx)`` and the float64 array ``ya`` of the same
        shape; ``i`` and ``wx`` are only read (a caller may keep them for the next ``ya``). The same
        values as ``self(x, ya)``."""
        # As in Grid1D.__call__: cell lookups inlined, temporaries updated in place, and
        # z00 * (ux * uy) + z01 * (ux * wy) + z10 * (wx * uy) + z11 * (wx * wy) summed in that order.
        z00, z01, z10, z11 = self._corners
        y_axis = self._y_axis
        if y_axis is not None:
            j = y_axis.inner.searchsorted(ya, "right")
            wy = ya - y_axis.lower[j]
            wy /= y_axis.width[j]
            if self._ny_cells > 1:
                cell = self._row_start[i]
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
        # wy * wx is wx * wy (IEEE multiplication commutes): ``wx`` stays the caller's, unwritten.
        wy *= wx
        wy *= z11[cell]
        z += wy
        clamped: FloatArray = np.maximum(z, _ZERO, out=z)
        return clamped

    def at(self, x: float, y: float) -> float:
        """The value at one point, as a Python float (same result as ``float(self(x, y))``)."""
        z00, z01, z10, z11 = self._corner_lists
        # _clamp0 is inlined: this is a hot path too.
        x_axis = self._x_axis
        if x_axis is not None:
            i = bisect_right(x_axis.inner_list, x)
            wx = (x - x_axis.lower_list[i]) / x_axis.width_list[i]
        else:
            i, wx = 0, 0.0
        y_axis = self._y_axis
        if y_axis is not None:
            j = bisect_right(y_axis.inner_list, y)
            wy = (y - y_axis.lower_list[j]) / y_axis.width_list[j]
        else:
            j, wy = 0, 0.0
        c = i * self._ny_cells + j
        ux = 1.0 - wx
        uy = 1.0 - wy
        z = z00[c] * (ux * uy) + z01[c] * (ux * wy) + z10[c] * (wx * uy) + z11[c] * (wx * wy)
        return z if (z > 0.0 or z != z) else 0.0
