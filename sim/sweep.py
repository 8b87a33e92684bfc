"""Policy × rate sweeps of the virtual-time simulator, and how they are reported (table, JSON, PNG).

For each rate the workload's plan is generated once (same seed), and every
policy replays that same plan on a fresh copy of the fleet, so policies are
compared on identical requests. Each run is summarised with
:func:`workload.report.summarize`, the function ``slo-router bench`` uses, over the
run's virtual makespan (first arrival to last token).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from router.core.config import SchedulerConfig
from router.core.dispatchers import reads_qlm_config
from router.core.qlm import QlmConfig
from router.core.queue import Objective, QueueConfig
from router.core.worker_count import Desired
from sim.cluster import SimFleet, SimOutcome, SimStats, simulate
from sim.fleet import fleet_to_dict
from workload.prediction import prediction_error
from workload.report import BenchReport, PlotUnavailableError, RequestResult, slo_met, summarize
from workload.sequence import request_sequence, shape_arrivals
from workload.spec import RequestPlan, WorkloadSpec, workload_to_dict

#: The spelling of the ``slo`` policy with adaptive PD (``--enable-adaptive-pd``) in policy lists.
SLO_ADAPTIVE_PD = "slo+adaptive-pd"


@dataclass(frozen=True)
class PolicyChoice:
    """One policy of a sweep: the label it is reported under and the scheduler config that builds it."""

    label: str
    config: SchedulerConfig


@dataclass(frozen=True)
class SweepPoint:
    """One (policy, rate) run of a sweep."""

    policy: str
    rate: float
    report: BenchReport
    stats: SimStats
    wall_s: float
    #: The router's online calibration in this run (off, scale, refit).
    calibration: str = "off"
    #: :func:`workload.prediction.prediction_error` of the run (after the warm-up).
    prediction_error: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: Whether the sweep compared calibrations (the label then names this one).
    compare_calibrations: bool = False
    queue_policy: str = "none"
    #: Router-queue and G figures, overall and per class (:func:`queue_figures`).
    queue: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: The fleet's prefix-cache hit rate (None: no prefix caching in the run).
    cache_hit_rate: float | None = None
    #: ``slo_router_desired_instances`` as the router would export it at the run's last arrival.
    desired: Desired | None = None

    @property
    def label(self) -> str:
        """The policy, and the calibration when a sweep compares several."""
        return f"{self.policy} [{self.calibration}]" if self.compare_calibrations else self.policy


def policy_overrides(name: str) -> dict[str, Any]:
    """The :class:`SchedulerConfig` fields that select policy ``name``.

    ``name`` is a registered policy, :data:`SLO_ADAPTIVE_PD`, or a ``.yaml``/``.yml``
    policy file (``--policy-config``).
    """
    if name == SLO_ADAPTIVE_PD:
        return {"scheduling_policy": "slo", "enable_adaptive_pd": True, "policy_config_path": None}
    if Path(name).suffix.lower() in (".yaml", ".yml"):
        return {"enable_adaptive_pd": False, "policy_config_path": name}
    return {"scheduling_policy": name, "enable_adaptive_pd": False, "policy_config_path": None}


def open_loop(spec: WorkloadSpec, burstiness: float | None = None) -> WorkloadSpec:
    """``spec`` with an open-loop arrival process (closed loop becomes Poisson; ``burstiness`` applies gamma).

    The rule is :func:`workload.sequence.shape_arrivals`, the one ``slo-router bench`` applies to its flags.
    """
    return shape_arrivals(spec, burstiness=burstiness, open_loop=True)


def run_sweep(
    fleet: SimFleet,
    workload: WorkloadSpec,
    policies: Sequence[PolicyChoice],
    rates: Sequence[float],
    *,
    num_requests: int,
    seed: int = 0,
    on_run: Callable[[SweepPoint, int, int], None] | None = None,
    calibrations: Sequence[str] | None = None,
    warmup_requests: int = 0,
    queues: Sequence[QueueConfig] = (QueueConfig(queue_policy="none"),),
    qlm: Sequence[QlmConfig] = (QlmConfig(),),
    oracle_lengths: bool = False,
    plans_for: Callable[[WorkloadSpec, float], list[RequestPlan]] | None = None,
    measure_from: int = 0,
) -> list[SweepPoint]:
    """Every (rate, policy, calibration, queue policy) run, rate-major; ``on_run(point, done, total)``
    after each one.

    ``calibrations`` (default: each policy's own ``calibration``) runs every
    policy once per calibration mode; ``warmup_requests`` leaves the first
    requests of each run out of its prediction error; ``queues`` runs each
    of those once per router-queue configuration, and a ``qlm`` queue once per
    ``qlm`` configuration (labelled ``qlm``, or ``qlm-noevict`` with eviction off).
    ``oracle_lengths`` hands the policies true output lengths (an ablation: every policy label
    then ends in ``/oracle``). ``plans_for(spec, rate)`` makes each rate's plan (``slo-router simulate``
    passes :func:`sim.cli.run_plans`); by default it is
    :func:`workload.sequence.request_sequence` of ``workload`` with ``num_requests`` and ``seed``.
    ``measure_from``: every figure of a run is over its requests from that plan index on (the
    ones before run and warm the engines' caches, and are left out: :func:`measured_part`).
    """
    if not workload.arrival.open_loop:
        raise ValueError("the simulator replays open-loop arrivals; convert the workload with open_loop()")
    points: list[SweepPoint] = []
    modes: Sequence[str | None] = list(calibrations) if calibrations else [None]
    runs: list[tuple[QueueConfig, QlmConfig | None, str]] = []
    for queue in queues:
        if reads_qlm_config(queue.queue_policy):
            runs.extend((queue, q, qlm_label(q)) for q in qlm)
        else:
            # Labelled "edf+g" and the like under --queue-objective g.
            suffix = "+g" if queue.objective is Objective.G else ""
            runs.append((queue, None, queue.queue_policy + suffix))
    total = len(policies) * len(rates) * len(modes) * len(runs)
    for rate in rates:
        spec = workload.with_arrival(rate_per_s=rate)
        if plans_for is None:
            plans = request_sequence(workload, seed=seed, num_requests=num_requests, rate=rate)
        else:
            plans = plans_for(spec, rate)
        for policy in policies:
            for mode in modes:
                config = (
                    policy.config if mode is None else dataclasses.replace(policy.config, calibration=mode)
                )
                for queue, qlm_config, label in runs:
                    outcome = simulate(
                        fleet,
                        config,
                        plans,
                        seed=seed,
                        queue=queue,
                        qlm=qlm_config,
                        oracle_lengths=oracle_lengths,
                    )
                    point = _point(
                        policy.label + ("/oracle" if oracle_lengths else ""),
                        rate,
                        spec,
                        outcome,
                        config.calibration,
                        warmup_requests,
                        label,
                        measure_from,
                    )
                    if len(modes) > 1:
                        point = dataclasses.replace(point, compare_calibrations=True)
                    points.append(point)
                    if on_run is not None:
                        on_run(point, len(points), total)
    return points


def qlm_label(config: QlmConfig) -> str:
    """How a ``qlm`` run is named in tables: ``qlm``, or ``qlm-noevict`` with eviction off."""
    return "qlm" if config.eviction == "on" else "qlm-noevict"


def _point(
    policy: str,
    rate: float,
    spec: WorkloadSpec,
    outcome: SimOutcome,
    calibration: str = "off",
    warmup_requests: int = 0,
    queue_policy: str = "none",
    measure_from: int = 0,
) -> SweepPoint:
    error = prediction_error(outcome.results, skip_first=max(warmup_requests, measure_from))
    outcome = measured_part(outcome, measure_from)
    report = summarize(outcome.results, outcome.duration_s, class_slos=spec.class_slos())
    return SweepPoint(
        policy=policy,
        rate=rate,
        report=report,
        stats=outcome.stats,
        wall_s=outcome.wall_s,
        calibration=calibration,
        prediction_error=error,
        queue_policy=queue_policy,
        queue=queue_figures(outcome, report.duration_s, spec.class_names()),
        cache_hit_rate=getattr(outcome, "cache_hit_rate", None),
        desired=getattr(outcome, "desired", None),
    )


def measured_part(outcome: SimOutcome, first: int) -> SimOutcome:
    """``outcome`` restricted to its requests from plan index ``first`` on: their results, refusals,
    router-queue waits and prefix-cache lookups (the hit rate over their prompts), and the time from the first
    one's arrival to the end of the run. A warm-up: the requests before ``first`` filled the engines'
    caches (and the router's index) as a running fleet's would be, and are not counted."""
    if first <= 0:
        return outcome
    results = outcome.results[first:]
    start = results[0].start_s if results else outcome.duration_s
    hit_rate = outcome.cache_hit_rate
    if hit_rate is not None and outcome.cache_tokens:
        lookups = outcome.cache_tokens[first:]
        queried = sum(q for q, _ in lookups)
        hit_rate = sum(h for _, h in lookups) / queried if queried else 0.0
    stats = outcome.stats
    if outcome.refused:
        stats = dataclasses.replace(stats, rejected=sum(outcome.refused[first:]))
    return dataclasses.replace(
        outcome,
        stats=stats,
        refused=outcome.refused[first:],
        results=results,
        duration_s=max(outcome.duration_s - start, 0.0),
        queue_wait_ms=outcome.queue_wait_ms[first:],
        late=outcome.late[first:],
        cache_hit_rate=hit_rate,
        cache_tokens=outcome.cache_tokens[first:],
    )


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[k]


def _figures(rows: Sequence[tuple[RequestResult, float, bool]], duration_s: float) -> dict[str, Any]:
    n = len(rows)
    met = sum(1 for r, _, _ in rows if slo_met(r))
    # Every request's e2e counts in G's denominator (seed 000, eq. 3): a refused one adds the
    # time until its refusal, so refusing is cheap for G; read it beside attainment.
    latency_s = sum((r.e2e_ms or 0.0) for r, _, _ in rows) * 1e-3
    ok = [r.e2e_ms for r, _, _ in rows if r.ok and r.e2e_ms is not None]
    waits = [w for r, w, _ in rows if r.ok]
    return {
        "requests": n,
        "slo_attainment": met / n if n else 0.0,
        "goodput_rps": met / duration_s if duration_s > 0 else 0.0,
        "rejected": sum(1 for r, _, _ in rows if not r.ok),
        "late": sum(1 for _, _, late in rows if late),
        "queue_wait_ms": {"p50": _percentile(waits, 0.5), "p99": _percentile(waits, 0.99)},
        "mean_latency_ms": sum(ok) / len(ok) if ok else 0.0,
        "g": met / latency_s if latency_s > 0 else 0.0,
    }


def queue_figures(outcome: SimOutcome, duration_s: float, classes: Sequence[str] = ()) -> dict[str, Any]:
    """Attainment, goodput, refusals, late dispatches, queue waits (p50/p99 of served requests), mean
    latency of served requests and G (SLO-meeting requests per second of summed e2e latency, over
    every request), overall and in ``by_class``."""
    # Outcomes of runs without a router queue (e.g. slice dispatch) carry no waits: all zero.
    waits = getattr(outcome, "queue_wait_ms", ()) or (0.0,) * len(outcome.results)
    late = getattr(outcome, "late", ()) or (False,) * len(outcome.results)
    rows = list(zip(outcome.results, waits, late, strict=True))
    figures = _figures(rows, duration_s)
    names = list(dict.fromkeys([*classes, *(r.class_name for r in outcome.results)]))
    figures["by_class"] = {
        name: _figures([row for row in rows if row[0].class_name == name], duration_s) for name in names
    }
    return figures


# --------------------------------------------------------------------------- JSON


def point_to_dict(point: SweepPoint) -> dict[str, Any]:
    """One run's figures: ``policy``, ``rate``, ``slo_attainment`` (0-1), ``goodput`` (req/s), latencies, ...

    Every key of :meth:`workload.report.ClassReport.flat` for all requests, plus
    ``queue_policy`` (with ``+g`` under ``--queue-objective g``), ``rejected`` (refused: no placement, shed, expired or late
    with ``--late-policy reject``), ``duration_s`` (virtual makespan), ``preemptions``
    (engine preemptions, all instances), ``preemption_recompute_tokens`` (what the preempted requests re-prefilled,
    less their prefix-cache hits), ``mean_busy_instances`` (``{"prefill", "decode",
    "neutral"}``: time-average number of instances holding work of that kind, see
    :class:`sim.cluster.SimStats`), ``calibration`` (the router's online calibration mode),
    ``prediction_error`` (:func:`workload.prediction.prediction_error` after the warm-up), ``classes``
    (the same figures per SLO class), ``sim`` (step and event counts) and :func:`queue_figures`'
    ``late``, ``queue_wait_ms`` (p50/p99), ``mean_latency_ms``, ``g`` and ``by_class``. No
    wall-clock figure: the document is a pure function of the inputs.
    """
    overall = point.report.overall.flat()
    del overall["name"]
    for key in ("ttft_slo_ms", "tpot_slo_ms", "e2e_slo_ms"):
        del overall[key]
    doc: dict[str, Any] = {
        "policy": point.policy,
        "queue_policy": point.queue_policy,
        "rate": point.rate,
        "slo_attainment": overall.pop("slo_attainment"),
        "goodput": point.report.overall.goodput_rps,
        "ttft_p99_ms": overall.pop("ttft_p99_ms"),
        "tpot_p99_ms": overall.pop("tpot_p99_ms"),
        "rejected": point.stats.rejected,
        "duration_s": point.report.duration_s,
        "preemptions": point.stats.preemptions,
        "preemption_recompute_tokens": point.stats.preemption_recompute_tokens,
        "mean_busy_instances": {
            "prefill": point.stats.mean_busy_prefill,
            "decode": point.stats.mean_busy_decode,
            "neutral": point.stats.mean_busy_neutral,
        },
    }
    doc.update(overall)
    doc["calibration"] = point.calibration
    doc["cache_hit_rate"] = point.cache_hit_rate
    if point.desired is not None:
        doc["desired_instances"] = dataclasses.asdict(point.desired)
    doc["prediction_error"] = dict(point.prediction_error)
    for key in ("late", "queue_wait_ms", "mean_latency_ms", "g", "by_class"):
        if key in point.queue:
            doc[key] = point.queue[key]
    doc["goodput_rps"] = point.report.overall.goodput_rps
    doc["classes"] = {c.name: c.flat() for c in point.report.classes}
    doc["sim"] = dataclasses.asdict(point.stats)
    return doc


def sweep_to_dict(points: Sequence[SweepPoint], meta: Mapping[str, Any]) -> dict[str, Any]:
    """The ``--output`` document: ``meta`` and a ``results`` list, one entry per (policy, rate), rate-major."""
    return {"meta": dict(meta), "results": [point_to_dict(p) for p in points]}


def sweep_meta(
    fleet: SimFleet,
    workload: WorkloadSpec,
    policies: Sequence[PolicyChoice],
    rates: Sequence[float],
    *,
    num_requests: int,
    seed: int,
) -> dict[str, Any]:
    """What a sweep ran: fleet, workload, policies (with their scheduler configs), rates, size, seed."""
    return {
        "command": "simulate",
        "seed": seed,
        "num_requests": num_requests,
        "rates": list(rates),
        "policies": [p.label for p in policies],
        "fleet": fleet.spec.describe(),
        "fleet_spec": fleet_to_dict(fleet.spec),
        "workload": workload_to_dict(workload),
        "scheduler": {p.label: _json_safe(dataclasses.asdict(p.config)) for p in policies},
    }


def _json_safe(values: Mapping[str, Any]) -> dict[str, Any]:
    """Non-finite floats (e.g. ``instance_staleness_s=inf``: never stale) as strings, which JSON can hold."""
    return {k: str(v) if isinstance(v, float) and not math.isfinite(v) else v for k, v in values.items()}


def write_sweep_json(path: str | Path, points: Sequence[SweepPoint], meta: Mapping[str, Any]) -> None:
    """Write :func:`sweep_to_dict` (indented; non-finite numbers refused)."""
    text = json.dumps(sweep_to_dict(points, meta), indent=2, allow_nan=False)
    Path(path).write_text(text + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- text


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100.0 * value:.1f}%"


def _ms(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def format_sweep_table(points: Sequence[SweepPoint]) -> str:
    """A fixed-width comparison: one row per (rate, policy), attainment per class when there are several."""
    if not points:
        return "(no runs)"
    class_names = [c.name for c in points[0].report.classes]
    per_class = len(class_names) > 1
    header = ["rate/s", "policy", "queue", "reqs", "rejected", "late", "errors", "attain"]
    if per_class:
        header += [f"{name}" for name in class_names]
    header += ["goodput/s", "G", "wait p99", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "E2E p99"]
    caching = any(p.cache_hit_rate is not None for p in points)
    if caching:
        header.append("hit rate")
    rows = [header]
    for p in points:
        o = p.report.overall
        row = [
            f"{p.rate:g}",
            p.label,
            p.queue_policy,
            str(o.requests),
            str(p.stats.rejected),
            str(p.queue.get("late", 0)),
            str(o.errors),
            _pct(o.slo_attainment),
        ]
        if per_class:
            by_class = p.report.by_class()
            row += [
                _pct(by_class[name].slo_attainment if by_class[name].requests else None)
                for name in class_names
            ]
        row += [
            f"{o.goodput_rps:.2f}",
            f"{p.queue.get('g', 0.0):.3f}",
            _ms(p.queue.get("queue_wait_ms", {}).get("p99")),
            _ms(o.ttft.p50_ms),
            _ms(o.ttft.p99_ms),
            _ms(o.tpot.p50_ms),
            _ms(o.tpot.p99_ms),
            _ms(o.e2e.p99_ms),
        ]
        if caching:
            row.append(_pct(p.cache_hit_rate))
        rows.append(row)
    widths = [max(len(r[k]) for r in rows) for k in range(len(header))]
    lines = []
    for n, row in enumerate(rows):
        if n >= 2 and points[n - 1].rate != points[n - 2].rate:
            lines.append("")  # a blank line between rates
        cells = [
            c.ljust(w) if k in (1, 2) else c.rjust(w)
            for k, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    lines.append("")
    lines.append(
        "attain: share of requests meeting every target of their class (rejected ones miss); "
        "goodput: such requests per virtual second; G: such requests per second of summed e2e latency; "
        "late: dispatched from the router queue after their TTFT target was out of reach; "
        "latencies (and queue wait) in ms over completed requests"
        + ("; hit rate: prompt tokens the engines found in their prefix caches" if caching else "")
    )
    return "\n".join(lines)


def format_prediction_table(points: Sequence[SweepPoint]) -> str:
    """Prediction error beside attainment: one row per run (relative error |obs - pred| / pred)."""
    header = ["rate/s", "policy", "attain", "TTFT err p50", "p90", "bias", "TPOT err p50", "p90", "bias"]
    rows = [header]
    for p in points:
        row = [f"{p.rate:g}", _label(p), _pct(p.report.overall.slo_attainment)]
        for key in ("ttft", "tpot"):
            s = p.prediction_error.get(key, {})
            row += [_pct(s.get("median")), _pct(s.get("p90")), _pct(s.get("bias"))]
        rows.append(row)
    widths = [max(len(r[k]) for r in rows) for k in range(len(header))]
    lines = [
        "  ".join(
            c.ljust(w) if k == 1 else c.rjust(w) for k, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    skipped = points[0].prediction_error.get("skipped", 0) if points else 0
    lines.append(
        f"prediction error over successful requests after the first {skipped} (warm-up); "
        "bias > 0: slower than predicted"
    )
    return "\n".join(lines)


def format_desired_table(points: Sequence[SweepPoint], pd: bool) -> str:
    """Per run: ``slo_router_desired_instances`` at its last arrival (what an autoscaler would read)."""
    rows = [p for p in points if p.desired is not None]
    if not rows:
        return ""
    head = "prefill  decode" if pd else "neutral"
    lines = [f"rate/s  policy{'':14}  {head}  from"]
    for p in rows:
        d = p.desired
        assert d is not None
        counts = f"{d.prefill:>7}  {d.decode:>6}" if pd else f"{d.neutral:>7}"
        source = (
            f"Eq. 7 over {d.heartbeats} heartbeats"
            if d.fitted
            else "the last window's heartbeats pooled (or its fluid demand)"
        )
        lines.append(f"{p.rate:>6g}  {_label(p):<20}  {counts}  {source}")
    lines.append(
        "slo_router_desired_instances at the last arrival: Aladdin's Eq. 7 fitted online over 10 s "
        "heartbeats of the placed load (router/core/worker_count.py)"
    )
    return "\n".join(lines)


# --------------------------------------------------------------------------- PNG


def _label(point: SweepPoint) -> str:
    return point.label if point.queue_policy == "none" else f"{point.label}+{point.queue_policy}"


def plot_sweep(path: str | Path, points: Sequence[SweepPoint], title: str = "slo-router simulate") -> None:
    """A PNG with SLO attainment and goodput against the arrival rate, one line per policy.

    Needs matplotlib (the ``plot`` extra); raises :class:`PlotUnavailableError` when it is missing.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotUnavailableError(
            "--plot needs matplotlib: install it with `pip install 'slo-router[plot]'` "
            "(or `pip install matplotlib`), or drop --plot"
        ) from exc
    fig = Figure(figsize=(12, 4.8), layout="constrained")
    attain_ax, goodput_ax = fig.subplots(1, 2)
    policies = list(dict.fromkeys(_label(p) for p in points))
    for k, policy in enumerate(policies):
        mine = sorted((p for p in points if _label(p) == policy), key=lambda p: p.rate)
        rates = [p.rate for p in mine]
        style = {"marker": "o", "color": f"C{k % 10}", "label": policy}
        attain_ax.plot(rates, [100.0 * p.report.overall.slo_attainment for p in mine], **style)
        goodput_ax.plot(rates, [p.report.overall.goodput_rps for p in mine], **style)
    attain_ax.set_ylabel("SLO attainment (%)")
    attain_ax.set_ylim(0.0, 102.0)
    goodput_ax.set_ylabel("goodput (requests/s meeting their SLO)")
    goodput_ax.set_ylim(bottom=0.0)
    for ax in (attain_ax, goodput_ax):
        ax.set_xlabel("arrival rate (requests/s)")
        ax.grid(alpha=0.3)
        ax.legend(loc="best")
    fig.suptitle(title)
    fig.savefig(str(path), format="png", dpi=100)
