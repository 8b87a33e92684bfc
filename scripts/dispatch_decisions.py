"""Placement decisions per placed request for each dispatcher, in the simulator (deterministic).

    python scripts/dispatch_decisions.py [--rate 9] [--duration 40] [--workers 4] [--incremental on|exact|off]

The workload and fleet of ``python -m bench peers`` (the mixed workload at 9 req/s on 4 neutral
instances of the bundled profile at real speed), replayed in virtual time: the counts are the
dispatcher's own, free of the host's noise. Prints, per queue policy, the decisions the
dispatcher asked placement for, the requests placed, their ratio, SLO attainment and the wall time
the run took.
"""

from __future__ import annotations

import argparse
import time

from engine.model import SimConfig
from router.core.config import SchedulerConfig
from router.core.queue import QueueConfig
from sim.cluster import SimFleet, simulate
from sim.fleet import fleet_from_counts
from workload.report import summarize
from workload.spec import generate_requests, load_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=9.0)
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--policies", default="none,edf,fcfs,priority,sa,qlm")
    parser.add_argument(
        "--incremental",
        default="on",
        choices=("on", "exact", "off"),
        help="incremental dispatch (router.core.queue.LoadWatch); off: every pass offers every entry",
    )
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed")
    args = parser.parse_args()
    spec = load_workload("mixed").with_arrival(rate_per_s=args.rate)
    plans = generate_requests(spec, rng=args.seed, duration_s=args.duration)
    fleet = SimFleet(fleet_from_counts(neutral=args.workers, engine=SimConfig()))
    print(
        f"{len(plans)} requests, {args.workers} neutral instances, {args.rate:g} req/s, "
        f"seed {args.seed}, incremental dispatch {args.incremental}"
    )
    print(
        f"{'dispatcher':<10}{'decisions':>10}{'placed':>8}{'per placed':>11}{'attainment':>11}{'wall s':>8}"
    )
    for name in args.policies.split(","):
        started = time.perf_counter()
        out = simulate(
            fleet,
            SchedulerConfig(scheduling_policy="slo"),
            plans,
            queue=QueueConfig(queue_policy=name),
            incremental_dispatch=args.incremental,
        )
        wall = time.perf_counter() - started
        placed = sum(1 for r in out.results if r.prefill_instance_id)
        att = summarize(out.results, out.duration_s).overall.slo_attainment
        ratio = out.stats.decisions / max(placed, 1)
        print(f"{name:<10}{out.stats.decisions:>10}{placed:>8}{ratio:>11.2f}{att:>11.3f}{wall:>8.1f}")


if __name__ == "__main__":
    main()
