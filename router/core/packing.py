"""Packing that keeps its promises: KV and TPOT over a request's life, best-fit placement, a safety valve.

Bin-packing decode (adaptive PD, the ``binpack`` policy) concentrates requests
on few instances. Checked only at admission, a packed decoder later runs out
of KV as its requests grow, preempts, and recomputes whole contexts as prefill
steps that stall every co-resident decode. The metrics here look at the whole
life of the requests an instance holds, after Aladdin's placement model (seed
001: decode step time linear in batch and context, the γ strictness knob, the
KV footprint over each request's life, best fit by ``capacity_norm``).

Notation as in :mod:`router.core.metrics` (S status, L in-flight sums), plus R
= the router's *resident* tally of the instance (decode legs it placed there
whose request has not ended: count and the tokens their KV reaches at the end,
see :mod:`router.core.inflight`), n = S.num_decode_requests + L decode legs,
γ = ``tpot_packing_strictness``, ``out`` = the request's expected output
(:func:`expected_output_tokens`), ``o`` = ``packing_default_output_tokens``.

=========================  ==========================================================  =========
name                       value                                                       cached
=========================  ==========================================================  =========
kv_growth_tokens           tokens the resident decode requests will still add to       load
                           the KV (see below)
kv_peak_projected          (S.used_kv + S.uncomputed_prefill + L tokens                decision
                           + kv_growth_tokens + p + out) / kv_capacity_tokens
kv_life_tokens             the KV peak (tokens) over the life of the instance's        load
                           requests, exact from each leg's progress (see "KV peak")
kv_peak_exact              (kv_life_tokens + p + out) / kv_capacity_tokens             decision
decode_tokens_horizon      S.decode_tokens + L decode tokens + γ·kv_growth_tokens      load
predicted_tpot_horizon     predict_tpot_ms(n + 1, decode_tokens_horizon + p + γ·out)   decision
predicted_tpot_own         predicted_tpot for a request with a TTFT or TPOT target;    decision
                           for one judged by its e2e deadline alone (binpack, a
                           colocated fleet with an empty instance) predicted_tpot ×
                           target / its deadline's pace, else 0
predicted_tpot_residents   0 where n = 0, else predicted_tpot + prefill_stall_ms /     decision
                           max(kv_growth_tokens / n, 1) (see below)
capacity_norm              ‖(n / binpack_max_batch, decode_tokens_horizon /            load
                           kv_capacity_tokens)‖₂
capacity_norm_life         ‖(n / binpack_max_batch, kv_life_tokens /                   load
                           kv_capacity_tokens)‖₂
overpacked                 1 when the instance's measured decode step exceeds          decision
                           tpot target × overpacked_tpot_factor, or it is preempting
                           (without a preemption report: its KV is at least 99 %
                           used), else 0
=========================  ==========================================================  =========

Growth. The statuses report only sums (decode requests, their context
tokens), not each request's expected length, so the growth is taken from the
router's resident tally: ``R.tokens − (context of those requests)``. When R
covers every decode request (``R.requests ≥ n``) their context is
``S.decode_tokens + L.decode_tokens``; otherwise the covered share of it,
and each uncovered request adds ``o``. Adapted from Aladdin's KV constraint,
which sums per-request footprint vectors over future iterations: the sum here
is the value of that vector at the worst iteration when every request is
still alive (all finishing together), an upper bound of its peak that needs
no per-request state from the statuses.

KV peak (adaptive PD). When the view carries every resident leg's progress
(:class:`~router.core.columns.ResidentLegs`: the router's account updates each
leg's context as it forwards the tokens, the simulator reads its engines),
``kv_life_tokens`` is the peak exact for expected lengths: with K =
S.used_kv + S.uncomputed_prefill + L tokens, the part of it the legs do not
hold stays (``K − Σ context``, never below 0: a leg whose prefill is done may
still wait in its engine's queue for blocks, its context not in S.used_kv
yet), each decode request the legs do not cover adds ``o`` and stays,
the legs that decode already add their :func:`kv_peak_tokens`, and the legs
not started yet and the new request (whose decoding starts after their
prefill and KV transfer, a delay nobody knows) add their final length each.
Without the legs (peer router processes publish only sums): K +
kv_growth_tokens, every resident at its final length at once, which is never
below the exact peak. Adaptive PD's decode, ``binpack``'s (e) and ``slo``
hold ``kv_peak_exact`` in every pass; ``slo``'s first pass also keeps
``kv_peak_projected``, whose slack leaves room for answers longer than
predicted (docs/results.md, ``slo`` keeps its KV promise).

Horizon. Aladdin bounds ``Σ(l_in + γ·l_out)`` by the context the TPOT target
allows at the batch size; with the same sums, each resident request is taken
γ of the way through its remaining output (and the new one γ through its
whole output).

Residents of a colocated instance. A neutral instance runs prefill chunks
between the decode steps of the requests it holds, so a prompt placed there
slows every one of them, not just by joining their batch: the prompts
queued in its engine (``prefill_backlog_tokens``) and this one run as chunks
(``prefill_stall_ms``: the prefill part of each chunk step) before they see
many more tokens. ``predicted_tpot_residents`` spreads that stall over the
residents' mean remaining output (the growth above, per decode request),
on top of their decode step with the new request in the batch
(``predicted_tpot``, which carries the measured interleaving of prompts yet
to come). Dividing by the *remaining* output rather than the whole is the
cautious side: a resident halfway through spreads the stall over twice as
many gaps. The ``slo`` policy keeps it below the default TPOT target on its
neutral stage (seed 003's TPOT filter, applied to the requests already
there as well as to the new one).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from router.core.columns import BoolArray, FloatArray, InstanceTable, IntArray, ResidentLegs
from router.core.config import SchedulerConfig
from router.core.lengths import LengthConfig
from router.core.metrics import advanced_backlog, decision_correction, decode_step_with_request_ms
from router.core.plugins import DecisionContext, Metric, MetricScope
from router.core.registry import METRICS, Params
from router.core.request import Role, ScheduleInput

#: Decode-idle instances with prefill room that must remain for adaptive PD to open another decoder
#: (one more than the drain rule's zero: a hysteresis, so instances do not flip role back and forth).
OPEN_MARGIN = 2
#: A slot wait (ms) at or above which an engine is at its sequence cap (0 exactly where a slot is free).
SLOT_FREE_MS = 0.5

#: KV use (fraction of capacity) taken as "preempting" when the status reports no preemptions.
KV_SATURATED = 0.99

#: The share of its expected remaining output a TPOT-judged resident is counted on to still produce
#: when constraint (d) prices the time it will save (:func:`atgt_slack_ms`): the length it reaches
#: with the probability the router's cautious length bound keeps (``LengthConfig.quantile``, 0.9),
#: remaining lengths taken as memoryless (as ``slot_wait_ms`` takes them): ``P(R ≥ x) = exp(−x / r̄)``
#: is 0.9 at ``x = r̄ · ln(1 / 0.9)``, about a tenth of the expected remainder.
SURE_REMAINING_SHARE = math.log(1.0 / LengthConfig().quantile)


def expected_output_tokens(request: ScheduleInput | None, default: int) -> int:
    """The output a request is expected to generate: its estimate, else its ``max_tokens``, else ``default``."""
    if request is None:
        return 0
    if request.expected_output_tokens > 0:
        return request.expected_output_tokens
    if request.max_tokens > 0:
        return request.max_tokens
    return default


def waited_ms(ctx: DecisionContext) -> float:
    """How long the decision's request has waited since its arrival (ms; 0 when unknown)."""
    request = ctx.request
    if request is None or request.arrival_s is None:
        return 0.0
    return max(ctx.view.now_s - request.arrival_s, 0.0) * 1e3


def ttft_need_ms(ctx: DecisionContext) -> float:
    """The TTFT the request needs: its target, and at most a quarter of its e2e target when it has one."""
    request = ctx.request
    if request is not None and request.e2e_slo_ms > 0:
        return min(ctx.ttft_slo_ms, request.e2e_slo_ms / 4.0)
    return ctx.ttft_slo_ms


def packing_tpot_target_ms(
    ctx: DecisionContext, default_output_tokens: int, factor: float = 1.0, *, unknown_lengths: bool = False
) -> float:
    """The TPOT target a packed placement is held to (before ``factor``, the bin-packing threshold).

    The request's TPOT target in force. A request judged only end to end (an
    e2e target, no TPOT target of its own) must also keep the pace that
    finishes its output in time: ``(e2e − waited − TTFT) / (out − 1)``, with
    ``waited`` the time it has spent in the router queue (when its arrival is
    known) and ``TTFT`` the lowest predicted TTFT of the decision (without
    predictions: ``min(TTFT target, e2e / 4)``). That pace already holds the
    slack, so it is not scaled down again by ``factor`` (the result is
    ``min(target, pace / factor)``).

    ``out`` is the cautious bound of the output (``output_tokens_bound``, the
    length predictor's high quantile) when an instance can keep the pace it
    needs, else the expected length. Paced by the mean, best fit packs such a
    request as tight as its *typical* answer allows, and every answer longer
    than the mean -- half of a skewed length distribution -- misses, however
    many instances the fleet has (``plan --policy binpack`` then never reaches
    a high target). A pace even an idle instance cannot keep (batch 1, the
    default profile) is a lost cause for that length: the next, shorter length
    is tried, and with none left the request keeps the TPOT target in force,
    as packing tighter for it would only open fresh instances for requests
    that miss anyway. With ``unknown_lengths`` (the ``binpack`` policy), a request whose class's
    lengths are not learned yet is also tried at :func:`_unknown_class_length`, and ``out`` is at
    least the bound with the class's running answers counted (``output_tokens_bound_censored``).
    """
    return _paced(ctx, ctx.tpot_slo_ms, default_output_tokens, factor, unknown_lengths=unknown_lengths)[0]


def _paced(
    ctx: DecisionContext,
    target: float,
    default_output_tokens: int,
    factor: float,
    *,
    unknown_lengths: bool = False,
) -> tuple[float, bool, float]:
    """:func:`packing_tpot_target_ms` with ``target`` as the TPOT target in force, whether the
    result is a deadline's pace (over ``factor``) rather than ``target``, and the output length
    that pace spreads the deadline over (nan when it is not a pace)."""
    request = ctx.request
    if request is None or request.e2e_slo_ms <= 0 or request.tpot_slo_ms > 0:
        return target, False, math.nan
    expected = expected_output_tokens(request, default_output_tokens)
    lengths = [expected]
    # The class's running answers counted as lower bounds, where they make the bound longer (the
    # finished answers alone are the short ones while the class's long answers still run).
    bound = request.output_tokens_bound
    if unknown_lengths:
        bound = max(bound, request.output_tokens_bound_censored)
    if bound > expected:
        lengths.insert(0, bound)
    ttft = max(ttft_need_ms(ctx), 0.0)
    if ctx.predictors is not None:
        predicted = ctx.metric("predicted_ttft")
        if len(predicted) and not np.all(np.isnan(predicted)):
            ttft = float(np.nanmin(predicted))
    left = request.e2e_slo_ms - waited_ms(ctx)
    unknown = _unknown_class_length(ctx, left - ttft, factor) if unknown_lengths else 0
    if unknown > 1 and unknown not in lengths:
        lengths = sorted([*lengths, unknown], reverse=True)
    for k, out in enumerate(lengths):
        paced = (left - ttft) / max(out - 1, 1)
        if paced >= target * factor:
            return target, False, math.nan
        if ctx.predictors is not None:
            idle = ctx.predictors.default.predict_tpot_ms(1.0, ctx.prompt_tokens + out)
            if not paced > idle:
                continue
            if k + 1 < len(lengths) and not paced >= _best_horizon_ms(ctx):
                # No instance keeps the tail's pace now, and waiting only shortens what is left of the
                # deadline: paced by the tail, the request waited in the router queue until every
                # length's pace was out of reach and then ran late (code answers on 7 neutral
                # instances at 12 req/s, mixed, seed 17: 76.8 % met, 78.4 % paced this way, where JSQ,
                # placing them at once, meets 80.8 %). The expected length's pace is the one it can
                # still keep.
                continue
        elif not paced > 0:
            continue
        return paced / factor, True, float(max(out, 2))
    return target, False, math.nan


def _unknown_class_length(ctx: DecisionContext, decode_ms: float, factor: float) -> int:
    """The output length a deadline-only request is paced by while its class's lengths are unknown
    (0: they are known, or no predictor): the longest answer, up to its ``max_tokens``, whose pace
    over ``decode_ms`` leaves θ (``factor``) of margin over an idle instance's step.

    The length predictor answers such a request with its prior (``max_tokens``) until the class has
    finished answers, then with every class's answers pooled (``output_tokens_pooled``). The prior's
    pace an idle instance cannot keep, and the pooled lengths are other classes' (short chat turns),
    so both left the request at the router's TPOT target, 50 ms a token, the first 25 s of a run
    (the class's first answers take that long to finish): a 40 s class of 900-token median answers
    missed every answer past ~1,300 tokens there (docs/papers.md, Seed 001, C7). Aladdin's θ is the
    margin it keeps against output-length error; with nothing learned of the length, the request is
    taken as long as an instance at that margin over its idle step can still finish in time.
    """
    request = ctx.request
    if (
        request is None
        or ctx.predictors is None
        or not (request.output_tokens_prior or request.output_tokens_pooled)
        or request.max_tokens <= 1
        or not decode_ms > 0
        or not 0 < factor <= 1
    ):
        return 0
    idle = ctx.predictors.default.predict_tpot_ms(1.0, ctx.prompt_tokens + request.max_tokens)
    if not idle > 0:
        return 0
    return int(min(request.max_tokens, decode_ms * factor / idle + 1.0))


def _best_horizon_ms(ctx: DecisionContext) -> float:
    """The lowest γ-horizon TPOT (ms) among the instances that can decode this request (inf: none)."""
    horizon = ctx.metric("predicted_tpot_horizon")
    table = ctx.view.instances
    can = (table.roles != Role.PREFILL) & ~np.isnan(horizon)
    return float(np.min(horizon[can])) if np.any(can) else math.inf


def resident_tpot_need_ms(ctx: DecisionContext, config: SchedulerConfig) -> float:
    """The TPOT the request of ``ctx`` must keep where it decodes: :func:`resident_tpot_need`'s need."""
    return resident_tpot_need(ctx, config)[0]


def resident_tpot_need(ctx: DecisionContext, config: SchedulerConfig) -> tuple[float, bool]:
    """The TPOT the request of ``ctx`` must keep where it decodes, and whether that need is a
    deadline's pace: both recorded with its resident leg.

    :func:`packing_tpot_target_ms` at the bin-packing share θ
    (``binpack_theta``): its TPOT target, or the pace its e2e deadline needs
    over θ. Later placements on that instance are held to θ times the least of
    these (``tpot_horizon_over_need``): Aladdin's constraint (b) keeps the
    ATGT of every request a worker holds, not only of the one being placed.
    The target is the request's own (``tpot_slo_ms``, else the router's
    ``--tpot-slo``), not the one the decision ran with: the router queue
    places late work under a fraction of it as a margin of that placement,
    which is no need of the request's. The flag says the need is the pace
    its e2e deadline needs over θ (not a TPOT target): constraint (d) prices
    such a leg differently (:func:`atgt_slack_ms`), and a TPOT target of a
    class below the router's default must not be mistaken for one. (0, False)
    without a request.
    """
    need, paced, _ = resident_tpot_pacing(ctx, config)
    return need, paced


def resident_tpot_pacing(ctx: DecisionContext, config: SchedulerConfig) -> tuple[float, bool, float]:
    """:func:`resident_tpot_need`, and for a deadline's pace the output length (tokens) it spreads
    the deadline over (nan otherwise): recorded with the resident leg, so that constraint (d) can
    count the leg's whole decode budget (:func:`atgt_slack_ms`). (0, False, nan) without a request."""
    request = ctx.request
    if request is None:
        return 0.0, False, math.nan
    target = request.tpot_slo_ms or config.tpot_slo_ms
    if own_pace_waived(ctx):
        # Placed without its pace, it is not promised that pace: recorded at it, a pace the step it
        # was placed at already breaks, it left its instance no slack for the prompts after it ((b)
        # and (d) refused them), and the TPOT-judged requests arriving next lapsed in the router queue.
        return target, False, math.nan
    # Over the θ in force (the learned one): (b) then holds the horizon to θ × need = the pace itself.
    return _paced(
        ctx,
        target,
        config.packing_default_output_tokens,
        live_theta(ctx, config),
        unknown_lengths=binpacks(config),
    )


def binpacks(config: SchedulerConfig) -> bool:
    """Whether ``config`` runs the ``binpack`` policy (its deadline pacing learns unknown lengths:
    :func:`_unknown_class_length`, ``output_tokens_bound_censored``)."""
    return config.scheduling_policy == "binpack" and not config.enable_adaptive_pd


def live_theta(ctx: DecisionContext, config: SchedulerConfig) -> float:
    """θ in force for ``ctx``: the learned one when the predictor set carries a :class:`ThetaFit` and
    the fleet has decoders; the configured one on a fleet of colocated (neutral) instances.

    On a colocated instance constraints (b) and (d) share one budget, the residents' TPOT need:
    (b) spends it on the decode step, (d) keeps the prompts' prefill stalls within the slack (b)
    leaves (the slack is the need less the step). The fit reads the realized TPOT, which carries
    both, and while (d) keeps the stalls small it finds room and raises θ; (b) then packs the decode
    step up to the need, the slack is gone, and (d) refuses every new prompt there. Measured (mixed,
    14 neutral instances, 24 req/s, seed 17, 1,440 requests, the first 20 s not scored): θ learned
    94.5 % of chat met (TTFT 98.2 %, TPOT 96.1 %; prompts waiting in the router queue because (d)
    refused 93 % of the instances a chat prompt was offered) and 91.7 % overall, where JSQ meets
    94.3 %; θ fixed there 99.4 % of chat, 94.4 % overall. So θ is learned for decoders only, where
    no prefill shares the step (the γ-horizon's pessimism on chat, ``ThetaFit``'s reason).
    """
    fit = ctx.predictors.theta if ctx.predictors is not None and config.binpack_theta_adapt else None
    if fit is None or not _has_decoders(ctx.view.instances):
        return config.binpack_theta
    return fit.theta


def _has_decoders(table: InstanceTable) -> bool:
    """Whether the snapshot holds a decode-role instance (kept with the snapshot's columns)."""
    found: bool | None = table.memo.get(_HAS_DECODERS)
    if found is None:
        found = bool(np.any(table.roles == Role.DECODE))
        table.memo[_HAS_DECODERS] = found
    return found


_HAS_DECODERS = "packing_has_decoders"


_At = Callable[[DecisionContext, SchedulerConfig, int], float]


@dataclass(frozen=True, eq=False)
class _PackingMetric:
    """A metric of this module: a function of the context and the scheduler config."""

    name: str
    scope: MetricScope
    fn: Callable[[DecisionContext, SchedulerConfig], FloatArray]
    config: SchedulerConfig

    def compute(self, ctx: DecisionContext) -> FloatArray:
        return self.fn(ctx, self.config)


@dataclass(frozen=True, eq=False)
class _UpdatedPackingMetric(_PackingMetric):
    """A load-scoped metric of this module with a one-instance form: after a change of the in-flight
    account only the instances it touched are recomputed (``DecisionContext`` calls ``at``)."""

    one: _At

    def at(self, ctx: DecisionContext, index: int) -> float:
        return self.one(ctx, self.config, index)

    def compute_at(self, ctx: DecisionContext, index: int) -> float:
        return self.one(ctx, self.config, index)


def _register(
    name: str, scope: MetricScope, at: _At | None = None
) -> Callable[[Callable[[DecisionContext, SchedulerConfig], FloatArray]], None]:
    def decorator(fn: Callable[[DecisionContext, SchedulerConfig], FloatArray]) -> None:
        def factory(config: SchedulerConfig, params: Params) -> Metric:
            if at is not None:
                return _UpdatedPackingMetric(name, scope, fn, config, at)
            return _PackingMetric(name, scope, fn, config)

        METRICS.register(name)(factory)

    return decorator


def _out(ctx: DecisionContext, config: SchedulerConfig) -> float:
    return float(expected_output_tokens(ctx.request, config.packing_default_output_tokens))


# ----------------------------------------------------------------------------- KV over life


def _kv_growth_at(ctx: DecisionContext, config: SchedulerConfig, i: int) -> float:
    """``kv_growth_tokens`` at view index ``i`` alone: the column's float operations in the same
    order on Python floats (IEEE doubles, as numpy's), so the same value."""
    table = ctx.view.instances
    inflight = ctx.view.inflight
    n = table.decode_requests.item(i) + inflight.decode_requests.item(i)
    context = table.decode_tokens.item(i) + inflight.decode_tokens.item(i)
    known = inflight.resident_requests.item(i)
    covered = known if known <= n else n
    final = inflight.resident_tokens.item(i) * (covered / known if known > 0 else 0.0)
    context_covered = context * (covered / n if n > 0 else 0.0)
    grown = final - context_covered
    return (0.0 if grown < 0.0 else grown) + (n - covered) * config.packing_default_output_tokens


@_register("kv_growth_tokens", MetricScope.LOAD, at=_kv_growth_at)
def _kv_growth_tokens(ctx: DecisionContext, config: SchedulerConfig) -> FloatArray:
    table = ctx.view.instances
    inflight = ctx.view.inflight
    n = table.decode_requests + inflight.decode_requests
    context = table.decode_tokens + inflight.decode_tokens
    known = inflight.resident_requests
    covered = np.minimum(known, n)
    # Resident legs beyond n (finished at the engine, not yet ended at the router) are not in the
    # KV any more: take the covered requests' share of the final tokens, and of the context.
    final = inflight.resident_tokens * np.divide(covered, known, out=np.zeros(table.n), where=known > 0)
    context_covered = context * np.divide(covered, n, out=np.zeros(table.n), where=n > 0)
    growth: FloatArray = (
        np.maximum(final - context_covered, 0.0) + (n - covered) * config.packing_default_output_tokens
    )
    return growth


def kv_peak_tokens(n: int, instance: IntArray, context: FloatArray, remaining: FloatArray) -> FloatArray:
    """Per instance, the peak over the legs' life of ``Σ_{i alive k steps ahead} (context_i + k)``.

    Each leg ``i`` (on view index ``instance[i]``) holds ``context_i`` tokens
    now, adds one per decode step and leaves after ``remaining_i`` more steps
    (it still holds ``context_i + remaining_i`` at step ``remaining_i``). The
    sum grows between two finishing points and drops at each, so its peak is
    at a finishing point ``k = remaining_j``, where the legs alive are those
    with ``remaining ≥ remaining_j``: with the legs of an instance sorted by
    ``remaining`` (descending), the value at the m-th is the sum of the first
    m contexts + m·remaining_m (ties: the last of equal ``remaining`` counts
    them all). O(L log L) over all L legs, in a few array passes; 0 for an
    instance without legs.
    """
    peak = np.zeros(n)
    if len(instance) == 0:
        return peak
    order = np.lexsort((-remaining, instance))
    legs = instance[order]
    csum = np.cumsum(context[order])
    starts = np.flatnonzero(np.concatenate(([True], legs[1:] != legs[:-1])))
    lengths = np.diff(np.append(starts, len(legs)))
    before = np.concatenate(([0.0], csum))[starts]
    rank = np.arange(1, len(legs) + 1) - np.repeat(starts, lengths)
    value = csum - np.repeat(before, lengths) + rank * remaining[order]
    peak[legs[starts]] = np.maximum.reduceat(value, starts)
    return peak


def kv_all_alive_tokens(n: int, instance: IntArray, context: FloatArray, remaining: FloatArray) -> FloatArray:
    """Per instance, ``Σ (context_i + remaining_i)``: every leg at its final length at once (≥ the peak)."""
    total: FloatArray = np.bincount(instance, weights=context + remaining, minlength=n).astype(np.float64)
    return total


@_register("kv_peak_projected", MetricScope.DECISION)
def _kv_peak_projected(ctx: DecisionContext, config: SchedulerConfig) -> FloatArray:
    table = ctx.view.instances
    # The load's part reads the snapshot and the in-flight account only: kept with the view's load
    # (the same sum, so the same values as summing it per decision).
    growth = ctx.metric("kv_growth_tokens")
    memo = ctx.view.load_memo
    found: tuple[FloatArray, FloatArray] | None = memo.get(_KV_LOAD)
    if found is not None and found[0] is growth:
        used = found[1]
    else:
        used = table.used_kv_tokens + table.uncomputed_prefill_tokens + ctx.view.inflight.tokens + growth
        memo[_KV_LOAD] = (growth, used)
    if ctx.request is not None:
        used = used + np.array(ctx.prompt_tokens + _out(ctx, config))  # (0-d: a cheaper operand)
    return table.over_kv_capacity(used, np.inf)


_KV_LOAD = "kv_peak_projected_load"


def _kv_life_at(ctx: DecisionContext, config: SchedulerConfig, i: int) -> float:
    """``kv_life_tokens`` at view index ``i`` alone (the same value, from that instance's legs)."""
    table = ctx.view.instances
    inflight = ctx.view.inflight
    # (Python floats from .item: the same IEEE sums as numpy's scalars, without their overhead.)
    now = table.used_kv_tokens.item(i) + table.uncomputed_prefill_tokens.item(i) + inflight.tokens.item(i)
    legs = ctx.view.resident_legs_on(i)
    if legs is None:  # (the sums, as the column without legs)
        return now + ctx.metric_at("kv_growth_tokens", i)
    held = pending = 0.0
    running: list[tuple[float, float]] = []
    for context, remaining, started, cached in legs:
        if started:
            own = context - cached
            held += own
            running.append((remaining, own))
        else:
            held += context
            pending += context + remaining
    uncovered = max(table.decode_requests.item(i) + inflight.decode_requests.item(i) - len(legs), 0.0)
    # (max: see _kv_life_column, legs counted as holding KV the engine has not allocated yet.)
    rest = now - held
    used = (rest if rest > 0.0 else 0.0) + pending + uncovered * config.packing_default_output_tokens
    if running:
        running.sort(reverse=True)
        total = peak = 0.0
        for m, (remaining, context) in enumerate(running, start=1):
            total += context
            peak = max(peak, total + m * remaining)
        used += peak
    return used


def _kv_life_column(ctx: DecisionContext, config: SchedulerConfig) -> FloatArray:
    """The KV peak (tokens) over the life of what each instance holds, exact from the legs' progress.

    See "KV peak" in the module doc. Load-scoped: the legs that decode already
    advance one token a step together, so the peak of their sum does not move
    while they run (each holds one more token a step and has one fewer to go);
    it changes only when a leg is placed, starts or ends, which changes the
    in-flight version (a progress update does not). Without the legs: the sums
    (every resident at its final length at once).
    """
    table = ctx.view.instances
    inflight = ctx.view.inflight
    now = table.used_kv_tokens + table.uncomputed_prefill_tokens + inflight.tokens
    residents = ctx.view.resident_legs()
    if residents is None:
        sums: FloatArray = now + ctx.metric("kv_growth_tokens")
        return sums
    # The rest of the KV (prefill of requests decoding elsewhere, legs placed without an expected
    # length) stays as it is; a decode request the legs do not cover grows by the default output
    # and is taken to stay. A leg that has not started yet (its prefill or KV transfer is under
    # way) starts after a delay nobody knows, so it counts at its final length throughout (its
    # peak whatever the delay).
    n = table.n
    instance, context, remaining, started = residents[:4]
    if residents.cached is not None:
        # A started leg's cached prompt blocks are held once in the engine's KV, however many legs
        # reference them (in the snapshot's used KV, so in ``now − held`` below, and kept for the
        # whole horizon: never counted as freed); the leg's own part is the rest of its context. A
        # leg not started yet counts whole, as before.
        context = np.where(started, context - residents.cached, context)
    legs = np.bincount(instance, minlength=n)
    held = np.bincount(instance, weights=context, minlength=n)
    uncovered = np.maximum(table.decode_requests + inflight.decode_requests - legs, 0.0)
    waiting = ~started
    pending = np.bincount(instance[waiting], weights=(context + remaining)[waiting], minlength=n)
    # The rest is never below 0: a leg whose prefill is done may still wait in its engine's queue for
    # KV blocks (a transferred prompt is admitted only when its blocks are free), so the engine's used
    # KV holds none of its context while ``held`` counts it. Subtracted anyway, that context dropped
    # out of the peak altogether: placements passed (e) that overflowed the KV a step later, even with
    # exact lengths (binpack on PD 2 + 4, KV 16k, mixed at 9 req/s: 35 preemptions, 83 with exact
    # lengths; 0 and 0 with the floor).
    used: FloatArray = (
        np.maximum(now - held, 0.0) + pending + uncovered * config.packing_default_output_tokens
    )
    if np.any(started):
        used = used + kv_peak_tokens(n, instance[started], context[started], remaining[started])
    return used


_register("kv_life_tokens", MetricScope.LOAD, at=_kv_life_at)(_kv_life_column)


def _kv_peak_exact_at(ctx: DecisionContext, config: SchedulerConfig, i: int) -> float:
    """``kv_peak_exact`` at view index ``i`` alone (``slo`` judges it at its best candidates only)."""
    used = ctx.metric_at("kv_life_tokens", i)
    if ctx.request is not None:
        used += ctx.prompt_tokens + _out(ctx, config)
    capacity = ctx.view.instances.kv_capacity_tokens.item(i)
    return used / capacity if capacity > 0 else math.inf


@_register("kv_peak_exact", MetricScope.DECISION, at=_kv_peak_exact_at)
def _kv_peak_exact(ctx: DecisionContext, config: SchedulerConfig) -> FloatArray:
    table = ctx.view.instances
    used = ctx.metric("kv_life_tokens")
    if ctx.request is not None:
        # The new request also starts after its prefill: at its final length throughout.
        used = used + np.array(ctx.prompt_tokens + _out(ctx, config))  # (0-d: a cheaper operand)
    return table.over_kv_capacity(used, np.inf)


@_register("kv_peak_exact_yielding", MetricScope.DECISION)
def _kv_peak_exact_yielding(ctx: DecisionContext, config: SchedulerConfig) -> FloatArray:
    """``kv_peak_exact``, over ``kv_packing_headroom`` once more for a request judged by its e2e
    deadline alone: such a request leaves the last share of the KV to requests whose first token
    cannot wait.

    Aladdin's (e) holds every request within the worker's KV and, when no
    worker has room, opens one (its worker model: a KV-bound fleet grows
    until the KV is no longer full). A fixed fleet has no worker to open, so
    whichever request takes the last of the KV decides which one waits, and
    best fit fills it with whatever comes: on PD interactive-batch at 8 req/s
    on 1 + 2, batch answers (due in 60 s) took each room a finishing leg left
    and the interactive requests arriving next (first token in 1 s) were
    refused by (e) on both decoders until they lapsed (10 of 149), while the
    batch requests, placed a second later, would have met their deadline as
    well. A request whose only target is its deadline can wait that second:
    its peak counts as ``1 / headroom`` of itself, so it is placed only where
    the KV stays within ``headroom²`` of capacity, and the last ``headroom −
    headroom²`` (about 5 % at 0.95) is left for TTFT-judged requests, which the
    router queue offers first (:mod:`router.core.queue`, EDF by TTFT deadline).
    ``binpack`` reads it on decoders only; on colocated instances, where a
    request's prefill shares the steps too, it lost on fixed fleets
    (docs/papers.md, Seed 001).
    """
    ratio = ctx.metric("kv_peak_exact")
    request = ctx.request
    if request is None or not (
        request.e2e_slo_ms > 0 and request.ttft_slo_ms == 0 and request.tpot_slo_ms == 0
    ):
        return ratio
    out: FloatArray = ratio / config.kv_packing_headroom
    return out


# ----------------------------------------------------------------------------- TPOT at the horizon


@_register("decode_tokens_horizon", MetricScope.LOAD)
def _decode_tokens_horizon(ctx: DecisionContext, config: SchedulerConfig) -> FloatArray:
    table = ctx.view.instances
    tokens: FloatArray = (
        table.decode_tokens
        + ctx.view.inflight.decode_tokens
        + config.tpot_packing_strictness * ctx.metric("kv_growth_tokens")
    )
    return tokens


@_register("predicted_tpot_horizon", MetricScope.DECISION)
def _predicted_tpot_horizon(ctx: DecisionContext, config: SchedulerConfig) -> FloatArray:
    if ctx.predictors is None:
        return np.full(ctx.view.n, np.nan)
    batch = ctx.metric("decode_batch_size")
    tokens = ctx.metric("decode_tokens_horizon")
    if ctx.request is not None:
        # (A 0-d operand: a cheaper addition than with a Python float, the same sums.)
        tokens = tokens + np.array(ctx.prompt_tokens + config.tpot_packing_strictness * _out(ctx, config))
        if ctx.prompt_tokens > 0:  # every context > 0: the busy path, with the load's batch cells
            return decode_step_with_request_ms(ctx, ctx.predictors, tokens)[0]
        batch = batch + 1.0
    return ctx.predictors.decode_step_ms(ctx.view.instances, batch, tokens)


def residents_tpot_need(ctx: DecisionContext, default_ms: float) -> FloatArray:
    """Per instance, the least TPOT need of the resident legs there (ms): a leg that recorded none
    counts at ``default_ms``; inf where no leg is known (none there, or the view knows no legs)."""
    n = ctx.view.n
    out: FloatArray = np.full(n, np.inf)
    legs = ctx.view.resident_legs()
    if legs is None or len(legs.instance) == 0:
        return out
    need = legs.tpot_need_ms
    if need is None:
        need = np.full(len(legs.instance), default_ms)
    else:
        need = np.where(np.isfinite(need) & (need > 0), need, default_ms)
    np.minimum.at(out, legs.instance, need)
    return out


@_register("tpot_horizon_over_need", MetricScope.DECISION)
def _tpot_horizon_over_need(ctx: DecisionContext, config: SchedulerConfig) -> FloatArray:
    return _horizon_over_need(ctx, config, spare_lost=False)


@_register("tpot_horizon_over_need_live", MetricScope.DECISION)
def _tpot_horizon_over_need_live(ctx: DecisionContext, config: SchedulerConfig) -> FloatArray:
    """``tpot_horizon_over_need`` over the residents that can still keep their targets: a
    deadline-paced resident whose deadline no longer lets it finish its expected remainder even at
    the step its instance runs at without this request (:func:`legs_need_now` with ``spare_lost``)
    sets no bound. The ``binpack`` policy holds it in every pass on a colocated instance, and
    ``tpot_horizon_over_need`` before its fallback passes only.

    Aladdin's (b) keeps within their ATGT the requests a worker holds, all of which its
    constraints placed within it; one that has fallen behind for good (a predicted length too
    short, stalls past its slack) is a miss whatever is placed beside it, and held at the pace it
    was placed with it closed its instance to every prompt until it ended. Where no bin is left
    to open, the prompts waited in the router queue until they lapsed: 4 neutral at 32k of KV,
    support + summaries + codegen, seed 7170, 6 req/s: of the 2,057 offers of a summary (b) alone
    refused, 1,590 were refused for code answers already out of reach of their deadline at their
    expected length, and 24 summaries lapsed where ``slo`` placed them. (d) treats a resident
    without slack alike (:func:`atgt_slack_ms`).
    """
    return _horizon_over_need(ctx, config, spare_lost=True)


def _horizon_over_need(ctx: DecisionContext, config: SchedulerConfig, *, spare_lost: bool) -> FloatArray:
    """Aladdin's constraint (b) for every request an instance would hold: the TPOT at the γ horizon
    (``predicted_tpot_horizon``) over the least TPOT need among the residents and this request
    (:func:`resident_tpot_need_ms`); the ``binpack`` policy keeps it below θ.

    The paper's workers hold requests of one ATGT target, so bounding the batch
    by that target protects all of them; here requests carry their own targets
    (a chat TPOT, a code answer's deadline pace), and a placement checked only
    against the newcomer's target would slow a resident with a tighter one past
    its own -- best fit then fills the instances an e2e-judged request was paced
    on with looser chat until it misses. Residents whose need was not recorded
    (peer router processes publish sums only) count at the router's TPOT target.

    Where the view knows each resident leg (its progress, need and expected
    remainder), each resident is judged over its own remaining output
    (:func:`residents_step_over_need`): ATGT is a mean over a request's decode,
    and a newcomer shares only part of it (a 40-token answer beside a draft
    with 500 tokens to go), and a deadline-paced resident ahead of its pace
    may use the slack its deadline leaves it now (:func:`legs_need_now`).
    """
    horizon = ctx.metric("predicted_tpot_horizon")
    need = residents_tpot_need(ctx, config.tpot_slo_ms)
    ratio: FloatArray
    if ctx.request is not None:
        # The newcomer at the need it will record as a resident (its own target, or its deadline's
        # pace over θ), as every resident is judged; the target the decision runs with only where
        # that is looser (a relaxed decision). Not the 0.8 of its target the router queue offers
        # late and yielding work on a neutral instance: that margin keeps the prompt's prefill off
        # the requests already there, which (b) at their own needs and (d) protect here, and under
        # θ it held the newcomer to 0.56 of its target (4 neutral, translate at TPOT 40 ms: the
        # γ-horizon step under 22.4 ms, where `slo` places it under 32 ms and it meets 40).
        offered = packing_tpot_target_ms(
            ctx,
            config.packing_default_output_tokens,
            live_theta(ctx, config),
            unknown_lengths=binpacks(config),
        )
        own = max(offered, resident_tpot_need_ms(ctx, config))
        residents = residents_step_over_need(ctx, config, horizon, spare_lost=spare_lost)
        if residents is not None:
            if own_pace_waived(ctx):
                return _at_live_theta(ctx, config, residents)
            mine = horizon / own if own > 0 else np.full(ctx.view.n, np.inf)
            if own_margin_waived(ctx):
                mine = mine * live_theta(ctx, config)  # the horizon within its own need, not θ of it
            ratio = np.maximum(residents, mine)
            return _at_live_theta(ctx, config, ratio)
        need = np.minimum(need, own)
    ratio = np.divide(horizon, need, out=np.full(ctx.view.n, np.inf), where=need > 0)
    return _at_live_theta(ctx, config, ratio)


def own_pace_waived(ctx: DecisionContext) -> bool:
    """Whether (b) holds the request of ``ctx`` to the residents' needs alone, not to its own pace:
    a request judged by its e2e deadline alone that the router queue offers with its pace waived
    (:attr:`~router.core.request.Targets.margin_waived`: it has waited half its derived TTFT target,
    and no TPOT-judged request waits in the queue), on a fleet of
    colocated instances. Such a request is recorded at the TPOT target in force, not at the pace
    (:func:`resident_tpot_pacing`).

    The newcomer's own term holds it to the pace its deadline leaves over its expected length, and
    every second it waits tightens that pace: in a burst the router queue kept such requests until
    the pace fell under an idle instance's step and then placed them late (4 neutral at 32k of KV,
    faq + reviews + refactors, seed 9400, 4 req/s: refactors held 4-13 s, none met, where ``slo``
    placed them at once and met them). Aladdin opens a new bin for a request no worker takes within
    its target; a fixed fleet has none, so the request takes a worker whose residents keep their
    own needs with it ((b) at theirs, (c), (d), (e) and the valve hold). Only while the fleet has
    room for the TPOT-judged requests: waived while they waited, the deadline
    requests took what the translations, reviews and summaries behind them needed.
    Not on a fleet with decoders: there the request waits for a decoder after its prefill.
    """
    return _waived_on_colocated(ctx, e2e_only=True)


def own_margin_waived(ctx: DecisionContext) -> bool:
    """Whether the request of ``ctx``, judged by a TTFT target, is placed without θ's margin on its
    own TPOT need in (b) and on the residents' slack in (d), on a fleet of colocated instances: the
    router queue offers it so (:attr:`~router.core.request.Targets.margin_waived`) once what its
    TTFT target leaves it to wait is at most half that target.

    θ is the margin the paper keeps for output-length error, at the price of more workers; a
    request no worker takes within its margins opens a new one (Algorithm 1). A fixed fleet has
    none, and the router queue holds the request instead: worth it while the request can wait for
    room to open, a certain miss when its TTFT target is short (4 neutral at 32k of KV,
    completion + review + docs at 4 req/s: 300 ms completions whose prefill alone takes 200 ms
    held by (b)'s own term at θ of their 35 ms and by (d), 97 refused that ``slo`` served; 46.3 %
    of them met against ``slo``'s 67.5 %). Waived, its own horizon step is held to its need and
    its prefill to the residents' whole slack; the residents' own needs in (b) keep θ, and (c),
    (e) and the valve hold. Not on a fleet with decoders, where θ is learned.
    """
    return _waived_on_colocated(ctx, e2e_only=False)


def _waived_on_colocated(ctx: DecisionContext, *, e2e_only: bool) -> bool:
    """Whether the router queue waived the margin for the request of ``ctx``, one judged by its e2e
    deadline alone or not as ``e2e_only`` says, on a fleet with no decoders."""
    request = ctx.request
    if not ctx.margin_waived or request is None or request.e2e_only != e2e_only:
        return False
    return not _has_decoders(ctx.view.instances)


def _at_live_theta(ctx: DecisionContext, config: SchedulerConfig, ratio: FloatArray) -> FloatArray:
    """``ratio`` scaled so that the filter's limit, ``--binpack-theta``, holds the θ in force."""
    theta = live_theta(ctx, config)
    if theta != config.binpack_theta:
        # A need paced by a deadline is that pace over θ (resident_tpot_need_ms), so it stays the pace.
        ratio = ratio * (config.binpack_theta / theta)
    return ratio


def residents_step_over_need(
    ctx: DecisionContext, config: SchedulerConfig, horizon: FloatArray, *, spare_lost: bool = False
) -> FloatArray | None:
    """Per instance, the largest ratio over its resident legs of the mean decode step each would see
    over its remaining output with this request beside it, to the need (b) holds it to now
    (:func:`legs_need_now`); 0 where no leg is; None when the view knows no legs (or no predictor).

    ``horizon`` is the γ-horizon step with the request; without it the step is the profile's at the
    instance's batch and γ-horizon context. The difference is the request's part of a step, and a
    resident decodes beside the request for at most the request's own output (its cautious bound,
    else its expected length): its mean step over its expected remainder ``r`` rises by that part
    times ``min(1, out / r)``. A newcomer at least as long as a resident's remainder counts whole,
    as every newcomer did before. Checked at the whole step, a 40-token search answer beside drafts
    with 400-500 tokens to go read as slowing all of their steps, and (b) held the searches until
    their 300 ms lapsed (4 neutral, translate + search + draft, seed 5151, 5 req/s).
    """
    legs = ctx.view.resident_legs()
    if legs is None or ctx.predictors is None:
        return None
    out: FloatArray = np.zeros(ctx.view.n)
    if len(legs.instance) == 0:
        return out
    # Shared by (b)'s two forms in one decision (``tpot_horizon_over_need`` and its ``_live`` form,
    # both in binpack's neutral chain): only the needs differ.
    without, steps = ctx.memo(_resident_steps, lambda: _resident_steps(ctx, config, legs, horizon))
    ratio = steps / legs_need_now(ctx, config, legs, without, spare_lost=spare_lost)
    if legs.tpot_paced is not None and own_margin_waived(ctx):
        # A resident with a TPOT target of its own at that target, not θ of it (a paced one's need
        # is already its pace over θ: it keeps its pace).
        ratio = np.where(legs.tpot_paced, ratio, ratio * live_theta(ctx, config))
    np.maximum.at(out, legs.instance, ratio)
    return out


def _resident_steps(
    ctx: DecisionContext, config: SchedulerConfig, legs: ResidentLegs, horizon: FloatArray
) -> tuple[FloatArray, FloatArray]:
    """(per instance, the step without the request; per leg, its mean step over its remainder with the
    request beside it) for :func:`residents_step_over_need`."""
    assert ctx.predictors is not None
    without = np.nan_to_num(
        ctx.predictors.decode_step_ms(
            ctx.view.instances, ctx.metric("decode_batch_size"), ctx.metric("decode_tokens_horizon")
        ),
        nan=0.0,
    )
    # (On the profile's grid a short newcomer can lower the context per request enough that the
    # step with it comes out below the step without it: the base is then the step with it.)
    base = np.minimum(without, horizon)
    part = horizon - base
    length = _out(ctx, config)
    request = ctx.request
    if request is not None and request.output_tokens_bound > length:
        length = float(request.output_tokens_bound)
    share = np.minimum(1.0, length / np.maximum(legs.remaining, 1.0))
    at = legs.instance
    return without, base[at] + part[at] * share


def legs_need_now(
    ctx: DecisionContext,
    config: SchedulerConfig,
    legs: ResidentLegs,
    step: FloatArray,
    *,
    spare_lost: bool = False,
) -> FloatArray:
    """Per leg, the TPOT need (ms) (b) holds it to now: the need it recorded (the router's TPOT target
    where it recorded none), and for a deadline-paced leg that has started decoding, the pace its
    deadline leaves it now, over θ, re-made by the rule its placement followed
    (:func:`packing_tpot_target_ms`): over the tokens left to the length its pace was set by; where
    that pace is under ``step`` (per instance, the step its instance runs at without the newcomer),
    over its expected remainder; and never below the need it recorded, except for a leg re-predicted
    past the length its pace was set by (Algorithm 2, below). Otherwise only loosened: a leg behind
    its pace keeps the need it was placed with (held to the tighter pace now, and a lost cause for
    both lengths given the router's TPOT target, `mixed` at 18 req/s, seed 41, missed 95 % on 10
    instances by 2-3 requests; `plan` asked 12 where JSQ asks 11).

    Its deadline leaves it ``pace × (L − 1)`` of decode time from its first token (L the length the
    pace was set by), less the time since. Held for its life to the pace it was placed with, a draft
    due in 20 s, paced at 23-24 ms over a cautious 840 tokens on an instance whose γ-horizon step was
    already 23.5 ms without any newcomer, closed its instance to every prompt: (b) protected a pace
    its instance no longer gave it, and searches and translations lapsed in the router queue.

    With ``spare_lost`` a paced leg its deadline has left behind for both lengths (the pace over its
    expected remainder under ``step`` too) needs nothing: inf (``tpot_horizon_over_need_live``).
    """
    recorded = legs.tpot_need_ms
    if recorded is None:
        return np.full(len(legs.instance), config.tpot_slo_ms)
    need = np.where(np.isfinite(recorded) & (recorded > 0), recorded, config.tpot_slo_ms)
    if (
        legs.tpot_paced is None
        or legs.paced_tokens is None
        or legs.first_token_s is None
        or legs.generated is None
    ):
        return need
    paced = legs.tpot_paced & legs.started & np.isfinite(legs.paced_tokens) & np.isfinite(legs.first_token_s)
    if not np.any(paced):
        return need
    theta = live_theta(ctx, config)
    k = paced.nonzero()[0]
    length = legs.paced_tokens[k]
    left_ms = need[k] * theta * np.maximum(length - 1.0, 1.0) - (ctx.view.now_s - legs.first_token_s[k]) * 1e3
    here = step[legs.instance[k]]
    tail = left_ms / np.maximum(length - legs.generated[k], 1.0)
    expected = left_ms / np.maximum(legs.remaining[k], 1.0)
    now = np.where(tail >= here, tail, np.where(expected >= here, expected, 0.0)) / theta
    if spare_lost:
        now = np.where(expected >= here, now, np.inf)
    loosened = np.maximum(need[k], now)
    # Algorithm 2's re-balancing: a leg whose answer the re-prediction (the conditional mean of the
    # lengths past what it has produced, ``remaining``) now expects to run past the length it was
    # paced for was under-estimated, and its instance holds new arrivals to the pace its deadline
    # leaves it over that re-predicted remainder, tighter or looser than the pace it was placed
    # with, while its instance can still keep it (a pace under ``step`` is a lost cause: as above).
    outrun = legs.generated[k] + legs.remaining[k] > length
    if np.any(outrun):
        repredicted = np.where(expected >= here, expected / theta, need[k])
        if spare_lost:
            repredicted = np.where(expected >= here, repredicted, np.inf)
        loosened = np.where(outrun, repredicted, loosened)
    need[k] = loosened
    return need


# ----------------------------------------------------------------------------- residents of a colocated instance


def prefill_stall_ms(ctx: DecisionContext) -> FloatArray:
    """Per instance: the prefill time its queued prompts and this request's prompt will put between
    the next decode steps (the backlog ``prefill_backlog_tokens + p`` as full chunks and a tail,
    each chunk's prefill part only; times the calibrated TTFT factor when there is one). ``p`` is the
    uncached part of the prompt there (``prompt_compute_tokens``). Computed once per decision: (d),
    its paced form and the residents' predicted step all read it."""
    stall: FloatArray = ctx.memo(_PREFILL_STALL, lambda: _prefill_stall_ms(ctx))
    return stall


#: The :meth:`DecisionContext.memo` key of :func:`prefill_stall_ms`.
_PREFILL_STALL = object()


def _prefill_stall_ms(ctx: DecisionContext) -> FloatArray:
    predictors = ctx.predictors
    table = ctx.view.instances
    if predictors is None:
        return np.full(table.n, np.nan)
    tokens = ctx.metric("prefill_backlog_tokens")
    if ctx.request is not None:
        # Only what the instance would compute: a cached prefix puts no chunk between decode steps.
        tokens = tokens + ctx.metric("prompt_compute_tokens")
    budget = table.max_num_batched_tokens
    full = np.floor_divide(tokens, budget)
    rest = tokens - full * budget
    tail = np.where(rest > 0, predictors.prefill_step_ms(table, np.maximum(rest, 1.0)), 0.0)
    stall: FloatArray = full * predictors.prefill_step_ms(table, budget) + tail
    correction = decision_correction(ctx)
    if correction is not None:
        stall = stall * correction.ttft_factor
    return stall


@_register("predicted_ttft_behind_step", MetricScope.DECISION)
def _predicted_ttft_behind_step(ctx: DecisionContext, config: SchedulerConfig) -> FloatArray:
    """``predicted_ttft`` with the prompt behind the chunk its instance's engine is running.

    ``predicted_ttft`` merges the queued prompts and this one into the same chunks, but an engine
    fixes a step's chunks when it starts it: a prompt arriving while a chunk of the engine's
    backlog runs waits for that step to end. So the part of the chunk in progress still to run
    (``head``: the status backlog as the step model advances it, within its chunk) takes the rest
    of its step's time, and the prompt starts after it, its own step's fixed cost paid again. The
    difference to the merged prediction is added (0 where the engine has no backlog; the prompts
    the router has sent since the status merge as before). Best fit places beside a prompt in
    prefill where the lowest TTFT seldom does: there a 300 ms-TTFT prompt packed to the edge of its
    target missed it (234 ms predicted behind a 727-token chunk that had just started, 306 ms
    realised). Aladdin's (c) bounds the new prompts' inputs by the TTFT target; this is that sum
    as the engine runs it.
    """
    ttft = ctx.metric("predicted_ttft")
    predictors = ctx.predictors
    if predictors is None or ctx.request is None:
        return ttft
    running = advanced_backlog(ctx)
    started = running > 0
    if not np.count_nonzero(started):
        return ttft
    table = ctx.view.instances
    budget = table.max_num_batched_tokens
    status = table.uncomputed_prefill_tokens
    # The chunk in progress: the status backlog's last partial chunk once only it is left, else a
    # full one; ``head`` its tokens still to run.
    last = status - np.floor_divide(status, budget) * budget
    last = np.where(last > 0, last, budget)
    in_last = running <= last
    chunk = np.where(in_last, last, budget)
    over = np.maximum(running - last, 0.0)
    head_full = over - np.floor_divide(over, budget) * budget
    head = np.where(in_last, running, np.where(head_full > 0, head_full, budget))
    step = ctx.metric("decode_step_ms")
    full_chunk = predictors.prefill_step_ms(table, budget)
    chunk_ms = predictors.prefill_step_ms(table, np.maximum(chunk, 1.0)) + step
    correction = decision_correction(ctx)
    factor: float | FloatArray = 1.0 if correction is None else correction.ttft_factor
    head_ms = head / np.maximum(chunk, 1.0) * chunk_ms * factor
    backlog = ctx.metric("prefill_backlog_tokens")
    prompt = backlog * 0.0 + ctx.metric("prompt_compute_tokens")

    def chunked(tokens: FloatArray) -> FloatArray:
        return predictors.chunked_prefill_ms(table, tokens, step, full_chunk) * factor

    behind = head_ms + chunked(np.maximum(backlog - head, 0.0) + prompt) - chunked(backlog + prompt)
    result: FloatArray = ttft + np.where(started, np.maximum(behind, 0.0), 0.0)
    return result


@_register("predicted_ttft_over_own_budget", MetricScope.DECISION)
def _predicted_ttft_over_own_budget(ctx: DecisionContext, config: SchedulerConfig) -> FloatArray:
    """Aladdin's (c) at the request's own TTFT target: ``predicted_ttft_behind_step`` over what is left
    of that target since its arrival (inf once nothing is left); 0 for a request without a TTFT
    target of its own (judged by its e2e deadline alone) or without a known arrival.

    The router queue offers a request whose TTFT target it can no longer meet (*late*, served
    best-effort under ``--late-policy serve``) with a bound looser than its target, and the
    request is a miss wherever it goes. Aladdin's (c) holds a request's prefill within its TTFT
    SLO on every worker it may take, and where none can, Algorithm 1 opens a new bin (line 12).
    The ``binpack`` policy holds this below 1 in every pass, an empty instance passing as that
    new bin: the late request no longer takes a loaded instance's prefill and its residents' slack
    from the requests that can still be met, and lapses in the router queue instead when no
    instance is empty (support + summaries + codegen, 4 neutral, 6 req/s, seed 7170: 10 summaries
    placed after their 1.5 s had passed, 42,659 prompt tokens, none met). An on-time entry is
    offered with a bound at most its remaining budget, so this changes nothing for it.
    """
    n = ctx.view.n
    request = ctx.request
    if request is None or request.ttft_slo_ms <= 0 or request.arrival_s is None:
        return np.zeros(n)
    left = request.ttft_slo_ms - waited_ms(ctx)
    if not left > 0:
        return np.full(n, np.inf)
    ratio: FloatArray = ctx.metric("predicted_ttft_behind_step") / left
    return ratio


@_register("predicted_tpot_residents", MetricScope.DECISION)
def _predicted_tpot_residents(ctx: DecisionContext, config: SchedulerConfig) -> FloatArray:
    """The TPOT the requests already decoding on an instance will see once this request joins it.

    Their decode step with the request in the batch (``predicted_tpot``, which
    already carries the measured interleaving of later prompts on a colocated
    instance), plus the prefill chunks that are *known* to come next
    (:func:`prefill_stall_ms`: the instance's prefill backlog and this prompt)
    spread over the residents' remaining output (``kv_growth_tokens / n``, at
    least one step). 0 where nothing decodes (no resident to slow down).
    """
    if ctx.predictors is None:
        return np.full(ctx.view.n, np.nan)
    batch = ctx.metric("decode_batch_size")
    remaining = np.maximum(np.divide(ctx.metric("kv_growth_tokens"), np.maximum(batch, 1.0)), 1.0)
    value = ctx.metric("predicted_tpot") + prefill_stall_ms(ctx) / remaining
    out: FloatArray = np.where(batch > 0, value, 0.0)
    return out


@_register("predicted_tpot_own", MetricScope.DECISION)
def _predicted_tpot_own(ctx: DecisionContext, config: SchedulerConfig) -> FloatArray:
    """``predicted_tpot`` for a request judged by a TPOT or TTFT target of its own; for one judged by
    its e2e deadline alone, :func:`_paced_tpot_own` (its pace is otherwise (b)'s, at the γ horizon);
    0 for no request.

    ``binpack`` holds it below the request's TPOT target on a colocated instance: the step with the
    measured interleaving of the prompts to come, which (b)'s decode-only step leaves out. On a
    fleet whose prompts are long next to their answers (a cold prefix cache), (b) and (d) admitted
    prompt after prompt onto instances whose steps were mostly prefill: a 48-prefix shared-prefix
    workload at 7 req/s on 4 instances missed the TPOT target on 40 of its first 50 answers, ``slo``
    (which holds it) on 2 (docs/papers.md, Seed 001).
    """
    request = ctx.request
    if request is None:
        return np.zeros(ctx.view.n)
    if request.e2e_only:
        return _paced_tpot_own(ctx, config)
    tpot: FloatArray = ctx.metric("predicted_tpot")
    return tpot


def empty_instances(ctx: DecisionContext) -> BoolArray:
    """The instances that hold nothing: no request, no decode batch, no KV projected."""
    empty: BoolArray = (
        (ctx.metric("num_requests") == 0)
        & (ctx.metric("decode_batch_size") == 0)
        & (ctx.metric("kv_usage_projected") == 0)
    )
    return empty


def _paced_tpot_own(ctx: DecisionContext, config: SchedulerConfig) -> FloatArray:
    """``predicted_tpot_own`` for a request judged by its e2e deadline alone: under the ``binpack``
    policy, on a colocated instance, the step with the measured interleaving of the prompts to come
    (``predicted_tpot``) scaled so that the TPOT target in force bounds it at the pace its deadline
    needs (:func:`packing_tpot_target_ms` at θ, times θ: the deadline over the length it is paced
    for); 0 otherwise (no pace, its pace waived, other policies, a fleet with decoders) and where no
    instance is empty: the check only steers a paced request to an emptier bin the fleet has.

    Aladdin prices a batch's TPOT with everything its step runs; (b)'s γ-horizon step is the
    decode alone, and on a colocated instance the prompts' prefill chunks come between the steps.
    Held by (b) only, a bulk answer paced at 26.7 ms a token was packed onto an instance whose
    step with its prompts was predicted at 33-38 ms, ran at 26-28 ms and missed its 40 s
    deadline, where an emptier instance would have kept it (C7, docs/papers.md, Seed 001). Held
    where no instance is empty, the request waited in the router queue for a bin the fleet did not
    have (4 neutral at 32k of KV, completions + reviews + docs at 4 req/s: 74.0 → 72.2 % met).
    """
    zero = np.zeros(ctx.view.n)
    target = ctx.tpot_slo_ms
    if not binpacks(config) or own_pace_waived(ctx) or not target > 0 or _has_decoders(ctx.view.instances):
        return zero
    theta = live_theta(ctx, config)
    need, paced, _ = _paced(ctx, target, config.packing_default_output_tokens, theta, unknown_lengths=True)
    pace = need * theta
    if not paced or not 0 < pace < target:
        return zero
    if not np.any(empty_instances(ctx)):
        return zero  # no emptier bin to open: (b) decides, as before
    tpot: FloatArray = ctx.metric("predicted_tpot") * (target / pace)
    return tpot


def atgt_slack_ms(
    ctx: DecisionContext, tpot_target_ms: float, theta: float = 1.0, *, paced_behind_bounds: bool = False
) -> FloatArray:
    """Per instance, the least ATGT slack (ms) of a request decoding there; inf where none does.

    A leg that has produced ``g`` tokens and is predicted to produce ``r``
    more keeps its average time per output token within the target ``T``
    as long as the time added to it stays within
    ``(g − 1)·T − t_dec + r·(T − τ_new)``: what it has saved against the
    target so far (Aladdin's ``T_dec·l_out − t_dec``, with ``t_dec`` the
    time since its first token, ``first_token_s``: the prompts that stalled
    it before are paid out of it) plus what it will still save at the step
    it will run at with this request in the batch (``τ_new``,
    ``predicted_tpot``; for a deadline-paced leg, below, the γ-horizon step
    ``predicted_tpot_horizon`` that (b) holds within its pace). A source that
    does not know when a leg's first token came (``first_token_s`` missing
    or nan) prices its past at the instance's current decode step
    (``g·(T − τ_now)``, ``decode_step_ms``), blind to the stalls it took. ``r`` is the
    router's prediction, re-made from the
    tokens streamed so far when a leg outlives its estimate (seed 001's
    Algorithm 2 re-prediction: the conditional mean of the lengths seen
    that ran past ``g``). Legs whose production the view does not know
    (``generated`` missing, or peer router processes publishing only sums)
    count their saved part as zero (the residents' mean remaining output
    stands in for ``r`` without legs). ``T`` is each leg's recorded TPOT need
    (its own target, or the pace its e2e deadline needs:
    :func:`resident_tpot_need_ms`), ``tpot_target_ms`` where none was recorded.

    A leg paced by its deadline recorded its pace over θ (``theta``, the θ in
    force): (b) holds the horizon to θ times that, the pace itself, and the
    pace is what the deadline needs, so its slack here is counted against the
    pace (``need × θ``), not the need. Counted against the need, (d) let
    prompts stall such a leg by up to ``(1 − θ)`` of its pace beyond what its
    deadline allows (code answers on 7 neutral instances at 12 req/s, mixed,
    seed 17: 78.4 % met; against the pace 82.4 %, where JSQ meets 80.8 %).
    Which legs are deadline-paced the legs say (``tpot_paced``, recorded with
    the need: :func:`resident_tpot_need`); a source that records no marker has
    a need below ``tpot_target_ms`` (the default TPOT target, which a
    deadline-judged request is paced under) read as a deadline's, which takes
    a class with its own TPOT target below the default for one (``auto`` of
    ``kv-support-docs``, TPOT 40 ms: priced at θ of it, its expected remainder
    and the horizon step, it let long prompts in beside it and missed).

    A leg whose slack is gone even before this prompt (at or below zero: it
    misses whatever is placed beside it, by what it took before or by its
    step) sets no bound: it is inf here. Counted, it closed its instance to
    every prompt until it ended; the paper's (d) assumes every ongoing request
    within its ATGT, which its constraints keep and predicted lengths do not.
    With ``paced_behind_bounds`` a deadline-paced leg behind its pace is the
    exception: its slack is 0, so it bounds its instance (as the paper's (d)
    bounds every ongoing request), for ``binpack`` before its fallback passes.
    """
    n = ctx.view.n
    legs = ctx.view.resident_legs()
    if legs is None:
        spare_new = tpot_target_ms - ctx.metric("predicted_tpot")
        batch = ctx.metric("decode_batch_size")
        mean = np.divide(ctx.metric("kv_growth_tokens"), batch, out=np.full(n, np.inf), where=batch > 0)
        slack: FloatArray = np.maximum(mean, 1.0) * spare_new
        return slack
    out: FloatArray = np.full(n, np.inf)
    if not np.any(legs.started):
        return out
    # ``binpack`` reads (d) twice per decision (with and without ``paced_behind_bounds``): the legs'
    # budgets are the same for both, so they are computed once.
    at, budget, paced = ctx.memo(
        (_LEG_BUDGETS, tpot_target_ms, theta), lambda: _leg_budgets(ctx, legs, tpot_target_ms, theta)
    )
    lost = np.where(paced, 0.0, np.inf) if paced_behind_bounds else np.inf
    budget = np.where(budget > 0, budget, lost)
    np.minimum.at(out, at, budget)
    return out


#: The :meth:`DecisionContext.memo` key of :func:`_leg_budgets` (with the TPOT target and θ).
_LEG_BUDGETS = object()


def _leg_budgets(
    ctx: DecisionContext, legs: ResidentLegs, tpot_target_ms: float, theta: float
) -> tuple[IntArray, FloatArray, BoolArray]:
    """:func:`atgt_slack_ms` per started leg: its instance, its ATGT budget (ms, any sign) and whether it
    is deadline-paced."""
    started = legs.started
    at = legs.instance[started]
    target: FloatArray | float = tpot_target_ms
    if legs.tpot_need_ms is not None:
        # Each leg against the TPOT it must keep (its own target or deadline pace), as recorded.
        need = legs.tpot_need_ms[started]
        target = np.where(np.isfinite(need) & (need > 0), need, tpot_target_ms)
        if legs.tpot_paced is not None:
            paced = legs.tpot_paced[started] & np.isfinite(need) & (need > 0)
        else:
            paced = np.isfinite(need) & (need > 0) & (need < tpot_target_ms)
        target = np.where(paced, target * theta, target)
    step_new = ctx.metric("predicted_tpot")[at]
    remaining = np.maximum(legs.remaining[started], 1.0)
    # Each prompt is checked alone against this slack, and the future part is the same for every
    # later prompt: credited with the saving over its whole expected remainder, a TPOT-judged leg
    # paid prompt after prompt out of it, their stalls adding up (4 neutral instances, chat, 12 req/s:
    # 55 TPOT misses, 91.8 % against slo's 93.8 %; 92.0 % with exact lengths, so not the estimate),
    # and a short answer ends before any of it comes. Its future counts over the remainder it is
    # sure to reach (SURE_REMAINING_SHARE), whichever its sign: what it can still promise. A
    # deadline-paced leg (as above) keeps its expected remainder: an answer shorter than expected
    # only leaves it more time.
    if legs.tpot_need_ms is None:
        paced = np.zeros(len(remaining), dtype=bool)
    remaining = np.where(paced, remaining, np.maximum(remaining * SURE_REMAINING_SHARE, 1.0))
    if np.any(paced):
        # A deadline-paced leg saves at the step (b) holds it to (the γ-horizon step, which (b) keeps
        # within its pace), not at the measured step with the prompts' interleave: that step charged
        # the prompts' stalls to such a leg twice (in the step and as the stall itself), against a
        # pace its deadline spread over the cautious length bound, so over its *expected* remainder
        # the future came out negative on every instance holding one and long prompts waited for
        # ever (4 neutral instances at 24k of KV, mixed, 10 req/s: 81 refused, 80.0 % against slo's
        # 83.4 %; with this step 49 refused, 83.9 %).
        step_new = np.where(paced, ctx.metric("predicted_tpot_horizon")[at], step_new)
    budget = remaining * (target - step_new)
    if legs.generated is not None:
        step_now = ctx.metric("decode_step_ms")[at]
        spare_now = np.where(np.isnan(step_now), 0.0, target - step_now)
        saved = legs.generated[started] * spare_now
        if legs.first_token_s is not None:
            # Aladdin's T_dec·l_out − t_dec: the time it has really spent decoding, stalls included.
            # Priced at the current step, a leg that prompts had stalled before was credited with
            # time it no longer had (5 neutral at 20k, kv-support-docs, 9 req/s, seed 4300: auto,
            # TPOT 40 ms, 83.2 % met; counted from its first token 100 %).
            spent = (ctx.view.now_s - legs.first_token_s[started]) * 1e3
            exact = np.maximum(legs.generated[started] - 1.0, 0.0) * target - spent
            if legs.paced_tokens is not None and np.any(paced):
                # A paced leg's deadline leaves it its pace times the length the pace was set by
                # (`pace × (L − 1)` of decode time), and that length is the cautious bound, longer
                # than the expected length the slack's future runs to: the tokens between them are
                # time its deadline gives it too. Left out, a leg behind its cautious pace but well
                # within its deadline at its expected length read as nearly out of slack and closed
                # its instance to every prompt (4 neutral, drafts due in 20 s of ~500 tokens paced
                # over ~840: search and translate prompts held until they lapsed). Past that length
                # (an answer longer than its bound) the term is negative: its deadline is nearer.
                length = legs.paced_tokens[started]
                beyond = np.where(
                    paced & np.isfinite(length),
                    length - np.maximum(legs.generated[started], 1.0) - remaining,
                    0.0,
                )
                exact = exact + target * beyond
            saved = np.where(np.isfinite(spent), exact, saved)
        budget = budget + saved
    return at, budget, paced


@_register("prefill_over_atgt_slack", MetricScope.DECISION)
def _prefill_over_atgt_slack(ctx: DecisionContext, config: SchedulerConfig) -> FloatArray:
    """Aladdin's constraint (d) as a ratio: the prefill this prompt puts on a colocated instance over
    the least ATGT slack of the requests decoding there (kept below θ by the ``binpack`` policy).

    The paper bounds the new prompts' prefill time by θ times the least
    slack an ongoing request has saved against the ATGT target: its engine
    (vLLM without chunking) stops every decode for the whole prefill, which
    the saved slack must absorb at once. The engines here chunk the prefill
    into the decode steps, so each resident sees the stall spread over its
    steps and what must hold is its ATGT over its whole life: the slack is
    what it has saved plus what it will still save (:func:`atgt_slack_ms`).
    Numerator: :func:`prefill_stall_ms` (the queued prompts and this one,
    as the engine chunks them). 0 where nothing decodes; inf where a
    resident has no slack left.
    """
    if ctx.predictors is None:
        return np.full(ctx.view.n, np.nan)
    return _stall_over_slack(ctx, config, paced_behind_bounds=False)


@_register("prefill_over_atgt_slack_paced", MetricScope.DECISION)
def _prefill_over_atgt_slack_paced(ctx: DecisionContext, config: SchedulerConfig) -> FloatArray:
    """``prefill_over_atgt_slack`` with a deadline-paced resident already behind its pace bounding
    its instance (inf there) instead of setting no bound; ``binpack`` holds it below θ before its
    fallback passes only.

    Such a leg is lost only at the pace of its cautious length: most answers end well before that
    length and still make their deadline at the step their instance runs at, unless prompt after
    prompt joins its steps. Unbounded, it opened its instance to every prompt, and best fit sends
    prompts to the fullest instance: on 64 neutral instances (`mixed`, seed 17, 12 req/s) binpack
    kept 12 busy and missed 27 of 125 code deadlines (94.3 %; JSQ missed 4), 8 of them answers
    within their cautious length paced at 23-29 ms a token that ran at 30-41 ms, and `plan` found
    no fleet of at most 64 meeting 95 %. Where every instance holds such a leg or is closed
    otherwise, the fallback places as ``prefill_over_atgt_slack`` does: held in every pass (the
    summaries of 4 neutral at 24k, `mixed`, 10 req/s, waited behind such legs until they ended).
    """
    if ctx.predictors is None:
        return np.full(ctx.view.n, np.nan)
    return _stall_over_slack(ctx, config, paced_behind_bounds=True)


def _stall_over_slack(
    ctx: DecisionContext, config: SchedulerConfig, *, paced_behind_bounds: bool
) -> FloatArray:
    stall = prefill_stall_ms(ctx)
    slack = atgt_slack_ms(
        ctx, config.tpot_slo_ms, live_theta(ctx, config), paced_behind_bounds=paced_behind_bounds
    )
    ratio: FloatArray = np.divide(stall, slack, out=np.full(ctx.view.n, np.inf), where=slack > 0)
    ratio[np.isinf(slack)] = 0.0
    if own_margin_waived(ctx):
        ratio *= config.binpack_theta  # the prefill within the residents' whole slack
    return ratio


# ----------------------------------------------------------------------------- best fit


@_register("capacity_norm", MetricScope.LOAD)
def _capacity_norm(ctx: DecisionContext, config: SchedulerConfig) -> FloatArray:
    """Aladdin's load of a bin: batch and γ-weighted context, each as a share of the instance's room."""
    table = ctx.view.instances
    batch = ctx.metric("decode_batch_size") / float(config.binpack_max_batch)
    context = table.over_kv_capacity(ctx.metric("decode_tokens_horizon"), 0.0)
    norm: FloatArray = np.hypot(batch, context)
    return norm


@_register("capacity_norm_life", MetricScope.LOAD)
def _capacity_norm_life(ctx: DecisionContext, config: SchedulerConfig) -> FloatArray:
    """``capacity_norm`` with the KV over the life of everything the instance holds as its context.

    The ``binpack`` policy's best fit on colocated (neutral) instances. Aladdin
    sums ``l_in + γ·l_out`` over every request a worker holds; the decode
    context (``decode_tokens_horizon``) counts only the requests decoding
    already, and a colocated instance also holds prompts queued or being
    prefilled in chunks, whose KV is the largest part of a long prompt's. The
    KV peak over life (``kv_life_tokens``, constraint (e)'s own measure)
    counts them all, each at the length it will reach, so best fit fills the
    instance whose KV -- what binds on such fleets -- is fullest, and the room
    left elsewhere stays in one piece for a long prompt. A decoder of a PD
    fleet receives each leg whole and decodes it at once, so its decode
    context already is what it holds: adaptive PD and ``binpack``'s decode
    stage keep ``capacity_norm``.
    """
    table = ctx.view.instances
    batch = ctx.metric("decode_batch_size") / float(config.binpack_max_batch)
    context = table.over_kv_capacity(ctx.metric("kv_life_tokens"), 0.0)
    norm: FloatArray = np.hypot(batch, context)
    return norm


# ----------------------------------------------------------------------------- safety valve


def overpacked_mask(table: InstanceTable, tpot_target_ms: float, factor: float) -> FloatArray:
    """1.0 per instance that is over-packed (see the module doc), else 0.0."""
    over = np.zeros(table.n, dtype=bool)
    measured = table.measured_decode_step_ms
    if measured is not None:
        over |= np.nan_to_num(measured, nan=0.0) > tpot_target_ms * factor
    if table.preempting is not None:
        over |= table.preempting > 0
    else:
        capacity = table.kv_capacity_tokens
        over |= (capacity > 0) & (table.used_kv_tokens >= KV_SATURATED * capacity)
    return over.astype(np.float64)


@_register("overpacked", MetricScope.DECISION)
def _overpacked(ctx: DecisionContext, config: SchedulerConfig) -> FloatArray:
    # A function of the snapshot and the request's TPOT target: kept with the snapshot's columns
    # per target (read-only: every decision on the snapshot shares it).
    table = ctx.view.instances
    key = ("overpacked", ctx.tpot_slo_ms, config.overpacked_tpot_factor)
    mask: FloatArray | None = table.memo.get(key)
    if mask is None:
        mask = overpacked_mask(table, ctx.tpot_slo_ms, config.overpacked_tpot_factor)
        mask.setflags(write=False)
        if len(table.memo) < 4096:  # targets come from requests: bounded
            table.memo[key] = mask
    return mask


# ----------------------------------------------------------------------------- adaptive PD's prefill room


def _all_full(ctx: DecisionContext, decoders: IntArray) -> bool:
    """Every one of ``decoders`` is at its engine's sequence cap (a new leg waits for a slot)."""
    if ctx.view.instances.max_num_seqs is None:
        return False
    return bool((ctx.metric("slot_wait_ms")[decoders] >= SLOT_FREE_MS).all())


def prefill_room_mask(ctx: DecisionContext) -> BoolArray:
    """Instances that may take new decode without starving adaptive PD's prefill side.

    The reserved decode always passes (it is kept for decode; for a request
    that excludes it, a retry, every decode-idle instance passes). Another
    decode-idle instance passes when the decode set is below the size the
    placed demand calls for (``ctx.reserves.max_decoders``, see
    :class:`router.core.adaptive_pd.DecodeShare`) and at least
    :data:`OPEN_MARGIN` *other* usable decode-idle instances (not the reserved
    decode) predict a TTFT for this prompt under half of :func:`ttft_need_ms`
    (the half leaves room for the prompts that arrive before the prefill side
    is looked at again), or without that margin when every decoder runs its
    engine's sequence cap (a leg would wait for a slot whatever room is kept).
    An instance holding decode work passes, except the
    lightest decoders (fewest decode requests, not the reserved decode) while
    the decode set is over that size (as many as it is over), or the lightest
    one when the prefill side has no room at all: they get no new decode, so
    they drain and return to prefill — consolidation without migration.
    """
    batch = ctx.metric("decode_batch_size")
    idle = batch == 0
    usable = ctx.usable()
    # (A 0-d operand and ``nonzero()[0]`` below: cheaper numpy calls, the same values.)
    good = idle & usable & (ctx.metric("predicted_ttft") < np.array(0.5 * ttft_need_ms(ctx)))
    reserved = ctx.reserves.decode
    if reserved >= 0:
        good[reserved] = False
    decoders = (~idle & usable).nonzero()[0]
    cap = ctx.reserves.max_decoders
    others = int(np.count_nonzero(good)) - good
    below = len(decoders) < cap
    keep: BoolArray = ~idle | ((others >= OPEN_MARGIN) & below)
    if below and len(decoders) and _all_full(ctx, decoders):
        # Every decoder runs its engine's sequence cap: a leg waits for a slot whatever prefill
        # room is kept, so while the placed demand calls for more decoders one opens without the
        # margin (with OPEN_MARGIN a fleet of three never had a second decoder: 6-sequence engines,
        # 1 + 2 P/D at 2 req/s, met 70 % against slo's 97.5, its legs queued for one decoder's slots).
        keep = keep | idle
    if reserved >= 0:
        keep[reserved] = True
        decoders = decoders[decoders != reserved]
        request = ctx.request
        if request is not None and ctx.view.instances.ids[reserved] in request.exclude_instance_ids:
            # A retry away from the reserved decode: a decode-idle instance stands in for it.
            keep |= idle
    reserved_decodes = reserved >= 0 and not idle[reserved]
    excess = len(decoders) + int(reserved_decodes) - cap
    if excess > 0:  # down to the reserved decode, or one decoder without it
        drain = min(int(excess), len(decoders) - (0 if reserved_decodes else 1))
    else:
        drain = 1 if not np.count_nonzero(good) and len(decoders) > 1 else 0
    if drain > 0:
        ranks = ctx.view.instances.id_rank[decoders]
        keep[decoders[np.lexsort((ranks, batch[decoders]))[:drain]]] = False
    return keep
