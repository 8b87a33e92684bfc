"""Property tests of the scheduling core on random fleets (hypothesis)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet.snapshot import ClusterSnapshot
from router.core.config import SchedulerConfig
from router.core.decision import Decision
from router.core.errors import EmptyClusterError, NoInstanceError, SchedulingError
from router.core.packing import prefill_room_mask
from router.core.plugins import GlobalFilter
from router.core.registry import FILTERS, Params
from router.core.request import ScheduleInput
from router.core.rng import PeekableRandom
from router.core.scheduler import Scheduler
from tests.router.core.helpers import NOW, inst, make_predictor, make_snapshot

PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LP = make_predictor()


@st.composite
def fleets(draw: st.DrawFn, roles: tuple[str, ...] = ("prefill", "decode", "neutral")) -> ClusterSnapshot:
    n = draw(st.integers(1, 8))
    records = []
    for k in range(n):
        batch = draw(st.integers(0, 20))
        records.append(
            inst(
                f"i{k}",
                draw(st.sampled_from(roles)),
                age_s=draw(st.sampled_from([0.0, 0.01, 0.2, 1.0, 4.9, 6.0])),
                status=draw(st.booleans()) or k > 0,
                schedulable=draw(st.integers(0, 9)) > 0,
                prefill_tokens=draw(st.sampled_from([0, 0, 100, 700, 3000])),
                decode_requests=batch,
                decode_tokens=batch * draw(st.integers(0, 900)),
                waiting=draw(st.integers(0, 3)),
                running=draw(st.integers(0, 3)),
                used_kv_tokens=draw(st.integers(0, 90_000)),
                meta={
                    "node_id": draw(st.sampled_from(["", "n1", "n2"])),
                    "unit_id": draw(st.sampled_from(["", "u1"])),
                    "max_num_batched_tokens": draw(st.sampled_from([256, 512, 2048])),
                },
            )
        )
    return make_snapshot(*records)


requests = st.builds(
    ScheduleInput,
    request_id=st.sampled_from(["r1", "r2"]),
    prompt_tokens=st.integers(0, 3000),
    ttft_slo_ms=st.sampled_from([0.0, 80.0, 400.0]),
    tpot_slo_ms=st.sampled_from([0.0, 14.0, 30.0]),
)
inflight_ops = st.lists(
    st.tuples(st.integers(0, 7), st.integers(0, 7), st.integers(0, 2000), st.booleans()), max_size=6
)
policies = st.sampled_from(
    [
        {"scheduling_policy": "slo"},
        {"scheduling_policy": "slo", "enable_adaptive_pd": True},
        {"scheduling_policy": "load-balance", "dispatch_neutral_load_threshold": 500.0},
        {"scheduling_policy": "round-robin"},
        {"scheduling_policy": "least-requests"},
        {"scheduling_policy": "power-of-two"},
        {"scheduling_policy": "slo", "dispatch_top_k": 2, "failover_domain": "node-unit"},
    ]
)


def scheduler(
    config: dict[str, Any],
    snap: ClusterSnapshot,
    ops: list[tuple[int, int, int, bool]],
    seed: int = 0,
    *,
    peekable: bool = False,
) -> Scheduler:
    rng = PeekableRandom(seed) if peekable else random.Random(seed)
    s = Scheduler(SchedulerConfig(**config), LP, rng)
    n = len(snap.instances)
    for k, (a, b, tokens, pd) in enumerate(ops):
        ida, idb = f"i{a % n}", f"i{b % n}"
        s.inflight.record(f"x{k}", ida, idb if pd else ida, tokens, NOW - 0.1)
    return s


def try_schedule(s: Scheduler, snap: ClusterSnapshot, request: ScheduleInput) -> Decision | SchedulingError:
    try:
        return s.schedule(snap, request, NOW)
    except SchedulingError as exc:
        return exc


@PROPS
@given(fleets(), requests, inflight_ops, policies)
def test_selected_instances_pass_every_filter_unless_a_fallback_ran(snap, request, ops, config) -> None:  # type: ignore[no-untyped-def]
    s = scheduler(config, snap, ops)
    result = try_schedule(s, snap, request)
    if isinstance(result, SchedulingError):
        return
    usable = result.context.usable()
    for outcome in result.outcomes:
        assert outcome.selected >= 0
        assert usable[outcome.selected]
        position = outcome.candidates.tolist().index(outcome.selected)
        drop_any = outcome.first_drop(every_filter=True)[position]
        drop_active = outcome.first_drop()[position]
        assert drop_active == -1
        if outcome.fallback_pass == 0:
            assert drop_any == -1
        else:
            # Only filters the fallback pass relaxed may have dropped it.
            assert outcome.relax[drop_any] != 0


@PROPS
@given(fleets(), requests, inflight_ops, st.sampled_from(["instance", "node", "unit", "node-unit"]))
def test_adaptive_pd_returns_while_any_healthy_instance_keeps_the_targets(snap, request, ops, domain) -> None:  # type: ignore[no-untyped-def]
    s = scheduler(
        {"scheduling_policy": "slo", "enable_adaptive_pd": True, "failover_domain": domain}, snap, ops
    )
    ctx = s.context(s.view(snap, NOW), request)
    for hook in s.policy.hooks:  # the reserves the decision sees (nothing is committed)
        hook.prepare(ctx)
    table = ctx.view.instances
    usable = ctx.usable()
    # Healthy: usable and outside the failure domain of every unschedulable or stale instance.
    marked = table.has_status & ~usable
    failover = FILTERS.create("failover", s.config, Params("failover"))
    assert isinstance(failover, GlobalFilter)
    healthy = usable & failover.apply_global(ctx, marked)
    result = try_schedule(s, snap, request)
    if np.count_nonzero(healthy) and isinstance(result, NoInstanceError):
        # Refused only because every healthy instance would break a promise (prefill: its TTFT, or
        # a chunk beside decode while a decode-idle instance exists; decode: its TPOT or KV over
        # life): the request waits in the router queue, as under slo.
        batch = ctx.metric("decode_batch_size")
        if result.stage == "prefill":
            idle_exists = bool(np.count_nonzero(usable & (batch == 0)))
            kept = (ctx.metric("predicted_ttft") < ctx.ttft_slo_ms) & ((batch == 0) | (not idle_exists))
        else:
            # ... or would turn a decode-idle instance the prefill side cannot spare into a decoder.
            kept = (
                (ctx.metric("predicted_tpot") < ctx.tpot_slo_ms)
                & (ctx.metric("kv_peak_projected") < s.config.kv_packing_headroom)
                & prefill_room_mask(ctx)
            )
        assert not np.count_nonzero(kept & healthy), result
    elif np.count_nonzero(healthy):
        assert isinstance(result, Decision), result
        assert result.prefill is not None and result.decode is not None
        for choice in (result.prefill, result.decode):
            assert healthy[table.index[choice.instance_id]]
    elif not np.count_nonzero(usable):
        assert isinstance(result, EmptyClusterError)
    else:
        assert isinstance(result, NoInstanceError)


@PROPS
@given(fleets(), st.lists(requests, min_size=1, max_size=5), inflight_ops, policies, st.integers(0, 3))
def test_decisions_are_deterministic_for_a_fixed_seed(snap, reqs, ops, config, seed) -> None:  # type: ignore[no-untyped-def]
    def run() -> list[object]:
        s = scheduler(config, snap, ops, seed=seed)
        out: list[object] = []
        for k, request in enumerate(reqs):
            result = try_schedule(s, snap, request)
            if isinstance(result, Decision):
                s.record(result, NOW + k)
                out.append(
                    (result.instance_ids, [(e.instance_id, e.dropped_by, e.selected) for e in result.trace])
                )
            else:
                out.append(type(result).__name__)
        return out

    assert run() == run()


@PROPS
@given(fleets(), requests, inflight_ops, policies, st.booleans())
def test_dry_run_predicts_the_real_decision(snap, request, ops, config, peekable) -> None:  # type: ignore[no-untyped-def]
    # Both random sources: a copy of a plain Random's state, and a PeekableRandom read ahead.
    s = scheduler(config, snap, ops, seed=4, peekable=peekable)
    dry = try_schedule_dry(s, snap, request)
    again = try_schedule_dry(s, snap, request)
    real = try_schedule(s, snap, request)
    if isinstance(dry, Decision):
        assert isinstance(again, Decision) and dry.instance_ids == again.instance_ids
    if isinstance(dry, Decision):
        assert isinstance(real, Decision) and dry.instance_ids == real.instance_ids
    else:
        assert type(dry) is type(real)


def try_schedule_dry(
    s: Scheduler, snap: ClusterSnapshot, request: ScheduleInput
) -> Decision | SchedulingError:
    try:
        return s.schedule(snap, request, NOW, dry_run=True)
    except SchedulingError as exc:
        return exc


def reference_backlog(p0: float, m: float, batch: float, tokens: float, age_s: float) -> float:
    """The step model, one instance at a time, written independently of the vectorised code."""
    step = LP.predict_tpot_ms(batch, tokens)
    remaining, elapsed = p0, age_s * 1000.0
    while remaining > 0:
        chunk = min(remaining, m)
        cost = LP.predict_ttft_ms(chunk, 0, 0, m) + step
        if cost <= 0:
            remaining -= chunk
            continue
        if elapsed >= cost:
            elapsed -= cost
            remaining -= chunk
        else:
            remaining -= chunk * elapsed / cost
            break
    return max(remaining, 0.0)


@PROPS
@given(fleets(), requests, inflight_ops)
def test_columns_equal_per_instance_computation(snap, request, ops) -> None:  # type: ignore[no-untyped-def]
    s = scheduler({"scheduling_policy": "slo"}, snap, ops)
    view = s.view(snap, NOW)
    ctx = s.context(view, request)
    p = request.prompt_tokens
    ttft, tpot = ctx.metric("predicted_ttft"), ctx.metric("predicted_tpot")
    backlog = ctx.metric("prefill_backlog_tokens")
    for i, record in enumerate(snap.instances):
        totals = s.inflight.totals(record.instance_id)
        st_ = record.status
        m = float(record.metadata.max_num_batched_tokens)
        if st_ is None:
            d, t, p0, age = 0.0, 0.0, 0.0, 0.0
        else:
            d, t, p0, age = (
                st_.num_decode_requests,
                st_.num_decode_tokens,
                st_.num_uncomputed_prefill_tokens,
                record.status_age_s,
            )
        batch, tokens = d + totals.decode_requests, t + totals.decode_tokens
        expected_backlog = reference_backlog(p0, m, d, t, age) + totals.prefill_tokens
        assert abs(backlog[i] - expected_backlog) <= 1e-6 * max(1.0, expected_backlog)
        # The predictions are exactly the predictor's scalar results on the metric inputs.
        assert ttft[i] == LP.predict_ttft_ms(float(backlog[i]) + p, batch, tokens, m)
        assert tpot[i] == LP.predict_tpot_ms(batch + 1, tokens + p)
        assert (
            ctx.metric("num_requests")[i]
            == ((st_.num_waiting_requests + st_.num_running_requests) if st_ is not None else 0)
            + totals.requests
        )


@PROPS
@given(fleets(roles=("neutral",)), requests, policies)
def test_slo_never_places_above_a_non_droppable_threshold(snap, request, config) -> None:  # type: ignore[no-untyped-def]
    if config.get("enable_adaptive_pd") or config["scheduling_policy"] != "slo":
        return
    s = scheduler(config, snap, [])
    result = try_schedule(s, snap, request)
    if isinstance(result, NoInstanceError):
        assert result.stage == "neutral"
        return
    if isinstance(result, Decision):
        assert result.decode is not None
        ctx = result.context
        assert result.decode.predicted_ttft_ms < ctx.ttft_slo_ms * s.config.ttft_slo_dispatch_threshold
        assert result.decode.predicted_tpot_ms < ctx.tpot_slo_ms * s.config.tpot_slo_dispatch_threshold


@PROPS
@given(fleets(), requests, inflight_ops, policies, st.integers(1, 9))
def test_trace_top_is_the_head_of_the_full_trace_in_its_order(snap, request, ops, config, limit) -> None:  # type: ignore[no-untyped-def]
    s = scheduler(config, snap, ops)
    result = try_schedule(s, snap, request)
    if isinstance(result, SchedulingError):
        return
    full = result.trace
    top = result.trace_top(limit)
    assert result.trace_top(0) == full
    for outcome in result.outcomes:
        stage_full = [e for e in full if e.stage is outcome.stage]
        stage_top = [e for e in top if e.stage is outcome.stage]
        assert len(stage_top) == min(limit, len(stage_full))
        # Its entries are the full trace's, selected one first.
        assert all(e in stage_full for e in stage_top)
        assert stage_top[0].selected
        # The order, computed independently: the selected one, then survivors, then the candidates
        # a later filter dropped, each by the stage's prediction (NaN last), ties in view order.
        labels = list(outcome.labels)

        def key(pos_entry: tuple[int, Any], labels: list[str] = labels, stage: Any = outcome.stage) -> Any:
            pos, e = pos_entry
            depth = len(labels) if not e.dropped_by else labels.index(e.dropped_by)
            value = e.predicted_tpot_ms if stage.value == "decode" else e.predicted_ttft_ms
            return (not e.selected, -depth, value if value == value else float("inf"), pos)

        expected = [e for _, e in sorted(enumerate(stage_full), key=key)[:limit]]
        assert stage_top == expected
