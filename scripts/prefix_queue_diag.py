"""Why a simulated run's requests wait in the router queue: per request, the time it waited and, at
each offer that left it waiting, which filters dropped the candidates.

    .venv/bin/python scripts/prefix_queue_diag.py simulate --workload prefix-heavy ... --queue-policies edf
    BENCH_OURS_DIAG=/tmp/diag.txt python -m bench peers_prefix     # the live router, run by the bench

``DIAG_TRUE_MAX_TOKENS=1`` makes each simulated request ask for its true answer length as
``max_tokens``, as the live bench does. With ``router`` instead of ``simulate`` it watches a live router and writes its account when the
router stops (to the file ``BENCH_OURS_DIAG`` names).

Runs ``slo-router simulate ARGS`` with the scheduler watched and prints, per run: the requests that
waited (offered more than once before dispatch) and their wait (p50 / p90 / total), the refused
offers grouped by the set of filters that dropped candidates (``NoInstanceError.drops``: each
filter and how many instances it dropped first), and how the waiting requests' TTFT deadline stood
when they were finally dispatched (past it: a sure miss the queue made). Figures only.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from collections import Counter
from typing import Any

import numpy as np

import router.core.packing as packing_module
import router.core.queue as queue_module
from router.cli import main
from router.core.errors import NoInstanceError
from router.core.metrics import advanced_backlog
from router.core.scheduler import Scheduler

_hopeless = queue_module.hopeless
_schedule = Scheduler.schedule
_dispatched = Scheduler.dispatched
_packing_compute = packing_module._PackingMetric.compute

#: The view the residents' TPOT filter saw at each instance for the request last computed:
#: request id -> (values, component columns).
_residents_seen: dict[str, tuple[Any, dict[str, Any]]] = {}
#: At each offer the residents' TPOT filter refused: the components at its best candidate.
residents_refused: list[dict[str, float]] = []
#: The same components at the instance each dispatch went to (the view at placements).
residents_placed: list[dict[str, float]] = []

first_offer: dict[str, float] = {}
refusals: dict[str, int] = {}
reasons: Counter[str] = Counter()
#: Per threshold metric: the best value among the candidates over its limit, at each refused offer.
over: dict[str, list[float]] = {}
waits_ms: list[float] = []
past_deadline = 0
runs: list[dict[str, Any]] = []
#: Entries the queue judged hopeless (late before their deadline), and the prompt tokens it counted
#: in front of each then.
hopeless_ahead: list[float] = []


def _hopeless_watched(
    drain: Any, request: Any, targets: Any, tokens_ahead: float, now_s: float, entries_ahead: Any = None
) -> Any:
    why = _hopeless(drain, request, targets, tokens_ahead, now_s, entries_ahead)
    if why is not None:
        hopeless_ahead.append(tokens_ahead)
    return why


def _residents_components(ctx: Any, values: Any) -> dict[str, Any]:
    """What ``predicted_tpot_residents`` is made of, per instance (status part S and the router's L)."""
    table, inflight = ctx.view.instances, ctx.view.inflight
    batch = ctx.metric("decode_batch_size")
    growth = ctx.metric("kv_growth_tokens")
    stall = packing_module.prefill_stall_ms(ctx)
    out = {
        "value": values,
        "S_decode_requests": table.decode_requests,
        "L_decode_requests": inflight.decode_requests,
        "S_decode_tokens": table.decode_tokens,
        "L_decode_tokens": inflight.decode_tokens,
        "S_waiting": table.waiting_requests,
        "S_running": table.running_requests,
        "R_requests": inflight.resident_requests,
        "R_tokens": inflight.resident_tokens,
        "kv_growth": growth,
        "remaining_per_resident": np.maximum(np.divide(growth, np.maximum(batch, 1.0)), 1.0),
        "predicted_tpot": ctx.metric("predicted_tpot"),
        "prefill_stall_ms": stall,
        "S_backlog_advanced": advanced_backlog(ctx),
        "L_prefill_tokens": inflight.prefill_tokens,
        "S_uncomputed": table.uncomputed_prefill_tokens,
        "compute_tokens": ctx.metric("prompt_compute_tokens"),
        "status_age_ms": table.status_age_s * 1000.0,
    }
    correction = None
    if ctx.predictors is not None and ctx.predictors.calibration is not None:
        correction = ctx.predictors.calibration.correction(table.ids, table.groups)
    if correction is not None:
        out["ttft_factor"] = correction.ttft_factor
        out["tpot_factor"] = correction.tpot_factor
        out["interleave_ms"] = correction.interleave_ms
    return out


def _packing_compute_watched(self: Any, ctx: Any) -> Any:
    values = _packing_compute(self, ctx)
    if self.name == "predicted_tpot_residents" and ctx.request is not None:
        try:
            _residents_seen[ctx.request.request_id] = (values, _residents_components(ctx, values))
        except Exception as e:  # a diagnosis must not break the router
            print("residents diag:", repr(e), file=sys.stderr)
    return values


def _at(components: dict[str, Any], i: int) -> dict[str, float]:
    return {k: float(np.asarray(v).reshape(-1)[i]) for k, v in components.items()}


def _schedule_watched(self: Scheduler, view: Any, request: Any, now_s: float, **kw: Any) -> Any:
    if not kw.get("dry_run"):
        first_offer.setdefault(request.request_id, now_s)
    try:
        return _schedule(self, view, request, now_s, **kw)
    except NoInstanceError as e:
        if not kw.get("dry_run"):
            refusals[request.request_id] = refusals.get(request.request_id, 0) + 1
            drops = ",".join(f"{k}:{v}" for k, v in sorted(e.drops.items()) if v)
            reasons[f"{e.stage} {drops}"] += 1
            for miss in e.misses:
                if miss.best == miss.best and miss.limit > 0:  # not NaN
                    over.setdefault(miss.filter, []).append(miss.best / miss.limit)
                    seen = _residents_seen.get(request.request_id)
                    if "residents" in miss.filter and seen is not None:
                        values, components = seen
                        hits = np.flatnonzero(np.asarray(values) == miss.best)
                        if len(hits):
                            row = _at(components, int(hits[0]))
                            row["limit"] = miss.limit
                            row["now_s"] = now_s
                            residents_refused.append(row)
        raise


def _dispatched_watched(self: Scheduler, decision: Any, now_s: float) -> None:
    global past_deadline
    request = decision.context.request
    seen = _residents_seen.pop(request.request_id, None) if request is not None else None
    target = decision.prefill or decision.decode
    if seen is not None and target is not None:
        i = decision.context.view.instances.index.get(target.instance_id)
        if i is not None:
            residents_placed.append(_at(seen[1], i))
    if request is not None and request.request_id in refusals:
        start = first_offer.get(request.request_id, now_s)
        waits_ms.append((now_s - start) * 1000.0)
        budget = decision.context.ttft_slo_ms
        if budget > 0 and (now_s - start) * 1000.0 > budget:
            past_deadline += 1
    _dispatched(self, decision, now_s)


def report() -> None:
    """Print the account (to the file named by ``BENCH_OURS_DIAG`` when it is a path, as under the bench)."""
    target = os.environ.get("BENCH_OURS_DIAG", "")
    if target not in ("", "1"):
        with open(target, "a", encoding="utf-8") as out, contextlib.redirect_stdout(out):
            _report()
    else:
        _report()


def _components_table(label: str, rows: list[dict[str, float]]) -> None:
    if not rows:
        print(f"{label}: none")
        return
    print(f"{label}: {len(rows)}; p10 / p50 / p90 (mean)")
    for key in rows[0]:
        v = np.asarray([r.get(key, np.nan) for r in rows])
        v = v[np.isfinite(v)]
        if len(v):
            print(
                f"  {key:<24} {np.percentile(v, 10):10.2f} {np.percentile(v, 50):10.2f} "
                f"{np.percentile(v, 90):10.2f} ({v.mean():.2f})"
            )


def _report() -> None:
    w = np.asarray(waits_ms) if waits_ms else np.zeros(1)
    print(
        f"queue diag: {len(first_offer)} offered, {len(refusals)} refused at least once, "
        f"{len(waits_ms)} of them dispatched after waiting: wait p50 {np.percentile(w, 50):.0f} ms, "
        f"p90 {np.percentile(w, 90):.0f} ms, total {w.sum() / 1000:.1f} s; "
        f"{past_deadline} dispatched past their TTFT target"
    )
    if hopeless_ahead:
        a = np.asarray(hopeless_ahead)
        print(f"judged hopeless: {len(a)}, prompt tokens counted in front p50 {np.percentile(a, 50):.0f}")
    total = sum(reasons.values())
    print(f"refused offers: {total}; by the filters that dropped candidates (stage label:instances):")
    for key, n in reasons.most_common(12):
        print(f"  {n:7d}  {100 * n / max(total, 1):5.1f} %  {key}")
    _components_table("residents' TPOT filter, best candidate at refused offers", residents_refused)
    _components_table("residents' TPOT view at the instance placed on", residents_placed)
    for name, ratios in sorted(over.items()):
        r = np.asarray(ratios)
        print(
            f"  {name}: best candidate / limit at refused offers: p10 {np.percentile(r, 10):.2f}, "
            f"p50 {np.percentile(r, 50):.2f}, p90 {np.percentile(r, 90):.2f} ({len(r)} offers)"
        )


def _true_max_tokens() -> None:
    """``DIAG_TRUE_MAX_TOKENS=1``: each simulated request asks for its true answer length as
    ``max_tokens``, as ``python -m bench peers_prefix`` sends it live (its length estimates are
    capped by it)."""
    import dataclasses

    import sim.cli

    run_plans = sim.cli.run_plans

    def capped(*args: Any, **kwargs: Any) -> Any:
        inner = run_plans(*args, **kwargs)
        return lambda spec, rate: [
            dataclasses.replace(p, max_tokens=p.true_output_tokens) for p in inner(spec, rate)
        ]

    setattr(sim.cli, "run_plans", capped)  # noqa: B010


if __name__ == "__main__":
    if os.environ.get("DIAG_TRUE_MAX_TOKENS"):
        _true_max_tokens()
    setattr(Scheduler, "schedule", _schedule_watched)  # noqa: B010
    setattr(queue_module, "hopeless", _hopeless_watched)  # noqa: B010
    setattr(Scheduler, "dispatched", _dispatched_watched)  # noqa: B010
    setattr(packing_module._PackingMetric, "compute", _packing_compute_watched)  # noqa: B010
    sys.argv[0] = "slo-router"
    atexit.register(report)
    sys.exit(main())
