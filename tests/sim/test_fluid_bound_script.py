"""``scripts/fluid_bound.py --step-ms``: the e2e-judged requests no placement finishes in time at a step."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _floor(step_ms: float) -> tuple[int, int, int]:
    out = subprocess.run(
        [
            sys.executable,
            "scripts/fluid_bound.py",
            "mixed:4:3",
            "--num-requests",
            "120",
            "--step-ms",
            f"{step_ms:g}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    found = re.search(
        r"judged end to end: (\d+) of 120; past their deadline on an idle instance (\d+), at a", out
    )
    at = re.search(r"ms step (\d+)", out)
    assert found and at, out
    return int(found.group(1)), int(found.group(2)), int(at.group(1))


def test_the_deadline_floor_grows_with_the_step_and_counts_only_e2e_judged_requests() -> None:
    judged, idle, slow = _floor(60.0)
    _, _, fast = _floor(5.0)
    # mixed: code and summaries are judged end to end, chat (60 %) is not.
    assert 0 < judged < 120
    assert fast <= slow <= judged
    assert slow > fast  # some 4 s code answers need a step under 60 ms
    assert idle <= slow


def test_a_step_out_of_range_is_refused_naming_the_flag() -> None:
    done = subprocess.run(
        [sys.executable, "scripts/fluid_bound.py", "mixed:4", "--step-ms", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--step-ms" in done.stderr
