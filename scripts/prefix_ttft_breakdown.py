"""Where a simulated run's TTFT goes, request by request: router queue, engine queue, prefill.

    .venv/bin/python scripts/prefix_ttft_breakdown.py simulate --workload trace:FILE ... --measure-from 1500
    DIAG_DUMP=/tmp/run.json .venv/bin/python scripts/prefix_ttft_breakdown.py simulate ...   # per request

Runs ``slo-router simulate ARGS`` with the scheduler and the engines watched. Per served request
from ``--measure-from`` on it splits the TTFT into

- the router-queue wait (arrival to dispatch),
- the engine queue (dispatch to the step its engine first schedules it in), and
- the prefill (that step to the first token: its chunks, sharing steps with decodes and with other
  prompts' chunks),

and prints each part's p50 over all served requests and over the requests whose TTFT lies within
±10 % of the TTFT p50 (the ones that set it), by SLO class, with the cached share of their prompts.
For the requests that waited in the router queue it prints which filters refused them, offer by
offer (``NoInstanceError.drops``: the first filter to drop each instance), and the best candidate's
value over each refusing threshold's limit. ``DIAG_DUMP`` writes every measured request's figures
as JSON for a closer look. A diagnosis aid for docs/prefix-cache.md; figures only.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter, defaultdict
from typing import Any

import numpy as np

import router.core.dispatchers as dispatchers
import sim.cluster as cluster
import sim.sweep as sweep
from engine.model import SimCore
from router.cli import main
from router.core.errors import NoInstanceError
from router.core.scheduler import Scheduler

_sims: list[Any] = []
#: request id -> (virtual time its engine first scheduled it, cached tokens found there)
_admitted: dict[str, tuple[float, int]] = {}
#: request id -> the refused offers: (first filters that dropped instances, {filter: best / limit})
_refused: dict[str, list[tuple[str, dict[str, float]]]] = defaultdict(list)

#: request id -> the verdicts its offers got, in order: (virtual time, verdict, error class or "")
_offers: dict[str, list[tuple[float, str, str]]] = defaultdict(list)
#: virtual times of the offer passes
_passes: list[float] = []
#: request id -> at its dispatch: the chosen instance's predicted TTFT and known cached tokens, the
#: longest known holder's, and the lowest predicted TTFT over the fleet (ms, tokens)
_placed: dict[str, dict[str, float]] = {}

_init = cluster._Simulation.__init__
_offer = getattr(dispatchers, "offer")  # noqa: B009
_lookup = SimCore._lookup
_schedule = Scheduler.schedule
_simulate = getattr(sweep, "simulate")  # noqa: B009
_dispatched = Scheduler.dispatched


def _init_watched(self: Any, *args: Any, **kwargs: Any) -> None:
    _init(self, *args, **kwargs)
    _sims[:] = [self]


def _lookup_watched(self: SimCore, req: Any, hit_blocks: int) -> None:
    if _sims and req.spec.request_id not in _admitted:
        _admitted[req.spec.request_id] = (_sims[0].now, hit_blocks * self.prefix_block_tokens)
    _lookup(self, req, hit_blocks)


def _schedule_watched(self: Scheduler, view: Any, request: Any, now_s: float, **kw: Any) -> Any:
    try:
        return _schedule(self, view, request, now_s, **kw)
    except NoInstanceError as e:
        if not kw.get("dry_run"):
            drops = ",".join(f"{k}:{v}" for k, v in sorted(e.drops.items()) if v)
            over = {m.filter: m.best / m.limit for m in e.misses if m.best == m.best and m.limit > 0}
            _refused[request.request_id].append((f"{e.stage} {drops}", over))
        raise


def _dispatched_watched(self: Scheduler, decision: Any, now_s: float) -> None:
    ctx = decision.context
    request = ctx.request
    stage = decision.prefill
    if request is not None and stage is not None:
        table = ctx.view.instances
        ttft = np.asarray(ctx.metric("predicted_ttft"), dtype=float)
        cached = np.asarray(ctx.metric("cached_prompt_tokens"), dtype=float)
        row = table.index[stage.instance_id]
        live = np.asarray(table.schedulable, dtype=bool)
        holder = int(np.argmax(np.where(live, cached, -1.0)))
        _placed[request.request_id] = {
            "chosen_ttft": float(ttft[row]),
            "chosen_cached": float(cached[row]),
            "holder_ttft": float(ttft[holder]),
            "holder_cached": float(cached[holder]),
            "best_ttft": float(np.min(np.where(live, ttft, np.inf))),
            "target": float(ctx.ttft_slo_ms),
        }
    _dispatched(self, decision, now_s)


def _offer_watched(queue: Any, scheduler: Any, source: Any, now_s: float, **kw: Any) -> Any:
    _passes.append(now_s)
    for result in _offer(queue, scheduler, source, now_s, **kw):
        error = "" if result.error is None else type(result.error).__name__
        _offers[result.entry.request_id].append((now_s, result.verdict.name, error))
        yield result


def _p(values: list[float], q: float = 50.0) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def _count_passes(start_s: float, end_s: float) -> int:
    import bisect

    return bisect.bisect_right(_passes, end_s) - bisect.bisect_left(_passes, start_s)


def _report(outcome: Any, first: int) -> None:
    rows = []
    for r in outcome.results:
        if r.index < first or r.ttft_ms is None or r.error_code is not None:
            continue
        rid = str(r.index)
        dispatch_s = r.start_s + r.queue_wait_ms / 1000.0
        admitted_s, cached = _admitted.get(rid, (dispatch_s, 0))
        rows.append(
            {
                "index": r.index,
                "class": r.class_name,
                "prompt": r.prompt_tokens,
                "cached": cached,
                "ttft": r.ttft_ms,
                "tpot": r.tpot_ms,
                "router_queue": r.queue_wait_ms,
                "engine_queue": (admitted_s - dispatch_s) * 1000.0,
                "prefill": r.ttft_ms - r.queue_wait_ms - (admitted_s - dispatch_s) * 1000.0,
                "offers_refused": len(_refused.get(rid, ())),
                "offers": _offers.get(rid, []),
                "passes_while_queued": _count_passes(r.start_s, dispatch_s),
                **_placed.get(rid, {}),
            }
        )
    if not rows:
        return
    refused = Counter(r.class_name for r in outcome.results if r.index >= first and r.error_code is not None)
    print(f"refused or failed, measured requests, by class: {dict(refused)}")
    ttft = np.array([x["ttft"] for x in rows])
    p50 = float(np.median(ttft))
    near = [x for x in rows if abs(x["ttft"] - p50) <= 0.1 * p50]
    print(f"TTFT p50 {p50:.0f} ms over {len(rows)} served (requests {first}..)")
    for label, group in (("all served", rows), ("within 10 % of the p50", near)):
        print(f"  {label}: {len(group)}; classes {dict(Counter(x['class'] for x in group))}")
        for key in ("ttft", "router_queue", "engine_queue", "prefill", "prompt", "cached"):
            v = [x[key] for x in group]
            print(
                f"    {key:<13} p10 {_p(v, 10):9.0f}  p50 {_p(v):9.0f}  p90 {_p(v, 90):9.0f}  mean {np.mean(v):9.0f}"
            )
        waited = [x for x in group if x["router_queue"] > 1.0]
        print(
            f"    waited in the router queue: {len(waited)} (p50 {_p([x['router_queue'] for x in waited]):.0f} ms)"
        )
    by_class: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for x in rows:
        by_class[x["class"]].append(x)
    for cls, group in sorted(by_class.items()):
        waited = [x for x in group if x["router_queue"] > 1.0]
        print(
            f"  class {cls}: {len(group)} served, TTFT p50 {_p([x['ttft'] for x in group]):.0f} ms, "
            f"router queue p50 {_p([x['router_queue'] for x in group]):.0f} (waited {len(waited)}, "
            f"their p50 {_p([x['router_queue'] for x in waited]):.0f}), engine queue p50 "
            f"{_p([x['engine_queue'] for x in group]):.0f}, prefill p50 {_p([x['prefill'] for x in group]):.0f}, "
            f"cached share p50 {100 * _p([x['cached'] / max(x['prompt'], 1) for x in group]):.0f} %"
        )
    _print_placement(rows)
    measured = {str(x["index"]) for x in rows}
    reasons: Counter[str] = Counter()
    over: dict[str, list[float]] = defaultdict(list)
    for rid, offers in _refused.items():
        if rid not in measured:
            continue
        for why, ratios in offers:
            reasons[why] += 1
            for name, ratio in ratios.items():
                over[name].append(ratio)
    total = sum(reasons.values())
    print(f"  refused offers of served measured requests: {total}")
    for why, n in reasons.most_common(8):
        print(f"    {n:7d}  {100 * n / max(total, 1):5.1f} %  {why}")
    for name, values in sorted(over.items()):
        print(
            f"    {name}: best / limit p10 {_p(values, 10):.2f} p50 {_p(values):.2f} p90 {_p(values, 90):.2f}"
        )
    dump = os.environ.get("DIAG_DUMP")
    if dump:
        with open(dump, "w", encoding="utf-8") as out:
            json.dump({"rows": rows, "refused": {k: v for k, v in _refused.items() if k in measured}}, out)


def _print_placement(rows: list[dict[str, Any]]) -> None:
    """Whether the served requests went to the instance the router knew to hold the most of their
    prompt, and whether the TTFT predicted at dispatch was what they got past the router queue."""
    placed = [x for x in rows if "chosen_ttft" in x]
    if not placed:
        return
    common = float(np.median([x["holder_cached"] for x in placed]))  # the prefix (nearly) all hold
    known = [x for x in placed if x["holder_cached"] > common]
    off = [x for x in known if x["chosen_cached"] < x["holder_cached"]]
    over = sum(1 for x in off if x["holder_ttft"] > x["target"])
    faster = sum(1 for x in off if x["holder_ttft"] <= x["target"] and x["holder_ttft"] < x["chosen_ttft"])
    lost = sum(x["holder_cached"] - x["chosen_cached"] for x in off)
    prompt = sum(x["prompt"] for x in placed)
    print(
        f"  placement: {len(known)} served prompts had more than {common:.0f} tokens cached on some instance "
        f"at dispatch; {len(known) - len(off)} went to the longest holder, {len(off)} elsewhere "
        f"({lost:.0f} cached tokens given up, {100 * lost / max(prompt, 1):.1f} % of the prompt tokens): "
        f"the holder predicted over the TTFT target for {over}, within it and faster than the chosen one "
        f"for {faster} (kept off by another filter: TPOT, the residents' TPOT, KV, or the bound after queueing)"
    )
    engine_less = sum(1 for x in placed if x["cached"] < x["chosen_cached"])
    print(
        f"  index against the engine: the engine found fewer cached tokens than the index said for {engine_less}"
    )
    for lo, hi in ((0.0, 0.2), (0.2, 0.5), (0.5, 0.9), (0.9, 1.01)):
        group = [x for x in placed if lo <= x["cached"] / max(x["prompt"], 1) < hi and x["chosen_ttft"] > 0]
        if group:
            err = [(x["ttft"] - x["router_queue"]) / x["chosen_ttft"] - 1.0 for x in group]
            print(
                f"  cached share {lo:.1f}-{min(hi, 1.0):.1f}: {len(group)} requests, TTFT past the router queue "
                f"/ predicted at dispatch - 1: p50 {_p(err):+.3f} p90 {_p(err, 90):+.3f}"
            )
    ttft = np.array([x["ttft"] for x in rows])
    less_queue = np.array([x["ttft"] - x["router_queue"] for x in rows])
    prefill = np.array([x["prefill"] for x in rows])
    print(
        f"  TTFT p50 {np.median(ttft):.0f} ms; without the router-queue wait {np.median(less_queue):.0f} ms; "
        f"the prefill alone (no queue of either kind) {np.median(prefill):.0f} ms"
    )


def _simulate_watched(*args: Any, **kwargs: Any) -> Any:
    _admitted.clear()
    _refused.clear()
    _offers.clear()
    _passes.clear()
    _placed.clear()
    outcome = _simulate(*args, **kwargs)
    first = int(sys.argv[sys.argv.index("--measure-from") + 1]) if "--measure-from" in sys.argv else 0
    _report(outcome, first)
    return outcome


if __name__ == "__main__":
    setattr(cluster._Simulation, "__init__", _init_watched)  # noqa: B010
    setattr(SimCore, "_lookup", _lookup_watched)  # noqa: B010
    setattr(Scheduler, "schedule", _schedule_watched)  # noqa: B010
    setattr(sweep, "simulate", _simulate_watched)  # noqa: B010
    setattr(dispatchers, "offer", _offer_watched)  # noqa: B010
    setattr(Scheduler, "dispatched", _dispatched_watched)  # noqa: B010
    sys.argv[0] = "slo-router"
    sys.exit(main())
