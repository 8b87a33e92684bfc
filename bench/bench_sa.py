"""Cost of one ``sa`` planning run (seed 000's priority mapping) with 10, 20 and 40 requests queued.

A run is what the ``sa`` queue policy does when an instance's queue changed
materially: cost every queued request for each batch size up to the cap with
the latency profile (:func:`router.core.sa.jobs_for`), then anneal
(:func:`router.core.sa.anneal`) under the default schedule and budget (0.8 ms, costing included).
The requests are the ``code-chat`` workload's (seed 000's code + chat mix), all
queued at once. Goal (the paper's): 1 ms for 40 requests.

Printed per (requests, cap): wall and thread-CPU p50/p99 of the whole run, the
annealing part alone, the moves evaluated, and how many runs ended early
because the latency order already met every target. A second block runs the
paper's full schedule (T0 500, Tthres 20, 100 moves per level, decay 0.95: 6300
moves) without a budget, which is what the budget cuts short.

Figures only, no assertions.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import replace
from pathlib import Path

from bench.figures import Figure
from predictor import LatencyPredictor
from router.core.queue import QueueConfig
from router.core.request import ScheduleInput
from router.core.sa import AnnealParams, anneal, jobs_for
from workload.spec import generate_requests, load_workload

PROFILE = Path(__file__).resolve().parent.parent / "profiling_data" / "qwen2.5-7b-2xv100-linear"
SIZES = (10, 20, 40)
CAPS = (1, 2, 4)
RUNS = 200
FULL_RUNS = 5


def _requests(n: int, seed: int) -> list[ScheduleInput]:
    plans = generate_requests(load_workload("code-chat"), rng=random.Random(seed), num_requests=n)
    return [
        ScheduleInput(
            request_id=str(p.index),
            prompt_tokens=p.prompt_tokens,
            ttft_slo_ms=p.slo.ttft_ms or 0.0,
            tpot_slo_ms=p.slo.tpot_ms or 0.0,
            e2e_slo_ms=p.slo.e2e_ms or 0.0,
            max_tokens=p.max_tokens,
            slo_class=p.class_name,
            arrival_s=0.0,
        )
        for p in plans
    ]


def _p(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[int(0.99 * (len(ordered) - 1))]


def bench_run(n: int, cap: int, params: AnnealParams, runs: int) -> dict[str, float]:
    predictor = LatencyPredictor.from_files(PROFILE / "ttft.json", PROFILE / "tpot.json")
    wall: list[float] = []
    cpu: list[float] = []
    anneal_wall: list[float] = []
    moves: list[int] = []
    early = 0
    perf, thread = time.perf_counter, time.thread_time
    for k in range(runs):
        requests = _requests(n, seed=1000 * n + k % 20)
        rng = random.Random(k)
        start, start_cpu = perf(), thread()
        jobs = jobs_for(requests, predictor, cap, 0.0, [0.0] * n, 1000.0, 50.0, 2048.0)
        mid = perf()
        # As the planner does: the budget covers the costing too.
        plan = anneal(jobs, cap, params, rng, spent_s=mid - start)
        end, end_cpu = perf(), thread()
        wall.append(end - start)
        cpu.append(end_cpu - start_cpu)
        anneal_wall.append(end - mid)
        moves.append(plan.evaluations)
        early += plan.early_exit
    w50, w99 = _p(wall)
    c50, c99 = _p(cpu)
    a50, a99 = _p(anneal_wall)
    return {
        "wall_p50": w50,
        "wall_p99": w99,
        "cpu_p50": c50,
        "cpu_p99": c99,
        "anneal_p50": a50,
        "anneal_p99": a99,
        "moves": statistics.median(moves),
        "early": early / runs,
    }


def _line(n: int, cap: int, f: dict[str, float]) -> str:
    return (
        f"  {n:3d} queued, cap {cap}: wall p50 {f['wall_p50'] * 1e3:6.3f} ms p99 {f['wall_p99'] * 1e3:6.3f} ms | "
        f"cpu p50 {f['cpu_p50'] * 1e3:6.3f} ms p99 {f['cpu_p99'] * 1e3:6.3f} ms | anneal p50 "
        f"{f['anneal_p50'] * 1e3:6.3f} ms | moves {f['moves']:6.0f} | early exit {f['early']:4.0%}"
    )


def main() -> list[Figure]:
    config = QueueConfig(queue_policy="sa")
    params = AnnealParams(
        config.sa_initial_temperature,
        config.sa_iterations,
        config.sa_decay,
        config.sa_min_temperature,
        config.sa_budget_ms * 1e-3,
    )
    print(
        f"sa planning run (jobs_for + anneal), default schedule: T0 {params.initial_temperature:g}, "
        f"Tmin {params.min_temperature:g}, {params.iterations} moves/level, decay {params.decay:g}, "
        f"budget {config.sa_budget_ms:g} ms"
    )
    figures: list[Figure] = []
    for n in SIZES:
        for cap in CAPS:
            f = bench_run(n, cap, params, RUNS)
            print(_line(n, cap, f), flush=True)
            if n == 40 and cap in (1, 4):
                figures.append(
                    Figure(
                        f"sa planning run, 40 queued, cap {cap} (goal 1 ms)",
                        f"p50 {f['wall_p50'] * 1e3:.2f} ms, p99 {f['wall_p99'] * 1e3:.2f} ms "
                        f"(cpu p99 {f['cpu_p99'] * 1e3:.2f} ms), {f['moves']:.0f} moves",
                    )
                )
    full = replace(params, budget_s=None)
    print("the paper's full schedule without a budget (6300 moves)")
    for n in SIZES:
        f = bench_run(n, 4, full, FULL_RUNS)
        print(_line(n, 4, f), flush=True)
    return figures


if __name__ == "__main__":
    main()
