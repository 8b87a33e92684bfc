"""Slice-level dispatch in virtual time, and sweeps comparing it with request-level dispatch.

``simulate --dispatch-modes request,slice`` runs every rate twice over the same
plan: ``request`` is :func:`sim.cluster.simulate` (each ``--policies`` entry
places each whole request at its arrival), ``slice`` is :func:`simulate_slices`:
the same virtual-time driver (:func:`sim.cluster.simulate`) over the ``slice``
dispatcher (:mod:`router.core.slice_dispatch`, the object the router runs under
``--dispatch-mode slice``):

- the dispatcher keeps the pool, the schedule points (the timer it asks for:
  adaptive unless ``--slice-interval-ms`` fixes it), the batching, the max-min
  offload into per-instance local queues and the admission as each
  instance's planned KV leaves room;
- each of its placements carries a cap: the driver adds the slice to its
  instance's :class:`engine.model.SimCore` with ``max_new_tokens`` at the cap
  (the engine stops earlier at the answer's true end);
- a run that ends at its cap with output left is the lifecycle's pause: the
  dispatcher hears :class:`~router.core.dispatch.Paused` and places the next
  slice (at once, or at the next schedule point), which prefills the prompt
  and the tokens so far again (what ``recomputed_tokens`` counts; a slice
  resumed at once on the instance it left finds its full blocks in that
  engine's prefix cache when ``SliceConfig.prefix_cache`` says engines keep them);
  a slice the dispatcher continues where it ran (``continue_in_place``: the
  router lets the leg run on) goes on there as a decode, nothing recomputed.

Figures beyond :func:`workload.report.summarize`: ``load_imbalance`` is the
coefficient of variation (population std / mean) of per-instance busy time,
the time an instance's engine had work; ``completion_spread_s`` the standard
deviation of the instances' last busy moment (the seed paper's
load-balance figure); ``recomputed_tokens`` the context tokens re-prefilled
when slices resume (engine preemptions, in either mode, are counted apart in
``sim.preemptions``); ``resume_gap_p99_ms`` the 99th percentile of the time
from a slice's last token to the next slice's first token of the same
request (what a client sees as a stall mid-stream).

Scope: neutral fleets (a slice is a whole prefill-plus-decode on one
instance). Each instance is priced with its own estimators (its profile
group's predictor and its engine's limits), as in the router.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fleet.flags import error_line
from router.core.auto_dispatch import AUTO_PILOT_REQUESTS as AUTO_PILOT_REQUESTS
from router.core.auto_dispatch import Auto
from router.core.config import SchedulerConfig
from router.core.request import Role
from router.core.slicing import (
    SliceConfig,
    add_slice_arguments,
    slice_config_of,
)
from sim.cluster import SimFleet, SimOutcome, SimStats, simulate
from sim.sweep import PolicyChoice, SweepPoint, _point, point_to_dict, sweep_meta
from workload.report import RequestResult
from workload.sequence import request_sequence
from workload.spec import RequestPlan, WorkloadSpec

#: Dispatch modes of ``simulate --dispatch-modes``.
DISPATCH_MODES = ("request", "slice", "auto")
#: The policy label slice-dispatch results carry (its offloader, not a registered policy).
SLICE_POLICY = "max-min"


@dataclass(frozen=True)
class SliceFigures:
    """What a run adds to the bench report: balance and slicing overheads."""

    busy_s: tuple[float, ...]
    completion_s: tuple[float, ...]
    recomputed_tokens: int
    slices: int
    batches: int
    schedule_points: int
    resume_gap_p99_ms: float | None

    @property
    def load_imbalance(self) -> float:
        """Coefficient of variation of per-instance busy time (0 = perfectly even)."""
        busy = np.asarray(self.busy_s)
        mean = float(busy.mean()) if busy.size else 0.0
        return float(busy.std() / mean) if mean > 0 else 0.0

    @property
    def completion_spread_s(self) -> float:
        return float(np.std(self.completion_s)) if self.completion_s else 0.0


@dataclass(frozen=True)
class SliceOutcome:
    results: tuple[RequestResult, ...]
    duration_s: float
    stats: SimStats
    figures: SliceFigures
    wall_s: float
    #: The dispatcher's counts (slices, batches, resumed, moved, shortened, waited, ...).
    counters: dict[str, int] = dataclasses.field(default_factory=dict)


def simulate_slices(
    fleet: SimFleet,
    plans: Sequence[RequestPlan],
    config: SliceConfig,
    *,
    seed: int = 0,
    engine_prefix_cache: bool = True,
) -> SliceOutcome:
    """Run ``plans`` (in arrival order) on a neutral ``fleet`` with slice-level dispatch.

    The simulator's one virtual-time driver (:func:`sim.cluster.simulate`) over the ``slice``
    dispatcher: each placement is capped at its slice, a run that ends at its cap is paused and
    resumed where the dispatcher places the next slice. The engines keep a paused slice's blocks in
    their prefix cache when ``config.prefix_cache`` says so, and, with ``engine_prefix_cache`` (the
    default), every prompt's blocks by the plans' hash ids. The router's calibration is off (the
    dispatcher fits its own estimators online).
    """
    if any(role is not Role.NEUTRAL for role in fleet.roles):
        raise ValueError("slice dispatch runs on neutral instances: use --neutral K (or a neutral --fleet)")
    outcome = simulate(
        fleet,
        SchedulerConfig(calibration="off"),
        plans,
        seed=seed,
        slicing=config,
        resume_cache=config.prefix_cache,
        # The engines cache prompt blocks by the plans' hash ids, as under request dispatch and `auto`
        # (vLLM's automatic prefix caching is on by default). Only workloads with shared prefixes (the
        # Mooncake trace, classes with prefix_groups) see it; without it slices were judged on such a
        # workload against request dispatch with a cache they lacked (docs/papers.md, Seed 002, 3 Dec).
        engine_prefix_cache=engine_prefix_cache,
    )
    return _slice_outcome(outcome)


def simulate_auto(
    fleet: SimFleet, policy: PolicyChoice, plans: Sequence[RequestPlan], config: SliceConfig, *, seed: int = 0
) -> tuple[str, SliceOutcome]:
    """``auto`` as the router runs it (:mod:`router.core.auto_dispatch`), over one run of ``plans``.

    Request dispatch with ``policy`` until the engines' preemption counts over the first
    :data:`AUTO_PILOT_REQUESTS` requests decide; slices (``config``) for every arrival after, if
    slices pay. Returns the mode chosen (``request`` when the run ended before the pilot did) and
    the run's outcome.
    """
    if any(role is not Role.NEUTRAL for role in fleet.roles):
        raise ValueError("auto dispatch runs on neutral instances: use --neutral K (or a neutral --fleet)")
    outcome = simulate(
        fleet,
        policy.config,
        plans,
        seed=seed,
        slicing=config,
        resume_cache=config.prefix_cache,
        dispatch_mode=Auto.name,
    )
    mode = "slice" if outcome.counters.get("auto_slice", 0) else "request"
    return mode, _slice_outcome(outcome, batches_are_decisions=False)


def _slice_outcome(outcome: SimOutcome, *, batches_are_decisions: bool = True) -> SliceOutcome:
    gaps = outcome.resume_gaps_ms
    counters = outcome.counters
    figures = SliceFigures(
        busy_s=outcome.busy_s,
        completion_s=outcome.last_busy_s,
        recomputed_tokens=outcome.recomputed_tokens,
        slices=counters.get("slices", 0),
        batches=counters.get("batches", 0),
        schedule_points=counters.get("schedule_points", 0),
        resume_gap_p99_ms=float(np.percentile(gaps, 99)) if gaps else None,
    )
    # A slice placement is a health check on the instance the offloader chose; the decisions a
    # report counts are the batcher's.
    stats = outcome.stats
    if batches_are_decisions:
        stats = dataclasses.replace(stats, decisions=counters.get("batches", 0))
    return SliceOutcome(outcome.results, outcome.duration_s, stats, figures, outcome.wall_s, dict(counters))


def request_figures(fleet: SimFleet, results: Sequence[RequestResult]) -> SliceFigures:
    """Busy time and completion per instance of a request-level run, from its results.

    An engine steps back to back while it holds a request, so an instance is
    busy exactly over the union of its requests' service intervals (arrival to
    last token: dispatch is instantaneous in the simulator).
    """
    spans: dict[str, list[tuple[float, float]]] = {i: [] for i in fleet.ids}
    for r in results:
        if r.prefill_instance_id in spans and r.e2e_ms is not None and r.ok:
            spans[r.prefill_instance_id].append((r.start_s, r.start_s + r.e2e_ms * 1e-3))
    busy, done = [], []
    for instance in fleet.ids:
        total, end = 0.0, -math.inf
        for a, b in sorted(spans[instance]):
            if b <= end:
                continue
            total += b - max(a, end)
            end = b
        busy.append(total)
        done.append(max(end, 0.0))
    return SliceFigures(tuple(busy), tuple(done), 0, 0, 0, 0, None)


# --------------------------------------------------------------------------- sweeps


@dataclass(frozen=True)
class DispatchPoint:
    """One (dispatch mode, policy, rate) run."""

    mode: str
    point: SweepPoint
    figures: SliceFigures


def parse_dispatch_modes(text: str) -> list[str]:
    modes: list[str] = []
    for raw in text.split(","):
        mode = raw.strip()
        if mode not in DISPATCH_MODES:
            raise ValueError(f"--dispatch-modes: {mode!r} is not one of {', '.join(DISPATCH_MODES)}")
        if mode in modes:
            raise ValueError(f"--dispatch-modes: {mode!r} is listed twice")
        modes.append(mode)
    return modes


def run_dispatch_sweep(
    fleet: SimFleet,
    workload: WorkloadSpec,
    policies: Sequence[PolicyChoice],
    rates: Sequence[float],
    modes: Sequence[str],
    slice_config: SliceConfig,
    *,
    num_requests: int,
    seed: int = 0,
    on_run: Callable[[SweepPoint, int, int], None] | None = None,
    plans_for: Callable[[WorkloadSpec, float], list[RequestPlan]] | None = None,
) -> list[DispatchPoint]:
    """Rate-major runs: per rate, every policy in ``request`` mode, then one ``slice`` run (max-min),
    then every policy under ``auto`` (:func:`simulate_auto`), in the order ``modes`` lists them.

    ``plans_for(spec, rate)`` makes each rate's plan (a trace replay) instead of drawing it.
    """
    if not workload.arrival.open_loop:
        raise ValueError("the simulator replays open-loop arrivals; convert the workload with open_loop()")
    if ("slice" in modes or "auto" in modes) and any(role is not Role.NEUTRAL for role in fleet.roles):
        raise ValueError("--dispatch-modes slice needs a neutral fleet: use --neutral K")
    out: list[DispatchPoint] = []
    total = len(rates) * (
        len(policies) * ("request" in modes) + ("slice" in modes) + len(policies) * ("auto" in modes)
    )
    for rate in rates:
        spec = workload.with_arrival(rate_per_s=rate)
        if plans_for is None:
            plans = request_sequence(workload, seed=seed, num_requests=num_requests, rate=rate)
        else:
            plans = plans_for(spec, rate)
        for mode in modes:
            if mode == "request":
                for policy in policies:
                    outcome = simulate(fleet, policy.config, plans, seed=seed)
                    point = _point(policy.label, rate, spec, outcome)
                    out.append(DispatchPoint(mode, point, request_figures(fleet, outcome.results)))
                    if on_run is not None:
                        on_run(point, len(out), total)
            elif mode == "slice":
                sliced = simulate_slices(fleet, plans, slice_config, seed=seed)
                point = _point(SLICE_POLICY, rate, spec, sliced)  # type: ignore[arg-type]
                out.append(DispatchPoint(mode, point, sliced.figures))
                if on_run is not None:
                    on_run(point, len(out), total)
            else:
                for policy in policies:
                    chosen, auto = simulate_auto(fleet, policy, plans, slice_config, seed=seed)
                    point = _point(f"{policy.label}/auto:{chosen}", rate, spec, auto)  # type: ignore[arg-type]
                    figures = auto.figures
                    if chosen == "request":
                        # Busy time from the results, as request dispatch's own rows count it.
                        figures = dataclasses.replace(request_figures(fleet, auto.results), slices=0)
                    out.append(DispatchPoint(mode, point, figures))
                    if on_run is not None:
                        on_run(point, len(out), total)
    return out


def dispatch_point_to_dict(p: DispatchPoint) -> dict[str, Any]:
    """:func:`sim.sweep.point_to_dict` plus ``dispatch_mode``, ``load_imbalance``, ``recomputed_tokens``, ..."""
    doc = point_to_dict(p.point)
    f = p.figures
    doc.update(
        {
            "dispatch_mode": p.mode,
            "throughput_rps": p.point.report.overall.throughput_rps,
            "load_imbalance": f.load_imbalance,
            "completion_spread_s": f.completion_spread_s,
            "recomputed_tokens": f.recomputed_tokens,
            "slices": f.slices,
            "slice_batches": f.batches,
            "schedule_points": f.schedule_points,
            "resume_gap_p99_ms": f.resume_gap_p99_ms,
            "busy_s": list(f.busy_s),
        }
    )
    return doc


def _ms(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def format_dispatch_table(points: Sequence[DispatchPoint]) -> str:
    header = [
        "rate/s",
        "dispatch",
        "policy",
        "done",
        "thru/s",
        "E2E mean",
        "E2E p99",
        "TTFT p99",
        "imbalance",
        "CT std s",
        "recomputed",
        "stall p99",
        "preempt",
    ]
    rows = [header]
    for p in points:
        o = p.point.report.overall
        rows.append(
            [
                f"{p.point.rate:g}",
                p.mode,
                p.point.policy,
                str(o.completed),
                f"{o.throughput_rps:.2f}",
                _ms(o.e2e.mean_ms),
                _ms(o.e2e.p99_ms),
                _ms(o.ttft.p99_ms),
                f"{p.figures.load_imbalance:.3f}",
                f"{p.figures.completion_spread_s:.1f}",
                str(p.figures.recomputed_tokens),
                _ms(p.figures.resume_gap_p99_ms),
                str(p.point.stats.preemptions),
            ]
        )
    widths = [max(len(r[k]) for r in rows) for k in range(len(header))]
    lines = []
    for n, row in enumerate(rows):
        if n >= 2 and points[n - 1].point.rate != points[n - 2].point.rate:
            lines.append("")
        cells = [
            c.ljust(w) if k in (1, 2) else c.rjust(w)
            for k, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    lines.append("")
    lines.append(
        "thru/s: completed requests per virtual second (makespan); latencies in ms; imbalance: CV of "
        "per-instance busy time; CT std: std of instances' last busy moment; recomputed: context tokens "
        "re-prefilled when slices resume; stall p99: 99th percentile in ms of the time between a slice's last "
        "token and the next slice's first token of the same stream (request dispatch: -); preempt: engine "
        "preemptions"
    )
    return "\n".join(lines)


# --------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``simulate``'s dispatch flags (``--dispatch-modes``, ``--slice-tokens``, ``--slice-interval-ms``)."""
    group = parser.add_argument_group("dispatch (request-level or slice-level)")
    group.add_argument(
        "--dispatch-modes",
        metavar="M1,M2",
        help="compare dispatch modes: request (each --policies entry places whole requests), slice "
        "(requests placed S tokens at a time, batched and offloaded max-min; neutral fleets) and/or auto "
        "(the router's --dispatch-mode auto, in one run: each policy's request dispatch until the engines "
        "have preempted once per ten requests dispatched (at least 100), then slices for every later "
        "arrival; request dispatch throughout where the first 100 requests end under that. Where slices "
        "pay they hold the KV plan and do 1.0x-3x the work, 0.9x-1.0x with long answers, at a lower SLO "
        "attainment (a first slice waits); where the KV holds request dispatch wins on continuous-batching "
        "engines, 0.91-0.97x for slices; behind shared cached prefixes slices book each prefix once per "
        "instance, 1.0-1.6x, but 0.95x on the Mooncake conversations; auto reads preemptions only, so on "
        "unequal instances where request dispatch loses to imbalance it switches late or never: compare "
        "slice there); the row's policy says what auto chose; adds "
        "load_imbalance, recomputed_tokens, ... to the JSON",
    )
    add_slice_arguments(
        group,
        interval_help="slice mode: fixed time between schedule points (default: adaptive, "
        "max(0.5 x least instance load, 200 ms))",
    )
    group.add_argument(
        "--slice-one-batch-at-a-time",
        action="store_true",
        help="slice mode: an instance serves one batch at a time (the static-batching worker loop) "
        "instead of taking queued batches while its KV has room",
    )


def run_cli(
    args: argparse.Namespace,
    fleet: SimFleet,
    workload: WorkloadSpec,
    policies: Sequence[PolicyChoice],
    rates: Sequence[float],
    title: str,
    progress: Callable[[SweepPoint, int, int], None],
    *,
    plans_for: Callable[[WorkloadSpec, float], list[RequestPlan]] | None = None,
) -> int:
    """``simulate --dispatch-modes ...``: run, print the table, write ``--output``."""
    try:
        modes = parse_dispatch_modes(args.dispatch_modes)
        config = slice_config_of(
            args.slice_tokens, args.slice_interval_ms, overlap_batches=not args.slice_one_batch_at_a_time
        )
        if "slice" in modes and any(role is not Role.NEUTRAL for role in fleet.roles):
            raise ValueError("--dispatch-modes slice needs a neutral fleet: use --neutral K")
    except ValueError as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    try:
        points = run_dispatch_sweep(
            fleet,
            workload,
            policies,
            rates,
            modes,
            config,
            num_requests=args.num_requests,
            seed=args.seed,
            on_run=progress,
            plans_for=plans_for,
        )
    except KeyboardInterrupt:
        print("\ninterrupted; no report written", file=sys.stderr)
        return 130
    print(title + f"; slice {config.slice_tokens} tokens")
    print(format_dispatch_table(points))
    if args.output:
        meta = sweep_meta(fleet, workload, policies, rates, num_requests=args.num_requests, seed=args.seed)
        meta["dispatch_modes"] = modes
        meta["slice"] = dataclasses.asdict(config)
        doc = {"meta": meta, "results": [dispatch_point_to_dict(p) for p in points]}
        Path(args.output).write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n", encoding="utf-8")
        print(f"wrote {args.output}", file=sys.stderr)
    return 0
