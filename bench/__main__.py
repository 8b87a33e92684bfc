"""``make bench``: run every ``bench/bench_*.py`` module's ``main()``, print its figures, write the speed table of docs/results.md.

    python -m bench                 # all benchmarks; rewrites the speed table of docs/results.md
    python -m bench --no-readme     # all benchmarks; leaves docs/results.md alone
    python -m bench predictor cms   # only bench_predictor.py and bench_cms.py (docs/results.md untouched)

Benchmarks print numbers; they never assert on timing. Each ``main()`` returns
the rows docs/results.md shows (:class:`bench.figures.Figure`); the table is
written only after a full run, so every row comes from the same run.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
import time

import bench
from bench.figures import RESULTS, Figure, Section, render, write_results


def main(argv: list[str]) -> int:
    names = sorted(m.name for m in pkgutil.iter_modules(bench.__path__) if m.name.startswith("bench_"))
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Run the benchmarks, print their figures and (after a full run) write the speed table of docs/results.md.",
    )
    parser.add_argument(
        "benchmarks",
        nargs="*",
        metavar="NAME",
        help=f"run only these ({', '.join(n.removeprefix('bench_') for n in names)}); default: all",
    )
    parser.add_argument(
        "--no-readme",
        action="store_true",
        help="do not rewrite the speed table of docs/results.md after a full run",
    )
    args = parser.parse_args(argv)
    if args.benchmarks:
        wanted = {f"bench_{a}" for a in args.benchmarks}
        unknown = wanted - set(names)
        if unknown:
            have = ", ".join(n.removeprefix("bench_") for n in names)
            parser.error(
                f"unknown benchmarks: {', '.join(sorted(u.removeprefix('bench_') for u in unknown))}; have: {have}"
            )
        names = [n for n in names if n in wanted]
    load_before = os.getloadavg()[0]
    sections: list[Section] = []
    for name in names:
        print(f"\n=== {name.removeprefix('bench_')} ===", flush=True)
        start = time.perf_counter()
        figures: list[Figure] | None = importlib.import_module(f"bench.{name}").main()
        elapsed = time.perf_counter() - start
        print(f"({name} took {elapsed:.1f} s)", flush=True)
        sections.append(Section(name.removeprefix("bench_"), tuple(figures or ()), elapsed))
    block = render(sections, load_before=load_before, load_after=os.getloadavg()[0])
    print("\n" + block)
    if args.benchmarks or args.no_readme:
        print(f"\n(not written to {RESULTS}: only a full run without --no-readme writes it)")
        return 0
    write_results(block)
    print(f"\nwrote the table above into {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
