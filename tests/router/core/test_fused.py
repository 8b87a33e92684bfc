"""The fused stage (router/core/fused.py) decides exactly as the composed chain does.

The composed chain (:func:`router.core.chain.run_stage`: every filter's mask,
the passes, the selector) is the definition of a stage; the fused pass is a
faster way to the same answer. Two schedulers in the same state, one with the
fused pass and one without, make the same decisions one after the other on
random fleets (stale, unschedulable and status-less instances, failure
domains, loads, exclusions, targets tight enough to fail or fall back) with
every built-in policy: the same choices, stage records, traces, metrics read
(their values; not their order: a threshold judged at the selector's best
candidates only, ``at_best``, computes its column when the record is read),
errors and random draws.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet.snapshot import ClusterSnapshot
from router.core import chain, fused
from router.core.config import SchedulerConfig
from router.core.errors import SchedulingError
from router.core.policies import policy_from_dict
from router.core.request import Stage, StageRestriction
from router.core.scheduler import Scheduler
from router.core.selectors import _best_ties
from tests.router.core.helpers import NOW, inst, make_request, make_scheduler, make_snapshot

PROPS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

POLICIES = [
    "slo",
    "adaptive-pd",
    "load-balance",
    "load-balance-limited",
    "least-requests",
    "binpack",
    "cache-affinity",
    "round-robin",
    "at-best",
]

#: Thresholds judged at the selector's best candidates only (``at_best``), where the best often
#: fails them (a request count at 1, the exact KV peak), among lowest-TTFT ties on idle instances.
_AT_BEST_STAGE = {
    "filters": [
        "schedulability",
        "staleness",
        {"name": "metric_threshold", "metric": "num_requests", "limit": 1, "at_best": True},
        {"name": "metric_threshold", "metric": "predicted_ttft", "slo": "ttft"},
        {
            "name": "metric_threshold",
            "metric": "kv_peak_exact",
            "limit": 0.5,
            "empty_passes": True,
            "at_best": True,
        },
        "failover",
    ],
    "selector": {"name": "lowest", "metrics": ["decode_batch_size", "predicted_ttft"]},
}


@contextmanager
def _fused(on: bool, small: int | None = None, large: int | None = None) -> Iterator[None]:
    was = chain.FUSED, fused.SMALL_FLEET, fused.LARGE_FLEET
    chain.FUSED = on
    if small is not None:
        fused.SMALL_FLEET = small
    if large is not None:
        fused.LARGE_FLEET = large
    try:
        yield
    finally:
        chain.FUSED, fused.SMALL_FLEET, fused.LARGE_FLEET = was


_rows = st.lists(
    st.tuples(
        st.sampled_from(["prefill", "decode", "neutral"]),
        st.integers(0, 40),  # decode requests
        st.integers(0, 2000),  # tokens per decode request
        st.sampled_from([0, 0, 300, 5000]),  # status prefill backlog
        st.sampled_from([0, 50_000, 200_000]),  # KV capacity (0: not stated)
        st.integers(0, 150_000),  # KV used
        st.sampled_from([0.0, 0.0, 0.0, 0.5, 5.0]),  # status age (staleness default 2 s)
        st.sampled_from([True, True, True, True, False]),  # schedulable
        st.sampled_from([True, True, True, True, True, False]),  # has a status
        st.sampled_from(["", "n0", "n1", "n2"]),  # node
    ),
    min_size=1,
    max_size=14,
)


def _snapshot(rows: Any) -> ClusterSnapshot:
    return make_snapshot(
        *(
            inst(
                f"i{k:02d}",
                role,
                age_s=age,
                status=has_status,
                schedulable=schedulable,
                decode_requests=batch,
                decode_tokens=batch * per,
                prefill_tokens=backlog,
                used_kv_tokens=used,
                meta={"kv_capacity_tokens": capacity, "max_num_batched_tokens": 512, "node_id": node},
            )
            for k, (
                role,
                batch,
                per,
                backlog,
                capacity,
                used,
                age,
                schedulable,
                has_status,
                node,
            ) in enumerate(rows)
        )
    )


def _scheduler(policy: str, seed: int, domain: str) -> Scheduler:
    adaptive = policy == "adaptive-pd"
    limits: dict[str, Any] = {}
    if policy == "load-balance-limited":
        # Integer loads against integer limits: values exactly at the limit (kept only below it).
        policy = "load-balance"
        for stage in ("prefill", "decode", "neutral"):
            limits[f"dispatch_{stage}_load_metric"] = "num_requests"
            limits[f"dispatch_{stage}_load_threshold"] = float(random.Random(seed + 2).choice([0, 1, 3]))
    scheduler = make_scheduler(
        "slo" if adaptive or policy == "at-best" else policy,
        **limits,
        enable_adaptive_pd=adaptive,
        seed=seed,
        failover_domain=domain,
        ttft_slo_ms=random.Random(seed).choice([50.0, 400.0, 3000.0]),
        tpot_slo_ms=random.Random(seed + 1).choice([12.0, 30.0, 80.0]),
    )
    if policy == "at-best":
        stages = {"prefill": _AT_BEST_STAGE, "decode": _AT_BEST_STAGE, "neutral": _AT_BEST_STAGE}
        scheduler.policy = policy_from_dict({"name": policy, **stages}, scheduler.config, "test")
    return scheduler


def _record(decision: Any) -> tuple[Any, ...]:
    """Everything a decision says: choices, stage records (keep-masks included), trace, metrics read."""
    outcomes = []
    for o in decision.outcomes:
        keeps = tuple(k.tolist() for k in o.keeps)
        outcomes.append(
            (o.stage, o.candidate_mask.tolist(), o.labels, keeps, o.relax, o.selected, o.fallback_pass)
        )
    computed = decision.context.computed_metrics()
    metrics = sorted((name, np.asarray(values).tolist()) for name, values in computed.items())
    return (decision.prefill, decision.decode, decision.mode, tuple(outcomes), decision.trace, repr(metrics))


def _decide(scheduler: Scheduler, snap: ClusterSnapshot, request: Any, now: float, dry_run: bool) -> Any:
    try:
        return scheduler.schedule(snap, request, now, dry_run=dry_run)
    except SchedulingError as exc:
        return (type(exc).__name__, str(exc))


@PROPS
@given(
    _rows,
    st.integers(0, 2**31),
    st.sampled_from(POLICIES),
    st.sampled_from(["instance", "node"]),
    # The fused pass on Python lists (as on a small fleet), index arrays or masks (a large one).
    st.sampled_from([(None, None), (0, None), (0, 0)]),
)
def test_the_fused_pass_decides_as_the_composed_chain(rows, seed, policy, domain, mode) -> None:  # type: ignore[no-untyped-def]
    snap = _snapshot(rows)
    with_fused, composed = _scheduler(policy, seed, domain), _scheduler(policy, seed, domain)
    rng = random.Random(seed)
    ids = [r.metadata.instance_id for r in snap.instances]
    now = NOW
    for k in range(8):
        exclude = frozenset(rng.sample(ids, 1)) if rng.random() < 0.2 else frozenset()
        stages = rng.choice([StageRestriction.ALL] * 4 + [StageRestriction.DECODE])
        request = make_request(
            f"r{k}", prompt_tokens=rng.randint(1, 4000), exclude_instance_ids=exclude, stages=stages
        )
        dry_run = rng.random() < 0.25
        with _fused(True, *mode):
            a = _decide(with_fused, snap, request, now, dry_run)
        with _fused(False):
            b = _decide(composed, snap, request, now, dry_run)
        if isinstance(a, tuple) or isinstance(b, tuple):
            assert a == b
        else:
            assert _record(a) == _record(b)
            if not dry_run:
                with_fused.record(a, now)
                composed.record(b, now)
        assert with_fused.rng.getstate() == composed.rng.getstate()
        if k % 3 == 2:
            with_fused.inflight.release(f"r{k - 2}")
            composed.inflight.release(f"r{k - 2}")
        now += 0.01


_values = st.lists(
    st.sampled_from([0.0, -0.0, 1.0, 2.5, 2.5, -3.0, float("nan"), float("inf"), float("-inf")]),
    min_size=1,
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(_values, st.booleans())
def test_list_ties_equal_the_array_ties(values, highest) -> None:  # type: ignore[no-untyped-def]
    column = [v * 1.0 for v in values] + [7.0]  # an instance that is not a candidate
    candidates = list(range(len(values)))
    expected = _best_ties(np.array(values), np.array(candidates), highest).tolist()
    assert fused._best_ties_of_list(column, candidates, highest) == expected


def test_the_fused_pass_decides_a_healthy_pd_fleet_and_leaves_a_failure_to_the_chain() -> None:
    """It is used where it should be (a property comparing it with a pass that always stepped aside
    would hold trivially), and a failed stage is still explained by the chain."""
    snap = make_snapshot(
        *(
            inst(f"i{k}", "prefill" if k % 2 == 0 else "decode", decode_requests=k, decode_tokens=100 * k)
            for k in range(8)
        )
    )
    scheduler = make_scheduler("slo")
    view = scheduler.view(snap, NOW)
    plan = chain._plan(scheduler.policy, view.instances, "")
    for stage, candidates in ((Stage.PREFILL, plan.prefill), (Stage.DECODE, plan.decode)):
        ctx = scheduler.context(view, make_request("r1", prompt_tokens=300), NOW)
        outcome = fused.try_stage(ctx, scheduler.policy.spec(stage), stage, candidates, chain._evaluate)
        assert outcome is not None and outcome.selected >= 0
        ctx2 = scheduler.context(view, make_request("r1", prompt_tokens=300), NOW)
        expected = chain.run_stage(ctx2, scheduler.policy.spec(stage), stage, candidates)
        assert outcome.selected == expected.selected
        assert [k.tolist() for k in outcome.keeps] == [k.tolist() for k in expected.keeps]
    tight = scheduler.context(view, make_request("r2", prompt_tokens=300, ttft_slo_ms=0.001), NOW)
    spec = scheduler.policy.spec(Stage.PREFILL)
    assert fused.try_stage(tight, spec, Stage.PREFILL, plan.prefill, chain._evaluate) is None
    with pytest.raises(SchedulingError, match="metric_threshold:predicted_ttft"):
        scheduler.schedule(snap, make_request("r2", prompt_tokens=300, ttft_slo_ms=0.001), NOW)


def test_a_stage_whose_order_the_fused_pass_cannot_keep_is_left_to_the_chain() -> None:
    """A threshold that lets an empty bin pass runs in the fused pass by its own keep-mask (binpack's
    and slo's KV promise; the property test above compares the two passes); a health filter after a
    threshold, an order the fused pass does not keep, leaves the stage to the chain."""
    assert fused._fusable(make_scheduler("binpack").policy.spec(Stage.DECODE)) is not None
    assert fused._fusable(make_scheduler("slo").policy.spec(Stage.DECODE)) is not None
    stage = {
        "filters": [
            {"name": "metric_threshold", "metric": "predicted_tpot", "slo": "tpot"},
            "schedulability",
        ],
        "selector": {"name": "lowest", "metrics": ["predicted_tpot"]},
    }
    policy = policy_from_dict(
        {"name": "odd", "prefill": stage, "decode": stage, "neutral": stage}, SchedulerConfig(), "test"
    )
    assert fused._fusable(policy.spec(Stage.DECODE)) is None


def test_a_trace_shows_the_thresholds_judged_at_the_best_only() -> None:
    """slo's exact KV peak is judged at the selector's best candidates in the fused pass; the trace,
    read first, still shows its value at every candidate (the column computed with the masks)."""
    scheduler = make_scheduler("slo")
    snap = make_snapshot(inst("a", decode_requests=2, decode_tokens=900), inst("b"), inst("c", running=1))
    decision = scheduler.schedule(snap, make_request("r1", prompt_tokens=400), NOW)
    assert "kv_peak_exact" not in decision.context.computed_metrics()
    trace = decision.trace
    assert [e.instance_id for e in trace] == ["a", "b", "c"]
    assert all(e.metrics["kv_peak_exact"] >= 0 for e in trace)
