"""Conformance: every registered metric, filter, selector and policy honours its interface."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from router.core.config import SchedulerConfig
from router.core.plugins import (
    DecisionContext,
    Filter,
    FilterResult,
    GlobalFilter,
    Metric,
    Reserves,
    Selector,
)
from router.core.registry import FILTERS, METRICS, POLICIES, SELECTORS, Params
from router.core.request import Role
from router.core.scheduler import Scheduler
from tests.router.core.helpers import NOW, inst, make_predictor, make_request, make_snapshot

#: Parameters that make each registered plugin usable; a new plugin must be added here.
FILTER_PARAMS: dict[str, dict[str, Any]] = {
    "schedulability": {},
    "staleness": {},
    "metric_threshold": {"metric": "predicted_ttft", "slo": "ttft"},
    "exclude_reserved": {"reserve": "decode"},
    "prefill_room": {},
    "decode_idle": {},
    "failover": {"domain": "node-unit"},
}
SELECTOR_PARAMS: dict[str, dict[str, Any]] = {
    "lowest": {"metrics": ["predicted_ttft", "-decode_batch_size"]},
    "random": {},
    "round_robin": {},
    "power_of_two": {},
    "adaptive_decode": {},
    "binpack": {},
}

FLEET = make_snapshot(
    inst("p1", "prefill", prefill_tokens=1500, age_s=0.05, meta={"node_id": "n1", "unit_id": "u1"}),
    inst("p2", "prefill", waiting=2, meta={"node_id": "n2"}),
    inst("d1", "decode", decode_requests=5, decode_tokens=2500, used_kv_tokens=3000, meta={"node_id": "n1"}),
    inst("d2", "decode", decode_requests=1, decode_tokens=90, meta={"unit_id": "u1"}),
    inst("n1", "neutral", running=2),
    inst("sick", "decode", schedulable=False, meta={"node_id": "n9"}),
    inst("old", "prefill", age_s=30.0),
    inst("new", "neutral", status=False),
)
NEUTRAL_FLEET = make_snapshot(
    inst("a", prefill_tokens=700),
    inst("b", decode_requests=3, decode_tokens=300),
    inst("c"),
    inst("d", age_s=60),
)


def context(seed: int = 0, request: bool = True) -> DecisionContext:
    s = Scheduler(SchedulerConfig(scheduling_policy="slo"), make_predictor(), random.Random(seed))
    s.inflight.record("x", "p2", "d2", 333, NOW)
    s.inflight.record("y", "n1", "n1", 50, NOW)
    ctx = s.context(s.view(FLEET, NOW), make_request(prompt_tokens=600) if request else None)
    ctx.reserves = Reserves(prefill=1, decode=3)
    return ctx


def test_every_registered_plugin_has_conformance_parameters() -> None:
    assert set(FILTERS.names()) == set(FILTER_PARAMS)
    assert set(SELECTORS.names()) == set(SELECTOR_PARAMS)


@pytest.mark.parametrize("name", METRICS.names())
@pytest.mark.parametrize("with_request", [True, False])
def test_metric_conformance(name: str, with_request: bool) -> None:
    metric = METRICS.create(name, SchedulerConfig())
    assert isinstance(metric, Metric) and metric.name == name
    ctx = context(request=with_request)
    values = metric.compute(ctx)
    assert values.dtype == np.float64 and values.shape == (ctx.view.n,)
    assert not np.any(np.isnan(values)), "with a predictor no metric is NaN"
    assert np.all(values >= 0)
    # The cached column equals a fresh computation, and one instance equals its column entry.
    assert np.array_equal(ctx.metric(name), values)
    at = getattr(metric, "compute_at", None)
    if at is not None:
        assert [at(context(request=with_request), i) for i in range(ctx.view.n)] == pytest.approx(
            values.tolist(), rel=0, abs=0
        )
    # Instances without a status carry no load (predictions and projections with a request add it).
    new = ctx.view.instances.index["new"]
    with_the_request = (
        "kv_peak_projected",
        "kv_peak_exact",
        "kv_peak_exact_yielding",
        "predicted_tpot_horizon",
        "predicted_tpot_own",
        "prompt_compute_tokens",
        "tpot_horizon_over_need",
        "tpot_horizon_over_need_live",
    )
    predictions = (
        "predicted_ttft",
        "predicted_ttft_behind_step",
        "predicted_tpot",
        "predicted_tpot_after_slot_wait",
        "kv_usage_projected",
    )
    if name not in predictions and not (with_request and name in with_the_request):
        assert values[new] == 0


@pytest.mark.parametrize("name", FILTERS.names())
def test_filter_conformance(name: str) -> None:
    plugin = FILTERS.create(name, SchedulerConfig(), Params(name, FILTER_PARAMS[name]))
    ctx = context()
    n = ctx.view.n
    assert plugin.label.startswith(name)
    if isinstance(plugin, GlobalFilter):
        marks = np.zeros(n, dtype=bool)
        assert plugin.apply_global(ctx, marks).tolist() == [True] * n
        marks[0] = True
        keep = plugin.apply_global(ctx, marks)
        assert keep.dtype == np.bool_ and keep.shape == (n,) and not keep[0]
        return
    assert isinstance(plugin, Filter)
    result = plugin.apply(ctx)
    assert isinstance(result, FilterResult)
    assert result.keep.dtype == np.bool_ and result.keep.shape == (n,)
    if result.mark is not None:
        assert plugin.relax_pass == 0, "marking filters must always apply"
        assert result.mark.dtype == np.bool_ and result.mark.shape == (n,)
        assert not np.any(result.mark & result.keep), "a marked instance is never kept"
    assert plugin.relax_pass >= 0
    # Deterministic: the same context gives the same verdict.
    assert np.array_equal(plugin.apply(ctx).keep, result.keep)


@pytest.mark.parametrize("name", SELECTORS.names())
def test_selector_conformance(name: str) -> None:
    rng = random.Random(5)
    for trial in range(25):
        selector = SELECTORS.create(name, SchedulerConfig(), Params(name, SELECTOR_PARAMS[name]))
        assert isinstance(selector, Selector)
        ctx = context(seed=trial)
        size = rng.randint(1, ctx.view.n)
        survivors = np.array(sorted(rng.sample(range(ctx.view.n), size)))
        fallback_pass = rng.choice([0, 0, 1, 2])
        chosen = selector.select(ctx, survivors, fallback_pass)
        assert isinstance(chosen, int) and chosen in survivors.tolist()
        again = SELECTORS.create(name, SchedulerConfig(), Params(name, SELECTOR_PARAMS[name]))
        assert again.select(context(seed=trial), survivors, fallback_pass) == chosen


@pytest.mark.parametrize("name", POLICIES.names())
@pytest.mark.parametrize("fleet", [FLEET, NEUTRAL_FLEET], ids=["pd-fleet", "neutral-fleet"])
def test_policy_conformance(name: str, fleet) -> None:  # type: ignore[no-untyped-def]
    adaptive = name == "adaptive-pd"
    config = SchedulerConfig(scheduling_policy="slo" if adaptive else name, enable_adaptive_pd=adaptive)
    runs = []
    for _ in range(2):
        s = Scheduler(config, make_predictor(), random.Random(9))
        assert s.policy.name == name
        picks = []
        for k in range(6):
            d = s.schedule(fleet, make_request(f"r{k}", 100 + 10 * k), NOW)
            s.record(d, NOW)
            table = d.context.view.instances
            usable = d.context.usable()
            for choice in (d.prefill, d.decode):
                assert choice is not None
                i = table.index[choice.instance_id]
                assert usable[i], f"{name} placed on an unusable instance"
                assert choice.endpoint == table.endpoints[i]
                if not s.policy.role_agnostic:
                    wanted = {"prefill": Role.PREFILL, "decode": Role.DECODE, "neutral": Role.NEUTRAL}[
                        choice.stage.value
                    ]
                    assert table.roles[i] == wanted
            stages = {e.stage for e in d.trace}
            for stage in stages:
                assert sum(e.selected for e in d.trace if e.stage is stage) == 1
            assert all(e.dropped_by == "" for e in d.trace if e.selected)
            picks.append(d.instance_ids)
        runs.append(picks)
    assert runs[0] == runs[1], "decisions are deterministic for a fixed seed"
