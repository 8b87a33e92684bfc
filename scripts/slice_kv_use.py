"""What the engines hold under request and slice dispatch: KV use and decode batch, step-time weighted.

Runs one synthetic workload on K neutral instances of a given KV capacity twice over the same
plan, least-requests (request dispatch, every engine step simulated: no fast-forwarded decode runs)
and slice dispatch, and prints per mode the completed requests per second of makespan, the
preemptions, the KV in use and the decode batch averaged over engine steps weighted by their
duration, and the prompt tokens prefilled (recomputes included). Used to say why slices lose on
long answers (docs/papers.md, seed 002, "Long answers").

    python scripts/slice_kv_use.py --workload interactive-batch --kv 16384 --rate 6 --seed 1 --num-requests 1200
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from engine.model import ScheduledStep, SimConfig, SimCore
from router.core.config import SchedulerConfig
from router.core.slicing import SliceConfig
from sim.cluster import SimFleet, simulate
from sim.fleet import fleet_from_counts
from sim.slicing import simulate_slices
from workload.sequence import request_sequence
from workload.spec import load_workload

#: (duration ms, decode requests, prefill tokens, KV share in use) of every engine step of a run.
_Steps = list[tuple[float, int, int, float]]


def _recording(steps: _Steps) -> Callable[[SimCore], ScheduledStep | None]:
    plain = SimCore.schedule

    def schedule(core: SimCore) -> ScheduledStep | None:
        step = plain(core)
        if step is not None:
            total = core.config.num_kv_blocks
            used = core.num_used_kv_tokens / (total * core.config.block_size) if total else 0.0
            steps.append((step.duration_ms, step.num_decode_requests, step.num_prefill_tokens, used))
        return step

    return schedule


def _line(mode: str, outcome: Any, steps: _Steps) -> str:
    done = sum(1 for r in outcome.results if r.ok)
    thru = done / outcome.duration_s if outcome.duration_s > 0 else 0.0
    weight = sum(s[0] for s in steps) or 1.0
    kv = sum(s[0] * s[3] for s in steps) / weight
    batch = sum(s[0] * s[1] for s in steps) / weight
    prefilled = sum(s[2] for s in steps)
    return (
        f"{mode:8s} {thru:6.2f} req/s  {outcome.stats.preemptions:5d} preemptions  KV in use {kv:5.1%}  "
        f"decode batch {batch:5.1f}  prefilled {prefilled:,} tokens"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="interactive-batch", help="a workload preset or file")
    parser.add_argument("--kv", type=int, default=16384, help="KV capacity per instance, tokens")
    parser.add_argument("--rate", type=float, default=6.0, help="mean arrival rate, req/s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-requests", type=int, default=1200)
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument("--kv-headroom", type=float, default=0.9, help="slice mode: SliceConfig.kv_headroom")
    args = parser.parse_args()
    if not 1 <= args.num_requests <= 100_000:
        parser.error(f"--num-requests must be in 1..100000, got {args.num_requests}")
    if not 1 <= args.instances <= 256:
        parser.error(f"--instances must be in 1..256, got {args.instances}")
    plans = request_sequence(
        load_workload(args.workload), seed=args.seed, num_requests=args.num_requests, rate=args.rate
    )
    engine = dataclasses.replace(SimConfig(), kv_capacity_tokens=args.kv)

    def fleet() -> SimFleet:
        return SimFleet(fleet_from_counts(neutral=args.instances, engine=engine))

    plain = SimCore.schedule
    try:
        steps: _Steps = []
        SimCore.schedule = _recording(steps)  # type: ignore[method-assign,assignment]
        config = SchedulerConfig(scheduling_policy="least-requests")
        request = simulate(fleet(), config, plans, seed=args.seed, fast_forward=False)
        print(_line("request", request, steps))
        steps = []
        SimCore.schedule = _recording(steps)  # type: ignore[method-assign,assignment]
        sliced = simulate_slices(fleet(), plans, SliceConfig(kv_headroom=args.kv_headroom), seed=args.seed)
        print(_line("slice", sliced, steps))
    finally:
        SimCore.schedule = plain  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
