"""Piecewise-linear interpolation on sampled grids, with linear extrapolation.

Inside the sampled range the value is the linear (1-D) or bilinear (2-D)
blend of the surrounding samples. Outside it, the boundary cell's formula is
used with a weight below 0 or above 1, so the prediction keeps growing with
load instead of saturating or becoming "unknown". An axis with one sample is
constant along that axis. Results are clamped at 0.

Both grids evaluate numpy arrays element-wise (broadcasting), which is how the
router predicts for every instance in one call.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]


def _cell(axis: FloatArray, x: FloatArray) -> tuple[npt.NDArray[np.intp], FloatArray]:
    """Index of the cell's lower sample and the weight of its upper sample.

    ``axis`` is strictly increasing with at least two samples; points left of
    the first cell get the first cell with a negative weight, points right of
    the last get the last cell with a weight above 1.
    """
    lo = np.clip(np.searchsorted(axis, x, side="right") - 1, 0, len(axis) - 2)
    x0 = axis[lo]
    weight = (x - x0) / (axis[lo + 1] - x0)
    return lo, weight


@dataclass(frozen=True)
class Grid1D:
    """Samples ``x -> y`` on a strictly increasing axis."""

    xs: FloatArray
    ys: FloatArray

    def __post_init__(self) -> None:
        if self.xs.ndim != 1 or self.xs.shape != self.ys.shape or len(self.xs) == 0:
            raise ValueError("Grid1D needs two equal-length, non-empty 1-D arrays")
        if np.any(np.diff(self.xs) <= 0):
            raise ValueError("Grid1D axis must be strictly increasing")

    def __call__(self, x: npt.ArrayLike) -> FloatArray:
        xa = np.asarray(x, dtype=np.float64)
        if len(self.xs) == 1:
            return np.broadcast_to(np.maximum(self.ys[0], 0.0), xa.shape).astype(np.float64)
        lo, w = _cell(self.xs, xa)
        y = self.ys[lo] * (1.0 - w) + self.ys[lo + 1] * w
        return np.asarray(np.maximum(y, 0.0), dtype=np.float64)


@dataclass(frozen=True)
class Grid2D:
    """Samples ``(x, y) -> z`` on a rectangular grid; ``zs[i, j]`` is at ``(xs[i], ys[j])``."""

    xs: FloatArray
    ys: FloatArray
    zs: FloatArray

    def __post_init__(self) -> None:
        if self.zs.shape != (len(self.xs), len(self.ys)) or self.zs.size == 0:
            raise ValueError("Grid2D needs zs of shape (len(xs), len(ys))")
        if np.any(np.diff(self.xs) <= 0) or np.any(np.diff(self.ys) <= 0):
            raise ValueError("Grid2D axes must be strictly increasing")

    def __call__(self, x: npt.ArrayLike, y: npt.ArrayLike) -> FloatArray:
        xa, ya = np.broadcast_arrays(np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64))
        # A single-sample axis is constant: use cell (0, 0) with weight 0.
        if len(self.xs) > 1:
            i, wx = _cell(self.xs, xa)
        else:
            i, wx = np.zeros(xa.shape, dtype=np.intp), np.zeros(xa.shape)
        if len(self.ys) > 1:
            j, wy = _cell(self.ys, ya)
        else:
            j, wy = np.zeros(ya.shape, dtype=np.intp), np.zeros(ya.shape)
        i1 = np.minimum(i + 1, len(self.xs) - 1)
        j1 = np.minimum(j + 1, len(self.ys) - 1)
        z = (
            self.zs[i, j] * ((1.0 - wx) * (1.0 - wy))
            + self.zs[i, j1] * ((1.0 - wx) * wy)
            + self.zs[i1, j] * (wx * (1.0 - wy))
            + self.zs[i1, j1] * (wx * wy)
        )
        return np.asarray(np.maximum(z, 0.0), dtype=np.float64)
