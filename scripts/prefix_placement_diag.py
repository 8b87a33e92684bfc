"""Where a simulated run's prefix-cache hits go: at each dispatch, the instance the router knew to hold
the longest prefix of the prompt against the one it chose.

    .venv/bin/python scripts/prefix_placement_diag.py simulate --workload trace:FILE ... --prefix-cache-routing exact

Runs ``slo-router simulate ARGS`` and prints, per run, the dispatches whose prompt some instance
held more of than the chosen one (a placement miss), the cached tokens those dispatches gave up,
and for them how the longest holder's predicted TTFT stood against the request's TTFT target (over
it: the SLO filter kept the request away from the cache; within it: the selector chose otherwise).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from router.cli import main
from router.core.scheduler import Scheduler

_dispatched = Scheduler.dispatched
stats: dict[str, Any] = {"dispatches": 0, "with_hit_known": 0, "misses": 0, "lost_tokens": 0, "over": 0}


def _watching(self: Scheduler, decision: Any, now_s: float) -> None:
    request = decision.context.request
    prefix = self.prefix
    if prefix is not None and request is not None and request.prefix_hashes and decision.prefill is not None:
        found = prefix.matched_blocks(request.prefix_hashes)
        stats["dispatches"] += 1
        if found:
            stats["with_hit_known"] += 1
            best_id, best = max(found.items(), key=lambda kv: kv[1])
            chosen = found.get(decision.prefill.instance_id, 0)
            if best > chosen:
                stats["misses"] += 1
                stats["lost_tokens"] += (best - chosen) * prefix.block_tokens
                ctx = decision.context
                row = ctx.view.instances.index.get(best_id)
                target = ctx.ttft_slo_ms
                if row is not None and target > 0:
                    ttft = float(np.asarray(ctx.metric("predicted_ttft"))[row])
                    stats["over"] += int(ttft > target)
    _dispatched(self, decision, now_s)


if __name__ == "__main__":
    setattr(Scheduler, "dispatched", _watching)  # noqa: B010
    sys.argv[0] = "slo-router"
    code = main()
    print("placement:", stats)
    sys.exit(code)
