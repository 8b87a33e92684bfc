"""Regenerate the four seed-paper tables of docs/seed-papers.md: where each mechanism wins and loses.

    .venv/bin/python scripts/readme_papers.py [--papers sa,qlm,binpack,slice] [--jobs 2]

Runs every row's command as the page prints it (``python -m sim.papers`` for the two queue
policies, ``slo-router simulate`` for packing and slices) and prints each paper's table in the
page's Markdown form, the commands above it. Everything runs in virtual time, so the figures
are the same on any machine; only the wall time (printed per command) depends on it. Paste the
output over that page's tables when the code changes them, and say in the commit what moved.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

D = "docs/scenarios"


@dataclass(frozen=True)
class Row:
    """One table row: what it shows and the arguments of its command."""

    scenario: str
    args: str


@dataclass(frozen=True)
class Paper:
    """A paper's table: its command, its rows and how a run's output becomes the row's cells."""

    name: str
    #: The commands each row's arguments go to, as the page prints them; the cells get their outputs.
    commands: tuple[str, ...]
    head: str
    rows: tuple[Row, ...]
    cells: Callable[[list[Any]], str]


SA_BURSTS = "--instances 2 --bursts 8 --period-s 60"


def _papers_rows(out: Any) -> dict[str, dict[str, float]]:
    return {r["queue"]: r for r in out["rows"]}


def _sa_cells(outs: list[Any]) -> str:
    r = _papers_rows(outs[0])
    fcfs, edf, sa = r["fcfs"], r["edf"], r["sa"]
    gain = 100 * (sa["g"] / fcfs["g"] - 1) if fcfs["g"] > 0 else float("nan")
    return (
        f"{fcfs['g']:.4f} ({fcfs['attain']:.1f} %) | {edf['g']:.4f} ({edf['attain']:.1f} %) | "
        f"{sa['g']:.4f} ({sa['attain']:.1f} %) | {gain:+.1f} %"
    )


def _qlm_cells(outs: list[Any]) -> str:
    r = _papers_rows(outs[0])
    fcfs, edf, qlm = r["fcfs"], r["edf"], r["qlm"]

    def one(f: dict[str, float]) -> str:
        return f"{f['attain']:.1f} % · {f['tput']:.2f} · {f['preempt']:.0f}"

    evicted = f" ({qlm['evicted']:.0f} evicted)" if qlm["evicted"] else ""
    return (
        f"{one(fcfs)} | {one(edf)} | {one(qlm)}{evicted} | {qlm['attain'] - edf['attain']:+.1f} points, "
        f"{qlm['tput'] / edf['tput']:.2f}× throughput"
    )


def _simulate_rows(outs: list[Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["policy"], r.get("dispatch_mode", "request")): r for out in outs for r in out["results"]}


def _binpack_cells(outs: list[Any]) -> str:
    r = _simulate_rows(outs)

    def one(policy: str) -> str:
        x = r[(policy, "request")]
        return f"{100 * x['slo_attainment']:.1f} % ({x['preemptions']})"

    slo, binpack = r[("slo", "request")], r[("binpack", "request")]
    lead = 100 * (binpack["slo_attainment"] - slo["slo_attainment"])
    return f"{one('slo')} | {one('binpack')} | {one('least-requests')} | {lead:+.1f} points"


def _slice_cells(outs: list[Any]) -> str:
    r = _simulate_rows(outs)

    def one(x: dict[str, Any]) -> str:
        return f"{x['throughput_rps']:.2f} · {x['preemptions']} · {100 * x['slo_attainment']:.1f} %"

    lr, sliced, slo = r[("least-requests", "request")], r[("max-min", "slice")], r[("slo", "request")]
    return f"{one(lr)} | {one(sliced)} | {one(slo)} | {sliced['throughput_rps'] / lr['throughput_rps']:.2f}×"


PAPERS = (
    Paper(
        "sa",
        ("python -m sim.papers sa --only fcfs,edf,sa",),
        "| scenario | `fcfs` G (attainment) | `edf` G | `sa` G | `sa` over `fcfs` |",
        (
            Row(
                "classify + code + chat, bursts of 12, 1 sequence per engine, 3 ms apart",
                f"{SA_BURSTS} --workload {D}/sa-classify-code-chat.json --seeds 2 --seed 100 --seqs 1 "
                "--burst 12 --gap-ms 3",
            ),
            Row(
                "summaries + chat, bursts of 12, 2 sequences, 3 ms apart",
                f"{SA_BURSTS} --workload {D}/sa-summaries-chat.json --seeds 2 --seed 100 --seqs 2 "
                "--burst 12 --gap-ms 3",
            ),
            Row(
                "tickets + assistant, bursts of 10, 2 sequences, together",
                f"--instances 2 --period-s 60 --workload {D}/sa-tickets-assistant.json --seeds 3 --seqs 2 "
                "--burst 10 --gap-ms 0 --bursts 10",
            ),
            Row(
                "OCR + a 300 ms-TTFT Q&A stream + contracts, bursts of 10, 2 sequences, 4 ms apart",
                f"--instances 2 --period-s 60 --workload {D}/sa-ocr-qa-contract.json --seeds 2 --seed 31100 "
                "--seqs 2 --burst 10 --gap-ms 4 --bursts 6",
            ),
            Row(
                "tickets + assistant, steady 0.3 req/s (light load)",
                f"--instances 2 --workload {D}/sa-tickets-assistant.json --seeds 3 --rate 0.3 --requests 300",
            ),
            Row(
                "`mixed` on 4 default engines (256 sequences) at 10 req/s",
                "--instances 4 --workload mixed --seeds 1 --rate 10 --requests 600",
            ),
        ),
        _sa_cells,
    ),
    Paper(
        "qlm",
        ("python -m sim.papers qlm --only fcfs,edf,qlm",),
        "| scenario | `fcfs` attainment · req/s · preemptions | `edf` (`slo`'s default) | `qlm` | `qlm` against `edf` |",
        (
            Row(
                "alerts (20 s) + reports (90 s) past capacity, 4 instances, 24 req/s",
                f"--instances 4 --seeds 2 --workload {D}/qlm-alerts-reports-90s.json --rate 24 --requests 800",
            ),
            Row(
                "triage + digests, heavy overload, 4 instances, 30 req/s",
                f"--instances 4 --seeds 1 --seed 31 --workload {D}/qlm-triage-digests.json --rate 30 "
                "--requests 1000",
            ),
            Row(
                "a burst of 10-minute digests on 8-sequence engines beside 20 s alerts (eviction)",
                f"--instances 4 --seeds 1 --seqs 8 --workload {D}/qlm-digests-alerts.json --rate 1.5 "
                "--burst-class digests --burst 32 --bursts 3 --period-s 120",
            ),
            Row(
                "triage + 120 s digests, near capacity, 20 req/s",
                f"--instances 4 --seeds 2 --seed 11 --workload {D}/qlm-triage-digests.json --rate 20 "
                "--requests 600",
            ),
            Row(
                "alerts + reports on a KV-limited fleet (24k tokens), 16 req/s",
                f"--instances 4 --seeds 1 --seed 51 --kv-tokens 24000 --workload {D}/qlm-alerts-reports-90s.json "
                "--rate 16 --requests 600",
            ),
            Row(
                "long-prompt streams (TTFT 2 s) + 45 s reports past capacity",
                f"--instances 4 --seeds 3 --seed 701 --workload {D}/qlm-rag-reports.json --rate 6.5 "
                "--requests 600",
            ),
        ),
        _qlm_cells,
    ),
    Paper(
        "binpack",
        (
            "slo-router simulate --policies slo,binpack,least-requests --queue-policies edf --num-requests 800",
        ),
        "| scenario | `slo` attainment (preemptions) | `binpack` | least-requests (JSQ) | `binpack` against `slo` |",
        (
            Row(
                "2 prefill + 4 decode, 16k tokens of KV, `mixed` at 9 req/s",
                "--prefill 2 --decode 4 --kv-capacity-tokens 16384 --workload mixed --rates 9",
            ),
            Row("4 neutral, `chat` at 12 req/s", "--neutral 4 --workload chat --rates 12"),
            Row(
                "6 neutral, 24k tokens of KV, `chat` at 16 req/s",
                "--neutral 6 --kv-capacity-tokens 24576 --workload chat --rates 16 --seed 21",
            ),
            Row(
                "faq + reviews + 15 s refactors, 4 neutral, 32k of KV, 4 req/s",
                f"--neutral 4 --kv-capacity-tokens 32768 --workload {D}/aladdin-faq-reviews-refactor.json "
                "--rates 4 --seed 9400",
            ),
            Row(
                "300 ms completions + reviews + 30 s docs, 4 neutral, 32k of KV, 4 req/s",
                f"--neutral 4 --kv-capacity-tokens 32768 --workload {D}/aladdin-completion-review-docs.json "
                "--rates 4 --seed 31000",
            ),
            Row(
                "ops + runbooks + 25 s exports past capacity, 4 neutral, 32k of KV, 6 req/s",
                f"--neutral 4 --kv-capacity-tokens 32768 --workload {D}/aladdin-ops-runbooks-exports.json "
                "--rates 6 --seed 31000",
            ),
            Row(
                "2 prefill + 2 decode, 48 shared prompt prefixes, prefix caches, 6 req/s",
                f"--prefill 2 --decode 2 --workload {D}/hunt-ph48.json --rates 6 --seed 3109 "
                "--prefix-cache-routing exact",
            ),
            Row(
                "3 prefill + 3 decode, Azure conversation trace at 16 req/s",
                "--prefill 3 --decode 3 --workload trace:../shared/traces/azure-conv-2023.csv --rates 16",
            ),
        ),
        _binpack_cells,
    ),
    Paper(
        "slice",
        (
            "slo-router simulate --neutral 4 --policies least-requests --dispatch-modes request,slice "
            "--num-requests 400",
            "slo-router simulate --neutral 4 --policies slo --queue-policies edf --num-requests 400",
        ),
        "| scenario | least-requests req/s · preemptions · attainment | slices | `slo` | slices over least-requests |",
        (
            Row(
                "8k tokens of KV, `mixed` at 8 req/s", "--kv-capacity-tokens 8192 --workload mixed --rates 8"
            ),
            Row(
                "16k tokens of KV, `mixed` at 8 req/s",
                "--kv-capacity-tokens 16384 --workload mixed --rates 8",
            ),
            Row(
                "16k tokens of KV, `interactive-batch` at 6 req/s",
                "--kv-capacity-tokens 16384 --workload interactive-batch --rates 6 --seed 3",
            ),
            Row(
                "16k tokens of KV, 48 shared 3,072-token prompt prefixes, prefix caches, 8 req/s",
                f"--kv-capacity-tokens 16384 --workload {D}/scls-prefix-heavy-48.yaml --rates 8 --seed 3101 "
                "--prefix-cache-routing exact",
            ),
            Row(
                "64k tokens of KV (the KV holds), `mixed` at 8 req/s",
                "--kv-capacity-tokens 65536 --workload mixed --rates 8",
            ),
        ),
        _slice_cells,
    ),
)


def _argv(command: str, row: Row, output: Path) -> list[str]:
    """The row's command as this interpreter runs it, writing JSON to ``output``."""
    program, *fixed = command.split()
    module = ["-m", "sim.papers"] if program == "python" else ["-m", "router.cli"]
    fixed = fixed[2:] if program == "python" else fixed  # drop "-m sim.papers"
    extra = ["--no-progress"] if program == "slo-router" else []
    return [sys.executable, *module, *fixed, *row.args.split(), *extra, "--output", str(output)]


def _run(argv: Sequence[str]) -> float:
    start = time.monotonic()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [p.name for p in PAPERS]
    parser.add_argument(
        "--papers",
        default=",".join(names),
        help=f"which tables, comma-separated (default: {','.join(names)})",
    )
    parser.add_argument("--jobs", type=int, default=2, help="commands run at once (default: 2)")
    args = parser.parse_args(argv)
    wanted = [w.strip() for w in args.papers.split(",") if w.strip()]
    unknown = sorted(set(wanted) - set(names))
    if unknown or not wanted:
        parser.error(f"--papers {args.papers}: each must be one of {', '.join(names)}")
    if not 1 <= args.jobs <= 8:
        parser.error(f"--jobs {args.jobs}: must be 1-8")
    papers = [p for p in PAPERS if p.name in wanted]
    runs = [(p, r, c) for p in papers for r in p.rows for c in p.commands]
    with tempfile.TemporaryDirectory() as tmp:
        outputs = [Path(tmp) / f"run{i}.json" for i in range(len(runs))]
        argvs = [_argv(c, r, o) for (_, r, c), o in zip(runs, outputs, strict=True)]
        with ThreadPoolExecutor(args.jobs) as pool:
            walls = list(pool.map(_run, argvs))
        loaded = iter([json.loads(o.read_text()) for o in outputs])
    for paper in papers:
        commands = " and ".join(f"`{c}`" for c in paper.commands)
        print(f"\n{paper.name}: {commands}, each with the row's arguments\n")
        print(paper.head)
        print("|" + "---|" * (paper.head.count("|") - 1))
        for row in paper.rows:
            print(f"| {row.scenario} | {paper.cells([next(loaded) for _ in paper.commands])} |")
        print()
        for row in paper.rows:
            print(f"    {row.args}")
    print()
    for (_, row, command), wall in zip(runs, walls, strict=True):
        print(f"# {command} {row.args}   ({wall:.0f} s wall)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
