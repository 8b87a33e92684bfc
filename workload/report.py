"""Figures of a run: SLO attainment, goodput and latency percentiles, per class and overall.

Everything here is a pure function of per-request :class:`RequestResult` records
and the length of the measurement window, so the load generator (wall clock) and
the simulator (virtual time) report the same way.

Definitions:

- A request *meets its SLO* when it finished without error and each target its
  class sets holds: TTFT ≤ ``ttft_ms``; mean TPOT ≤ ``tpot_ms`` (a request with a
  single output token has no TPOT and passes that part); e2e ≤ ``e2e_ms``. A
  request that errored misses, whatever its latencies.
- *SLO attainment* is met / requests. The per-target attainments (``ttft_attainment``
  ...) count only requests whose class sets that target (errors miss), and are
  ``None`` when no request does.
- *Goodput* is requests meeting their SLO per second of the window
  (``goodput_rps``) and their output tokens per second (``goodput_tokens_per_s``);
  throughput counts every completed request.
- Latency percentiles (linear interpolation between order statistics, numpy's
  default) are over requests that completed without error.
- Errors are counted by gRPC status code name; ``BAD_STREAM`` marks a stream that
  ended without an error status but broke the response contract (see loadgen).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from workload.spec import RequestPlan, SloTarget

#: Error code recorded when a stream completed but broke the Generate response contract.
BAD_STREAM = "BAD_STREAM"

PERCENTILES: tuple[int, ...] = (50, 90, 99)


class PlotUnavailableError(RuntimeError):
    """``--plot`` was asked for but matplotlib is not installed."""


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What happened to one request, as measured by the client (or the simulator)."""

    index: int
    class_name: str
    slo: SloTarget
    prompt_tokens: int
    max_tokens: int
    completion_tokens: int = 0
    start_s: float = 0.0
    """When the request was sent, seconds after the run started."""
    ttft_ms: float | None = None
    """Time to the first message carrying tokens; ``None`` when none arrived."""
    tpot_ms: float | None = None
    """Mean time per output token after the first; ``None`` with fewer than two tokens."""
    e2e_ms: float | None = None
    """Time to the end of the stream (or to the error)."""
    error_code: str | None = None
    """gRPC status code name (``UNAVAILABLE`` ...) or ``BAD_STREAM``; ``None`` when it went well."""
    error_message: str = ""
    finish_reason: str = ""
    prefill_instance_id: str = ""
    decode_instance_id: str = ""
    predicted_ttft_ms: float | None = None
    predicted_tpot_ms: float | None = None
    queue_wait_ms: float = 0.0
    """Time spent in the router queue before placement (``usage.queue_wait_ms``); part of ``ttft_ms``."""

    @classmethod
    def of_plan(cls, plan: RequestPlan, *, start_s: float, **measured: Any) -> RequestResult:
        """The result of planned request ``plan`` (its class, SLO and lengths), with what was measured."""
        return cls(
            index=plan.index,
            class_name=plan.class_name,
            slo=plan.slo,
            prompt_tokens=plan.prompt_tokens,
            max_tokens=plan.max_tokens,
            start_s=start_s,
            **measured,
        )

    @property
    def ok(self) -> bool:
        return self.error_code is None


def ttft_met(r: RequestResult) -> bool | None:
    """Whether ``r`` meets its TTFT target; ``None`` when it has none."""
    if r.slo.ttft_ms is None:
        return None
    return r.ok and r.ttft_ms is not None and r.ttft_ms <= r.slo.ttft_ms


def tpot_met(r: RequestResult) -> bool | None:
    """Whether ``r`` meets its mean-TPOT target; ``None`` when it has none."""
    if r.slo.tpot_ms is None:
        return None
    return r.ok and (r.tpot_ms is None or r.tpot_ms <= r.slo.tpot_ms)


def e2e_met(r: RequestResult) -> bool | None:
    """Whether ``r`` meets its end-to-end target; ``None`` when it has none."""
    if r.slo.e2e_ms is None:
        return None
    return r.ok and r.e2e_ms is not None and r.e2e_ms <= r.slo.e2e_ms


def slo_met(r: RequestResult) -> bool:
    """True when ``r`` completed without error and met every target it has."""
    return r.ok and all(check(r) is not False for check in (ttft_met, tpot_met, e2e_met))


@dataclass(frozen=True)
class LatencyStats:
    """Summary of one latency over the requests that completed; values ``None`` when ``count == 0``."""

    count: int = 0
    mean_ms: float | None = None
    p50_ms: float | None = None
    p90_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None


def latency_stats(values: Iterable[float]) -> LatencyStats:
    """Mean, p50/p90/p99 (linear interpolation) and max of ``values``."""
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size == 0:
        return LatencyStats()
    p50, p90, p99 = (float(v) for v in np.percentile(arr, PERCENTILES))
    return LatencyStats(
        count=int(arr.size),
        mean_ms=float(arr.mean()),
        p50_ms=p50,
        p90_ms=p90,
        p99_ms=p99,
        max_ms=float(arr.max()),
    )


def _fraction(flags: Iterable[bool | None]) -> float | None:
    relevant = [f for f in flags if f is not None]
    return sum(relevant) / len(relevant) if relevant else None


@dataclass(frozen=True)
class ClassReport:
    """The figures of one SLO class, or of all requests (``name == "overall"``, ``slo is None``)."""

    name: str
    slo: SloTarget | None
    requests: int
    completed: int
    errors: int
    slo_met: int
    slo_attainment: float
    ttft_attainment: float | None
    tpot_attainment: float | None
    e2e_attainment: float | None
    goodput_rps: float
    goodput_tokens_per_s: float
    throughput_rps: float
    output_tokens_per_s: float
    prompt_tokens: int
    completion_tokens: int
    ttft: LatencyStats
    tpot: LatencyStats
    e2e: LatencyStats
    errors_by_code: Mapping[str, int] = field(default_factory=dict)
    first_error_by_code: Mapping[str, str] = field(default_factory=dict)
    """The message of the first request (by index) that failed with each code: the cause, in words."""

    def flat(self) -> dict[str, Any]:
        """Every figure as a flat JSON-ready mapping (``ttft_p99_ms`` style keys)."""
        out: dict[str, Any] = {
            "name": self.name,
            "ttft_slo_ms": None if self.slo is None else self.slo.ttft_ms,
            "tpot_slo_ms": None if self.slo is None else self.slo.tpot_ms,
            "e2e_slo_ms": None if self.slo is None else self.slo.e2e_ms,
            "requests": self.requests,
            "completed": self.completed,
            "errors": self.errors,
            "slo_met": self.slo_met,
            "slo_attainment": self.slo_attainment,
            "ttft_attainment": self.ttft_attainment,
            "tpot_attainment": self.tpot_attainment,
            "e2e_attainment": self.e2e_attainment,
            "goodput_rps": self.goodput_rps,
            "goodput_tokens_per_s": self.goodput_tokens_per_s,
            "throughput_rps": self.throughput_rps,
            "output_tokens_per_s": self.output_tokens_per_s,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }
        for label, stats in (("ttft", self.ttft), ("tpot", self.tpot), ("e2e", self.e2e)):
            out[f"{label}_count"] = stats.count
            for stat in ("mean", "p50", "p90", "p99", "max"):
                out[f"{label}_{stat}_ms"] = getattr(stats, f"{stat}_ms")
        out["errors_by_code"] = dict(sorted(self.errors_by_code.items()))
        out["first_error_by_code"] = dict(sorted(self.first_error_by_code.items()))
        return out


@dataclass(frozen=True)
class BenchReport:
    """A whole run: the window length, overall figures, per-class figures and run facts."""

    duration_s: float
    overall: ClassReport
    classes: tuple[ClassReport, ...]
    meta: Mapping[str, Any] = field(default_factory=dict)

    def by_class(self) -> dict[str, ClassReport]:
        return {c.name: c for c in self.classes}


def summarize_group(
    name: str, results: Sequence[RequestResult], duration_s: float, slo: SloTarget | None = None
) -> ClassReport:
    """The figures of ``results`` over a window of ``duration_s`` seconds (rates are 0 when it is 0)."""
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    ok = [r for r in results if r.ok]
    met = [r for r in results if slo_met(r)]
    n = len(results)
    return ClassReport(
        name=name,
        slo=slo,
        requests=n,
        completed=len(ok),
        errors=n - len(ok),
        slo_met=len(met),
        slo_attainment=len(met) / n if n else 0.0,
        ttft_attainment=_fraction(ttft_met(r) for r in results),
        tpot_attainment=_fraction(tpot_met(r) for r in results),
        e2e_attainment=_fraction(e2e_met(r) for r in results),
        goodput_rps=len(met) * per_s,
        goodput_tokens_per_s=sum(r.completion_tokens for r in met) * per_s,
        throughput_rps=len(ok) * per_s,
        output_tokens_per_s=sum(r.completion_tokens for r in ok) * per_s,
        prompt_tokens=sum(r.prompt_tokens for r in results),
        completion_tokens=sum(r.completion_tokens for r in results),
        ttft=latency_stats(r.ttft_ms for r in ok if r.ttft_ms is not None),
        tpot=latency_stats(r.tpot_ms for r in ok if r.tpot_ms is not None),
        e2e=latency_stats(r.e2e_ms for r in ok if r.e2e_ms is not None),
        errors_by_code=dict(Counter(r.error_code for r in results if r.error_code is not None)),
        first_error_by_code=_first_messages(results),
    )


def _first_messages(results: Sequence[RequestResult]) -> dict[str, str]:
    first: dict[str, RequestResult] = {}
    for r in results:
        if r.error_code is not None and (r.error_code not in first or r.index < first[r.error_code].index):
            first[r.error_code] = r
    return {code: r.error_message or "(no message)" for code, r in first.items()}


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    *,
    class_slos: Mapping[str, SloTarget] | None = None,
    meta: Mapping[str, Any] | None = None,
) -> BenchReport:
    """Per-class and overall figures of a run.

    ``class_slos`` (class name → targets, in report order) lists classes even when
    none of their requests ran; classes found only in ``results`` follow, in order of
    first appearance, with the SLO of their first request.
    """
    if not math.isfinite(duration_s) or duration_s < 0:
        raise ValueError(f"duration_s must be finite and >= 0, got {duration_s!r}")
    slos: dict[str, SloTarget] = dict(class_slos or {})
    groups: dict[str, list[RequestResult]] = {name: [] for name in slos}
    for r in results:
        if r.class_name not in slos:
            slos[r.class_name] = r.slo
            groups[r.class_name] = []
        groups[r.class_name].append(r)
    classes = tuple(summarize_group(name, groups[name], duration_s, slos[name]) for name in groups)
    overall = summarize_group("overall", results, duration_s)
    return BenchReport(duration_s=duration_s, overall=overall, classes=classes, meta=dict(meta or {}))


# --------------------------------------------------------------------------- text


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100.0 * value:.1f}%"


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def _render(rows: Sequence[Sequence[str]], right: Sequence[bool]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [cell.rjust(w) if r else cell.ljust(w) for cell, w, r in zip(row, widths, right, strict=True)]
        lines.append("  ".join(cells).rstrip())
    return lines


def format_table(report: BenchReport) -> str:
    """The report as fixed-width text: attainment and goodput, latency percentiles, errors."""
    groups = [*report.classes, report.overall]
    lines: list[str] = []
    header = report.meta.get("title")
    if header:
        lines.append(str(header))
    lines.append(
        f"{report.overall.requests} requests in {report.duration_s:.1f} s, "
        f"{report.overall.completed} completed, {report.overall.errors} errors"
    )
    lines.append("")
    rows: list[list[str]] = [
        [
            "class",
            "reqs",
            "errs",
            "SLO",
            "attain",
            "ttft ok",
            "tpot ok",
            "e2e ok",
            "goodput/s",
            "good tok/s",
            "tok/s",
        ]
    ]
    for g in groups:
        rows.append(
            [
                g.name,
                str(g.requests),
                str(g.errors),
                "-" if g.slo is None else g.slo.describe(),
                _pct(g.slo_attainment if g.requests else None),
                _pct(g.ttft_attainment),
                _pct(g.tpot_attainment),
                _pct(g.e2e_attainment),
                f"{g.goodput_rps:.2f}",
                f"{g.goodput_tokens_per_s:.1f}",
                f"{g.output_tokens_per_s:.1f}",
            ]
        )
    lines.extend(_render(rows, [False, True, True, False, *([True] * 7)]))
    lines.append("")
    lat_rows: list[list[str]] = [["latency ms"]]
    for label in ("TTFT", "TPOT", "E2E"):
        lat_rows[0].extend(f"{label} p{p}" for p in PERCENTILES)
    for g in groups:
        row = [g.name]
        for stats in (g.ttft, g.tpot, g.e2e):
            row.extend(_ms(v) for v in (stats.p50_ms, stats.p90_ms, stats.p99_ms))
        lat_rows.append(row)
    lines.extend(_render(lat_rows, [False, *([True] * 9)]))
    lines.append("")
    lines.extend(LEGEND)
    errors = report.overall.errors_by_code
    if errors:
        lines.append("")
        lines.append("errors by code, with the first message of each:")
        first = report.overall.first_error_by_code
        for code, count in sorted(errors.items(), key=lambda kv: (-kv[1], kv[0])):
            lines.append(f"  {code} {count}: {first.get(code, '(no message)')}")
    return "\n".join(lines)


#: What the summary's columns mean (printed under every table).
LEGEND = (
    "attain: share of requests that finished without error and met every target of their class (SLO);",
    "  ttft/tpot/e2e ok: the same for one target, over the requests whose class sets it.",
    "goodput/s: requests per second of the run that met their SLO; good tok/s: their output tokens per",
    "  second; tok/s: output tokens per second of every completed request. Latencies: completed requests.",
)


# --------------------------------------------------------------------------- JSON


def result_to_dict(r: RequestResult) -> dict[str, Any]:
    """One request as a JSON-ready mapping, with whether it met each target."""
    return {
        "index": r.index,
        "class": r.class_name,
        "start_s": r.start_s,
        "prompt_tokens": r.prompt_tokens,
        "max_tokens": r.max_tokens,
        "completion_tokens": r.completion_tokens,
        "ttft_ms": r.ttft_ms,
        "tpot_ms": r.tpot_ms,
        "e2e_ms": r.e2e_ms,
        "slo_met": slo_met(r),
        "ttft_met": ttft_met(r),
        "tpot_met": tpot_met(r),
        "e2e_met": e2e_met(r),
        "error_code": r.error_code,
        "error_message": r.error_message,
        "finish_reason": r.finish_reason,
        "prefill_instance_id": r.prefill_instance_id,
        "decode_instance_id": r.decode_instance_id,
        "predicted_ttft_ms": r.predicted_ttft_ms,
        "predicted_tpot_ms": r.predicted_tpot_ms,
        "queue_wait_ms": r.queue_wait_ms,
    }


def report_to_dict(report: BenchReport, results: Sequence[RequestResult] | None = None) -> dict[str, Any]:
    """Every figure of ``report`` (and, when given, every request) as a JSON-ready mapping."""
    doc: dict[str, Any] = {
        "duration_s": report.duration_s,
        "meta": dict(report.meta),
        "overall": report.overall.flat(),
        "classes": {c.name: c.flat() for c in report.classes},
    }
    if results is not None:
        doc["requests"] = [result_to_dict(r) for r in results]
    return doc


def write_json(path: str | Path, report: BenchReport, results: Sequence[RequestResult] | None = None) -> None:
    """Write :func:`report_to_dict` to ``path`` (indented, non-finite numbers refused)."""
    text = json.dumps(report_to_dict(report, results), indent=2, allow_nan=False)
    Path(path).write_text(text + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- PNG


def plot_report(path: str | Path, report: BenchReport, results: Sequence[RequestResult]) -> None:
    """A PNG with TTFT, TPOT and e2e CDFs per class (targets dashed) and attainment per class.

    Needs matplotlib (the ``plot`` extra); raises :class:`PlotUnavailableError` when it
    is missing. Uses the object API, so no global pyplot state is touched.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotUnavailableError(
            "--plot needs matplotlib: install it with `pip install 'slo-router[plot]'` "
            "(or `pip install matplotlib`), or drop --plot"
        ) from exc

    fig = Figure(figsize=(12, 8), layout="constrained")
    axes = fig.subplots(2, 2)
    names = [c.name for c in report.classes]
    colors = {name: f"C{i % 10}" for i, name in enumerate(names)}
    panels = (
        ("ttft_ms", "TTFT (ms)", axes[0][0]),
        ("tpot_ms", "mean TPOT (ms)", axes[0][1]),
        ("e2e_ms", "end-to-end (ms)", axes[1][0]),
    )
    for attr, label, ax in panels:
        shown: list[float] = []
        for cls in report.classes:
            values = np.sort(
                np.array(
                    [
                        getattr(r, attr)
                        for r in results
                        if r.class_name == cls.name and r.ok and getattr(r, attr) is not None
                    ],
                    dtype=np.float64,
                )
            )
            target = None if cls.slo is None else getattr(cls.slo, attr)
            if values.size:
                ax.step(
                    values,
                    np.arange(1, values.size + 1) / values.size,
                    where="post",
                    color=colors[cls.name],
                    label=cls.name,
                )
                shown.extend((float(values[0]), float(values[-1])))
            if target is not None:
                ax.axvline(target, color=colors[cls.name], linestyle="--", linewidth=1)
                shown.append(float(target))
        if shown and min(shown) > 0 and max(shown) / min(shown) > 100:
            ax.set_xscale("log")  # long tails or far targets: keep the body of the curves readable
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0.0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower right")
    ax = axes[1][1]
    groups = [*report.classes, report.overall]
    bars = ax.bar(
        [g.name for g in groups],
        [100.0 * g.slo_attainment for g in groups],
        color=[colors.get(g.name, "0.4") for g in groups],
    )
    ax.bar_label(bars, labels=[f"{100.0 * g.slo_attainment:.1f}%" for g in groups], padding=2)
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0.0, 110.0)
    ax.grid(axis="y", alpha=0.3)
    title = report.meta.get("title")
    fig.suptitle(str(title) if title else "slo-router bench")
    fig.savefig(str(path), format="png", dpi=100)
