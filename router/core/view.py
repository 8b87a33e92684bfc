"""Building the columnar :class:`~router.core.columns.ClusterView` a decision works on.

Three layers, each cached as long as its inputs do not change:

* per snapshot — :class:`~router.core.columns.InstanceTable`: ids, endpoints, roles,
  node/unit codes, chunk budget ``M``, KV capacity, the status counters, and
  values derived from them (``InstanceTable.memo``). Rows are reused for
  instances whose metadata and status objects did not change between
  snapshots;
* per (snapshot, in-flight version) — the in-flight columns and
  ``ClusterView.load_memo``;
* per decision — the status ages at ``now_s``.

So a decision on an unchanged snapshot costs a few array operations here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
from slorouter.v1 import cms_pb2

from fleet.snapshot import ClusterSnapshot
from router.core.columns import (
    INFLIGHT_ROWS,
    ClusterView,
    FloatArray,
    InflightColumns,
    InstanceTable,
    LegList,
    LoadDelta,
    ResidentLegs,
    ResidentSource,
)
from router.core.inflight import InflightAccount
from router.core.protocols import dial_endpoint
from router.core.request import Role

_ROLE_BY_PROTO = {
    cms_pb2.INSTANCE_ROLE_PREFILL: Role.PREFILL,
    cms_pb2.INSTANCE_ROLE_DECODE: Role.DECODE,
    cms_pb2.INSTANCE_ROLE_NEUTRAL: Role.NEUTRAL,
}

# Status counters a table keeps, in row order; an instance without a status has the zero row.
_STATUS = (
    "has_status",
    "schedulable",
    "uncomputed_prefill_tokens",
    "decode_requests",
    "decode_tokens",
    "used_kv_tokens",
    "waiting_requests",
    "running_requests",
    "preemptions",
    "preemption_recompute_tokens",
)
# (NaN preemption counts: an instance without a status, or one that does not count them, reports none.)
_NO_STATUS = (0,) * (len(_STATUS) - 2) + (float("nan"), float("nan"))


def _measured_decode_step_ms(status: cms_pb2.InstanceStatus | None) -> float:
    """Mean duration of the status's step samples that decoded (the measured TPOT); NaN without any."""
    if status is None:
        return float("nan")
    total = 0.0
    count = 0
    for sample in status.step_samples:
        if sample.num_decode_requests > 0:
            total += sample.duration_ms
            count += 1
    return total / count if count else float("nan")


class _Meta(NamedTuple):
    """What a table keeps of one instance's metadata."""

    instance_id: str
    endpoint: str
    model: str
    node_id: str
    unit_id: str
    group: str
    role: int
    budget: int
    kv_capacity: int
    max_num_seqs: int


class _Layout(NamedTuple):
    """The metadata columns of a sequence of instances (shared by snapshots with the same metadata)."""

    metas: tuple[_Meta, ...]
    ids: tuple[str, ...]
    positions: dict[str, int]
    endpoints: tuple[str, ...]
    models: tuple[str, ...]
    node_ids: tuple[str, ...]
    unit_ids: tuple[str, ...]
    groups: tuple[str, ...]
    roles: npt.NDArray[np.int8]
    node_codes: npt.NDArray[np.intp]
    unit_codes: npt.NDArray[np.intp]
    id_rank: npt.NDArray[np.intp]
    max_num_batched_tokens: npt.NDArray[np.float64]
    kv_capacity_tokens: npt.NDArray[np.float64]
    max_num_seqs: npt.NDArray[np.float64]


def _codes(values: Sequence[str]) -> np.ndarray[Any, np.dtype[np.intp]]:
    """Number the distinct non-empty strings in order of appearance; "" → -1."""
    seen: dict[str, int] = {}
    out = np.fromiter(
        (seen.setdefault(v, len(seen)) if v else -1 for v in values), dtype=np.intp, count=len(values)
    )
    return out


def _readonly(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    array.setflags(write=False)
    return array


def _oldest_status_age(table: InstanceTable) -> float:
    """The largest snapshot-time status age among instances with a status (-inf without any)."""
    oldest: float | None = table.memo.get("oldest_status_age_s")
    if oldest is None:
        ages = table.status_age_s[table.has_status]
        oldest = table.memo["oldest_status_age_s"] = float(ages.max()) if len(ages) else -np.inf
    return oldest


class _Load(NamedTuple):
    """The in-flight columns and load memo of one (snapshot, account, version)."""

    account: InflightAccount
    version: int
    columns: InflightColumns
    memo: dict[Any, Any]


class _LastView(NamedTuple):
    view: ClusterView
    instances: InstanceTable
    account: InflightAccount | None
    version: int
    now_s: float


class ViewBuilder:
    """Builds views for one scheduler, caching per snapshot and per in-flight version.

    ``default_max_num_batched_tokens`` replaces a metadata chunk budget of 0;
    ``profile_label`` is the metadata label naming an instance's profile group.
    """

    def __init__(self, *, default_max_num_batched_tokens: int = 2048, profile_label: str = "profile") -> None:
        if default_max_num_batched_tokens < 1:
            raise ValueError(
                f"default_max_num_batched_tokens must be >= 1, got {default_max_num_batched_tokens}"
            )
        self.default_max_num_batched_tokens = default_max_num_batched_tokens
        self.profile_label = profile_label
        self._table: InstanceTable | None = None
        self._metas: dict[str, tuple[cms_pb2.InstanceMetadata, _Meta]] = {}
        self._last_layout: _Layout | None = None
        self._load: _Load | None = None
        #: The last view built and what it was built from; the status ages of the last (table, now_s).
        self._last_view: _LastView | None = None
        self._ages: tuple[InstanceTable, float, FloatArray, float] | None = None
        #: What the last table was built from (see ``_build_table``'s incremental path).
        self._rows: _Rows | None = None

    def table(self, snapshot: ClusterSnapshot) -> InstanceTable:
        """The per-snapshot columns (rebuilt only when handed a different snapshot object)."""
        table = self._table
        if table is not None and table.snapshot is snapshot:
            return table
        table = self._build_table(snapshot)
        self._table = table
        self._load = None
        return table

    def build(self, snapshot: ClusterSnapshot, inflight: InflightAccount | None, now_s: float) -> ClusterView:
        """The view of ``snapshot`` plus ``inflight`` at ``now_s`` (monotonic seconds, the snapshot's clock).

        Asked again for the same snapshot, account version and ``now_s`` (the
        decisions of one router queue pass), it returns the same view object:
        the same inputs give the same columns, and values a decision derives
        from the view alone (:func:`~router.core.metrics.advanced_backlog`)
        are then computed once for all of them.
        """
        last = self._last_view
        if (
            last is not None
            and last.now_s == now_s
            and last.instances.snapshot is snapshot
            and last.account is inflight
            and (inflight is None or last.version == inflight.version)
        ):
            return last.view
        table = self.table(snapshot)
        ages = self._ages
        if ages is not None and ages[0] is table and ages[1] == now_s:
            age, oldest = ages[2], ages[3]
        else:
            elapsed = snapshot.elapsed_s(now_s)  # frozen while the CMS is lost (static stability)
            age = _readonly(table.status_age_s + np.array(elapsed))  # (0-d: cheaper, the same sums)
            # The same float addition as in ``age``, and rounding is monotonic: the oldest age exactly.
            oldest = _oldest_status_age(table) + elapsed
            self._ages = (table, now_s, age, oldest)
        view = self._build(table, inflight, now_s, age, oldest)
        self._last_view = _LastView(
            view, view.instances, inflight, -1 if inflight is None else inflight.version, now_s
        )
        return view

    def _build(
        self,
        table: InstanceTable,
        inflight: InflightAccount | None,
        now_s: float,
        age: FloatArray,
        oldest: float,
    ) -> ClusterView:
        if inflight is None:
            columns, load_memo = self._no_inflight(table)
            return ClusterView(table, columns, now_s, age, load_memo, None, oldest)
        load = self._load
        previous = None
        changes = None
        if load is not None and load.account is inflight:
            if load.version == inflight.version:
                return ClusterView(
                    table,
                    load.columns,
                    now_s,
                    age,
                    load.memo,
                    None,
                    oldest,
                    _legs_of(inflight, table),
                )
            changes = inflight.changes_since(load.version)
        if load is not None and changes is not None and len(changes) <= max(8, table.n // 8):
            matrix = load.columns.matrix.copy()
            changed: dict[int, int] = {}
            index = table.index
            for instance_id, mask in changes.items():
                i = index.get(instance_id)
                if i is not None:
                    matrix[:, i] = inflight.totals_row(instance_id)
                    changed[i] = mask
            columns = InflightColumns.of(matrix)
            previous = LoadDelta._make((load.memo, changed))
        else:
            columns = inflight.columns(table.index, table.n)
        load = _Load._make((inflight, inflight.version, columns, {}))
        self._load = load
        return ClusterView(
            table,
            columns,
            now_s,
            age,
            load.memo,
            previous,
            oldest,
            _legs_of(inflight, table),
        )

    def _no_inflight(self, table: InstanceTable) -> tuple[InflightColumns, dict[Any, Any]]:
        found: tuple[InflightColumns, dict[Any, Any]] | None = table.memo.get("no_inflight")
        if found is None:
            found = (InflightColumns.of(np.zeros((INFLIGHT_ROWS, table.n))), {})
            table.memo["no_inflight"] = found
        return found

    def _meta(self, md: cms_pb2.InstanceMetadata) -> _Meta:
        # Metadata rarely changes: reuse the row while the message is equal to the one it came from.
        cached = self._metas.get(md.instance_id)
        if cached is not None and (cached[0] is md or cached[0] == md):
            return cached[1]
        meta = _Meta(
            md.instance_id,
            dial_endpoint(md.endpoint, md.worker_protocol),
            md.model,
            md.node_id,
            md.unit_id,
            md.labels.get(self.profile_label, ""),
            int(_ROLE_BY_PROTO.get(md.role, Role.NEUTRAL)),
            md.max_num_batched_tokens or self.default_max_num_batched_tokens,
            md.kv_capacity_tokens,
            md.max_num_seqs,
        )
        self._metas[md.instance_id] = (md, meta)
        return meta

    def _layout(self, metas: tuple[_Meta, ...]) -> _Layout:
        layout = self._last_layout
        if layout is not None and layout.metas == metas:
            return layout
        n = len(metas)
        ids = tuple(m.instance_id for m in metas)
        index = {instance_id: i for i, instance_id in enumerate(ids)}
        if len(index) != n:
            raise ValueError("snapshot holds duplicate instance ids")
        rank = np.empty(n, dtype=np.intp)
        rank[np.argsort(np.array(ids, dtype=object), kind="stable")] = np.arange(n)
        node_ids = tuple(m.node_id for m in metas)
        unit_ids = tuple(m.unit_id for m in metas)
        layout = _Layout(
            metas=metas,
            ids=ids,
            positions=index,
            endpoints=tuple(m.endpoint for m in metas),
            models=tuple(m.model for m in metas),
            node_ids=node_ids,
            unit_ids=unit_ids,
            groups=tuple(m.group for m in metas),
            roles=_readonly(np.fromiter((m.role for m in metas), dtype=np.int8, count=n)),
            node_codes=_readonly(_codes(node_ids)),
            unit_codes=_readonly(_codes(unit_ids)),
            id_rank=_readonly(rank),
            max_num_batched_tokens=_readonly(
                np.fromiter((m.budget for m in metas), dtype=np.float64, count=n)
            ),
            kv_capacity_tokens=_readonly(
                np.fromiter((m.kv_capacity for m in metas), dtype=np.float64, count=n)
            ),
            max_num_seqs=_readonly(
                np.fromiter((m.max_num_seqs or np.inf for m in metas), dtype=np.float64, count=n)
            ),
        )
        self._last_layout = layout
        if len(self._metas) > 2 * max(n, 64):
            self._metas = {k: v for k, v in self._metas.items() if k in index}
        return layout

    def _build_table(self, snapshot: ClusterSnapshot) -> InstanceTable:
        records = snapshot.instances
        n = len(records)
        statuses = [r.status for r in records]
        metadatas = [r.metadata for r in records]
        ages = np.fromiter((r.status_age_s for r in records), dtype=np.float64, count=n)
        rows = self._rows
        changed: list[int] | None = None
        if rows is not None and len(rows.statuses) == n and rows.metadatas == metadatas:
            # The same metadata objects in the same order (list equality tries identity first): the
            # layout holds; only the rows whose status object changed are read again.
            changed = [i for i, (a, b) in enumerate(zip(statuses, rows.statuses, strict=True)) if a is not b]
            if len(changed) > n // 4:
                changed = None
        if changed is not None and rows is not None:
            # Incremental: copy the previous columns and rewrite the touched rows in place. The
            # values written are those a full build computes, so the table is the same either way.
            layout = rows.layout
            numbers = rows.numbers.copy()
            measured = rows.measured.copy()
            for i in changed:
                numbers[i] = _status_row(statuses[i])
                measured[i] = _measured_decode_step_ms(statuses[i])
        else:
            layout = self._layout(tuple(self._meta(md) for md in metadatas))
            numbers = np.array([_status_row(st) for st in statuses], dtype=np.float64).reshape(
                n, len(_STATUS)
            )
            measured = np.fromiter(
                (_measured_decode_step_ms(st) for st in statuses), dtype=np.float64, count=n
            )
        self._rows = _Rows(layout, statuses, metadatas, numbers, measured)
        columns = numbers.T.copy()  # one row per status counter, each contiguous
        col = {name: _readonly(columns[k]) for k, name in enumerate(_STATUS)}
        has_status = _readonly(col["has_status"] > 0)
        return InstanceTable(
            snapshot=snapshot,
            ids=layout.ids,
            index=layout.positions,
            endpoints=layout.endpoints,
            models=layout.models,
            node_ids=layout.node_ids,
            unit_ids=layout.unit_ids,
            groups=layout.groups,
            roles=layout.roles,
            node_codes=layout.node_codes,
            unit_codes=layout.unit_codes,
            id_rank=layout.id_rank,
            max_num_batched_tokens=layout.max_num_batched_tokens,
            kv_capacity_tokens=layout.kv_capacity_tokens,
            has_status=has_status,
            schedulable=_readonly(has_status & (col["schedulable"] > 0)),
            status_age_s=_readonly(np.where(has_status, ages, np.inf)),
            uncomputed_prefill_tokens=col["uncomputed_prefill_tokens"],
            decode_requests=col["decode_requests"],
            decode_tokens=col["decode_tokens"],
            used_kv_tokens=col["used_kv_tokens"],
            waiting_requests=col["waiting_requests"],
            running_requests=col["running_requests"],
            measured_decode_step_ms=_readonly(measured),
            max_num_seqs=layout.max_num_seqs,
            preemptions=col["preemptions"],
            preemption_recompute_tokens=col["preemption_recompute_tokens"],
        )


def _status_row(st: cms_pb2.InstanceStatus | None) -> tuple[float, ...]:
    """One instance's status counters in ``_STATUS`` order (the zero row without a status)."""
    if st is None:
        return _NO_STATUS
    return (
        1,
        st.schedulable,
        st.num_uncomputed_prefill_tokens,
        st.num_decode_requests,
        st.num_decode_tokens,
        st.num_used_kv_tokens,
        st.num_waiting_requests,
        st.num_running_requests,
        st.num_preemptions if st.HasField("num_preemptions") else float("nan"),
        (
            st.num_preemption_recompute_tokens
            if st.HasField("num_preemption_recompute_tokens")
            else float("nan")
        ),
    )


class _Rows(NamedTuple):
    """What the last table was built from, so the next snapshot rewrites only the rows that changed.

    ``numbers`` holds the status counters one row per instance (``_STATUS`` order), ``measured``
    the measured decode step; both are private copies (the table's columns are read-only copies).
    """

    layout: _Layout
    statuses: list[cms_pb2.InstanceStatus | None]
    metadatas: list[cms_pb2.InstanceMetadata]
    numbers: FloatArray
    measured: FloatArray


def _legs_of(inflight: InflightAccount, table: InstanceTable) -> ResidentSource:
    """The resident legs of ``inflight`` on ``table``'s instances, built when asked (see ``ClusterView``)."""
    return _AccountLegs(inflight, table)


class _AccountLegs:
    """A :class:`ResidentSource` reading the in-flight account."""

    __slots__ = ("inflight", "table")

    def __init__(self, inflight: InflightAccount, table: InstanceTable) -> None:
        self.inflight = inflight
        self.table = table

    def legs(self) -> ResidentLegs | None:
        return self.inflight.resident_legs(self.table.index, self.table.n)

    def legs_on(self, index: int) -> LegList | None:
        found = self.inflight.resident_legs_on(self.table.ids[index])
        return None if found is None else [(float(c), float(r), s, float(k)) for c, r, s, k in found]
