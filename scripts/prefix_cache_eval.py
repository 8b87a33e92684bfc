"""Prefix-cache routing in the simulator: slo with cache-aware prediction against slo without it and
against pure cache affinity, on a shared-prefix workload or the Mooncake conversation trace.

    python scripts/prefix_cache_eval.py synthetic --rate 8 --neutral 4 --requests 1000 --groups 48
    python scripts/prefix_cache_eval.py mooncake --scale 1.0 --neutral 8 --requests 1500
    python scripts/prefix_cache_eval.py ceiling --cache-tokens 2097152,8388608

``ceiling`` asks what any router could get from the trace's reuse, before routing: per window of
the trace, the hit rate of one infinite cache and of one LRU cache of the fleet's whole KV (every
turn of a conversation on the instance that holds its history, never a miss from placement), the
median request's cached share, the time since a conversation's history (more than its first block) was last sent, and the zero-queue TTFT p50
ratio those hits give on the default profile (each prompt's prefill on its uncached tokens only,
against its full prompt): the best a cache-aware TTFT p50 can be when queueing does not set it.

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
PROFILE = Path("profiling_data") / "qwen2.5-7b-2xv100-linear"
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


def ceiling(path: Path, windows: list[tuple[float, float]], caches: list[int], warm: bool = False) -> None:
    """Print the reuse a trace offers per window and cache size (see the module docstring).

    ``warm``: the cache first takes every request before the window (a fleet that has been serving
    the trace), and only the window's requests are counted; else the window starts cold."""
    from collections import OrderedDict

    from workload.traces import MOONCAKE_BLOCK_TOKENS, read_trace

    _, records = read_trace(path)
    profile = json.loads((Path(__file__).resolve().parents[1] / PROFILE / "ttft.json").read_text())
    xs = np.array([r["tokens_num"] for r in profile["results"]], dtype=float)
    ys = np.array([r["p50"] for r in profile["results"]], dtype=float)

    def prefill_ms(tokens: np.ndarray) -> np.ndarray:
        # linear inside the profile and past its end (the profile is linear in the prompt)
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        out: np.ndarray = np.where(
            tokens <= xs[-1], np.interp(tokens, xs, ys), ys[-1] + slope * (tokens - xs[-1])
        )
        return out

    block = MOONCAKE_BLOCK_TOKENS
    print(
        f"{'window s':>11s} {'reqs':>6s} {'cache tokens':>12s} {'hit':>6s} {'median req':>10s} "
        f"{'TTFT p50 ratio':>14s} {'history gap p50/p90 s':>22s}"
    )
    for start, end in windows:
        rows = [r for r in records if (warm or start <= r.arrival_s) and r.arrival_s < end]
        for cap in caches:
            lru: OrderedDict[tuple[int, ...], None] = OrderedDict()
            last: dict[tuple[int, ...], float] = {}
            cached, prompt, gaps = [], [], []
            for r in rows:
                keys = [tuple(r.hash_ids[: i + 1]) for i in range(len(r.hash_ids))]
                k = 0
                for key in keys:
                    if key not in lru:
                        break
                    k += 1
                # a conversation's history, not only the first block every prompt shares
                if k > 1 and r.arrival_s >= start:
                    gaps.append(r.arrival_s - last[keys[k - 1]])
                for key in keys:
                    lru[key] = None
                    lru.move_to_end(key)
                    last[key] = r.arrival_s
                while cap and len(lru) > cap // block:
                    lru.popitem(last=False)
                if r.arrival_s >= start:
                    cached.append(min(k * block, r.prompt_tokens))
                    prompt.append(r.prompt_tokens)
            c, p = np.array(cached, dtype=float), np.array(prompt, dtype=float)
            ratio = np.percentile(prefill_ms(p - c), 50) / np.percentile(prefill_ms(p), 50)
            g = np.percentile(gaps, [50, 90]) if gaps else (0.0, 0.0)
            print(
                f"{start:5.0f}:{end:<5.0f} {len(prompt):6d} {cap or 'inf':>12} {100 * c.sum() / p.sum():5.1f}% "
                f"{100 * np.median(c / p):9.1f}% {ratio:14.2f} {g[0]:10.0f} / {g[1]:<7.0f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("workload", choices=("synthetic", "mooncake", "ceiling"))
    parser.add_argument("--rate", type=float, default=8.0, help="synthetic: arrivals per second")
    parser.add_argument("--groups", type=int, default=48, help="synthetic: shared prefixes")
    parser.add_argument("--scale", type=float, default=1.0, help="mooncake: arrival-time factor")
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--neutral", type=int, default=4, help="neutral sim instances")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument(
        "--windows",
        default="0:600,1800:2400,0:3600",
        help="ceiling: trace windows START:END (s), comma-separated",
    )
    parser.add_argument(
        "--cache-tokens", default="2097152,8388608,0", help="ceiling: fleet KV sizes in tokens (0 = infinite)"
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="ceiling: replay the trace before each window into the cache first (count only the window)",
    )
    args = parser.parse_args()
    if args.workload == "ceiling":
        windows = [(float(a), float(b)) for a, b in (w.split(":") for w in args.windows.split(","))]
        ceiling(args.trace, windows, [int(c) for c in args.cache_tokens.split(",")], warm=args.warm)
        return
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
