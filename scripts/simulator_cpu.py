"""CPU seconds of a smaller ``python -m bench simulator`` run, and a digest of its outcomes.

The bench's shape (a prefill/decode fleet on the bundled profile, the ``mixed`` workload at
1.56 requests/s per instance pair, ``slo`` with ``refit`` calibration) at a size a shared machine
can repeat: compare two checkouts by alternating runs of each (``PYTHONPATH=<checkout>``); the
digest must match between them (the same per-request outcomes). Process time, which a loaded
machine inflates far less than wall time.

    .venv/bin/python scripts/simulator_cpu.py [PAIRS] [REQUESTS] [--calibration off|scale|refit] [--update-every-s S]
"""

from __future__ import annotations

import argparse
import hashlib
import time

from router.core.calibration import CalibrationConfig
from router.core.config import SchedulerConfig
from sim.cluster import SimFleet, simulate
from sim.fleet import fleet_from_counts
from workload.spec import generate_requests, load_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "pairs", nargs="?", type=int, default=32, help="prefill instances (= decode instances)"
    )
    parser.add_argument("requests", nargs="?", type=int, default=2000, help="requests to simulate")
    parser.add_argument("--calibration", default="refit", choices=("off", "scale", "refit"))
    parser.add_argument(
        "--update-every-s",
        type=float,
        default=0.0,
        help="the calibrator's update_every_s (default: %(default)s, the router's default)",
    )
    args = parser.parse_args()
    if not (1 <= args.pairs <= 1024 and 1 <= args.requests <= 1_000_000):
        parser.error("PAIRS must be in [1, 1024] and REQUESTS in [1, 1000000]")
    fleet = SimFleet(fleet_from_counts(prefill=args.pairs, decode=args.pairs))
    rate = 400.0 * args.pairs / 128  # the bench's load per instance
    plans = generate_requests(
        load_workload("mixed").with_arrival(rate_per_s=rate), rng=0, num_requests=args.requests
    )
    config = SchedulerConfig(scheduling_policy="slo", calibration=args.calibration)
    cpu = time.process_time()
    calibration = CalibrationConfig(mode=args.calibration, update_every_s=args.update_every_s)
    outcome = simulate(fleet, config, plans, seed=0, calibration=calibration)
    cpu = time.process_time() - cpu
    digest = hashlib.sha256(repr(outcome.results).encode()).hexdigest()[:16]
    print(
        f"{args.pairs} + {args.pairs} instances, {args.requests} requests at {rate:g} req/s, "
        f"calibration {args.calibration} (update_every_s {args.update_every_s:g}): {cpu:.2f} s CPU, {outcome.stats.steps} steps, digest {digest}"
    )


if __name__ == "__main__":
    main()
