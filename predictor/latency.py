"""TTFT and TPOT prediction for an instance's load.

The prefill model follows chunked prefill: a backlog of P tokens with a chunk
budget of M runs as ``P // M`` full steps plus one partial step, and every step
also carries the decode batch, so each step costs ``ttft(chunk) + tpot(batch)``.
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
    def predict_tpot_ms(
        self, decode_requests: npt.ArrayLike, decode_tokens: npt.ArrayLike
    ) -> npt.NDArray[np.float64]: ...

    def predict_tpot_ms(
        self, decode_requests: npt.ArrayLike, decode_tokens: npt.ArrayLike
    ) -> float | npt.NDArray[np.float64]:
        """Latency of one decode step for ``decode_requests`` requests holding ``decode_tokens``.

        0 when there is no decode work; otherwise the profile at
        ``(D, max(T / D, 8))``.
        """
        scalar = np.ndim(decode_requests) == 0 and np.ndim(decode_tokens) == 0
        d, t = np.broadcast_arrays(
            np.asarray(decode_requests, dtype=np.float64), np.asarray(decode_tokens, dtype=np.float64)
        )
        result = self._tpot(d, t)
        return float(result) if scalar else result

    def _tpot(self, d: npt.NDArray[np.float64], t: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        active = (d > 0) & (t > 0)
        safe_d = np.where(active, d, 1.0)
        per_request = np.maximum(t / safe_d, MIN_TOKENS_PER_REQUEST)
        return np.where(active, self.tpot_profile.grid(safe_d, per_request), 0.0)

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
    ) -> npt.NDArray[np.float64]: ...

    def predict_ttft_ms(
        self,
        prefill_tokens: npt.ArrayLike,
        decode_requests: npt.ArrayLike,
        decode_tokens: npt.ArrayLike,
        max_num_batched_tokens: npt.ArrayLike,
    ) -> float | npt.NDArray[np.float64]:
        """Time to finish a prefill backlog of ``prefill_tokens`` beside a decode batch.

        ``n = P // M`` full chunks cost ``ttft(M) + tpot(D, T)`` each and a
        remainder ``r`` costs ``ttft(r) + tpot(D, T)``. 0 when ``P <= 0``;
        ``M <= 0`` raises :class:`ValueError`.
        """
        args = (prefill_tokens, decode_requests, decode_tokens, max_num_batched_tokens)
        scalar = all(np.ndim(a) == 0 for a in args)
        p, d, t, m = np.broadcast_arrays(*(np.asarray(a, dtype=np.float64) for a in args))
        if np.any(m <= 0) or np.any(np.isnan(m)):
            bad = m[(m <= 0) | np.isnan(m)].flat[0]
            raise ValueError(f"max_num_batched_tokens must be > 0, got {bad:g}")
        step_decode = self._tpot(d, t)
        full_chunks = np.floor_divide(np.maximum(p, 0.0), m)
        remainder = np.maximum(p, 0.0) - full_chunks * m
        grid = self.ttft_profile.grid
        full_cost = np.where(full_chunks > 0, full_chunks * (grid(m) + step_decode), 0.0)
        tail_cost = np.where(remainder > 0, grid(remainder) + step_decode, 0.0)
        result = np.where(p > 0, full_cost + tail_cost, 0.0)
        return float(result) if scalar else result
