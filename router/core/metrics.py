"""The built-in metrics: one column per instance for the request being placed.

Notation: S = the instance's status, L = its in-flight sums (router's own
dispatches), M = its ``max_num_batched_tokens``, p = the request's prompt
tokens. Every metric counts the in-flight load on top of the status.

=========================  ==========================================================  =========
name                       value                                                       cached
=========================  ==========================================================  =========
prefill_backlog_tokens     S.num_uncomputed_prefill_tokens advanced to now by the      decision
                           step model (never below 0) + L prefill tokens
decode_batch_size          S.num_decode_requests + L decode requests                   load
decode_tokens              S.num_decode_tokens + L decode tokens                       load
kv_usage_projected         (S.num_used_kv_tokens + S.num_uncomputed_prefill_tokens     load
                           + L tokens) / kv_capacity_tokens (inf without capacity)
num_waiting_requests       S.num_waiting_requests + L requests                         load
num_requests               S.num_waiting_requests + S.num_running_requests             load
                           + L requests (a request counts once per instance)
decode_step_ms             predicted latency of one decode step at the current load    load
prompt_compute_tokens      p - c: the prompt tokens the instance would compute         decision
cached_prompt_tokens       c = the prompt's leading tokens the instance's prefix cache  decision
                           holds, as the router knows it (at most p - 1; 0 without
                           a prefix source or prefix hashes)
cache_affinity_tokens      c - median c over the schedulable instances (at least 0;    decision
                           0 everywhere when the load is imbalanced)
predicted_ttft             predict_ttft_ms(prefill_backlog_tokens + p - c,             decision
                           decode_batch_size, decode_tokens, M)
predicted_tpot             predict_tpot_ms(decode_batch_size + 1,                      decision
                           decode_tokens + p + o / 2)
reserved_prefill           1 for adaptive PD's reserved-prefill instance, else 0       decision
reserved_decode            1 for adaptive PD's reserved-decode instance, else 0        decision
=========================  ==========================================================  =========

Prefix caching: an engine computes only the part of a prompt its cache does
not hold, so ``predicted_ttft`` charges ``p - c`` at each instance (the status
backlog already counts only what the engine will compute, and the in-flight
prefill tokens only the uncached part of each dispatch). A hit therefore wins
the lowest-TTFT choice exactly when the tokens it saves outweigh the queue
in front of it, with no affinity weight. ``predicted_tpot`` still counts the
whole prompt: a cached prefix is context like any other.

The "+1" of ``predicted_tpot`` is the request being placed; metrics computed
without a request (``ctx.request is None``, e.g. for observability) add
neither it nor its tokens. Without a latency predictor the predictions are NaN
and the backlog is not advanced.

TPOT over the request's life: ``o`` is the request's expected output tokens
(else its ``max_tokens``, else 0). Its context grows from ``p`` to ``p + o``
while it decodes, so the step it sees on average carries ``o / 2`` more
context than at admission (the other requests of the batch are in steady
state: as many finish as join, their mean context stays).

Calibration (``PredictorSet.calibration``, :mod:`router.core.calibration`):
``predicted_ttft`` is the profile's times the instance's TTFT factor (or the
refit's chunk schedule), ``predicted_tpot`` the profile's times the TPOT
factor (or the refit's decode step) plus the prefill time that ran between
decode steps on that instance recently (colocated instances interleave later
requests' prefill chunks with this request's decode steps), and the backlog
advances at the calibrated speed.

Backlog advancement: the status was taken ``age`` ago; since then the engine
ran its backlog ``P0`` as ``P0 // M`` full chunks of ``ttft(M) + tpot(D, T)``
ms each and a last chunk ``r`` of ``ttft(r) + tpot(D, T)`` ms (D, T from the
status), progressing linearly within a chunk. The remaining backlog is what
that schedule has not finished at ``age``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from predictor import LatencyPredictor
from router.core.calibration import Correction
from router.core.columns import (
    INFLIGHT_ALL,
    INFLIGHT_DECODE_REQUESTS,
    INFLIGHT_DECODE_TOKENS,
    FloatArray,
    InstanceTable,
)
from router.core.config import SchedulerConfig
from router.core.plugins import DecisionContext, Metric, MetricScope
from router.core.predictors import PredictorSet
from router.core.prefix import cached_tokens_column
from router.core.registry import METRICS, Params


@dataclass(frozen=True, eq=False)
class _Column:
    """A metric computed by one function of the context.

    ``at`` (optional) computes the value at one instance without the whole
    column: it lets a load-scoped metric be updated at the few instances whose
    in-flight sums changed, and a decision read one instance's prediction
    cheaply. Only metrics whose column costs far more than one entry have one.
    """

    name: str
    scope: MetricScope
    fn: Callable[[DecisionContext], FloatArray]
    at: Callable[[DecisionContext, int], float] | None = None
    #: The in-flight columns (``INFLIGHT_*`` bits) a load-scoped value reads at its instance.
    inflight_columns: int = INFLIGHT_ALL

    def __post_init__(self) -> None:
        # Metrics are computed several times per decision: let ``compute`` be ``fn`` itself
        # (an instance attribute wins over the method below), saving a call each time; the same
        # for ``compute_at`` when there is a one-instance form.
        object.__setattr__(self, "compute", self.fn)
        if self.at is not None:
            object.__setattr__(self, "compute_at", self.at)

    def compute(self, ctx: DecisionContext) -> FloatArray:
        return self.fn(ctx)

    def compute_at(self, ctx: DecisionContext, index: int) -> float:
        return self.at(ctx, index) if self.at is not None else float(ctx.metric(self.name)[index])


_AT: dict[str, Callable[[DecisionContext, int], float]] = {}


def _register(
    name: str, scope: MetricScope, inflight_columns: int = INFLIGHT_ALL
) -> Callable[[Callable[[DecisionContext], FloatArray]], None]:
    """Register ``fn`` as metric ``name``; a one-instance version may be put in ``_AT[name]`` first.

    The one-instance version must return exactly what ``fn`` returns at that
    index (the same float operations in the same order). ``inflight_columns``
    names the in-flight columns a load-scoped value reads (see :class:`Metric`).
    """

    def decorator(fn: Callable[[DecisionContext], FloatArray]) -> None:
        def factory(config: SchedulerConfig, params: Params) -> Metric:
            return _Column(name, scope, fn, _AT.get(name), inflight_columns)

        METRICS.register(name)(factory)

    return decorator


def _at(
    name: str,
) -> Callable[[Callable[[DecisionContext, int], float]], Callable[[DecisionContext, int], float]]:
    def decorator(fn: Callable[[DecisionContext, int], float]) -> Callable[[DecisionContext, int], float]:
        _AT[name] = fn
        return fn

    return decorator


# 0-d operands: a ufunc resolves them faster than a Python float, with the same values.
_ZERO = np.array(0.0)
_ONE = np.array(1.0)


def _nan(ctx: DecisionContext) -> FloatArray:
    return np.full(ctx.view.n, np.nan)


def decision_correction(ctx: DecisionContext) -> Correction | None:
    """The calibration of the view's instances, or None (calibration off, or no samples yet).

    Looked up once per decision (several metrics and predictions ask). With calibration off
    there is nothing to look up or remember: the answer is None at once (two calls fewer each
    time, on every decision of a router without calibration).
    """
    predictors = ctx.predictors
    calibration = predictors.calibration if predictors is not None else None
    if calibration is None:
        return None
    found = ctx.cached(decision_correction)
    if found is None:
        table = ctx.view.instances
        found = calibration.correction(table.ids, table.groups) or _NO_CORRECTION
        ctx.remember(decision_correction, found)
    return None if found is _NO_CORRECTION else found


_NO_CORRECTION = object()


def _horizon_tokens(ctx: DecisionContext) -> float:
    """Context the request adds on average over its decode: half its expected output."""
    request = ctx.request
    if request is None:
        return 0.0
    expected = request.expected_output_tokens or request.max_tokens
    return 0.5 * float(expected)


# ----------------------------------------------------------------------------- load


@_at("decode_step_ms")
def _decode_step_ms_at(ctx: DecisionContext, i: int) -> float:
    if ctx.predictors is None:
        return float("nan")
    lp = ctx.predictors.for_group(ctx.view.instances.groups[i])
    return lp.tpot_ms_at(ctx.metric("decode_batch_size").item(i), ctx.metric("decode_tokens").item(i))


@_register("decode_batch_size", MetricScope.LOAD)
def _decode_batch_size(ctx: DecisionContext) -> FloatArray:
    return ctx.view.instances.decode_requests + ctx.view.inflight.decode_requests


@_register("decode_tokens", MetricScope.LOAD)
def _decode_tokens(ctx: DecisionContext) -> FloatArray:
    return ctx.view.instances.decode_tokens + ctx.view.inflight.decode_tokens


@_register("num_waiting_requests", MetricScope.LOAD)
def _num_waiting_requests(ctx: DecisionContext) -> FloatArray:
    return ctx.view.instances.waiting_requests + ctx.view.inflight.requests


@_register("num_requests", MetricScope.LOAD)
def _num_requests(ctx: DecisionContext) -> FloatArray:
    table = ctx.view.instances
    return table.waiting_requests + table.running_requests + ctx.view.inflight.requests


@_register("kv_usage_projected", MetricScope.LOAD)
def _kv_usage_projected(ctx: DecisionContext) -> FloatArray:
    table = ctx.view.instances
    used = table.used_kv_tokens + table.uncomputed_prefill_tokens + ctx.view.inflight.tokens
    return table.over_kv_capacity(used, np.inf)


@_register("decode_step_ms", MetricScope.LOAD, INFLIGHT_DECODE_REQUESTS | INFLIGHT_DECODE_TOKENS)
def _decode_step_ms(ctx: DecisionContext) -> FloatArray:
    if ctx.predictors is None:
        return _nan(ctx)
    return ctx.predictors.decode_step_ms(
        ctx.view.instances, ctx.metric("decode_batch_size"), ctx.metric("decode_tokens")
    )


#: Harmonic numbers H_0..H_4096 (``H[n] = 1 + 1/2 + ... + 1/n``): the expected order statistics of
#: memoryless remaining lengths in :func:`_slot_wait_ms`.
_HARMONIC = np.concatenate(([0.0], np.cumsum(1.0 / np.arange(1, 4097))))


@_register("slot_wait_ms", MetricScope.LOAD)
def _slot_wait_ms(ctx: DecisionContext) -> FloatArray:
    """How long a new request waits for a running slot before its prefill can start (ms).

    An engine runs at most ``max_num_seqs`` requests; the rest wait in its queue. A new request
    needs ``k = running + ahead + 1 - max_num_seqs`` completions first (``ahead``: the engine's
    waiting requests and the router's dispatches not yet admitted). The router knows only the
    mean of the running requests' remaining output (``R``: ``kv_growth_tokens`` over the ``s``
    running, from its learned length estimates), not which ends first, so it takes the remaining
    lengths as memoryless with that mean: the j-th completion among ``s`` comes after
    ``R·(H_s - H_{s-j})`` decode steps (``H`` the harmonic numbers; the first after ``R/s``, the
    last after ``R·H_s``, not ``R``), and each completion beyond the ``s`` running ones is a
    request admitted since, one per ``R / max_num_seqs`` steps. 0 where a slot is free or the cap
    is unknown. Spacing the completions evenly (``k·R/s``) left a TTFT bias of +68 to +120 % on
    two engines capped at 4 (``docs/real-traces.md``, "Capped engines"); this model, -4 to +3 %.
    """
    table = ctx.view.instances
    cap = table.max_num_seqs
    if cap is None or _uncapped(table):
        return _no_cache(table)  # (the table's shared read-only zeros)
    zero = np.zeros(table.n)
    need = table.running_requests + table.waiting_requests + ctx.view.inflight.requests + 1.0 - cap
    if not np.count_nonzero(need > 0):
        return zero
    batch = ctx.metric("decode_batch_size")
    running = np.clip(np.maximum(table.running_requests, batch), 1.0, np.maximum(cap, 1.0))
    remaining = np.maximum(ctx.metric("kv_growth_tokens") / np.maximum(batch, 1.0), 1.0)
    top = len(_HARMONIC) - 1
    s = np.minimum(running, top).astype(np.int64)
    first = np.minimum(np.maximum(need, 0.0), s).astype(np.int64)
    steps = remaining * (_HARMONIC[s] - _HARMONIC[s - first]) + np.maximum(
        need - s, 0.0
    ) * remaining / np.maximum(cap, 1.0)
    wait: FloatArray = np.where(need > 0, steps * ctx.metric("decode_step_ms"), 0.0)
    return wait


def _uncapped(table: InstanceTable) -> bool:
    """No instance of ``table`` states a ``max_num_seqs`` (kept with the table): no slot wait anywhere."""
    found: bool | None = table.memo.get("uncapped")
    if found is None:
        cap = table.max_num_seqs
        found = table.memo["uncapped"] = cap is None or not bool(np.isfinite(cap).any())
    return found


# ----------------------------------------------------------------------------- prefill backlog


@dataclass(frozen=True)
class _StepModel:
    """The schedule of the status backlogs, one entry per instance, in the status age's units.

    Times are in seconds of status age and rates in tokens per second of it,
    with the calibration's TTFT factor folded in (a slower engine runs its
    chunks longer), so that advancing to an age column is a few whole-column
    operations with no gather and no scatter. An instance without a backlog has
    zeros throughout, which advance it to zero.
    """

    backlog: FloatArray  # S.num_uncomputed_prefill_tokens less the tokens that take no time
    full_s: FloatArray  # age by which every full chunk has run
    full_rate: FloatArray  # tokens per second during the full chunks (0 when they take no time)
    tail_s: FloatArray  # how long the last partial chunk runs
    tail_rate: FloatArray


def _step_model(
    table: InstanceTable, predictors: PredictorSet, correction: Correction | None
) -> _StepModel | None:
    """The schedule for ``table`` under ``predictors`` and ``correction`` (None: no backlog anywhere).

    Kept with the table for the last calibration it was asked for (a refit makes a
    new :class:`Correction`; the decisions between two refits share one model).
    """
    key = ("step_model", predictors)
    found: tuple[Correction | None, _StepModel | None] | None = table.memo.get(key)
    if found is not None and found[0] is correction:
        return found[1]
    p0 = table.uncomputed_prefill_tokens
    has = p0 > 0
    if not np.count_nonzero(has):
        table.memo[key] = (correction, None)
        return None
    decode = predictors.decode_step_ms(table, table.decode_requests, table.decode_tokens)
    m = table.max_num_batched_tokens
    n_full = np.floor_divide(p0, m)
    rest = p0 - n_full * m
    tail_chunk = np.where(has & (rest > 0), predictors.prefill_step_ms(table, rest) + decode, 0.0)
    full_one = np.where(has, _full_chunk_ms(table, predictors) + decode, 0.0)
    instant = np.where(full_one > 0, 0.0, n_full * m) + np.where(tail_chunk > 0, 0.0, rest)
    # ms of engine time per second of age: 1000, or 1000 / factor on a slower engine.
    speed = np.full(table.n, 1000.0) if correction is None else 1000.0 / correction.ttft_factor
    zero = np.zeros(table.n)
    model = _StepModel(
        backlog=np.where(has, p0 - instant, 0.0),
        full_s=np.where(has, n_full * full_one / speed, 0.0),
        full_rate=np.divide(m * speed, full_one, out=zero.copy(), where=full_one > 0),
        tail_s=tail_chunk / speed,
        tail_rate=np.divide(rest * speed, tail_chunk, out=zero.copy(), where=tail_chunk > 0),
    )
    for column in (model.backlog, model.full_s, model.full_rate, model.tail_s, model.tail_rate):
        column.setflags(write=False)
    table.memo[key] = (correction, model)
    return model


def _full_chunk_ms(table: InstanceTable, predictors: PredictorSet) -> FloatArray:
    key = ("full_chunk_ms", predictors)
    found: FloatArray | None = table.memo.get(key)
    if found is None:
        found = predictors.prefill_step_ms(table, table.max_num_batched_tokens)
        table.memo[key] = found
    return found


def advanced_backlog(ctx: DecisionContext) -> FloatArray:
    """S.num_uncomputed_prefill_tokens advanced to ``now`` by the step model (see the module doc).

    It reads the snapshot's columns, the status ages and the calibration, not
    the request: the decisions of one router queue pass (the same view object,
    so the same age column) and the pass's fleet drain share one result, kept
    with the table for the last (ages, predictors, correction) it was asked
    for. Read-only (callers add to it into new arrays).
    """
    table = ctx.view.instances
    status_backlog = table.uncomputed_prefill_tokens
    predictors = ctx.predictors
    if predictors is None:
        return status_backlog
    correction = decision_correction(ctx)
    model = _step_model(table, predictors, correction)
    if model is None:
        return status_backlog
    ages = ctx.view.status_age_s
    found: tuple[FloatArray, _StepModel, FloatArray] | None = table.memo.get(_ADVANCED)
    if found is not None and found[0] is ages and found[1] is model:
        return found[2]
    out = _advance(model, ages)
    out.setflags(write=False)
    table.memo[_ADVANCED] = (ages, model, out)  # (the keys held: their ids stay theirs)
    return out


_ADVANCED = "advanced_backlog"


def _advance(model: _StepModel, ages: FloatArray) -> FloatArray:
    """What each backlog has left after ``ages``: full chunks, then the last chunk, then nothing.

    An instance without a status has an infinite age and no backlog: its entries
    are all zero, and so is what it has left (no ``inf * 0`` arises: each
    product takes a ``minimum`` with a zero first).
    """
    done = np.minimum(ages, model.full_s) * model.full_rate
    tail = np.maximum(ages - model.full_s, _ZERO)
    done += np.minimum(tail, model.tail_s, out=tail) * model.tail_rate
    np.subtract(model.backlog, done, out=done)
    return np.maximum(done, _ZERO, out=done)  # type: ignore[no-any-return]


@_register("prefill_backlog_tokens", MetricScope.DECISION)
def _prefill_backlog_tokens(ctx: DecisionContext) -> FloatArray:
    inflight = ctx.view.inflight
    backlog = advanced_backlog(ctx)
    return backlog + inflight.prefill_tokens if inflight.instances_with_entries else backlog


# ----------------------------------------------------------------------------- prefix cache


def _no_cache(table: InstanceTable) -> FloatArray:
    return table.constant(0.0)


@_register("cached_prompt_tokens", MetricScope.DECISION)
def _cached_prompt_tokens(ctx: DecisionContext) -> FloatArray:
    request, source = ctx.request, ctx.prefix
    table = ctx.view.instances
    if request is None or source is None or not request.prefix_hashes:
        return _no_cache(table)
    return cached_tokens_column(source, table.ids, table.index, request.prefix_hashes, request.prompt_tokens)


#: Pure cache affinity's load-imbalance guard (as SMG's and vLLM router's ``cache_aware``): when the
#: busiest schedulable instance holds more than this many requests over the least busy one and more
#: than this factor of it, the prompt goes by load alone.
AFFINITY_IMBALANCE_REQUESTS = 32.0
AFFINITY_IMBALANCE_FACTOR = 1.5


@_register("cache_affinity_tokens", MetricScope.DECISION)
def _cache_affinity_tokens(ctx: DecisionContext) -> FloatArray:
    """The cached prefix an instance holds *beyond* what most of the fleet holds (``c`` minus the
    median ``c`` over the schedulable instances, at least 0); 0 everywhere when the load is imbalanced
    (see :data:`AFFINITY_IMBALANCE_REQUESTS`). What pure cache affinity (``cache-affinity``) chases.

    Raw ``c`` makes affinity pile up: when every prompt starts with the same block (a system prompt,
    Mooncake's first block), the first instance to take one holds that block for every later prompt
    and takes them all. A prefix most instances hold gives no instance an edge, so the tie goes to
    load; and a prefix only a few hold stops attracting once their load runs away from the rest, as
    the peers' cache-aware policies do with their balance thresholds.
    """
    cached = ctx.metric("cached_prompt_tokens")
    table = ctx.view.instances
    live = table.schedulable
    if not cached.any() or not live.any():
        return cached
    load = ctx.metric("num_requests")[live]
    low, high = float(np.min(load)), float(np.max(load))
    if high - low > AFFINITY_IMBALANCE_REQUESTS and high > AFFINITY_IMBALANCE_FACTOR * low:
        return _no_cache(table)
    common = float(np.median(cached[live]))
    out: FloatArray = np.maximum(cached - common, 0.0)
    return out


@_register("prompt_compute_tokens", MetricScope.DECISION)
def _prompt_compute_tokens(ctx: DecisionContext) -> FloatArray:
    """``p - c``: the prompt tokens the instance would compute (``p`` everywhere without cache knowledge)."""
    prompt = _prompt_to_compute(ctx)
    if isinstance(prompt, float):
        return ctx.view.instances.constant(prompt)
    return prompt


def _prompt_to_compute(ctx: DecisionContext) -> float | FloatArray:
    """The prompt tokens each instance would compute: ``p`` (a scalar) without cache knowledge, else ``p - c``."""
    request = ctx.request
    if request is None or ctx.prefix is None or not request.prefix_hashes:
        return ctx.prompt_tokens
    return np.array(ctx.prompt_tokens) - ctx.metric("cached_prompt_tokens")  # (0-d: cheaper, the same)


# ----------------------------------------------------------------------------- predictions


def _predicted_ttft_at(ctx: DecisionContext, i: int) -> float:
    if ctx.predictors is None:
        return float("nan")
    table = ctx.view.instances
    lp = ctx.predictors.for_group(table.groups[i])
    request = ctx.request
    prompt = ctx.prompt_tokens
    if request is not None and ctx.prefix is not None and request.prefix_hashes:
        # ``_prompt_to_compute`` at one instance: the same subtraction, without the column's.
        prompt = prompt - ctx.metric("cached_prompt_tokens").item(i)
    backlog = ctx.metric("prefill_backlog_tokens").item(i) + prompt
    batch = ctx.metric("decode_batch_size").item(i)
    tokens = ctx.metric("decode_tokens").item(i)
    budget = table.max_num_batched_tokens.item(i)
    value = lp.ttft_ms_at(backlog, batch, tokens, budget)
    # No instance capped: the column is the table's zeros, so its entry is 0.0 without building it.
    wait = ctx.metric("slot_wait_ms").item(i) if not _uncapped(table) else 0.0
    correction = decision_correction(ctx)
    if correction is None:
        return value + wait
    # The one-instance form (exactly the column's entry) unless the column is at hand: on a new
    # snapshot the whole column would cost a vectorised profile lookup for one value.
    decode = ctx.metric_at("decode_step_ms", i)
    return correction.ttft_ms_at(i, value, backlog, batch, tokens, budget, decode) + wait


def _predicted_tpot_at(ctx: DecisionContext, i: int) -> float:
    if ctx.predictors is None:
        return float("nan")
    lp = ctx.predictors.for_group(ctx.view.instances.groups[i])
    extra = 1.0 if ctx.request is not None else 0.0
    batch = ctx.metric("decode_batch_size").item(i) + extra
    tokens = ctx.metric("decode_tokens").item(i) + ctx.prompt_tokens
    horizon = _horizon_tokens(ctx)
    if horizon > 0.0:
        tokens = tokens + horizon
    value = lp.tpot_ms_at(batch, tokens)
    correction = decision_correction(ctx)
    if correction is None:
        return value
    return correction.tpot_ms_at(i, value, batch, tokens)


_AT["predicted_ttft"] = _predicted_ttft_at
_AT["predicted_tpot"] = _predicted_tpot_at


@_register("predicted_ttft", MetricScope.DECISION)
def _predicted_ttft(ctx: DecisionContext) -> FloatArray:
    predictors = ctx.predictors
    if predictors is None:
        return _nan(ctx)
    table = ctx.view.instances
    prompt = _prompt_to_compute(ctx)
    # (A 0-d operand: a cheaper addition than with a Python float, the same sums.)
    backlog = ctx.metric("prefill_backlog_tokens") + (
        np.array(prompt) if isinstance(prompt, float) else prompt
    )
    step = ctx.metric("decode_step_ms")
    full_chunk = _full_chunk_ms(table, predictors)
    if ctx.prompt_tokens > 0:  # then every backlog is > 0: the leaner path gives the same values
        values = predictors.positive_chunked_prefill_ms(
            table, backlog, step, _full_step_ms(ctx, full_chunk, step)
        )
    else:
        values = predictors.chunked_prefill_ms(table, backlog, step, full_chunk)
    correction = decision_correction(ctx)
    if correction is not None:
        batch, tokens = ctx.metric("decode_batch_size"), ctx.metric("decode_tokens")
        values = correction.ttft_ms(
            values,
            backlog,
            batch,
            tokens,
            table.max_num_batched_tokens,
            step,
            _full_chunk_remainder(ctx, correction, batch, tokens),
        )
    if table.max_num_seqs is not None:
        # A full engine holds the request back until a running one finishes (see slot_wait_ms).
        wait = ctx.metric("slot_wait_ms")
        # (NaN counts as nonzero, as for .any(). No instance capped: the column is the table's
        # zeros, so there is nothing to count.)
        if not _uncapped(table) and np.count_nonzero(wait):
            values = values + wait
    return values


def _full_step_ms(ctx: DecisionContext, full_chunk: FloatArray, step: FloatArray) -> FloatArray:
    """``full_chunk + step`` (a step carrying a full chunk and the decode batch), kept with the load:
    both are the same objects for every decision on it."""
    memo = ctx.view.load_memo
    found: tuple[FloatArray, FloatArray, FloatArray] | None = memo.get(_FULL_STEP)
    if found is not None and found[0] is full_chunk and found[1] is step:
        return found[2]
    total = full_chunk + step
    memo[_FULL_STEP] = (full_chunk, step, total)  # (the keys held: their ids stay theirs)
    return total


_FULL_STEP = "full_step_ms"


def _full_chunk_remainder(
    ctx: DecisionContext, correction: Correction, batch: FloatArray, tokens: FloatArray
) -> FloatArray | None:
    """The refit's remainder of a full chunk (None without a refit), kept with the view's load.

    It reads the decode load and the calibration, not the request: every decision on the same
    load (the requests of one router queue pass) shares it.
    """
    if correction.coefs is None:
        return None
    memo = ctx.view.load_memo
    found: tuple[Correction, FloatArray, FloatArray, FloatArray] | None = memo.get(_FULL_REMAINDER)
    if found is not None and found[0] is correction and found[1] is batch and found[2] is tokens:
        return found[3]
    full = correction.full_chunk_remainder_ms(ctx.view.instances.max_num_batched_tokens, batch, tokens)
    memo[_FULL_REMAINDER] = (correction, batch, tokens, full)  # (the keys held: their ids stay theirs)
    return full


_FULL_REMAINDER = "refit_full_chunk_remainder"
_BATCH_CELLS = "predicted_tpot_batch_cells"


def decode_step_with_request_ms(
    ctx: DecisionContext, predictors: PredictorSet, tokens: FloatArray
) -> tuple[FloatArray, FloatArray]:
    """Per instance, the profile's decode step with this request in the batch, and that batch: at
    ``(decode_batch_size + 1, tokens)``, for ``tokens`` > 0 everywhere (not checked).

    The batch is then >= 1 and the context > 0, so the leaner busy path gives the values of
    ``predictors.decode_step_ms``. The batches with the request are the load's: they and their
    cells on the profile's batch axis are kept with the load (every decision on it, and each
    prediction of one decision at this batch, reads the same ones).
    """
    batch = ctx.metric("decode_batch_size")
    table = ctx.view.instances
    lp = predictors.only(table)
    if lp is None:
        with_request = batch + _ONE
        return predictors.busy_decode_step_ms(table, with_request, tokens), with_request
    memo = ctx.view.load_memo
    found: tuple[FloatArray, Any, FloatArray, Any] | None = memo.get(_BATCH_CELLS)
    if found is not None and found[0] is batch and found[1] is lp:
        with_request, cells = found[2], found[3]
    else:
        with_request = batch + _ONE
        cells = _updated_batch_cells(ctx, lp, with_request)
        if cells is None:
            cells = lp.decode_batch_cells(with_request)
        # The batches are handed to callers: read-only. The cells stay here and are only read
        # (``Grid2D.with_x_cells`` writes neither; tests/predictor/test_kernel_rewrites.py).
        with_request.setflags(write=False)
        memo[_BATCH_CELLS] = (batch, lp, with_request, cells)
    return lp.busy_decode_step_ms_cells(with_request, cells, tokens), with_request


def _updated_batch_cells(
    ctx: DecisionContext, lp: LatencyPredictor, with_request: FloatArray
) -> tuple[npt.NDArray[np.intp], FloatArray] | None:
    """The previous load's batch cells with the entries of the instances whose in-flight decode
    requests changed recomputed (None: no previous load's cells to start from).

    Elsewhere the batch is the previous load's (same snapshot, same in-flight decode requests),
    so its cell is too; at a changed instance ``Grid2D.x_cell_at`` gives what ``x_cells`` would.
    """
    previous = ctx.view.load_previous
    if previous is None:
        return None
    found: tuple[FloatArray, Any, FloatArray, Any] | None = previous.memo.get(_BATCH_CELLS)
    if found is None or found[1] is not lp:
        return None
    cell, weight = found[3][0].copy(), found[3][1].copy()
    grid = lp.tpot_profile.grid
    for i, mask in previous.changed.items():
        if mask & INFLIGHT_DECODE_REQUESTS:
            cell[i], weight[i] = grid.x_cell_at(with_request.item(i))
    return cell, weight


@_register("predicted_tpot", MetricScope.DECISION)
def _predicted_tpot(ctx: DecisionContext) -> FloatArray:
    predictors = ctx.predictors
    if predictors is None:
        return _nan(ctx)
    batch = ctx.metric("decode_batch_size")
    tokens = ctx.metric("decode_tokens")
    if ctx.request is not None:
        horizon = _horizon_tokens(ctx)
        # (0-d operands: cheaper additions than with Python floats, the same sums in the same order.)
        tokens = tokens + np.array(ctx.prompt_tokens)
        if horizon > 0.0:
            tokens += np.array(horizon)
        if ctx.prompt_tokens > 0:
            values, batch = decode_step_with_request_ms(ctx, predictors, tokens)
        else:
            batch = batch + _ONE
            values = predictors.decode_step_ms(ctx.view.instances, batch, tokens)
    else:
        values = predictors.decode_step_ms(ctx.view.instances, batch, tokens)
    correction = decision_correction(ctx)
    if correction is None:
        return values
    return correction.tpot_ms(values, batch, tokens)


@_at("predicted_tpot_after_slot_wait")
def _predicted_tpot_after_slot_wait_at(ctx: DecisionContext, i: int) -> float:
    # (A stage choice reads it at one instance: uncapped fleets pay only predicted_tpot's own.)
    tpot = ctx.metric_at("predicted_tpot", i)
    if ctx.request is None or _uncapped(ctx.view.instances):
        return tpot
    wait = ctx.metric("slot_wait_ms").item(i)
    if wait == 0.0:
        return tpot
    return tpot + wait / max(float(ctx.request.output_tokens_estimate) - 1.0, 1.0)


@_register("predicted_tpot_after_slot_wait", MetricScope.DECISION)
def _predicted_tpot_after_slot_wait(ctx: DecisionContext) -> FloatArray:
    """A decode leg's mean TPOT (ms) with its wait for a running slot spread over its answer.

    On a decoder the first token is already out (the prefill instance streamed it); a leg that finds
    the engine at ``max_num_seqs`` waits in its queue before its second token, and the client's mean
    TPOT (``(e2e - TTFT) / (output - 1)``) carries that wait divided by the tokens after the first.
    So the decode stage judges the TPOT target on ``predicted_tpot + slot_wait_ms / (expected - 1)``
    (``expected``: the learned length, else ``max_tokens``): a short wait on a long answer passes, as
    the engine queue will serve it in time, and a wait the answer cannot absorb does not, where a
    plain TPOT filter queued decode legs into full decoders past capacity (4-sequence decoders, chat
    at 3 req/s: 10 % met). Where no instance states a cap (or none is full) this is ``predicted_tpot``
    itself. A colocated instance's slot wait delays its prefill, so it is in ``predicted_ttft``, not
    here.
    """
    values = ctx.metric("predicted_tpot")
    if ctx.request is None or _uncapped(ctx.view.instances):  # (no cap stated: no slot wait anywhere)
        return values
    wait = ctx.metric("slot_wait_ms")
    if not np.count_nonzero(wait):
        return values
    spread: FloatArray = values + wait / max(float(ctx.request.output_tokens_estimate) - 1.0, 1.0)
    return spread


# ----------------------------------------------------------------------------- adaptive PD reserves


def _indicator(ctx: DecisionContext, index: int) -> FloatArray:
    # Reserves rarely change: one read-only column per reserved index and snapshot.
    table = ctx.view.instances
    if index < 0:
        return table.constant(0.0)
    key = ("indicator", index)
    out: FloatArray | None = table.memo.get(key)
    if out is None:
        out = np.zeros(table.n)
        if index >= 0:
            out[index] = 1.0
        out.setflags(write=False)
        table.memo[key] = out
    return out


@_register("reserved_prefill", MetricScope.DECISION)
def _reserved_prefill(ctx: DecisionContext) -> FloatArray:
    return _indicator(ctx, ctx.reserves.prefill)


@_register("reserved_decode", MetricScope.DECISION)
def _reserved_decode(ctx: DecisionContext) -> FloatArray:
    return _indicator(ctx, ctx.reserves.decode)
