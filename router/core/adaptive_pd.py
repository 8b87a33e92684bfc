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

The decode set's size (:class:`DecodeShare`, Aladdin's worker-count model,
seed 001, applied to one fleet instead of a fleet size): from the load it
placed over the last minute, the instances prefill and decode keep busy (the
throughput model of :mod:`router.core.capacity`), and of the usable instances
the decode share of that demand may hold decode work, rounded (at least the
whole decode demand while prefill's demand fits beside it). Only
decode-idle instances prefill, so each decoder past that share is prefill
capacity a saturated fleet lacks, and one short of it starves decode; in
overload both sides are saturated and the split that serves the most is
the one in proportion to their demands (the placed rate cancels out, so it
holds while the fleet places less than arrives). The
``prefill_room`` filter applies it.

Loads include the router's in-flight dispatches. A reserve is re-elected at
once — in the same decision — when it disappears from the view, becomes
unschedulable or goes stale; with a single usable instance only the reserved
decode is held. Reserves are kept per model and changed only by committed
(not dry-run) decisions.
"""

from __future__ import annotations

import math

import numpy as np

from router.core.capacity import LoadShape, LoadTracker, decode_batch, median_seq_cap, role_demand
from router.core.columns import BoolArray, InstanceTable
from router.core.config import SchedulerConfig
from router.core.packing import expected_output_tokens
from router.core.plugins import DecisionContext, Reserves
from router.core.request import ScheduleInput

#: Placements :class:`DecodeShare` needs in its window before it sizes the decode set.
MIN_OBSERVED = 20
#: How often (s, the decisions' clock) :class:`DecodeShare` re-fits the throughput model.
REFIT_S = 1.0


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

    def dispatched(self, request: ScheduleInput, now_s: float) -> None:
        """Nothing to do: the reserves change only with the decisions' commits."""

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
        index = eligible.nonzero()[0]  # (np.flatnonzero's result, with a cheaper call)
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


class DecodeShare:
    """A policy hook sizing adaptive PD's decode set by the demand placed (see the module doc).

    Sets ``ctx.reserves.max_decoders`` (after :class:`ReserveElection`). The
    demand is the model of :mod:`router.core.capacity` on the load observed
    over ``window_s`` (each dispatched placement's prompt and expected output),
    with the default profile, the TPOT target, the packing strictness and
    threshold, and the median KV capacity of the usable instances.
    """

    def __init__(self, config: SchedulerConfig, window_s: float = 60.0) -> None:
        self.config = config
        self.load = LoadTracker(window_s)
        self._fitted_at = -math.inf
        #: (prefill, decode) instances the observed load keeps busy (None: not enough seen yet).
        self.demand: tuple[float, float] | None = None

    def dispatched(self, request: ScheduleInput, now_s: float) -> None:
        # Observed at dispatch, not on commit: the router queue drops committed decisions (a late
        # or yielding request offered a fallback placement keeps waiting and is offered again),
        # and counting each offer inflated the placed rate in overload several times over.
        output = expected_output_tokens(request, self.config.packing_default_output_tokens)
        self.load.observe(now_s, request.prompt_tokens, output)

    def prepare(self, ctx: DecisionContext) -> None:
        request = ctx.request
        now = ctx.view.now_s
        if ctx.predictors is None:
            return
        if now - self._fitted_at >= REFIT_S or now < self._fitted_at:
            self._fitted_at = now
            self.demand = self._fit(ctx, self.load.shape(now))
        if self.demand is None:
            return
        usable = ctx.usable()
        if request is not None and request.model:
            usable = usable & ctx.view.instances.model_mask(request.model)
        cap = decoder_cap(int(np.count_nonzero(usable)), *self.demand)
        held = ctx.reserves  # (built directly: dataclasses.replace costs several times more per decision)
        ctx.reserves = Reserves(held.prefill, held.decode, float(cap))

    def _fit(self, ctx: DecisionContext, shape: LoadShape) -> tuple[float, float] | None:
        assert ctx.predictors is not None
        if len(self.load) < MIN_OBSERVED or shape.rate <= 0:
            return None
        table = ctx.view.instances
        capacity = table.kv_capacity_tokens[table.kv_capacity_tokens > 0]
        seqs = table.max_num_seqs
        config = self.config
        predictor = ctx.predictors.default
        batch, step_ms = decode_batch(
            predictor,
            shape,
            tpot_target_ms=config.tpot_slo_ms,
            strictness=config.tpot_packing_strictness,
            threshold=config.tpot_binpack_threshold,
            kv_capacity_tokens=float(np.median(capacity)) if len(capacity) else 65536.0,
            kv_headroom=config.kv_packing_headroom,
            # A decoder runs at most its engine's cap: past it, decode needs more instances than
            # the TPOT and KV bounds say (6-sequence engines, 1 + 2 P/D: one decoder was judged
            # enough, and the legs waited for its slots).
            max_batch=median_seq_cap(seqs.tolist() if seqs is not None else ()),
        )
        return role_demand(predictor, shape, batch, step_ms)


def decoder_cap(instances: int, prefill: float, decode: float) -> int:
    """How many of ``instances`` may hold decode work when the load keeps ``prefill`` and ``decode``
    instances busy: the decode share of the demand, rounded, and at least the whole decode demand
    while the prefill demand fits beside it; within [1, instances]."""
    if instances <= 0:
        return 0
    total = prefill + decode
    if not total > 0:
        return instances
    cap = round(instances * decode / total)
    whole = math.ceil(decode)
    if whole + prefill <= instances:
        cap = max(cap, whole)
    return max(1, min(instances, cap))
