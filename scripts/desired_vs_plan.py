"""Compare the router's autoscaling signal with ``slo-router plan``, per role.

For each ``WORKLOAD:RATE`` (a preset, a mix, or ``trace:FILE`` with its gaps scaled to RATE):
``plan`` finds the PD fleet meeting 95 % attainment (``--plan-requests`` requests, policy ``slo``),
then a seeded simulation of ``N`` requests on that fleet reports ``slo_router_desired_instances``
as the router would export it at the last arrival (``router.core.worker_count.DesiredInstances``).

    python scripts/desired_vs_plan.py 3000 chat:16 interactive-batch:8 trace:/path/azure.csv:8

``WORKLOAD:RATE@P+D`` takes the fleet as given (a plan found before) and runs only the simulation.
"""

from __future__ import annotations

import argparse
import time

from router.core.config import SchedulerConfig
from router.core.queue import QueueConfig
from sim.cluster import SimFleet, simulate
from sim.fleet import fleet_from_counts
from sim.plan import plan_fleet
from sim.sweep import open_loop
from workload.spec import generate_requests, load_workload
from workload.traces import load_trace


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("requests", type=int, help="requests of the simulated run")
    parser.add_argument("points", nargs="+", metavar="WORKLOAD:RATE")
    parser.add_argument("--plan-requests", type=int, default=1500, help="requests per plan simulation")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = SchedulerConfig()
    for point in args.points:
        point, _, given = point.partition("@")
        name, _, rate_text = point.rpartition(":")
        rate = float(rate_text)
        started = time.perf_counter()
        fixed = tuple(int(x) for x in given.split("+")) if given else None
        if name.startswith("trace:"):
            trace = load_trace(name)
            spec = trace.workload()
            planned = fixed or plan_fleet(
                spec,
                rate,
                0.95,
                config,
                num_requests=args.plan_requests,
                requests=trace.plans(args.plan_requests, rate),
            )
            plans = trace.plans(args.requests, rate)
        else:
            workload = load_workload(name)
            planned = fixed or plan_fleet(
                workload, rate, 0.95, config, num_requests=args.plan_requests, seed=args.seed
            )
            spec = open_loop(workload).with_arrival(rate_per_s=rate)
            plans = generate_requests(spec, rng=args.seed, num_requests=args.requests)
        prefill, decode = (
            (planned[0], planned[1]) if isinstance(planned, tuple) else (planned.prefill, planned.decode)
        )
        fleet = SimFleet(fleet_from_counts(prefill=prefill, decode=decode))
        outcome = simulate(fleet, config, plans, seed=args.seed, queue=QueueConfig(queue_policy="edf"))
        d = outcome.desired
        assert d is not None
        source = f"Eq. 7 over {d.heartbeats} heartbeats" if d.fitted else "fluid"
        how = (
            "given"
            if isinstance(planned, tuple)
            else f"{100 * planned.attainment:.1f} %, started from {planned.estimate.prefill} + {planned.estimate.decode}"
        )
        print(
            f"{name} @ {rate:g} req/s: plan {prefill} + {decode} ({how}); "
            f"signal {d.prefill} + {d.decode} ({source}); "
            f"{time.perf_counter() - started:.0f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
