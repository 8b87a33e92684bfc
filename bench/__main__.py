"""``make bench``: run every ``bench/bench_*.py`` module's ``main()`` and print its figures.

    python -m bench                 # all benchmarks
    python -m bench predictor cms   # only bench_predictor.py and bench_cms.py

Benchmarks print numbers; they never assert on timing.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import time

import bench


def main(argv: list[str]) -> int:
    names = sorted(m.name for m in pkgutil.iter_modules(bench.__path__) if m.name.startswith("bench_"))
    if argv:
        wanted = {f"bench_{a}" for a in argv}
        unknown = wanted - set(names)
        if unknown:
            print(
                f"unknown benchmarks: {', '.join(sorted(unknown))}; have: {', '.join(names)}", file=sys.stderr
            )
            return 2
        names = [n for n in names if n in wanted]
    for name in names:
        print(f"\n=== {name.removeprefix('bench_')} ===", flush=True)
        start = time.perf_counter()
        importlib.import_module(f"bench.{name}").main()
        print(f"({name} took {time.perf_counter() - start:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
