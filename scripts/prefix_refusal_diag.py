"""Which of a simulated run's refusals the fleet could have served in time: each refused request
against the same request in a run of a policy that places every request on arrival.

    .venv/bin/python scripts/prefix_refusal_diag.py simulate --neutral 4 --workload ph48.yaml --rates 8 \
        --num-requests 330 --policies slo,cache-affinity --prefix-cache-routing exact --true-noise 0.1

Runs ``slo-router simulate ARGS`` and, for every pair of runs at one rate, prints per refused
request of the first policy: when it arrived, its error and message (what the router queue's best
case was made of), how it turned late (after how long waiting: found hopeless, its best predicted
TTFT past its budget at a decision, or its deadline passed), its first refused decisions (the
filters that dropped every instance first, and each threshold's best candidate over its limit), and
whether the second policy's run served it and met its SLO; then the first run's TPOT bias (the mean
and median of (measured - predicted at dispatch) / predicted) per 4 s window of dispatch time. The
runs share
the seeded workload, so a request's index names the same request in both. A refusal of a request
the other run met is not proof the first could have (the other run's fleet held other work), but
a count of them in the first seconds, while caches are cold, says where to look. A diagnosis aid
for docs/prefix-cache.md; figures only.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import router.core.queue as queue_mod
import sim.sweep as sweep
from router.cli import main
from router.core.errors import NoInstanceError
from router.core.scheduler import Scheduler
from workload.report import slo_met

_runs: list[tuple[str, Any]] = []
#: request id -> how it turned late: (virtual time, why, best predicted TTFT ms, budget left ms)
_turned: dict[str, tuple[float, str, float, float]] = {}
_turned_by_run: list[dict[str, tuple[float, str, float, float]]] = []
#: request id -> its refused decisions: (virtual time, first filters that dropped instances, {filter: best / limit})
_refusals: dict[str, list[tuple[float, str, dict[str, float]]]] = {}
_refusals_by_run: list[dict[str, list[tuple[float, str, dict[str, float]]]]] = []
_schedule = Scheduler.schedule


def _schedule_watched(self: Scheduler, view: Any, request: Any, now_s: float, **kw: Any) -> Any:
    try:
        return _schedule(self, view, request, now_s, **kw)
    except NoInstanceError as e:
        if not kw.get("dry_run"):
            drops = ",".join(f"{k.split(':')[-1]}:{v}" for k, v in sorted(e.drops.items()) if v)
            over = {
                m.filter.split(":")[-1]: m.best / m.limit
                for m in e.misses
                if m.best == m.best and m.limit > 0
            }
            _refusals.setdefault(request.request_id, []).append((now_s, drops, over))
        raise


_late = getattr(queue_mod, "_late")  # noqa: B009


def _late_watched(
    now_s: float, queue: Any, entry: Any, reject: bool, predicted: float, budget: float, why: Any = None
) -> Any:
    if entry.request_id not in _turned:
        kind = "hopeless" if why is not None else ("deadline" if predicted != predicted else "decision")
        _turned[entry.request_id] = (now_s, kind, predicted, budget)
    return _late(now_s, queue, entry, reject, predicted, budget, why)


_simulate = getattr(sweep, "simulate")  # noqa: B009


def _label(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    for value in (*args, *kwargs.values()):
        name = getattr(value, "name", None)
        if isinstance(name, str):
            return name
    return f"run {len(_runs)}"


def _simulate_watched(*args: Any, **kwargs: Any) -> Any:
    outcome = _simulate(*args, **kwargs)
    _runs.append((_label(args, kwargs), outcome))
    _turned_by_run.append(dict(_turned))
    _turned.clear()
    _refusals_by_run.append(dict(_refusals))
    _refusals.clear()
    if len(_runs) % 2 == 0:
        _report(_runs[-2][1], _runs[-1][1], _turned_by_run[-2], _refusals_by_run[-2])
    return outcome


def _report(
    first: Any,
    second: Any,
    turned_at: dict[str, tuple[float, str, float, float]],
    refusals: dict[str, list[tuple[float, str, dict[str, float]]]],
) -> None:
    other = {r.index: r for r in second.results}
    refused = [r for r in first.results if r.error_code is not None]
    print(f"refused by the first run: {len(refused)} of {len(first.results)}")
    kinds: Counter[str] = Counter()
    met_there = 0
    for r in sorted(refused, key=lambda r: r.start_s):
        o = other.get(r.index)
        there = (
            "-" if o is None else ("met" if slo_met(o) else ("served" if o.error_code is None else "refused"))
        )
        met_there += there == "met"
        kinds[f"{r.error_code} / {there}"] += 1
        ttft = "" if o is None or o.ttft_ms is None else f" ttft there {o.ttft_ms:.0f} ms"
        turned = turned_at.get(str(r.index))
        if turned is not None:
            at, kind, predicted, budget = turned
            ttft += f"; turned late {kind} after {(at - r.start_s) * 1e3:.0f} ms (predicted {predicted:.0f}, budget {budget:.0f})"
        for at, drops, over in refusals.get(str(r.index), [])[:3]:
            shown = " ".join(f"{k}={v:.2f}" for k, v in over.items())
            ttft += f"\n      refused +{(at - r.start_s) * 1e3:.0f} ms: {drops} ({shown})"
        print(
            f"  t={r.start_s:6.2f}s #{r.index} prompt {r.prompt_tokens} {r.error_code}; other run: {there}{ttft}"
            f"\n      {r.error_message[:400]}"
        )
    print(f"  of them met by the other run: {met_there}; by kind: {dict(kinds)}")
    print(f"  TPOT bias (mean/median), first run: {_tpot_windows(first.results)}")


def _tpot_windows(results: Any, width_s: float = 4.0) -> str:
    """The TPOT prediction's bias per window of dispatch time: the mean and the median over served
    requests of (measured - predicted) / predicted (> 0: predicted too fast), as the run's report
    takes its bias."""
    by_window: dict[int, list[float]] = {}
    for r in results:
        if r.error_code is None and r.predicted_tpot_ms and r.tpot_ms is not None:
            at = r.start_s + r.queue_wait_ms / 1e3
            signed = (r.tpot_ms - r.predicted_tpot_ms) / r.predicted_tpot_ms
            by_window.setdefault(int(at // width_s), []).append(signed)
    parts = []
    for w in sorted(by_window):
        errors = sorted(by_window[w])
        mean = sum(errors) / len(errors)
        median = errors[len(errors) // 2]
        parts.append(f"{w * width_s:.0f}-{(w + 1) * width_s:.0f}s {100 * mean:+.1f}/{100 * median:+.1f}%")
    return "; ".join(parts)


if __name__ == "__main__":
    setattr(sweep, "simulate", _simulate_watched)  # noqa: B010
    setattr(queue_mod, "_late", _late_watched)  # noqa: B010
    setattr(Scheduler, "schedule", _schedule_watched)  # noqa: B010
    sys.argv[0] = "slo-router"
    sys.exit(main())
