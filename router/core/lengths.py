"""Online output-length prediction: what a router may know about how long an answer will be.

A client sends ``max_tokens`` (a cap), never the length of the answer it will get. Policies that
cost a request by its output (packing's KV peak, the ``sa`` planner's service time, adaptive PD's
placement, the in-flight resident legs) used to read the cap, or in the simulator the true length.
:class:`LengthPredictor` replaces both with what a router can learn honestly: the lengths of the
requests that have *finished*, grouped the way the source papers group them -- by SLO class and by
prompt length (answers to a one-line question and to a pasted document differ) -- and summarised
as a distribution, not a point: a mean (expected cost) and a high quantile (a cautious bound).

How an estimate is made. Completed lengths are kept per key (class, prompt-length bucket) in a
bounded window of the most recent :attr:`LengthConfig.window` samples (traffic drifts; old answers
should fade). An estimate uses the most specific key with at least
:attr:`LengthConfig.min_samples` samples: (class, bucket), then the class over all buckets, then
every class, and before anything has finished a prior: the request's own hint when the client
sent one, else ``max_tokens`` (the only figure a router has), else
:attr:`LengthConfig.default_tokens`. Every estimate is capped at the request's ``max_tokens`` (an
engine never generates past it).

:meth:`LengthPredictor.remaining` answers the question a running request poses: given it has
produced ``generated`` tokens already, how many more are expected? The mean of the window's
samples longer than ``generated``, minus ``generated`` (the conditional mean: a request that has
outlived the typical answer is probably a long one), at least one token.

Pure and deterministic: no clock, no randomness, no I/O; the same observations in the same order
give the same estimates. Bounded: at most :attr:`LengthConfig.max_keys` keys of
:attr:`LengthConfig.window` samples each; classes beyond the bound share one overflow key.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

#: Key of the class summary over all prompt buckets.
_ALL_BUCKETS = -1
#: Class name standing for every class (the global summary) and for classes past ``max_keys``.
_ANY_CLASS = "\x00any"
_OVERFLOW_CLASS = "\x00overflow"


@dataclass(frozen=True)
class LengthConfig:
    """Bounds and knobs of a :class:`LengthPredictor`."""

    #: Completed lengths kept per key (the most recent ones).
    window: int = 256
    #: Samples a key needs before its estimate is used (else the next coarser key answers).
    min_samples: int = 8
    #: The quantile reported beside the mean (a cautious bound for KV and deadline planning).
    quantile: float = 0.9
    #: Most (class, bucket) keys kept; classes beyond it share one overflow key.
    max_keys: int = 1024
    #: Prompt-length buckets are powers of two from this many tokens (shorter prompts share bucket 0).
    min_bucket_tokens: int = 64
    #: Number of prompt-length buckets (the last one takes every longer prompt).
    num_buckets: int = 10
    #: The estimate before anything finished, when the request gives no hint and no ``max_tokens``.
    default_tokens: int = 128

    def __post_init__(self) -> None:
        for name in (
            "window",
            "min_samples",
            "max_keys",
            "min_bucket_tokens",
            "num_buckets",
            "default_tokens",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LengthConfig.{name} must be an integer >= 1, got {value!r}")
        if self.min_samples > self.window:
            raise ValueError(
                f"LengthConfig.min_samples ({self.min_samples}) must not exceed window ({self.window})"
            )
        if not (isinstance(self.quantile, (int, float)) and 0.0 < self.quantile < 1.0):
            raise ValueError(f"LengthConfig.quantile must be in (0, 1), got {self.quantile!r}")


@dataclass(frozen=True)
class LengthEstimate:
    """What the predictor expects of one request's output, in tokens."""

    #: Expected length (>= 1): what a policy costs the request by.
    mean: float
    #: The configured quantile of the length (>= mean's floor): a cautious bound.
    quantile: float
    #: Samples the answer rests on (0: a prior, nothing learned yet).
    samples: int
    #: Which key answered: "class+bucket", "class", "all" or "prior".
    source: str = field(default="prior")

    @property
    def tokens(self) -> int:
        """The mean rounded to a whole token count (>= 1), what ``ScheduleInput.expected_output_tokens`` takes."""
        return max(1, round(self.mean))

    @property
    def bound_tokens(self) -> int:
        """The quantile rounded up to a whole token count, at least :attr:`tokens`: ``ScheduleInput.output_tokens_bound``."""
        return max(self.tokens, math.ceil(self.quantile))


class _Window:
    """The last ``size`` samples of one key, with their sum and a lazily sorted copy."""

    __slots__ = ("_sorted", "_suffix", "samples", "total")

    def __init__(self, size: int) -> None:
        self.samples: deque[int] = deque(maxlen=size)
        self.total = 0
        self._sorted: list[int] | None = None
        self._suffix: list[int] | None = None

    def add(self, value: int) -> None:
        if len(self.samples) == self.samples.maxlen:
            self.total -= self.samples[0]
        self.samples.append(value)
        self.total += value
        self._sorted = None
        self._suffix = None

    def ordered(self) -> list[int]:
        if self._sorted is None:
            self._sorted = sorted(self.samples)
        return self._sorted

    def quantile(self, q: float) -> float:
        ordered = self.ordered()
        # The smallest sample with at least a q share of the samples at or below it.
        k = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
        return float(ordered[k])

    def mean_above(self, generated: int) -> float | None:
        """Mean of the samples longer than ``generated`` (None: none is)."""
        ordered = self.ordered()
        lo = bisect.bisect_right(ordered, generated)
        if lo == len(ordered):
            return None
        return self.suffix_sums()[lo] / (len(ordered) - lo)

    def suffix_sums(self) -> list[int]:
        """``suffix[k] = sum(ordered[k:])``: the conditional mean in O(log n) per question."""
        if self._suffix is None:
            ordered = self.ordered()
            suffix = [0] * (len(ordered) + 1)
            for k in range(len(ordered) - 1, -1, -1):
                suffix[k] = suffix[k + 1] + ordered[k]
            self._suffix = suffix
        return self._suffix


class LengthPredictor:
    """Learns output lengths from completed requests; see the module docstring."""

    def __init__(self, config: LengthConfig | None = None) -> None:
        self.config = config or LengthConfig()
        self._windows: dict[tuple[str, int], _Window] = {}
        self._classes: set[str] = set()
        self.observed = 0

    # ------------------------------------------------------------------ keys

    def bucket(self, prompt_tokens: int) -> int:
        """The prompt-length bucket of a prompt: 0 below ``min_bucket_tokens``, then one per doubling."""
        c = self.config
        if prompt_tokens < c.min_bucket_tokens:
            return 0
        return min(c.num_buckets - 1, (prompt_tokens // c.min_bucket_tokens).bit_length())

    def _class_key(self, slo_class: str) -> str:
        if slo_class in self._classes:
            return slo_class
        # Each class takes up to num_buckets + 1 keys; the global summary takes one.
        per_class = self.config.num_buckets + 1
        if (len(self._classes) + 1) * per_class + 1 > self.config.max_keys:
            return _OVERFLOW_CLASS
        return slo_class

    def _window(self, key: tuple[str, int]) -> _Window:
        w = self._windows.get(key)
        if w is None:
            w = self._windows[key] = _Window(self.config.window)
        return w

    # ------------------------------------------------------------------ learning

    def observe(self, slo_class: str, prompt_tokens: int, output_tokens: int) -> None:
        """A request of ``slo_class`` with ``prompt_tokens`` finished after ``output_tokens`` tokens."""
        if output_tokens < 1:
            return  # nothing generated (failed before its first token): says nothing about lengths
        cls = self._class_key(slo_class)
        if cls != _OVERFLOW_CLASS:
            self._classes.add(cls)
        b = self.bucket(prompt_tokens)
        for key in ((cls, b), (cls, _ALL_BUCKETS), (_ANY_CLASS, _ALL_BUCKETS)):
            self._window(key).add(int(output_tokens))
        self.observed += 1

    # ------------------------------------------------------------------ estimates

    def _answer(self, slo_class: str, prompt_tokens: int) -> tuple[_Window, str] | None:
        return self._answer_bucket(slo_class, self.bucket(prompt_tokens))

    def _answer_bucket(self, slo_class: str, bucket: int) -> tuple[_Window, str] | None:
        cls = slo_class if slo_class in self._classes else self._class_key(slo_class)
        need = self.config.min_samples
        for key, source in (
            ((cls, bucket), "class+bucket"),
            ((cls, _ALL_BUCKETS), "class"),
            ((_ANY_CLASS, _ALL_BUCKETS), "all"),
        ):
            w = self._windows.get(key)
            if w is not None and len(w.samples) >= need:
                return w, source
        return None

    def estimate(
        self, slo_class: str, prompt_tokens: int, max_tokens: int = 0, hint: int = 0
    ) -> LengthEstimate:
        """Expected output of a new request (``max_tokens``/``hint``: 0 = not given)."""
        found = self._answer(slo_class, prompt_tokens)
        # (One estimate built, at the end: it is asked for once per placement.)
        if found is None:
            mean = quantile = float(hint or max_tokens or self.config.default_tokens)
            samples, source = 0, "prior"
        else:
            w, source = found
            samples = len(w.samples)
            mean, quantile = w.total / samples, w.quantile(self.config.quantile)
        if max_tokens > 0:
            cap = float(max_tokens)
            mean, quantile = min(mean, cap), min(quantile, cap)
        return LengthEstimate(max(mean, 1.0), max(quantile, 1.0), samples, source)

    def remaining(
        self, slo_class: str, prompt_tokens: int, generated: int, max_tokens: int = 0, hint: int = 0
    ) -> float:
        """Expected tokens still to come of a request that has produced ``generated`` and is still running (>= 1)."""
        generated = max(int(generated), 0)
        found = self._answer(slo_class, prompt_tokens)
        if found is None:
            total = float(hint or max_tokens or self.config.default_tokens)
        else:
            above = found[0].mean_above(generated)
            # Outlived every sample: expect it to go on about as long again as the longest seen.
            total = above if above is not None else 2.0 * max(found[0].ordered()[-1], generated)
        if max_tokens > 0:
            total = min(total, float(max_tokens))
        return max(total - generated, 1.0)

    def censored_bound(
        self, slo_class: str, prompt_tokens: int, reached: Sequence[float], max_tokens: int = 0
    ) -> int:
        """The :attr:`LengthConfig.quantile` of the class's output with its running answers counted
        as lower bounds (``reached``: the tokens each has produced so far; Kaplan–Meier,
        :func:`censored_distribution`), at least the finished answers' own quantile; 0 when the class
        has no finished answer of its own, or too few for an estimate and none running.

        The finished answers alone are the short ones while the class's long answers still run
        (the first minutes of a run whose answers take tens of seconds): their quantile is biased
        short, and a policy pacing a deadline by it under-provisions the long answers. Only a
        caller asking for it pays the estimate (``binpack``'s deadline pace).
        """
        found = self._answer(slo_class, prompt_tokens)
        if found is None or found[1] == "all":
            # Too few of the class's own answers have finished for an estimate: its finished ones
            # and its running ones together, once one has finished and one runs.
            own = self._windows.get((slo_class, _ALL_BUCKETS))
            if own is None or not own.samples or not reached:
                return 0
            found = (own, "class")
        window = found[0]
        cap = float(max_tokens) if max_tokens > 0 else math.inf
        plain = window.quantile(self.config.quantile)
        if not reached:
            value = plain
        else:
            dist = censored_distribution(list(window.samples), [float(r) for r in reached], cap)
            value = max(plain, dist.quantile(self.config.quantile))
        if max_tokens > 0:
            value = min(value, float(max_tokens))
        return max(1, math.ceil(value))

    def remaining_many(
        self,
        slo_classes: Sequence[str],
        buckets: Sequence[int],
        generated: Sequence[int],
        max_tokens: Sequence[int],
    ) -> list[float]:
        """:meth:`remaining` of many running requests at once (no hints), the same values.

        ``buckets``: each request's :meth:`bucket` of its prompt (a caller asking about the same
        requests again and again computes it once). A status push re-estimates every resident
        leg of an instance; looking each key's window up once per call instead of once per leg
        is most of the saving (the simulator asks this for every leg of every instance it refreshes).
        """
        out: list[float] = []
        found: dict[tuple[str, int], tuple[list[int], list[int]] | None] = {}
        default = float(self.config.default_tokens)
        bisect_right = bisect.bisect_right
        for cls, b, gen, cap in zip(slo_classes, buckets, generated, max_tokens, strict=True):
            key = (cls, b)
            if key in found:
                answer = found[key]
            else:
                window = self._answer_bucket(cls, b)
                answer = None if window is None else (window[0].ordered(), window[0].suffix_sums())
                found[key] = answer
            if gen < 0:
                gen = 0
            if answer is None:
                total = float(cap or default)
            else:
                ordered, suffix = answer
                lo = bisect_right(ordered, gen)
                if lo == len(ordered):
                    total = 2.0 * max(ordered[-1], gen)
                else:
                    total = suffix[lo] / (len(ordered) - lo)
            if cap > 0 and total > cap:
                total = float(cap)
            rest = total - gen
            out.append(rest if rest > 1.0 else 1.0)
        return out

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Per class (all buckets): samples, mean and quantile, for reports."""
        out: dict[str, dict[str, float]] = {}
        for (cls, b), w in sorted(self._windows.items()):
            if b != _ALL_BUCKETS or not w.samples:
                continue
            name = "*" if cls == _ANY_CLASS else ("(overflow)" if cls == _OVERFLOW_CLASS else cls)
            n = len(w.samples)
            out[name] = {"samples": n, "mean": w.total / n, "quantile": w.quantile(self.config.quantile)}
        return out


@dataclass(frozen=True)
class LengthDistribution:
    """A length distribution as point masses (ascending values), with conditional moments.

    Built by :func:`censored_distribution`. ``values[k]`` carries ``masses[k]`` (the masses sum to
    1); a tail piece spread uniformly over an interval is one point at its middle whose spread is
    kept in ``spreads[k]`` (its variance), so the moments stay exact.
    """

    values: tuple[float, ...]
    masses: tuple[float, ...]
    spreads: tuple[float, ...]
    #: Suffix sums from k on: mass, mass x value, mass x (value^2 + spread).
    _m0: tuple[float, ...] = field(repr=False, default=())
    _m1: tuple[float, ...] = field(repr=False, default=())
    _m2: tuple[float, ...] = field(repr=False, default=())

    @classmethod
    def of(
        cls, values: Sequence[float], masses: Sequence[float], spreads: Sequence[float]
    ) -> LengthDistribution:
        n = len(values)
        m0 = [0.0] * (n + 1)
        m1 = [0.0] * (n + 1)
        m2 = [0.0] * (n + 1)
        for k in range(n - 1, -1, -1):
            w, v = masses[k], values[k]
            m0[k] = m0[k + 1] + w
            m1[k] = m1[k + 1] + w * v
            m2[k] = m2[k + 1] + w * (v * v + spreads[k])
        return cls(tuple(values), tuple(masses), tuple(spreads), tuple(m0), tuple(m1), tuple(m2))

    def moments(self) -> tuple[float, float]:
        """(mean, standard deviation)."""
        return self.given(-math.inf)

    def quantile(self, q: float) -> float:
        """The smallest point with at least a ``q`` share of the mass at or below it (a tail piece
        at its middle)."""
        total = 0.0
        for value, mass in zip(self.values, self.masses, strict=True):
            total += mass
            if total >= q - 1e-12:
                return value
        return self.values[-1] if self.values else 0.0

    def given(self, reached: float, cap: float = math.inf) -> tuple[float, float]:
        """(mean, standard deviation) of a length known to exceed ``reached`` (a running request).

        Past every point of the distribution, the rule of :func:`censored_distribution`'s tail:
        uniform from ``reached`` to three times it, at most ``cap``.
        """
        k = bisect.bisect_right(self.values, reached)
        mass = self._m0[k] if k < len(self.values) else 0.0
        if mass <= 1e-12:
            lo = max(reached, 0.0)
            hi = max(min(3.0 * lo, cap), lo)
            return (lo + hi) / 2.0, (hi - lo) / math.sqrt(12.0)
        mean = self._m1[k] / mass
        return mean, math.sqrt(max(self._m2[k] / mass - mean * mean, 0.0))


def censored_distribution(
    events: Sequence[float], censored: Sequence[float], cap: float
) -> LengthDistribution:
    """A length distribution from finished samples and lower bounds (Kaplan–Meier).

    ``events``: lengths of requests that have finished. ``censored``: requests still running, each
    as the length it has reached (its true length is larger). ``cap``: the largest length possible
    (``max_tokens``, or 1.0 for fractions of it). Learning from finished requests alone is biased
    short whenever requests started together (the first wave of a run, a burst): the short ones end
    first, and a policy sized by them over-commits. The product-limit estimator counts each running
    request as at risk up to the length it reached, which removes that bias without waiting for the
    long ones to end.

    The survival mass left past the last finished sample (only when the longest observations are
    still running) is shared equally by the running requests beyond it, each spread uniformly from
    the length it reached to three times it (at most ``cap``): with nothing known past that point,
    a request seen at a random moment of its life is expected to run about as long again as it has.
    Raises ``ValueError`` with no observation at all.
    """
    if not events and not censored:
        raise ValueError("censored_distribution needs at least one observation")
    # Events sort before censored values at a tie (a request running at v has not ended at v).
    obs = sorted([(float(v), 0) for v in events] + [(float(c), 1) for c in censored])
    n = len(obs)
    at_risk = n
    survival = 1.0
    points: list[tuple[float, float, float]] = []  # (value, mass, spread)
    k = 0
    while k < n:
        value, kind = obs[k]
        if kind == 1:
            at_risk -= 1
            k += 1
            continue
        d = 1
        while k + d < n and obs[k + d] == (value, 0):
            d += 1
        mass = survival * d / at_risk
        points.append((value, mass, 0.0))
        survival -= mass
        at_risk -= d
        k += d
    if survival > 1e-12:
        last_event = max(events, default=-math.inf)
        tail = [float(c) for c in censored if c >= last_event]
        share = survival / len(tail)
        for c in tail:
            lo = min(max(c, 0.0), cap)
            hi = min(max(3.0 * lo, lo), cap)
            points.append(((lo + hi) / 2.0, share, (hi - lo) ** 2 / 12.0))
    points.sort()
    return LengthDistribution.of([p[0] for p in points], [p[1] for p in points], [p[2] for p in points])


def censored_moments(events: Sequence[float], censored: Sequence[float], cap: float) -> tuple[float, float]:
    """Mean and standard deviation of :func:`censored_distribution` (the same arguments)."""
    return censored_distribution(events, censored, cap).moments()
