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
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist

from router.core.capacity import (
    InstanceRates,
    LoadShape,
    decode_staffing,
    erlang_c,
    fluid_demand,
    prefill_staffing,
)
from router.core.lengths import LengthConfig

#: Samples after which a sample's weight has halved (the default decay).
HALF_LIFE = 256


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

    def __init__(
        self,
        *,
        max_relative_sem: float = 0.1,
        min_samples: int = 4,
        min_rate_spread: float = 0.0,
        half_life: int = HALF_LIFE,
    ) -> None:
        if not (math.isfinite(max_relative_sem) and max_relative_sem > 0):
            raise ValueError(f"max_relative_sem must be a finite number > 0, got {max_relative_sem!r}")
        if min_samples < 2:
            raise ValueError(f"min_samples must be >= 2, got {min_samples}")
        if not (math.isfinite(min_rate_spread) and min_rate_spread >= 0):
            raise ValueError(f"min_rate_spread must be a finite number >= 0, got {min_rate_spread!r}")
        if half_life < 1:
            raise ValueError(f"half_life must be >= 1, got {half_life}")
        self.max_relative_sem = max_relative_sem
        self.min_samples = min_samples
        self._decay = 0.5 ** (1 / half_life)
        #: Below this coefficient of variation of the sampled rates the fit is proportional (c5 = 0).
        self.min_rate_spread = min_rate_spread
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
        d = self._decay
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
        if var <= (self.min_rate_spread * mean_x) ** 2 + 1e-12:
            # One rate only, or rates too close for a slope (a steady load's heartbeats differ by
            # their Poisson noise, and a slope fitted to noise can come out negative): the line
            # through the origin and the mean, workers proportional to load.
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


# --------------------------------------------------------------------------- the autoscaling signal


#: Kinds of target (TPOT target, e2e target) a heartbeat keeps apart for the decode margin; the
#: requests of further kinds count toward the rate and lengths only.
MAX_TARGET_KINDS = 64


def least_slack(
    kinds: Mapping[tuple[float, float], tuple[float, ...]],
    rates: InstanceRates,
    default_tpot_ms: float,
) -> float:
    """The share of its decoding life the least patient kind of request can wait and keep its pace
    (``decode_staffing``'s slack), at the decoder's step.

    ``kinds`` maps (TPOT target, e2e target), 0 where unset, to (requests, prompt tokens, paced
    output tokens) summed over the heartbeat. A kind's pace is its TPOT target, or what its
    deadline leaves per token of its paced answer after the prefill of its mean prompt (the prompt
    over what a prefill instance computes a second), or the default target. The paced answer is
    the length the router paces a deadline by, the tail of the length estimate
    (``LengthEstimate.bound_tokens``; ``packing_tpot_target_ms``): answers longer than the mean
    must finish in time too. Each class is judged on its own, so the margin protects the kind
    with the least time to spare, as constraint (b) holds an instance's batch to the least need
    of the requests it holds: averaged over requests, a patient majority (chat stepping 42 ms
    against 50) hid a tight minority (code answers whose 4 s deadline leaves about 24 ms a token
    at the tail of their length) and ``mixed`` at 16 req/s was sized at 3 decoders where ``plan``
    needs 4.
    """
    step = rates.decode_step_ms
    if not (step > 0 and math.isfinite(step)) or not kinds:
        return 0.0
    least = math.inf
    for (tpot, e2e), (n, prompt, output, *_) in kinds.items():
        if n <= 0:
            continue
        if tpot > 0:
            pace = tpot
        elif e2e > 0:
            prefill_ms = 1000.0 * (prompt / n) / max(rates.prefill_tokens_per_s, 1e-9)
            pace = (e2e - prefill_ms) / max(output / n - 1.0, 1.0)
        else:
            pace = default_tpot_ms
        least = min(least, pace / step - 1.0)
    return max(least, 0.0) if math.isfinite(least) else 0.0


def second_moment_ratio(mean: float, quantile_tokens: float, z: float) -> float:
    """``E[o²] / E[o]²`` of an answer whose expected length is ``mean`` and whose length estimate
    puts the quantile of normal score ``z`` at ``quantile_tokens`` (the router's cautious bound,
    ``LengthEstimate.bound_tokens``), lengths taken as lognormal (the answer lengths of the
    workloads and traces here are): ``q / mean = exp(z·σ − σ²/2)`` gives ``σ``, and the ratio is
    ``exp(σ²)``. 1 where the estimate has no spread (a prior, exact lengths); ``σ`` at most ``z``
    (the widest spread that quantile can say)."""
    sigma = lognormal_sigma(mean, quantile_tokens, z)
    return math.exp(sigma * sigma)


def lognormal_sigma(mean: float, quantile_tokens: float, z: float) -> float:
    """``σ`` of a lognormal length whose mean is ``mean`` and whose quantile of normal score ``z``
    is ``quantile_tokens`` (``q / mean = exp(z·σ − σ²/2)``, the smaller root); 0 where the
    estimate has no spread, at most ``z``."""
    if not (mean > 0 and quantile_tokens > mean and z > 0):
        return 0.0
    log_ratio = math.log(quantile_tokens / mean)
    return z - math.sqrt(z * z - 2.0 * log_ratio) if 2.0 * log_ratio < z * z else z


#: The share of a heartbeat's requests the decoders may let miss their deadline by the length of
#: their answer (:func:`deadline_decoders`): the tail the prefill and decode staffing keep too.
DEADLINE_MISS_SHARE = 0.05


def deadline_miss_share(
    kinds: Mapping[tuple[float, float], tuple[float, ...]],
    requests: float,
    step_ms: float,
    z: float,
    first_tokens: Callable[[float, float], Sequence[float]] | None = None,
) -> float:
    """The share of ``requests`` expected to miss an end-to-end deadline by their answer's length
    on decoders stepping ``step_ms``.

    ``kinds`` as :meth:`DesiredInstances.observe` keeps them: (TPOT target, e2e target) ->
    (requests, prompt tokens, paced output tokens, expected output tokens, TTFT need ms), summed.
    A kind judged end to end (no TPOT target) decodes for what its deadline leaves after its
    first token: an answer longer than ``(e2e − first token) / step + 1`` tokens misses. The first
    token's time is taken at the points ``first_tokens(mean prompt, mean need)`` gives (equally
    likely: quantiles of the prefill queue's wait, :func:`first_token_points`), or at the TTFT
    need without it. Lengths are lognormal, the mean and spread from the router's length
    estimate (the expected length and its high quantile, ``LengthEstimate.bound_tokens``)."""
    if not (requests > 0 and step_ms > 0 and math.isfinite(step_ms)):
        return 0.0
    missed = 0.0
    for (tpot, e2e), value in kinds.items():
        if tpot > 0 or e2e <= 0 or len(value) < 5 or value[0] <= 0:
            continue
        n, prompt, paced, expected, need = value[:5]
        mean, bound = expected / n, paced / n
        sigma = lognormal_sigma(mean, bound, z)
        median = mean * math.exp(-0.5 * sigma * sigma)
        points = list(first_tokens(prompt / n, need / n)) if first_tokens is not None else [need / n]
        share = 0.0
        for first in points:
            longest = (e2e - first) / step_ms + 1.0
            if not longest > 1.0:
                share += 1.0
            elif sigma <= 0:
                share += 1.0 if mean > longest else 0.0
            else:
                share += 0.5 * math.erfc(math.log(longest / median) / sigma / math.sqrt(2.0))
        missed += n * share / max(len(points), 1)
    return missed / requests


#: Quantile points :func:`first_token_points` gives a kind's first-token time at.
FIRST_TOKEN_POINTS = 8


def first_token_points(
    prompt_tokens: float,
    need_ms: float,
    *,
    load: LoadShape,
    rates: InstanceRates,
    servers: int,
    ttft_kinds: Sequence[tuple[float, float, float]],
    points: int = FIRST_TOKEN_POINTS,
) -> list[float]:
    """A prompt's first-token time (ms) at ``points`` equally likely quantiles, on ``servers``
    prefill instances: its own prefill at the full-chunk rate plus its wait in an M/M/c queue of
    every kind's prompts (a wait of 0 with probability ``1 − C(c, a)``, else exponential of mean
    ``s / (c − a)``), at most ``need_ms``.

    Every kind's prompts, first come first served: the router places a prompt at once where an
    instance can start it in time, and the engine computes what it was given in arrival order, so
    a code prompt waits behind the summaries placed before it. (``capacity.prefill_staffing``
    orders the kinds by deadline, the router queue's order, to staff the prefill side; priced
    that way here, code prompts at ``mixed`` 12 req/s on 2 prefill instances were given first
    tokens of 150-330 ms where the simulator's median is 509 ms and its 90th percentile 791.)
    At most the need: a prompt waiting past it is a miss of the prefill side, which is staffed
    for that tail, not one the decoders could avoid. ``ttft_kinds``: (requests, mean prompt
    tokens, need ms) per kind of need; empty: the load's mean prompt."""
    full = rates.prefill_tokens_per_s / max(rates.prefill_utilisation, 1e-9)
    if not (full > 0 and load.rate > 0):
        return [need_ms]
    own = 1000.0 * prompt_tokens / full
    usable = [(n, p) for n, p, _ in ttft_kinds if n > 0 and p > 0]
    if usable:
        count = sum(n for n, _ in usable)
        service = sum(n * p for n, p in usable) / count / full
        offered = load.rate * service
    else:
        service = load.mean_prompt_tokens / full
        offered = load.rate * service
    if servers < 1 or offered >= servers or service <= 0:
        return [need_ms] * points if need_ms > 0 else [math.inf] * points
    waits = erlang_c(servers, offered)
    mean_wait = 1000.0 * service / (servers - offered)
    out = []
    for i in range(points):
        u = (i + 0.5) / points
        wait = 0.0 if u <= 1.0 - waits else mean_wait * math.log(waits / (1.0 - u))
        out.append(min(own + wait, need_ms) if need_ms > 0 else own + wait)
    return out


def _per_kind(
    first_tokens: Callable[[float, float], Sequence[float]],
) -> Callable[[float, float], Sequence[float]]:
    """``first_tokens``, each (mean prompt, mean need) computed once."""
    found: dict[tuple[float, float], Sequence[float]] = {}

    def points(prompt: float, need: float) -> Sequence[float]:
        key = (prompt, need)
        value = found.get(key)
        if value is None:
            value = found[key] = list(first_tokens(prompt, need))
        return value

    return points


def deadline_decoders(
    kinds: Mapping[tuple[float, float], tuple[float, ...]],
    requests: float,
    load: LoadShape,
    rates: Callable[[float], InstanceRates],
    tpot_ms: float,
    z: float,
    first_tokens: Callable[[float, float], Sequence[float]] | None = None,
    allowance: float = DEADLINE_MISS_SHARE,
) -> float:
    """Decoders (fractional) whose step keeps the deadline-judged answers' misses within
    ``allowance`` of the requests; 0 where the TPOT target's step already does, or where even an
    idle decoder cannot (a lost cause: more decoders would not save those answers).

    Aladdin's constraint (b) holds each request to its own ATGT; a request judged end to end has
    as its ATGT what its deadline leaves per token, so a decoder's batch is bounded by the step
    its deadline-judged residents need, not only by the TPOT target. That step depends on the
    answer's length, which varies: the slowest step at which the expected misses
    (:func:`deadline_miss_share`) stay within ``allowance`` is found by bisection, and the decoders
    are the load's fluid demand at the batch stepping that fast (``rates(step)``: the instance's
    rates at that step as its target). Fluid, with no square-root spare
    (:func:`capacity.decode_staffing`): a deadline is kept by the mean step over an answer's life,
    which a moment of a larger batch slows by little, where a TPOT target is missed by it.
    """
    if not any(e2e > 0 and tpot <= 0 for tpot, e2e in kinds) or load.rate <= 0:
        return 0.0
    if first_tokens is not None:
        # A kind's first-token points do not depend on the step: found once, not at every probe.
        first_tokens = _per_kind(first_tokens)
    at_target = rates(tpot_ms)
    if deadline_miss_share(kinds, requests, at_target.decode_step_ms, z, first_tokens) <= allowance:
        return 0.0
    idle = rates(0.0)
    if deadline_miss_share(kinds, requests, idle.decode_step_ms, z, first_tokens) > allowance:
        return 0.0
    lo, hi = idle.decode_step_ms, at_target.decode_step_ms
    for _ in range(24):
        mid = 0.5 * (lo + hi)
        if deadline_miss_share(kinds, requests, mid, z, first_tokens) <= allowance:
            lo = mid
        else:
            hi = mid
    return fluid_demand(load, rates(lo))[1]


#: Rates an instance serves for a load shape and a TPOT target (ms): see ``capacity.instance_rates``.
RatesFn = Callable[[LoadShape, float], InstanceRates]


@dataclass(frozen=True)
class Desired:
    """Instances per role the load needs (what ``slo_router_desired_instances`` exports).

    ``fitted`` says whether Eq. 7 answered (fitted, and the rate at or above its ``R``); otherwise
    the counts are the staffing of the last window's heartbeats pooled (too few requests in each for
    the SEM rule, enough together: :meth:`DesiredInstances.desired`), else the fluid demand of the
    last window's load, rounded up.
    """

    prefill: int
    decode: int
    neutral: int
    fitted: bool
    #: Heartbeats Eq. 7 was fitted on, and those the SEM rule (or unlearned lengths) left out.
    heartbeats: int = 0
    left_out: int = 0


class DesiredInstances:
    """Aladdin's Eq. 7 per role, fitted online from the load a router places.

    Adapted to a router: Aladdin counts the bins its best-fit packing opens; a router running
    another policy has no such count (an idle instance under ``slo`` still holds a request or
    two), so a heartbeat's "workers" per role is the load's fluid demand instead, the bins a
    perfect packing of that heartbeat's work would fill: the prompt tokens that arrived over the
    prompt tokens a prefill instance computes in the heartbeat, and the output tokens they are
    expected to generate (the router's learned length estimate, never the true length) over
    what a decoder generates at the TPOT target (:func:`router.core.capacity.instance_rates`),
    decoders staffed for the spread of a Poisson load's concurrency
    (:func:`router.core.capacity.decode_staffing`: sized for the mean, mixed at 16 req/s was
    3 decoders where ``plan`` needs 4), and at least as many as keep the steps the deadline-judged
    answers need (:func:`deadline_decoders`: priced at the TPOT target's batch alone, ``mixed``
    at 16, 20 and 24 req/s was one decoder short of ``plan``, and a half-code mix at 10 req/s
    two of three).
    Each role's ``(rate, workers)`` samples feed a :class:`WorkerCountModel` (decayed least
    squares, the SEM rule); :meth:`desired` evaluates ``⌈k5·r + c5⌉`` at the rate of the last
    window. A heartbeat in which more than a tenth of the requests had no learned length yet
    (the prior, ``max_tokens``) is left out: it would charge the warm-up's caps as load. The fit
    forgets at ``half_life`` heartbeats (a minute by default, the window the rate is read over):
    Aladdin fits on history, but the lengths a router learns early are those of the answers that
    finished first, the short ones, and a workload changes.

    Pure and synchronous; bounded (one open heartbeat, three running sums per role).
    """

    def __init__(
        self,
        rates: RatesFn,
        *,
        heartbeat_s: float = 10.0,
        default_tpot_ms: float = 50.0,
        default_ttft_ms: float = 0.0,
        max_relative_sem: float = 0.1,
        min_samples: int = 4,
        min_rate_spread: float = 0.25,
        half_life: int = 6,
        length_quantile: float = LengthConfig().quantile,
    ) -> None:
        if not (math.isfinite(heartbeat_s) and heartbeat_s > 0):
            raise ValueError(f"heartbeat_s must be a finite number > 0, got {heartbeat_s!r}")
        if not (math.isfinite(default_tpot_ms) and default_tpot_ms > 0):
            raise ValueError(f"default_tpot_ms must be a finite number > 0, got {default_tpot_ms!r}")
        if not 0.5 < length_quantile < 1:
            raise ValueError(f"length_quantile must be within (0.5, 1), got {length_quantile!r}")
        self._rates = rates
        self.heartbeat_s = heartbeat_s
        #: The normal score of the quantile ``paced_tokens`` are (the router's length bound).
        self._z = NormalDist().inv_cdf(length_quantile)
        self.default_tpot_ms = default_tpot_ms
        #: The TTFT target of a request that reports none and has no e2e target (0: no prefill
        #: staffing for it, the fluid demand alone).
        self.default_ttft_ms = default_ttft_ms if math.isfinite(default_ttft_ms) else 0.0
        self.models = {
            role: WorkerCountModel(
                max_relative_sem=max_relative_sem,
                min_samples=min_samples,
                min_rate_spread=min_rate_spread,
                half_life=half_life,
            )
            for role in ("prefill", "decode", "neutral")
        }
        self.max_relative_sem = max_relative_sem
        #: The last ``half_life`` heartbeats whose lengths were learned: (rate, prefill, decode,
        #: requests, Σ length, Σ length²), for the answer below ``R`` (:meth:`desired`).
        self._recent: deque[tuple[float, float, float, int, float, float]] = deque(maxlen=half_life)
        self._beat: int | None = None
        self._reset()

    def _reset(self) -> None:
        self._n = 0
        self._unlearned = 0
        self._prompt = 0.0
        self._output = 0.0
        # Σ over the heartbeat's requests of their expected output times the context they hold on
        # average while decoding (``prompt + E[o²] / (2·E[o])``): the length-biased resident context.
        self._resident = 0.0
        self._len = 0.0
        self._len2 = 0.0
        self._tpot = math.inf
        self._ttft = math.inf
        # (TPOT target, e2e target) -> (requests, prompt tokens, paced output tokens, expected output
        # tokens, TTFT need ms), summed: the decode margin (least_slack) and the deadline's step.
        self._kinds: dict[tuple[float, float], tuple[float, float, float, float, float]] = {}
        # TTFT need (ms) -> (requests, prompt tokens): the router queue serves by deadline.
        self._ttft_kinds: dict[float, tuple[int, float]] = {}

    def observe(
        self,
        now_s: float,
        prompt_tokens: int,
        output_tokens: float,
        *,
        learned: bool = True,
        tpot_ms: float = 0.0,
        e2e_ms: float = 0.0,
        paced_tokens: float = 0.0,
        ttft_ms: float = 0.0,
    ) -> None:
        """One placed request: its prompt, its expected output (``learned``: from finished requests,
        not the prior), its TPOT target and its end-to-end target (0: none; with neither, the
        default TPOT target applies), the answer length its deadline is paced by (the router's
        tail of the length estimate; 0: the expected output), and its TTFT target (0: none; a
        request judged end to end needs its first token within a quarter of its deadline, as
        ``packing.ttft_need_ms`` places it; with neither, ``default_ttft_ms``)."""
        self._advance(now_s)
        self._n += 1
        self._unlearned += 0 if learned else 1
        self._prompt += prompt_tokens
        self._output += output_tokens
        spread = second_moment_ratio(output_tokens, paced_tokens, self._z)
        self._resident += output_tokens * (prompt_tokens + 0.5 * output_tokens * spread)
        length = float(prompt_tokens) + float(output_tokens)
        self._len += length
        self._len2 += length * length
        if tpot_ms > 0:
            self._tpot = min(self._tpot, tpot_ms)
        need = ttft_ms if ttft_ms > 0 else e2e_ms / 4.0 if e2e_ms > 0 else self.default_ttft_ms
        if need > 0 and math.isfinite(need):
            self._ttft = min(self._ttft, need)
            held = self._ttft_kinds.get(need)
            if held is not None or len(self._ttft_kinds) < MAX_TARGET_KINDS:
                count, tokens = held or (0, 0.0)
                self._ttft_kinds[need] = (count + 1, tokens + prompt_tokens)
        kind = (max(tpot_ms, 0.0), max(e2e_ms, 0.0))
        seen = self._kinds.get(kind)
        if seen is not None or len(self._kinds) < MAX_TARGET_KINDS:
            n, prompt, output, expected, needs = seen or (0, 0.0, 0.0, 0.0, 0.0)
            self._kinds[kind] = (
                n + 1,
                prompt + prompt_tokens,
                output + max(paced_tokens, output_tokens),
                expected + output_tokens,
                needs + (need if need > 0 and math.isfinite(need) else 0.0),
            )

    def _advance(self, now_s: float) -> None:
        beat = int(now_s // self.heartbeat_s) if math.isfinite(now_s) else 0
        if self._beat is None:
            self._beat = beat
        elif beat > self._beat:
            self._close()
            self._beat = beat
            self._reset()

    def _close(self) -> None:
        n = self._n
        if n == 0:
            return
        shape = LoadShape(n / self.heartbeat_s, self._prompt / n, self._output / n)
        mean = self._len / n
        cv = math.sqrt(max(self._len2 / n - mean * mean, 0.0)) / mean if mean > 0 else math.inf
        if self._unlearned > 0.1 * n:
            cv = math.inf  # not representative: the SEM rule leaves it out
        tpot = self._tpot if math.isfinite(self._tpot) else self.default_tpot_ms
        # A decoder's batch is of the requests decoding now, and a request decodes for as long as
        # its answer, so long answers are over-represented among those present (Little's law, per
        # request): their mean context is ``Σ o·(p + o/2) / Σ o``, with ``E[o²]`` from the length
        # estimate's spread (:func:`second_moment_ratio`), not ``p̄ + ō/2``. A batch's step and
        # KV are priced at it (``instance_rates`` takes the context as ``prompt + output / 2``: the
        # prompt it is given is the one that makes it so; the prefill side does not depend on it).
        # Priced at ``p̄ + ō/2``, chat's lognormal answers (σ 0.8: the resident context 15 % more)
        # were one decoder short at 32 req/s (3 + 5 where ``plan`` needs 3 + 6), and
        # ``interactive-batch``'s bimodal answers at 12 req/s (1 + 3: 74.9 %, 113 preemptions,
        # where ``plan`` needs 1 + 4).
        resident = self._resident / self._output if self._output > 0 else 0.0
        held = (
            LoadShape(
                shape.rate, max(resident - 0.5 * shape.mean_output_tokens, 0.0), shape.mean_output_tokens
            )
            if resident > 0
            else shape
        )
        rates = self._rates(held, tpot)
        _, decode = fluid_demand(shape, rates)
        # The prefill side staffed for the least patient TTFT of the heartbeat (capacity.prefill_staffing).
        least_ttft = self._ttft if math.isfinite(self._ttft) else 0.0
        ttft_kinds = [
            (float(count), tokens / count, need)
            for need, (count, tokens) in self._ttft_kinds.items()
            if count
        ]
        prefill = prefill_staffing(shape, rates, least_ttft, ttft_kinds)
        decode = decode_staffing(
            decode, rates.decode_batch, slacks=[least_slack(self._kinds, rates, self.default_tpot_ms)]
        )
        servers = max(1, math.ceil(prefill - 1e-9))

        def first_tokens(prompt: float, need: float) -> list[float]:
            return first_token_points(
                prompt, need, load=shape, rates=rates, servers=servers, ttft_kinds=ttft_kinds
            )

        decode = max(
            decode,
            deadline_decoders(
                self._kinds, n, held, lambda step: self._rates(held, step), tpot, self._z, first_tokens
            ),
        )
        for role, workers in (("prefill", prefill), ("decode", decode), ("neutral", prefill + decode)):
            self.models[role].observe(Heartbeat(shape.rate, workers, n, cv))
        if math.isfinite(cv):
            self._recent.append((shape.rate, prefill, decode, n, self._len, self._len2))

    def pooled(self, rate: float) -> tuple[int, int, int] | None:
        """(prefill, decode, neutral) at ``rate`` from the last heartbeats pooled, or None with fewer
        of them than Eq. 7 is fitted on (``min_samples``) or when even together their requests do
        not represent the length distribution (the SEM rule over their union).

        Each heartbeat's staffing is priced from its own requests (each kind's TTFT need and
        deadline, the resident context), so pooled they say what the window's load needs per
        req/s: ``⌈Σ workers / Σ rate · rate⌉``, Eq. 7's proportional line through them. The SEM
        rule is about how many requests a sample holds; a heartbeat of 50 requests of ``mixed``
        (lengths varying with ``cv`` ≈ 1.2) is too few alone, six together are not."""
        beats = list(self._recent)
        if len(beats) < self.models["decode"].min_samples:
            return None  # as few heartbeats as Eq. 7 would not be fitted on
        count = sum(b[3] for b in beats)
        rates = sum(b[0] for b in beats)
        if count < 1 or rates <= 0:
            return None
        mean = sum(b[4] for b in beats) / count
        var = max(sum(b[5] for b in beats) / count - mean * mean, 0.0)
        cv = math.sqrt(var) / mean if mean > 0 else math.inf
        if not cv / math.sqrt(count) <= self.max_relative_sem:
            return None
        prefill = sum(b[1] for b in beats) / rates * rate
        decode = sum(b[2] for b in beats) / rates * rate
        return (
            max(1, math.ceil(prefill - 1e-9)),
            max(1, math.ceil(decode - 1e-9)),
            max(1, math.ceil(prefill + decode - 1e-9)),
        )

    def desired(self, now_s: float, load: LoadShape) -> Desired:
        """Instances per role for ``load`` (the last window's: its rate and mean lengths)."""
        self._advance(now_s)
        if load.rate <= 0:
            return Desired(0, 0, 0, False)
        fits = {role: m.predict(load.rate) for role, m in self.models.items()}
        model = self.models["decode"]
        if all(v is not None for v in fits.values()):
            # Eq. 7's line alone, per role. The last window's own load, staffed by the prefill queue
            # (``capacity.prefill_staffing``), is not a floor under it: that floor answered a plan
            # made without the router queue (the Azure conversation trace's last minute at 12 req/s
            # then needed 3 prefill instances, a prompt no instance could start in time being
            # refused); with the queue the router runs, the plan there is 2 + 3 (96.2 %) and the
            # floor asked 3 + 3. Near a step of the queue model (two instances at 80 % of their
            # full rate) the staffing's ceiling decides the floor, and the model's M/M/c tail is
            # the cautious side there: it prices 9.0 % of the prompts past 1 s where the simulator
            # puts 3.6 % of them (everything included) and an FCFS queue of the same prompts on the
            # trace's own arrivals 6.1 %. The line, fitted through a minute of heartbeats, reads
            # the load at the rate rather than at one window's ceiling: 2 there, and at ``mixed``
            # 24 req/s 4 (the floor: 5; plan 4 + 6).
            return Desired(
                int(fits["prefill"] or 0),
                int(fits["decode"] or 0),
                int(fits["neutral"] or 0),
                True,
                model.samples,
                model.rejected,
            )
        pooled = self.pooled(load.rate)
        if pooled is not None:
            # Below R (the SEM rule left every heartbeat out, each too small) but a minute of them
            # together represents the load: their staffing, each kind priced for its own need.
            # Before, the last window's fluid demand against the default TTFT target alone:
            # ``mixed`` at 5 req/s (seed 21) asked 1 prefill instance, where summaries' 3,300-token
            # prompts ahead of code and chat in one engine's queue need a second (plan 2 + 2).
            p, d, both = pooled
            return Desired(p, d, both, False, model.samples, model.rejected)
        rates = self._rates(load, self.default_tpot_ms)
        _, decode = fluid_demand(load, rates)
        prefill = prefill_staffing(load, rates, self.default_ttft_ms)
        decode = decode_staffing(decode, rates.decode_batch)
        return Desired(
            max(1, math.ceil(prefill - 1e-9)),
            max(1, math.ceil(decode - 1e-9)),
            max(1, math.ceil(prefill + decode - 1e-9)),
            False,
            model.samples,
            model.rejected,
        )
