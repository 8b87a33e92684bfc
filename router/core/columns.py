"""The columnar view a decision works on: per-snapshot instance columns plus in-flight load.

Every column is a numpy array over *all* instances of the view, in view order;
candidates are boolean masks or ascending index arrays into those columns.
:class:`InstanceTable` is cached per snapshot, :class:`ClusterView` adds the
router's in-flight account and the clock. Built by :mod:`router.core.view`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from fleet.snapshot import ClusterSnapshot

T = TypeVar("T")
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]
IntArray = npt.NDArray[np.intp]

# The decision core builds a few frozen dataclasses per decision (the view, the decision, its
# choices). Their generated __init__ sets each field with object.__setattr__, which costs more
# than the arithmetic of a small fleet's decision; these classes define an __init__ with the same
# signature that sets the instance __dict__ in one step (tests check the signatures match).
_set_attr = object.__setattr__


# --------------------------------------------------------------------------- the view

#: How many entries a table's memo may hold before :meth:`InstanceTable.constant` stops keeping
#: new columns (the values come from requests' prompts: bounded).
_MEMO_CONSTANTS_MAX = 4096


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
    #: Mean duration (ms) of the instance's recently reported engine steps that decoded (NaN: none
    #: reported). Optional: ``None`` when the source has no step measurements.
    measured_decode_step_ms: FloatArray | None = None
    #: 1 where the instance reports recent preemptions, else 0. Optional: ``None`` when the source
    #: does not report them (the safety valve then reads KV saturation instead).
    preempting: FloatArray | None = None
    #: Most requests each engine runs at once (``inf`` where unknown); beyond it a new request
    #: waits for a running one to finish before its prefill starts. Optional: ``None`` = unknown.
    max_num_seqs: FloatArray | None = None
    #: Requests each engine preempted since it started (its status's cumulative count; NaN where the
    #: instance does not report one). Optional: ``None`` when the source has no such counts.
    preemptions: FloatArray | None = None
    #: Tokens each engine computed again for the requests it preempted, less those its prefix cache
    #: still held, since it started (cumulative; NaN where not reported). Optional: ``None`` when the
    #: source has no such counts.
    preemption_recompute_tokens: FloatArray | None = None

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

    def constant(self, value: float) -> FloatArray:
        """A shared read-only column holding ``value`` (finite) at every instance.

        Kept with the snapshot (up to a bound), and known as constant: a selector
        ranking by it sees every candidate tie without comparing (:meth:`is_constant`).
        """
        key = ("constant", value)
        column: FloatArray | None = self.memo.get(key)
        if column is None:
            column = np.full(self.n, value)
            column.setflags(write=False)
            if len(self.memo) < _MEMO_CONSTANTS_MAX:
                self.memo[key] = column
                self.memo[("constant_id", id(column))] = column  # (held: the id stays its own)
        return column

    def is_constant(self, column: FloatArray) -> bool:
        """``column`` is one of :meth:`constant`'s (the same value everywhere)."""
        return self.memo.get(("constant_id", id(column))) is column

    def over_kv_capacity(self, values: FloatArray, empty: float) -> FloatArray:
        """``values / kv_capacity_tokens`` per instance, ``empty`` where an instance states no capacity.

        On a fleet where every instance states one (the usual case) this is one
        division: ``np.divide`` with ``where=`` and a filled ``out`` costs ten
        times more on a small fleet, and gives the same quotients where it divides.
        """
        capacity = self.kv_capacity_tokens
        everywhere: bool | None = self.memo.get("kv_capacity_everywhere")
        if everywhere is None:
            everywhere = self.memo["kv_capacity_everywhere"] = bool(np.count_nonzero(capacity > 0) == self.n)
        if everywhere:
            quotient: FloatArray = values / capacity
            return quotient
        out: FloatArray = np.divide(values, capacity, out=np.full(self.n, empty), where=capacity > 0)
        return out

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
INFLIGHT_RESIDENT_REQUESTS = 1 << 6
INFLIGHT_RESIDENT_TOKENS = 1 << 7
INFLIGHT_ALL = (1 << 8) - 1
#: Rows of the in-flight matrix (``InflightColumns.matrix``).
INFLIGHT_ROWS = 8


class InflightColumns(NamedTuple):
    """The router's in-flight dispatches per instance of a view (see :mod:`router.core.inflight`).

    ``requests`` and ``tokens`` count each request once per instance, whatever
    legs it has there; the prefill/decode columns count per leg. ``matrix``
    holds the columns as its rows, in field order (read-only). Masks of
    changed columns use the ``INFLIGHT_*`` bits, one per row.

    The two ``resident_*`` columns outlive admission: they hold, per
    instance, the decode legs the router placed there whose request has not
    ended yet (in flight or already reported), and the tokens their KV will
    reach at the end (context + expected remaining output), for packing over
    a request's life (:mod:`router.core.packing`). Legs placed without an
    expected length are not in them.
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
    resident_requests: FloatArray
    resident_tokens: FloatArray

    @classmethod
    def of(cls, matrix: FloatArray) -> InflightColumns:
        """Columns over the rows of an (8, n) ``matrix`` (which becomes read-only).

        A (6, n) matrix (no resident rows) is padded with zero resident rows.
        """
        if matrix.shape[0] < INFLIGHT_ROWS:
            matrix = np.vstack([matrix, np.zeros((INFLIGHT_ROWS - matrix.shape[0], matrix.shape[1]))])
        matrix.setflags(write=False)
        r = matrix
        return cls._make(
            (r[0], r[1], r[2], r[3], r[4], r[5], int(np.count_nonzero(r[0])), matrix, r[6], r[7])
        )


class LoadDelta(NamedTuple):
    """How a view's in-flight columns differ from those of an earlier in-flight version.

    ``memo`` is that version's ``load_memo``; ``changed`` maps each view index
    whose in-flight sums changed since to a mask of the ``INFLIGHT_*`` columns
    that changed there (a superset is allowed; unlisted indices are unchanged).
    """

    memo: dict[Any, Any]
    changed: Mapping[int, int]


class ResidentLegs(NamedTuple):
    """Every resident decode leg of a view, one entry per leg (see :mod:`router.core.packing`).

    ``instance`` is the leg's view index, ``context`` the tokens its KV holds
    now (prompt + tokens produced so far), ``remaining`` the tokens it is
    still expected to produce (≥ 0) and ``started`` whether it decodes on its
    instance already (a leg whose prefill or KV transfer is still under way
    starts after an unknown delay). A view carries a source of them only
    when its builder knows every resident leg's progress (the router's
    in-flight account, the simulator); without them packing falls back to the
    sums of :class:`InflightColumns`.
    """

    instance: IntArray
    context: FloatArray
    remaining: FloatArray
    started: BoolArray
    #: Output tokens each leg has produced so far (None when the source does not know its prompt).
    generated: FloatArray | None = None
    #: The TPOT each leg must keep on its instance, ms (its own TPOT target, or the pace its e2e
    #: deadline needs: :func:`router.core.packing.resident_tpot_need_ms`); inf where it was not
    #: recorded. None when the source records none.
    tpot_need_ms: FloatArray | None = None
    #: Whether each leg's recorded need is the pace its e2e deadline needs (over θ), not a TPOT
    #: target (:func:`router.core.packing.resident_tpot_need`). None when the source records none.
    tpot_paced: BoolArray | None = None
    #: When each leg's first output token came (s, the view's clock; nan where it is not known):
    #: the time since is the leg's decode time so far, Aladdin's ``t_dec`` of constraint (d).
    #: None when the source records none.
    first_token_s: FloatArray | None = None
    #: For a deadline-paced leg, the output length (tokens) its pace spreads its deadline over: the
    #: length the pace was set by when it was placed (:func:`router.core.packing.resident_tpot_pacing`:
    #: the length predictor's cautious bound, or the expected length). nan where the leg is not
    #: paced or the length is not known; None when the source records none.
    paced_tokens: FloatArray | None = None
    #: Tokens of each leg's prompt its instance's prefix cache held when the leg was placed there (the
    #: decision's count; 0 where none was counted or the KV came from another instance). Blocks a
    #: prompt shares with other requests are held once in the engine's KV however many reference
    #: them, so the exact KV peak counts only the rest of a started leg's context as its own. None
    #: when the source records none.
    cached: FloatArray | None = None


#: One instance's resident legs: (context now, output still expected, started, prompt tokens cached
#: at placement) each.
LegList = list[tuple[float, float, bool, float]]


class ResidentSource(Protocol):
    """Where a view's :class:`ResidentLegs` come from, built only when asked.

    ``legs`` gives every leg; ``legs_on`` those of one view index (packing
    updates one instance's peak after a change there). Either is None when the
    source does not know every leg's progress.
    """

    def legs(self) -> ResidentLegs | None: ...

    def legs_on(self, index: int) -> LegList | None: ...


@dataclass(frozen=True)
class StaticResidents:
    """A :class:`ResidentSource` over legs known up front."""

    known: ResidentLegs

    def legs(self) -> ResidentLegs:
        return self.known

    def legs_on(self, index: int) -> LegList:
        instance, context, remaining, started = self.known[:4]
        mine = instance == index
        cached = self.known.cached
        shared = cached[mine].tolist() if cached is not None else [0.0] * int(mine.sum())
        return list(
            zip(context[mine].tolist(), remaining[mine].tolist(), started[mine].tolist(), shared, strict=True)
        )


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
    ``residents`` (optional) builds the :class:`ResidentLegs` on demand (only
    adaptive PD's exact KV peak reads them, so other policies pay nothing).
    """

    instances: InstanceTable
    inflight: InflightColumns
    now_s: float
    status_age_s: FloatArray
    load_memo: dict[Any, Any] = field(default_factory=dict, repr=False)
    load_previous: LoadDelta | None = field(default=None, repr=False)
    oldest_status_age_s: float | None = field(default=None, repr=False)
    residents: ResidentSource | None = field(default=None, repr=False)

    def __init__(
        self,
        instances: InstanceTable,
        inflight: InflightColumns,
        now_s: float,
        status_age_s: FloatArray,
        load_memo: dict[Any, Any] | None = None,
        load_previous: LoadDelta | None = None,
        oldest_status_age_s: float | None = None,
        residents: ResidentSource | None = None,
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
                "residents": residents,
            },
        )

    @property
    def n(self) -> int:
        return self.instances.n

    def resident_legs(self) -> ResidentLegs | None:
        """Every resident decode leg with its progress, or None when the view's source does not know them."""
        source = self.residents
        return None if source is None else source.legs()

    def resident_legs_on(self, index: int) -> LegList | None:
        """The resident legs of view index ``index``, or None when the view's source does not know them."""
        source = self.residents
        return None if source is None else source.legs_on(index)
