"""The router queue pass's shortcuts decide exactly what the full computation decides.

A pass makes many decisions on one fleet state, most of which leave their
request waiting. Three shortcuts serve it: the view builder hands the same view
to every decision on the same (snapshot, in-flight version, time), so the
backlog advanced to now is computed once; a stage stops applying filters that
mark nothing once no candidate can survive; a failed decision builds its text,
drop counts and threshold misses only when read. These properties run the same
passes on random queues and fleets against a scheduler with none of them.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet.snapshot import ClusterSnapshot
from router.core.columns import ClusterView, IntArray
from router.core.errors import NoInstanceError, SchedulingError
from router.core.filters import MetricThreshold
from router.core.inflight import InflightAccount
from router.core.plugins import DecisionContext, FilterResult, Policy, StageSpec
from router.core.queue import QueueConfig, RouterQueue, Verdict, offer
from router.core.request import ScheduleInput
from router.core.scheduler import Scheduler
from router.core.view import ViewBuilder
from tests.router.core.helpers import NOW, inst, make_predictor, make_scheduler, make_snapshot

PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True, eq=False)
class _Applied:
    """A threshold filter the chain may not skip (it does not say it never marks)."""

    inner: MetricThreshold

    @property
    def label(self) -> str:
        return self.inner.label

    @property
    def relax_pass(self) -> int:
        return self.inner.relax_pass

    def apply(self, ctx: DecisionContext) -> FilterResult:
        return self.inner.apply(ctx)

    def explain_miss(self, ctx: DecisionContext, candidates: IntArray) -> tuple[str, float, float]:
        return self.inner.explain_miss(ctx, candidates)


def _every_filter_applied(policy: Policy) -> Policy:
    def spec(s: StageSpec | None) -> StageSpec | None:
        if s is None:
            return None
        filters = tuple(_Applied(f) if isinstance(f, MetricThreshold) else f for f in s.filters)
        return StageSpec(filters, s.global_filters, s.selector)

    prefill, decode = spec(policy.prefill), spec(policy.decode)
    assert prefill is not None and decode is not None
    return dataclasses.replace(policy, prefill=prefill, decode=decode, neutral=spec(policy.neutral))


class _FreshViews(ViewBuilder):
    """Builds every view anew: no view shared between decisions, no backlog kept with the table."""

    def build(self, snapshot: ClusterSnapshot, inflight: InflightAccount | None, now_s: float) -> ClusterView:
        self._last_view = None
        self._ages = None
        self._table = None  # a new table (and memo) per view
        return super().build(snapshot, inflight, now_s)


def _reference(fast: Scheduler, seed: int) -> Scheduler:
    ref = Scheduler(
        fast.config, make_predictor(), random.Random(seed), policy=_every_filter_applied(fast.policy)
    )
    ref.views = _FreshViews(
        default_max_num_batched_tokens=fast.config.default_max_num_batched_tokens,
        profile_label=fast.config.profile_label,
    )
    return ref


def _fleet(rng: random.Random, pd: bool, version: int) -> ClusterSnapshot:
    return make_snapshot(
        *(
            inst(
                f"i{k}",
                ("prefill" if k % 2 == 0 else "decode") if pd else "neutral",
                age_s=rng.choice([0.0, 0.01, 0.05, 0.3]),
                prefill_tokens=rng.choice([0, 0, 300, 900, 5000, 20000]),
                decode_requests=(b := rng.randint(0, 30)),
                decode_tokens=b * rng.randint(10, 900),
                used_kv_tokens=rng.choice([0, 20_000, 90_000]),
                meta={"max_num_batched_tokens": 512},
            )
            for k in range(rng.randint(1, 6))
        ),
        version=version,
    )


def _request(rng: random.Random, k: int, now: float) -> ScheduleInput:
    return ScheduleInput(
        request_id=f"r{k}",
        prompt_tokens=rng.randint(1, 3000),
        ttft_slo_ms=rng.choice([0.0, 30.0, 150.0, 600.0, 5000.0]),
        tpot_slo_ms=rng.choice([0.0, 11.0, 14.0, 30.0]),
        e2e_slo_ms=rng.choice([0.0, 0.0, 2000.0]),
        max_tokens=rng.choice([0, 50, 400]),
        priority=rng.randint(0, 2),
        arrival_s=now - rng.choice([0.0, 0.1, 0.5]),
    )


def _failure(exc: SchedulingError) -> tuple[Any, ...]:
    if isinstance(exc, NoInstanceError):
        return (type(exc), str(exc), exc.stage, exc.candidates, exc.drops, exc.misses, exc.healthy_candidates)
    return (type(exc), str(exc))


@PROPS
@given(st.integers(0, 2**31), st.booleans(), st.sampled_from(["edf", "fcfs", "priority"]))
def test_queue_passes_match_passes_without_the_shortcuts(seed: int, pd: bool, policy: str) -> None:
    rng = random.Random(seed)
    fast = make_scheduler("slo", seed=seed)
    ref = _reference(fast, seed)
    config = QueueConfig(queue_policy=policy)
    queues = [RouterQueue(config, fast.config.ttft_slo_ms, fast.config.tpot_slo_ms) for _ in range(2)]
    now = NOW
    k = 0
    for step in range(6):
        snap = _fleet(rng, pd, step + 1)
        for _ in range(rng.randint(0, 5)):
            request = _request(rng, k, now)
            k += 1
            for q in queues:
                q.observe_arrival(request)
                q.push(request, now)
        got = []

        def source(snap: ClusterSnapshot = snap) -> ClusterSnapshot:
            return snap

        max_failures = rng.choice([2, 4])
        for sched, q in ((fast, queues[0]), (ref, queues[1])):
            outcome = []
            for result in offer(q, sched, source, now, max_failures=max_failures):
                row: tuple[Any, ...] = (result.entry.request_id, result.verdict, result.predicted_ttft_ms)
                if result.verdict is Verdict.DISPATCH:
                    assert result.decision is not None
                    row += (result.decision.instance_ids,)
                    sched.record(result.decision, now)
                elif result.error is not None:
                    row += _failure(result.error)
                outcome.append(row)
            got.append(outcome)
        assert repr(got[0]) == repr(got[1])  # (NaN-safe: NaN != NaN, but their reprs agree)
        now += rng.choice([0.0, 0.02, 0.3])


@PROPS
@given(st.integers(0, 2**31), st.booleans())
def test_failed_decisions_read_the_same_without_the_early_exit(seed: int, pd: bool) -> None:
    rng = random.Random(seed)
    fast = make_scheduler("slo", seed=seed)
    ref = _reference(fast, seed)
    snap = _fleet(rng, pd, 1)
    for k in range(8):
        request = _request(rng, k, NOW)
        found = []
        for sched in (fast, ref):
            try:
                found.append(("placed", sched.schedule(snap, request, NOW, dry_run=True).instance_ids))
            except SchedulingError as exc:
                found.append(_failure(exc))
        assert repr(found[0]) == repr(found[1])


def test_one_view_per_fleet_state_and_time() -> None:
    s = make_scheduler("slo")
    snap = make_snapshot(inst("a", prefill_tokens=4000), inst("b"))
    first = s.view(snap, NOW)
    assert s.view(snap, NOW) is first  # the decisions of one pass share it
    decision = s.schedule(snap, ScheduleInput("x", prompt_tokens=100), NOW)
    s.record(decision, NOW)
    after = s.view(snap, NOW)
    assert after is not first and after.inflight.requests.sum() == 1  # a dispatch is a new state
    assert after.status_age_s is first.status_age_s  # (the same ages at the same time)
    later = s.view(snap, NOW + 0.01)
    assert later is not after and later.status_age_s[0] == snap.elapsed_s(NOW + 0.01) > 0  # ages grow


def test_a_waiting_decision_builds_its_text_only_when_read() -> None:
    s = make_scheduler("slo")
    snap = make_snapshot(inst("a", prefill_tokens=50_000))
    try:
        s.schedule(snap, ScheduleInput("x", prompt_tokens=100, ttft_slo_ms=10.0), NOW)
    except NoInstanceError as exc:
        error = exc
    else:
        raise AssertionError("a 10 ms TTFT behind 50,000 queued tokens was placed")
    assert error._message is not None and error._make_drops is not None  # nothing built yet
    first = next(error.iter_misses())
    assert first.metric == "predicted_ttft" and first.best > first.limit == 10.0
    assert len(error._misses) == 1  # the other thresholds' misses are not built by reading the first
    text = str(error)
    assert text.startswith("no neutral instance for request 'x': 1 candidate(s); dropped first by ")
    assert f"best predicted_ttft {first.best:.1f} vs limit 10.0" in text
    assert error.args == (text,) and error.drops == {"metric_threshold:predicted_ttft": 1}
    assert error.misses[0] == first and len(error.misses) > 1
