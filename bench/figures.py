"""The speed table of ``docs/results.md``, written by ``make bench`` itself.

Every ``bench/bench_*.py`` module's ``main()`` prints its figures and returns
the few of them the results page shows, as :class:`Figure` rows. ``python -m bench``
(all benchmarks) collects them into a Markdown table headed by the date and the
machine, and replaces the results page's table between :data:`BEGIN` and :data:`END`,
so the figures there are always the output of one command on one machine.
"""

from __future__ import annotations

import datetime
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

BEGIN = "<!-- bench:begin (written by `make bench`; do not edit by hand) -->"
END = "<!-- bench:end -->"
#: The page whose speed table ``make bench`` rewrites.
RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results.md"


@dataclass(frozen=True)
class Figure:
    """One row of the speed table: what was measured and the figures, as the benchmark printed them."""

    what: str
    measured: str


def without_vllm(what: str, hint: str) -> list[Figure]:
    """The row a vLLM benchmark reports when ``.venv-vllm`` is missing (``hint`` says how to make it)."""
    print(f"skipped: {hint}")
    return [Figure(what, "not measured: `.venv-vllm` is missing (`make vllm-venv`)")]


def print_load_average() -> None:
    """Say how busy the machine was as a benchmark starts: other work skews wall-clock figures."""
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)


@dataclass(frozen=True)
class Section:
    """The figures of one benchmark module (``python -m bench NAME``)."""

    name: str
    figures: tuple[Figure, ...]
    seconds: float


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _memory_gib() -> str:
    try:
        for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 2**20:.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return "? GiB"


def machine() -> str:
    """Cores, CPU model, memory, OS and Python of this machine, in one line."""
    return (
        f"{os.cpu_count()} cores ({_cpu_model()}), {_memory_gib()}, "
        f"{platform.system()} {platform.release().split('-')[0]}, Python {platform.python_version()}"
    )


def render(sections: Sequence[Section], *, load_before: float, load_after: float) -> str:
    """The Markdown block (markers included) for ``sections``."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    total = sum(s.seconds for s in sections)
    lines = [
        BEGIN,
        f"Measured {now} on {machine()}; load average {load_before:.1f} before and {load_after:.1f} "
        f"after (other work on the machine makes the figures noisier); the run took {total:.0f} s.",
        "",
        "| figure | command | measured |",
        "|---|---|---|",
    ]
    for section in sections:
        for fig in section.figures:
            lines.append(f"| {fig.what} | `python -m bench {section.name}` | {fig.measured} |")
    lines.append(END)
    return "\n".join(lines)


def write_results(block: str, path: Path = RESULTS) -> None:
    """Replace the block between :data:`BEGIN` and :data:`END` in ``path`` with ``block``.

    ``ValueError`` if the markers are missing (nothing is written then).
    """
    text = path.read_text(encoding="utf-8")
    start = text.find(BEGIN)
    end = text.find(END, start)
    if start < 0 or end < 0:
        raise ValueError(f"{path} has no {BEGIN!r} ... {END!r} block to replace")
    path.write_text(text[:start] + block + text[end + len(END) :], encoding="utf-8")
