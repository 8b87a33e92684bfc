"""Prefix-cache routing in the simulator: slo with cache-aware prediction against slo without it and
against pure cache affinity, on a shared-prefix workload or the Mooncake conversation trace.

    python scripts/prefix_cache_eval.py synthetic --rate 8 --neutral 4 --requests 1000 --groups 48
    python scripts/prefix_cache_eval.py mooncake --scale 1.0 --neutral 8 --requests 1500

Prints TTFT p50/p90, SLO attainment and the fleet's prefix-cache hit rate per arm (``simulate``
with the router queue ``edf`` and the default calibration). ``mooncake`` reads
``../shared/traces/mooncake-conversation.jsonl`` (``--trace``): arrivals times ``--scale``
(smaller = more load), prompts capped at 30k tokens, a 5 s TTFT and 100 ms TPOT target.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np

from engine.model import SimConfig
from router.core.config import SchedulerConfig
from router.core.queue import QueueConfig
from sim.cluster import SimFleet, simulate
from sim.fleet import fleet_from_counts
from workload.report import slo_met
from workload.spec import RequestPlan, SloTarget, generate_requests, load_workload

ARMS = (("slo", "off"), ("slo", "exact"), ("slo", "approximate"), ("cache-affinity", "exact"))
TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake-conversation.jsonl"


def mooncake(path: Path, n: int, scale: float) -> list[RequestPlan]:
    plans = []
    with path.open() as f:
        for i, line in enumerate(f):
            if i >= n:
                break
            row = json.loads(line)
            plans.append(
                RequestPlan(
                    index=i,
                    arrival_s=row["timestamp"] / 1000.0 * scale,
                    class_name="conversation",
                    prompt_tokens=min(int(row["input_length"]), 30000),
                    max_tokens=max(1, min(int(row["output_length"]), 2000)),
                    slo=SloTarget(ttft_ms=5000.0, tpot_ms=100.0),
                    prompt_seed=i,
                    hash_ids=tuple(row["hash_ids"]),
                )
            )
    return plans


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("workload", choices=("synthetic", "mooncake"))
    parser.add_argument("--rate", type=float, default=8.0, help="synthetic: arrivals per second")
    parser.add_argument("--groups", type=int, default=48, help="synthetic: shared prefixes")
    parser.add_argument("--scale", type=float, default=1.0, help="mooncake: arrival-time factor")
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--neutral", type=int, default=4, help="neutral sim instances")
    parser.add_argument("--requests", type=int, default=1000)
    args = parser.parse_args()
    if args.workload == "synthetic":
        spec = load_workload("prefix-heavy").with_arrival(rate_per_s=args.rate)
        spec = dataclasses.replace(
            spec, classes=(dataclasses.replace(spec.classes[0], prefix_groups=args.groups),)
        )
        plans = generate_requests(spec, rng=0, num_requests=args.requests)
        engine = SimConfig()
    else:
        plans = mooncake(args.trace, args.requests, args.scale)
        engine = SimConfig(max_model_len=32768, kv_capacity_tokens=262144)
    fleet = SimFleet(fleet_from_counts(neutral=args.neutral, engine=engine))
    print(f"{'policy':15s} {'routing':12s} {'TTFT p50':>9s} {'p90':>9s} {'attain':>7s} {'hit rate':>8s}")
    for policy, routing in ARMS:
        config = SchedulerConfig(scheduling_policy=policy, prefix_cache_routing=routing)
        out = simulate(fleet, config, plans, queue=QueueConfig(queue_policy="edf"))
        ttft = [r.ttft_ms for r in out.results if r.ttft_ms is not None]
        attainment = float(np.mean([slo_met(r) for r in out.results]))
        print(
            f"{policy:15s} {routing:12s} {np.percentile(ttft, 50):8.0f}ms {np.percentile(ttft, 90):8.0f}ms "
            f"{100 * attainment:6.1f}% {100 * (out.cache_hit_rate or 0.0):7.1f}%",
            flush=True,
        )


if __name__ == "__main__":
    main()
