"""A live router's prefix index against what its workers found, request by request.

    PREFIX_EXACT_DIAG=/tmp/diag.jsonl .venv/bin/python scripts/prefix_exact_diag.py router ARGS
    BENCH_OURS_LAUNCH=scripts/prefix_exact_diag.py PREFIX_EXACT_DIAG=/tmp/diag.jsonl python -m bench peers_prefix
    python scripts/prefix_exact_diag.py summary /tmp/diag.jsonl

Runs ``slo-router ARGS`` with the scheduler, the service and the exact index watched, and appends one
JSON object to the file ``PREFIX_EXACT_DIAG`` names when the router stops:

- ``requests``: per request, at its dispatch the instance chosen, the prompt tokens the index counted
  cached there (``predicted``), the deepest match any instance had and the chosen one's, the prompt's
  first block hash (its prefix family), the dispatch time; at its first token the prompt tokens the
  worker found cached (``found``: its first message's ``num_cached_prompt_tokens``, which sim
  workers and vLLM engines report) and the time;
- ``events``: the KV-event batches the exact index applied, the hashes stored and removed, the wall
  time spent applying them, and the removals that named a block the router had sent to that
  instance within the last second (``removed_resent``: the engine evicted it before the dispatch
  reached it, so the request will compute it again there) or that was pending there
  (``removed_pending``);
- ``settle_s``: per lookup block marked pending, the seconds until the worker's ``STORED`` named it.

Figures only: ``python scripts/prefix_exact_diag.py summary FILE`` prints them per run.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from typing import Any

import numpy as np

from router.cli import main
from router.core.prefix import ExactPrefixIndex
from router.core.scheduler import Scheduler, cached_at
from router.service import RouterService

_dispatched = Scheduler.dispatched
_after_first = RouterService._after_first
_apply = ExactPrefixIndex.apply
_exact_dispatched = ExactPrefixIndex.dispatched

requests: dict[str, dict[str, Any]] = {}
events = {"batches": 0, "stored": 0, "removed": 0, "apply_s": 0.0, "removed_resent": 0, "removed_pending": 0}
#: (instance, hash) -> when the router last sent a prompt with that lookup block there
sent_at: dict[tuple[str, int], float] = {}
#: (instance, hash) -> when it was marked pending
pending_at: dict[tuple[str, int], float] = {}
settle_s: list[float] = []


def _dispatched_watched(self: Scheduler, decision: Any, now_s: float) -> None:
    request = decision.context.request
    if (
        request is not None
        and request.prefix_hashes
        and decision.prefill is not None
        and self.prefix is not None
    ):
        chosen = decision.prefill.instance_id
        found = self.prefix.matched_blocks(request.prefix_hashes)
        requests[decision.request_id] = {
            "t": time.monotonic(),
            "instance": chosen,
            "predicted": cached_at(decision.context, chosen),
            "best": max(found.values(), default=0) * self.prefix.block_tokens,
            "chosen_depth": found.get(chosen, 0) * self.prefix.block_tokens,
            "prompt": request.prompt_tokens,
            "group": request.prefix_hashes[0] & 0xFFFFFFFF,
        }
        now = time.monotonic()
        for h in request.prefix_hashes:
            sent_at[(chosen, h)] = now
    _dispatched(self, decision, now_s)


def _after_first_watched(self: RouterService, started: Any, progress: Any) -> None:
    entry = requests.get(progress.request_id)
    if entry is not None:
        entry["found"] = progress.cached_prompt_tokens
        entry["t_first"] = time.monotonic()
    _after_first(self, started, progress)


def _exact_dispatched_watched(self: ExactPrefixIndex, instance_id: str, hashes: Any, *args: Any) -> None:
    before = self.pending_of(instance_id)
    _exact_dispatched(self, instance_id, hashes, *args)
    now = time.monotonic()
    for h in self.pending_of(instance_id) - before:
        pending_at[(instance_id, h)] = now


def _apply_watched(self: ExactPrefixIndex, instance_id: str, batch: Any) -> None:
    batch = list(batch)
    now = time.monotonic()
    pending = self.pending_of(instance_id)
    for kind, hashes in batch:
        if kind == "stored":
            events["stored"] += len(hashes)
            for h in hashes:
                at = pending_at.pop((instance_id, h), None)
                if at is not None:
                    settle_s.append(now - at)
        elif kind == "removed":
            events["removed"] += len(hashes)
            for h in hashes:
                pending_at.pop((instance_id, h), None)
                if h in pending:
                    events["removed_pending"] += 1
                at = sent_at.get((instance_id, h))
                if at is not None and now - at < 1.0:
                    events["removed_resent"] += 1
    start = time.perf_counter()
    _apply(self, instance_id, batch)
    events["apply_s"] += time.perf_counter() - start
    events["batches"] += 1


def report() -> None:
    path = os.environ.get("PREFIX_EXACT_DIAG", "")
    if not path:
        return
    with open(path, "a") as out:
        out.write(
            json.dumps({"argv": sys.argv[1:], "requests": requests, "events": events, "settle_s": settle_s})
        )
        out.write("\n")


def summary(path: str) -> None:
    with open(path) as f:
        for line in f:
            run = json.loads(line)
            argv = run["argv"]
            mode = argv[argv.index("--prefix-cache-routing") + 1] if "--prefix-cache-routing" in argv else "?"
            done = [r for r in run["requests"].values() if "found" in r]
            pred = np.array([r["predicted"] for r in done], float)
            found = np.array([r["found"] for r in done], float)
            prompt = np.array([r["prompt"] for r in done], float)
            best = np.array([r["best"] for r in done], float)
            depth = np.array([r["chosen_depth"] for r in done], float)
            over = pred > found + 255
            under = pred + 255 < found
            print(
                f"{mode}: {len(run['requests'])} dispatched, {len(done)} with a first token; "
                f"found cached {found.sum() / prompt.sum() * 100:.1f} % of prompt tokens, "
                f"predicted {pred.sum() / prompt.sum() * 100:.1f} %"
            )
            print(
                f"  index over the worker (by >= 256 tokens): {over.sum()} requests, "
                f"{(pred - found)[over].sum():.0f} tokens; under: {under.sum()} requests, "
                f"{(found - pred)[under].sum():.0f} tokens"
            )
            print(
                f"  holder elsewhere (deepest match > chosen's): {(best > depth).sum()} requests, "
                f"{(best - depth).sum():.0f} tokens; cold (no match anywhere): {(best == 0).sum()}"
            )
            ev = run["events"]
            print(
                f"  events: {ev['batches']} batches, {ev['stored']} stored / {ev['removed']} removed hashes, "
                f"applied in {ev['apply_s']:.2f} s; removed while pending {ev['removed_pending']}, "
                f"removed within 1 s of a dispatch naming it {ev['removed_resent']}"
            )
            s = np.array(run["settle_s"]) if run["settle_s"] else np.zeros(1)
            print(
                f"  pending -> stored: {len(run['settle_s'])} blocks, p50 {np.percentile(s, 50) * 1e3:.0f} ms, "
                f"p90 {np.percentile(s, 90) * 1e3:.0f} ms, p99 {np.percentile(s, 99) * 1e3:.0f} ms"
            )


if __name__ == "__main__":
    if sys.argv[1:2] == ["summary"]:
        summary(sys.argv[2])
        sys.exit(0)
    setattr(Scheduler, "dispatched", _dispatched_watched)  # noqa: B010
    setattr(RouterService, "_after_first", _after_first_watched)  # noqa: B010
    setattr(ExactPrefixIndex, "apply", _apply_watched)  # noqa: B010
    setattr(ExactPrefixIndex, "dispatched", _exact_dispatched_watched)  # noqa: B010
    atexit.register(report)
    sys.exit(main())
