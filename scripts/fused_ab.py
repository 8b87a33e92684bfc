"""A/B of the fused stage pass: ``bench.bench_scheduler``'s decision loop with it and without it,
alternating in one process (so other work on the machine weighs on both alike).

    PYTHONPATH=. .venv/bin/python scripts/fused_ab.py [ROUNDS] [--cpu] [--long]

Prints p50 / p99 (µs) per fleet size, policy and side, per round; ``--cpu`` times the thread's CPU
instead of the wall clock; ``--long`` adds the 32k-token prompt rows (prefix-cache routing off and
approximate, wall clock). Figures only.
"""

from __future__ import annotations

import os
import sys
import time

from bench.bench_scheduler import PROFILE, SIZES, measure, measure_long_prompt
from predictor import LatencyPredictor
from router.core import chain


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    rounds = int(args[0]) if args else 2
    clock = time.thread_time_ns if "--cpu" in sys.argv else time.perf_counter_ns
    lp = LatencyPredictor.from_files(PROFILE / "ttft.json", PROFILE / "tpot.json")
    for r in range(rounds):
        print(f"round {r + 1} (load average {os.getloadavg()[0]:.2f})")
        for n in SIZES:
            decisions = 3000 if n <= 256 else 1000
            for adaptive in (False, True):
                cells = []
                for on in (True, False) if r % 2 == 0 else (False, True):
                    chain.FUSED = on
                    p50, p99 = measure(n, adaptive, lp, decisions, clock=clock)
                    cells.append((on, p50, p99))
                chain.FUSED = True
                cells.sort(key=lambda c: not c[0])
                name = "adaptive PD" if adaptive else "slo"
                print(
                    f"  {n:5d} {name:12s} fused p50 {cells[0][1]:7.1f} p99 {cells[0][2]:7.1f}   "
                    f"composed p50 {cells[1][1]:7.1f} p99 {cells[1][2]:7.1f}"
                )
        if "--long" in sys.argv:  # the 32k-token prompt at 256 instances, cache-aware over plain (wall p50)
            ratios = {}
            for on in (True, False) if r % 2 == 0 else (False, True):
                chain.FUSED = on
                off = measure_long_prompt(256, lp, 1500, "off")[0]
                aware = measure_long_prompt(256, lp, 1500, "approximate")[0]
                ratios[on] = (off, aware)
            chain.FUSED = True
            for on in (True, False):
                off, aware = ratios[on]
                side = "fused" if on else "composed"
                print(
                    f"  32k prompt, 256 {side:8s} off p50 {off:6.1f} approximate p50 {aware:6.1f} ({aware / off:.2f}x)"
                )


if __name__ == "__main__":
    main()
