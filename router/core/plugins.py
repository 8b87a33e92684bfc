"""The plugin interface: the per-decision context plugins receive and the protocols they implement.

A decision flows through the core like this::

    ClusterSnapshot + InflightAccount + now ──view.ViewBuilder──▶ ClusterView (columns)
    ClusterView + ScheduleInput ──Scheduler──▶ DecisionContext ──chain──▶ Decision

Plugins come in four kinds, each registered by name (:mod:`router.core.registry`):

* :class:`Metric` — one number per instance for this request (a column);
* :class:`Filter` / :class:`GlobalFilter` — a boolean keep-mask over the view;
* :class:`Selector` — picks one instance among a stage's survivors;
* :class:`Policy` — a composition of the above per stage (plus optional
  :class:`PolicyHook` objects, e.g. adaptive PD's reserve election).

The decision core is synchronous and I/O-free; the clock (``now_s``) and the
RNG are injected.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, Protocol, TypeVar, runtime_checkable

import numpy as np

from router.core.columns import INFLIGHT_ALL, BoolArray, ClusterView, FloatArray, IntArray
from router.core.predictors import PredictorSet
from router.core.prefix import PrefixSource
from router.core.request import ScheduleInput, Stage

T = TypeVar("T")


class MetricScope(enum.Enum):
    """What a metric's value depends on, which decides how long it is cached.

    ``SNAPSHOT``: the snapshot only (cached until the snapshot changes);
    ``LOAD``: the snapshot and the in-flight account (cached until either
    changes); ``DECISION``: also the clock or the request (computed once per
    decision).
    """

    SNAPSHOT = "snapshot"
    LOAD = "load"
    DECISION = "decision"


_DECISION = MetricScope.DECISION
_LOAD = MetricScope.LOAD


# --------------------------------------------------------------------------- decision context


@dataclass(frozen=True)
class Reserves:
    """Adaptive PD's reserved instances as view indices (-1 = none), and the largest decode set the
    demand it placed calls for (``max_decoders``; unbounded until it has seen enough load)."""

    prefill: int = -1
    decode: int = -1
    max_decoders: float = math.inf


NO_RESERVES = Reserves()


class DecisionContext:
    """The per-decision workspace every plugin receives.

    Built by the scheduler for one request and dropped after the decision (a
    :class:`Decision` keeps it for its lazy trace). It is not shared between
    threads or decisions. Plugins may assume: the view is immutable; metric
    values are computed at most once per decision (and cached longer according
    to their :class:`MetricScope`); state changes a plugin wants to keep go
    through :meth:`on_commit`, which the scheduler runs only for real
    (not dry-run) decisions.
    """

    __slots__ = (
        "_commits",
        "_memo",
        "_metrics",
        "_values",
        "margin_waived",
        "max_status_age_s",
        "predictors",
        "prefix",
        "prompt_tokens",
        "request",
        "reserves",
        "rng",
        "tpot_slo_ms",
        "ttft_slo_ms",
        "view",
    )

    def __init__(
        self,
        view: ClusterView,
        request: ScheduleInput | None,
        *,
        metrics: Mapping[str, Metric],
        predictors: PredictorSet | None,
        rng: random.Random,
        ttft_slo_ms: float,
        tpot_slo_ms: float,
        max_status_age_s: float,
        prefix: PrefixSource | None = None,
        margin_waived: bool = False,
    ) -> None:
        self.view = view
        self.request = request
        #: The new request's prompt tokens (0 when metrics are computed without a request).
        self.prompt_tokens = float(request.prompt_tokens) if request is not None else 0.0
        self.predictors = predictors
        self.rng = rng
        #: The SLO targets in force for this request (request override or router default).
        self.ttft_slo_ms = ttft_slo_ms
        self.tpot_slo_ms = tpot_slo_ms
        self.max_status_age_s = max_status_age_s
        #: The router queue offered the request without the margin packing holds for it
        #: (:attr:`~router.core.request.Targets.margin_waived`).
        self.margin_waived = margin_waived
        self.reserves = NO_RESERVES
        #: What the router knows of the instances' prefix caches (None: prompts are charged in full).
        self.prefix = prefix
        self._metrics = metrics
        self._values: dict[str, FloatArray] = {}
        self._memo: dict[Any, Any] = {}
        self._commits: list[Callable[[], None]] = []

    def metric(self, name: str) -> FloatArray:
        """The column of metric ``name`` (computed on first use, then cached)."""
        values = self._values.get(name)
        if values is not None:
            return values
        metric = self._metrics[name]
        scope = metric.scope
        if scope is _DECISION:
            values = metric.compute(self)
        else:
            key = (metric, self.predictors)
            memo = self.view.load_memo if scope is _LOAD else self.view.instances.memo
            values = memo.get(key)
            if values is None:
                values = memo[key] = (
                    self._update_load(metric, key) if scope is _LOAD else metric.compute(self)
                )
        self._values[name] = values
        return values

    def _update_load(self, metric: Metric, key: Any) -> FloatArray:
        # Only a few instances' in-flight sums change between decisions: for a metric with a
        # one-instance form (``at``), recompute just those entries of the previous column, and
        # only where an in-flight column it reads (``inflight_columns``, default all) changed.
        previous = self.view.load_previous
        if previous is None:
            return metric.compute(self)
        at: Callable[[DecisionContext, int], float] | None = getattr(metric, "at", None)
        if at is not None:
            old: FloatArray | None = previous.memo.get(key)
            if old is not None:
                reads: int = getattr(metric, "inflight_columns", INFLIGHT_ALL)
                stale = [i for i, mask in previous.changed.items() if mask & reads]
                if not stale:
                    return old
                values = old.copy()
                for i in stale:
                    values[i] = at(self, i)
                return values
        return metric.compute(self)

    def decision_only(self, name: str, values: FloatArray) -> bool:
        """``values`` (metric ``name``'s column) was computed for this decision alone: a
        decision-scoped metric's own new array, which no later decision will see again (a shared
        column is read-only)."""
        return self._metrics[name].scope is _DECISION and values.flags.writeable

    def metric_at(self, name: str, index: int) -> float:
        """Metric ``name`` at one instance, without computing the whole column when it is not cached.

        Uses the metric's ``compute_at(ctx, index)`` when it has one; NaN for an
        unregistered name.
        """
        values = self._values.get(name)
        if values is not None:
            return float(values[index])
        metric = self._metrics.get(name)
        if metric is None:
            return float("nan")
        scope = metric.scope
        if scope is not _DECISION:  # (a column kept with the load or snapshot: read it)
            memo = self.view.load_memo if scope is _LOAD else self.view.instances.memo
            kept: FloatArray | None = memo.get((metric, self.predictors))
            if kept is not None:
                return float(kept[index])
        at: Callable[[DecisionContext, int], float] | None = getattr(metric, "compute_at", None)
        if at is not None:
            return at(self, index)
        return float(self.metric(name)[index])

    def metric_or_nan(self, name: str) -> FloatArray:
        """Like :meth:`metric`, but NaN everywhere for a metric that is not registered."""
        if name not in self._metrics:
            return np.full(self.view.n, np.nan)
        return self.metric(name)

    def computed_metrics(self) -> Mapping[str, FloatArray]:
        """Every metric computed so far in this decision."""
        return dict(self._values)

    def cached(self, key: Any) -> Any:
        """A value remembered for this decision under ``key``, or ``None``."""
        return self._memo.get(key)

    def remember(self, key: Any, value: T) -> T:
        """Remember ``value`` for this decision under ``key``; returns it."""
        self._memo[key] = value
        return value

    def memo(self, key: Any, compute: Callable[[], Any]) -> Any:
        """A per-decision cache for values plugins share (e.g. the freshness mask)."""
        try:
            return self._memo[key]
        except KeyError:
            value = self._memo[key] = compute()
            return value

    def fresh(self, max_age_s: float | None = None) -> BoolArray:
        """Instances whose status is at most ``max_age_s`` (default ``max_status_age_s``) old.

        False without a status. Computed once per decision and age limit.
        """
        limit = self.max_status_age_s if max_age_s is None else max_age_s
        key = ("fresh", limit)
        fresh: BoolArray | None = self._memo.get(key)
        if fresh is None:
            view = self.view
            oldest = view.oldest_status_age_s
            if oldest is not None and oldest <= limit:
                fresh = view.instances.has_status  # every status is fresh (the same mask, shared)
            else:
                fresh = view.status_age_s <= limit
            self._memo[key] = fresh
        return fresh

    def usable(self) -> BoolArray:
        """Instances with a fresh status that are schedulable."""
        usable: BoolArray | None = self._memo.get("usable")
        if usable is None:
            schedulable = self.view.instances.schedulable
            fresh = self.fresh()
            # Every schedulable instance has a status: when every status is fresh, that is all of them.
            usable = schedulable if fresh is self.view.instances.has_status else schedulable & fresh
            self._memo["usable"] = usable
        return usable

    def on_commit(self, action: Callable[[], None]) -> None:
        """Run ``action`` if and when this decision is committed (not for a dry run)."""
        self._commits.append(action)

    def commit(self) -> None:
        """Apply the state changes plugins registered (called by the scheduler)."""
        for action in self._commits:
            action()
        self._commits.clear()


# --------------------------------------------------------------------------- plugin protocols


@runtime_checkable
class Metric(Protocol):
    """One value per instance of the view, for the decision's request.

    ``compute`` is called at most once per cache lifetime (see ``scope``) and
    must return a ``float64`` array of length ``ctx.view.n`` that it never
    mutates afterwards. Lower is better unless a selector says otherwise.
    A metric may also offer ``at(ctx, index) -> float``, the exact value at one
    instance; load-scoped metrics with one are updated entry by entry when
    only a few instances' in-flight sums changed (and, if the metric names the
    in-flight columns its value reads as an ``inflight_columns`` mask of
    ``INFLIGHT_*`` bits, only where one of those changed).
    """

    @property
    def name(self) -> str: ...
    @property
    def scope(self) -> MetricScope: ...

    def compute(self, ctx: DecisionContext) -> FloatArray: ...


class FilterResult(NamedTuple):
    """A single-instance filter's verdict over the whole view.

    ``keep`` is true for instances the filter lets through; ``mark`` (optional)
    is true for instances whose failure domain the global failover filter
    must avoid. (A named tuple: several are built per decision.)
    """

    keep: BoolArray
    mark: BoolArray | None = None


@runtime_checkable
class Filter(Protocol):
    """A single-instance filter: judges every instance of the view on its own.

    ``label`` names this use in traces and errors. ``relax_pass`` is 0 for a
    filter that always applies, ``k >= 1`` for one the chain drops from
    fallback pass ``k`` on (``droppable`` thresholds use 1). Filters that mark
    instances for failover must have ``relax_pass == 0``.
    """

    @property
    def label(self) -> str: ...
    @property
    def relax_pass(self) -> int: ...

    def apply(self, ctx: DecisionContext) -> FilterResult: ...


@runtime_checkable
class GlobalFilter(Protocol):
    """A filter over the whole candidate set, run after the single-instance filters.

    ``marked`` is the union of the marks of this stage's single-instance
    filters; returns the keep-mask over the view.
    """

    @property
    def label(self) -> str: ...

    def apply_global(self, ctx: DecisionContext, marked: BoolArray) -> BoolArray: ...


@runtime_checkable
class ExplainsMiss(Protocol):
    """A filter that can say how close candidates came (used for ``NoInstanceError``)."""

    @property
    def label(self) -> str: ...

    def explain_miss(self, ctx: DecisionContext, candidates: IntArray) -> tuple[str, float, float]:
        """``(metric, best value among candidates, limit)`` for these view indices."""
        ...


@runtime_checkable
class Selector(Protocol):
    """Picks one instance among a stage's survivors.

    ``survivors`` is a non-empty, ascending array of view indices;
    ``fallback_pass`` is 0 unless filters were relaxed. Must return one of
    ``survivors``. Any state change goes through ``ctx.on_commit``; randomness
    comes from ``ctx.rng`` only.
    """

    @property
    def label(self) -> str: ...

    def select(self, ctx: DecisionContext, survivors: IntArray, fallback_pass: int) -> int: ...


@runtime_checkable
class PolicyHook(Protocol):
    """Runs once per decision before any stage (e.g. adaptive PD's reserve election).

    May set ``ctx.reserves``; state changes go through ``ctx.on_commit``.
    ``dispatched`` hears of each decision the caller really dispatched
    (:meth:`router.core.scheduler.Scheduler.dispatched`): a committed decision
    may still be dropped (the router queue keeps a late request waiting when
    its placement came from a fallback pass), so load a hook measures belongs
    there, not in a commit.
    """

    def prepare(self, ctx: DecisionContext) -> None: ...

    def dispatched(self, request: ScheduleInput, now_s: float) -> None: ...


@dataclass(frozen=True)
class StageSpec:
    """How one stage picks an instance: single-instance filters in order, global filters, selector."""

    filters: tuple[Filter, ...]
    global_filters: tuple[GlobalFilter, ...]
    selector: Selector
    #: Every filter's label, single-instance ones first (derived).
    labels: tuple[str, ...] = field(init=False, repr=False, compare=False)
    #: Every filter's relax pass, in ``labels`` order; global filters always apply (derived).
    relax: tuple[int, ...] = field(init=False, repr=False, compare=False)
    #: The single-instance filters that can explain a miss, in order (derived: a failed decision
    #: reads them, and ``isinstance`` against a runtime-checkable protocol is slow per call).
    explainers: tuple[ExplainsMiss, ...] = field(init=False, repr=False, compare=False)
    #: Per single-instance filter: it never marks for failover (its class says ``marks = False``), so
    #: the chain may skip it once no candidate can survive (derived; see ``chain._evaluate``).
    markless: tuple[bool, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        labels = tuple(f.label for f in self.filters) + tuple(g.label for g in self.global_filters)
        relax = tuple(f.relax_pass for f in self.filters) + (0,) * len(self.global_filters)
        object.__setattr__(self, "labels", labels)
        object.__setattr__(self, "relax", relax)
        object.__setattr__(self, "explainers", tuple(f for f in self.filters if isinstance(f, ExplainsMiss)))
        object.__setattr__(self, "markless", tuple(getattr(f, "marks", True) is False for f in self.filters))


@dataclass(frozen=True)
class Policy:
    """A scheduling policy: a stage spec per stage, composed from registered plugins.

    Without ``role_agnostic`` the mode follows the view: PD when it holds at
    least one prefill-role and one decode-role instance (each stage on its
    role), otherwise neutral (neutral-role instances). With ``role_agnostic``
    (adaptive PD) every instance is a candidate for both PD stages.
    """

    name: str
    prefill: StageSpec
    decode: StageSpec
    neutral: StageSpec | None
    role_agnostic: bool = False
    hooks: tuple[PolicyHook, ...] = ()

    def __post_init__(self) -> None:
        if self.neutral is None and not self.role_agnostic:
            raise ValueError(f"policy {self.name!r}: a neutral stage is needed unless role_agnostic")

    def without(self, label: str) -> Policy:
        """This policy less every single-instance filter labelled ``label`` (itself when it has none)."""

        def drop(spec: StageSpec) -> StageSpec:
            kept = tuple(f for f in spec.filters if f.label != label)
            return spec if len(kept) == len(spec.filters) else replace(spec, filters=kept)

        neutral = None if self.neutral is None else drop(self.neutral)
        prefill, decode = drop(self.prefill), drop(self.decode)
        if prefill is self.prefill and decode is self.decode and neutral is self.neutral:
            return self
        return replace(self, prefill=prefill, decode=decode, neutral=neutral)

    def spec(self, stage: Stage) -> StageSpec:
        if stage is Stage.PREFILL:
            return self.prefill
        if stage is Stage.DECODE:
            return self.decode
        if self.neutral is None:
            raise ValueError(f"policy {self.name!r} has no neutral stage")
        return self.neutral
