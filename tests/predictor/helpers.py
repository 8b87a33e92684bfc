"""Small builders for profile files used by the predictor tests."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

WORKED_TTFT = {128: 40.0, 256: 60.0, 512: 100.0, 1024: 180.0}
WORKED_BATCHES = (1, 8, 16)
WORKED_TPRS = (8, 128, 1024)


def worked_tpot(batch: float, tpr: float) -> float:
    return 10 + 0.5 * batch + 0.01 * tpr


def ttft_doc(points: Mapping[float, float]) -> dict[str, Any]:
    return {
        "metadata": {"model": "test", "timestamp": "2026-01-01T00:00:00Z", "description": "test"},
        "results": [{"tokens_num": k, "mean": v, "p50": v, "p95": v, "p99": v} for k, v in points.items()],
    }


def tpot_doc(points: Iterable[tuple[float, float, float]]) -> dict[str, Any]:
    return {
        "metadata": {"model": "test", "timestamp": "2026-01-01T00:00:00Z"},
        "results": [
            {"batch_size": b, "tokens_per_request": t, "mean": v, "p50": v, "p95": v} for b, t, v in points
        ],
    }


def write_json(path: Path, doc: Any) -> Path:
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


def worked_files(tmp: Path) -> tuple[Path, Path]:
    ttft = write_json(tmp / "ttft.json", ttft_doc(WORKED_TTFT))
    tpot = write_json(
        tmp / "tpot.json",
        tpot_doc((b, t, worked_tpot(b, t)) for b in WORKED_BATCHES for t in WORKED_TPRS),
    )
    return ttft, tpot
