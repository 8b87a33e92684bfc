"""Aladdin's worker-count model (seed 001, Eq. 7), fitted online from observed load.

Above some arrival rate ``R`` the workers a best-fit packing keeps busy grow
linearly with the rate: ``N_w = ⌈k5·r + c5⌉``. The paper learns ``k5`` and
``c5`` from historical demand. Here they are fitted online by least squares
over heartbeat samples, each the arrival rate seen over one heartbeat and the
number of instances holding work then (the bins the packing has open), with
older samples decayed so a changed workload takes over.

``R``: a heartbeat with few requests does not represent the length
distribution (the paper measures it by the standard error of the mean of the
lengths, ``σ/√n``). A sample is used only when that error is at most
``max_relative_sem`` of the mean, i.e. when the heartbeat held at least
``(cv / max_relative_sem)²`` requests (``cv`` the coefficient of variation
of the lengths it saw); ``R`` is the lowest rate of a sample used, and the
model predicts nothing below it.

Pure and synchronous; ``slo-router plan`` feeds it from simulated runs
(:func:`samples_from_spans`), and the same object can be fed by a router.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

#: Weight a sample keeps after 256 more.
_DECAY = 0.5 ** (1 / 256)


@dataclass(frozen=True)
class Heartbeat:
    """One heartbeat of observed load: arrival rate (req/s), instances holding work, and how many
    requests arrived with what spread of lengths (for the SEM rule)."""

    rate: float
    workers: float
    requests: int
    length_cv: float


class WorkerCountModel:
    """``N_w = ⌈k5·r + c5⌉`` for ``r ≥ R``, by decayed least squares over accepted heartbeats."""

    def __init__(self, *, max_relative_sem: float = 0.1, min_samples: int = 4) -> None:
        if not (math.isfinite(max_relative_sem) and max_relative_sem > 0):
            raise ValueError(f"max_relative_sem must be a finite number > 0, got {max_relative_sem!r}")
        if min_samples < 2:
            raise ValueError(f"min_samples must be >= 2, got {min_samples}")
        self.max_relative_sem = max_relative_sem
        self.min_samples = min_samples
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.samples = 0
        self.rejected = 0
        self.lower_rate = math.inf

    def representative(self, beat: Heartbeat) -> bool:
        """Whether the heartbeat's requests represent the length distribution (SEM rule)."""
        if beat.requests < 1:
            return False
        return beat.length_cv / math.sqrt(beat.requests) <= self.max_relative_sem

    def observe(self, beat: Heartbeat) -> bool:
        """Add one heartbeat; False when the SEM rule leaves it out."""
        if not (math.isfinite(beat.rate) and math.isfinite(beat.workers)) or not self.representative(beat):
            self.rejected += 1
            return False
        d = _DECAY
        self._w = self._w * d + 1.0
        self._x = self._x * d + beat.rate
        self._y = self._y * d + beat.workers
        self._xx = self._xx * d + beat.rate * beat.rate
        self._xy = self._xy * d + beat.rate * beat.workers
        self.samples += 1
        self.lower_rate = min(self.lower_rate, beat.rate)
        return True

    def coefficients(self) -> tuple[float, float] | None:
        """``(k5, c5)``, or None before ``min_samples`` samples or without a spread of rates."""
        if self.samples < self.min_samples:
            return None
        w = self._w
        var = self._xx / w - (self._x / w) ** 2
        mean_x, mean_y = self._x / w, self._y / w
        if var <= 1e-12 * max(1.0, mean_x * mean_x):
            # One rate only: the line through the origin and the mean (workers proportional to load).
            return (mean_y / mean_x if mean_x > 0 else 0.0), 0.0
        k5 = (self._xy / w - mean_x * mean_y) / var
        return k5, mean_y - k5 * mean_x

    def predict(self, rate: float) -> int | None:
        """Workers at ``rate`` (at least 1), or None when unfitted or below ``R``."""
        fit = self.coefficients()
        if fit is None or not math.isfinite(rate) or rate < self.lower_rate:
            return None
        k5, c5 = fit
        return max(1, math.ceil(k5 * rate + c5 - 1e-9))


def samples_from_spans(
    arrivals_s: Sequence[float],
    lengths: Sequence[float],
    spans: Sequence[tuple[str, float, float]],
    *,
    heartbeat_s: float,
) -> list[Heartbeat]:
    """Heartbeats of a run: per window, its arrival rate, the instances holding work in it (time
    averaged over the window) and its requests' length spread.

    ``spans`` are (instance, start s, end s) of each request's service on an instance.
    """
    if not arrivals_s or heartbeat_s <= 0:
        return []
    end = max(max(arrivals_s), max((b for _, _, b in spans), default=0.0))
    windows = max(1, math.ceil(end / heartbeat_s))
    busy: list[dict[str, float]] = [{} for _ in range(windows)]
    for instance, a, b in spans:
        k = max(0, int(a // heartbeat_s))
        while k < windows and k * heartbeat_s < b:
            lo, hi = max(a, k * heartbeat_s), min(b, (k + 1) * heartbeat_s)
            if hi > lo:
                row = busy[k]
                row[instance] = row.get(instance, 0.0) + (hi - lo)
            k += 1
    counts = [0] * windows
    sums = [0.0] * windows
    squares = [0.0] * windows
    for t, n in zip(arrivals_s, lengths, strict=True):
        k = min(windows - 1, int(t // heartbeat_s))
        counts[k] += 1
        sums[k] += n
        squares[k] += n * n
    out = []
    last_arrival = max(arrivals_s)
    for k in range(windows):
        if (k + 1) * heartbeat_s > last_arrival:
            break  # the drain after the last arrival is not load at a rate
        c = counts[k]
        mean = sums[k] / c if c else 0.0
        var = max(squares[k] / c - mean * mean, 0.0) if c else 0.0
        cv = math.sqrt(var) / mean if mean > 0 else math.inf
        # Instances holding work: each counts for the share of the window it held some (a bin open).
        workers = sum(min(1.0, v / heartbeat_s) for v in busy[k].values())
        out.append(Heartbeat(c / heartbeat_s, workers, c, cv))
    return out
