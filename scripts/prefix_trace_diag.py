"""Where a simulated run's prefix-cache hits and TTFT go, request by request.

    .venv/bin/python scripts/prefix_trace_diag.py simulate --workload trace:FILE ... --measure-from 1500

Runs ``slo-router simulate ARGS`` with the scheduler and the engines watched and prints, per run,
over the requests from ``--measure-from`` on:

- placement: the dispatches whose prompt some instance was known to hold more of than the chosen
  one, and why the holder was passed over (its predicted TTFT over the request's target, over what
  was left of it after the router queue, or within it: a TPOT or KV filter), with the cached tokens
  given up; and whether the engine found exactly the blocks the index said it held;
- TTFT: its p50, the router-queue wait (share of served requests that waited, their wait p50), the
  TTFT less that wait, the request's own prefill on the uncached part (the default profile's TTFT
  at that many tokens) and the median share of the prompt found cached.

A diagnosis aid for docs/prefix-cache.md; figures only.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

import sim.sweep as sweep
from engine.model import SimCore
from router.cli import main
from router.core.scheduler import Scheduler
from sim.cluster import simulate as cluster_simulate

PROFILE = Path(__file__).resolve().parents[1] / "profiling_data" / "qwen2.5-7b-2xv100-linear" / "ttft.json"
_lookups: dict[str, tuple[int, int]] = {}
_placed: dict[str, dict[str, Any]] = {}
_lookup = SimCore._lookup
_dispatched = Scheduler.dispatched
_simulate = cluster_simulate


def _watch_lookup(self: SimCore, req: Any, hit_blocks: int) -> None:
    if not req.spec.num_cached_tokens:
        _lookups[req.spec.request_id] = (req.spec.num_context_tokens, hit_blocks * self.prefix_block_tokens)
    _lookup(self, req, hit_blocks)


def _watch_dispatch(self: Scheduler, decision: Any, now_s: float) -> None:
    request, prefix = decision.context.request, self.prefix
    if request is not None and decision.prefill is not None and prefix is not None and request.prefix_hashes:
        ctx = decision.context
        table = ctx.view.instances
        ttft = np.asarray(ctx.computed_metrics().get("predicted_ttft", np.full(len(table.ids), np.nan)))
        _placed[request.request_id] = {
            "chosen": decision.prefill.instance_id,
            "known": dict(prefix.matched_blocks(request.prefix_hashes)),
            "ttft": {iid: float(ttft[table.index[iid]]) for iid in table.ids},
            "target": ctx.ttft_slo_ms,
            "block": prefix.block_tokens,
        }
    _dispatched(self, decision, now_s)


def _prefill_ms() -> Any:
    rows = json.loads(PROFILE.read_text())["results"]
    xs = np.array([r["tokens_num"] for r in rows], dtype=float)
    ys = np.array([r["p50"] for r in rows], dtype=float)
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return lambda t: float(np.interp(t, xs, ys)) if t <= xs[-1] else float(ys[-1] + slope * (t - xs[-1]))


def _report(outcome: Any, first: int) -> None:
    results = [r for r in outcome.results if r.index >= first]
    why: Counter[str] = Counter()
    lost: Counter[str] = Counter()
    agree = dispatched = 0
    for r in results:
        rid = str(r.index)
        placed, looked = _placed.get(rid), _lookups.get(rid)
        if placed is None:
            continue
        block = placed["block"]
        known = placed["known"]
        chosen = known.get(placed["chosen"], 0)
        if looked is not None:
            dispatched += 1
            agree += looked[1] == min(chosen * block, r.prompt_tokens - 1) // block * block
        best = max(known.values(), default=0)
        if best <= 1:
            why["no instance holds more than the first block"] += 1
            continue
        if best <= chosen:
            why["went to the longest holder"] += 1
            continue
        holder = min((i for i, v in known.items() if v == best), key=lambda i: placed["ttft"][i])
        predicted, target = placed["ttft"][holder], placed["target"] or 0.0
        reason = (
            "passed over: holder's TTFT over the target"
            if predicted > target
            else "passed over: holder's TTFT over the target less the queue wait"
            if predicted > target - r.queue_wait_ms
            else "passed over: holder within TTFT (TPOT or KV filter)"
        )
        why[reason] += 1
        lost[reason] += (best - chosen) * block
    queried = sum(_lookups[str(r.index)][0] for r in results if str(r.index) in _lookups)
    print(f"placement over requests {first}..: {dict(why)}")
    print(f"  cached tokens given up: {dict(lost)} of {queried} looked up")
    print(f"  engine found exactly what the index said: {agree} of {dispatched} dispatches")
    prefill = _prefill_ms()
    served = [r for r in results if r.ttft_ms is not None and r.error_code is None]
    if not served:
        return
    waited = [r.queue_wait_ms for r in served if r.queue_wait_ms > 1.0]
    own, share = [], []
    for r in served:
        q, h = _lookups.get(str(r.index), (r.prompt_tokens, 0))
        own.append(prefill(r.prompt_tokens - h))
        share.append(h / max(q, 1))
    ttft = np.array([r.ttft_ms for r in served])
    wait = np.array([r.queue_wait_ms for r in served])
    print(
        f"TTFT p50 {np.median(ttft):.0f} ms over {len(served)} served; {len(waited)} waited in the router queue "
        f"(p50 {np.median(waited) if waited else 0:.0f} ms); TTFT less that wait p50 {np.median(ttft - wait):.0f} ms; "
        f"own prefill p50 {np.median(own):.0f} ms; cached share p50 {100 * np.median(share):.0f} %"
    )


def _watch_simulate(*args: Any, **kwargs: Any) -> Any:
    _lookups.clear()
    _placed.clear()
    outcome = _simulate(*args, **kwargs)
    first = int(sys.argv[sys.argv.index("--measure-from") + 1]) if "--measure-from" in sys.argv else 0
    _report(outcome, first)
    return outcome


if __name__ == "__main__":
    setattr(SimCore, "_lookup", _watch_lookup)  # noqa: B010
    setattr(Scheduler, "dispatched", _watch_dispatch)  # noqa: B010
    setattr(sweep, "simulate", _watch_simulate)  # noqa: B010
    sys.argv[0] = "slo-router"
    sys.exit(main())
