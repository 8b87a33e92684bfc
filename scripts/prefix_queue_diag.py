"""Why a simulated run's requests wait in the router queue: per request, the time it waited and, at
each offer that left it waiting, which filters dropped the candidates.

    .venv/bin/python scripts/prefix_queue_diag.py simulate --workload prefix-heavy ... --queue-policies edf
    BENCH_OURS_DIAG=/tmp/diag.txt python -m bench peers_prefix     # the live router, run by the bench

With ``router`` instead of ``simulate`` it watches a live router and writes its account when the
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

import router.core.queue as queue_module
from router.cli import main
from router.core.errors import NoInstanceError
from router.core.scheduler import Scheduler

_hopeless = queue_module.hopeless
_schedule = Scheduler.schedule
_dispatched = Scheduler.dispatched

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


def _hopeless_watched(drain: Any, request: Any, targets: Any, tokens_ahead: float, now_s: float) -> Any:
    why = _hopeless(drain, request, targets, tokens_ahead, now_s)
    if why is not None:
        hopeless_ahead.append(tokens_ahead)
    return why


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
        raise


def _dispatched_watched(self: Scheduler, decision: Any, now_s: float) -> None:
    global past_deadline
    request = decision.context.request
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
    for name, ratios in sorted(over.items()):
        r = np.asarray(ratios)
        print(
            f"  {name}: best candidate / limit at refused offers: p10 {np.percentile(r, 10):.2f}, "
            f"p50 {np.percentile(r, 50):.2f}, p90 {np.percentile(r, 90):.2f} ({len(r)} offers)"
        )


if __name__ == "__main__":
    setattr(Scheduler, "schedule", _schedule_watched)  # noqa: B010
    setattr(queue_module, "hopeless", _hopeless_watched)  # noqa: B010
    setattr(Scheduler, "dispatched", _dispatched_watched)  # noqa: B010
    sys.argv[0] = "slo-router"
    atexit.register(report)
    sys.exit(main())
