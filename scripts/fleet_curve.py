"""Attainment of given fleets per policy, scored the way ``slo-router plan`` scores a fleet.

The same seeded requests, the router queue ``plan`` gives each policy (``edf`` for binpack, none
otherwise), one line per policy:

    python scripts/fleet_curve.py mixed 9 --kv 16384 --seed 4 2+4 2+5 3+5 n4
"""

from __future__ import annotations

import argparse

from engine.model import SimConfig
from router.core.config import SchedulerConfig
from router.core.queue import QueueConfig
from sim.cluster import SimFleet, simulate
from sim.fleet import fleet_from_counts
from sim.sweep import open_loop, policy_overrides
from workload.report import summarize
from workload.spec import generate_requests, load_workload
from workload.traces import load_trace


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("workload")
    parser.add_argument("rate", type=float)
    parser.add_argument("fleets", nargs="+", help="P+D (prefill + decode) or nN (N neutral)")
    parser.add_argument(
        "--kv", type=int, default=SimConfig().kv_capacity_tokens, help="KV tokens per instance"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument("--policies", default="binpack,least-requests")
    parser.add_argument(
        "--warmup-s", type=float, default=0.0, help="score requests arriving after S seconds only"
    )
    parser.add_argument(
        "--queue-policy", help="router queue for every policy (default: what plan gives each)"
    )
    args = parser.parse_args()
    engine = SimConfig(kv_capacity_tokens=args.kv)
    if args.workload.startswith("trace:"):
        trace = load_trace(args.workload)
        workload = trace.workload()
        plans = trace.plans(args.num_requests, args.rate)
    else:
        workload = load_workload(args.workload)
        spec = open_loop(workload).with_arrival(rate_per_s=args.rate)
        plans = generate_requests(spec, rng=args.seed, num_requests=args.num_requests)
    slos = open_loop(workload).with_arrival(rate_per_s=args.rate).class_slos()
    for policy in args.policies.split(","):
        config = SchedulerConfig(**policy_overrides(policy))
        queue = QueueConfig(queue_policy=args.queue_policy or ("edf" if policy == "binpack" else "none"))
        row = []
        for text in args.fleets:
            if text.startswith("n"):
                p, d, n = 0, 0, int(text[1:])
            else:
                first, _, second = text.partition("+")
                p, d, n = int(first), int(second), 0
            counts = fleet_from_counts(prefill=p, decode=d, neutral=n, engine=engine)
            fleet = SimFleet(counts, profile_label=config.profile_label)
            out = simulate(fleet, config, plans, seed=args.seed, queue=queue)
            scored = [r for r in out.results if r.start_s >= plans[0].arrival_s + args.warmup_s]
            share = summarize(scored, out.duration_s, class_slos=slos).overall.slo_attainment
            row.append(f"{text}: {100 * share:.1f}% ({out.stats.preemptions} preemptions)")
        print(f"{policy}: " + ", ".join(row), flush=True)


if __name__ == "__main__":
    main()
