"""What ``slo-router bench`` tells the router about answer lengths, per ``--engine``.

For each workload, the seed-0 plan of 1,000 requests (``request_sequence``, what ``bench`` and
``simulate`` both replay) is turned into the requests ``bench`` sends (``build_request``) and
compared with the plan's cap: how many send a ``max_tokens`` other than the cap, the median of
sent / cap, how many carry a stop string (and its length), and the time ``build_request`` takes.

    .venv/bin/python scripts/bench_sent_lengths.py [WORKLOAD ...]
"""

from __future__ import annotations

import statistics
import sys
import time

from bench.loadgen import ENGINES, LoadConfig, build_request
from workload.sequence import request_sequence
from workload.spec import load_workload

NUM_REQUESTS = 1000


def main(workloads: list[str]) -> None:
    for name in workloads:
        plans = request_sequence(load_workload(name), seed=0, num_requests=NUM_REQUESTS)
        for engine in ENGINES:
            config = LoadConfig(engine=engine)
            start = time.perf_counter()
            sent = [build_request(p, config).sampling for p in plans]
            ms = (time.perf_counter() - start) / len(plans) * 1e3
            differ = sum(s.max_tokens != p.max_tokens for s, p in zip(sent, plans, strict=True))
            ratio = statistics.median(s.max_tokens / p.max_tokens for s, p in zip(sent, plans, strict=True))
            stops = [len(s.stop[0]) for s in sent if s.stop]
            lengths = f"median {statistics.median(stops):g}, max {max(stops)}" if stops else "-"
            print(
                f"{name:<18} --engine {engine:<4}  max_tokens != cap {differ}/{len(plans)}  "
                f"median sent/cap {ratio:.2f}  stop strings {len(stops)} (chars {lengths})  "
                f"build_request {ms:.2f} ms"
            )


if __name__ == "__main__":
    main(sys.argv[1:] or ["mixed", "code-chat", "interactive-batch"])
