"""Every filter, the fallback pass and every failover domain."""

from __future__ import annotations

import numpy as np
import pytest

from router.core.config import SchedulerConfig
from router.core.errors import ConfigError, EmptyClusterError, NoInstanceError
from router.core.plugins import Filter, GlobalFilter
from router.core.registry import FILTERS, Params
from tests.router.core.helpers import NOW, inst, make_request, make_scheduler, make_snapshot


def apply(name: str, snap, params=None, prompt_tokens: int = 256, **cfg):  # type: ignore[no-untyped-def]
    s = make_scheduler("slo", **cfg)
    ctx = s.context(s.view(snap, NOW), make_request(prompt_tokens=prompt_tokens))
    f = FILTERS.create(name, s.config, Params(name, params or {}))
    return ctx, f


def test_schedulability_drops_and_marks_unschedulable_instances() -> None:
    snap = make_snapshot(inst("ok"), inst("down", schedulable=False), inst("new", status=False))
    ctx, f = apply("schedulability", snap)
    assert isinstance(f, Filter)
    result = f.apply(ctx)
    assert result.keep.tolist() == [True, False, False]
    # An instance without a status yet is not schedulable, but it does not take its domain down.
    assert result.mark is not None and result.mark.tolist() == [False, True, False]


def test_staleness_drops_and_marks_statuses_older_than_the_limit() -> None:
    snap = make_snapshot(
        inst("fresh", age_s=1.0),
        inst("edge", age_s=5.0),
        inst("stale", age_s=5.01),
        inst("new", status=False),
    )
    ctx, f = apply("staleness", snap)
    result = f.apply(ctx)
    assert result.keep.tolist() == [True, True, False, False]
    assert result.mark is not None and result.mark.tolist() == [False, False, True, False]
    ctx, f = apply("staleness", snap, {"max_age_s": 0.5})
    assert f.apply(ctx).keep.tolist() == [False, False, False, False]


def test_staleness_counts_the_time_since_the_snapshot_was_taken() -> None:
    snap = make_snapshot(inst("a", age_s=1.0), taken_at_s=NOW - 4.5)
    ctx, f = apply("staleness", snap)
    assert f.apply(ctx).keep.tolist() == [False]


def test_metric_threshold_keeps_strictly_below_the_limit() -> None:
    snap = make_snapshot(inst("a", waiting=1), inst("b", waiting=2), inst("c", waiting=3))
    ctx, f = apply("metric_threshold", snap, {"metric": "num_waiting_requests", "limit": 2})
    assert f.apply(ctx).keep.tolist() == [True, False, False]
    assert f.label == "metric_threshold:num_waiting_requests"
    assert f.relax_pass == 0


def test_metric_threshold_on_an_slo_uses_the_request_target_times_the_factor() -> None:
    # predicted_ttft of a 256-token prompt on an idle instance is 60 ms.
    snap = make_snapshot(inst("a"))
    ctx, f = apply("metric_threshold", snap, {"metric": "predicted_ttft", "slo": "ttft"}, ttft_slo_ms=61)
    assert f.apply(ctx).keep.tolist() == [True]
    ctx, f = apply("metric_threshold", snap, {"metric": "predicted_ttft", "slo": "ttft"}, ttft_slo_ms=60)
    assert f.apply(ctx).keep.tolist() == [False]
    ctx, f = apply(
        "metric_threshold",
        snap,
        {"metric": "predicted_ttft", "slo": "ttft"},
        ttft_slo_ms=100,
        ttft_slo_dispatch_threshold=0.5,
    )
    assert f.apply(ctx).keep.tolist() == [False]


def test_metric_threshold_never_passes_nan() -> None:
    snap = make_snapshot(inst("a"))
    s = make_scheduler("load-balance", predictors=None)
    ctx = s.context(s.view(snap, NOW), make_request())
    f = FILTERS.create("metric_threshold", s.config, Params("t", {"metric": "predicted_ttft", "limit": 1e9}))
    assert f.apply(ctx).keep.tolist() == [False]


def test_a_threshold_judged_at_one_instance_says_what_its_mask_says() -> None:
    """``keeps_at`` (the fused pass's verdict at a selector's best, ``at_best``) equals the keep-mask
    at every instance: the exact KV peak over the residents' life with empty instances passing, on
    instances idle, holding legs the router placed, over their KV, and stating no capacity."""
    s = make_scheduler("slo")
    kv = {"kv_capacity_tokens": 8000}
    snap = make_snapshot(
        inst("idle", meta=kv),
        *(
            inst(name, decode_requests=n, decode_tokens=tokens, used_kv_tokens=tokens, meta=kv)
            for name, n, tokens in (("busy", 6, 6000), ("full", 2, 9000))
        ),
        inst("unstated", decode_requests=1, decode_tokens=100, meta={"kv_capacity_tokens": 0}),
        inst("legs", meta=kv),
    )
    placed = s.schedule(snap, make_request("r0", prompt_tokens=3000), NOW)
    s.record(placed, NOW)
    params = {"metric": "kv_peak_exact", "limit": 0.9, "empty_passes": True, "at_best": True}
    f = FILTERS.create("metric_threshold", s.config, Params("t", params))
    for prompt in (100, 1500, 5000, 9000):  # (at 9,000 only instances holding nothing pass)
        ctx = s.context(s.view(snap, NOW), make_request("r1", prompt_tokens=prompt))
        keep = f.apply(ctx).keep.tolist()
        fresh = s.context(s.view(snap, NOW), make_request("r1", prompt_tokens=prompt))
        assert [f.keeps_at(fresh, i) for i in range(len(keep))] == keep
        assert "kv_peak_exact" not in fresh.computed_metrics()  # (judged without the column)
    assert True in keep and False in keep


def test_at_best_is_refused_where_a_verdict_reads_more_than_one_entry() -> None:
    params = Params("t", {"metric": "predicted_tpot", "slo": "tpot", "at_best": True})
    with pytest.raises(ConfigError, match="at_best"):
        FILTERS.create("metric_threshold", SchedulerConfig(), params)


@pytest.mark.parametrize(
    ("params", "relax"),
    [({}, 0), ({"droppable": True}, 1), ({"relax_pass": 2}, 2), ({"droppable": False}, 0)],
)
def test_metric_threshold_droppable_flag(params: dict, relax: int) -> None:
    f = FILTERS.create(
        "metric_threshold", SchedulerConfig(), Params("t", {"metric": "num_requests", "limit": 1, **params})
    )
    assert f.relax_pass == relax


def test_fallback_pass_drops_only_droppable_thresholds() -> None:
    s = make_scheduler(
        "load-balance",
        predictors=None,
        dispatch_neutral_load_metric="num_requests",
        dispatch_neutral_load_threshold=1,
    )
    snap = make_snapshot(inst("busy", running=3), inst("busier", running=5), inst("down", schedulable=False))
    d = s.schedule(snap, make_request(), NOW)
    assert d.decode is not None and d.decode.instance_id == "busy"
    assert d.decode.fallback_pass == 1
    trace = {e.instance_id: e.dropped_by for e in d.trace}
    # In the fallback pass the threshold no longer applies; schedulability still does.
    assert trace == {"busy": "", "busier": "", "down": "schedulability"}


def test_non_droppable_threshold_survives_the_fallback_pass() -> None:
    s = make_scheduler("slo", ttft_slo_ms=50)  # 256-token prompt: 60 ms at best
    snap = make_snapshot(inst("a"), inst("b", prefill_tokens=1000))
    with pytest.raises(NoInstanceError) as err:
        s.schedule(snap, make_request(), NOW)
    assert err.value.stage == "neutral"
    assert err.value.drops == {"metric_threshold:predicted_ttft": 2}
    assert err.value.healthy_candidates == 2
    (miss,) = [m for m in err.value.misses if m.metric == "predicted_ttft"]
    assert miss.best == pytest.approx(60.0) and miss.limit == 50.0
    assert "neutral" in str(err.value) and "best predicted_ttft 60.0 vs limit 50.0" in str(err.value)


def test_exclusions_drop_the_failed_instances() -> None:
    s = make_scheduler("slo")
    snap = make_snapshot(inst("a"), inst("b", prefill_tokens=200))
    d = s.schedule(snap, make_request(exclude_instance_ids=frozenset({"a", "zz"})), NOW)
    assert d.instance_ids == ("b",)
    assert {e.instance_id: e.dropped_by for e in d.trace} == {"a": "excluded", "b": ""}
    with pytest.raises(NoInstanceError, match="excluded 2"):
        s.schedule(snap, make_request(exclude_instance_ids=frozenset({"a", "b"})), NOW)


# ----------------------------------------------------------------------------- failover


def failover_keep(domain: str, snap) -> list[bool]:  # type: ignore[no-untyped-def]
    ctx, f = apply("failover", snap, {"domain": domain})
    assert isinstance(f, GlobalFilter)
    marks = np.zeros(ctx.view.n, dtype=bool)
    for name in ("schedulability", "staleness"):
        mark = FILTERS.create(name, SchedulerConfig(), Params(name)).apply(ctx).mark
        assert mark is not None
        marks |= mark
    return f.apply_global(ctx, marks).tolist()


DOMAIN_FLEET = make_snapshot(
    inst("bad", schedulable=False, meta={"node_id": "n1", "unit_id": "u1"}),
    inst("same-node", meta={"node_id": "n1", "unit_id": "u2"}),
    inst("same-unit", meta={"node_id": "n2", "unit_id": "u1"}),
    inst("unit-of-node-peer", meta={"node_id": "n3", "unit_id": "u2"}),
    inst("other", meta={"node_id": "n4", "unit_id": "u4"}),
    inst("no-ids"),
    inst("no-ids-2"),
)


@pytest.mark.parametrize(
    ("domain", "expected"),
    [
        ("instance", [False, True, True, True, True, True, True]),
        ("node", [False, False, True, True, True, True, True]),
        ("unit", [False, True, False, True, True, True, True]),
        ("node-unit", [False, False, False, False, True, True, True]),
    ],
)
def test_failover_domains(domain: str, expected: list[bool]) -> None:
    assert failover_keep(domain, DOMAIN_FLEET) == expected


def test_empty_ids_never_form_a_domain() -> None:
    snap = make_snapshot(inst("bad", age_s=60.0), inst("peer"), inst("peer2"))
    for domain in ("instance", "node", "unit", "node-unit"):
        assert failover_keep(domain, snap) == [False, True, True]


def test_failover_without_marks_keeps_everyone() -> None:
    snap = make_snapshot(inst("a", meta={"node_id": "n"}), inst("b", meta={"node_id": "n"}))
    assert failover_keep("node-unit", snap) == [True, True]


def test_a_failed_prefill_instance_takes_down_a_decode_instance_on_its_node() -> None:
    s = make_scheduler("slo", failover_domain="node")
    snap = make_snapshot(
        inst("p-bad", "prefill", schedulable=False, meta={"node_id": "n1"}),
        inst("p-ok", "prefill", meta={"node_id": "n2"}),
        inst("d-n1", "decode", meta={"node_id": "n1"}),
        inst("d-n2", "decode", meta={"node_id": "n2"}, decode_requests=30, decode_tokens=3000),
    )
    d = s.schedule(snap, make_request(), NOW)
    assert d.decode is not None and d.decode.instance_id == "d-n2"
    assert {e.instance_id: e.dropped_by for e in d.trace if e.stage.value == "decode"} == {
        "d-n1": "failover",
        "d-n2": "",
    }


def test_a_stage_without_usable_instances_is_an_empty_cluster() -> None:
    s = make_scheduler("slo")
    snap = make_snapshot(inst("p", "prefill"), inst("d", "decode", age_s=30.0))
    with pytest.raises(EmptyClusterError, match="no usable decode instance"):
        s.schedule(snap, make_request(), NOW)
