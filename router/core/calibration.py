"""Online calibration: correct the profile's TTFT/TPOT predictions from the engines' own step samples.

A profile is measured once, on some hardware; the fleet it predicts may be
slower, faster, or shaped differently (another GPU, a driver, KV pressure).
Every worker reports its recent engine steps (prefill tokens, decode batch,
decode context tokens, duration). The :class:`Calibrator` keeps a window of
them per instance and per profile group, compares each with what the profile
predicts for the same step, and derives a correction the metrics apply
(:mod:`router.core.metrics`):

- ``scale``: a robust multiplicative factor per instance and per prediction:
  the median of observed/predicted over the window, for steps with prefill
  (TTFT) and for pure-decode steps (TPOT) separately. The median ignores
  outliers (a step stalled by a GC pause, a noisy neighbour);
- ``refit``: on top of the factors, once ``refit_min_samples`` steps exist, a
  least-squares fit of what the scaled profile still misses, step by step,
  in the terms of

      t = a_p·P + c_p·[P>0] + α·b·l + β·b + γ·l + δ·[b>0]

  where P is the step's prefill tokens, b its decode batch and l the mean
  context per decode request (so b·l is the batch's context tokens). The
  decode part is the linear model with interaction term of seed 000 §3
  (``α·b·l + β·b + γ·l + δ``); the prefill part is linear in the step's prefill
  tokens (seed 001: prefill time follows the total input tokens of the batch,
  which under chunked prefill is the step's chunk). The prediction is the
  scaled profile plus that fitted remainder: where the hardware differs from
  the profile only in speed the remainder is 0 and refit is scale; where it
  differs in shape (another GPU, a slowdown with context) the seed model's
  terms absorb the difference, while a non-linear profile that does match
  keeps its shape. Adapted from the papers, which fit the model itself once
  offline: fitting the remainder online keeps the profile's detail and lets
  the fit start from few samples. The fit is robust (one pass drops residuals
  beyond 4 MADs and refits) and anchored by pseudo steps of remainder 0 over a
  typical range, so an operating point the window never saw is predicted like
  the scaled profile rather than by an extrapolated line;
- ``interleave``: for colocated (neutral) instances, the prefill time that ran
  between decode steps (what steps with a prefill chunk took beyond their
  calibrated decode part), averaged over the window's decode steps with
  weights halving every ``interleave_half_life_samples`` steps back: the TPOT
  a new request will see includes the chunks of later requests' prefills, and
  the recent steps say more of those than the old ones where the prefill work
  per decode step changes (a prefix cache warming up computes less and less of
  each prompt). Optionally (``interleave_recent_dispatches`` > 0; off by
  default) the measured term is carried forward to the prefills still to come
  where the router's prefix index predicts cached prompt tokens: times the share
  of prompt tokens the instance's latest dispatches will compute, over the share
  the dispatches behind the measured steps computed (:func:`uncached_ratio`).
  Without predicted cache hits the ratio is 1.

Bounds: a factor (and a refit prediction, relative to the profile's) stays in
``[min_factor, max_factor]``; each update moves a factor by at most
``max_change_per_update`` (ratio) and blends a new fit halfway into the old
one. Fallback: an instance with fewer than ``min_samples`` samples uses its
profile group's correction, and the profile itself when the group has too few
too; samples older than ``stale_after_s`` are dropped (the correction then
decays back to the profile: no samples, no correction).

Pure: no I/O, no clock (the caller passes ``now_s``), no logging. The shell
feeds samples (:meth:`Calibrator.observe`) and reads drift
(:meth:`Calibrator.drifted`, :meth:`Calibrator.take_drift_events`) to log and
export it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from router.core.columns import BoolArray, FloatArray, IntArray

#: ``off``: the profile as is; ``scale``: robust factors; ``refit``: factors + a least-squares refit.
CALIBRATION_MODES = ("off", "scale", "refit")

#: Number of refit coefficients: a_p, c_p, alpha, beta, gamma, delta.
NUM_COEFS = 6

#: The profile's prediction of one step: (prefill part ms, decode part ms).
StepPredictor = Callable[[FloatArray, FloatArray, FloatArray], tuple[FloatArray, FloatArray]]


def _doc(text: str) -> dict[str, Any]:
    return {"doc": text}


@dataclass(frozen=True)
class StepSample:
    """One engine step as a worker reports it."""

    num_prefill_tokens: int
    num_decode_requests: int
    num_decode_tokens: int
    duration_ms: float


@dataclass(frozen=True)
class CalibrationConfig:
    """How the calibrator learns and how far it may move from the profile."""

    mode: str = field(default="refit", metadata=_doc("off, scale or refit"))
    window_samples: int = field(default=256, metadata=_doc("step samples kept per instance and per group"))
    min_samples: int = field(default=8, metadata=_doc("fewer samples than this: no correction of its own"))
    update_every_samples: int = field(
        default=4, metadata=_doc("recompute a correction at most once per this many new samples")
    )
    # Off by default (every decision as before). An update is a robust refit of the window, the
    # calibration's main CPU cost, and spacing them in time is the lever for large fleets: with
    # 0.25 s the simulator ran 20-23 % faster on a 32-instance PD fleet and the one-hour Azure
    # trace, at the same attainment and prediction error there and on mismatched hardware
    # (scripts/calibration_cadence.py; docs/measurements.md, 2026-11-29, issue 34). But on the
    # README's 4-instance quick start it lost 0.5-1.3 points of attainment over three seeds and
    # up to 1.8 points of TPOT prediction error, for no CPU saved on so few instances; a sample
    # count alone (every 16 or 64) lost 3-21 points where the hardware differs from the profile.
    # No exact incremental update exists: the fit drops outliers by the window's MAD, and each
    # update moves a factor by at most ``max_change_per_update`` and blends the fit halfway, so
    # the correction depends on how many updates there were, not only on the samples.
    update_every_s: float = field(
        default=0.0,
        metadata=_doc("and at most once per this many seconds of the caller's clock (0: no such limit)"),
    )
    max_change_per_update: float = field(
        default=0.25, metadata=_doc("ratio by which one update may move a factor (0.25: x1.25 or /1.25)")
    )
    min_factor: float = field(default=0.2, metadata=_doc("lowest factor (observed/profile) allowed"))
    max_factor: float = field(default=5.0, metadata=_doc("highest factor (observed/profile) allowed"))
    stale_after_s: float = field(
        default=60.0, metadata=_doc("samples older than this (s) are dropped; none left: the profile")
    )
    drift_bound: float = field(
        default=0.25, metadata=_doc("an instance whose factor is beyond 1 ± this (ratio) has drifted")
    )
    refit_min_samples: int = field(
        default=48, metadata=_doc("refit mode: samples needed before a least-squares fit is used")
    )
    prior_weight: float = field(
        default=0.1,
        metadata=_doc("refit mode: weight of the pseudo steps from the scaled profile, x the window"),
    )
    # The interleave predicts the prefill time that will run between a new request's decode steps
    # over its lifetime; the window's plain mean assumes the future brings as much prefill per
    # decode step as the whole window did. While a prefix cache warms up it brings less and less
    # (a cold start computed 38 ms of prefill per decode step over its first 2 s, 12-17 ms once
    # the prefixes were cached), and the plain mean over 256 steps (~10 s) predicted TPOT 11-15 %
    # high for 10 s, refusing requests at 1.0-1.2x their TPOT limit. Weights halving every 128
    # steps follow such a change in about one half-life and still average ~185 steps' worth of
    # samples (a hard window of the last 64 steps followed every burst of cold prefills and
    # refused twice as many). docs/prefix-cache.md, 2026-11-30.
    interleave_half_life_samples: int = field(
        default=128,
        metadata=_doc("interleave: a step this many steps back weighs half the newest"),
    )
    # The measured interleave is the prefill of dispatches already computed; a new request's decode
    # steps interleave with the prefill of dispatches still to come. Where prefix caching is in play
    # the computed part of each prompt is what changes fastest (a warming cache), and the router
    # knows it at dispatch (its index's cached tokens): with this > 0 the measured term is scaled by
    # the share of prompt tokens the latest dispatches compute (weights halving every this many
    # dispatches to the instance) over the share the measured steps' dispatches computed
    # (uncached_ratio). Off by default: on the simulated cold start it made the TPOT prediction's
    # bias honest (-2.6 % -> -0.2 % over 8 seeds) and refused 8 % fewer requests, but those it let
    # through missed their TPOT or slowed others: attainment -0.7 points over 16 seeds at 4
    # (every lowering of the term lost there, a constant x0.8 by 3 points), +0.9 on Mooncake's
    # trace; docs/prefix-cache.md, "The interleave carried forward to the coming prefill".
    interleave_recent_dispatches: float = field(
        default=0.0,
        metadata=_doc(
            "interleave: dispatches back at which a dispatch's uncached share weighs half the newest "
            "in the share of the prefill still to come (0: the measured term as it is)"
        ),
    )
    interleave_max_ratio: float = field(
        default=2.0,
        metadata=_doc("interleave: the scaling by the uncached shares stays within [1 / this, this]"),
    )

    def __post_init__(self) -> None:
        if self.mode not in CALIBRATION_MODES:
            raise ValueError(
                f"calibration mode must be one of {', '.join(CALIBRATION_MODES)}, got {self.mode!r}"
            )
        for name in (
            "window_samples",
            "min_samples",
            "update_every_samples",
            "refit_min_samples",
            "interleave_half_life_samples",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1_000_000:
                raise ValueError(f"calibration {name} must be an integer in [1, 1000000], got {value!r}")
        if self.min_samples > self.window_samples or self.refit_min_samples > self.window_samples:
            raise ValueError(
                f"calibration min_samples ({self.min_samples}) and refit_min_samples ({self.refit_min_samples}) "
                f"must not exceed window_samples ({self.window_samples})"
            )
        if not (0.0 < self.min_factor <= 1.0 <= self.max_factor <= 100.0):
            raise ValueError(
                f"calibration needs 0 < min_factor <= 1 <= max_factor <= 100, got {self.min_factor}, "
                f"{self.max_factor}"
            )
        if not (
            isinstance(self.update_every_s, (int, float))
            and math.isfinite(self.update_every_s)
            and 0.0 <= self.update_every_s <= 3600.0
        ):
            raise ValueError(
                f"calibration update_every_s must be in [0, 3600] s, got {self.update_every_s!r}"
            )
        recent = self.interleave_recent_dispatches
        if not (isinstance(recent, (int, float)) and math.isfinite(recent) and 0.0 <= recent <= 1_000_000):
            raise ValueError(
                f"calibration interleave_recent_dispatches must be in [0, 1000000], got {recent!r}"
            )
        ratio = self.interleave_max_ratio
        if not (isinstance(ratio, (int, float)) and math.isfinite(ratio) and 1.0 <= ratio <= 1000.0):
            raise ValueError(f"calibration interleave_max_ratio must be in [1, 1000], got {ratio!r}")
        for name in ("max_change_per_update", "drift_bound", "stale_after_s", "prior_weight"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"calibration {name} must be a finite number > 0, got {value!r}")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


def step_features(prefill: FloatArray, batch: FloatArray, tokens: FloatArray) -> FloatArray:
    """The refit's design matrix, one row per step: ``[P, P>0, b·l, b, l, b>0]``."""
    has_decode = batch > 0
    # Filled column by column (the values np.stack of the columns would give, without its overhead).
    out = np.empty((*np.shape(prefill), NUM_COEFS))
    out[..., 0] = prefill
    out[..., 1] = prefill > 0
    out[..., 2] = tokens
    out[..., 3] = batch
    per_request = out[..., 4]
    per_request[...] = 0.0
    np.divide(tokens, batch, out=per_request, where=has_decode)
    out[..., 5] = has_decode
    return out


def linear_step_ms(
    coefs: FloatArray, prefill: FloatArray, batch: FloatArray, tokens: FloatArray
) -> FloatArray:
    """The linear step model at ``(prefill, batch, tokens)`` (``coefs`` one row per instance, or one row)."""
    return _dot_rows(step_features(prefill, batch, tokens), coefs)


def _dot_rows(features: FloatArray, coefs: FloatArray) -> FloatArray:
    """Each row of ``features`` dotted with its row of ``coefs``: the one place the sum is taken.

    numpy's ``einsum`` sums the six products in its own order (vector lanes, then across
    them), which a Python sum would not follow; the one-instance path
    (:meth:`Correction.ttft_ms_at`) calls this too, so its floats are the columns'.
    """
    out: FloatArray = np.einsum("...k,...k->...", features, coefs)
    return out


def fitted_step_ms(
    coefs: FloatArray, prefill: FloatArray, batch: FloatArray, tokens: FloatArray
) -> FloatArray:
    """Step times of the linear step model, never below 0."""
    return np.maximum(linear_step_ms(coefs, prefill, batch, tokens), 0.0)


def fit_step_model(
    features: FloatArray, observed_ms: FloatArray, weights: FloatArray | None = None
) -> FloatArray | None:
    """Robust weighted least squares of ``observed_ms`` on ``features``; None when it cannot be fitted.

    One pass of outlier rejection: rows whose residual exceeds 4 scaled MADs
    of the first fit's residuals (and at least 10 µs plus 0.1 % of the
    observations' RMS) are dropped and the rest refitted, unless dropping them
    would leave a term without a row to fit it (:func:`_drops_a_term`).
    """
    w = np.ones(len(observed_ms)) if weights is None else weights
    keep = np.isfinite(observed_ms) & (w > 0)
    kept = int(np.count_nonzero(keep))
    if kept < NUM_COEFS:
        return None
    coefs = _weighted_lstsq(features, observed_ms, w, keep, kept == len(keep))
    residual = observed_ms - features @ coefs
    mad = _median(np.abs(residual[keep] - _median(residual[keep])))
    # The floor keeps rows off by a rounding error: when most rows fit exactly (a remainder
    # that is 0 on every pure-decode step), the MAD is 0 and would reject every prefill row
    # for a residual of a few microseconds, leaving their coefficients unfitted.
    square = np.square(observed_ms[keep])
    rms = float(np.sqrt(np.add.reduce(square) / len(square)))  # what np.mean computes, without its overhead
    limit = max(4.0 * 1.4826 * mad, 1e-3 * rms + 1e-2)
    refit = keep & (np.abs(residual) <= limit)
    kept_now = int(np.count_nonzero(refit))
    if kept_now == kept:
        # No row rejected: the second solve would be the same system, so the same coefficients.
        return coefs
    if kept_now < NUM_COEFS or _drops_a_term(features, keep, refit):
        return coefs
    return _weighted_lstsq(features, observed_ms, w, refit, False)


def _drops_a_term(features: FloatArray, before: BoolArray, after: BoolArray) -> bool:
    """Whether the rows ``after`` keeps leave a term (a column) that the rows ``before`` fitted with none.

    The outlier pass judges residuals against the MAD of every row. Where most rows fit
    exactly (a window of decode steps whose remainder the model matches) and one regime is off
    by a little more than the floor (every prefill step, pulled a few µs by the pseudo steps),
    the pass would drop the whole regime: its terms are then left to rounding (the
    normal-equation solve subtracts every one of its rows and keeps the noise: a prefill
    constant of 500 ms) or to the minimum-norm zero. A regime is not an outlier; keeping
    the first fit there is right.
    """
    had = np.logical_or.reduce(features[before] != 0.0, axis=0)
    has = np.logical_or.reduce(features[after] != 0.0, axis=0)
    return bool((had & ~has).any())


def _weighted_lstsq(
    features: FloatArray, observed_ms: FloatArray, w: FloatArray, keep: BoolArray, every_row: bool
) -> FloatArray:
    """Least squares of the ``keep`` rows, each scaled by the square root of its weight."""
    sw = np.sqrt(w[keep])
    x, y = (features, observed_ms) if every_row else (features[keep], observed_ms[keep])
    solution, *_ = np.linalg.lstsq(x * sw[:, None], y * sw, rcond=None)
    return np.asarray(solution, dtype=np.float64)


def _median(values: FloatArray) -> float:
    """``np.median`` of a 1-D array, bit for bit, at a fraction of its overhead (see :func:`_median_of`)."""
    return _median_of(values.copy())


def _median_of(scratch: FloatArray) -> float:
    """``np.median`` of a 1-D array that may be reordered (a temporary), bit for bit.

    The same partition (the same kth as ``np.median``'s, the last element too: that is where a
    NaN lands) and the same mean of the middle. The calibration takes several medians of a few
    hundred values per update, where ``np.median``'s generic axis handling costs more than the
    partition itself.
    """
    n = len(scratch)
    if n == 0:
        return float(np.median(scratch))  # NaN and its warning, as np.median gives them
    half = n // 2
    scratch.partition([half, -1] if n % 2 else [half - 1, half, -1])
    last = float(scratch[-1])
    if last != last:
        return last
    middle = scratch[half : half + 1] if n % 2 else scratch[half - 1 : half + 1]
    return float(np.add.reduce(middle) / len(middle))  # np.mean of the middle, as np.median takes it


# Columns of a track's window. The first NUM_COEFS are the step's refit features (step_features),
# then what the update takes of each step; all computed once when the step arrives rather than at
# every update of the windows holding it (the same element-wise operations, so the same values).
_P, _B, _L, _HAS_DECODE = 0, 3, 4, 5  # prefill tokens, decode batch, context per decode request, b>0
_OBS, _PRE, _DEC, _TIME = 6, 7, 8, 9  # observed ms, profile prefill ms, profile decode ms, time (s)
_TPOT_RATIO, _TTFT_RATIO = 10, 11  # observed / profile of a decode-only step, of a step with prefill
_COLUMNS = 12
# Flags of a track's window: a decode-only step (a TPOT sample), a step with prefill (a TTFT
# sample), a step with both prefill and decode (its prefill ran between decode steps).
_DECODE_ONLY, _WITH_PREFILL, _MIXED = 0, 1, 2
_FLAGS = 3


def _step_rows(
    steps: FloatArray, pre: FloatArray, dec: FloatArray, now_s: float
) -> tuple[FloatArray, BoolArray]:
    """The window rows and flags of ``steps`` (n x: prefill, batch, tokens, ms) and their profile parts."""
    n = len(steps)
    rows = np.empty((n, _COLUMNS))
    rows[:, :NUM_COEFS] = step_features(steps[:, 0], steps[:, 1], steps[:, 2])
    obs = rows[:, _OBS]
    obs[...] = steps[:, 3]
    rows[:, _PRE] = pre
    rows[:, _DEC] = dec
    rows[:, _TIME] = now_s
    p, b = steps[:, 0], steps[:, 1]
    flags = np.empty((n, _FLAGS), dtype=bool)
    decode_only = flags[:, _DECODE_ONLY]
    decode_only[...] = (p == 0) & (b > 0) & (dec > 0)
    with_prefill = flags[:, _WITH_PREFILL]
    with_prefill[...] = (p > 0) & (pre + dec > 0)
    flags[:, _MIXED] = (b > 0) & (p > 0)
    rows[:, _TPOT_RATIO] = 0.0
    np.divide(obs, dec, out=rows[:, _TPOT_RATIO], where=decode_only)
    rows[:, _TTFT_RATIO] = 0.0
    np.divide(obs, pre + dec, out=rows[:, _TTFT_RATIO], where=with_prefill)
    return rows, flags


#: Dispatches kept per instance and per profile group for :func:`uncached_ratio` (the window's
#: 256 steps span a few dozen dispatches per instance at the rates where the interleave matters).
_DISPATCHES_PER_INSTANCE = 128
_DISPATCHES_PER_GROUP = 512


class _Dispatches:
    """The latest dispatches of one instance or group: (time, prompt tokens, cached tokens), in a ring."""

    __slots__ = ("any_cached", "buf", "count", "pos")

    def __init__(self, size: int) -> None:
        self.buf = np.zeros((size, 3))
        self.count = 0
        self.pos = 0
        #: Whether any dispatch kept counted a cached token (until then the ratio is 1).
        self.any_cached = False

    def add(self, row: tuple[float, float, float]) -> None:
        self.buf[self.pos] = row
        self.pos = (self.pos + 1) % len(self.buf)
        self.count = min(self.count + 1, len(self.buf))
        if row[2] > 0:
            self.any_cached = True

    def array(self) -> FloatArray:
        """The dispatches kept, oldest first."""
        if self.count < len(self.buf):
            return self.buf[: self.count]
        return np.concatenate((self.buf[self.pos :], self.buf[: self.pos]))


class _Track:
    """The window and the current correction of one instance or one profile group."""

    __slots__ = (
        "buf",
        "coefs",
        "count",
        "flags",
        "interleave_ms",
        "last_s",
        "pending",
        "pos",
        "tpot_factor",
        "tpot_samples",
        "ttft_factor",
        "ttft_samples",
        "updated_s",
    )

    def __init__(self, window: int) -> None:
        # A ring of ``window`` rows (the _P ... columns, and the flags); the first ``count`` are in use.
        self.buf = np.zeros((window, _COLUMNS))
        self.flags = np.zeros((window, _FLAGS), dtype=bool)
        self.count = 0
        self.pos = 0
        self.pending = 0
        self.last_s = -math.inf
        #: When the correction was last recomputed (the caller's clock), for ``update_every_s``.
        self.updated_s = -math.inf
        self.ttft_factor = 1.0
        self.tpot_factor = 1.0
        self.ttft_samples = 0
        self.tpot_samples = 0
        self.interleave_ms = 0.0
        self.coefs: FloatArray | None = None

    def add(self, rows: FloatArray, flags: BoolArray) -> None:
        window = len(self.buf)
        n = len(rows)
        pos = self.pos
        if n <= window - pos:
            # The common case, rows that fit before the ring's end: one copy per ring (what the
            # general case below does then, without its empty second copy).
            self.buf[pos : pos + n] = rows
            self.flags[pos : pos + n] = flags
            self.pos = (pos + n) % window
            self.count = min(window, self.count + n)
            self.pending += n
            self.last_s = max(self.last_s, float(rows[-1, _TIME]))
            return
        k = min(len(rows), window)
        # Row after row from ``pos`` (the last ``window`` of them), wrapping at the end of the ring.
        # Each row lands where adding the rows one call at a time would leave it, so the ring (and
        # every fit over it, bit for bit) does not depend on how the rows were split into calls.
        pos = (self.pos + len(rows) - k) % window
        head = min(k, window - pos)
        for ring, new in ((self.buf, rows[-k:]), (self.flags, flags[-k:])):
            ring[pos : pos + head] = new[:head]
            ring[: k - head] = new[head:]
        self.pos = (self.pos + len(rows)) % window
        self.count = min(window, self.count + len(rows))
        self.pending += len(rows)
        self.last_s = max(self.last_s, float(rows[-1, _TIME]))

    def rows(self) -> FloatArray:
        return self.buf[: self.count]

    def ages(self) -> FloatArray:
        """How many steps back each of :meth:`rows` came in (0: the newest)."""
        # The newest row is just before ``pos``; before the ring first fills, ``pos`` is ``count``.
        return ((self.pos - 1 - np.arange(self.count)) % len(self.buf)).astype(float)

    def drop_older_than(self, cutoff_s: float) -> bool:
        """Drop samples older than ``cutoff_s``; True when any was dropped."""
        if self.count == 0 or float(np.min(self.rows()[:, _TIME])) >= cutoff_s:
            return False
        # Oldest first (a full ring's oldest row is at ``pos``), so the kept rows stay in the
        # order they came in: the interleave weighs them by how many steps back they are.
        order = np.roll(np.arange(self.count), -self.pos if self.count == len(self.buf) else 0)
        rows, flags = self.rows()[order], self.flags[: self.count][order]
        fresh = rows[:, _TIME] >= cutoff_s
        kept = rows[fresh]
        self.buf[: len(kept)] = kept
        self.flags[: len(kept)] = flags[fresh]
        self.count = len(kept)
        self.pos = self.count % len(self.buf)
        return True


#: Columns of a window row whose products with the features make the refit's normal equations
#: (the features, then _OBS, _PRE, _DEC: the first nine, so a slice, not a copy).
_GRAM_COLUMNS = slice(0, _DEC + 1)
assert (NUM_COEFS, _OBS, _PRE, _DEC) == (6, 6, 7, 8)


def _gram_of(rows: FloatArray) -> FloatArray:
    """X^T [X | obs | pre | dec] of window rows (X: their refit features).

    X^T y of the refit follows for any factors: y = obs - pre·ttft - dec·tpot is linear in them.
    Computed from the window at each refit rather than kept as rows come and go: one product
    of a (window x 6) by a (window x 9) matrix costs less than the bookkeeping of an
    incremental sum, and keeps the result independent of how the samples arrived (one call or
    several: the same window, the same bits) with no rounding accumulating over an hour.
    """
    x = rows[:, :NUM_COEFS]
    out: FloatArray = x.T @ rows[:, _GRAM_COLUMNS]
    return out


def _solve_normal(a: FloatArray, b: FloatArray) -> FloatArray | None:
    """The solution of ``a @ x = b`` (``a`` symmetric positive definite), equilibrated; None if singular.

    The features differ in scale by 10^5 (tokens beside 0/1 indicators); scaling rows and
    columns by 1/sqrt(diag) keeps the solve's rounding at the conditioning of the correlations.
    """
    diag = np.diagonal(a)
    if not (diag > 0).all():
        return None
    d = 1.0 / np.sqrt(diag)
    try:
        x = np.linalg.solve(a * d[:, None] * d[None, :], b * d)
    except np.linalg.LinAlgError:
        return None
    out = np.asarray(x * d, dtype=np.float64)
    return out if np.isfinite(out).all() else None


def _fit_normal(
    window_gram: FloatArray,
    rows: FloatArray,
    grid: FloatArray,
    grid_gram: FloatArray,
    ttft_factor: float,
    tpot_factor: float,
    prior: float,
) -> FloatArray | None:
    """:func:`_fit_with_prior` of the refit's system, solved from the normal equations the track keeps.

    The same robust fit (one pass dropping residuals beyond 4 scaled MADs, the same floor), but
    the first solve takes the window's X^T X and X^T y (:func:`_gram_of`, plus the pseudo
    steps' cached X^T X times their weight) instead of a least-squares (SVD) solve over every
    row, and the second subtracts the dropped rows from them. Equal to the from-scratch fit
    within rounding (tests/router/core/test_calibration_exact.py), not bit for bit; None when
    the normal equations are singular (the caller then solves from scratch).
    """
    n = len(rows)
    gram = window_gram[:, :NUM_COEFS] + prior * grid_gram
    xty = window_gram[:, NUM_COEFS] - ttft_factor * window_gram[:, NUM_COEFS + 1]
    xty -= tpot_factor * window_gram[:, NUM_COEFS + 2]
    coefs = _solve_normal(gram, xty)
    if coefs is None:
        return None
    features = rows[:, :NUM_COEFS]
    observed = rows[:, _OBS] - rows[:, _PRE] * ttft_factor - rows[:, _DEC] * tpot_factor
    residual = np.empty(n + len(grid))
    np.subtract(observed, features @ coefs, out=residual[:n])
    np.negative(grid @ coefs, out=residual[n:])
    mad = _median_of(np.abs(residual - _median_of(residual.copy())))
    rms = float(np.sqrt(np.add.reduce(np.square(observed)) / len(residual)))
    limit = max(4.0 * 1.4826 * mad, 1e-3 * rms + 1e-2)
    dropped = np.abs(residual) > limit
    num_dropped = int(np.count_nonzero(dropped))
    if num_dropped == 0 or len(residual) - num_dropped < NUM_COEFS:
        return coefs
    every_row = np.concatenate([features, grid])
    if _drops_a_term(every_row, np.ones(len(dropped), dtype=bool), ~dropped):
        return coefs
    # The dropped rows leave the normal equations (a pseudo step with its weight; its y is 0).
    window_out, grid_out = dropped[:n], dropped[n:]
    out_x = features[window_out]
    gram = gram - out_x.T @ out_x
    xty = xty - out_x.T @ observed[window_out]
    if grid_out.any():
        g = grid[grid_out]
        gram -= prior * (g.T @ g)
    return _solve_normal(gram, xty)


def _fit_with_prior(features: FloatArray, observed_ms: FloatArray, n: int, prior: float) -> FloatArray | None:
    """``fit_step_model`` with weight 1 for the first ``n`` rows and ``prior`` (> 0) for the others.

    The same coefficients as ``fit_step_model(features, observed_ms, weights)``, bit for bit,
    with fewer array operations where every row is finite (a weight of 1 scales nothing).
    """
    weights = np.ones(len(observed_ms))
    weights[n:] = prior
    if len(observed_ms) < NUM_COEFS or not np.isfinite(observed_ms).all():
        return fit_step_model(features, observed_ms, weights)
    x = features.copy()
    x[n:] *= np.sqrt(weights[n:])[:, None]
    solution, *_ = np.linalg.lstsq(x, observed_ms, rcond=None)
    coefs = np.asarray(solution, dtype=np.float64)
    residual = observed_ms - features @ coefs
    mad = _median_of(np.abs(residual - _median_of(residual.copy())))
    rms = float(np.sqrt(np.add.reduce(np.square(observed_ms)) / len(observed_ms)))
    limit = max(4.0 * 1.4826 * mad, 1e-3 * rms + 1e-2)
    keep = np.abs(residual) <= limit
    if keep.all() or np.count_nonzero(keep) < NUM_COEFS:
        return coefs
    if _drops_a_term(features, np.ones(len(keep), dtype=bool), keep):
        return coefs
    return _weighted_lstsq(features, observed_ms, weights, keep, False)


def uncached_ratio(
    step_times: FloatArray,
    step_prefill: FloatArray,
    dispatches: FloatArray,
    half_life_steps: float,
    recent_dispatches: float,
    max_ratio: float,
) -> float:
    """How much more (or less) of each prompt the coming prefills compute than the measured ones did.

    ``dispatches``: one row per dispatch to the track's instance(s), oldest first: (time, prompt
    tokens, prompt tokens the router counted as cached there). ``step_times``: when each step
    of the track's window was reported (same clock); ``step_prefill``: the prefill tokens each
    computed. The interleave measured over the window is
    (ms per computed prefill token) x (computed prefill tokens per decode step); of the latter,
    (prompt tokens per decode step) follows the arrival rate and the prompt lengths, which a
    warming cache does not change, and (computed / prompt tokens) is what it changes. Returns

        u_recent / u_measured,   u = sum w·(prompt - cached) / sum w·prompt

    where ``u_measured`` weighs each dispatch whose prefill the window holds as the interleave
    weighs the steps that ran it, 2^(-steps reported since / half_life_steps); a dispatch counts
    as held once it came after the window's oldest step and the steps reported since computed at
    least its own uncached tokens (its prefill ran in them, or a backlog in front of it did: a
    prompt still queued in the engine is not in the measured time yet), and ``u_recent`` weighs the k-th latest dispatch 2^(-k /
    recent_dispatches) (the latest stand for the ones still to come: the router places them
    the same way, against caches at least as warm). Clipped to [1 / max_ratio, max_ratio].
    1 exactly where no dispatch counted a cached token, where none lies inside the window, and
    with ``recent_dispatches`` 0.
    """
    if recent_dispatches <= 0 or len(dispatches) == 0 or len(step_times) == 0:
        return 1.0
    at, prompt, cached = dispatches[:, 0], dispatches[:, 1], dispatches[:, 2]
    if not (cached > 0).any():
        return 1.0
    computed = prompt - np.minimum(cached, prompt)
    order = np.argsort(step_times, kind="stable")
    times = step_times[order]
    # Prefill tokens reported before each position of ``times`` (0 .. all).
    before = np.concatenate(([0.0], np.cumsum(step_prefill[order])))
    first_after = np.searchsorted(times, at, side="right")
    since = len(times) - first_after
    prefilled_since = before[-1] - before[first_after]
    inside = (at >= times[0]) & (since > 0) & (prefilled_since >= computed)
    if not inside.any():
        return 1.0
    w = np.exp2(-since[inside] / half_life_steps)
    measured_prompt = float(np.dot(w, prompt[inside]))
    if measured_prompt <= 0:
        return 1.0
    measured = float(np.dot(w, computed[inside])) / measured_prompt
    v = np.exp2(-np.arange(len(at) - 1, -1, -1, dtype=float) / recent_dispatches)
    recent_prompt = float(np.dot(v, prompt))
    if recent_prompt <= 0:
        return 1.0
    recent = float(np.dot(v, computed)) / recent_prompt
    if measured <= 0:
        return max_ratio if recent > 0 else 1.0
    return min(max(recent / measured, 1.0 / max_ratio), max_ratio)


def _approach(current: float, target: float, config: CalibrationConfig) -> float:
    """Move ``current`` toward ``target`` by at most the configured ratio, within the factor bounds."""
    step = 1.0 + config.max_change_per_update
    value = min(max(target, current / step), current * step)
    return min(max(value, config.min_factor), config.max_factor)


@dataclass(frozen=True)
class Correction:
    """The calibration of every instance of one table, as columns the metrics apply."""

    ttft_factor: FloatArray
    tpot_factor: FloatArray
    #: Observed prefill ms per decode step (the time steps with prefill took beyond their decode part).
    interleave_ms: FloatArray
    #: Refit coefficients of the remainder per instance (zeros where ``has_fit`` is False), or None without any.
    coefs: FloatArray | None
    has_fit: BoolArray
    min_factor: float
    max_factor: float

    def at(self, i: int) -> Correction:
        """The correction of instance ``i`` alone (one-element columns)."""
        sl = slice(i, i + 1)
        return Correction(
            ttft_factor=self.ttft_factor[sl],
            tpot_factor=self.tpot_factor[sl],
            interleave_ms=self.interleave_ms[sl],
            coefs=None if self.coefs is None else self.coefs[sl],
            has_fit=self.has_fit[sl],
            min_factor=self.min_factor,
            max_factor=self.max_factor,
        )

    def ttft_ms(
        self,
        profile_ms: FloatArray,
        backlog: FloatArray,
        batch: FloatArray,
        tokens: FloatArray,
        budget: FloatArray,
        decode_ms: FloatArray,
        full_chunk_ms: FloatArray | None = None,
    ) -> FloatArray:
        """Calibrated TTFT of a chunk schedule (``decode_ms``: the profile's decode part of each chunk).

        Scale: the profile times the TTFT factor. Refit: each chunk's prefill part times the
        TTFT factor, its decode part times the TPOT factor (the baseline the remainder was
        fitted against), plus the fitted remainder of every chunk. ``full_chunk_ms``: the
        remainder of a full chunk, :meth:`full_chunk_remainder_ms` of these columns, when the
        caller keeps it (it does not depend on the backlog).
        """
        scaled: FloatArray = profile_ms * self.ttft_factor
        if self.coefs is None:
            return scaled
        n_full = np.floor_divide(backlog, budget)
        rest = backlog - n_full * budget
        zero = np.zeros_like(backlog)
        decode_part = np.where(backlog > 0, n_full + (rest > 0), zero) * decode_ms
        baseline = (profile_ms - decode_part) * self.ttft_factor + decode_part * self.tpot_factor
        full = self.full_chunk_remainder_ms(budget, batch, tokens) if full_chunk_ms is None else full_chunk_ms
        tail = np.where(rest > 0, linear_step_ms(self.coefs, rest, batch, tokens), zero)
        fitted = baseline + np.where(backlog > 0, n_full * full + tail, zero)
        fitted = np.clip(fitted, profile_ms * self.min_factor, profile_ms * self.max_factor)
        out: FloatArray = np.where(self.has_fit, fitted, scaled)
        return out

    def ttft_ms_at(
        self,
        i: int,
        profile_ms: float,
        backlog: float,
        batch: float,
        tokens: float,
        budget: float,
        decode_ms: float,
    ) -> float:
        """:meth:`ttft_ms` at instance ``i`` alone, on Python floats: the column's entry, bit for bit.

        A route's predicted TTFT is one instance's; building one-element columns for it was
        most of its cost. The same IEEE operations run in the same order on scalars (Python's
        float ``//`` is numpy's ``floor_divide``: the same fmod-based algorithm; the clip is
        numpy's, comparison for comparison), and the refit's dot products stay numpy's
        (:func:`_dot_rows` on one row). Inputs that are not all finite, or a budget that is
        not positive, where Python's float operations and numpy's part ways (exceptions,
        NaN comparisons), go through the columns.
        """
        factor = self.ttft_factor.item(i)
        scaled: float = profile_ms * factor
        if self.coefs is None or not self.has_fit.item(i):
            return scaled  # (the refit's value is dropped for an instance without a fit)
        if not (math.isfinite(profile_ms + backlog + batch + tokens + budget + decode_ms) and budget > 0):
            one = self.at(i)
            columns = [np.array([v]) for v in (profile_ms, backlog, batch, tokens, budget, decode_ms)]
            return float(one.ttft_ms(*columns)[0])
        n_full = backlog // budget
        rest = backlog - n_full * budget
        positive = backlog > 0
        decode_part = ((n_full + (1.0 if rest > 0 else 0.0)) if positive else 0.0) * decode_ms
        baseline = (profile_ms - decode_part) * factor + decode_part * self.tpot_factor.item(i)
        if positive:
            full = self._linear_at(i, budget, batch, tokens)
            tail = self._linear_at(i, rest, batch, tokens) if rest > 0 else 0.0
            fitted = baseline + (n_full * full + tail)
        else:
            fitted = baseline + 0.0
        return self._clip(fitted, profile_ms)

    def tpot_ms_at(self, i: int, profile_ms: float, batch: float, tokens: float) -> float:
        """:meth:`tpot_ms` at instance ``i`` alone, on Python floats (as :meth:`ttft_ms_at`)."""
        scaled: float = profile_ms * self.tpot_factor.item(i)
        if self.coefs is not None and self.has_fit.item(i):
            if not math.isfinite(profile_ms + batch + tokens):
                one = self.at(i)
                return float(one.tpot_ms(np.array([profile_ms]), np.array([batch]), np.array([tokens]))[0])
            scaled = self._clip(scaled + self._linear_at(i, 0.0, batch, tokens), profile_ms)
        return scaled + self.interleave_ms.item(i)

    def _linear_at(self, i: int, prefill: float, batch: float, tokens: float) -> float:
        """:func:`linear_step_ms` at instance ``i``: :func:`step_features`' row built from floats."""
        assert self.coefs is not None
        has_decode = batch > 0
        row = [
            prefill,
            1.0 if prefill > 0 else 0.0,
            tokens,
            batch,
            tokens / batch if has_decode else 0.0,
            1.0 if has_decode else 0.0,
        ]
        value: float = _dot_rows(np.array([row]), self.coefs[i : i + 1]).item(0)
        return value

    def _clip(self, value: float, profile_ms: float) -> float:
        """``np.clip(value, profile_ms * min_factor, profile_ms * max_factor)`` on floats (NaN stays NaN)."""
        if value != value:
            return value
        low = profile_ms * self.min_factor
        high = profile_ms * self.max_factor
        value = value if value > low else low
        return value if value < high else high

    def full_chunk_remainder_ms(
        self, budget: FloatArray, batch: FloatArray, tokens: FloatArray
    ) -> FloatArray:
        """The refit's remainder of a full chunk of ``budget`` tokens beside the decode batch (refit only)."""
        assert self.coefs is not None
        return linear_step_ms(self.coefs, budget, batch, tokens)

    def tpot_ms(self, profile_ms: FloatArray, batch: FloatArray, tokens: FloatArray) -> FloatArray:
        """Calibrated TPOT of a decode step at ``(batch, tokens)``, plus the interleaved prefill time."""
        scaled: FloatArray = profile_ms * self.tpot_factor
        if self.coefs is not None:
            fitted = scaled + linear_step_ms(self.coefs, np.zeros_like(batch), batch, tokens)
            fitted = np.clip(fitted, profile_ms * self.min_factor, profile_ms * self.max_factor)
            scaled = np.where(self.has_fit, fitted, scaled)
        out: FloatArray = scaled + self.interleave_ms
        return out


class Calibrator:
    """Step samples in, per-instance corrections out; see the module docstring.

    ``predict_step(group)`` returns the profile's step predictor of a profile
    group (the router passes its :class:`~router.core.predictors.PredictorSet`'s).
    Not thread-safe: the shell feeds and reads it from one event loop.
    """

    def __init__(self, config: CalibrationConfig, predict_step: Callable[[str], StepPredictor]) -> None:
        self.config = config
        self._predict_step = predict_step
        self._instances: dict[str, _Track] = {}
        self._groups: dict[str, _Track] = {}
        self._group_of: dict[str, str] = {}
        self._drifted: dict[str, tuple[float, float]] = {}
        self._events: list[tuple[str, bool, float, float]] = []
        #: Bumped whenever a correction changes (tables cache their :class:`Correction` by it).
        self.version = 0
        self._cache: tuple[Sequence[str], int, Correction | None] | None = None
        # The columns of the last correction built, and what changed since: instances whose
        # track took or lost samples, and whether any group's did (rows falling back to their
        # group then change too). A new correction for the same ids rewrites only those rows.
        self._columns: _Columns | None = None
        self._dirty: set[str] = set()
        self._groups_dirty = False
        #: The latest dispatches per instance and per profile group, for :func:`uncached_ratio`.
        self._dispatches: dict[str, _Dispatches] = {}
        self._group_dispatches: dict[str, _Dispatches] = {}

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    @property
    def follows_dispatches(self) -> bool:
        """Whether the interleave reads the dispatches (:meth:`dispatched`): calibrating, with
        ``interleave_recent_dispatches`` > 0."""
        return self.config.enabled and self.config.interleave_recent_dispatches > 0

    def dispatched(self, instance_id: str, prompt_tokens: int, cached_tokens: int, now_s: float) -> None:
        """Note a prompt of ``prompt_tokens`` dispatched to ``instance_id`` for prefill at ``now_s``,
        ``cached_tokens`` of them counted as cached there (by the router's prefix index).

        Read at the next update of the instance's correction (:func:`uncached_ratio`); a router
        that never counts a cached token gets the measured interleave as it is.
        """
        if not self.follows_dispatches or prompt_tokens <= 0:
            return
        row = (float(now_s), float(prompt_tokens), float(max(cached_tokens, 0)))
        ring = self._dispatches.get(instance_id)
        if ring is None:
            ring = self._dispatches[instance_id] = _Dispatches(_DISPATCHES_PER_INSTANCE)
        ring.add(row)
        group = self._group_of.get(instance_id)
        if group is not None:
            group_ring = self._group_dispatches.get(group)
            if group_ring is None:
                group_ring = self._group_dispatches[group] = _Dispatches(_DISPATCHES_PER_GROUP)
            group_ring.add(row)

    # ------------------------------------------------------------------ input

    def observe(self, instance_id: str, group: str, samples: Sequence[StepSample], now_s: float) -> None:
        """Record ``samples`` (oldest first, each once) of ``instance_id`` in profile group ``group``."""
        if not self.enabled or not samples:
            return
        steps = np.array(
            [
                (s.num_prefill_tokens, s.num_decode_requests, s.num_decode_tokens, s.duration_ms)
                for s in samples
            ],
            dtype=np.float64,
        )
        self.observe_steps(((instance_id, group, steps),), now_s)

    def observe_steps(self, batches: Iterable[tuple[str, str, FloatArray]], now_s: float) -> None:
        """:meth:`observe` of several instances at once, in order; each batch's steps as an array.

        A batch is ``(instance_id, group, steps)`` with ``steps`` of shape ``(n, 4)``: prefill
        tokens, decode batch, decode tokens, duration (ms), oldest first. The outcome is that of
        one :meth:`observe` call per batch in the same order; the profile's predictions are
        computed in one call per group (the step predictor is element-wise, so the values are
        the same).
        """
        if not self.enabled:
            return
        todo = [batch for batch in batches if len(batch[2])]
        if not todo:
            return
        steps = todo[0][2] if len(todo) == 1 else np.concatenate([batch[2] for batch in todo])
        sizes = np.array([len(batch[2]) for batch in todo])
        ok = np.isfinite(steps).all(axis=1) & (steps[:, 3] >= 0) & (steps[:, :3] >= 0).all(axis=1)
        ok &= (steps[:, 0] > 0) | (steps[:, 1] > 0)
        if not ok.all():
            # Samples that cannot be right (negative, not finite, an empty step) are left out.
            sizes = np.add.reduceat(ok, np.cumsum(sizes) - sizes)
            steps = steps[ok]
            if len(steps) == 0:
                return
        ends = np.cumsum(sizes).tolist()
        codes: dict[str, int] = {}
        for _, group, _ in todo:
            codes.setdefault(group, len(codes))
        # The rows of each group, ascending (the rows of its batches in call order); None: all.
        rows_of: dict[str, IntArray | None]
        if len(codes) == 1:
            rows_of = {todo[0][1]: None}
            pre, dec = self._predict_step(todo[0][1])(steps[:, 0], steps[:, 1], steps[:, 2])
        else:
            row_code = np.repeat(np.array([codes[group] for _, group, _ in todo]), sizes)
            rows_of = {group: np.flatnonzero(row_code == code) for group, code in codes.items()}
            pre, dec = np.empty(len(steps)), np.empty(len(steps))
            for group, at in rows_of.items():
                assert at is not None
                pre[at], dec[at] = self._predict_step(group)(steps[at, 0], steps[at, 1], steps[at, 2])
        rows, flags = _step_rows(steps, pre, dec, float(now_s))
        # Every batch's rows go into their tracks first; then each track that took at least
        # ``update_every_samples`` new rows is updated once. An instance reports once per call,
        # so its track is updated exactly as before; a profile group takes the rows of all its
        # instances in the call and is refitted once over them, instead of once per instance
        # (no one reads the corrections between those refits; the refit is most of the
        # calibration's cost, and a group took ~15 refits per snapshot of a 16-instance fleet).
        # A group's rows go into its ring in one add (of its batches' rows in call order): the
        # ring places each row where one add per batch would, so the window is the same.
        # Tracks that took rows: (track, group, instance id; None for a group's track).
        touched: dict[int, tuple[_Track, str, str | None]] = {}
        start = 0
        for (instance_id, group, _), end in zip(todo, ends, strict=True):
            if end > start:
                track = self._record(instance_id, group, rows[start:end], flags[start:end])
                touched[id(track)] = (track, group, instance_id)
            start = end
        window = self.config.window_samples
        for group, at in rows_of.items():
            if at is not None and len(at) == 0:
                continue  # every row of the group's batches was left out above
            group_track = self._groups.get(group)
            if group_track is None:
                group_track = self._groups[group] = _Track(window)
            if at is None:
                group_track.add(rows, flags)
            else:
                group_track.add(rows[at], flags[at])
            touched[id(group_track)] = (group_track, group, None)
        update_every = self.config.update_every_samples
        every_s = self.config.update_every_s
        for track, group, owner in touched.values():
            # Not within ``update_every_s`` after the last update (a clock that went back: due).
            if track.pending >= update_every and not (0.0 <= now_s - track.updated_s < every_s):
                ring = self._dispatches.get(owner) if owner is not None else self._group_dispatches.get(group)
                self._update(track, group, now_s, ring)
                if owner is not None:
                    # Only an update moves the factors, so only an updated track can change drift.
                    self._check_drift(owner)

    def _record(self, instance_id: str, group: str, rows: FloatArray, flags: BoolArray) -> _Track:
        """Add ``rows`` to the track of ``instance_id`` (its group's track: the caller adds them there)."""
        self._group_of[instance_id] = group
        self._dirty.add(instance_id)
        self._groups_dirty = True
        instance_track = self._instances.get(instance_id)
        if instance_track is None:
            instance_track = self._instances[instance_id] = _Track(self.config.window_samples)
        instance_track.add(rows, flags)
        return instance_track

    def forget(self, instance_id: str) -> None:
        """Drop an instance that left the fleet."""
        self._instances.pop(instance_id, None)
        self._dispatches.pop(instance_id, None)
        self._group_of.pop(instance_id, None)
        self._drifted.pop(instance_id, None)
        self._columns = None
        self.version += 1

    def expire(self, now_s: float) -> None:
        """Drop samples older than ``stale_after_s``; tracks left with too few fall back to the profile."""
        cutoff = now_s - self.config.stale_after_s
        changed = False
        for key, track in (*self._instances.items(), *self._groups.items()):
            if track.drop_older_than(cutoff):
                changed = True
                if self._instances.get(key) is track:
                    self._dirty.add(key)
                    ring = self._dispatches.get(key)
                else:
                    self._groups_dirty = True
                    ring = self._group_dispatches.get(key)
                group = self._group_of.get(key, key)
                self._update(track, group, now_s, ring)
        if changed:
            for instance_id in list(self._instances):
                self._check_drift(instance_id)

    def _update(self, track: _Track, group: str, now_s: float, ring: _Dispatches | None = None) -> None:
        config = self.config
        track.pending = 0
        track.updated_s = float(now_s)
        rows = track.rows()
        if len(rows) < config.min_samples:
            # Too few (or stale) samples: back to the profile.
            track.ttft_factor = track.tpot_factor = 1.0
            track.ttft_samples = track.tpot_samples = 0
            track.interleave_ms = 0.0
            track.coefs = None
            self.version += 1
            return
        flags = track.flags[: len(rows)]
        decode_only, with_prefill = flags[:, _DECODE_ONLY], flags[:, _WITH_PREFILL]
        track.tpot_samples = int(np.count_nonzero(decode_only))
        track.ttft_samples = int(np.count_nonzero(with_prefill))
        if track.tpot_samples >= config.min_samples:
            target = _median_of(rows[decode_only, _TPOT_RATIO])
            track.tpot_factor = _approach(track.tpot_factor, target, config)
        if track.ttft_samples >= config.min_samples:
            target = _median_of(rows[with_prefill, _TTFT_RATIO])
            track.ttft_factor = _approach(track.ttft_factor, target, config)
        if track.ttft_samples < config.min_samples and track.tpot_samples >= config.min_samples:
            track.ttft_factor = track.tpot_factor  # one speed for the hardware until prefill is seen
        # Prefill time between decode steps, as observed: what the steps with a prefill chunk
        # took beyond their (calibrated) decode part, spread over every decode step. Measured,
        # not the profile's prefill cost times a factor that may not be learned yet. Each step
        # weighs 2^(-age / half-life) (age in steps, 0 the newest): the same weight in the sum of
        # prefill time and in the count of decode steps, so a steady regime gives the plain mean
        # within noise, and a change of regime dominates the estimate after about one half-life.
        # A group's track counts the steps of all its instances (its fallback follows a change
        # as many times faster as it has reporting instances).
        has_decode = rows[:, _HAS_DECODE] > 0
        if has_decode.any():
            mixed = flags[:, _MIXED]
            weights = np.exp2(-track.ages() / config.interleave_half_life_samples)
            extra = np.maximum(rows[mixed, _OBS] - rows[mixed, _DEC] * track.tpot_factor, 0.0)
            track.interleave_ms = float(np.dot(weights[mixed], extra) / np.sum(weights[has_decode]))
            if ring is not None and ring.any_cached and track.interleave_ms > 0:
                # Carried forward to the prefills still to come (uncached_ratio; 1 without cache hits).
                track.interleave_ms *= uncached_ratio(
                    rows[:, _TIME],
                    rows[:, _P],
                    ring.array(),
                    config.interleave_half_life_samples,
                    config.interleave_recent_dispatches,
                    config.interleave_max_ratio,
                )
        else:
            track.interleave_ms = 0.0
        if config.mode == "refit" and len(rows) >= config.refit_min_samples:
            coefs = self._refit(rows, track)
            if coefs is not None:
                track.coefs = coefs if track.coefs is None else 0.5 * (track.coefs + coefs)
        self.version += 1

    def _refit(self, rows: FloatArray, track: _Track) -> FloatArray | None:
        """Least squares of the scaled profile's remainder over the window, plus pseudo steps of remainder 0."""
        # Pseudo steps on a grid spanning the window's range and a typical one: a direction the
        # window never explored (no prefill step in it, a single batch size) follows the scaled
        # profile instead of whatever the minimum-norm solution would give it.
        maxima = np.maximum.reduce(rows[:, : _L + 1], axis=0)  # ndarray.max without its wrapper
        grid, grid_gram = _pseudo_steps(
            max(float(maxima[_P]), 2048.0), max(float(maxima[_B]), 32.0), max(float(maxima[_L]), 2048.0)
        )
        n, m = len(rows), len(grid)
        prior = self.config.prior_weight * n / m
        fast = _fit_normal(_gram_of(rows), rows, grid, grid_gram, track.ttft_factor, track.tpot_factor, prior)
        if fast is not None:
            return fast
        features = np.empty((n + m, NUM_COEFS))
        features[:n] = rows[:, :NUM_COEFS]
        features[n:] = grid
        # The baseline: the prefill part at the TTFT factor, the decode part at the TPOT factor
        # (linear in the parts, so a linear truth leaves a linear remainder).
        scaled = rows[:, _PRE] * track.ttft_factor + rows[:, _DEC] * track.tpot_factor
        observed = np.empty(n + m)
        np.subtract(rows[:, _OBS], scaled, out=observed[:n])
        observed[n:] = 0.0
        # The pseudo steps weigh prior_weight x the window in all.
        return _fit_with_prior(features, observed, n, prior)

    def _check_drift(self, instance_id: str) -> None:
        track = self._instances.get(instance_id)
        if track is None:
            return
        bound = 1.0 + self.config.drift_bound
        ttft, tpot = track.ttft_factor, track.tpot_factor
        drifted = any(f > bound or f < 1.0 / bound for f in (ttft, tpot))
        was = instance_id in self._drifted
        if drifted:
            self._drifted[instance_id] = (ttft, tpot)
        else:
            self._drifted.pop(instance_id, None)
        if drifted != was:
            self._events.append((instance_id, drifted, ttft, tpot))
            del self._events[:-1024]  # bounded: a shell that never reads them loses the oldest

    # ------------------------------------------------------------------ output

    def factors(self, instance_id: str) -> tuple[float, float]:
        """(TTFT factor, TPOT factor) in force for ``instance_id`` (1.0, 1.0: the profile)."""
        track = self._effective(instance_id)
        return (1.0, 1.0) if track is None else (track.ttft_factor, track.tpot_factor)

    def num_samples(self, instance_id: str) -> int:
        track = self._instances.get(instance_id)
        return 0 if track is None else track.count

    def coefficients(self, instance_id: str) -> FloatArray | None:
        """The refit coefficients of the remainder in force for ``instance_id`` (a_p, c_p, α, β, γ, δ), or None."""
        track = self._effective(instance_id)
        return None if track is None else track.coefs

    def drifted(self) -> dict[str, tuple[float, float]]:
        """Instances whose (TTFT, TPOT) factor is beyond ``1 ± drift_bound``."""
        return dict(self._drifted)

    def take_drift_events(self) -> list[tuple[str, bool, float, float]]:
        """``(instance_id, drifted, ttft_factor, tpot_factor)`` for every change since the last call."""
        events, self._events = self._events, []
        return events

    def _effective(self, instance_id: str) -> _Track | None:
        track = self._instances.get(instance_id)
        if track is not None and track.count >= self.config.min_samples:
            return track
        group = self._groups.get(self._group_of.get(instance_id, ""))
        if group is not None and group.count >= self.config.min_samples:
            return group
        return None

    def correction(self, ids: Sequence[str], groups: Iterable[str] | None = None) -> Correction | None:
        """The correction of the instances ``ids`` (in table order), or None when it is the profile's everywhere.

        Instances never seen use their group's correction (``groups`` in table order).
        """
        if not self.enabled or not (self._instances or self._groups):
            return None  # nothing learned yet: the profile everywhere, at no cost per decision
        cached = self._cache
        if cached is not None and cached[0] is ids and cached[1] == self.version:
            return cached[2]
        columns = self._columns
        if columns is None or columns.ids is not ids or columns.groups is not groups:
            if groups is not None:
                for instance_id, group in zip(ids, groups, strict=True):
                    self._group_of.setdefault(instance_id, group)
            columns = self._columns = _Columns(ids, groups)
            rows: Iterable[int] = range(len(ids))
        else:
            # Only rows whose instance or group track changed since the last build differ.
            changed: set[int] = set()
            for instance_id in self._dirty:
                changed.update(columns.index.get(instance_id, ()))
            if self._groups_dirty:
                changed.update(columns.from_group)
            rows = changed
        self._dirty.clear()
        self._groups_dirty = False
        min_samples = self.config.min_samples
        for i in rows:
            instance_id = ids[i]
            track = self._instances.get(instance_id)
            if track is not None and track.count >= min_samples:
                columns.from_group.discard(i)
            else:
                columns.from_group.add(i)
                track = self._groups.get(self._group_of.get(instance_id, ""))
                if track is not None and track.count < min_samples:
                    track = None
            columns.set(i, track)
        result = None
        if columns.tracked.any():
            has_fit = columns.has_fit.copy()
            result = Correction(
                ttft_factor=columns.ttft.copy(),
                tpot_factor=columns.tpot.copy(),
                interleave_ms=columns.interleave.copy(),
                coefs=columns.coefs.copy() if has_fit.any() else None,
                has_fit=has_fit,
                min_factor=self.config.min_factor,
                max_factor=self.config.max_factor,
            )
        self._cache = (ids, self.version, result)
        return result


def _pseudo_steps(p_max: float, b_max: float, l_max: float) -> tuple[FloatArray, FloatArray]:
    """The refit's pseudo steps (their features) on a grid up to the window's maxima, and their X^T X; cached."""
    key = (p_max, b_max, l_max)
    cached = _PSEUDO_STEPS.get(key)
    if cached is None:
        p_grid = np.array([0.0, 16.0, p_max / 4.0, p_max / 2.0, p_max])
        b_grid = np.array([0.0, 1.0, b_max / 4.0, b_max / 2.0, b_max])
        l_grid = np.array([64.0, l_max / 2.0, l_max])
        pg, bg, lg = (a.ravel() for a in np.meshgrid(p_grid, b_grid, l_grid, indexing="ij"))
        live = (pg > 0) | (bg > 0)
        features = step_features(pg[live], bg[live], (bg * lg)[live])
        features.flags.writeable = False
        gram = features.T @ features
        gram.flags.writeable = False
        if len(_PSEUDO_STEPS) >= 256:  # bounded: windows of ever new maxima start it over
            _PSEUDO_STEPS.clear()
        cached = _PSEUDO_STEPS[key] = (features, gram)
    return cached


_PSEUDO_STEPS: dict[tuple[float, float, float], tuple[FloatArray, FloatArray]] = {}


class _Columns:
    """The per-instance columns of the corrections of one ``ids`` sequence, rewritten row by row."""

    __slots__ = (
        "coefs",
        "from_group",
        "groups",
        "has_fit",
        "ids",
        "index",
        "interleave",
        "tpot",
        "tracked",
        "ttft",
    )

    def __init__(self, ids: Sequence[str], groups: Iterable[str] | None) -> None:
        n = len(ids)
        self.ids = ids
        self.groups = groups
        self.index: dict[str, list[int]] = {}
        for i, instance_id in enumerate(ids):
            self.index.setdefault(instance_id, []).append(i)
        self.ttft = np.ones(n)
        self.tpot = np.ones(n)
        self.interleave = np.zeros(n)
        self.coefs = np.zeros((n, NUM_COEFS))
        self.has_fit = np.zeros(n, dtype=bool)
        self.tracked = np.zeros(n, dtype=bool)
        #: Rows whose correction is their group's (too few samples of their own), or none.
        self.from_group: set[int] = set()

    def set(self, i: int, track: _Track | None) -> None:
        """Row ``i`` from ``track`` (None: the profile's)."""
        if track is None:
            self.ttft[i] = self.tpot[i] = 1.0
            self.interleave[i] = 0.0
            self.coefs[i] = 0.0
            self.has_fit[i] = self.tracked[i] = False
            return
        self.tracked[i] = True
        self.ttft[i] = track.ttft_factor
        self.tpot[i] = track.tpot_factor
        self.interleave[i] = track.interleave_ms
        if track.coefs is not None:
            self.coefs[i] = track.coefs
            self.has_fit[i] = True
        else:
            self.coefs[i] = 0.0
            self.has_fit[i] = False
