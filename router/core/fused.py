"""The fused stage: a stage's filters and selector in one pass over its candidates.

:func:`router.core.chain.run_stage` is the definition of a stage: every
filter's keep-mask over the whole view, the masks combined per fallback
pass, then the selector over the survivors' index array. On a small fleet
that composition costs more than the predictions it combines: some twenty
array operations and as many memo lookups per stage, each a fixed 0.5-1.5 µs
whatever the fleet's size (a decision at 16 instances was ~470 such calls).

:func:`try_stage` decides the common case, a stage whose first pass keeps a
candidate, in one pass: the candidates still alive after each filter in
chain order (a Python list of view indices on a small fleet, an index array on
a large one), each threshold compared at those candidates only, then the
selector over what is left. A threshold marked ``at_best`` (``slo``'s exact
KV peak) is judged only at the selector's best candidates, the next best
judged while none of them passes (:func:`_checked_lowest`). It reads the same
metrics through the same :class:`~router.core.plugins.DecisionContext`, and
draws the same random numbers, so it picks the same instance (property tests in
``tests/router/core/test_fused.py`` compare it with :func:`chain.run_stage`
on random views). The per-filter keep-masks of the stage's record (the
trace's source) are computed by the composed chain itself, when first read.

It steps aside (returns ``None``) and leaves the stage to the composed chain
when the first pass keeps nobody (the fallback passes and the failure's
explanation are the chain's), when the request excludes instances, or when
the stage holds a filter kind it does not know (:func:`_fusable`): a plugin
from a policy file keeps the composed chain's definition and speed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from router.core.columns import BoolArray, IntArray
from router.core.decision import StageOutcome
from router.core.filters import (
    LIFE_TPOT_METRICS,
    DecodeIdle,
    ExcludeReserved,
    Failover,
    MetricThreshold,
    PrefillRoom,
    Schedulability,
    Staleness,
)
from router.core.plugins import DecisionContext, Filter, StageSpec
from router.core.request import Stage
from router.core.selectors import Lowest, SortKey, lowest_ties, pick_lowest

#: The composed chain's evaluation of a stage's filters (``chain._evaluate``): labels, keep-masks, relax.
Evaluate = Callable[
    [DecisionContext, StageSpec, BoolArray], tuple[tuple[str, ...], list[BoolArray], tuple[int, ...]]
]

#: At most this many instances in the view: candidates as a Python list of ints and metric values
#: read as Python floats (``ndarray.tolist`` of a short column costs less than one array operation).
#: Above it: index arrays and array operations (a column's ``tolist`` grows with the fleet).
SMALL_FLEET = 64

#: At most this many (and more than SMALL_FLEET): candidates as an index array, each threshold
#: compared at them only. Above it: each filter's own keep-mask folded into a mask (fancy indexing
#: thousands of candidates costs more than a comparison over the whole column).
LARGE_FLEET = 1024

_INF = float("inf")


# ----------------------------------------------------------------------------- which stages


class _Plan:
    """What :func:`try_stage` needs of one stage spec, derived once per spec."""

    __slots__ = ("at_best", "failover", "health", "keys", "rest", "spec")

    def __init__(
        self,
        spec: StageSpec,
        health: tuple[Filter, ...],
        ordered: tuple[Filter, ...],
        failover: Failover | None,
        keys: tuple[SortKey, ...] | None,
    ) -> None:
        self.spec = spec
        #: The leading health filters (schedulability, staleness): per-snapshot masks, their
        #: product with the candidates kept with the snapshot's columns.
        self.health = health
        self.failover = failover
        #: The ``lowest`` selector's keys (``top_k`` 1), or None: another selector, called as it is.
        self.keys = keys
        #: The thresholds judged at the selector's best candidates only (``MetricThreshold.at_best``,
        #: with a ``lowest`` selector), and the other single-instance filters in chain order (``rest``).
        self.at_best: tuple[MetricThreshold, ...] = ()
        if keys is not None:
            self.at_best = tuple(f for f in ordered if type(f) is MetricThreshold and f.at_best)
        self.rest = tuple(f for f in ordered if f not in self.at_best)


#: Plans by spec id, with the spec (held, so its id stays its own while the entry lives).
_PLANS: dict[int, tuple[StageSpec, _Plan | None]] = {}
_PLANS_MAX = 256


def _fusable(spec: StageSpec) -> _Plan | None:
    """The spec's plan, or None when a filter's kind is not one this pass knows how to run.

    Known: the health filters, ``metric_threshold`` (one with ``empty_passes`` by its own keep-mask), one ``failover``
    global filter (or none), and adaptive PD's filters (their keep-masks applied as they are:
    they mark nothing). A filter that marks for failover must be a health filter: the marks
    have to be known before the failover mask, which this pass computes last.
    """
    found = _PLANS.get(id(spec))
    if found is not None and found[0] is spec:
        return found[1]
    plan = _derive(spec)
    if len(_PLANS) >= _PLANS_MAX:
        _PLANS.clear()
    _PLANS[id(spec)] = (spec, plan)
    return plan


def _derive(spec: StageSpec) -> _Plan | None:
    health: list[Filter] = []
    rest: list[Filter] = []
    for f in spec.filters:
        kind = type(f)
        if kind in (Schedulability, Staleness):
            if rest:
                return None  # a health filter after another kind: keep the chain's order as it is
            health.append(f)
        elif kind is MetricThreshold:
            rest.append(f)  # (one with ``empty_passes`` is applied whole: its mask keeps empty instances)
        elif kind in (ExcludeReserved, DecodeIdle, PrefillRoom):
            rest.append(f)  # (masks without marks)
        else:
            return None
    failover: Failover | None = None
    if len(spec.global_filters) > 1:
        return None
    if spec.global_filters:
        g = spec.global_filters[0]
        if type(g) is not Failover:
            return None
        failover = g
    selector = spec.selector
    keys = selector.keys if type(selector) is Lowest and selector.top_k == 1 else None
    return _Plan(spec, tuple(health), tuple(rest), failover, keys)


# ----------------------------------------------------------------------------- the pass


def try_stage(
    ctx: DecisionContext,
    spec: StageSpec,
    stage: Stage,
    candidates: BoolArray,
    evaluate: Evaluate,
    small: int | None = None,
    large: int | None = None,
) -> StageOutcome | None:
    """The stage's outcome as :func:`chain.run_stage` gives it, when the first pass keeps a candidate;
    ``None`` otherwise (then nothing it did changes what the chain does: see the module doc).

    ``evaluate`` is the chain's own evaluation of the filters, which the outcome's keep-masks come
    from when read; ``small`` is the largest view handled with Python lists
    (default :data:`SMALL_FLEET`).
    """
    plan = _fusable(spec)
    if plan is None:
        return None
    request = ctx.request
    if request is not None and request.exclude_instance_ids:
        return None
    table = ctx.view.instances
    no_marks = table.all_false()
    marked = no_marks
    health: list[BoolArray] = []
    for f in plan.health:
        keep, mark = f.apply(ctx)
        health.append(keep)
        if mark is not None and mark is not no_marks:
            marked = mark if marked is no_marks else marked | mark
    list_mode = table.n <= (SMALL_FLEET if small is None else small)
    base_mask, base = _base(table.memo, stage, candidates, health, list_mode)
    if not len(base):
        return None
    failover = plan.failover.apply_global(ctx, marked) if plan.failover is not None else None
    if list_mode:
        selected = _pass_of_list(ctx, plan, base, failover)
    elif table.n <= (LARGE_FLEET if large is None else large):
        selected = _pass_of_index(ctx, plan, base, failover)
    else:
        selected = _pass_of_masks(ctx, plan, base_mask, base, failover)
    if selected < 0:
        return None
    keeps = _LazyKeeps(evaluate, ctx, spec, candidates)
    return StageOutcome._make((stage, candidates, spec.labels, keeps, spec.relax, selected, 0))


def _pass_of_list(ctx: DecisionContext, plan: _Plan, alive: list[int], failover: BoolArray | None) -> int:
    """The pass over a small fleet: the candidates as a list of ints, each filter's verdict read at
    them as Python values. -1: no candidate survives."""
    no_marks = ctx.view.instances.all_false()
    for f in plan.rest:
        if type(f) is MetricThreshold and not f.empty_passes:
            # The filter's own comparison, at the candidates only: metric < bound (NaN never is).
            values = ctx.metric(f.metric)
            bound = float(f.bound(ctx))
            column = values.tolist()
            kept = [i for i in alive if column[i] < bound]
            if f.metric in LIFE_TPOT_METRICS and len(kept) < len(alive):
                # (A cached prefix's holder is judged over the request's life: it may stay.)
                held = f.held_holders(ctx, [i for i in alive if not column[i] < bound])
                if held:
                    kept = [i for i in alive if column[i] < bound or i in held]
            alive = kept
        else:
            keep, mark = f.apply(ctx)
            if mark is not None and mark is not no_marks:
                return -1  # (a marking filter of a kind not known to mark: the chain's case)
            kept = keep.tolist()
            alive = [i for i in alive if kept[i]]
        if not alive:
            return -1
    if failover is not None and failover is not ctx.view.instances.all_true():
        kept = failover.tolist()
        alive = [i for i in alive if kept[i]]
        if not alive:
            return -1
    if plan.at_best:
        return _checked_lowest(ctx, alive, plan, _lowest_ties_of_list)
    if plan.keys is not None:
        return _lowest_of_list(ctx, alive, plan.keys)
    return plan.spec.selector.select(ctx, np.array(alive, dtype=np.intp), 0)


def _pass_of_index(ctx: DecisionContext, plan: _Plan, alive: IntArray, failover: BoolArray | None) -> int:
    """The pass over a mid-sized fleet: the candidates as an index array, each threshold compared
    at them only (a stage's candidates are often half the fleet). -1: no candidate survives."""
    no_marks = ctx.view.instances.all_false()
    for f in plan.rest:
        if type(f) is MetricThreshold and not f.empty_passes:
            values = ctx.metric(f.metric)
            passed = values[alive] < np.array(float(f.bound(ctx)))
            if f.metric in LIFE_TPOT_METRICS and not passed.all():
                # (A cached prefix's holder is judged over the request's life: it may stay.)
                held = f.held_holders(ctx, alive[~passed].tolist())
                if held:
                    passed |= np.isin(alive, held)
            alive = alive[passed]
        else:
            keep, mark = f.apply(ctx)
            if mark is not None and mark is not no_marks:
                return -1
            alive = alive[keep[alive]]
        if not len(alive):
            return -1
    if failover is not None and failover is not ctx.view.instances.all_true():
        alive = alive[failover[alive]]
        if not len(alive):
            return -1
    if plan.at_best:
        return _checked_lowest(ctx, alive, plan, _lowest_ties_of_index)
    if plan.keys is not None:
        return pick_lowest(ctx, alive, plan.keys)
    return plan.spec.selector.select(ctx, alive, 0)


def _pass_of_masks(
    ctx: DecisionContext, plan: _Plan, alive: BoolArray, base: IntArray, failover: BoolArray | None
) -> int:
    """The pass over a large fleet: each filter's own keep-mask (``apply``, as the chain calls it)
    folded into the candidates' mask, the selector over what is left. -1: no candidate survives."""
    no_marks = ctx.view.instances.all_false()
    narrowed = False
    for f in plan.rest:
        keep, mark = f.apply(ctx)
        if mark is not None and mark is not no_marks:
            return -1
        alive = alive & keep
        narrowed = True
        if not np.count_nonzero(alive):
            return -1
    if failover is not None and failover is not ctx.view.instances.all_true():
        alive = alive & failover
        narrowed = True
        if not np.count_nonzero(alive):
            return -1
    survivors: IntArray = alive.nonzero()[0] if narrowed else base
    if plan.at_best:
        return _checked_lowest(ctx, survivors, plan, _lowest_ties_of_index)
    if plan.keys is not None:
        return pick_lowest(ctx, survivors, plan.keys)
    return plan.spec.selector.select(ctx, survivors, 0)


def _base(
    memo: dict[Any, Any], stage: Stage, candidates: BoolArray, health: list[BoolArray], list_mode: bool
) -> tuple[BoolArray, Any]:
    """The candidates the health masks keep: their mask, and their indices (a list of ints, or an
    index array), kept with the snapshot's columns while the masks are the snapshot's own read-only
    arrays (the same objects, the same values: compared by id, the memo holding them)."""
    key = ("fused_base", stage, list_mode)
    ids = tuple(map(id, health))
    found: tuple[BoolArray, tuple[int, ...], list[BoolArray], BoolArray, Any] | None = memo.get(key)
    if found is not None and found[0] is candidates and found[1] == ids:
        return found[3], found[4]
    alive = candidates
    for keep in health:
        alive = alive & keep
    index: IntArray = alive.nonzero()[0]
    base: Any = index.tolist() if list_mode else index
    if not candidates.flags.writeable and not any([keep.flags.writeable for keep in health]):
        # (Shared by later decisions: nobody may change them.)
        if alive is not candidates:
            alive.setflags(write=False)
        index.setflags(write=False)
        memo[key] = (candidates, ids, health, alive, base)
    return alive, base


def _lowest_of_list(ctx: DecisionContext, candidates: list[int], keys: tuple[SortKey, ...]) -> int:
    """:func:`router.core.selectors.pick_lowest` (``top_k`` 1) over a list of view indices."""
    ties = _lowest_ties_of_list(ctx, candidates, keys)
    return ties[0] if len(ties) == 1 else ties[ctx.rng.randrange(len(ties))]


def _lowest_ties_of_list(ctx: DecisionContext, candidates: list[int], keys: tuple[SortKey, ...]) -> list[int]:
    """:func:`router.core.selectors.lowest_ties` over a list of view indices."""
    memo = ctx.view.instances.memo
    ties = candidates
    for key in keys:
        if len(ties) == 1:
            break
        column = ctx.metric(key.metric)
        if memo.get(("constant_id", id(column))) is column:  # (InstanceTable.is_constant, inlined)
            continue  # the same value everywhere: every candidate ties
        ties = _best_ties_of_list(column.tolist(), ties, key.highest)
    return ties


def _lowest_ties_of_index(ctx: DecisionContext, candidates: IntArray, keys: tuple[SortKey, ...]) -> list[int]:
    ties: list[int] = lowest_ties(ctx, candidates, keys).tolist()
    return ties


def _checked_lowest(
    ctx: DecisionContext,
    alive: Any,
    plan: _Plan,
    ties_of: Callable[[DecisionContext, Any, tuple[SortKey, ...]], list[int]],
) -> int:
    """The ``lowest`` selector's pick among the ``alive`` candidates that also pass the plan's
    ``at_best`` thresholds, each judged only where the selector looks (-1: none passes).

    The best ties among ``alive`` that pass are exactly the best ties among the
    survivors of every filter: the best value over all of ``alive`` is reached
    by one that passes, so no survivor is better, and a survivor as good is one
    of those ties. When none of the ties passes, they are not survivors and
    leave; the next best are judged. The draw among the ties is then the one
    the selector makes over the survivors (the same list, in view order).
    """
    keys = plan.keys
    assert keys is not None  # (``at_best`` thresholds exist only with a ``lowest`` selector)
    checks = plan.at_best
    while True:
        ties = ties_of(ctx, alive, keys)
        passed = [i for i in ties if all(f.keeps_at(ctx, i) for f in checks)]
        if passed:
            return passed[0] if len(passed) == 1 else passed[ctx.rng.randrange(len(passed))]
        failed = set(ties)
        if isinstance(alive, list):
            alive = [i for i in alive if i not in failed]
        else:
            alive = alive[~np.isin(alive, ties)]
        if not len(alive):
            return -1


def _best_ties_of_list(column: list[float], candidates: list[int], highest: bool) -> list[int]:
    """:func:`router.core.selectors._best_ties` over Python floats: the candidates holding the
    minimum (``highest``: the maximum), NaN ranking last; every candidate when all are NaN."""
    values = [column[i] for i in candidates]
    total = sum(values)
    if total != total:  # a NaN among them (or inf and -inf: the careful path is right for those too)
        if all(v != v for v in values):
            return candidates
        worst = -_INF if highest else _INF
        values = [worst if v != v else v for v in values]
    best = max(values) if highest else min(values)
    if values.count(best) == 1:  # (list.count and list.index compare in C: the usual single best)
        return [candidates[values.index(best)]]
    return [i for i, v in zip(candidates, values, strict=True) if v == best]


class _LazyKeeps(Sequence[BoolArray]):
    """A stage's per-filter keep-masks, computed by the composed chain on first read.

    The trace and a failure's explanation read them; a decision the router only dispatches never
    does. The context holds every metric the stage read, so the chain's filters see the same values.
    """

    __slots__ = ("_candidates", "_ctx", "_evaluate", "_keeps", "_spec")

    def __init__(
        self, evaluate: Evaluate, ctx: DecisionContext, spec: StageSpec, candidates: BoolArray
    ) -> None:
        self._evaluate = evaluate
        self._ctx = ctx
        self._spec = spec
        self._candidates = candidates
        self._keeps: tuple[BoolArray, ...] | None = None

    def _get(self) -> tuple[BoolArray, ...]:
        keeps = self._keeps
        if keeps is None:
            keeps = self._keeps = tuple(self._evaluate(self._ctx, self._spec, self._candidates)[1])
        return keeps

    def __getitem__(self, k: Any) -> Any:
        return self._get()[k]

    def __len__(self) -> int:
        return len(self._spec.labels)

    def __iter__(self) -> Iterator[BoolArray]:
        return iter(self._get())
