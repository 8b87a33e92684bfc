"""The built-in filters: keep-masks over the whole view.

Single-instance filters (in a stage's order):

* ``schedulability`` — drops instances whose status says ``schedulable ==
  false`` (and instances without a status yet); marks the former for failover.
* ``staleness`` (``max_age_s``) — drops a status older than ``max_age_s``;
  marks it for failover. An instance without a status is dropped, not marked.
* ``metric_threshold`` (``metric``, ``limit`` or ``slo`` + ``factor``,
  ``droppable``, optional ``label``) — keeps an instance whose metric is
  strictly below the limit (NaN never passes). ``slo: ttft`` means ``limit =
  request TTFT target × factor`` (``factor`` defaults to
  ``ttft_slo_dispatch_threshold``); likewise ``tpot``; ``tpot_packing`` is
  the TPOT a packed placement must keep over the request's life
  (:func:`router.core.packing.packing_tpot_target_ms`: the TPOT target, or
  the pace an e2e-only request needs); ``tpot_residents`` is the default TPOT
  target (``--tpot-slo``), which the requests already on an instance are held
  to (a status does not carry their own targets). A droppable threshold
  is skipped by the fallback pass. ``label`` names the use in traces
  (default ``metric_threshold:<metric>``).
* ``exclude_reserved`` (``reserve: prefill|decode``) — drops adaptive PD's
  reserved instance of that kind.
* ``prefill_room`` — adaptive PD's guard on opening decoders
  (:func:`router.core.packing.prefill_room_mask`): drops a decode-idle
  instance (other than the reserved decode) unless the decode set is below
  the size the placed demand calls for and two *other* usable decode-idle
  instances predict a TTFT for this prompt under half of what the request
  needs (its TTFT target; for an e2e target, at most a quarter of it:
  :func:`router.core.packing.ttft_need_ms`), and drops the lightest decoders
  while the decode set is over that size or the prefill side has no room, so
  they drain. Only decode-idle instances prefill under adaptive PD, so each
  instance turned into a decoder is prefill capacity lost; when the prefill
  side is saturated, waiting for a decoder costs less than starving prefill.

* ``decode_idle`` — adaptive PD's prefill guard: keeps the instances
  holding no decode work (``decode_batch_size == 0``, the router's in-flight
  decode legs included) as long as any usable one exists; keeps every
  instance when none does. A prefill chunk on a decoder shares its steps with
  every co-resident decode (a step carrying a full chunk lasts several decode
  steps), so prefill waits for an idle instance (or in the router queue)
  rather than stall decoders; only a fleet whose every instance decodes
  prefills on a decoder.

Global filter (after them):

* ``failover`` (``domain``) — drops every instance in the failure domain of a
  marked one: ``instance`` (just it), ``node`` (same non-empty ``node_id``),
  ``unit`` (same non-empty ``unit_id``), ``node-unit`` (the node expansion,
  then the unit expansion of that). Marks come from the whole view, so a
  stale prefill instance also takes down a decode instance on its node.

The TPOT thresholds (``predicted_tpot``, ``predicted_tpot_residents``) judge the
instance holding the request's longest cached prefix at the load it will have
over the request's life rather than the load of the moment (see
:func:`holder_life_tpot_ms`); every other instance, and every instance when the
router knows no cached prefix, is judged as above.

Every use accepts ``relax_pass`` (0 = always applies, ``k`` = skipped from
fallback pass ``k`` on); ``droppable: true`` is ``relax_pass: 1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from router.core.columns import BoolArray, FloatArray, InstanceTable, IntArray
from router.core.config import FAILOVER_DOMAINS, SchedulerConfig
from router.core.errors import ConfigError
from router.core.packing import (
    empty_instances,
    packing_tpot_target_ms,
    prefill_room_mask,
    prefill_stall_ms,
    waited_ms,
)
from router.core.plugins import DecisionContext, Filter, FilterResult, GlobalFilter
from router.core.registry import FILTERS, METRICS, Params
from router.core.request import resolve_targets


def _marks(table: InstanceTable, mark: BoolArray) -> BoolArray:
    # Most decisions mark nothing: the shared all-false mask lets the chain and failover skip work.
    return mark if np.count_nonzero(mark) else table.all_false()


def _relax_pass(params: Params) -> int:
    droppable = params.flag("droppable", False)
    relax = params.integer("relax_pass", 1 if droppable else 0)
    if relax < 0:
        raise ConfigError(f"{params.where}: 'relax_pass' must be >= 0, got {relax}")
    if droppable and relax == 0:
        raise ConfigError(f"{params.where}: 'droppable: true' contradicts 'relax_pass: 0'")
    return relax


# ----------------------------------------------------------------------------- health


@dataclass(frozen=True, eq=False)
class Schedulability:
    label: str = "schedulability"
    relax_pass: int = 0

    def apply(self, ctx: DecisionContext) -> FilterResult:
        table = ctx.view.instances
        result: FilterResult | None = table.memo.get("schedulability")
        if result is None:
            mark = _marks(table, table.has_status & ~table.schedulable)
            mark.setflags(write=False)  # one per snapshot, shared by every decision
            result = FilterResult(keep=table.schedulable, mark=mark)
            table.memo["schedulability"] = result
        return result


@dataclass(frozen=True, eq=False)
class Staleness:
    max_age_s: float
    label: str = "staleness"
    relax_pass: int = 0

    def apply(self, ctx: DecisionContext) -> FilterResult:
        key = ("staleness", self.max_age_s)
        result: FilterResult | None = ctx.cached(key)
        if result is None:
            keep = ctx.fresh(self.max_age_s)
            table = ctx.view.instances
            if keep is table.has_status:  # every status is fresh: one result per snapshot
                result = table.memo.get("all_fresh")
                if result is None:
                    result = table.memo["all_fresh"] = FilterResult(keep, table.all_false())
            else:
                result = FilterResult(keep, _marks(table, table.has_status > keep))  # has_status & ~keep
            ctx.remember(key, result)
        return result


@FILTERS.register("schedulability")
def _schedulability(config: SchedulerConfig, params: Params) -> Filter:
    return Schedulability()


@FILTERS.register("staleness")
def _staleness(config: SchedulerConfig, params: Params) -> Filter:
    max_age_s = params.number("max_age_s", config.instance_staleness_s)
    if not max_age_s > 0:
        raise ConfigError(f"{params.where}: 'max_age_s' must be > 0, got {max_age_s}")
    return Staleness(max_age_s)


# ----------------------------------------------------------------------------- thresholds

#: The threshold masks kept with a load (see ``MetricThreshold.apply``): the key's tag, and how many
#: entries a load memo takes before new masks are computed per decision only.
_KEEP = "threshold_keep"
_KEEP_MEMO_MAX = 1024


@dataclass(frozen=True, eq=False)
class MetricThreshold:
    """Keeps instances whose ``metric`` is strictly below the limit.

    The limit is ``limit`` when given, else the request's ``slo`` target
    (``"ttft"`` or ``"tpot"``) times ``factor``. With ``empty_passes`` an
    instance holding no request at all passes whatever the metric says: it
    is an empty bin, and Aladdin's packing opens one for a request no
    loaded bin can take (a constraint that also refused the empty bin would
    hold a request the fleet can only ever serve alone in the queue forever).

    With ``at_best`` the fused first pass (:mod:`router.core.fused`) judges
    the threshold only at the instances its ``lowest`` selector would pick
    (:meth:`keeps_at`), not over the whole column: for a costly metric whose
    verdict rarely changes the choice (``slo``'s exact KV peak). The choice
    is the same, since the selector's best among the survivors is its best
    among those the other filters keep that also pass this one; the
    composed chain, the fallback passes and the record's keep-masks apply
    it whole.
    """

    metric: str
    limit: float | None
    slo: str | None
    factor: float
    relax_pass: int
    label: str

    default_output_tokens: int = 256
    #: The TPOT target of the requests already on an instance (``slo: tpot_residents``): the default
    #: one, since a status does not carry its requests' own targets.
    residents_tpot_ms: float = 50.0
    #: The default TTFT target (a request's whole target, for ``empty_after_wait``, when it sets none).
    default_ttft_ms: float = 6000.0
    empty_passes: bool = False
    #: With ``empty_passes``: an empty instance passes only for a request that has waited at least
    #: this share of its whole TTFT target since its arrival (0: at once; see :meth:`_waited_enough`).
    empty_after_wait: float = 0.0
    at_best: bool = False
    #: It never marks an instance for failover (the chain may skip it once no candidate can survive).
    marks: ClassVar[bool] = False

    def bound(self, ctx: DecisionContext) -> float:
        if self.limit is not None:
            return self.limit
        if self.slo == "tpot_packing":
            return packing_tpot_target_ms(ctx, self.default_output_tokens, self.factor) * self.factor
        if self.slo == "tpot_residents":
            return self.residents_tpot_ms * self.factor
        target = ctx.ttft_slo_ms if self.slo == "ttft" else ctx.tpot_slo_ms
        return target * self.factor

    def apply(self, ctx: DecisionContext) -> FilterResult:
        keep, mark = self._apply(ctx)
        if self.metric in LIFE_TPOT_METRICS:
            held = self.held_holders(ctx)
            if held:
                keep = keep.copy()  # (the plain mask may be the load's, shared and read-only)
                keep[held] = True
        return FilterResult._make((keep, mark))

    def held_holders(self, ctx: DecisionContext, among: list[int] | None = None) -> list[int]:
        """The rows this TPOT threshold keeps beyond ``metric < bound``: holders of the request's
        longest cached prefix over the bound now and under it at their load over the request's life
        (:func:`holder_life_tpot_ms`). Empty for other metrics, and without a cached prefix.
        ``among``: only these rows are asked about (the candidates still alive that the bound drops)."""
        if self.metric not in LIFE_TPOT_METRICS:
            return []
        request = ctx.request
        if request is None or ctx.prefix is None or not request.prefix_hashes:
            return []
        found: tuple[list[int], IntArray] = ctx.memo(_HOLDERS, lambda: _holder_rows(ctx))
        rows, index = found
        if not rows:
            return []
        values = ctx.metric(self.metric)
        bound = self.bound(ctx)
        if len(rows) > 4:  # (many holders: one comparison over them, usually all under the bound)
            under = values[index] < bound
            if under.all():
                return []
            rows = index[~under].tolist()
        if among is not None:
            asked = set(among)
            rows = [i for i in rows if i in asked]
        residents = self.metric == "predicted_tpot_residents"
        return [
            i
            for i in rows
            if not values.item(i) < bound and holder_life_tpot_ms(ctx, i, residents=residents) < bound
        ]

    def _apply(self, ctx: DecisionContext) -> FilterResult:
        values = ctx.metric(self.metric)
        bound = self.bound(ctx)
        if not self.empty_passes:
            # A column that outlives the decision (snapshot- or load-scoped, the same object) under
            # the same bound gives the same mask: kept with the load, read-only, so the chain can
            # also reuse its product with the other fixed masks.
            memo = ctx.view.load_memo
            key = (_KEEP, self.metric, bound)
            found: tuple[FloatArray, BoolArray] | None = memo.get(key)
            if found is not None and found[0] is values:
                return FilterResult._make((found[1], None))
            keep = values < np.array(bound)  # (a 0-d operand: cheaper than a Python float, same mask)
            if ctx.decision_only(self.metric, values):
                return FilterResult._make((keep, None))  # (no later decision can reuse it)
            keep.setflags(write=False)
            if len(memo) < _KEEP_MEMO_MAX:
                memo[key] = (values, keep)
            return FilterResult._make((keep, None))
        keep = values < bound
        if self.empty_passes:
            empty = empty_instances(ctx)
            if self.empty_after_wait > 0:
                empty &= self._waited_enough(ctx)
            keep = keep | empty
        return FilterResult._make((keep, None))

    def keeps_at(self, ctx: DecisionContext, i: int) -> bool:
        """The keep-mask's verdict at view index ``i`` alone (``at_best``), from the metric's
        one-instance form (:meth:`DecisionContext.metric_at`): the same comparison, the same value."""
        if ctx.metric_at(self.metric, i) < self.bound(ctx):
            return True
        return self.empty_passes and (
            ctx.metric_at("num_requests", i) == 0
            and ctx.metric_at("decode_batch_size", i) == 0
            and ctx.metric_at("kv_usage_projected", i) == 0
            and (self.empty_after_wait <= 0 or self._waited_enough(ctx))
        )

    def _waited_enough(self, ctx: DecisionContext) -> bool:
        """Whether the request has waited ``empty_after_wait`` of its whole TTFT target (an e2e-only
        request's as :func:`resolve_targets` derives it) since its arrival; True when the arrival is
        unknown. Its own target, not the bound it is offered: the router queue lowers that bound to
        keep room for tighter traffic (release control), and the wait measures how much of its own
        budget that hold has already spent."""
        request = ctx.request
        if request is None or request.arrival_s is None:
            return True
        full = resolve_targets(request, self.default_ttft_ms, self.residents_tpot_ms).full_ttft_ms
        return self.empty_after_wait * full <= waited_ms(ctx)

    def explain_miss(self, ctx: DecisionContext, candidates: IntArray) -> tuple[str, float, float]:
        values = ctx.metric(self.metric)[candidates]
        values = values[~np.isnan(values)]
        best = float(values.min()) if len(values) else float("nan")
        return self.metric, best, self.bound(ctx)


#: The TPOT thresholds that judge the holder of the longest cached prefix at its load over the
#: request's life (:func:`holder_life_tpot_ms`).
LIFE_TPOT_METRICS = frozenset(("predicted_tpot", "predicted_tpot_residents"))


def holder_rows(ctx: DecisionContext) -> list[int]:
    """The usable instances holding the request's longest cached prefix (none without a prefix source,
    prefix hashes, or any cached token): the instances where the prompt costs the fleet least work."""
    request = ctx.request
    if request is None or ctx.prefix is None or not request.prefix_hashes:
        return []
    found: tuple[list[int], IntArray] = ctx.memo(_HOLDERS, lambda: _holder_rows(ctx))
    return found[0]


#: Per decision (both TPOT thresholds ask): the holders as a list and as an index array.
_HOLDERS = "holder_rows"
_NO_ROWS: IntArray = np.zeros(0, dtype=np.intp)


def _holder_rows(ctx: DecisionContext) -> tuple[list[int], IntArray]:
    cached = ctx.metric("cached_prompt_tokens")
    most = float(cached.max()) if len(cached) else 0.0
    if not most > 0.0:
        return [], _NO_ROWS
    index: IntArray = np.flatnonzero((cached == most) & ctx.usable())
    return index.tolist(), index


def life_share(remaining_tokens: float, horizon_tokens: float) -> float:
    """The mean, over the next ``horizon_tokens`` decode steps, of the share of today's residents
    still decoding, when their remaining outputs are exponential with mean ``remaining_tokens``:
    ``(r / o)·(1 − e^(−o / r))`` (1 at ``o → 0``, ``r / o`` for ``o ≫ r``)."""
    r = max(remaining_tokens, 1.0)
    o = max(horizon_tokens, 1e-9)
    return (r / o) * -math.expm1(-o / r)


def holder_life_tpot_ms(ctx: DecisionContext, i: int, *, residents: bool) -> float:
    """The TPOT threshold's metric at instance ``i`` with its decode batch at the load it will have,
    on average, over the life that metric is about, rather than the load of the moment.

    ``predicted_tpot`` takes today's batch (``n`` requests with their context) as the batch the
    request will decode in to its end. But today's residents finish after their remaining output
    (``r``, ``kv_growth_tokens / n``), and the requests that replace them are placed by the same
    router, which spreads them over the usable instances: an instance over the fleet's mean batch
    ``n̄`` converges to it as its residents finish. Over ``o`` steps (the request's expected output;
    the residents' own remaining ``r`` for ``predicted_tpot_residents``) the excess ``n − n̄`` keeps
    on average :func:`life_share` ``(r, o)`` of itself: the batch is ``n̄ + (n − n̄)·share`` with the
    same context per request, the decode step at that batch (the calibrated one, plus the measured
    interleave). An instance at or under the fleet's mean keeps today's batch.

    For the residents, the TPOT target is met or missed on the mean over each one's whole output:
    the stall of the known prefill (``prefill_stall_ms``) is spread over the tokens they produced
    already as well as those to come (their mean ``generated + remaining`` where the view knows
    each leg's progress; their remaining output, as ``predicted_tpot_residents`` does, where it does
    not), their past steps taken at about the step of now. Never above the threshold's own metric.

    Why for the holder of the longest cached prefix only: a TPOT threshold that drops it sends the
    prompt where its cached part is computed again (the fleet's work, a cold copy of the prefix, a
    later TTFT), so a pessimistic prediction costs more there than anywhere else. Over the requests
    ``slo`` placed with a prefix cache (4 instances, 48 shared prefixes, 8 req/s, 8 seeds), the
    measured TPOT was ~0.81 of the target whatever was predicted between 0.75 and 0.97 of it
    (correlation 0.04), and it did not follow the batch at dispatch (−0.04) where the prediction
    did (0.54): today's batch does not last the request's life. Scoped to the holder so that a
    router without prefix knowledge decides as before.
    """
    metric = "predicted_tpot_residents" if residents else "predicted_tpot"
    value = ctx.metric(metric).item(i)
    predictors = ctx.predictors
    request = ctx.request
    if predictors is None or request is None:
        return value
    batch = ctx.metric("decode_batch_size")
    n = batch.item(i)
    if not n > 0.0:
        return value  # (nothing decodes there: no batch to outlast, no resident to slow down)
    usable = ctx.usable()
    # (An instance at or under the fleet's mean keeps today's batch: the request makes it no lighter.)
    mean = min(float(batch[usable].mean()), n) if np.count_nonzero(usable) else n
    if not n > mean and not residents:
        return value
    remaining = max(ctx.metric("kv_growth_tokens").item(i) / n, 1.0)
    output = float(request.expected_output_tokens or request.max_tokens)  # (as predicted_tpot's horizon)
    share = life_share(remaining, remaining if residents else output)
    life_batch = mean + (n - mean) * share
    tokens = ctx.metric("decode_tokens").item(i) * (life_batch / n) + ctx.prompt_tokens + 0.5 * output
    life_batch += 1.0  # the request itself
    table = ctx.view.instances
    lp = predictors.for_group(table.groups[i])
    step = lp.tpot_ms_at(life_batch, tokens)
    calibration = predictors.calibration
    correction = calibration.correction(table.ids, table.groups) if calibration is not None else None
    if correction is not None:
        step = correction.tpot_ms_at(i, step, life_batch, tokens)
    if not residents:
        return min(step, value)
    spread = remaining
    legs = ctx.view.resident_legs()
    if legs is not None and legs.generated is not None:
        mine = (legs.instance == i) & legs.started
        if np.count_nonzero(mine):
            spread = max(float(np.mean(legs.generated[mine] + legs.remaining[mine])), 1.0)
    stall = prefill_stall_ms(ctx).item(i) / spread
    return min(step + stall, value)


@FILTERS.register("metric_threshold")
def _metric_threshold(config: SchedulerConfig, params: Params) -> Filter:
    metric = params.text("metric", "")
    if not metric:
        raise ConfigError(f"{params.where}: metric_threshold needs 'metric'")
    if metric not in METRICS:
        raise ConfigError(
            f"{params.where}: unknown metric {metric!r}; registered: {', '.join(METRICS.names())}"
        )
    limit = params.optional_number("limit")
    slo = params.text("slo", "")
    if (limit is None) == (not slo):
        raise ConfigError(f"{params.where}: metric_threshold needs exactly one of 'limit' or 'slo'")
    if slo and slo not in ("ttft", "tpot", "tpot_packing", "tpot_residents"):
        raise ConfigError(
            f"{params.where}: 'slo' must be ttft, tpot, tpot_packing or tpot_residents, got {slo!r}"
        )
    at_best = params.flag("at_best", False)
    if at_best and metric in LIFE_TPOT_METRICS:
        # (Their verdict at a cached prefix's holder reads the request's life, not one column entry.)
        raise ConfigError(f"{params.where}: 'at_best' is not available for metric {metric!r}")
    default_factor = (
        config.ttft_slo_dispatch_threshold if slo == "ttft" else config.tpot_slo_dispatch_threshold
    )
    factor = params.number("factor", default_factor)
    if not factor > 0:
        raise ConfigError(f"{params.where}: 'factor' must be > 0, got {factor}")
    return MetricThreshold(
        metric=metric,
        limit=limit,
        slo=slo or None,
        factor=factor,
        relax_pass=_relax_pass(params),
        label=params.text("label", f"metric_threshold:{metric}"),
        default_output_tokens=config.packing_default_output_tokens,
        residents_tpot_ms=config.tpot_slo_ms,
        default_ttft_ms=config.ttft_slo_ms,
        empty_passes=params.flag("empty_passes", False),
        empty_after_wait=params.number("empty_after_wait", 0.0),
        at_best=at_best,
    )


# ----------------------------------------------------------------------------- adaptive PD


@dataclass(frozen=True, eq=False)
class ExcludeReserved:
    """Drops adaptive PD's reserved ``reserve`` instance (``"prefill"`` or ``"decode"``)."""

    reserve: str
    relax_pass: int
    label: str

    def apply(self, ctx: DecisionContext) -> FilterResult:
        index = ctx.reserves.prefill if self.reserve == "prefill" else ctx.reserves.decode
        table = ctx.view.instances
        if index < 0:
            return FilterResult(keep=table.all_true())
        # Reserves rarely change: one read-only mask per reserved index and snapshot.
        key = ("all_but", index)
        result: FilterResult | None = table.memo.get(key)
        if result is None:
            keep = np.ones(table.n, dtype=bool)
            keep[index] = False
            keep.setflags(write=False)
            result = table.memo[key] = FilterResult(keep=keep)
        return result


@dataclass(frozen=True, eq=False)
class PrefillRoom:
    """Keeps decoders, and decode-idle instances whose conversion leaves prefill capacity (module doc)."""

    relax_pass: int
    label: str = "prefill_room"

    def apply(self, ctx: DecisionContext) -> FilterResult:
        return FilterResult(keep=prefill_room_mask(ctx))


@dataclass(frozen=True, eq=False)
class DecodeIdle:
    """Keeps instances without decode work while any usable one exists (module doc)."""

    relax_pass: int
    label: str = "decode_idle"

    def apply(self, ctx: DecisionContext) -> FilterResult:
        idle = ctx.metric("decode_batch_size") == 0
        if not np.count_nonzero(idle & ctx.usable()):
            return FilterResult(keep=ctx.view.instances.all_true())
        return FilterResult(keep=idle)


@FILTERS.register("decode_idle")
def _decode_idle(config: SchedulerConfig, params: Params) -> Filter:
    return DecodeIdle(_relax_pass(params))


@FILTERS.register("prefill_room")
def _prefill_room(config: SchedulerConfig, params: Params) -> Filter:
    return PrefillRoom(_relax_pass(params))


@FILTERS.register("exclude_reserved")
def _exclude_reserved(config: SchedulerConfig, params: Params) -> Filter:
    reserve = params.text("reserve", "")
    if reserve not in ("prefill", "decode"):
        raise ConfigError(f"{params.where}: 'reserve' must be prefill or decode, got {reserve!r}")
    return ExcludeReserved(reserve, _relax_pass(params), f"exclude_reserved:{reserve}")


# ----------------------------------------------------------------------------- failover


def _expand(codes: IntArray, marked: BoolArray) -> BoolArray:
    """``marked`` plus every instance sharing a non-empty code with a marked one."""
    hit = codes[marked]
    hit = hit[hit >= 0]
    if len(hit) == 0:
        return marked
    bad = np.zeros(int(codes.max()) + 2, dtype=bool)  # the last slot is where -1 (empty) lands
    bad[hit] = True
    down: BoolArray = bad[codes] | marked
    return down


@dataclass(frozen=True, eq=False)
class Failover:
    domain: str
    label: str = "failover"

    def apply_global(self, ctx: DecisionContext, marked: BoolArray) -> BoolArray:
        table = ctx.view.instances
        if marked is table.all_false():
            return table.all_true()
        if marked.flags.writeable:
            return self._keep(table, marked)
        # Read-only marks are usually the snapshot's own (its unschedulable instances): the same
        # array object decision after decision, so the verdict is kept with the snapshot's columns.
        key = ("failover", self.domain)
        found: tuple[BoolArray, BoolArray] | None = table.memo.get(key)
        if found is not None and found[0] is marked:
            return found[1]
        keep = self._keep(table, marked)
        keep.setflags(write=False)
        table.memo[key] = (marked, keep)
        return keep

    def _keep(self, table: InstanceTable, marked: BoolArray) -> BoolArray:
        if not np.count_nonzero(marked):
            return table.all_true()
        down = marked
        if self.domain in ("node", "node-unit"):
            down = _expand(table.node_codes, down)
        if self.domain in ("unit", "node-unit"):
            down = _expand(table.unit_codes, down)
        keep: BoolArray = ~down
        return keep


@FILTERS.register("failover")
def _failover(config: SchedulerConfig, params: Params) -> GlobalFilter:
    domain = params.text("domain", config.failover_domain)
    if domain not in FAILOVER_DOMAINS:
        raise ConfigError(
            f"{params.where}: 'domain' must be one of {', '.join(FAILOVER_DOMAINS)}, got {domain!r}"
        )
    return Failover(domain)
