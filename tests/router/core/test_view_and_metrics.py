"""The columnar view and every metric, on fabricated snapshots (worked examples)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from router.core.config import SchedulerConfig
from router.core.inflight import InflightAccount
from router.core.predictors import PredictorSet
from router.core.request import Role
from router.core.scheduler import Scheduler
from router.core.view import ViewBuilder
from tests.router.core.helpers import NOW, inst, make_predictor, make_request, make_scheduler, make_snapshot


def test_table_columns_follow_snapshot_order() -> None:
    snap = make_snapshot(
        inst("a", "prefill", meta={"node_id": "n1", "unit_id": "u1"}, prefill_tokens=300, waiting=2),
        inst("b", "decode", meta={"node_id": "n2"}, decode_requests=3, decode_tokens=900, running=3),
        inst("c", "unspecified", status=False, meta={"max_num_batched_tokens": 0}),
    )
    table = ViewBuilder(default_max_num_batched_tokens=1024).table(snap)
    assert table.ids == ("a", "b", "c")
    assert table.index == {"a": 0, "b": 1, "c": 2}
    assert table.endpoints[1] == "b.local:50051"
    assert table.roles.tolist() == [Role.PREFILL, Role.DECODE, Role.NEUTRAL]
    assert table.node_codes.tolist() == [0, 1, -1]
    assert table.unit_codes.tolist() == [0, -1, -1]
    assert table.max_num_batched_tokens.tolist() == [8192, 8192, 1024]
    assert table.has_status.tolist() == [True, True, False]
    assert table.schedulable.tolist() == [True, True, False]
    assert table.status_age_s[2] == math.inf
    assert table.uncomputed_prefill_tokens.tolist() == [300, 0, 0]
    assert table.decode_tokens.tolist() == [0, 900, 0]
    assert table.waiting_requests.tolist() == [2, 0, 0]
    assert table.running_requests.tolist() == [0, 3, 0]
    assert table.id_rank.tolist() == [0, 1, 2]
    with pytest.raises(ValueError):
        table.uncomputed_prefill_tokens[0] = 1  # columns are read-only


def test_the_preemption_column_is_the_status_count_and_nan_where_none_is_reported() -> None:
    counted, unreported = inst("a", "neutral"), inst("b", "neutral")
    assert counted.status is not None
    counted.status.num_preemptions = 7
    counted.status.num_preemption_recompute_tokens = 1200
    snap = make_snapshot(counted, unreported, inst("c", "neutral", status=False))
    builder = ViewBuilder(default_max_num_batched_tokens=1024)
    table = builder.table(snap)
    assert table.preemptions is not None
    assert table.preemptions[0] == 7 and math.isnan(table.preemptions[1]) and math.isnan(table.preemptions[2])
    tokens = table.preemption_recompute_tokens
    assert tokens is not None and tokens[0] == 1200 and math.isnan(tokens[1]) and math.isnan(tokens[2])
    # Rebuilt incrementally (only the changed status read again): the same column.
    zero = inst("b", "neutral", update_id=2)
    assert zero.status is not None
    zero.status.num_preemptions = 0
    again = builder.table(make_snapshot(counted, zero, snap.instances[2]))
    assert again.preemptions is not None and again.preemptions[:2].tolist() == [7, 0]


def test_table_is_cached_per_snapshot_object_and_ages_grow_with_now() -> None:
    snap = make_snapshot(inst("a", age_s=0.5), taken_at_s=100.0)
    builder = ViewBuilder()
    assert builder.table(snap) is builder.table(snap)
    view = builder.build(snap, None, now_s=102.0)
    assert view.status_age_s.tolist() == [2.5]
    assert builder.build(snap, None, now_s=99.0).status_age_s.tolist() == [0.5]  # never younger than reported
    other = make_snapshot(inst("a", age_s=0.5), taken_at_s=100.0)
    assert builder.table(other) is not builder.table(snap)


def test_incremental_inflight_columns_equal_a_full_rebuild() -> None:
    snap = make_snapshot(*(inst(f"i{k}") for k in range(6)))
    acc = InflightAccount()
    builder = ViewBuilder()
    rng = random.Random(3)
    for step in range(200):
        a, b = rng.choice(snap.instances).instance_id, rng.choice(snap.instances).instance_id
        if rng.random() < 0.6:
            acc.record(f"r{step}", a, b, rng.randint(0, 100), now_s=step)
        else:
            acc.release(f"r{rng.randrange(step + 1)}")
        view = builder.build(snap, acc, now_s=float(step))
        full = acc.columns(view.instances.index, view.n)
        assert np.array_equal(view.inflight.matrix, full.matrix)
        assert view.inflight.instances_with_entries == full.instances_with_entries


# ----------------------------------------------------------------------------- metrics


def metric(scheduler: Scheduler, snap, name: str, prompt_tokens: int | None = 256, now: float = NOW):  # type: ignore[no-untyped-def]
    view = scheduler.view(snap, now)
    request = None if prompt_tokens is None else make_request(prompt_tokens=prompt_tokens)
    return scheduler.context(view, request).metric(name)


def test_load_metrics_add_the_inflight_account() -> None:
    s = make_scheduler("load-balance")
    snap = make_snapshot(
        inst(
            "a",
            waiting=2,
            running=3,
            decode_requests=3,
            decode_tokens=600,
            used_kv_tokens=1000,
            prefill_tokens=500,
        ),
        inst("b", meta={"kv_capacity_tokens": 0}),
    )
    s.inflight.record("r1", "a", "a", 100, now_s=NOW)
    s.inflight.record("r2", None, "b", 50, now_s=NOW)
    assert metric(s, snap, "decode_batch_size").tolist() == [4, 1]
    assert metric(s, snap, "decode_tokens").tolist() == [700, 50]
    assert metric(s, snap, "num_waiting_requests").tolist() == [3, 1]
    assert metric(s, snap, "num_requests").tolist() == [6, 1]  # a neutral in-flight request counts once
    kv = metric(s, snap, "kv_usage_projected")
    assert kv[0] == pytest.approx((1000 + 500 + 100) / 100_000)
    assert kv[1] == math.inf  # no capacity known


def test_prefill_backlog_advances_with_status_age_by_the_step_model() -> None:
    # M = 512, no decode batch: one full chunk of 100 ms, then a 488-token tail of 96.25 ms.
    s = make_scheduler("slo")

    def backlog(age_s: float) -> float:
        snap = make_snapshot(
            inst("a", age_s=age_s, prefill_tokens=1000, meta={"max_num_batched_tokens": 512})
        )
        return float(metric(s, snap, "prefill_backlog_tokens")[0])

    assert backlog(0.0) == 1000
    assert backlog(0.050) == pytest.approx(1000 - 256)
    assert backlog(0.100) == pytest.approx(488)
    assert backlog(0.100 + 0.09625 / 2) == pytest.approx(244)
    assert backlog(0.5) == 0.0
    assert backlog(30.0) == 0.0


def test_prefill_backlog_counts_the_decode_batch_in_each_step_and_adds_inflight() -> None:
    s = make_scheduler("slo")
    # tpot(4, 400) = 13 ms per step: the 512-token chunk takes 113 ms.
    snap = make_snapshot(
        inst(
            "a",
            age_s=0.113,
            prefill_tokens=1024,
            decode_requests=4,
            decode_tokens=400,
            meta={"max_num_batched_tokens": 512},
        )
    )
    s.inflight.record("r0", "a", None, 300, now_s=NOW)
    assert metric(s, snap, "prefill_backlog_tokens")[0] == pytest.approx(512 + 300)


def test_without_a_predictor_the_backlog_is_not_advanced_and_predictions_are_nan() -> None:
    s = make_scheduler("load-balance", predictors=None)
    snap = make_snapshot(inst("a", age_s=3.0, prefill_tokens=1000))
    assert metric(s, snap, "prefill_backlog_tokens")[0] == 1000
    assert math.isnan(metric(s, snap, "predicted_ttft")[0])
    assert math.isnan(metric(s, snap, "predicted_tpot")[0])


def test_predictions_follow_the_issue_formulas_exactly() -> None:
    s = make_scheduler("slo")
    lp = make_predictor()
    snap = make_snapshot(
        inst(
            "a",
            prefill_tokens=300,
            decode_requests=4,
            decode_tokens=400,
            meta={"max_num_batched_tokens": 256},
        ),
        inst("b", decode_requests=7, decode_tokens=3000),
        inst("c"),
    )
    s.inflight.record("r0", "b", "b", 40, now_s=NOW)
    p = 700
    ttft = metric(s, snap, "predicted_ttft", p)
    tpot = metric(s, snap, "predicted_tpot", p)
    backlog = metric(s, snap, "prefill_backlog_tokens", p)
    batch = metric(s, snap, "decode_batch_size", p)
    tokens = metric(s, snap, "decode_tokens", p)
    m = [256, 8192, 8192]
    for i in range(3):
        assert ttft[i] == lp.predict_ttft_ms(float(backlog[i]) + p, float(batch[i]), float(tokens[i]), m[i])
        assert tpot[i] == lp.predict_tpot_ms(float(batch[i]) + 1, float(tokens[i]) + p)
    # Worked example: backlog 300 + 700 = 1000 tokens in chunks of 256 beside tpot(4, 400) = 13 ms:
    # three full chunks of 60 + 13 ms and a 232-token tail of 56.25 + 13 ms.
    assert ttft[0] == pytest.approx(3 * (60 + 13) + 56.25 + 13)
    assert tpot[2] == pytest.approx(lp.predict_tpot_ms(1, 700))


def test_predicted_tpot_without_a_request_adds_no_phantom_request() -> None:
    s = make_scheduler("slo")
    snap = make_snapshot(inst("a", decode_requests=4, decode_tokens=400), inst("b"))
    tpot = metric(s, snap, "predicted_tpot", prompt_tokens=None)
    assert tpot[0] == pytest.approx(13.0)  # tpot(4, 400), not tpot(5, 400)
    assert tpot[1] == 0.0
    # A zero-token request still counts as one more request in the batch.
    assert metric(s, snap, "predicted_tpot", prompt_tokens=0)[0] == pytest.approx(
        make_predictor().predict_tpot_ms(5, 400)
    )


def test_metric_at_equals_the_column() -> None:
    s = make_scheduler("slo")
    snap = make_snapshot(
        inst("a", prefill_tokens=5000, age_s=0.2, decode_requests=2, decode_tokens=90), inst("b")
    )
    s.inflight.record("r0", "a", "b", 40, now_s=NOW)
    view = s.view(snap, NOW)
    for name in s.metrics:
        column = s.context(view, make_request(prompt_tokens=77)).metric(name)
        at = [s.context(view, make_request(prompt_tokens=77)).metric_at(name, i) for i in range(view.n)]
        assert np.array_equal(np.asarray(at), column, equal_nan=True), name


def test_heterogeneous_fleet_uses_each_groups_profile() -> None:
    predictors = PredictorSet(make_predictor(), {"big": make_predictor(scale=2.0)})
    s = Scheduler(SchedulerConfig(scheduling_policy="slo"), predictors, random.Random(0))
    snap = make_snapshot(
        inst("small", decode_requests=4, decode_tokens=400),
        inst("big", decode_requests=4, decode_tokens=400, meta={"labels": {"profile": "big"}}),
        inst("unknown", decode_requests=4, decode_tokens=400, meta={"labels": {"profile": "nope"}}),
    )
    tpot = metric(s, snap, "predicted_tpot", prompt_tokens=None)
    ttft = metric(s, snap, "predicted_ttft", prompt_tokens=300)
    assert tpot.tolist() == pytest.approx([13.0, 26.0, 13.0])
    assert ttft[1] == pytest.approx(2 * ttft[0])
    assert ttft[2] == ttft[0]


def test_load_metrics_are_updated_incrementally_and_equal_a_full_recompute() -> None:
    s = make_scheduler("slo")
    snap = make_snapshot(*(inst(f"i{k}", decode_requests=k, decode_tokens=100 * k) for k in range(5)))
    rng = random.Random(0)
    names = ["decode_batch_size", "decode_tokens", "decode_step_ms", "kv_usage_projected", "num_requests"]
    for step in range(60):
        s.inflight.record(
            f"r{step}", f"i{rng.randrange(5)}", f"i{rng.randrange(5)}", rng.randint(1, 900), now_s=NOW
        )
        if step % 3 == 0:
            s.inflight.release(f"r{rng.randrange(step + 1)}")
        view = s.view(snap, NOW)
        ctx = s.context(view, None)
        fresh = Scheduler(s.config, make_predictor(), random.Random(0), inflight=s.inflight)
        ref = fresh.context(fresh.view(snap, NOW), None)
        for name in names:
            assert np.array_equal(ctx.metric(name), ref.metric(name)), (step, name)


def test_predictor_set_from_files_loads_the_default_and_each_group() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parents[3] / "profiling_data"
    small = (root / "qwen2.5-7b-2xv100-linear" / "ttft.json", root / "qwen2.5-7b-2xv100-linear" / "tpot.json")
    big = (
        root / "llama3-70b-4xh100-roofline" / "ttft.json",
        root / "llama3-70b-4xh100-roofline" / "tpot.json",
    )
    predictors = PredictorSet.from_files(small, {"h100": big})
    assert predictors.for_group("h100") is predictors.groups["h100"]
    assert predictors.for_group("") is predictors.default
    assert predictors.for_group("unknown") is predictors.default
