"""TTFT and TPOT prediction for an instance's load.

The prefill model follows chunked prefill: a backlog of P tokens with a chunk
budget of M runs as ``P // M`` full steps plus one partial step, and every step
also carries the decode batch, so each step costs ``ttft(chunk) + tpot(batch)``.

Calls with Python numbers take a pure-Python path (no numpy dispatch); calls
with arrays are vectorised. Both perform the same IEEE operations in the same
order, so an array element equals the scalar call on that element's inputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import overload

import numpy as np
import numpy.typing as npt

from predictor.profile import TpotProfile, TtftProfile, load_tpot_profile, load_ttft_profile

#: Floor on the per-request context used for TPOT lookups, so a batch of brand-new
#: requests is not predicted from an unrealistically short context.
MIN_TOKENS_PER_REQUEST = 8.0

Number = int | float | np.integer | np.floating
FloatArray = npt.NDArray[np.float64]

_SCALAR_TYPES = (int, float, np.integer, np.floating)

# 0-d operands: a ufunc resolves them faster than a Python float, with the same values.
_ZERO = np.array(0.0)
_ONE = np.array(1.0)
_MIN_TPR = np.array(MIN_TOKENS_PER_REQUEST)


def _as_float_arrays(*args: npt.ArrayLike) -> list[FloatArray]:
    arrays = [np.asarray(a, dtype=np.float64) for a in args]
    shape = arrays[0].shape
    if any(a.shape != shape for a in arrays[1:]):
        arrays = list(np.broadcast_arrays(*arrays))
    return arrays


class LatencyPredictor:
    """Predicts TTFT and TPOT (milliseconds) from a TTFT and a TPOT profile.

    Both methods take Python numbers (and return a ``float``) or numpy arrays
    that broadcast (and return an array of ``float64``).
    """

    def __init__(self, ttft: TtftProfile, tpot: TpotProfile) -> None:
        self.ttft_profile = ttft
        self.tpot_profile = tpot

    @classmethod
    def from_files(cls, ttft_path: str | Path, tpot_path: str | Path) -> LatencyPredictor:
        """Load both profiles; raises :class:`predictor.ProfileError` on a bad file."""
        return cls(load_ttft_profile(ttft_path), load_tpot_profile(tpot_path))

    @overload
    def predict_tpot_ms(self, decode_requests: Number, decode_tokens: Number) -> float: ...
    @overload
    def predict_tpot_ms(self, decode_requests: npt.ArrayLike, decode_tokens: npt.ArrayLike) -> FloatArray: ...

    def predict_tpot_ms(
        self, decode_requests: npt.ArrayLike, decode_tokens: npt.ArrayLike
    ) -> float | FloatArray:
        """Latency of one decode step for ``decode_requests`` requests holding ``decode_tokens``.

        0 when there is no decode work; otherwise the profile at
        ``(D, max(T / D, 8))``.
        """
        if isinstance(decode_requests, _SCALAR_TYPES) and isinstance(decode_tokens, _SCALAR_TYPES):
            return self.tpot_ms_at(float(decode_requests), float(decode_tokens))
        scalar = np.ndim(decode_requests) == 0 and np.ndim(decode_tokens) == 0
        d, t = _as_float_arrays(decode_requests, decode_tokens)
        result = self.decode_step_ms(d, t)
        return float(result) if scalar else result

    def decode_step_ms(self, decode_requests: FloatArray, decode_tokens: FloatArray) -> FloatArray:
        """:meth:`predict_tpot_ms` for two ``float64`` arrays of the same shape (no checks)."""
        d, t = decode_requests, decode_tokens
        active = (d > _ZERO) & (t > _ZERO)
        safe_d = np.where(active, d, _ONE)
        per_request = np.maximum(t / safe_d, _MIN_TPR)
        return np.where(active, self.tpot_profile.grid(safe_d, per_request), _ZERO)

    def busy_decode_step_ms(self, decode_requests: FloatArray, decode_tokens: FloatArray) -> FloatArray:
        """:meth:`decode_step_ms` when every ``decode_requests`` and ``decode_tokens`` is > 0 (not checked).

        The same values with fewer array operations (the router's hot path: a
        batch that includes the new request is never empty).
        """
        return self.tpot_profile.grid(decode_requests, np.maximum(decode_tokens / decode_requests, _MIN_TPR))

    def busy_decode_step_ms_cells(
        self,
        decode_requests: FloatArray,
        cells: tuple[npt.NDArray[np.intp], FloatArray],
        decode_tokens: FloatArray,
    ) -> FloatArray:
        """:meth:`busy_decode_step_ms` with ``cells`` = ``decode_batch_cells(decode_requests)`` kept by the
        caller (the same batches, decision after decision): the same values, without the batch lookup."""
        i, wx = cells
        per_request = np.maximum(decode_tokens / decode_requests, _MIN_TPR)
        return self.tpot_profile.grid.with_x_cells(i, wx, per_request)  # (wx only read)

    def decode_batch_cells(self, decode_requests: FloatArray) -> tuple[npt.NDArray[np.intp], FloatArray]:
        """The TPOT profile's batch-axis cells of ``decode_requests`` (see :meth:`busy_decode_step_ms_cells`)."""
        return self.tpot_profile.grid.x_cells(decode_requests)

    def tpot_ms_at(self, d: float, t: float) -> float:
        """:meth:`predict_tpot_ms` for two Python floats (no type dispatch: the one-instance hot path)."""
        if not (d > 0 and t > 0):
            return 0.0
        per_request = t / d
        # Same as np.maximum(per_request, 8.0), NaN included.
        if not (per_request >= MIN_TOKENS_PER_REQUEST or per_request != per_request):
            per_request = MIN_TOKENS_PER_REQUEST
        return self.tpot_profile.grid.at(d, per_request)

    def prefill_step_ms(self, tokens: npt.ArrayLike) -> FloatArray:
        """Profiled latency of one prefill step of ``tokens`` tokens (no decode batch)."""
        return self.ttft_profile.grid(tokens)

    @overload
    def predict_ttft_ms(
        self,
        prefill_tokens: Number,
        decode_requests: Number,
        decode_tokens: Number,
        max_num_batched_tokens: Number,
    ) -> float: ...
    @overload
    def predict_ttft_ms(
        self,
        prefill_tokens: npt.ArrayLike,
        decode_requests: npt.ArrayLike,
        decode_tokens: npt.ArrayLike,
        max_num_batched_tokens: npt.ArrayLike,
    ) -> FloatArray: ...

    def predict_ttft_ms(
        self,
        prefill_tokens: npt.ArrayLike,
        decode_requests: npt.ArrayLike,
        decode_tokens: npt.ArrayLike,
        max_num_batched_tokens: npt.ArrayLike,
    ) -> float | FloatArray:
        """Time to finish a prefill backlog of ``prefill_tokens`` beside a decode batch.

        ``n = P // M`` full chunks cost ``ttft(M) + tpot(D, T)`` each and a
        remainder ``r`` costs ``ttft(r) + tpot(D, T)``. 0 when ``P <= 0``;
        ``M <= 0`` raises :class:`ValueError`.
        """
        args = (prefill_tokens, decode_requests, decode_tokens, max_num_batched_tokens)
        if all(isinstance(a, _SCALAR_TYPES) for a in args):
            return self.ttft_ms_at(*(float(a) for a in args))  # type: ignore[arg-type]
        scalar = all(np.ndim(a) == 0 for a in args)
        p, d, t, m = _as_float_arrays(*args)
        ok = m > 0
        if not ok.all():
            bad = m[~ok].flat[0]
            raise ValueError(f"max_num_batched_tokens must be > 0, got {bad:g}")
        result = self.chunked_prefill_ms(p, self.decode_step_ms(d, t), m)
        return float(result) if scalar else result

    def chunked_prefill_ms(
        self,
        prefill_tokens: FloatArray,
        decode_step_ms: FloatArray,
        max_num_batched_tokens: FloatArray,
        full_chunk_ms: FloatArray | None = None,
    ) -> FloatArray:
        """:meth:`predict_ttft_ms` from parts the caller may have cached.

        ``decode_step_ms`` is ``predict_tpot_ms(D, T)`` and ``full_chunk_ms``
        (optional) is ``prefill_step_ms(max_num_batched_tokens)``. All arrays
        are ``float64`` of one shape and ``max_num_batched_tokens`` must be
        > 0 (not checked: this is the hot path of the router).
        """
        p, m = prefill_tokens, max_num_batched_tokens
        grid = self.ttft_profile.grid
        gm = grid(m) if full_chunk_ms is None else full_chunk_ms
        backlog = np.maximum(p, 0.0)
        full_chunks = np.floor_divide(backlog, m)
        remainder = backlog - full_chunks * m
        full_cost = np.where(full_chunks > 0, full_chunks * (gm + decode_step_ms), 0.0)
        tail_cost = np.where(remainder > 0, grid(remainder) + decode_step_ms, 0.0)
        return np.where(p > 0, full_cost + tail_cost, 0.0)

    def positive_chunked_prefill_ms(
        self,
        prefill_tokens: FloatArray,
        decode_step_ms: FloatArray,
        max_num_batched_tokens: FloatArray,
        full_step_ms: FloatArray,
    ) -> FloatArray:
        """:meth:`chunked_prefill_ms` when every ``prefill_tokens`` is > 0 (not checked).

        ``full_step_ms`` is ``prefill_step_ms(max_num_batched_tokens) +
        decode_step_ms`` (finite). Same values, fewer array operations.
        """
        p, m = prefill_tokens, max_num_batched_tokens
        full_chunks = np.floor_divide(p, m)
        remainder = p - full_chunks * m
        # ``where(remainder > 0, grid(remainder) + step, 0)`` in place (one array operation fewer,
        # and no ``where``, the dearest of them on a small fleet): where ``remainder <= 0`` the
        # tail is 0; a NaN remainder (an infinite backlog) keeps its NaN tail where ``where`` gave
        # 0, but its ``full_chunks`` is NaN too, so the sum below is NaN either way.
        tail_cost = self.ttft_profile.grid(remainder)
        tail_cost += decode_step_ms
        np.copyto(tail_cost, _ZERO, where=remainder <= _ZERO)
        result: FloatArray = full_chunks * full_step_ms
        result += tail_cost
        return result

    def ttft_ms_at(self, p: float, d: float, t: float, m: float) -> float:
        """:meth:`predict_ttft_ms` for four Python floats (no type dispatch: the one-instance hot path)."""
        if not m > 0:
            raise ValueError(f"max_num_batched_tokens must be > 0, got {m:g}")
        step_decode = self.tpot_ms_at(d, t)
        backlog = p if (p >= 0.0 or p != p) else 0.0
        full_chunks = backlog // m
        remainder = backlog - full_chunks * m
        grid = self.ttft_profile.grid
        full_cost = full_chunks * (grid.at(m) + step_decode) if full_chunks > 0 else 0.0
        tail_cost = grid.at(remainder) + step_decode if remainder > 0 else 0.0
        return full_cost + tail_cost if p > 0 else 0.0
