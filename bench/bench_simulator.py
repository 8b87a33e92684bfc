"""Simulator speed: simulated requests per wall second on a 256-instance fleet with 50,000 requests.

The fleet is 128 prefill + 128 decode instances on the bundled Qwen2.5-7B profile,
the workload the default ``mixed`` one at 400 requests/s (the fleet busy but
meeting most SLOs), placed by the ``slo`` policy with online calibration
(``refit``, the default: the router's calibrator fed every engine step, its
refits included in the figure) — the same run as::

    slo-router simulate --prefill 128 --decode 128 --policies slo --rates 400 --num-requests 50000 \
        --calibrations refit
"""

from __future__ import annotations

import time

from bench.figures import Figure
from router.core.config import SchedulerConfig
from sim.cluster import SimFleet, simulate
from sim.fleet import fleet_from_counts
from workload.report import summarize
from workload.spec import generate_requests, load_workload

PREFILL = DECODE = 128
NUM_REQUESTS = 50_000
RATE_PER_S = 400.0
POLICY = "slo"
CALIBRATION = "refit"


def main() -> list[Figure]:
    fleet = SimFleet(fleet_from_counts(prefill=PREFILL, decode=DECODE))
    spec = load_workload("mixed").with_arrival(rate_per_s=RATE_PER_S)
    plans = generate_requests(spec, rng=0, num_requests=NUM_REQUESTS)
    cpu = time.process_time()
    outcome = simulate(
        fleet, SchedulerConfig(scheduling_policy=POLICY, calibration=CALIBRATION), plans, seed=0
    )
    cpu = time.process_time() - cpu
    report = summarize(outcome.results, outcome.duration_s, class_slos=spec.class_slos())
    stats = outcome.stats
    print(
        f"{fleet.n} instances ({PREFILL} prefill + {DECODE} decode), {NUM_REQUESTS:,} requests "
        f"(mixed, Poisson {RATE_PER_S:g} req/s), policy {POLICY}, calibration {CALIBRATION}"
    )
    print(
        f"  wall {outcome.wall_s:.1f} s, cpu {cpu:.1f} s: "
        f"{NUM_REQUESTS / outcome.wall_s:,.0f} simulated requests per wall second"
    )
    print(
        f"  virtual makespan {outcome.duration_s:.0f} s ({outcome.duration_s / outcome.wall_s:.1f}x real time), "
        f"{stats.steps:,} engine steps ({stats.steps / outcome.wall_s:,.0f}/s), {stats.events:,} events, "
        f"{stats.decisions:,} decisions"
    )
    print(
        f"  SLO attainment {100.0 * report.overall.slo_attainment:.1f}% (a sanity check, not a speed figure)"
    )
    return [
        Figure(
            f"simulator, {fleet.n} instances x {NUM_REQUESTS:,} requests",
            f"{outcome.wall_s:.1f} s wall ({NUM_REQUESTS / outcome.wall_s:,.0f} requests/s); goal ≥ 2,000 requests/s",
        )
    ]


if __name__ == "__main__":
    main()
