"""How many instances a load needs: the throughput model of Aladdin's worker-count prediction (seed 001).

Pure arithmetic on a latency profile, used twice: ``slo-router plan`` starts
its simulator search from it, and the router exports it for the load it sees
(``slo_router_desired_instances{role=...}``) for an autoscaler.

Model, for an arrival rate ``λ`` (req/s) with mean prompt ``p`` and mean
output ``o`` tokens:

* a decoder runs a batch ``B`` whose step keeps the TPOT target at the packing
  horizon: the largest ``B`` with ``tpot(B, B·(p + γ·o)) ≤ θ·T`` (θ =
  ``tpot_binpack_threshold``, γ = ``tpot_packing_strictness``) and whose KV at
  the end of life fits, ``B·(p + o) ≤ headroom · kv_capacity`` (Aladdin's
  Eq. 6: throughput is limited by the SLO or by the KV, whichever binds
  first). It finishes ``B / (o · tpot(B, …))`` requests per second, so
  decoders = ``⌈λ · o · step / B⌉``;
* a prefill instance spends ``ttft(p)`` per request and is run at most at
  ``utilisation`` (queueing keeps TTFT in bounds), so prefill instances =
  ``⌈λ · ttft(p) / utilisation⌉``;
* a neutral instance does both, so neutral = ``⌈λ · (ttft(p)/utilisation +
  o · step / B)⌉``.

It is an estimate (no queueing beyond the utilisation cap, no length
spread); the simulator confirms and refines it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from predictor import LatencyPredictor

#: Largest decode batch the model considers.
MAX_BATCH = 1024


def _batch_bound(max_batch: float) -> int:
    """The batches the model tries: up to the engines' cap (at least 1), never past MAX_BATCH."""
    if not max_batch >= 1:
        return 1
    return int(min(max_batch, MAX_BATCH))


def median_seq_cap(caps: Sequence[float]) -> int:
    """The typical engine's sequence cap among those stated (0, ``inf`` and NaN: not stated); no cap
    (``MAX_BATCH``) when none is."""
    stated = sorted(c for c in caps if c > 0 and math.isfinite(c))
    return int(stated[len(stated) // 2]) if stated else MAX_BATCH


@dataclass(frozen=True)
class LoadShape:
    """The load: arrival rate (req/s) and mean prompt / output lengths (tokens)."""

    rate: float
    mean_prompt_tokens: float
    mean_output_tokens: float


@dataclass(frozen=True)
class InstanceEstimate:
    """Instances the model says a load needs, per role, and the decode batch it assumed."""

    prefill: int
    decode: int
    neutral: int
    decode_batch: int
    decode_step_ms: float


def decode_batch(
    predictor: LatencyPredictor,
    load: LoadShape,
    *,
    tpot_target_ms: float,
    strictness: float = 0.5,
    threshold: float = 0.85,
    kv_capacity_tokens: float = 65536.0,
    kv_headroom: float = 0.95,
    max_batch: int = MAX_BATCH,
) -> tuple[int, float]:
    """The largest batch meeting the TPOT target at the horizon and the KV over life, and its step (ms),
    at most ``max_batch`` (the engines' sequence cap: a decoder never runs more at once)."""
    p, o = load.mean_prompt_tokens, load.mean_output_tokens
    horizon = p + strictness * o
    life = p + o
    best = 1
    best_step = float(predictor.predict_tpot_ms(1.0, horizon))
    for b in range(2, _batch_bound(max_batch) + 1):
        if b * life > kv_headroom * kv_capacity_tokens:
            break
        step = float(predictor.predict_tpot_ms(float(b), b * horizon))
        if step > threshold * tpot_target_ms:
            break
        best, best_step = b, step
    return best, best_step


def role_demand(
    predictor: LatencyPredictor, load: LoadShape, batch: int, step_ms: float
) -> tuple[float, float]:
    """Instances kept busy by ``load``: (prefill, decode), at full utilisation, decode batches of ``batch``
    stepping ``step_ms`` (from :func:`decode_batch`)."""
    prefill_s = float(predictor.ttft_profile.grid(max(load.mean_prompt_tokens, 1.0))) / 1000.0
    decode_busy = load.rate * max(load.mean_output_tokens - 1.0, 0.0) * step_ms / 1000.0 / max(batch, 1)
    return load.rate * prefill_s, decode_busy


def estimate_instances(
    predictor: LatencyPredictor,
    load: LoadShape,
    *,
    tpot_target_ms: float,
    strictness: float = 0.5,
    threshold: float = 0.85,
    kv_capacity_tokens: float = 65536.0,
    kv_headroom: float = 0.95,
    utilisation: float = 0.8,
) -> InstanceEstimate:
    """The throughput model's instance counts for ``load`` (see the module doc); 0 for no load."""
    if not (load.rate >= 0 and math.isfinite(load.rate)):
        raise ValueError(f"rate must be a finite number >= 0, got {load.rate}")
    if not 0 < utilisation <= 1:
        raise ValueError(f"utilisation must be within (0, 1], got {utilisation}")
    if load.rate == 0:
        return InstanceEstimate(0, 0, 0, 0, 0.0)
    batch, step_ms = decode_batch(
        predictor,
        load,
        tpot_target_ms=tpot_target_ms,
        strictness=strictness,
        threshold=threshold,
        kv_capacity_tokens=kv_capacity_tokens,
        kv_headroom=kv_headroom,
    )
    prefill_busy, decode_busy = role_demand(predictor, load, batch, step_ms)
    prefill_busy /= utilisation
    return InstanceEstimate(
        prefill=max(1, math.ceil(prefill_busy)),
        decode=max(1, math.ceil(decode_busy)),
        neutral=max(1, math.ceil(prefill_busy + decode_busy)),
        decode_batch=batch,
        decode_step_ms=step_ms,
    )


@dataclass(frozen=True)
class InstanceRates:
    """What one instance serves per second at the SLO: prompt tokens (as a prefill instance) and
    output tokens (as a decoder), and the decode batch and step behind the second figure."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    decode_batch: int
    decode_step_ms: float
    #: The share of its time a prefill instance is taken to compute (``prefill_tokens_per_s`` is this
    #: share of its full-chunk rate): what :func:`prefill_staffing` divides back out.
    prefill_utilisation: float = 0.8


def fleet_instance_rates(
    predictor: LatencyPredictor,
    *,
    mean_prompt_tokens: float,
    mean_output_tokens: float,
    tpot_target_ms: float,
    kv_capacities: Sequence[int],
    chunk_budgets: Sequence[int],
    kv_headroom: float,
    seq_caps: Sequence[float] = (),
) -> InstanceRates:
    """:func:`instance_rates` of a fleet's typical instance: the median KV capacity, step budget and
    sequence cap of those that report one (the defaults, and no cap, where none does). The router's
    autoscaling signal and the simulator's both size instances this way."""
    kv = sorted(c for c in kv_capacities if c)
    chunks = sorted(c for c in chunk_budgets if c)
    return instance_rates(
        predictor,
        mean_prompt_tokens=mean_prompt_tokens,
        mean_output_tokens=mean_output_tokens,
        tpot_target_ms=tpot_target_ms,
        kv_capacity_tokens=float(kv[len(kv) // 2]) if kv else 65536.0,
        kv_headroom=kv_headroom,
        chunk_tokens=chunks[len(chunks) // 2] if chunks else 2048,
        max_batch=median_seq_cap(seq_caps),
    )


def instance_rates(
    predictor: LatencyPredictor,
    *,
    mean_prompt_tokens: float,
    mean_output_tokens: float,
    tpot_target_ms: float,
    kv_capacity_tokens: float = 65536.0,
    kv_headroom: float = 0.95,
    chunk_tokens: int = 2048,
    prefill_utilisation: float = 0.8,
    max_batch: int = MAX_BATCH,
) -> InstanceRates:
    """An instance's service rates for a load of these mean lengths, at the TPOT target.

    The fluid counterpart of :func:`decode_batch` that the autoscaling signal uses
    (:class:`router.core.worker_count.DesiredInstances`): where :func:`decode_batch` keeps the
    packing's margins (the TPOT projected to the packing horizon under ``threshold`` of the target,
    the KV at the end of every request's life), a fleet in steady state holds its requests at
    every point of their lives, so the KV a decoder holds on average is the prompt plus half the
    output, and its steps may take the whole target. Measured against ``slo-router plan`` those
    margins doubled the decoders a bimodal mix was said to need (issue 30).

    * prefill: a prefill instance with work queued runs full chunks of the engine's step budget,
      ``chunk_tokens / ttft(chunk_tokens)`` prompt tokens a second (a request's ``ttft(prompt)``
      alone would charge each prompt the step's fixed cost: 40-75 % too many prefill instances
      on chat at 24-36 req/s), at most ``prefill_utilisation`` of the time: the rest is the
      queueing the TTFT target absorbs (the utilisation cap of :func:`estimate_instances`);
    * decode: the batch ``B`` with the highest ``B / step(B)`` whose step at ``B`` requests of the
      mean-life context meets ``tpot_target_ms``, whose mean-life KV fits ``kv_headroom`` of
      the capacity, and which the engine runs at once (``max_batch``, its sequence cap).
    """
    if not 0 < prefill_utilisation <= 1:
        raise ValueError(f"prefill_utilisation must be within (0, 1], got {prefill_utilisation}")
    chunk = max(int(chunk_tokens), 1)
    prefill_ms = max(float(predictor.ttft_profile.grid(float(chunk))), 1e-6)
    context = max(mean_prompt_tokens + 0.5 * mean_output_tokens, 1.0)
    best_rate = 0.0
    best = 1
    best_step = max(float(predictor.predict_tpot_ms(1.0, context)), 1e-6)
    for b in range(1, _batch_bound(max_batch) + 1):
        if b > 1 and b * context > kv_headroom * kv_capacity_tokens:
            break
        step = max(float(predictor.predict_tpot_ms(float(b), b * context)), 1e-6)
        if b > 1 and step > tpot_target_ms:
            break
        if b / step > best_rate:
            best_rate, best, best_step = b / step, b, step
    return InstanceRates(
        prefill_tokens_per_s=prefill_utilisation * chunk / prefill_ms * 1000.0,
        decode_tokens_per_s=best_rate * 1000.0,
        decode_batch=best,
        decode_step_ms=best_step,
        prefill_utilisation=prefill_utilisation,
    )


def fluid_demand(load: LoadShape, rates: InstanceRates) -> tuple[float, float]:
    """Instances ``load`` keeps busy at ``rates``: (prefill, decode), fractional."""
    prefill = load.rate * load.mean_prompt_tokens / max(rates.prefill_tokens_per_s, 1e-9)
    decode = load.rate * load.mean_output_tokens / max(rates.decode_tokens_per_s, 1e-9)
    return prefill, decode


#: Prefill instances are staffed so that at most this share of prompts waits past the TTFT target's
#: budget (:func:`prefill_staffing`), the tail the decoders' staffing keeps too.
PREFILL_WAIT_TAIL = 0.05

#: The most prefill instances :func:`prefill_staffing` searches beyond the fluid demand.
MAX_PREFILL_SEARCH = 4096


def erlang_c(servers: int, offered: float) -> float:
    """The probability that an arrival waits in an M/M/c queue (Erlang's C formula), by the stable
    recursion of Erlang's B; 1 when ``offered >= servers`` (the queue grows without end)."""
    if servers < 1 or offered >= servers:
        return 1.0
    if offered <= 0:
        return 0.0
    b = 1.0
    for k in range(1, servers + 1):
        b = offered * b / (k + offered * b)
    return servers * b / (servers - offered * (1.0 - b))


def prefill_staffing(
    load: LoadShape,
    rates: InstanceRates,
    ttft_ms: float,
    kinds: Sequence[tuple[float, float, float]] = (),
) -> float:
    """Prefill instances ``load`` needs so that a prompt rarely waits past its TTFT target.

    :func:`fluid_demand` sizes the prefill side at ``rates.prefill_utilisation`` of its full-chunk
    rate, a cap that stands for the queueing the TTFT target absorbs. It does not depend on how
    many instances share the queue, and on few instances it is too loose: with two prefill
    instances at 79 % of their full rate (the Azure conversation trace at 9.8 req/s, 1,200-token
    prompts) a tenth of the prompts waited past the 1 s target and ``plan`` needed three. Here the
    prefill side is an M/M/c queue (Halfin and Whitt's regime, as :func:`decode_staffing` staffs
    the decoders): a prompt takes ``s`` = mean prompt over the full-chunk rate, the offered load is
    ``a = rate · s``, and it waits past ``t = ttft_ms − s`` with probability
    ``C(c, a) · exp(−(c − a) · t / s)`` (Erlang's C times the tail of the wait). The answer is the
    least ``c`` keeping that at :data:`PREFILL_WAIT_TAIL`, made fractional within ``(c − 1, c]``
    (or ``(a, c]``) by the log of the tail (its ceiling is that ``c``): Eq. 7 fits a line through
    the heartbeats, and whole steps would read as noise. With no TTFT target (``ttft_ms <= 0``) or
    a prompt that alone outlasts it, the fluid demand.

    The queue replaces the utilisation cap rather than adding to it: the cap stood for the waiting
    the TTFT target absorbs, which the queue now prices. Kept as a floor, it asked for an instance
    the target did not need (``slo-router plan`` with its default ``slo`` placement on the requests
    the signal reads, ``scripts/desired_vs_plan.py --window``): the Azure trace's last minute at
    16 req/s (14.2 req/s of 1,264-token prompts, ``a`` = 2.41) keeps the tail with 3 (3.7 % wait
    past 1 s; the plan there is 3 + 4 at 98.5 %), but 2.41 at 80 % is 3.02 instances, so the
    signal asked 4; chat at 32 req/s (``a`` = 2.67 of 622-token prompts, 3.34 at 80 %) asked 4
    where the plan is 3 + 6. A placement blind to TTFT (``load-balance``) queues prompts behind
    long ones on one instance and needs the fourth on the trace (3 + 4: 93.8 %): this model is
    the TTFT-aware placement's, a shared queue.

    ``kinds``: (share of the requests, mean prompt tokens, TTFT need ms) per kind of TTFT need. The
    router serves its queue by deadline (``edf``) and holds back a prompt no instance can start in
    time, so a prompt waits only behind those whose need is at most its own: each kind is priced
    as the queue of the kinds up to its need (their offered load and mean prompt) against its own
    budget, and the share that misses is those tails weighted by the kinds' shares (the
    non-preemptive priority queue). The servers, though, are busy with every kind: an engine
    finishes the prefill it started, chunk after chunk, before it admits the next prompt, so a
    summary placed a moment earlier holds its instance for its whole 450 ms whatever the deadline
    of the code prompt behind it. So a kind waits at all with the probability the whole load gives
    (Erlang's C of every kind's offered load), and then for the kinds up to its need ahead of it,
    drained as the servers free up (``c / s`` a second, ``s`` the whole load's mean prompt):
    ``C(c, a)·exp(−(c/s − λ_≤k)·t)``, the top kind's wait in the non-preemptive priority M/M/c
    with one service rate. Priced with the lower kinds' load left out of the servers (before),
    ``mixed`` at 5 req/s (seed 21) was staffed 0.92 prefill instances where ``plan`` needs 2
    (2 + 2: 96.0 %). Priced as one FCFS queue at the least need, a mix whose long
    prompts are patient was over-staffed: ``mixed`` at 16 req/s (summaries, a sixth of the
    requests with 40 % of the prompt tokens, need 3.75 s where chat and code need 1 s) staffed 4
    prefill instances where ``plan`` with the router queue needs 3 (3 + 5: 95.4 %); at 24 req/s 5
    where it needs 4. With no kinds, or one, the single queue at ``ttft_ms``.
    """
    fluid, _ = fluid_demand(load, rates)
    full = rates.prefill_tokens_per_s / max(rates.prefill_utilisation, 1e-9)
    if not (ttft_ms > 0 and load.rate > 0 and load.mean_prompt_tokens > 0 and full > 0):
        return fluid
    service_s = load.mean_prompt_tokens / full
    wait_s = ttft_ms / 1000.0 - service_s
    if wait_s <= 0 or not math.isfinite(wait_s):
        return fluid
    offered = load.rate * service_s
    groups = _deadline_groups(kinds, load, full)

    def one(servers: int, a: float, wait: float, service: float) -> float:
        if a >= servers:
            return 1.0
        return erlang_c(servers, a) * math.exp(-(servers - a) * max(wait, 0.0) / service)

    def ahead(servers: int, a: float, wait: float, service: float) -> float:
        # Whether a prompt waits at all is the whole load's (every kind takes servers), how long is
        # the queue of the kinds up to its need, drained as the servers free up (c / s of the whole
        # load a second): the non-preemptive priority M/M/c's wait, C(c, a)·exp(−(c·μ − λ_≤k)·t).
        busy = erlang_c(servers, offered) if offered < servers else 1.0
        drain = servers / service_s - a / service
        return busy * math.exp(-drain * max(wait, 0.0)) if drain > 0 else 1.0

    def tail(servers: int) -> float:
        if not groups:
            return one(servers, offered, wait_s, service_s)
        return sum(share * ahead(servers, a, wait, service) for share, a, wait, service in groups)

    least = max(1, math.floor(offered) + 1)
    servers = least
    for servers in range(least, least + MAX_PREFILL_SEARCH):
        if tail(servers) <= PREFILL_WAIT_TAIL:
            break
    # Fractional between the count below (or the offered load, where the queue never drains) and
    # ``servers``, by the log of the tail: a heartbeat's demand then moves with its rate rather than
    # by whole instances, which Eq. 7's line through the heartbeats would read as noise.
    below = servers - 1 if servers - 1 > offered else offered
    high = tail(servers - 1) if servers - 1 > offered else 1.0
    low = max(tail(servers), 1e-300)
    share = 1.0 if high <= low else math.log(high / PREFILL_WAIT_TAIL) / math.log(high / low)
    return below + min(max(share, 0.0), 1.0) * (servers - below)


def _deadline_groups(
    kinds: Sequence[tuple[float, float, float]], load: LoadShape, full_rate: float
) -> list[tuple[float, float, float, float]]:
    """Per kind of TTFT need, for :func:`prefill_staffing`: (its share of the requests, the offered
    load of the kinds up to its need, its wait budget, their mean service), in s. Empty with fewer
    than two usable kinds (the single queue then)."""
    usable = [
        (share, prompt, need)
        for share, prompt, need in kinds
        if share > 0 and prompt > 0 and need > 0 and math.isfinite(share + prompt + need)
    ]
    if len({need for _, _, need in usable}) < 2:
        return []
    total = sum(share for share, _, _ in usable)
    out: list[tuple[float, float, float, float, float]] = []
    for _, _, need in sorted(usable, key=lambda k: k[2]):
        if out and need == out[-1][4]:
            continue
        ahead = [(share / total, prompt) for share, prompt, k in usable if k <= need]
        share_ahead = sum(sh for sh, _ in ahead)
        service = sum(sh * prompt for sh, prompt in ahead) / share_ahead / full_rate
        own = sum(share for share, _, k in usable if k == need) / total
        out.append((own, load.rate * share_ahead * service, need / 1000.0 - service, service, need))
    return [(own, a, wait, service) for own, a, wait, service, _ in out]


#: Decoders are staffed so that a Poisson load's concurrency outruns them, for longer than a request
#: can wait, at most this often (the 95th percentile of a normal): see :func:`decode_staffing`.
DECODE_STAFFING_Z = 1.645


def _normal_tail(x: float) -> float:
    return 0.5 * math.erfc(x / math.sqrt(2.0))


def decode_staffing(
    decode_fluid: float, batch: float, z: float = DECODE_STAFFING_Z, *, slacks: Sequence[float] = ()
) -> float:
    """Decoders a load needs when its concurrency varies: ``(m + β·√m) / B``.

    ``decode_fluid`` is :func:`fluid_demand`'s decoders (``m / B``, with ``m``
    the mean number of requests decoding at once, by Little's law) and ``B``
    the batch one decoder keeps at the TPOT target. Under Poisson arrivals the
    number decoding at once varies by about ``√m``, and a decoder set sized
    for the mean is over its batch half the time (the square-root staffing rule
    of queueing; Aladdin's Eq. 7 carries it in ``c5``, the workers a load needs
    beyond proportion). The prefill side needs no term of its own: its queue
    absorbs the spread within the TTFT target (``prefill_utilisation``).

    ``slacks``: per request, the share of its decoding life it may spend waiting and still keep
    the pace it needs (Aladdin's ATGT): ``pace / step − 1``, with ``pace`` its TPOT target (or
    the pace its deadline leaves) and ``step`` the decoder's step at ``B``. A decoder whose batch
    is bounded by its KV rather than by the target steps faster than the target, and a request
    that arrives while every slot is taken waits for one (the engine's blocks, or the router
    queue) out of that saved time rather than missing. With ``β√m`` slots spare a delayed
    request waits about ``life / (β√m)`` on average (the square-root staffing regime), so it
    misses its pace with probability ``exp(−β·√m·slack)``. ``β`` is the least spare that keeps
    ``P(concurrency > slots) · mean(exp(−β·√m·slack))`` at the tail ``z`` stands for (5 %);
    with no slack (none given, or every request's pace already at the step), ``β = z``. Without
    the slack the Azure conversation trace at 8 req/s (KV-bound decoders stepping 42 ms against
    a 50 ms target) was staffed with 3 decoders where 2 meet 98 %; a mix whose code answers
    need the step's pace to meet their deadline keeps its margin.
    """
    if not (decode_fluid > 0 and batch > 0):
        return max(decode_fluid, 0.0)
    mean = decode_fluid * batch
    root = math.sqrt(mean)
    shares = [max(s, 0.0) if math.isfinite(s) else 0.0 for s in slacks] or [0.0]
    tail = _normal_tail(z)

    def miss(beta: float) -> float:
        return _normal_tail(beta) * sum(math.exp(-beta * root * s) for s in shares) / len(shares)

    lo, hi = 0.0, z
    for _ in range(40):  # the miss probability falls with β: bisect for the least β meeting the tail
        mid = 0.5 * (lo + hi)
        if miss(mid) <= tail:
            hi = mid
        else:
            lo = mid
    return (mean + hi * root) / batch


class LoadTracker:
    """The load the router has seen over the last ``window_s`` seconds, as a :class:`LoadShape`.

    ``observe`` each placed request (its prompt and expected output); ``shape``
    gives the arrival rate over the window (over the time since the first
    observation while that is shorter) and the mean lengths. Bounded: at most
    ``max_entries`` observations are kept (the oldest go first).
    """

    def __init__(self, window_s: float = 60.0, max_entries: int = 100_000) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.window_s = window_s
        self._entries: deque[tuple[float, int, int]] = deque(maxlen=max_entries)
        self._prompt = 0
        self._output = 0
        self._first_s: float | None = None

    def observe(self, now_s: float, prompt_tokens: int, output_tokens: int) -> None:
        if len(self._entries) == self._entries.maxlen:
            _, p, o = self._entries[0]
            self._prompt -= p
            self._output -= o
        self._entries.append((now_s, prompt_tokens, output_tokens))
        self._prompt += prompt_tokens
        self._output += output_tokens
        if self._first_s is None:
            self._first_s = now_s

    def __len__(self) -> int:
        """Observations held (those of the window as of the last :meth:`shape`)."""
        return len(self._entries)

    def _trim(self, now_s: float) -> None:
        horizon = now_s - self.window_s
        while self._entries and self._entries[0][0] <= horizon:
            _, p, o = self._entries.popleft()
            self._prompt -= p
            self._output -= o

    def shape(self, now_s: float) -> LoadShape:
        self._trim(now_s)
        n = len(self._entries)
        if n == 0 or self._first_s is None:
            return LoadShape(0.0, 0.0, 0.0)
        span = min(self.window_s, max(now_s - self._first_s, 1.0))
        return LoadShape(n / span, self._prompt / n, self._output / n)
