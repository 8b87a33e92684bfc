"""Every engine step of one SCLS scenario under request and slice dispatch: where the engine time goes.

Runs one scenario of ``scripts/slice_suite.py`` (by name) twice over the same plan, least-requests
and slice dispatch, with every engine step simulated (no fast-forwarded decode runs), and prints per
mode: engine busy time, prefill steps and tokens, decode-only steps with their mean batch (plain and
weighted by step time), the KV in use (time-weighted) and, for slices, the KV plan next to it: what
the running slices are booked to at their peak (``committed_kv``), the budget new work may fill, and
both while work waits in the instance's queue. Used to say why slices lose on long answers
(docs/papers.md, seed 002).

    python scripts/slice_plan_trace.py ib12k-4.5-s21
    python scripts/slice_plan_trace.py 5x-ib12k-6-s43 --config '{"kv_headroom": 1.0}'
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from slice_suite import _setup, scenario_run

from engine.model import ScheduledStep, SimCore
from router.core.config import SchedulerConfig
from router.core.slicing import SliceScheduler
from sim.cluster import simulate


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("scenario", help="a scenario name of scripts/slice_suite.py (e.g. ib12k-4.5-s21)")
    parser.add_argument("--config", default="{}", help="SliceConfig fields as a JSON object")
    args = parser.parse_args()
    argv, seed, config = scenario_run(parser, args.scenario, args.config)
    scheds: list[SliceScheduler] = []
    cores: dict[int, str] = {}
    rows: list[tuple[float, ...]] = []
    plain_schedule, plain_init = SimCore.schedule, SliceScheduler.__init__

    def init(self: SliceScheduler, *a: Any, **k: Any) -> None:
        plain_init(self, *a, **k)
        scheds.append(self)

    def schedule(core: SimCore) -> ScheduledStep | None:
        step = plain_schedule(core)
        if step is None:
            return None
        cap = core.config.num_kv_blocks * core.config.block_size
        used = core.num_used_kv_tokens / cap
        sched = scheds[-1] if scheds else None
        inst = cores.get(id(core), "")
        com = bud = queued = 0.0
        if sched is not None and inst in sched.instances:
            com, bud, queued = sched.committed_kv(inst) / cap, sched.budget_kv(inst) / cap, sched.queued(inst)
        waiting = core.num_waiting
        rows.append(
            (
                step.duration_ms,
                step.num_decode_requests,
                step.num_prefill_tokens,
                used,
                com,
                bud,
                queued,
                waiting,
            )
        )
        return step

    def run(mode: str) -> None:
        rows.clear()
        fleet, plans = _setup(argv)
        made: list[SimCore] = []
        core_init = SimCore.__init__

        def track(self: SimCore, *a: Any, **k: Any) -> None:
            core_init(self, *a, **k)
            made.append(self)
            cores[id(self)] = fleet.ids[len(made) - 1] if len(made) <= len(fleet.ids) else ""

        SimCore.__init__ = track  # type: ignore[method-assign]
        try:
            if mode == "request":
                policy = SchedulerConfig(scheduling_policy="least-requests")
                out = simulate(fleet, policy, plans, seed=seed, fast_forward=False)
            else:
                out = simulate(
                    fleet,
                    SchedulerConfig(calibration="off"),
                    plans,
                    seed=seed,
                    slicing=config,
                    resume_cache=config.prefix_cache,
                    engine_prefix_cache=False,
                    fast_forward=False,
                )
        finally:
            SimCore.__init__ = core_init  # type: ignore[method-assign]
        a = np.array(rows)
        dur, dec, pre, used, com, bud, queued, waiting = a.T
        w = dur / dur.sum()
        pf, do = pre > 0, pre == 0
        thru = sum(r.ok for r in out.results) / out.duration_s
        print(
            f"{mode}: {thru:.3f} req/s, makespan {out.duration_s:.1f} s, {out.stats.preemptions} preemptions, "
            f"engine busy {dur.sum() / 1e3:.1f} s"
        )
        print(
            f"  prefill steps {pf.sum()} ({dur[pf].sum() / 1e3:.1f} s, {pre.sum():,.0f} tokens); decode-only steps "
            f"{do.sum()} ({dur[do].sum() / 1e3:.1f} s), mean batch {dec[do].mean():.2f}, "
            f"time-weighted {(dur[do] * dec[do]).sum() / dur[do].sum():.2f}"
        )
        e = waiting > 0
        we = w[e].sum() or 1.0
        print(
            f"  KV in use {np.dot(w, used):.1%}; while requests wait in the engine's queue "
            f"({np.dot(w, e):.0%} of the time) {np.dot(w[e], used[e]) / we:.1%}"
        )
        if mode == "slice":
            q = queued > 0
            wq = w[q].sum() or 1.0
            print(
                f"  plan: committed {np.dot(w, com):.1%}, budget {np.dot(w, bud):.1%}, committed past the KV "
                f"{np.dot(w, com > 1.0):.1%} of the time"
            )
            print(
                f"  while work waits in the instance's queue ({np.dot(w, q):.0%} of the time): KV in use "
                f"{np.dot(w[q], used[q]) / wq:.1%}, committed {np.dot(w[q], com[q]) / wq:.1%}, budget "
                f"{np.dot(w[q], bud[q]) / wq:.1%}, decode batch {np.dot(w[q], dec[q]) / wq:.2f}"
            )
            print(f"  counters {out.counters}")

    SimCore.schedule = schedule  # type: ignore[method-assign,assignment]
    SliceScheduler.__init__ = init  # type: ignore[method-assign]
    try:
        run("request")
        run("slice")
    finally:
        SimCore.schedule = plain_schedule  # type: ignore[method-assign]
        SliceScheduler.__init__ = plain_init  # type: ignore[method-assign]
    return 0


if __name__ == "__main__":
    sys.exit(main())
