"""Compare the router's autoscaling signal with ``slo-router plan``, per role.

For each ``WORKLOAD:RATE`` (a preset, a mix, or ``trace:FILE`` with its gaps scaled to RATE):
``plan`` finds the PD fleet meeting 95 % attainment (``--plan-requests`` requests, ``--policy``
as ``slo-router plan --policy`` takes it, ``slo`` by default as there; the router queue
``--queue-policy``, ``edf`` by default as the router runs it), then a seeded simulation
of ``N`` requests on that fleet, placed by the same policy, reports ``slo_router_desired_instances`` as the router
would export it at the last arrival (``router.core.worker_count.DesiredInstances``).

``--window``: ``plan`` on the requests the signal reads instead: the same ``N`` requests, scoring
only those that arrive in the last minute (the window the signal's rate and lengths come from).
The first ``--plan-requests`` of a trace are not the load of its last minute (the Azure
conversation trace scaled to 16 req/s runs its last minute at 14.2 req/s of longer prompts).

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
from sim.sweep import open_loop, policy_overrides
from workload.spec import RequestPlan, generate_requests, load_workload
from workload.traces import load_trace

#: The window the signal reads its load over (``LoadTracker``'s default), s.
SIGNAL_WINDOW_S = 60.0


def _window_start(plans: list[RequestPlan]) -> float:
    """Seconds from the first arrival to the start of the last minute (the signal's window)."""
    return max(plans[-1].arrival_s - SIGNAL_WINDOW_S - plans[0].arrival_s, 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("requests", type=int, help="requests of the simulated run")
    parser.add_argument("points", nargs="+", metavar="WORKLOAD:RATE")
    parser.add_argument("--plan-requests", type=int, default=1500, help="requests per plan simulation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--policy",
        default="slo",
        help="placement policy of the plan and the run, as `slo-router plan --policy` (default: %(default)s; "
        "before 30 Nov this script ran SchedulerConfig()'s own default, load-balance)",
    )
    parser.add_argument(
        "--queue-policy",
        default="edf",
        help="router queue of the plan's simulations and of the run, the same for both (default: %(default)s, "
        "the router's; before 30 Nov the plan ran none, `slo-router plan`'s default for slo, while the run "
        "ran edf, so the plan sized a fleet that refuses what the signal's fleet queues)",
    )
    parser.add_argument(
        "--window",
        action="store_true",
        help="plan on the signal's own window: the N requests, those of the last minute scored",
    )
    args = parser.parse_args()
    if args.requests < 1 or args.plan_requests < 1:
        parser.error("requests and --plan-requests must be >= 1")
    config = SchedulerConfig(**policy_overrides(args.policy))
    for point in args.points:
        point, _, given = point.partition("@")
        name, _, rate_text = point.rpartition(":")
        rate = float(rate_text)
        started = time.perf_counter()
        fixed = tuple(int(x) for x in given.split("+")) if given else None
        if name.startswith("trace:"):
            trace = load_trace(name)
            spec = trace.workload()
            plans = trace.plans(args.requests, rate)
            planned = fixed or plan_fleet(
                spec,
                rate,
                0.95,
                config,
                num_requests=args.requests if args.window else args.plan_requests,
                requests=plans if args.window else trace.plans(args.plan_requests, rate),
                warmup_s=_window_start(plans) if args.window else 0.0,
                queue_policy=args.queue_policy,
            )
        else:
            workload = load_workload(name)
            spec = open_loop(workload).with_arrival(rate_per_s=rate)
            plans = generate_requests(spec, rng=args.seed, num_requests=args.requests)
            planned = fixed or plan_fleet(
                workload,
                rate,
                0.95,
                config,
                num_requests=args.requests if args.window else args.plan_requests,
                seed=args.seed,
                requests=plans if args.window else None,
                warmup_s=_window_start(plans) if args.window else 0.0,
                queue_policy=args.queue_policy,
            )
        prefill, decode = (
            (planned[0], planned[1]) if isinstance(planned, tuple) else (planned.prefill, planned.decode)
        )
        fleet = SimFleet(fleet_from_counts(prefill=prefill, decode=decode))
        outcome = simulate(
            fleet, config, plans, seed=args.seed, queue=QueueConfig(queue_policy=args.queue_policy)
        )
        d = outcome.desired
        assert d is not None
        source = f"Eq. 7 over {d.heartbeats} heartbeats" if d.fitted else "below R"
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
