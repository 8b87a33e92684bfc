"""Seed 000's comparison in simulation: the ``sa`` queue policy against ``fcfs`` (and exhaustive search).

    python -m sim.sa_compare [--seeds 5] [--sizes 6,8,10,20,30,40] [--caps 1,2,4]

One instance (neutral, the bundled 7B-on-2xV100 profile), whose engine runs at
most ``cap`` requests at once (``max_num_seqs``, the paper's maximum batch
size). ``N`` requests of the ``code-chat`` workload (seed 000's code + chat mix)
arrive together and wait in the router queue: ``fcfs`` hands them to the engine
in arrival order (the engine batches them itself, as vLLM does in the paper's
baseline), ``sa`` releases them in the annealer's order and batches of at most
``cap`` (the ``--sa-max-batch``). ``exh`` is the ``sa`` policy planning by
exhaustive search instead (only up to 8 requests). G is met requests per second
of summed e2e latency (seed 000's objective), attainment the share meeting
their targets; both are means over ``--seeds`` bursts.

Beside the simulated figures, ``plan`` columns give the planner's own objective
(the predicted G of its plan, before anything runs) for the queue order in
full batches (what ``fcfs`` amounts to in the planner's model), the annealer
and exhaustive search: that is where "within 2 % of exhaustive" is measured.

Deterministic: the same arguments print the same table.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
from collections.abc import Sequence

from engine.model import SimConfig
from router.core.config import SchedulerConfig
from router.core.queue import QueueConfig
from router.core.request import ScheduleInput
from router.core.sa import (
    AnnealParams,
    anneal,
    evaluate,
    exhaustive,
    full_batches,
    jobs_for,
    modeled_clock,
    modeled_costing_s,
    modeled_evaluation_s,
)
from sim.cluster import SimFleet, simulate
from sim.fleet import fleet_from_counts
from sim.sweep import queue_figures
from workload.spec import RequestPlan, generate_requests, load_workload

#: No queued request of a burst may expire (an expiry is a cheap refusal in G's denominator).
WAIT_MS = 3_600_000.0
EXHAUSTIVE_MAX = 8


def burst(n: int, seed: int) -> list[RequestPlan]:
    plans = generate_requests(load_workload("code-chat"), rng=random.Random(seed), num_requests=n)
    return [dataclasses.replace(p, arrival_s=0.0) for p in plans]


def _inputs(plans: Sequence[RequestPlan]) -> list[ScheduleInput]:
    return [
        ScheduleInput(
            str(p.index),
            prompt_tokens=p.prompt_tokens,
            ttft_slo_ms=p.slo.ttft_ms or 0.0,
            tpot_slo_ms=p.slo.tpot_ms or 0.0,
            e2e_slo_ms=p.slo.e2e_ms or 0.0,
            max_tokens=p.max_tokens,
            arrival_s=0.0,
        )
        for p in plans
    ]


def cell(cap: int, n: int, seeds: int) -> dict[str, float]:
    """Mean figures of ``seeds`` bursts of ``n`` requests at batch cap ``cap``."""
    fleet = SimFleet(fleet_from_counts(neutral=1, engine=SimConfig(max_num_seqs=cap)))
    config = SchedulerConfig(scheduling_policy="slo")
    queue = QueueConfig(queue_policy="sa", sa_max_batch=cap, max_queue_wait_ms=WAIT_MS)
    fcfs_queue = dataclasses.replace(queue, queue_policy="fcfs")
    # The same run as the policy's in the simulator: the default schedule, its budget on the modeled clock.
    params = AnnealParams(
        queue.sa_initial_temperature,
        queue.sa_iterations,
        queue.sa_decay,
        queue.sa_min_temperature,
        queue.sa_budget_ms * 1e-3,
    )
    rows: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        rows.setdefault(key, []).append(value)

    for s in range(seeds):
        seed = 1000 * cap + 10 * n + s
        plans = burst(n, seed)
        runs = {"fcfs": (fcfs_queue, "anneal"), "sa": (queue, "anneal")}
        if n <= EXHAUSTIVE_MAX:
            runs["exh"] = (queue, "exhaustive")
        for name, (q, search) in runs.items():
            outcome = simulate(fleet, config, plans, seed=seed, queue=q, sa_search=search)
            figures = queue_figures(outcome, outcome.duration_s)
            add(f"{name}_g", figures["g"])
            add(f"{name}_att", figures["slo_attainment"])
        jobs = jobs_for(_inputs(plans), fleet.predictors.default, cap, 0.0, [0.0] * n, 10000.0, 50.0, 2048.0)
        add("plan_fcfs", evaluate(jobs, range(n), full_batches(n, cap))[0])
        clock = modeled_clock(modeled_evaluation_s(n))
        plan = anneal(jobs, cap, params, random.Random(seed), clock=clock, spent_s=modeled_costing_s(n))
        add("plan_sa", plan.g)
        if n <= EXHAUSTIVE_MAX:
            add("plan_exh", exhaustive(jobs, cap).g)
        add("sa_loses", float(rows["sa_g"][-1] < rows["fcfs_g"][-1]))
    out = {key: statistics.fmean(values) for key, values in rows.items()}
    out["sa_losses"] = sum(rows["sa_loses"])
    out["plan_sa_vs_exh_worst"] = (
        min(a / b for a, b in zip(rows["plan_sa"], rows["plan_exh"], strict=True))
        if "plan_exh" in rows
        else 0.0
    )
    return out


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def table(caps: Sequence[int], sizes: Sequence[int], seeds: int) -> str:
    lines = [
        "| cap | N | G fcfs | G sa | G exh | sa vs fcfs | attainment fcfs | sa | exh | sa < fcfs (bursts) "
        "| plan G: fcfs order | sa | exh (sa worst / exh) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cap in caps:
        for n in sizes:
            c = cell(cap, n, seeds)
            exh = n <= EXHAUSTIVE_MAX
            gain = c["sa_g"] / c["fcfs_g"] - 1 if c["fcfs_g"] > 0 else float("inf")
            exh_g = f"{c['exh_g']:.4f}" if exh else "–"
            exh_att = _pct(c["exh_att"]) if exh else "–"
            plan_exh = f"{c['plan_exh']:.4f} ({c['plan_sa_vs_exh_worst']:.1%})" if exh else "–"
            lines.append(
                f"| {cap} | {n} | {c['fcfs_g']:.4f} | {c['sa_g']:.4f} | {exh_g} | {gain:+.1%} | "
                f"{_pct(c['fcfs_att'])} | {_pct(c['sa_att'])} | {exh_att} | {c['sa_losses']:.0f} / {seeds} | "
                f"{c['plan_fcfs']:.4f} | {c['plan_sa']:.4f} | {plan_exh} |"
            )
            print(lines[-1], file=sys.stderr, flush=True)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim.sa_compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5, help="bursts per cell (default: %(default)s)")
    parser.add_argument("--sizes", default="6,8,10,20,30,40", help="queued requests N (default: %(default)s)")
    parser.add_argument("--caps", default="1,2,4", help="release batch caps (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        sizes = [int(x) for x in args.sizes.split(",")]
        caps = [int(x) for x in args.caps.split(",")]
    except ValueError:
        parser.error("--sizes and --caps take comma-separated integers")
    if not 1 <= args.seeds <= 100:
        parser.error(f"--seeds must be within 1..100, got {args.seeds}")
    if any(not 1 <= n <= 200 for n in sizes):
        parser.error("--sizes: each N must be within 1..200")
    if any(not 1 <= c <= 64 for c in caps):
        parser.error("--caps: each cap must be within 1..64")
    print(table(caps, sizes, args.seeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
