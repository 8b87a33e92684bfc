"""Loading and validating profiling JSON (the seed schema).

A TTFT profile maps ``tokens_num`` (tokens in one prefill step) to latency; a
TPOT profile maps ``(batch_size, tokens_per_request)`` to the latency of one
decode step, on a rectangular grid. Only ``p50`` is used. Every problem is a
:class:`ProfileError` whose message names the file and the offending entry.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from predictor.interpolation import Grid1D, Grid2D


class ProfileError(ValueError):
    """A profiling file cannot be used; the message says which file, which entry and why."""


@dataclass(frozen=True)
class TtftProfile:
    """A loaded TTFT profile: p50 latency (ms) by tokens in one prefill step."""

    grid: Grid1D
    source: str
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TpotProfile:
    """A loaded TPOT profile: p50 step latency (ms) by (batch size, tokens per request)."""

    grid: Grid2D
    source: str
    metadata: Mapping[str, Any] = field(default_factory=dict)


def _read_results(path: str | Path, source: str) -> tuple[list[Any], Mapping[str, Any]]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"{source}: cannot read profiling file: {exc}") from exc
    return _parse_results(text, source)


def _parse_results(text: str, source: str) -> tuple[list[Any], Mapping[str, Any]]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{source}: invalid JSON: {exc}") from exc
    if not isinstance(doc, dict) or "results" not in doc:
        raise ProfileError(f"{source}: missing top-level 'results' list")
    results = doc["results"]
    if not isinstance(results, list):
        raise ProfileError(f"{source}: 'results' must be a list, got {type(results).__name__}")
    if not results:
        raise ProfileError(f"{source}: 'results' is empty; at least one sample is needed")
    metadata = doc.get("metadata", {})
    return results, metadata if isinstance(metadata, dict) else {}


def _number(entry: Any, key: str, where: str, *, positive: bool) -> float:
    if not isinstance(entry, dict):
        raise ProfileError(f"{where}: entry must be an object, got {type(entry).__name__}")
    if key not in entry:
        raise ProfileError(f"{where}: missing key '{key}'")
    value = entry[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(f"{where}: '{key}' must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ProfileError(f"{where}: '{key}' must be finite, got {value!r}")
    if positive and v <= 0:
        raise ProfileError(f"{where}: '{key}' must be > 0, got {value!r}")
    if not positive and v < 0:
        raise ProfileError(f"{where}: '{key}' must be >= 0, got {value!r}")
    return v


def parse_ttft_profile(text: str, source: str = "<ttft profile>") -> TtftProfile:
    """Parse TTFT profiling JSON text; ``source`` names it in error messages."""
    results, metadata = _parse_results(text, source)
    return _build_ttft(results, metadata, source)


def load_ttft_profile(path: str | Path) -> TtftProfile:
    """Load and validate a TTFT profiling file."""
    source = str(path)
    results, metadata = _read_results(path, source)
    return _build_ttft(results, metadata, source)


def _build_ttft(results: Sequence[Any], metadata: Mapping[str, Any], source: str) -> TtftProfile:
    points: dict[float, float] = {}
    for idx, entry in enumerate(results):
        where = f"{source}: results[{idx}]"
        tokens = _number(entry, "tokens_num", where, positive=True)
        p50 = _number(entry, "p50", where, positive=False)
        if tokens in points:
            raise ProfileError(f"{where}: duplicated point tokens_num={entry['tokens_num']}")
        points[tokens] = p50
    xs = np.array(sorted(points), dtype=np.float64)
    ys = np.array([points[x] for x in xs], dtype=np.float64)
    return TtftProfile(Grid1D(xs, ys), source, dict(metadata))


def parse_tpot_profile(text: str, source: str = "<tpot profile>") -> TpotProfile:
    """Parse TPOT profiling JSON text; ``source`` names it in error messages."""
    results, metadata = _parse_results(text, source)
    return _build_tpot(results, metadata, source)


def load_tpot_profile(path: str | Path) -> TpotProfile:
    """Load and validate a TPOT profiling file (the grid must be rectangular)."""
    source = str(path)
    results, metadata = _read_results(path, source)
    return _build_tpot(results, metadata, source)


def _fmt(v: float) -> str:
    return str(int(v)) if v.is_integer() else repr(v)


def _build_tpot(results: Sequence[Any], metadata: Mapping[str, Any], source: str) -> TpotProfile:
    points: dict[tuple[float, float], float] = {}
    for idx, entry in enumerate(results):
        where = f"{source}: results[{idx}]"
        batch = _number(entry, "batch_size", where, positive=True)
        tpr = _number(entry, "tokens_per_request", where, positive=True)
        p50 = _number(entry, "p50", where, positive=False)
        if (batch, tpr) in points:
            raise ProfileError(
                f"{where}: duplicated point (batch_size={_fmt(batch)}, tokens_per_request={_fmt(tpr)})"
            )
        points[(batch, tpr)] = p50
    xs = sorted({b for b, _ in points})
    ys = sorted({t for _, t in points})
    missing = [(b, t) for b in xs for t in ys if (b, t) not in points]
    if missing:
        listed = ", ".join(f"({_fmt(b)}, {_fmt(t)})" for b, t in missing[:20])
        more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
        raise ProfileError(
            f"{source}: TPOT grid is not rectangular; missing (batch_size, tokens_per_request) "
            f"pairs: {listed}{more}"
        )
    zs = np.array([[points[(b, t)] for t in ys] for b in xs], dtype=np.float64)
    grid = Grid2D(np.array(xs, dtype=np.float64), np.array(ys, dtype=np.float64), zs)
    return TpotProfile(grid, source, dict(metadata))
