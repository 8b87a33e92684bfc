"""Where a slice run loses its makespan to least-requests: the tail, and who starts late.

Runs one scenario of ``scripts/slice_suite.py`` (by name) under least-requests (request dispatch)
and under slice dispatch over the same plan, and prints per mode the makespan, the moments by which
a share of the requests had completed (the run's completion curve), the last requests to end (their
arrival, prompt, answer and time to first token) and the mean time to first token by prompt size
(quartiles of the plan's prompts). Throughput is completed requests per second of makespan, so a
run whose completion curve matches least-requests' up to its last 1 % but ends later loses only in
its tail; the last rows say whether that tail is long answers that started late (docs/papers.md,
seed 002).

    python scripts/slice_tail.py code8k-7-s23
    python scripts/slice_tail.py code8k-7-s23 --config '{"head_wait_intervals": null}'
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from slice_suite import _setup, scenario_run

from router.core.config import SchedulerConfig
from sim.cluster import simulate
from sim.slicing import simulate_slices

#: Shares of the requests at which the completion curve is printed.
SHARES = (0.5, 0.9, 0.95, 0.99, 1.0)


def _end_s(r: Any) -> float:
    return float(r.start_s + r.e2e_ms * 1e-3)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("scenario", help="a scenario name of scripts/slice_suite.py (e.g. code8k-7-s23)")
    parser.add_argument("--config", default="{}", help="SliceConfig fields as a JSON object")
    parser.add_argument("--last", type=int, default=3, help="how many of the last requests to list")
    args = parser.parse_args()
    argv, seed, config = scenario_run(parser, args.scenario, args.config)
    runs: dict[str, Any] = {}
    fleet, plans = _setup(argv)
    runs["least-requests"] = simulate(
        fleet, SchedulerConfig(scheduling_policy="least-requests"), plans, seed=seed
    )
    fleet, plans = _setup(argv)
    runs["slice"] = simulate_slices(fleet, plans, config, seed=seed)
    prompts = np.array([p.prompt_tokens for p in plans])
    edges = np.quantile(prompts, [0.25, 0.5, 0.75])
    print(f"{args.scenario}: {argv}")
    print(f"prompt quartile edges: {', '.join(f'{e:.0f}' for e in edges)} tokens")
    curves: dict[str, np.ndarray] = {}
    for mode, outcome in runs.items():
        done = [r for r in outcome.results if r.ok]
        ends = np.sort(np.array([_end_s(r) for r in done]))
        curves[mode] = ends
        thru = len(done) / outcome.duration_s if outcome.duration_s > 0 else 0.0
        print(
            f"\n{mode}: {len(done)} done, makespan {outcome.duration_s:.1f} s, {thru:.3f} req/s, "
            f"preemptions {outcome.stats.preemptions}"
        )
        ttft = np.full(4, np.nan)
        quart = np.searchsorted(edges, [r.prompt_tokens for r in done], side="right")
        for q in range(4):
            vals = [r.ttft_ms for r, k in zip(done, quart, strict=True) if k == q and r.ttft_ms is not None]
            if vals:
                ttft[q] = float(np.mean(vals)) * 1e-3
        print("  mean TTFT by prompt quartile (s): " + " / ".join(f"{t:.2f}" for t in ttft))
        for r in sorted(done, key=_end_s)[-args.last :]:
            print(
                f"  last: request {r.index} arrived {r.start_s:.1f} s, prompt {r.prompt_tokens}, answer "
                f"{r.completion_tokens}, TTFT {r.ttft_ms * 1e-3:.1f} s, ended {_end_s(r):.1f} s"
            )
    lr, sl = curves["least-requests"], curves["slice"]
    n = min(len(lr), len(sl))
    print("\nshare done by (s)   least-requests   slice   slice / LR throughput up to there")
    for share in SHARES:
        k = max(round(share * n) - 1, 0)
        print(f"  {share:6.0%}            {lr[k]:9.1f} {sl[k]:9.1f}   {lr[k] / sl[k]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
