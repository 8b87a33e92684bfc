"""Regenerate the README's simulated figures: its quick start and the real-trace table (docs/figures.md).

    .venv/bin/python scripts/readme_figures.py [--traces ../shared/traces] [--jobs 2]

Runs the commands the README and docs/figures.md print above their figures, exactly as printed, and
prints the quick start's table as `simulate` writes it and the real-trace table as the Markdown rows
docs/figures.md carries. Everything runs in virtual time, so the figures are the same on any machine; only the wall
time (printed per command) depends on it. Paste the output over those figures (and the README's summary of them) when the code
changes them, and say in the commit what moved.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

QUICK_START = "--neutral 4 --workload mixed --policies round-robin,slo --rates 9 --num-requests 600 --seed 0"
# The Azure conversation trace on 8 instances at 0.7x, 1x and 1.3x of the rate at which `slo`
# keeps 95 % (16 req/s); docs/figures.md's "Real traces" section prints these commands.
TRACE_BASE = "--neutral 8 --num-requests 3000 --rates 11.2,16,20.8"
TRACE_RUNS = (
    "--policies round-robin,load-balance,slo,binpack --queue-policies edf",
    "--policies slo --queue-policies sa,qlm",
    "--policies round-robin --dispatch-modes slice",
)
ROW_NAMES = {
    ("round-robin", "edf", "request"): "`round-robin`",
    ("load-balance", "edf", "request"): "`load-balance`",
    ("slo", "edf", "request"): "`slo` (queue `edf`)",
    ("binpack", "edf", "request"): "`binpack` (seed 001)",
    ("slo", "sa", "request"): "`slo` + queue `sa` (seed 000)",
    ("slo", "qlm", "request"): "queue `qlm` (seed 004)",
    ("max-min", "none", "slice"): "slice dispatch (seed 002)",
}


def _simulate(args: str, output: Path) -> float:
    """Run one `slo-router simulate` (this interpreter's) writing JSON; return its wall time."""
    command = [sys.executable, "-m", "router.cli", "simulate", *args.split()]
    command += ["--output", str(output), "--no-progress"]
    start = time.monotonic()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - start


def _ms(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _trace_rows(results: list[dict[str, Any]]) -> list[str]:
    """One Markdown row per (policy, queue, dispatch), attainment at each rate, latencies at 1x."""
    rows: dict[tuple[str, str, str], dict[float, dict[str, Any]]] = {}
    for r in results:
        key = (str(r["policy"]), str(r["queue_policy"]), str(r.get("dispatch_mode", "request")))
        rows.setdefault(key, {})[float(r["rate"])] = r
    lines = []
    for key, name in ROW_NAMES.items():
        by_rate = rows.get(key)
        if by_rate is None:
            lines.append(f"| {name} | (no run: {key}) |")
            continue
        rates = sorted(by_rate)
        one = by_rate[rates[1]]
        attain = " | ".join(f"{100 * by_rate[x]['slo_attainment']:.1f} %" for x in rates)
        lines.append(
            f"| {name} | {attain} | {one['goodput_rps']:.2f} | "
            f"{_ms(one['ttft_p50_ms'])} / {_ms(one['ttft_p99_ms'])} | "
            f"{_ms(one['tpot_p50_ms'])} / {_ms(one['tpot_p99_ms'])} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--traces",
        type=Path,
        default=Path("../shared/traces"),
        help="directory holding azure-conv-2023.csv (default: ../shared/traces)",
    )
    parser.add_argument("--jobs", type=int, default=2, help="commands run at once (default: 2)")
    args = parser.parse_args(argv)
    trace = args.traces / "azure-conv-2023.csv"
    if not trace.is_file():
        parser.error(f"--traces {args.traces}: no azure-conv-2023.csv there")
    if not 1 <= args.jobs <= 8:
        parser.error(f"--jobs {args.jobs}: must be 1-8")
    commands = [QUICK_START] + [f"--workload trace:{trace} {TRACE_BASE} {run}" for run in TRACE_RUNS]
    with tempfile.TemporaryDirectory() as tmp:
        outputs = [Path(tmp) / f"run{i}.json" for i in range(len(commands))]
        with ThreadPoolExecutor(args.jobs) as pool:
            walls = list(pool.map(_simulate, commands, outputs))
        loaded = [json.loads(o.read_text())["results"] for o in outputs]
    for command, wall in zip(commands, walls, strict=True):
        print(f"slo-router simulate {command}   # {wall:.1f} s wall")
    print("\nQuick start (attainment, chat / code / summarize):")
    for r in loaded[0]:
        classes = " / ".join(f"{name} {100 * c['slo_attainment']:.1f} %" for name, c in r["by_class"].items())
        print(f"  {r['policy']}: {100 * r['slo_attainment']:.1f} % ({classes})")
    print("\nReal traces (Markdown rows):")
    print("\n".join(_trace_rows([r for runs in loaded[1:] for r in runs])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
