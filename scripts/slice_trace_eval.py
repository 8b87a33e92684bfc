"""Request against slice dispatch on a production trace slice (``simulate --dispatch-modes`` takes
synthetic workloads only): the first N requests of a trace, rescaled to a mean rate, on K neutral
instances of a given KV capacity. Prints completed requests per second of makespan, preemptions,
and the two modes' ratio.

    python scripts/slice_trace_eval.py /work/shared/traces/azure-conv-2023.csv --rate 8 --kv 8192
"""

from __future__ import annotations

import argparse
import dataclasses

from engine.model import SimConfig
from router.core.config import SchedulerConfig
from router.core.slicing import SliceConfig, slices_pay
from sim.cluster import SimFleet, simulate
from sim.fleet import fleet_from_counts
from sim.slicing import simulate_slices
from workload.traces import TraceOptions, load_trace


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trace", help="trace file (Azure CSV or Mooncake JSONL)")
    parser.add_argument("--rate", type=float, required=True, help="mean arrival rate, req/s")
    parser.add_argument("--kv", type=int, default=8192, help="KV capacity per instance, tokens")
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument("--max-tokens", type=int, default=2048, help="the requests' output cap")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    trace = load_trace(f"trace:{args.trace}", TraceOptions(max_tokens=args.max_tokens))
    plans = trace.plans(args.num_requests, rate=args.rate)
    engine = dataclasses.replace(SimConfig(), kv_capacity_tokens=args.kv)

    def fleet() -> SimFleet:
        return SimFleet(fleet_from_counts(neutral=args.instances, engine=engine))

    config = SchedulerConfig(scheduling_policy="least-requests")
    request = simulate(fleet(), config, plans, seed=args.seed)
    sliced = simulate_slices(fleet(), plans, SliceConfig(), seed=args.seed)

    def thru(outcome) -> float:  # type: ignore[no-untyped-def]
        done = sum(1 for r in outcome.results if r.ok)
        return done / outcome.duration_s if outcome.duration_s > 0 else 0.0

    t_req, t_sl = thru(request), thru(sliced)
    pilot = simulate(fleet(), config, plans[: max(100, len(plans) // 4)], seed=args.seed)
    auto = "slice" if slices_pay(pilot.stats.preemptions, max(100, len(plans) // 4)) else "request"
    gap = sliced.figures.resume_gap_p99_ms
    stall = "-" if gap is None else f"{gap:.0f} ms"
    print(
        f"{trace.format} {args.num_requests} req @ {args.rate:g}/s, {args.instances} x KV {args.kv}: "
        f"request {t_req:.2f} req/s ({request.stats.preemptions} preemptions), "
        f"slice {t_sl:.2f} req/s ({sliced.stats.preemptions}), slice/request {t_sl / t_req:.2f}, auto picks {auto}, "
        f"stall p99 between slices {stall}"
    )


if __name__ == "__main__":
    main()
