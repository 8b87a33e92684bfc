"""The scheduling core's shortcuts equal the general computations they stand in for.

Each shortcut skips work on the hot path (a column that would not change, a
comparison whose result is known); these properties check it gives exactly
what the general path gives, on random inputs.
"""

from __future__ import annotations

import dataclasses
import inspect
import random

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet.snapshot import ClusterSnapshot
from router.core.columns import INFLIGHT_ALL, ClusterView
from router.core.decision import Choice, Decision
from router.core.inflight import InflightAccount
from router.core.request import ScheduleInput, Stage, Targets
from router.core.scheduler import Scheduler
from router.core.selectors import _best_ties
from router.placement import PlacementRequest
from tests.router.core.helpers import NOW, inst, make_predictor, make_request, make_scheduler, make_snapshot

PROPS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------- in-flight change masks

_legs = st.tuples(
    st.sampled_from(["r1", "r2", "r3", "r4", "r5"]),
    st.sampled_from([None, "A", "B", "C"]),
    st.sampled_from([None, "A", "B", "C"]),
    st.integers(0, 50),
    st.booleans(),
)


def _sums(acc: InflightAccount, instance_id: str) -> tuple[int, ...]:
    t = acc.totals(instance_id)
    return (t.requests, t.prefill_requests, t.prefill_tokens, t.decode_requests, t.decode_tokens, t.tokens)


@PROPS
@given(st.lists(_legs, max_size=12), st.lists(_legs, max_size=12))
def test_change_masks_cover_every_column_that_changed(before, after) -> None:  # type: ignore[no-untyped-def]
    acc = InflightAccount()

    def apply(ops) -> None:  # type: ignore[no-untyped-def]
        for request_id, prefill, decode, tokens, release in ops:
            if release:
                acc.release(request_id)
            else:
                acc.record(request_id, prefill, decode, tokens, now_s=0.0)

    apply(before)
    version = acc.version
    old = {i: _sums(acc, i) for i in "ABC"}
    apply(after)
    changes = acc.changes_since(version)
    assert changes is not None
    assert set(changes) == acc.changed_since(version)
    for instance_id in "ABC":
        mask = changes.get(instance_id, 0)
        assert mask & ~INFLIGHT_ALL == 0
        new = _sums(acc, instance_id)
        for column in range(6):
            if old[instance_id][column] != new[column]:
                assert mask & (1 << column), (instance_id, column, changes)


# ----------------------------------------------------------------------------- load metrics, incrementally


@PROPS
@given(st.lists(_legs, min_size=1, max_size=30), st.sampled_from([False, True]))
def test_incremental_load_metrics_equal_a_full_recompute(ops, pd) -> None:  # type: ignore[no-untyped-def]
    roles = ("prefill", "decode", "prefill") if pd else ("neutral",) * 3
    snap = make_snapshot(
        *(
            inst(i, role, decode_requests=k, decode_tokens=300 * k)
            for k, (i, role) in enumerate(zip("ABC", roles, strict=True))
        )
    )
    s = make_scheduler("slo")
    names = ["decode_batch_size", "decode_tokens", "decode_step_ms", "kv_usage_projected", "num_requests"]
    for request_id, prefill, decode, tokens, release in ops:
        if release:
            s.inflight.release(request_id)
        else:
            s.inflight.record(request_id, prefill, decode, tokens, now_s=NOW)
        ctx = s.context(s.view(snap, NOW), make_request(prompt_tokens=tokens))
        fresh = Scheduler(s.config, make_predictor(), random.Random(0), inflight=s.inflight)
        ref = fresh.context(fresh.view(snap, NOW), make_request(prompt_tokens=tokens))
        for name in [*names, "predicted_ttft", "predicted_tpot"]:
            assert np.array_equal(ctx.metric(name), ref.metric(name)), name


# ----------------------------------------------------------------------------- freshness


@PROPS
@given(
    st.lists(st.tuples(st.booleans(), st.floats(0.0, 8.0), st.booleans()), min_size=1, max_size=8),
    st.floats(0.0, 4.0),
    st.sampled_from([0.5, 1.0, 5.0]),
)
def test_freshness_shortcut_equals_the_age_comparison(records, elapsed_s, limit_s) -> None:  # type: ignore[no-untyped-def]
    snap = make_snapshot(
        *(
            inst(f"i{k}", age_s=age, status=has_status or k == 0, schedulable=schedulable)
            for k, (has_status, age, schedulable) in enumerate(records)
        ),
        taken_at_s=NOW,
    )
    s = make_scheduler("slo", instance_staleness_s=limit_s)
    view = s.view(snap, NOW + elapsed_s)
    ctx = s.context(view, make_request())
    expected = view.status_age_s <= limit_s
    assert ctx.fresh().tolist() == expected.tolist()
    assert ctx.fresh(limit_s / 2).tolist() == (view.status_age_s <= limit_s / 2).tolist()
    assert ctx.usable().tolist() == (view.instances.schedulable & expected).tolist()
    # The same view without the oldest-age hint takes the general path.
    plain = ClusterView(view.instances, view.inflight, view.now_s, view.status_age_s)
    assert s.context(plain, make_request()).fresh().tolist() == expected.tolist()


# ----------------------------------------------------------------------------- selection


@PROPS
@given(
    st.lists(st.sampled_from([0.0, -0.0, 1.0, 2.5, -3.0, float("nan"), float("inf")]), min_size=1, max_size=9)
)
def test_highest_ties_are_the_lowest_ties_of_the_negation(values) -> None:  # type: ignore[no-untyped-def]
    v = np.array(values)
    candidates = np.arange(len(v)) * 3
    assert _best_ties(v, candidates, highest=True).tolist() == _best_ties(-v, candidates).tolist()


# ----------------------------------------------------------------------------- decisions


def test_hand_written_inits_match_the_dataclass_fields() -> None:
    for cls in (Choice, Decision, ClusterView, ScheduleInput, PlacementRequest, Targets):
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
        fields = [f for f in dataclasses.fields(cls) if f.init]
        assert [p.name for p in params] == [f.name for f in fields], cls
        for p, f in zip(params, fields, strict=True):
            if f.default is not dataclasses.MISSING:
                assert p.default == f.default, (cls, f.name)
            elif f.default_factory is not dataclasses.MISSING:
                assert p.default is None, (cls, f.name)  # None stands for "a fresh default"
            else:
                assert p.default is inspect.Parameter.empty, (cls, f.name)
    choice = Choice("a", "a:1", Stage.PREFILL, 1.0, 2.0)
    assert dataclasses.replace(choice, fallback_pass=1) == Choice("a", "a:1", Stage.PREFILL, 1.0, 2.0, 1)
    assert choice == Choice("a", "a:1", Stage.PREFILL, 1.0, 2.0) and choice.fallback_pass == 0


@PROPS
@given(st.integers(0, 2**31), st.sampled_from(["slo", "adaptive-pd", "load-balance", "least-requests"]))
def test_decisions_on_a_loaded_fleet_match_a_scheduler_without_caches(seed, policy) -> None:  # type: ignore[no-untyped-def]
    """Decisions with every cache warm equal decisions recomputed from scratch, step by step.

    (Including what is kept across decisions: the survivors of the per-snapshot masks and a
    lowest selector's ties while its load-scoped column stays the same.)
    """
    adaptive = policy == "adaptive-pd"
    rng = random.Random(seed)
    snap = make_snapshot(
        *(
            inst(
                f"i{k}",
                "prefill" if k % 2 == 0 else "decode",
                age_s=rng.choice([0.0, 0.05, 0.3]),
                prefill_tokens=rng.choice([0, 0, 900, 5000]),
                decode_requests=(b := rng.randint(0, 12)),
                decode_tokens=b * rng.randint(10, 900),
                meta={"max_num_batched_tokens": 512},
            )
            for k in range(6)
        )
    )
    warm = make_scheduler("slo" if adaptive else policy, enable_adaptive_pd=adaptive, seed=seed)
    now = NOW
    for k in range(12):
        request = make_request(f"r{k}", prompt_tokens=rng.randint(1, 2000))
        cold = Scheduler(warm.config, make_predictor(), random.Random(seed), inflight=warm.inflight)
        cold.rng.setstate(warm.rng.getstate())
        if adaptive:
            cold.policy.hooks[0].reserved = dict(warm.policy.hooks[0].reserved)  # type: ignore[attr-defined]
        expected = cold.schedule(snap, request, now, dry_run=True)
        # A dry run first: the real decision then finds what it kept (same snapshot, same load).
        assert warm.schedule(snap, request, now, dry_run=True).instance_ids == expected.instance_ids
        decision = warm.schedule(snap, request, now)
        assert decision.instance_ids == expected.instance_ids
        assert decision.prefill == expected.prefill and decision.decode == expected.decode
        assert [(e.instance_id, e.dropped_by, e.selected) for e in decision.trace] == [
            (e.instance_id, e.dropped_by, e.selected) for e in expected.trace
        ]
        warm.record(decision, now)
        if k % 3 == 2:
            warm.inflight.release(f"r{k - 2}")
        now += 0.01


# ----------------------------------------------------------------------------- cheaper numpy forms

_fleets = st.lists(
    st.tuples(
        st.sampled_from(["prefill", "decode", "neutral"]),
        st.integers(0, 40),  # decode requests
        st.integers(0, 2000),  # tokens per decode request
        st.sampled_from([0, 0, 300, 5000]),  # status prefill backlog
        st.sampled_from([0, 50_000, 200_000]),  # KV capacity (0: not stated)
        st.integers(0, 150_000),  # KV used
    ),
    min_size=1,
    max_size=12,
)


def _fleet_snapshot(rows) -> ClusterSnapshot:  # type: ignore[no-untyped-def]
    return make_snapshot(
        *(
            inst(
                f"i{k:02d}",
                role,
                decode_requests=batch,
                decode_tokens=batch * per,
                prefill_tokens=backlog,
                used_kv_tokens=used,
                meta={"kv_capacity_tokens": capacity, "max_num_batched_tokens": 512},
            )
            for k, (role, batch, per, backlog, capacity, used) in enumerate(rows)
        )
    )


@PROPS
@given(
    _fleets, st.lists(st.sampled_from([0.0, 1.5, 7e4, float("nan"), float("inf")]), min_size=12, max_size=12)
)
def test_division_by_kv_capacity_equals_the_guarded_division(rows, values) -> None:  # type: ignore[no-untyped-def]
    table = make_scheduler("slo").views.table(_fleet_snapshot(rows))
    v = np.array(values[: table.n])
    for empty in (np.inf, 0.0):
        expected = np.divide(
            v, table.kv_capacity_tokens, out=np.full(table.n, empty), where=table.kv_capacity_tokens > 0
        )
        assert np.array_equal(table.over_kv_capacity(v, empty), expected, equal_nan=True)


@PROPS
@given(st.integers(1, 10), st.floats(0.0, 1e6), st.sampled_from([False, True]))
def test_a_constant_column_ties_every_candidate_as_the_comparison_does(n, value, read_only) -> None:  # type: ignore[no-untyped-def]
    s = make_scheduler("slo")
    snap = make_snapshot(*(inst(f"i{k}") for k in range(n)))
    table = s.views.table(snap)
    column = table.constant(value)
    assert table.is_constant(column) and table.constant(value) is column
    assert not table.is_constant(column.copy())
    candidates = np.arange(0, n, 2)
    if read_only:
        candidates.setflags(write=False)
    ctx = s.context(s.view(snap, NOW), make_request())
    ctx._values["prompt_compute_tokens"] = column  # (the metric's own cached column)
    from router.core.selectors import _ties

    assert _ties(ctx, "prompt_compute_tokens", candidates, False).tolist() == (
        _best_ties(column[candidates], candidates).tolist()
    )


@PROPS
@given(_fleets, st.integers(1, 6000), st.integers(0, 900), st.sampled_from(["slo", "adaptive-pd"]))
def test_predictions_with_the_request_equal_the_general_decode_step(rows, prompt, output, policy) -> None:  # type: ignore[no-untyped-def]
    """The busy path (with the load's batch cells) equals ``decode_step_ms`` at (batch + 1, tokens)."""
    adaptive = policy == "adaptive-pd"
    s = make_scheduler("slo", enable_adaptive_pd=adaptive, calibration="off")
    snap = _fleet_snapshot(rows)
    s.inflight.record("old", None, f"i{len(rows) - 1:02d}", 700, now_s=NOW, final_tokens=900)
    request = make_request(prompt_tokens=prompt, expected_output_tokens=output)
    for k in range(4):
        # The second decision on a load reads the kept batch cells; a load that changed updates
        # the previous load's cells at the instances whose decode requests changed.
        if k == 2:
            s.inflight.record("new", None, "i00", 300, now_s=NOW, final_tokens=400)
        elif k == 3:
            s.inflight.release("old")
        ctx = s.context(s.view(snap, NOW), request)
        table = ctx.view.instances
        assert ctx.predictors is not None
        batch = ctx.metric("decode_batch_size") + 1.0
        tokens = ctx.metric("decode_tokens") + float(prompt)
        if output:
            tokens = tokens + 0.5 * output
        expected = ctx.predictors.decode_step_ms(table, batch, tokens)
        assert np.array_equal(ctx.metric("predicted_tpot"), expected)
        strict = s.config.tpot_packing_strictness
        horizon = ctx.metric("decode_tokens_horizon") + (float(prompt) + strict * float(output or 256))
        expected_horizon = ctx.predictors.decode_step_ms(table, batch, horizon)
        assert np.array_equal(ctx.metric("predicted_tpot_horizon"), expected_horizon)


@PROPS
@given(_fleets, st.integers(1, 6000), st.integers(0, 3))
def test_one_instance_ttft_with_a_prefix_hit_equals_the_column(rows, prompt, hit_blocks) -> None:  # type: ignore[no-untyped-def]
    s = make_scheduler("slo", prefix_cache_routing="approximate", prefix_block_tokens=16, calibration="off")
    snap = _fleet_snapshot(rows)
    hashes = tuple(range(1, min(prompt // 16, 6) + 1))
    assert s.prefix is not None
    if hashes and hit_blocks:
        s.prefix.dispatched("i00", hashes[:hit_blocks], 1e9)
    request = make_request(prompt_tokens=prompt, prefix_hashes=hashes)
    column_ctx = s.context(s.view(snap, NOW), request)
    column = column_ctx.metric("predicted_ttft")
    for i in range(len(rows)):
        one = s.context(s.view(snap, NOW), request)  # a fresh context: no column cached yet
        assert one.metric_at("predicted_ttft", i) == column[i]


@PROPS
@given(st.lists(st.floats(-5.0, 600.0), min_size=1, max_size=20))
def test_one_batch_cell_equals_the_array_lookup(batches) -> None:  # type: ignore[no-untyped-def]
    grid = make_predictor().tpot_profile.grid
    cells, weights = grid.x_cells(np.array(batches))
    for x, i, w in zip(batches, cells.tolist(), weights.tolist(), strict=True):
        assert grid.x_cell_at(x) == (i, w)


@PROPS
@given(
    st.lists(
        st.tuples(
            st.sampled_from([0, 0, 2, 4, 64]),  # max_num_seqs (0: not stated)
            st.integers(0, 8),  # running
            st.integers(0, 6),  # waiting
            st.integers(0, 8),  # decode requests
            st.sampled_from([0, 300, 5000]),  # status prefill backlog
        ),
        min_size=1,
        max_size=10,
    ),
    st.integers(1, 6000),
)
def test_ttft_column_adds_the_slot_wait_exactly_where_the_one_instance_form_does(rows, prompt) -> None:  # type: ignore[no-untyped-def]
    # The column skips counting the slot-wait column when no instance states a cap; the
    # one-instance form always reads it. Both must agree, capped or not.
    records = []
    for k, (cap, running, waiting, decode, backlog) in enumerate(rows):
        record = inst(
            f"i{k:02d}",
            running=running,
            waiting=waiting,
            decode_requests=decode,
            decode_tokens=decode * 400,
            prefill_tokens=backlog,
        )
        record.metadata.max_num_seqs = cap
        records.append(record)
    snap = make_snapshot(*records)
    s = make_scheduler("slo", calibration="off")
    request = make_request(prompt_tokens=prompt, expected_output_tokens=200)
    column = s.context(s.view(snap, NOW), request).metric("predicted_ttft")
    wait = s.context(s.view(snap, NOW), request).metric("slot_wait_ms")
    for i in range(len(rows)):
        one = s.context(s.view(snap, NOW), request)
        assert one.metric_at("predicted_ttft", i) == column[i]
    # And the wait is what the caps add: the same fleet without them predicts the column less it.
    for record in records:
        record.metadata.max_num_seqs = 0
    plain = make_scheduler("slo", calibration="off")
    uncapped = plain.context(plain.view(make_snapshot(*records), NOW), request).metric("predicted_ttft")
    assert column.tolist() == (uncapped + wait).tolist()
