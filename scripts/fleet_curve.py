"""Attainment of given fleets per policy, scored the way ``slo-router plan`` scores a fleet.

The same seeded requests, the router queue ``plan`` gives each policy (``edf`` for binpack, none
otherwise), one line per policy:

    python scripts/fleet_curve.py mixed 9 --kv 16384 --seed 4 2+4 2+5 3+5 n4

``--by-class``: under each fleet, per class the scored requests met and what the misses missed
(TTFT, TPOT, the e2e deadline, or an error such as a refusal), with the misses' answer lengths.
"""

from __future__ import annotations

import argparse

from engine.model import SimConfig
from router.core.config import SchedulerConfig
from router.core.queue import QueueConfig
from sim.cluster import SimFleet, simulate
from sim.fleet import fleet_from_counts
from sim.sweep import open_loop, policy_overrides
from workload.report import RequestResult, slo_met, summarize
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
    parser.add_argument("--by-class", action="store_true", help="per class: met, and why the misses missed")
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
            if args.by_class:
                lengths = {p.index: p.output_tokens or p.max_tokens for p in plans}
                row.append(_by_class(scored, lengths))
        print(f"{policy}: " + ", ".join(row), flush=True)


def _by_class(scored: list[RequestResult], lengths: dict[int, int]) -> str:
    """One line per class: requests met, the misses by reason, their answers' true lengths."""
    lines = []
    for name in sorted({r.class_name for r in scored}):
        mine = [r for r in scored if r.class_name == name]
        missed = [r for r in mine if not slo_met(r)]
        why: dict[str, int] = {}
        for r in missed:
            slo = r.slo
            reasons = (
                [r.error_code]
                if r.error_code
                else [
                    k
                    for k, target, got in (
                        ("ttft", slo.ttft_ms, r.ttft_ms),
                        ("tpot", slo.tpot_ms, r.tpot_ms),
                        ("e2e", slo.e2e_ms, r.e2e_ms),
                    )
                    if target and (got > target if got is not None else k != "tpot")
                ]
            )
            for k in reasons:
                why[k] = why.get(k, 0) + 1
        answers = sorted(lengths[r.index] for r in missed)
        lines.append(
            f"\n    {name}: {len(mine) - len(missed)}/{len(mine)} met, misses {why}, answers {answers}"
        )
    return "".join(lines)


if __name__ == "__main__":
    main()
