"""Adaptive PD's reserve election: one reserved-prefill and one distinct reserved-decode instance.

Under adaptive PD every instance may take either role per request. Two
instances are kept in reserve so both stages always have a home: the
reserved decode never takes prefill (unless nothing else can) and the reserved
prefill never takes decode (likewise); see the ``adaptive-pd`` policy.

Election, among usable instances (a status, fresh, schedulable) serving the
request's model, deterministic for a given view:

* reserved decode — prefer no prefill backlog; then the smallest backlog;
  then an instance that already decodes; then the lowest instance id;
* reserved prefill (a different instance) — prefer no decode load; then the
  smallest decode batch; then the smallest prefill backlog; then the lowest id.

Loads include the router's in-flight dispatches. A reserve is re-elected at
once — in the same decision — when it disappears from the view, becomes
unschedulable or goes stale; with a single usable instance only the reserved
decode is held. Reserves are kept per model and changed only by committed
(not dry-run) decisions.
"""

from __future__ import annotations

import numpy as np

from router.core.columns import BoolArray, InstanceTable
from router.core.plugins import DecisionContext, Reserves


def _still_usable(table: InstanceTable, usable: BoolArray, instance_id: str | None) -> int:
    if instance_id is None:
        return -1
    i = table.index.get(instance_id)
    return i if i is not None and usable[i] else -1


class ReserveElection:
    """A policy hook holding adaptive PD's reserves (see the module doc)."""

    def __init__(self) -> None:
        #: model -> (reserved prefill id, reserved decode id)
        self.reserved: dict[str, tuple[str | None, str | None]] = {}
        # Reserves rarely change: one Reserves object per pair of indices.
        self._reserves: dict[tuple[int, int], Reserves] = {}

    def prepare(self, ctx: DecisionContext) -> None:
        table = ctx.view.instances
        model = ctx.request.model if ctx.request is not None else ""
        usable = ctx.usable() & table.model_mask(model) if model else ctx.usable()
        held = self.reserved.get(model, (None, None))
        prefill = _still_usable(table, usable, held[0])
        decode = _still_usable(table, usable, held[1])
        if prefill == decode:
            prefill = -1
        if decode < 0:
            decode = self._elect(ctx, usable, prefill, decode=True)
        if prefill < 0:
            prefill = self._elect(ctx, usable, decode, decode=False)
        reserves = self._reserves.get((prefill, decode))
        if reserves is None:
            if len(self._reserves) > 64:
                self._reserves.clear()
            reserves = self._reserves[(prefill, decode)] = Reserves(prefill=prefill, decode=decode)
        ctx.reserves = reserves
        ids = (table.ids[prefill] if prefill >= 0 else None, table.ids[decode] if decode >= 0 else None)
        if ids != held:
            ctx.on_commit(lambda: self.reserved.__setitem__(model, ids))

    @staticmethod
    def _elect(ctx: DecisionContext, usable: BoolArray, other: int, *, decode: bool) -> int:
        eligible = usable.copy()
        if other >= 0:
            eligible[other] = False
        index = np.flatnonzero(eligible)
        if len(index) == 0:
            return -1
        backlog = ctx.metric("prefill_backlog_tokens")[index]
        batch = ctx.metric("decode_batch_size")[index]
        rank = ctx.view.instances.id_rank[index]
        if decode:
            order = np.lexsort((rank, batch == 0, backlog, backlog > 0))
        else:
            order = np.lexsort((rank, backlog, batch, batch > 0))
        return int(index[order[0]])
