"""Interfaces of the scheduling core: the data types that cross modules and the plugin protocols.

A decision flows through these types::

    ClusterSnapshot + InflightAccount + now ──view.ViewBuilder──▶ ClusterView (columns)
    ClusterView + ScheduleInput ──Scheduler──▶ DecisionContext ──chain──▶ Decision

Plugins come in four kinds, each registered by name (:mod:`router.registry`):

* :class:`Metric` — one number per instance for this request (a column);
* :class:`Filter` / :class:`GlobalFilter` — a boolean keep-mask over the view;
* :class:`Selector` — picks one instance among a stage's survivors;
* :class:`Policy` — a composition of the above per stage (plus optional
  :class:`PolicyHook` objects, e.g. adaptive PD's reserve election).

Every column is a numpy array over *all* instances of the view, in view order;
candidates are boolean masks or ascending index arrays into those columns. The
decision core is synchronous and I/O-free; the clock (``now_s``) and the RNG
are injected.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar, runtime_checkable

import numpy as np
import numpy.typing as npt

from cms.model import ClusterSnapshot
from router.errors import InvalidRequestError

if TYPE_CHECKING:
    from router.predictors import PredictorSet

T = TypeVar("T")
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]
IntArray = npt.NDArray[np.intp]

# The decision core builds a few frozen dataclasses per decision (the view, the decision, its
# choices). Their generated __init__ sets each field with object.__setattr__, which costs more
# than the arithmetic of a small fleet's decision; these classes define an __init__ with the same
# signature that sets the instance __dict__ in one step (tests check the signatures match).
_set_attr = object.__setattr__


class Role(enum.IntEnum):
    """An instance's registered role (values match ``slorouter.v1.InstanceRole``)."""

    NEUTRAL = 1
    PREFILL = 2
    DECODE = 3


class Stage(str, enum.Enum):
    """One placement step of a decision."""

    PREFILL = "prefill"
    DECODE = "decode"
    NEUTRAL = "neutral"


class Mode(str, enum.Enum):
    """``pd``: prefill and decode placed separately; ``neutral``: one instance does both."""

    PD = "pd"
    NEUTRAL = "neutral"


class StageRestriction(str, enum.Enum):
    """Which PD stages a request needs placed (ignored in neutral mode, where one stage does both).

    ``DECODE`` is a decode-only re-placement (the prefill already ran);
    ``PREFILL`` places only the prefill.
    """

    ALL = "all"
    PREFILL = "prefill"
    DECODE = "decode"


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


# --------------------------------------------------------------------------- request and decision


@dataclass(frozen=True)
class ScheduleInput:
    """What the scheduler needs to know about one request.

    SLO fields are the request's own targets; 0 means "use the router's
    default" (``SchedulerConfig.ttft_slo_ms`` / ``tpot_slo_ms``).
    """

    request_id: str
    prompt_tokens: int
    ttft_slo_ms: float = 0.0
    tpot_slo_ms: float = 0.0
    #: Only instances serving this model (or advertising none) are candidates; "" = any.
    model: str = ""
    #: Instances a retry must avoid (they failed this request already).
    exclude_instance_ids: frozenset[str] = frozenset()
    stages: StageRestriction = StageRestriction.ALL

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0:
            raise InvalidRequestError(f"prompt_tokens must be >= 0, got {self.prompt_tokens}")
        for name in ("ttft_slo_ms", "tpot_slo_ms"):
            value = getattr(self, name)
            if not (value >= 0 and value != float("inf")):
                raise InvalidRequestError(f"{name} must be finite and >= 0 (0 = router default), got {value}")


@dataclass(frozen=True)
class Choice:
    """One placement: where a stage runs and what it is predicted to cost there.

    Predictions are NaN when the scheduler has no latency predictor.
    ``fallback_pass`` is 0 when the instance passed every filter, ``k`` when
    it was chosen in fallback pass ``k`` (droppable filters relaxed).
    """

    instance_id: str
    endpoint: str
    stage: Stage
    predicted_ttft_ms: float
    predicted_tpot_ms: float
    fallback_pass: int = 0

    def __init__(
        self,
        instance_id: str,
        endpoint: str,
        stage: Stage,
        predicted_ttft_ms: float,
        predicted_tpot_ms: float,
        fallback_pass: int = 0,
    ) -> None:
        _set_attr(
            self,
            "__dict__",
            {
                "instance_id": instance_id,
                "endpoint": endpoint,
                "stage": stage,
                "predicted_ttft_ms": predicted_ttft_ms,
                "predicted_tpot_ms": predicted_tpot_ms,
                "fallback_pass": fallback_pass,
            },
        )


@dataclass(frozen=True)
class TraceEntry:
    """One candidate of one evaluated stage, as the ``Schedule`` trace reports it.

    ``dropped_by`` is the label of the first filter (in chain order, with the
    filters active in the pass that decided the stage) that dropped the
    candidate, or ``""`` if it survived. ``metrics`` holds every metric the
    decision computed, at this instance.
    """

    instance_id: str
    stage: Stage
    selected: bool
    dropped_by: str
    predicted_ttft_ms: float
    predicted_tpot_ms: float
    metrics: Mapping[str, float] = field(default_factory=dict)


class StageOutcome(NamedTuple):
    """The columnar record of one evaluated stage (the source of the trace).

    ``candidate_mask`` marks the stage's candidates in the view;
    ``keeps[k]`` is filter ``labels[k]``'s keep-mask over the view and
    ``relax[k]`` its relax pass (0 = always applied). ``selected`` is a view
    index, or -1 when nothing survived; ``fallback_pass`` is the pass that
    decided the stage (the last one tried when nothing survived). (Immutable;
    a named tuple because one is built per stage of every decision.)
    """

    stage: Stage
    candidate_mask: BoolArray
    labels: tuple[str, ...]
    keeps: tuple[BoolArray, ...]
    relax: tuple[int, ...]
    selected: int
    fallback_pass: int

    @property
    def candidates(self) -> IntArray:
        """The candidates' view indices, ascending."""
        return self.candidate_mask.nonzero()[0]

    @property
    def active(self) -> tuple[bool, ...]:
        """Per filter: did it apply in the deciding pass?"""
        return tuple(r == 0 or r > self.fallback_pass for r in self.relax)

    def first_drop(self, *, every_filter: bool = False) -> npt.NDArray[np.int64]:
        """Per candidate, the index of the first filter that dropped it, or -1.

        Only the filters active in the deciding pass count, unless ``every_filter``.
        """
        candidates = self.candidates
        active = (True,) * len(self.labels) if every_filter else self.active
        out = np.full(len(candidates), -1, dtype=np.int64)
        for k in range(len(self.labels) - 1, -1, -1):
            if active[k]:
                out[~self.keeps[k][candidates]] = k
        return out


@dataclass(frozen=True, eq=False)
class Decision:
    """Where a request goes.

    In ``pd`` mode ``prefill`` and ``decode`` are the two placements (one of
    them is ``None`` when the request restricted the stages; they may name the
    same instance under adaptive PD). In ``neutral`` mode both hold the same
    :class:`Choice` (stage ``NEUTRAL``). ``trace`` lists every candidate of
    every evaluated stage; it is built on first access, so the ``Generate``
    path never pays for it. For that the decision keeps its context (the
    view's columns): keep the :class:`Choice` objects, not the decision,
    for the lifetime of a request.
    """

    request_id: str
    mode: Mode
    policy: str
    prefill: Choice | None
    decode: Choice | None
    decided_at_s: float
    outcomes: tuple[StageOutcome, ...] = field(repr=False)
    context: DecisionContext = field(repr=False)

    def __init__(
        self,
        request_id: str,
        mode: Mode,
        policy: str,
        prefill: Choice | None,
        decode: Choice | None,
        decided_at_s: float,
        outcomes: tuple[StageOutcome, ...],
        context: DecisionContext,
    ) -> None:
        _set_attr(
            self,
            "__dict__",
            {
                "request_id": request_id,
                "mode": mode,
                "policy": policy,
                "prefill": prefill,
                "decode": decode,
                "decided_at_s": decided_at_s,
                "outcomes": outcomes,
                "context": context,
            },
        )

    @property
    def instance_ids(self) -> tuple[str, ...]:
        """The distinct instances this decision uses, prefill first."""
        ids = [c.instance_id for c in (self.prefill, self.decode) if c is not None]
        return tuple(dict.fromkeys(ids))

    @cached_property
    def trace(self) -> tuple[TraceEntry, ...]:
        """Every candidate of every evaluated stage, in stage then view order (built on first access)."""
        ctx = self.context
        ids = ctx.view.instances.ids
        ttft = ctx.metric_or_nan("predicted_ttft")
        tpot = ctx.metric_or_nan("predicted_tpot")
        computed = ctx.computed_metrics()
        entries: list[TraceEntry] = []
        for outcome in self.outcomes:
            drops = outcome.first_drop()
            for pos, i in enumerate(outcome.candidates.tolist()):
                k = int(drops[pos])
                entries.append(
                    TraceEntry(
                        instance_id=ids[i],
                        stage=outcome.stage,
                        selected=i == outcome.selected,
                        dropped_by=outcome.labels[k] if k >= 0 else "",
                        predicted_ttft_ms=float(ttft[i]),
                        predicted_tpot_ms=float(tpot[i]),
                        metrics={name: float(values[i]) for name, values in computed.items()},
                    )
                )
        return tuple(entries)


# --------------------------------------------------------------------------- the view


@dataclass(frozen=True, eq=False)
class InstanceTable:
    """Per-snapshot columns, one entry per instance in snapshot order (cached per snapshot).

    Instances without a status have ``has_status`` and ``schedulable`` false,
    an infinite ``status_age_s`` and zero load. ``max_num_batched_tokens``
    falls back to the configured default where the metadata leaves it 0.
    ``node_codes``/``unit_codes`` number the distinct non-empty node/unit ids
    (-1 = empty). ``memo`` caches values derived from this snapshot only.
    """

    snapshot: ClusterSnapshot
    ids: tuple[str, ...]
    index: Mapping[str, int]
    endpoints: tuple[str, ...]
    models: tuple[str, ...]
    node_ids: tuple[str, ...]
    unit_ids: tuple[str, ...]
    #: Profile group per instance (the metadata label the config names; "" = default group).
    groups: tuple[str, ...]
    roles: npt.NDArray[np.int8]
    node_codes: IntArray
    unit_codes: IntArray
    #: Rank of each instance id in sorted order (for deterministic tie-breaks and rotation).
    id_rank: IntArray
    max_num_batched_tokens: FloatArray
    kv_capacity_tokens: FloatArray
    has_status: BoolArray
    schedulable: BoolArray
    #: Age of the status when the snapshot was taken (``inf`` without a status).
    status_age_s: FloatArray
    uncomputed_prefill_tokens: FloatArray
    decode_requests: FloatArray
    decode_tokens: FloatArray
    used_kv_tokens: FloatArray
    waiting_requests: FloatArray
    running_requests: FloatArray
    memo: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def n(self) -> int:
        return len(self.ids)

    def all_true(self) -> BoolArray:
        """A shared read-only all-true mask (filters return it to keep everything)."""
        mask: BoolArray | None = self.memo.get("all_true")
        if mask is None:
            mask = np.ones(self.n, dtype=bool)
            mask.setflags(write=False)
            self.memo["all_true"] = mask
        return mask

    def all_false(self) -> BoolArray:
        """A shared read-only all-false mask (filters mark nothing with it, which the chain skips)."""
        mask: BoolArray | None = self.memo.get("all_false")
        if mask is None:
            mask = np.zeros(self.n, dtype=bool)
            mask.setflags(write=False)
            self.memo["all_false"] = mask
        return mask

    def model_mask(self, model: str) -> BoolArray:
        """Instances that serve ``model``: all of them for ``""``, else those naming it or naming none."""
        key = ("model_mask", model)
        mask: BoolArray | None = self.memo.get(key)
        if mask is None:
            if not model:
                mask = self.all_true()
            else:
                mask = np.fromiter((m in ("", model) for m in self.models), dtype=bool, count=self.n)
                mask.setflags(write=False)
            self.memo[key] = mask
        return mask


# One bit per InflightColumns row (field order), for masks of "which in-flight sums changed".
INFLIGHT_REQUESTS = 1 << 0
INFLIGHT_PREFILL_REQUESTS = 1 << 1
INFLIGHT_PREFILL_TOKENS = 1 << 2
INFLIGHT_DECODE_REQUESTS = 1 << 3
INFLIGHT_DECODE_TOKENS = 1 << 4
INFLIGHT_TOKENS = 1 << 5
INFLIGHT_ALL = (1 << 6) - 1


class InflightColumns(NamedTuple):
    """The router's in-flight dispatches per instance of a view (see :mod:`router.inflight`).

    ``requests`` and ``tokens`` count each request once per instance, whatever
    legs it has there; the prefill/decode columns count per leg. ``matrix``
    holds the six columns as its rows, in field order (read-only). Masks of
    changed columns use the ``INFLIGHT_*`` bits, one per row.
    """

    requests: FloatArray
    prefill_requests: FloatArray
    prefill_tokens: FloatArray
    decode_requests: FloatArray
    decode_tokens: FloatArray
    tokens: FloatArray
    #: How many instances of the view have at least one in-flight entry.
    instances_with_entries: int
    matrix: FloatArray

    @classmethod
    def of(cls, matrix: FloatArray) -> InflightColumns:
        """Columns over the rows of a (6, n) ``matrix`` (which becomes read-only)."""
        matrix.setflags(write=False)
        r = matrix
        return cls._make((r[0], r[1], r[2], r[3], r[4], r[5], int(np.count_nonzero(r[0])), matrix))


class LoadDelta(NamedTuple):
    """How a view's in-flight columns differ from those of an earlier in-flight version.

    ``memo`` is that version's ``load_memo``; ``changed`` maps each view index
    whose in-flight sums changed since to a mask of the ``INFLIGHT_*`` columns
    that changed there (a superset is allowed; unlisted indices are unchanged).
    """

    memo: dict[Any, Any]
    changed: Mapping[int, int]


@dataclass(frozen=True, eq=False)
class ClusterView:
    """What one decision sees: the snapshot's columns, the in-flight columns and the clock.

    ``status_age_s`` is each status's age at ``now_s``. ``load_memo`` caches
    values that depend on the snapshot and the in-flight account only; it is
    shared by every view built for the same (snapshot, in-flight version).
    ``load_previous`` (optional) says what changed since the previous version,
    so load-scoped metrics can be updated at those indices instead of
    recomputed. ``oldest_status_age_s`` (optional) is the largest
    ``status_age_s`` among instances with a status (``-inf`` without any), so
    freshness checks can skip the column when every status is fresh.
    """

    instances: InstanceTable
    inflight: InflightColumns
    now_s: float
    status_age_s: FloatArray
    load_memo: dict[Any, Any] = field(default_factory=dict, repr=False)
    load_previous: LoadDelta | None = field(default=None, repr=False)
    oldest_status_age_s: float | None = field(default=None, repr=False)

    def __init__(
        self,
        instances: InstanceTable,
        inflight: InflightColumns,
        now_s: float,
        status_age_s: FloatArray,
        load_memo: dict[Any, Any] | None = None,
        load_previous: LoadDelta | None = None,
        oldest_status_age_s: float | None = None,
    ) -> None:
        _set_attr(
            self,
            "__dict__",
            {
                "instances": instances,
                "inflight": inflight,
                "now_s": now_s,
                "status_age_s": status_age_s,
                "load_memo": {} if load_memo is None else load_memo,
                "load_previous": load_previous,
                "oldest_status_age_s": oldest_status_age_s,
            },
        )

    @property
    def n(self) -> int:
        return self.instances.n


# --------------------------------------------------------------------------- decision context


@dataclass(frozen=True)
class Reserves:
    """Adaptive PD's reserved instances as view indices (-1 = none)."""

    prefill: int = -1
    decode: int = -1


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
        "max_status_age_s",
        "predictors",
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
        self.reserves = NO_RESERVES
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
    """

    def prepare(self, ctx: DecisionContext) -> None: ...


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

    def __post_init__(self) -> None:
        labels = tuple(f.label for f in self.filters) + tuple(g.label for g in self.global_filters)
        relax = tuple(f.relax_pass for f in self.filters) + (0,) * len(self.global_filters)
        object.__setattr__(self, "labels", labels)
        object.__setattr__(self, "relax", relax)


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

    def spec(self, stage: Stage) -> StageSpec:
        if stage is Stage.PREFILL:
            return self.prefill
        if stage is Stage.DECODE:
            return self.decode
        if self.neutral is None:
            raise ValueError(f"policy {self.name!r} has no neutral stage")
        return self.neutral
