"""The built-in selectors: pick one instance among a stage's survivors.

* ``lowest`` (``metrics``, ``top_k``) — lexicographic: the lowest value of
  the first metric, ties compared on the next, and so on; a name prefixed
  with ``-`` prefers the *highest* value. Remaining ties are broken by the
  injected RNG. ``top_k > 1`` picks uniformly among the K best (ties at the
  K-th place are sampled with the RNG too). NaN ranks last.
* ``random`` — uniform among the survivors.
* ``round_robin`` — the next survivor after the last pick, in instance-id
  order (state lives in the selector object; one object per stage).
* ``power_of_two`` (``metric``) — two distinct survivors at random, the one
  with the lower metric (the first drawn on a tie).
* ``adaptive_decode`` — adaptive PD's decode rule: in the normal pass the
  HIGHEST ``predicted_tpot`` (bin-packing; the threshold filter already kept
  only instances under the target), ties to the reserved decode, then to the
  lower ``predicted_ttft``. In a fallback pass (nobody meets the target): the
  decode-idle survivor with the lowest ``predicted_ttft`` becomes a decoder;
  without one, the lowest ``predicted_tpot``.
* ``binpack`` — Aladdin's best fit (seed 001): among the survivors (the
  stage's filters already kept only instances meeting every constraint: TTFT,
  TPOT at the packing horizon, KV over the requests' life), the one with the
  HIGHEST ``capacity_norm`` (:mod:`router.core.packing`; ``load`` names
  another load metric, e.g. ``capacity_norm_life``), so load
  concentrates and idle instances can be released; ties to the reserved
  decode, then to the lower ``predicted_ttft``, then the lower instance id
  (a deterministic "next bin"). In a fallback pass (no instance meets every
  constraint) the order turns around: a decode-idle survivor with the lowest
  ``predicted_ttft`` opens a new bin (Aladdin's "open a new bin"); without
  one, the LOWEST ``capacity_norm`` (spread the overload). With
  ``keep_prefill_room: true`` (adaptive PD) a decode-idle instance is opened
  in a fallback pass only if it passes the ``prefill_room`` guard (see
  :mod:`router.core.filters`) or no instance holds decode work yet: when the
  prefill side is saturated, existing decoders absorb the overload. With
  ``fastest_when_paced_short: true`` (binpack's decode stage) a request whose
  deadline is paced over a length shorter than its cautious bound (no
  instance keeps the bound's pace now) goes to the survivor with the lowest
  ``predicted_tpot_horizon`` instead of the fullest.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import numpy as np

from router.core.columns import FloatArray, IntArray
from router.core.config import SchedulerConfig
from router.core.errors import ConfigError
from router.core.packing import prefill_room_mask, resident_tpot_pacing
from router.core.plugins import DecisionContext, Selector
from router.core.registry import METRICS, SELECTORS, Params


@dataclass(frozen=True)
class SortKey:
    """One metric of a lexicographic order; ``highest`` prefers larger values."""

    metric: str
    highest: bool = False

    @classmethod
    def parse(cls, text: str, where: str) -> SortKey:
        metric = text[1:] if text.startswith("-") else text
        if metric not in METRICS:
            raise ConfigError(f"{where}: unknown metric {metric!r}; registered: {', '.join(METRICS.names())}")
        return cls(metric, text.startswith("-"))

    def values(self, ctx: DecisionContext, candidates: IntArray) -> FloatArray:
        """The key's values at ``candidates``, oriented so that lower is better."""
        v = ctx.metric(self.metric)[candidates]
        return -v if self.highest else v


def _best_ties(v: FloatArray, candidates: IntArray, highest: bool = False) -> IntArray:
    """The candidates holding the minimum (``highest``: the maximum) of ``v`` (NaN ranks last).

    ``highest`` gives exactly the ties of the minimum of ``-v``, without computing it.
    """
    best = v[v.argmax() if highest else v.argmin()]
    if best != best:  # argmin/argmax stop at the first NaN
        ok = ~np.isnan(v)
        if not np.count_nonzero(ok):
            return candidates
        v = np.where(ok, v, -np.inf if highest else np.inf)
        best = v[v.argmax() if highest else v.argmin()]
    ties: IntArray = candidates[v == best]
    return ties


def _ties(ctx: DecisionContext, metric: str, candidates: IntArray, highest: bool) -> IntArray:
    """:func:`_best_ties` of ``metric`` at ``candidates``, kept for the next decision over the same arrays.

    A load-scoped column and the stage's survivors are often the very same array
    objects in the next decision (nothing changed in between). Metric columns are
    never modified (the :class:`~router.core.plugins.Metric` contract) and shared
    survivors are read-only, so the same objects give the same ties.
    """
    column = ctx.metric(metric)
    memo = ctx.view.instances.memo
    if memo.get(("constant_id", id(column))) is column:  # (InstanceTable.is_constant, inlined)
        return candidates  # the same value everywhere: every candidate ties
    if candidates.flags.writeable:  # (survivors of this decision only)
        return _best_ties(column[candidates], candidates, highest)
    key = ("ties", metric, highest)
    found: tuple[FloatArray, IntArray, IntArray] | None = memo.get(key)
    if found is not None and found[0] is column and found[1] is candidates:
        return found[2]
    ties = _best_ties(column[candidates], candidates, highest)
    ties.setflags(write=False)
    memo[key] = (column, candidates, ties)
    return ties


def lowest_ties(ctx: DecisionContext, candidates: IntArray, keys: tuple[SortKey, ...]) -> IntArray:
    """The candidates that are lexicographically best by ``keys`` (the ones ``pick_lowest`` draws from)."""
    ties = candidates
    for key in keys:  # narrow to the ties of each key in turn
        if len(ties) == 1:
            break
        ties = _ties(ctx, key.metric, ties, key.highest)
    return ties


def pick_lowest(ctx: DecisionContext, candidates: IntArray, keys: tuple[SortKey, ...], top_k: int = 1) -> int:
    """The lexicographic best of ``candidates`` (RNG among ties), or uniform among the ``top_k`` best."""
    if len(candidates) == 1:
        return int(candidates[0])
    if top_k <= 1:
        ties = lowest_ties(ctx, candidates, keys)
        return int(ties[0] if len(ties) == 1 else ties[ctx.rng.randrange(len(ties))])
    cols = []
    for key in keys:
        v = key.values(ctx, candidates)
        cols.append(np.where(np.isnan(v), np.inf, v))
    order = np.lexsort(cols[::-1])
    k = min(top_k, len(candidates))
    ranked = [c[order] for c in cols]
    at_boundary = np.ones(len(candidates), dtype=bool)
    for c in ranked:
        at_boundary &= c == c[k - 1]
    tied = np.flatnonzero(at_boundary)
    first, end = int(tied[0]), int(tied[-1]) + 1
    r = ctx.rng.randrange(k)
    if r < first:
        return int(candidates[order[r]])
    # The places first..k-1 go to a uniform sample of the tied run, so any member is equally likely.
    return int(candidates[order[first + ctx.rng.randrange(end - first)]])


@dataclass(frozen=True, eq=False)
class Lowest:
    keys: tuple[SortKey, ...]
    top_k: int
    label: str

    def select(self, ctx: DecisionContext, survivors: IntArray, fallback_pass: int) -> int:
        return pick_lowest(ctx, survivors, self.keys, self.top_k)


def _keys(params: Params, default: list[str]) -> tuple[SortKey, ...]:
    return tuple(SortKey.parse(m, params.where) for m in params.names("metrics", default))


def _top_k(params: Params, config: SchedulerConfig) -> int:
    top_k = params.integer("top_k", config.dispatch_top_k)
    if top_k < 1:
        raise ConfigError(f"{params.where}: 'top_k' must be >= 1, got {top_k}")
    return top_k


@SELECTORS.register("lowest")
def _lowest(config: SchedulerConfig, params: Params) -> Selector:
    if "metrics" not in params:
        raise ConfigError(f"{params.where}: selector 'lowest' needs 'metrics'")
    keys = _keys(params, [])
    return Lowest(
        keys,
        _top_k(params, config),
        "lowest:" + ",".join(("-" if k.highest else "") + k.metric for k in keys),
    )


# ----------------------------------------------------------------------------- baselines


@dataclass(frozen=True, eq=False)
class Random:
    label: str = "random"

    def select(self, ctx: DecisionContext, survivors: IntArray, fallback_pass: int) -> int:
        return int(survivors[ctx.rng.randrange(len(survivors))])


class RoundRobin:
    """Rotates through the survivors in instance-id order, starting after the last pick."""

    label = "round_robin"

    def __init__(self) -> None:
        self.last_id: str | None = None

    def select(self, ctx: DecisionContext, survivors: IntArray, fallback_pass: int) -> int:
        table = ctx.view.instances
        ranks = table.id_rank[survivors]
        if self.last_id is None:
            pos = int(ranks.argmin())
        else:
            sorted_ids: list[str] | None = table.memo.get("sorted_ids")
            if sorted_ids is None:
                sorted_ids = table.memo["sorted_ids"] = sorted(table.ids)
            after = ranks >= bisect_right(sorted_ids, self.last_id)
            pos = int(np.where(after, ranks, ranks + table.n).argmin())
        chosen = int(survivors[pos])
        chosen_id = table.ids[chosen]
        ctx.on_commit(lambda: setattr(self, "last_id", chosen_id))
        return chosen


@dataclass(frozen=True, eq=False)
class PowerOfTwo:
    metric: str
    label: str

    def select(self, ctx: DecisionContext, survivors: IntArray, fallback_pass: int) -> int:
        if len(survivors) == 1:
            return int(survivors[0])
        a, b = ctx.rng.sample(range(len(survivors)), 2)
        values = ctx.metric(self.metric)
        first, second = int(survivors[a]), int(survivors[b])
        return second if values[second] < values[first] else first


@SELECTORS.register("random")
def _random(config: SchedulerConfig, params: Params) -> Selector:
    return Random()


@SELECTORS.register("round_robin")
def _round_robin(config: SchedulerConfig, params: Params) -> Selector:
    return RoundRobin()


@SELECTORS.register("power_of_two")
def _power_of_two(config: SchedulerConfig, params: Params) -> Selector:
    metric = params.text("metric", "num_requests")
    key = SortKey.parse(metric, params.where)
    return PowerOfTwo(key.metric, f"power_of_two:{key.metric}")


# ----------------------------------------------------------------------------- adaptive PD


_BIN_PACK = (SortKey("predicted_tpot", True), SortKey("reserved_decode", True), SortKey("predicted_ttft"))
_CONVERT = (SortKey("predicted_ttft"), SortKey("reserved_decode", True))
_SPREAD = (SortKey("predicted_tpot"), SortKey("reserved_decode", True))


@dataclass(frozen=True, eq=False)
class AdaptiveDecode:
    label: str = "adaptive_decode"

    def select(self, ctx: DecisionContext, survivors: IntArray, fallback_pass: int) -> int:
        if fallback_pass == 0:
            return pick_lowest(ctx, survivors, _BIN_PACK)
        idle = survivors[ctx.metric("decode_batch_size")[survivors] == 0]
        if len(idle):
            return pick_lowest(ctx, idle, _CONVERT)
        return pick_lowest(ctx, survivors, _SPREAD)


@SELECTORS.register("adaptive_decode")
def _adaptive_decode(config: SchedulerConfig, params: Params) -> Selector:
    return AdaptiveDecode()


# ----------------------------------------------------------------------------- best fit


_BEST_FIT = (
    SortKey("capacity_norm", True),
    SortKey("reserved_decode", True),
    SortKey("predicted_ttft"),
)
_LEAST_PACKED = (SortKey("capacity_norm"), SortKey("predicted_tpot"), SortKey("reserved_decode", True))


def _first_by_rank(ctx: DecisionContext, ties: IntArray) -> int:
    return int(ties[ctx.view.instances.id_rank[ties].argmin()])


def _lexicographic_ties(ctx: DecisionContext, candidates: IntArray, keys: tuple[SortKey, ...]) -> IntArray:
    ties = candidates
    table = ctx.view.instances
    for key in keys:
        column = ctx.metric(key.metric)
        if table.is_constant(column):
            continue  # every candidate ties
        ties = _best_ties(column[ties], ties, key.highest)
        if len(ties) == 1:
            break
    return ties


@dataclass(frozen=True, eq=False)
class BinPack:
    keep_prefill_room: bool = False
    label: str = "binpack"
    #: The best fit's order: the load metric first (highest), then the ties of ``_BEST_FIT``.
    best_fit: tuple[SortKey, ...] = _BEST_FIT

    #: With the router's config: a request paced by a length shorter than its cautious bound goes to
    #: the survivor with the lowest γ-horizon TPOT, not the fullest (see :func:`_paced_short`).
    paced_short_config: SchedulerConfig | None = None

    def select(self, ctx: DecisionContext, survivors: IntArray, fallback_pass: int) -> int:
        if fallback_pass == 0:
            if self.paced_short_config is not None and _paced_short(ctx, self.paced_short_config):
                return _first_by_rank(ctx, _lexicographic_ties(ctx, survivors, _FASTEST))
            return _first_by_rank(ctx, _lexicographic_ties(ctx, survivors, self.best_fit))
        batch = ctx.metric("decode_batch_size")[survivors]
        idle = survivors[batch == 0]
        busy = survivors[batch > 0]
        if len(idle) and self.keep_prefill_room and len(busy):
            idle = idle[prefill_room_mask(ctx)[idle]]
        if len(idle):
            return _first_by_rank(ctx, _lexicographic_ties(ctx, idle, _CONVERT))
        if self.keep_prefill_room and fallback_pass == 1:
            # The prefill side is saturated and every decoder is past its packing bound: keep
            # filling the fullest decoder the valve still accepts, so the lightest ones drain
            # and return to prefill (consolidation without migration).
            return _first_by_rank(ctx, _lexicographic_ties(ctx, busy, _BEST_FIT))
        return _first_by_rank(ctx, _lexicographic_ties(ctx, busy, _LEAST_PACKED))


#: Best fit with a prefix cache known: among the instances that meet every constraint, those that
#: would compute the fewest of the prompt's tokens (its longest cached prefix) first, the fullest of
#: them next. Aladdin's best fit counts a request's prompt as work wherever it goes; with prefix
#: caching its work is the uncached part, which differs by instance. Best fit alone sent prompts of a
#: 48-prefix workload to the fullest instance whatever it had cached (hit rate 67.8 % against
#: ``slo``'s 75.3 %), and the recomputed prefixes took the prefill the fleet needed (docs/papers.md,
#: Seed 001). Without cache knowledge every instance computes the whole prompt: the column is
#: constant and best fit decides as before.
_CACHED_FIRST = SortKey("prompt_compute_tokens")

#: The order for a request paced short (:func:`_paced_short`): the lowest γ-horizon TPOT first.
_FASTEST = (SortKey("predicted_tpot_horizon"), *_BEST_FIT)


def _paced_short(ctx: DecisionContext, config: SchedulerConfig) -> bool:
    """Whether the request is paced by its deadline over a length shorter than its cautious bound.

    Such a request is paced by its expected length because no instance keeps the pace of its
    cautious length now (``packing._paced``): the constraints then promise its deadline only to
    the answers up to the expected length, about half of a skewed length distribution. Best fit
    sends it to the fullest decoder whose step still keeps that pace, where every longer answer
    misses; the decoder with the lowest step keeps the longest answer it can still finish (PD
    `mixed`, seed 37, 12 req/s, 3 + 3: 25 code deadlines missed at best fit, 15 of them paced
    short, 7 of those placed at batch 56-63 and run at 43-45 ms a token; JSQ missed 22; this
    placement 17). Aladdin's re-balancing
    for length error, at the placement: the new request goes where its length error costs least.
    """
    request = ctx.request
    if request is None or request.output_tokens_bound <= 0:
        return False
    _, paced, length = resident_tpot_pacing(ctx, config)
    return paced and request.output_tokens_bound > length


@SELECTORS.register("binpack")
def _binpack(config: SchedulerConfig, params: Params) -> Selector:
    load = params.text("load", "capacity_norm")
    if load not in METRICS:
        raise ConfigError(
            f"{params.where}: 'load': unknown metric {load!r}; registered: {', '.join(METRICS.names())}"
        )
    key = SortKey(load, True)  # the fullest bin first
    best_fit: tuple[SortKey, ...] = _BEST_FIT if key == _BEST_FIT[0] else (key, *_BEST_FIT[1:])
    if params.flag("cached_first", False):
        # The fewest prompt tokens to compute first (the longest prefix the router knows cached
        # there), best fit among those: see ``_CACHED_FIRST``.
        best_fit = (_CACHED_FIRST, *best_fit)
    return BinPack(
        keep_prefill_room=params.flag("keep_prefill_room", False),
        best_fit=best_fit,
        paced_short_config=config if params.flag("fastest_when_paced_short", False) else None,
    )
