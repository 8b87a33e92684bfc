"""Slice against request dispatch over the KV-limited scenarios of docs/papers.md (seed 002, SCLS).

Each scenario is a ``slo-router simulate`` command line (fleet, KV, workload, rate, seed, requests);
the suite runs it under ``least-requests`` (request dispatch) and under slice dispatch and prints,
per scenario, the completed requests per second of makespan and the preemptions of both, their
ratio and whether the SCLS goal holds (slice >= 0.95 x least-requests' throughput with at most a
tenth of its preemptions, judged where least-requests preempts at least once per ten requests).
Request dispatch does not depend on the slice code: its results are kept in a cache file
(``--cache``) so that comparing slice variants re-runs only the slice side.

    python scripts/slice_suite.py --set long600 --jobs 2
    python scripts/slice_suite.py --set all --jobs 2 --config '{"grow_with_answer": false}'

``--config`` is a JSON object of :class:`router.core.slicing.SliceConfig` fields.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

T = "/work/shared/traces/azure-conv-2023.csv"
H1 = "neutral=2:qwen2.5-7b-2xv100-linear,neutral=2:qwen2.5-7b-2xv100-linear-x4"
H2 = "neutral=2:qwen2.5-7b-2xv100-linear-x4,neutral=2:qwen2.5-7b-2xv100-linear"
SC = "docs/scenarios"
#: Three groups, two profiles, listed two ways (the x4 profile between and after the others).
H3A = (
    "neutral=1:qwen2.5-7b-2xv100-linear,neutral=2:qwen2.5-7b-2xv100-linear-x4,"
    "neutral=1:qwen2.5-7b-2xv100-linear"
)
H3B = (
    "neutral=1:qwen2.5-7b-2xv100-linear,neutral=1:qwen2.5-7b-2xv100-linear,"
    "neutral=2:qwen2.5-7b-2xv100-linear-x4"
)


def _n(instances: int, kv: int, workload: str, rate: float, seed: int, requests: int) -> str:
    return (
        f"--neutral {instances} --kv-capacity-tokens {kv} --workload {workload} --rates {rate:g} "
        f"--seed {seed} --num-requests {requests}"
    )


def _h(fleet: str, kv: int, workload: str, rate: float, seed: int, requests: int) -> str:
    return (
        f"--fleet {fleet} --kv-capacity-tokens {kv} --workload {workload} --rates {rate:g} "
        f"--seed {seed} --num-requests {requests}"
    )


#: Named scenario sets (name -> simulate arguments), from docs/papers.md's SCLS tables.
SETS: dict[str, dict[str, str]] = {
    # "A continued slice goes on in its engine's batch": the long-answer runs and the scls-* mixes.
    "long600": {
        "ib12k-4.5-s21": _n(4, 12288, "interactive-batch", 4.5, 21, 600),
        "ib8k-3.5-s22": _n(4, 8192, "interactive-batch", 3.5, 22, 600),
        "code8k-7-s23": _n(4, 8192, "codegen", 7, 23, 600),
        "ib16k-4.5-s27": _n(4, 16384, "interactive-batch", 4.5, 27, 600),
        "ib16k-5.5-s27": _n(4, 16384, "interactive-batch", 5.5, 27, 600),
        "3x-ib12k-3.5-s42": _n(3, 12288, "interactive-batch", 3.5, 42, 600),
        "5x-ib12k-6-s43": _n(5, 12288, "interactive-batch", 6, 43, 600),
        "6x-reports-qa16k-9-s51": _n(6, 16384, f"{SC}/scls-reports-qa.json", 9, 51, 600),
        "3x-agent12k-1.5-s52": _n(3, 12288, f"{SC}/scls-agent-steps.json", 1.5, 52, 600),
        "8x-stories8k-9-s53": _n(8, 8192, f"{SC}/scls-stories.json", 9, 53, 600),
        "chat8k-6-s25": _n(4, 8192, "chat", 6, 25, 600),
        "mixed12k-6-s26": _n(4, 12288, "mixed", 6, 26, 600),
    },
    "long1200": {
        "ib12k-4.5-s21": _n(4, 12288, "interactive-batch", 4.5, 21, 1200),
        "ib8k-3.5-s22": _n(4, 8192, "interactive-batch", 3.5, 22, 1200),
        "code8k-7-s23": _n(4, 8192, "codegen", 7, 23, 1200),
        "ib16k-4.5-s27": _n(4, 16384, "interactive-batch", 4.5, 27, 1200),
        "ib16k-5.5-s27": _n(4, 16384, "interactive-batch", 5.5, 27, 1200),
        "3x-ib12k-3.5-s42": _n(3, 12288, "interactive-batch", 3.5, 42, 1200),
        "5x-ib12k-6-s43": _n(5, 12288, "interactive-batch", 6, 43, 1200),
        "6x-reports-qa16k-9-s51": _n(6, 16384, f"{SC}/scls-reports-qa.json", 9, 51, 1200),
        "3x-agent12k-1.5-s52": _n(3, 12288, f"{SC}/scls-agent-steps.json", 1.5, 52, 1200),
        "8x-stories8k-9-s53": _n(8, 8192, f"{SC}/scls-stories.json", 9, 53, 1200),
        "code8k-8-s3": _n(4, 8192, "codegen", 8, 3, 1200),
        "code8k-8-s1": _n(4, 8192, "codegen", 8, 1, 1200),
        "ib16k-6-s3": _n(4, 16384, "interactive-batch", 6, 3, 1200),
        "ib16k-6-s1": _n(4, 16384, "interactive-batch", 6, 1, 1200),
    },
    # "Throughput against request dispatch on KV-limited fleets" (400 requests) and its nine more.
    "table400": {
        "mixed8k-4-s0": _n(4, 8192, "mixed", 4, 0, 400),
        "mixed8k-8-s0": _n(4, 8192, "mixed", 8, 0, 400),
        "mixed8k-6-s3": _n(4, 8192, "mixed", 6, 3, 400),
        "mixed16k-4-s0": _n(4, 16384, "mixed", 4, 0, 400),
        "mixed16k-8-s0": _n(4, 16384, "mixed", 8, 0, 400),
        "mixed16k-6-s3": _n(4, 16384, "mixed", 6, 3, 400),
        "chat8k-4-s0": _n(4, 8192, "chat", 4, 0, 400),
        "chat8k-8-s0": _n(4, 8192, "chat", 8, 0, 400),
        "chat8k-6-s3": _n(4, 8192, "chat", 6, 3, 400),
        "chat16k-8-s0": _n(4, 16384, "chat", 8, 0, 400),
        "chat16k-8-s3": _n(4, 16384, "chat", 8, 3, 400),
        "code8k-8-s0": _n(4, 8192, "codegen", 8, 0, 400),
        "code8k-8-s3": _n(4, 8192, "codegen", 8, 3, 400),
        "ib16k-6-s3": _n(4, 16384, "interactive-batch", 6, 3, 400),
        "trace8k-4": _n(4, 8192, f"trace:{T}", 4, 0, 400),
        "trace8k-8": _n(4, 8192, f"trace:{T}", 8, 0, 400),
        "trace16k-8": _n(4, 16384, f"trace:{T}", 8, 0, 400),
        "code8k-4-s0": _n(4, 8192, "codegen", 4, 0, 400),
        "trace16k-4": _n(4, 16384, f"trace:{T}", 4, 0, 400),
        "mixed64k-8-s0": _n(4, 65536, "mixed", 8, 0, 400),
        "chat64k-8-s3": _n(4, 65536, "chat", 8, 3, 400),
        "mixed8k-5-s7": _n(4, 8192, "mixed", 5, 7, 400),
        "mixed12k-7-s9": _n(4, 12288, "mixed", 7, 9, 400),
        "chat16k-10-s5": _n(4, 16384, "chat", 10, 5, 400),
        "chat12k-9-s11": _n(4, 12288, "chat", 9, 11, 400),
        "code8k-8-s6": _n(4, 8192, "code", 8, 6, 400),
        "trace12k-6": _n(4, 12288, f"trace:{T}", 6, 0, 400),
        "ib8k-4-s2": _n(4, 8192, "interactive-batch", 4, 2, 400),
        "ib12k-5-s8": _n(4, 12288, "interactive-batch", 5, 8, 400),
        "codechat8k-8-s1": _n(4, 8192, "code-chat", 8, 1, 400),
        "interactive-batch16k-6-s3": _n(4, 16384, "interactive-batch", 6, 3, 400),
    },
    # Written after the continued slice's KV admission was built, rates picked from least-requests'
    # preemptions alone (at least one per ten requests) before any slice run.
    "new": {
        "2x-essays-faq10k-2.6-s61": _n(2, 10240, f"{SC}/scls-essays-faq.json", 2.6, 61, 600),
        "10x-digest-rag16k-4.5-s62": _n(10, 16384, f"{SC}/scls-digest-rag.json", 4.5, 62, 600),
        "2x-essays-faq10k-2.6-s61-1200": _n(2, 10240, f"{SC}/scls-essays-faq.json", 2.6, 61, 1200),
        "10x-digest-rag16k-4.5-s62-1200": _n(10, 16384, f"{SC}/scls-digest-rag.json", 4.5, 62, 1200),
    },
    # Written to check the 30 Nov build on set-ups it was not measured on (other seeds, KV sizes,
    # fleet sizes and workloads); rates picked from least-requests' preemptions alone.
    "check": {
        "ib12k-4.5-s31": _n(4, 12288, "interactive-batch", 4.5, 31, 600),
        "ib12k-4.5-s32": _n(4, 12288, "interactive-batch", 4.5, 32, 600),
        "6x-code8k-10.5-s33": _n(6, 8192, "codegen", 10.5, 33, 600),
        "3x-chat10k-4.5-s34": _n(3, 10240, "chat", 4.5, 34, 600),
        "ib10k-4-s35": _n(4, 10240, "interactive-batch", 4, 35, 900),
        "2x-code12k-4-s36": _n(2, 12288, "codegen", 4, 36, 600),
    },
    # Written to check queue backfill (a blocked head lets later batches start) on set-ups neither
    # the build nor backfill was measured on: other seeds, KV sizes, fleets, and two heterogeneous
    # fleets both ways; rates picked from least-requests' preemptions alone.
    "check2": {
        "code8k-7-s71": _n(4, 8192, "codegen", 7, 71, 600),
        "5x-code10k-12-s72": _n(5, 10240, "codegen", 12, 72, 600),
        "ib12k-4.5-s73": _n(4, 12288, "interactive-batch", 4.5, 73, 600),
        "3x-ib10k-3-s74": _n(3, 10240, "interactive-batch", 3, 74, 600),
        "6x-stories8k-7-s75": _n(6, 8192, f"{SC}/scls-stories.json", 7, 75, 600),
        "4x-reports-qa12k-6-s76": _n(4, 12288, f"{SC}/scls-reports-qa.json", 6, 76, 600),
        "ib12k-4.5-s73-1200": _n(4, 12288, "interactive-batch", 4.5, 73, 1200),
        "H1-code8k-4.5-s77": _h(H1, 8192, "codegen", 4.5, 77, 600),
        "H2-code8k-4.5-s77": _h(H2, 8192, "codegen", 4.5, 77, 600),
        "H1-ib12k-3-s78": _h(H1, 12288, "interactive-batch", 3, 78, 600),
        "H2-ib12k-3-s78": _h(H2, 12288, "interactive-batch", 3, 78, 600),
    },
    # Seven KV-limited set-ups on seeds no other set uses (201-207), to tell a rule's effect from
    # one run's spread (a run's makespan is set by when its last long answers start).
    "unseen": {
        f"{name}-s{seed}": _n(n, kv, workload, rate, seed, 600)
        for name, (n, kv, workload, rate) in {
            "ib12k-4.5": (4, 12288, "interactive-batch", 4.5),
            "code8k-7": (4, 8192, "codegen", 7),
            "6x-reports-qa16k-9": (6, 16384, f"{SC}/scls-reports-qa.json", 9),
            "8x-stories8k-9": (8, 8192, f"{SC}/scls-stories.json", 9),
            "3x-chat10k-4.5": (3, 10240, "chat", 4.5),
            "5x-ib12k-6": (5, 12288, "interactive-batch", 6),
            "codechat10k-7": (4, 10240, "code-chat", 7),
        }.items()
        for seed in range(201, 208)
    },
    # Written to check the bound on how long a blocked head is passed (head_wait_intervals): three
    # workloads no other set uses (docs/scenarios/scls-contracts-chat, -diff-review, -translate-docs),
    # fleets of 2, 4 and 7, seeds 401-406; rates picked from least-requests' preemptions alone.
    "check3": {
        "4x-contracts16k-2.4-s401": _n(4, 16384, f"{SC}/scls-contracts-chat.json", 2.4, 401, 600),
        "4x-contracts16k-3-s401": _n(4, 16384, f"{SC}/scls-contracts-chat.json", 3, 401, 600),
        "4x-contracts16k-3-s404": _n(4, 16384, f"{SC}/scls-contracts-chat.json", 3, 404, 600),
        "7x-diff10k-8-s402": _n(7, 10240, f"{SC}/scls-diff-review.json", 8, 402, 600),
        "7x-diff10k-8-s405": _n(7, 10240, f"{SC}/scls-diff-review.json", 8, 405, 600),
        "2x-translate8k-0.6-s403": _n(2, 8192, f"{SC}/scls-translate-docs.json", 0.6, 403, 600),
        "2x-translate8k-0.9-s403": _n(2, 8192, f"{SC}/scls-translate-docs.json", 0.9, 403, 600),
        "2x-translate8k-0.6-s406": _n(2, 8192, f"{SC}/scls-translate-docs.json", 0.6, 406, 600),
        "H1-contracts16k-1.5-s407": _h(H1, 16384, f"{SC}/scls-contracts-chat.json", 1.5, 407, 600),
        "H2-contracts16k-1.5-s407": _h(H2, 16384, f"{SC}/scls-contracts-chat.json", 1.5, 407, 600),
    },
    # Written for session 25 before any run, on seeds no other set uses (2501-2510): fleet sizes, KV
    # sizes and a heterogeneous fleet of three groups in two orders, workloads from other papers'
    # scenario files too; rates guessed from the nearest set-ups above (rows where least-requests
    # preempts less than once per ten requests are not judged).
    "check25": {
        "3x-codegen10k-5-s2501": _n(3, 10240, "codegen", 5, 2501, 600),
        "5x-ib14k-5.5-s2502": _n(5, 14336, "interactive-batch", 5.5, 2502, 600),
        "4x-mixed12k-6-s2503": _n(4, 12288, "mixed", 6, 2503, 600),
        "4x-codechat8k-6-s2504": _n(4, 8192, "code-chat", 6, 2504, 600),
        "6x-chat12k-9-s2505": _n(6, 12288, "chat", 9, 2505, 600),
        "4x-support-summaries-codegen16k-6-s2506": _n(
            4, 16384, f"{SC}/aladdin-support-summaries-codegen.json", 6, 2506, 600
        ),
        "4x-chat-reports12k-5-s2507": _n(4, 12288, f"{SC}/qlm-chat-reports.json", 5, 2507, 600),
        "H3a-mixed12k-5-s2508": _h(H3A, 12288, "mixed", 5, 2508, 600),
        "H3b-mixed12k-5-s2508": _h(H3B, 12288, "mixed", 5, 2508, 600),
        "H3a-codegen8k-5-s2509": _h(H3A, 8192, "codegen", 5, 2509, 600),
        "H3b-codegen8k-5-s2509": _h(H3B, 8192, "codegen", 5, 2509, 600),
        "4x-ib12k-4.5-s2510-1200": _n(4, 12288, "interactive-batch", 4.5, 2510, 1200),
    },
    # Short answers beside long ones over twelve seeds (the set-up where backfill passed long heads).
    "reports-qa12": {
        f"6x-reports-qa16k-9-s{seed}": _n(6, 16384, f"{SC}/scls-reports-qa.json", 9, seed, 600)
        for seed in range(90, 102)
    },
    # Listing order of a heterogeneous fleet (both orders) and the 600-request scenarios of that round.
    "het": {
        "H1-mixed16k-5-s29": _h(H1, 16384, "mixed", 5, 29, 600),
        "H2-mixed16k-5-s29": _h(H2, 16384, "mixed", 5, 29, 600),
        "H1-ib16k-2.5-s28": _h(H1, 16384, "interactive-batch", 2.5, 28, 600),
        "H2-ib16k-2.5-s28": _h(H2, 16384, "interactive-batch", 2.5, 28, 600),
        "H1-reports-qa8k-4-s54": _h(H1, 8192, f"{SC}/scls-reports-qa.json", 4, 54, 600),
        "H2-reports-qa8k-4-s54": _h(H2, 8192, f"{SC}/scls-reports-qa.json", 4, 54, 600),
        "H1-trace8k-6": _h(H1, 8192, f"trace:{T}", 6, 0, 600),
        "H2-trace8k-6": _h(H2, 8192, f"trace:{T}", 6, 0, 600),
        "ib8k-3.5-s22": _n(4, 8192, "interactive-batch", 3.5, 22, 600),
        "ib16k-3.5-s27": _n(4, 16384, "interactive-batch", 3.5, 27, 600),
        "codechat12k-6-s24": _n(4, 12288, "code-chat", 6, 24, 600),
    },
}


def scenario_run(parser: argparse.ArgumentParser, name: str, config_json: str) -> tuple[str, int, Any]:
    """A suite scenario's ``simulate`` flags, its seed and the ``SliceConfig`` from ``--config``
    (for the scripts that trace one scenario); an unknown name is the parser's error."""
    from router.core.slicing import SliceConfig

    found = [v for s in SETS.values() for k, v in s.items() if k == name]
    if not found:
        parser.error(f"scenario: {name!r} is not in scripts/slice_suite.py")
    argv = found[0]
    words = shlex.split(argv)
    return argv, int(words[words.index("--seed") + 1]), SliceConfig(**json.loads(config_json))


def _setup(argv: str) -> tuple[Any, list[Any]]:
    """The fleet and the plans ``slo-router simulate ARGV`` would run (its own parser and loaders)."""
    from router.cli import build_parser
    from sim.cli import _fleet, load_source, run_plans
    from sim.cluster import SimFleet

    args = build_parser().parse_args(["simulate", *shlex.split(argv)])
    workload, trace, rates = load_source(args)
    fleet = SimFleet(_fleet(args))
    plans = run_plans(args, workload, trace)(workload, rates[0])
    return fleet, plans


def _figures(outcome: Any) -> dict[str, Any]:
    done = sum(1 for r in outcome.results if r.ok)
    thru = done / outcome.duration_s if outcome.duration_s > 0 else 0.0
    from workload.report import slo_met

    attained = sum(1 for r in outcome.results if slo_met(r)) / max(len(outcome.results), 1)
    out = {"thru": thru, "preempt": outcome.stats.preemptions, "done": done, "attain": attained}
    figures = getattr(outcome, "figures", None)
    if figures is not None:
        out["stall_p99"] = figures.resume_gap_p99_ms
        out["recomputed"] = figures.recomputed_tokens
    counters = getattr(outcome, "counters", None) or {}
    for k in ("moved", "shortened", "waited", "resumed"):
        if k in counters:
            out[k] = counters[k]
    return out


def _run(job: tuple[str, str, str, dict[str, Any]]) -> tuple[str, str, dict[str, Any]]:
    name, mode, argv, config = job
    from router.core.config import SchedulerConfig
    from router.core.slicing import SliceConfig
    from sim.cluster import simulate
    from sim.slicing import simulate_slices

    fleet, plans = _setup(argv)
    seed = int(shlex.split(argv)[shlex.split(argv).index("--seed") + 1])
    if mode == "request":
        outcome: Any = simulate(fleet, SchedulerConfig(scheduling_policy="least-requests"), plans, seed=seed)
    else:
        outcome = simulate_slices(fleet, plans, SliceConfig(**config), seed=seed)
    return name, mode, _figures(outcome)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--set", default="long600", help=f"one of {', '.join(SETS)}, or all; comma-separated")
    parser.add_argument("--only", default="", help="comma-separated scenario names (substrings) to keep")
    parser.add_argument("--jobs", type=int, default=1, help="processes (1..8)")
    parser.add_argument("--config", default="{}", help="SliceConfig fields as a JSON object")
    parser.add_argument(
        "--cache", default="/tmp/slice_suite_request_cache.json", help="request-dispatch cache"
    )
    parser.add_argument("--json", default="", help="write the rows to this file")
    args = parser.parse_args()
    if not 1 <= args.jobs <= 8:
        parser.error(f"--jobs must be in 1..8, got {args.jobs}")
    try:
        config = json.loads(args.config)
    except json.JSONDecodeError as exc:
        parser.error(f"--config: not JSON: {exc}")
    if not isinstance(config, dict):
        parser.error("--config must be a JSON object")
    names = list(SETS) if args.set == "all" else [s.strip() for s in args.set.split(",")]
    scenarios: dict[str, str] = {}
    for s in names:
        if s not in SETS:
            parser.error(f"--set: {s!r} is not one of {', '.join(SETS)}")
        for k, v in SETS[s].items():
            scenarios[f"{s}/{k}"] = v
    if args.only:
        keep = [o.strip() for o in args.only.split(",") if o.strip()]
        scenarios = {k: v for k, v in scenarios.items() if any(o in k for o in keep)}
    cache_path = Path(args.cache)
    cache: dict[str, Any] = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    jobs = [(k, "slice", v, config) for k, v in scenarios.items()]
    jobs += [(k, "request", v, {}) for k, v in scenarios.items() if v not in cache]
    sliced: dict[str, dict[str, Any]] = {}
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for name, mode, figures in pool.map(_run, jobs):
            if mode == "request":
                cache[scenarios[name]] = figures
                cache_path.write_text(json.dumps(cache, indent=1))
            else:
                sliced[name] = figures
    rows = []
    ratios = []
    met = judged = 0
    print(
        f"{'scenario':34s} {'LR thru':>7s} {'LR pre':>6s} {'sl thru':>7s} {'sl pre':>6s} {'ratio':>6s} "
        f"{'stall':>6s} {'LR att':>6s} {'sl att':>6s} goal  moved/shortened/waited"
    )
    for name, argv in scenarios.items():
        req, sl = cache[argv], sliced[name]
        ratio = sl["thru"] / req["thru"] if req["thru"] > 0 else math.nan
        ratios.append(ratio)
        requests = int(shlex.split(argv)[shlex.split(argv).index("--num-requests") + 1])
        limited = req["preempt"] >= 0.1 * requests
        ok = ratio >= 0.95 and sl["preempt"] <= 0.1 * req["preempt"]
        if limited:
            judged += 1
            met += ok
        goal = ("met" if ok else "NOT") if limited else "-"
        stall = sl.get("stall_p99")
        print(
            f"{name:34s} {req['thru']:7.2f} {req['preempt']:6d} {sl['thru']:7.2f} {sl['preempt']:6d} "
            f"{ratio:6.3f} {stall if stall is None else round(stall):>6} {req['attain']:6.1%} "
            f"{sl['attain']:6.1%} {goal:4s}  {sl.get('moved', '-')}/{sl.get('shortened', '-')}/{sl.get('waited', '-')}"
        )
        rows.append(
            {"scenario": name, "argv": argv, "request": req, "slice": sl, "ratio": ratio, "goal": goal}
        )
    gm = math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else math.nan
    print(f"goal met {met} of {judged} KV-limited; geometric mean {gm:.3f}; worst {min(ratios):.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": config, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
