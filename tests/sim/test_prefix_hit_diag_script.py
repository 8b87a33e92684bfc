"""``scripts/prefix_hit_diag.py``: every request of the first run under one cause, the causes' lost
hits adding up to the runs' difference, and the counterfactual keeping holders through the TPOT
thresholds."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REQUESTS = 150


def _run(tmp_path: Path, **env: str) -> str:
    workload = tmp_path / "ph48.yaml"
    workload.write_text(
        "name: ph48\nclasses:\n  - preset: shared-prefix\n    share: 1.0\n    prefix_groups: 48\n"
    )
    return subprocess.run(
        [
            sys.executable,
            "scripts/prefix_hit_diag.py",
            "simulate",
            "--neutral",
            "4",
            "--workload",
            str(workload),
            "--rates",
            "10",
            "--num-requests",
            str(REQUESTS),
            "--policies",
            "slo,cache-affinity",
            "--prefix-cache-routing",
            "exact",
            "--true-noise",
            "0.1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
    ).stdout


def _rows(out: str) -> dict[str, tuple[int, int]]:
    """cause -> (requests, lost tokens)."""
    rows = {}
    for m in re.finditer(r"^  (\S.*?)\s{2,}(\d+)\s+\d+\s+\d+\s+\d+\s+([+-]\d+)\s", out, re.MULTILINE):
        rows[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    return rows


def test_each_request_has_one_cause_and_the_losses_add_up(tmp_path: Path) -> None:
    out = _run(tmp_path)
    total = re.search(r"cached tokens (\d+) against (\d+): ([+-]\d+)", out)
    assert total, out
    rows = _rows(out)
    assert sum(n for n, _ in rows.values()) == REQUESTS, out
    assert sum(lost for _, lost in rows.values()) == int(total.group(3)), out
    assert "placed on holder" in rows and "cold" in rows
    # (the shape drops some holders by TPOT: what the counterfactual below removes)
    assert [c for c in rows if "predicted_tpot" in c or "tpot_residents" in c], out


def test_the_counterfactual_keeps_holders_through_the_tpot_thresholds(tmp_path: Path) -> None:
    out = _run(tmp_path, PREFIX_HIT_DIAG_KEEP_HOLDER="1")
    rows = _rows(out)
    assert sum(n for n, _ in rows.values()) == REQUESTS, out
    assert not [c for c in rows if c.startswith("holder dropped: predicted_tpot") or "tpot_residents" in c], (
        out
    )
