"""Where a simulated run loses prefix-cache hits against a second policy's run of the same workload,
by cause.

    .venv/bin/python scripts/prefix_hit_diag.py simulate --neutral 4 --workload ph48.yaml --rates 8 \
        --num-requests 330 --policies slo,cache-affinity --prefix-cache-routing exact --true-noise 0.1

Runs ``slo-router simulate ARGS``; for every pair of runs at one rate it classifies each dispatch of
the first run (the router's index read just before the dispatch, pending blocks counted):

- ``cold``: no instance held any block of the prompt and none of its prefix was dispatched before
  (the prefix group's first prompt: every policy misses it);
- ``forgotten``: no instance held a block, but the prefix was dispatched before (evicted);
- ``placed on holder``: the chosen instance held the longest known prefix;
- ``holder dropped: F``: another instance held more, and the filter ``F`` (the first of the chain to
  drop it) kept the request away; for the TTFT threshold, ``ttft (release limit)`` when the
  holder's predicted TTFT was within the request's remaining budget but over the bound the router
  queue set (its release limit), ``ttft (budget)`` when it was past the remaining budget;
- ``holder passed, not chosen``: another instance held more and passed every filter (a fallback
  pass or the selector).

Per cause it prints the dispatches, the prompt tokens the engines found cached in this run and in
the second run (same request index: the runs share the seeded workload), the tokens the index
predicted cached at the chosen instance against those the engine found (a pending block is counted
as held before its prefill has run), and the requests of the cause that met their SLO in each run.
With ``PREFIX_HIT_DIAG_KEEP_HOLDER=1`` in the environment the TPOT thresholds (the request's own and the
residents') never drop an instance holding the longest known prefix of the prompt: a counterfactual
that prices those misses (what the run gives when the holder is kept through them);
``=predicted_tpot`` or ``=predicted_tpot_residents`` exempts the holder from that threshold only;
``PREFIX_HIT_DIAG_KEEP_WITHIN=1.05`` exempts it only while its value is within that factor of the limit. A diagnosis aid
for docs/prefix-cache.md; figures only.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from typing import Any

import numpy as np

import router.core.chain as chain
import sim.sweep as sweep
from router.cli import main
from router.core.filters import MetricThreshold
from router.core.plugins import FilterResult
from router.core.request import resolve_targets
from router.core.scheduler import Scheduler, cached_at
from workload.report import slo_met, tpot_met, ttft_met

_dispatched = Scheduler.dispatched
_schedule = Scheduler.schedule
#: request id -> the first block hash of its prompt (every request a decision was tried for)
_group: dict[str, int] = {}
_group_by_run: list[dict[str, int]] = []
#: request id -> (cause, predicted cached tokens at the chosen instance, dispatched at s)
_causes: dict[str, tuple[str, int, float]] = {}
_seen_first: set[int] = set()
_runs: list[Any] = []
#: per holder dropped by a TPOT threshold: (filter, holder's value / limit, chosen's value / limit, at s)
_over: list[tuple[str, float, float, float]] = []
_causes_by_run: list[dict[str, tuple[str, int, float]]] = []


def _cause(self: Scheduler, decision: Any, request: Any, now_s: float) -> str:
    prefix = self.prefix
    assert prefix is not None
    hashes = request.prefix_hashes
    found = prefix.matched_blocks(hashes)
    first = hashes[0]
    if not found:
        return "forgotten" if first in _seen_first else "cold"
    best_id, best = max(found.items(), key=lambda kv: kv[1])
    chosen = found.get(decision.prefill.instance_id, 0)
    if chosen >= best:
        return "placed on holder"
    ctx = decision.context
    row = ctx.view.instances.index.get(best_id)
    if row is None:
        return "holder not in view"
    outcome = decision.outcomes[0]
    filters = dict(
        zip(self.policy.spec(outcome.stage).labels, self.policy.spec(outcome.stage).filters, strict=False)
    )
    for label, keep in zip(outcome.labels, outcome.keeps, strict=True):
        if not bool(np.asarray(keep)[row]):
            name = label.split(":")[-1]
            f = filters.get(label)
            if isinstance(f, MetricThreshold) and "ttft" not in label:
                limit = f.bound(ctx)
                values = np.asarray(ctx.metric(f.metric))
                chosen_row = ctx.view.instances.index[decision.prefill.instance_id]
                _over.append((name, float(values[row]) / limit, float(values[chosen_row]) / limit, now_s))
            if "ttft" in label:
                predicted = float(np.asarray(ctx.metric("predicted_ttft"))[row])
                budget = resolve_targets(
                    request, self.config.ttft_slo_ms, self.config.tpot_slo_ms, now_s
                ).ttft_ms
                name = "ttft (release limit)" if predicted <= budget else "ttft (budget)"
            return f"holder dropped: {name}"
    return f"holder passed, not chosen (pass {outcome.fallback_pass})"


def _watching(self: Scheduler, decision: Any, now_s: float) -> None:
    request = decision.context.request
    if (
        self.prefix is not None
        and request is not None
        and request.prefix_hashes
        and decision.prefill is not None
    ):
        cause = _cause(self, decision, request, now_s)
        predicted = cached_at(decision.context, decision.prefill.instance_id)
        _causes[request.request_id] = (cause, predicted, now_s)
        _seen_first.add(request.prefix_hashes[0])
    _dispatched(self, decision, now_s)


def _schedule_watched(self: Scheduler, view: Any, request: Any, now_s: float, **kw: Any) -> Any:
    if request.prefix_hashes:
        _group.setdefault(request.request_id, request.prefix_hashes[0])
    return _schedule(self, view, request, now_s, **kw)


_simulate = getattr(sweep, "simulate")  # noqa: B009


def _simulate_watched(*args: Any, **kwargs: Any) -> Any:
    outcome = _simulate(*args, **kwargs)
    _runs.append(outcome)
    _causes_by_run.append(dict(_causes))
    _causes.clear()
    _seen_first.clear()
    _group_by_run.append(dict(_group))
    _group.clear()
    if _over:
        shown = ", ".join(f"{n} {h:.2f}/{c:.2f} @{t:.1f}s" for n, h, c, t in _over)
        print(f"holders dropped by a TPOT threshold (holder / chosen, over the limit): {shown}")
    _over.clear()
    if len(_runs) % 2 == 0:
        _report(_runs[-2], _runs[-1], _causes_by_run[-2], _group_by_run[-2])
    return outcome


def _report(
    first: Any, second: Any, causes: dict[str, tuple[str, int, float]], groups: dict[str, int]
) -> None:
    other = {r.index: r for r in second.results}
    refused_groups: dict[int, int] = {}  # group -> the earliest refused request index
    for r in first.results:
        g = groups.get(str(r.index))
        if r.error_code is not None and g is not None:
            refused_groups[g] = min(refused_groups.get(g, r.index), r.index)
    rows: dict[str, list[float]] = defaultdict(lambda: [0.0] * 11)
    for r in first.results:
        if r.index >= len(first.cache_tokens):
            continue
        query, hit = first.cache_tokens[r.index]
        query2, hit2 = second.cache_tokens[r.index] if r.index < len(second.cache_tokens) else (0, 0)
        found = causes.get(str(r.index))
        cause = found[0] if found is not None else ("refused" if r.error_code is not None else "not seen")
        predicted = found[1] if found is not None else 0
        o = other.get(r.index)
        if cause == "cold" and hit2 > 0:
            g = groups.get(str(r.index))
            earlier = g is not None and refused_groups.get(g, r.index) < r.index
            cause = (
                "cold: the group's earlier prompt refused" if earlier else "cold: its earlier prompt queued"
            )
        row = rows[cause]
        row[0] += 1
        row[1] += query
        row[2] += hit
        row[3] += hit2
        row[4] += predicted
        row[5] += slo_met(r)
        row[6] += o is not None and slo_met(o)
        row[7] += query2
        row[10] += r.start_s
        if r.ttft_ms is not None and o is not None and o.ttft_ms is not None:
            row[8] += r.ttft_ms
            row[9] += o.ttft_ms
    total_q = sum(v[1] for v in rows.values())
    total_q2 = sum(v[7] for v in rows.values())
    hit1 = sum(v[2] for v in rows.values())
    hit2 = sum(v[3] for v in rows.values())
    print(
        f"hit rate: first {100 * hit1 / max(total_q, 1):.1f} %, second {100 * hit2 / max(total_q2, 1):.1f} %"
        f" (cached tokens {hit1:.0f} against {hit2:.0f}: {hit2 - hit1:+.0f})"
    )
    for name, run in (("first", first), ("second", second)):
        served = [r for r in run.results if r.error_code is None]
        ttft_missed = sum(ttft_met(r) is False for r in served)
        tpot_missed = sum(tpot_met(r) is False for r in served)
        print(
            f"  {name} run: {len(run.results) - len(served)} refused, of {len(served)} served"
            f" {ttft_missed} missed their TTFT, {tpot_missed} their TPOT"
        )
    print(
        f"  {'cause':42s} {'reqs':>5s} {'prompt':>8s} {'hit':>8s} {'hit 2nd':>8s} {'lost':>8s}"
        f" {'points':>6s} {'predicted':>9s} {'met':>4s} {'met 2nd':>7s} {'TTFT ms':>8s} {'2nd':>6s} {'arrived':>7s}"
    )

    def points(cause: str, v: list[float]) -> str:
        # A refused request is looked up in the second run only: it leaves the first run's rate.
        return "-" if cause == "refused" else f"{100 * (v[3] - v[2]) / max(total_q, 1):.1f}"

    for cause, v in sorted(rows.items(), key=lambda kv: -(kv[1][3] - kv[1][2])):
        print(
            f"  {cause:42s} {v[0]:5.0f} {v[1]:8.0f} {v[2]:8.0f} {v[3]:8.0f} {v[3] - v[2]:+8.0f}"
            f" {points(cause, v):>6s} {v[4]:9.0f} {v[5]:4.0f} {v[6]:7.0f} {v[8] / max(v[0], 1):8.0f} {v[9] / max(v[0], 1):6.0f} {v[10] / max(v[0], 1):6.1f}s"
        )


_apply = MetricThreshold.apply
_TPOT_METRICS = ["predicted_tpot", "predicted_tpot_residents"]
_WITHIN = float(os.environ.get("PREFIX_HIT_DIAG_KEEP_WITHIN", "inf"))


def _apply_keeping_holder(self: MetricThreshold, ctx: Any) -> Any:
    result = _apply(self, ctx)
    request = ctx.request
    if self.metric not in _TPOT_METRICS or request is None or not request.prefix_hashes or ctx.prefix is None:
        return result
    found = ctx.prefix.matched_blocks(request.prefix_hashes)
    if not found:
        return result
    best = max(found.values())
    keep = np.array(result[0], dtype=bool)
    ceiling = self.bound(ctx) * _WITHIN
    values = ctx.metric(self.metric)
    for instance_id, blocks in found.items():
        row = ctx.view.instances.index.get(instance_id)
        if blocks == best and row is not None and values[row] < ceiling:
            keep[row] = True
    return FilterResult(keep, result[1])


if __name__ == "__main__":
    _keep = os.environ.get("PREFIX_HIT_DIAG_KEEP_HOLDER", "")
    if _keep in _TPOT_METRICS:
        _TPOT_METRICS[:] = [_keep]
    if _keep == "1" or _keep in _TPOT_METRICS:
        setattr(MetricThreshold, "apply", _apply_keeping_holder)  # noqa: B010
        setattr(chain, "FUSED", False)  # noqa: B010
    setattr(Scheduler, "dispatched", _watching)  # noqa: B010
    setattr(Scheduler, "schedule", _schedule_watched)  # noqa: B010
    setattr(sweep, "simulate", _simulate_watched)  # noqa: B010
    sys.argv[0] = "slo-router"
    sys.exit(main())
