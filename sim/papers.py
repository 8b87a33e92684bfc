"""Seed papers against the project's queue policies on scenarios of one's own (docs/papers.md).

    python -m sim.papers sa  --workload FILE --instances 2 --seqs 1 --burst 8 --gap-ms 3 --bursts 12 --period-s 40
    python -m sim.papers sa  --workload FILE --instances 2 --rate 0.3 --requests 300
    python -m sim.papers qlm --workload FILE --instances 4 --rate 6 --requests 600 [--eviction on,off]

Arrivals are either steady (Poisson at ``--rate``) or bursts: ``--bursts``
bursts of ``--burst`` requests every ``--period-s`` seconds, the requests of a
burst ``--gap-ms`` apart (0: the same instant). Request lengths and SLO classes
come from the workload file, drawn with ``--seed``; every run sees the same
plan. Each row is one queue policy: ``lr`` (least-requests placement, arrival
order, no request held: every engine's own FCFS, as vLLM behind a balancer), ``fcfs``
(the ``slo`` placement policy, the router queue in arrival order), ``edf`` (the ``slo``
policy and its default queue, earliest deadline first: this router's default, ``slo``,
and the QLM paper's EDF baseline), for ``qlm`` also ``none`` (the ``slo`` policy with no router
queue: a request no instance can take at once is refused), then the paper's policy.
Figures: attainment, G (seed 000's objective: met requests per second of summed
latency), throughput (completed requests per second of makespan), engine
preemptions, and the policy's own counters. Means over ``--seeds`` plans.
Deterministic: the same arguments print the same table. ``--output FILE.json``
also writes the table's figures (scripts/readme_papers.py reads them).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import random
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from engine.model import SimConfig
from router.core.config import SchedulerConfig
from router.core.qlm import QlmConfig
from router.core.queue import LATE_ALLOWANCE, QueueConfig
from sim.cluster import SimFleet, simulate
from sim.fleet import fleet_from_counts
from sim.sweep import policy_overrides, queue_figures
from workload.spec import RequestPlan, generate_requests, load_workload

#: Requests may wait this long in the router queue (an expiry is a cheap refusal in G's denominator).
WAIT_MS = 3_600_000.0

#: The rows: (label, placement policy, queue policy, qlm eviction).
BASELINES = (("lr", "least-requests", "fcfs"), ("fcfs", "slo", "fcfs"), ("edf", "slo", "edf"))


def plans_for(args: argparse.Namespace, seed: int) -> list[RequestPlan]:
    """The plan of one seed: lengths and classes from the workload, arrivals as the flags say."""
    spec = load_workload(args.workload)
    if args.rate and not args.burst_class:
        spec = dataclasses.replace(spec, arrival=dataclasses.replace(spec.arrival, rate_per_s=args.rate))
        return generate_requests(spec, rng=random.Random(seed), num_requests=args.requests)
    if args.burst_class:
        return _burst_class(args, spec, seed)
    n = args.burst * args.bursts
    plans = generate_requests(spec, rng=random.Random(seed), num_requests=n)
    out = []
    for k, p in enumerate(plans):
        burst, position = divmod(k, args.burst)
        arrival = burst * args.period_s + position * args.gap_ms * 1e-3
        out.append(dataclasses.replace(p, arrival_s=arrival))
    return out


def _burst_class(args: argparse.Namespace, spec: Any, seed: int) -> list[RequestPlan]:
    """QLM's head-of-line setting: ``--burst-class`` arrives in bursts (``--burst`` every ``--period-s``, from
    0 s, ``--bursts`` of them), the other classes steadily (Poisson at ``--rate``) over the same span."""
    span = args.bursts * args.period_s
    rng = random.Random(seed)
    plans: list[RequestPlan] = []
    steady = [c for c in spec.classes if c.name != args.burst_class]
    bursty = [c for c in spec.classes if c.name == args.burst_class]
    if not bursty or not steady:
        raise SystemExit(f"--burst-class {args.burst_class!r}: the workload needs that class and another")
    rest = dataclasses.replace(
        spec, classes=tuple(steady), arrival=dataclasses.replace(spec.arrival, rate_per_s=args.rate)
    )
    for p in generate_requests(rest, rng=rng, num_requests=max(int(args.rate * span * 2), 1)):
        if p.arrival_s < span:
            plans.append(p)
    jobs = dataclasses.replace(spec, classes=tuple(bursty))
    for n, p in enumerate(generate_requests(jobs, rng=rng, num_requests=args.burst * args.bursts)):
        k = n // args.burst
        plans.append(
            dataclasses.replace(p, arrival_s=k * args.period_s + (n % args.burst) * args.gap_ms * 1e-3)
        )
    plans.sort(key=lambda p: p.arrival_s)
    return [dataclasses.replace(p, index=k) for k, p in enumerate(plans)]


def run_one(
    args: argparse.Namespace,
    plans: list[RequestPlan],
    label: str,
    policy: str,
    queue_policy: str,
    extra: dict[str, Any],
) -> dict[str, float]:
    engine = SimConfig(max_num_seqs=args.seqs) if args.seqs else SimConfig()
    if args.kv_tokens:
        engine = dataclasses.replace(engine, kv_capacity_tokens=args.kv_tokens)
    fleet = SimFleet(fleet_from_counts(neutral=args.instances, engine=engine))
    config = SchedulerConfig(**policy_overrides(policy))
    queue = QueueConfig(
        queue_policy=queue_policy,
        max_queue_wait_ms=WAIT_MS,
        late_allowance=args.late_allowance,
        **extra.get("queue", {}),
    )
    outcome = simulate(fleet, config, plans, queue=queue, qlm=extra.get("qlm"), seed=args.seed)
    figures = queue_figures(outcome, outcome.duration_s)
    done = sum(1 for r in outcome.results if r.ok)
    return {
        "attain": figures["slo_attainment"] * 100,
        "g": figures["g"],
        "tput": done / outcome.duration_s if outcome.duration_s > 0 else 0.0,
        "preempt": float(outcome.stats.preemptions),
        "evicted": float(outcome.stats.evicted),
        "rejected": float(figures["rejected"]),
        **{f"class:{k}": v["slo_attainment"] * 100 for k, v in figures["by_class"].items()},
    }


def rows_for(args: argparse.Namespace) -> list[tuple[str, str, str, dict[str, Any]]]:
    rows: list[tuple[str, str, str, dict[str, Any]]] = [(a, b, c, {}) for a, b, c in BASELINES]
    if args.paper == "sa":
        for pool in args.sa_pool_ms.split(","):
            label = "sa" if pool == "25" else f"sa/pool={pool}ms"
            queue = {"sa_max_batch": args.sa_max_batch, "sa_pool_ms": float(pool)}
            rows.append((label, "slo", "sa", {"queue": queue}))
    else:
        # The slo policy with no router queue (a request no instance can take at once is refused):
        # what the queue policies add to placement alone.
        rows.append(("none", "slo", "none", {}))
        for delta in args.qlm_delta.split(","):
            for ev in args.eviction.split(","):
                for lengths, margin, streams in itertools.product(
                    args.qlm_lengths.split(","), args.qlm_wait_margin.split(","), args.qlm_streams.split(",")
                ):
                    label = "qlm" if ev == "on" else "qlm-noevict"
                    if delta != "4":
                        label += f"/delta={delta}"
                    if args.qlm_batch:
                        label += f"/slots={args.qlm_batch}"
                    if lengths != "finished":
                        label += f"/lengths={lengths}"
                    if margin != "each":
                        label += f"/wait={margin}"
                    if streams != QlmConfig().streams:
                        label += f"/streams={streams}"
                    if args.qlm_confidence != 0.9:
                        label += f"/confidence={args.qlm_confidence:g}"
                    cfg = QlmConfig(
                        eviction=ev,
                        group_factor=int(delta),
                        batch=args.qlm_batch,
                        lengths=lengths,
                        confidence=args.qlm_confidence,
                        wait_margin=margin,
                        streams=streams,
                    )
                    rows.append((label, "slo", "qlm", {"qlm": cfg}))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim.papers", description=__doc__.split("\n\n")[0])
    parser.add_argument("paper", choices=["sa", "qlm"])
    parser.add_argument("--workload", required=True)
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--seqs", type=int, default=0, help="engine max_num_seqs (0: the default)")
    parser.add_argument("--kv-tokens", type=int, default=0, help="engine KV cache in tokens (0: the default)")
    parser.add_argument("--rate", type=float, default=0.0, help="steady Poisson arrivals (req/s)")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--burst", type=int, default=8)
    parser.add_argument("--gap-ms", type=float, default=0.0)
    parser.add_argument("--bursts", type=int, default=10)
    parser.add_argument("--period-s", type=float, default=40.0)
    parser.add_argument(
        "--burst-class",
        default="",
        help="this class arrives in bursts (--burst every --period-s), the others steadily at --rate",
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    parser.add_argument("--sa-max-batch", type=int, default=0)
    parser.add_argument("--eviction", default="on")
    parser.add_argument(
        "--qlm-delta", default="4", help="qlm group bound(s) in average batches, comma-separated"
    )
    parser.add_argument(
        "--qlm-lengths",
        default="finished",
        help="qlm output lengths: finished (the default) and/or censored (running requests as lower bounds), comma-separated",
    )
    parser.add_argument(
        "--qlm-confidence", type=float, default=0.9, help="qlm: the estimator's confidence (Delta, [0.5, 1))"
    )
    parser.add_argument(
        "--qlm-wait-margin",
        default="each",
        help="qlm: the estimator's margin on a wait, each (the default) and/or sum (Eq. 2-3), comma-separated",
    )
    parser.add_argument(
        "--qlm-streams",
        default=QlmConfig().streams,
        help="qlm: who orders and places the TTFT-judged requests, auto (the default), qlm and/or edf, comma-separated",
    )
    parser.add_argument("--qlm-batch", type=int, default=0, help="qlm: a fixed slot count (the ablation)")
    parser.add_argument("--sa-pool-ms", default="25", help="sa request pool(s) in ms, comma-separated")
    parser.add_argument(
        "--late-allowance",
        type=float,
        default=LATE_ALLOWANCE,
        help="every row's router queue serves a late request while its first token can come within "
        "this many of its targets past its deadline, and refuses it then; a refused request enters G's "
        "sum at its wait, so refusals shorten it. Seed 000's engines serve every request: 1000 runs that "
        "setting (a request is refused only after an hour's wait) (default: %(default)g, the router's)",
    )
    parser.add_argument("--only", default="", help="comma-separated row labels to run")
    parser.add_argument(
        "--output", default="", metavar="FILE.json", help="also write the table's figures to this JSON file"
    )
    args = parser.parse_args(argv)
    if not 0 <= args.late_allowance <= 1_000_000:
        parser.error(
            f"--late-allowance {args.late_allowance:g}: must be within 0..1000000 (a ratio of the target)"
        )
    if args.output and not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        parser.error(f"--output {args.output}: no such directory")
    rows = rows_for(args)
    if args.only:
        keep = set(args.only.split(","))
        rows = [r for r in rows if r[0] in keep]
    print("python -m sim.papers " + " ".join(sys.argv[1:] if argv is None else argv))
    table: list[tuple[str, dict[str, float]]] = []
    for label, policy, queue_policy, extra in rows:
        runs = [
            run_one(args, plans_for(args, args.seed + s), label, policy, queue_policy, extra)
            for s in range(args.seeds)
        ]
        keys = sorted({k for r in runs for k in r})
        table.append((label, {k: statistics.fmean(r.get(k, 0.0) for r in runs) for k in keys}))
    classes = sorted({k for _, f in table for k in f if k.startswith("class:")})
    head = [
        "queue",
        "attain %",
        "G",
        "req/s",
        "preempt",
        "evicted",
        "refused",
        *(c[6:] + " %" for c in classes),
    ]
    print(" | ".join(head))
    for label, f in table:
        cells = [
            label,
            f"{f['attain']:.1f}",
            f"{f['g']:.4f}",
            f"{f['tput']:.3f}",
            f"{f['preempt']:.0f}",
            f"{f['evicted']:.0f}",
            f"{f['rejected']:.0f}",
            *(f"{f.get(c, 0.0):.1f}" for c in classes),
        ]
        print(" | ".join(cells))
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as out:
                json.dump({"rows": [{"queue": label, **f} for label, f in table]}, out, indent=1)
        except OSError as exc:
            print(f"python -m sim.papers: --output {args.output}: {exc.strerror}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
