"""``slo-router plan``: the fewest instances per role that meet an attainment target at a rate.

Two steps, after Aladdin's worker-count prediction (seed 001):

1. the capacity model the router's autoscaling signal comes from
   (``slo_router_desired_instances``: Aladdin's Eq. 7 fitted over heartbeats of
   the load, :class:`router.core.worker_count.DesiredInstances`) estimates the
   counts from the workload's requests and the profile;
2. the simulator (:mod:`sim.cluster`, the router's own scheduling core on the
   sim engine model, in virtual time) confirms and refines them: while the
   fleet misses the target, add one instance of the role whose addition helps
   most; then, while removing one instance of some role still meets the
   target, remove it; then, for a PD fleet, while a fleet one instance smaller
   of another split (two of one role traded for one of the other) meets the
   target, move there and shrink again. The answer therefore meets the target,
   and every fleet with one instance fewer of any role, or one fewer in all
   traded that way, misses it (in the same simulation). With ``--prefill N``
   the prefill side is held at N and only the decoders are searched (how
   Aladdin's split-phase evaluation compares placement policies). No searched
   fleet has fewer prefill (or neutral) instances than the scored requests'
   prompts keep busy at the fastest rate an instance computes them
   (:func:`prefill_floor`): below it a finite run can meet the target while a
   backlog grows that the rate, held, never drains.

Every run replays the same seeded plan of requests, so the search is
deterministic for a seed. A run asked only whether its fleet meets the target
stops once more scored requests have missed than the target allows (the grow
step of a two-role search compares attainments, so its runs go to the end).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.model import SimConfig
from fleet.flags import error_line
from predictor import LatencyPredictor, ProfileError
from router.core.capacity import InstanceEstimate, InstanceRates, LoadShape, instance_rates
from router.core.config import SchedulerConfig, name_flags
from router.core.errors import ConfigError
from router.core.policies import build_policy
from router.core.queue import QueueConfig
from router.core.worker_count import DesiredInstances, WorkerCountModel, samples_from_spans
from sim.cluster import SimFleet, simulate
from sim.fleet import DEFAULT_PROFILE, FleetError, fleet_from_counts
from sim.sweep import SLO_ADAPTIVE_PD, open_loop, policy_overrides
from workload.report import summarize
from workload.spec import (
    DEFAULT_WORKLOAD,
    RequestPlan,
    WorkloadError,
    WorkloadSpec,
    generate_requests,
    load_workload,
)
from workload.traces import add_trace_arguments, is_trace, load_trace, trace_options

DEFAULT_NUM_REQUESTS = 600
DEFAULT_MAX_INSTANCES = 64


class PlanError(ValueError):
    """The plan cannot be made as asked (bad input, or the target is out of reach)."""


@dataclass(frozen=True)
class PlanResult:
    """The planned fleet, how it was found, and every fleet the search simulated."""

    mode: str
    rate: float
    target: float
    prefill: int
    decode: int
    neutral: int
    attainment: float
    estimate: InstanceEstimate
    #: (prefill, decode, neutral) -> attainment of every simulated fleet (for a fleet whose run stopped
    #: once it had missed the target, the most it could have reached: below the target).
    tried: dict[tuple[int, int, int], float] = field(default_factory=dict)
    #: Aladdin's Eq. 7 fitted online over the planned fleet's run (binpack only): k5, c5, R, the
    #: workers it predicts at the rate, and the heartbeats it used.
    worker_model: dict[str, float] | None = None
    #: The fleets whose simulation stopped once they had missed the target (their ``tried`` value is
    #: a bound).
    stopped: frozenset[tuple[int, int, int]] = frozenset()

    def to_dict(self) -> dict[str, Any]:
        return {
            "prefill": self.prefill,
            "decode": self.decode,
            "neutral": self.neutral,
            "attainment": self.target,
            "rate": self.rate,
            "achieved_attainment": self.attainment,
            "mode": self.mode,
            "estimate": {
                "prefill": self.estimate.prefill if self.mode == "pd" else 0,
                "decode": self.estimate.decode if self.mode == "pd" else 0,
                "neutral": self.estimate.neutral if self.mode == "neutral" else 0,
            },
            "simulations": len(self.tried),
            "worker_model": self.worker_model,
        }


def load_shape(plans: list[RequestPlan], rate: float) -> LoadShape:
    """The mean lengths of a plan at ``rate``."""
    n = max(len(plans), 1)
    return LoadShape(
        rate=rate,
        mean_prompt_tokens=sum(p.prompt_tokens for p in plans) / n,
        mean_output_tokens=sum(p.true_output_tokens for p in plans) / n,
    )


def capacity_estimate(
    plans: list[RequestPlan],
    rate: float,
    config: SchedulerConfig,
    predictor: LatencyPredictor,
    engine: SimConfig,
) -> InstanceEstimate:
    """The search's starting point: the router's autoscaling signal for this workload.

    The same :class:`DesiredInstances` the router exports ``slo_router_desired_instances`` from
    (Aladdin's Eq. 7 fitted over heartbeats of the placed load), fed the plan's requests in arrival
    order with their output lengths as history (a planner's past traffic; the simulated router
    itself still learns them online), and read at ``rate``.
    """

    def rates(load: LoadShape, tpot_ms: float) -> InstanceRates:
        return instance_rates(
            predictor,
            mean_prompt_tokens=load.mean_prompt_tokens,
            mean_output_tokens=load.mean_output_tokens,
            tpot_target_ms=tpot_ms,
            kv_capacity_tokens=float(engine.kv_capacity_tokens),
            kv_headroom=config.kv_packing_headroom,
            chunk_tokens=engine.max_num_batched_tokens,
            max_batch=engine.max_num_seqs,
        )

    model = DesiredInstances(rates, default_tpot_ms=config.tpot_slo_ms, default_ttft_ms=config.ttft_slo_ms)
    for p in plans:
        model.observe(
            p.arrival_s,
            p.prompt_tokens,
            float(p.true_output_tokens),
            tpot_ms=p.slo.tpot_ms or 0.0,
            e2e_ms=p.slo.e2e_ms or 0.0,
            ttft_ms=p.slo.ttft_ms or 0.0,
        )
    shape = load_shape(plans, rate)
    want = model.desired(plans[-1].arrival_s if plans else 0.0, shape)
    fluid = rates(shape, config.tpot_slo_ms)
    return InstanceEstimate(
        prefill=want.prefill,
        decode=want.decode,
        neutral=want.neutral,
        decode_batch=fluid.decode_batch,
        decode_step_ms=fluid.decode_step_ms,
    )


def plan_fleet(
    workload: WorkloadSpec,
    rate: float,
    target: float,
    config: SchedulerConfig,
    *,
    mode: str = "pd",
    profile: str = DEFAULT_PROFILE,
    engine: SimConfig | None = None,
    num_requests: int = DEFAULT_NUM_REQUESTS,
    seed: int = 0,
    max_instances: int = DEFAULT_MAX_INSTANCES,
    on_run: Callable[[tuple[int, int, int], float, bool], None] | None = None,
    queue_policy: str = "none",
    requests: Sequence[RequestPlan] | None = None,
    prefill: int | None = None,
    warmup_s: float = 0.0,
    stop_early: bool = True,
) -> PlanResult:
    """The fewest instances meeting ``target`` (0-1) at ``rate`` (see the module doc).

    ``prefill`` (PD only) holds the prefill count there and searches the decoders alone: the
    granularity of Aladdin's split-phase evaluation, which counts the decode instances each placement
    needs with the prefill side the same for every policy (prefill placement is trivial with known
    prompt lengths, the paper says).

    ``warmup_s``: requests arriving in the first ``warmup_s`` seconds load the fleet but are not
    scored. A run starts on an empty fleet, and at a high rate a few hundred requests are mostly that
    ramp: a fleet whose capacity is just below the rate still meets a target there, and the queues
    that make it miss build only later (chat at 40 req/s on 14 neutral instances, JSQ: 99.1 % over
    1,600 requests, 86.3 % over 4,000).

    ``stop_early`` (default): a simulation asked only whether its fleet meets the target stops once it
    has missed it (see the module doc); off, every simulation runs to the end. The plan is the same.
    """
    if mode not in ("pd", "neutral"):
        raise PlanError(f"--mode must be pd or neutral, got {mode!r}")
    if prefill is not None and (mode != "pd" or prefill < 1):
        raise PlanError(f"--prefill {prefill}: must be >= 1 and is for --mode pd only")
    if not (math.isfinite(rate) and rate > 0):
        raise PlanError(f"--rate must be a finite number > 0, got {rate}")
    if not 0 < target <= 1:
        raise PlanError(f"--attainment must be within (0, 1] (or a percentage within (0, 100]), got {target}")
    if num_requests < 1:
        raise PlanError(f"--num-requests must be >= 1, got {num_requests}")
    engine = engine if engine is not None else SimConfig()
    spec = open_loop(workload).with_arrival(rate_per_s=rate)
    # A trace's requests come ready (its own gaps scaled to the rate); a workload's are drawn.
    plans = (
        list(requests)
        if requests is not None
        else generate_requests(spec, rng=seed, num_requests=num_requests)
    )
    if not plans:
        raise PlanError("the workload holds no requests")
    if not (math.isfinite(warmup_s) and warmup_s >= 0):
        raise PlanError(f"--warmup-s must be a finite number >= 0, got {warmup_s}")
    scored_from = plans[0].arrival_s + warmup_s
    if warmup_s > 0 and not any(p.arrival_s >= scored_from for p in plans):
        raise PlanError(
            f"--warmup-s {warmup_s:g}: no request arrives after it (the run's arrivals span "
            f"{plans[-1].arrival_s - plans[0].arrival_s:.1f} s); raise --num-requests or lower --warmup-s"
        )
    fleets: dict[tuple[int, int, int], SimFleet] = {}
    tried: dict[tuple[int, int, int], float] = {}
    queue = QueueConfig(queue_policy=queue_policy)
    outcomes: dict[tuple[int, int, int], Any] = {}
    # A search step that only asks whether a fleet meets the target stops its simulation once more
    # scored requests have missed than the target allows (the answer is then known: it misses). Most
    # of a plan's simulations are of fleets too small, and past capacity a run is slowest (the router
    # queue grows); a run that meets the target is the same run either way, so the plan is too.
    scored_n = sum(1 for p in plans if p.arrival_s >= scored_from) if warmup_s > 0 else len(plans)
    allowed = _misses_allowed(scored_n, target)
    stopped: set[tuple[int, int, int]] = set()

    def attainment(counts: tuple[int, int, int], exact: bool = False) -> float:
        """The fleet's attainment; unless ``exact``, an upper bound below ``target`` for a fleet that
        misses it (its simulation stopped early)."""
        found = tried.get(counts)
        if found is not None and not (exact and counts in stopped):
            return found
        p, d, n = counts
        fleet = fleets.get(counts)
        if fleet is None:
            fleet = SimFleet(
                fleet_from_counts(prefill=p, decode=d, neutral=n, profile=profile, engine=engine),
                profile_label=config.profile_label,
            )
        limit = None if exact or not stop_early else (scored_from, allowed)
        outcome = simulate(fleet, config, plans, seed=seed, queue=queue, miss_limit=limit)
        if outcome.stopped:
            value = 1.0 - outcome.misses / max(scored_n, 1)
            stopped.add(counts)
        else:
            scored = (
                [r for r in outcome.results if r.start_s >= scored_from] if warmup_s > 0 else outcome.results
            )
            value = summarize(scored, outcome.duration_s, class_slos=spec.class_slos()).overall.slo_attainment
            stopped.discard(counts)
            outcomes[counts] = outcome
        tried[counts] = value
        if on_run is not None:
            on_run(counts, value, outcome.stopped)
        return value

    probe = SimFleet(fleet_from_counts(neutral=1, profile=profile, engine=engine))
    estimate = capacity_estimate(plans, rate, config, probe.predictors.default, engine)
    if max_instances < (2 if mode == "pd" else 1):
        raise PlanError(f"--max-instances must allow one instance per role, got {max_instances}")
    roles = (0, 1) if mode == "pd" and prefill is None else (1,) if mode == "pd" else (2,)
    # The fewest instances of each searched role that carry the scored load at all (see
    # ``prefill_floor``): a fleet below it meets the target only while its backlog is young.
    sustained = prefill_floor(plans, scored_from, probe.predictors.default, engine)
    least = (
        (max(1, sustained) if prefill is None else prefill, 1, 0)
        if mode == "pd"
        else (0, 0, max(1, sustained))
    )
    counts = (estimate.prefill, estimate.decode, 0) if mode == "pd" else (0, 0, estimate.neutral)
    counts = (max(counts[0], least[0]), counts[1], max(counts[2], least[2]))
    if prefill is not None:
        if prefill >= max_instances:
            raise PlanError(f"--prefill {prefill}: leaves no decoder within --max-instances {max_instances}")
        counts = (prefill, counts[1], 0)
    if sum(counts) > max_instances:  # start within the bound (the search grows it back if it can)
        scale = max_instances / sum(counts)
        counts = (
            (prefill or max(1, int(counts[0] * scale))) if mode == "pd" else 0,
            max(1, min(int(counts[1] * scale), max_instances - (prefill or 1))) if mode == "pd" else 0,
            0 if mode == "pd" else max_instances,
        )

    def bump(c: tuple[int, int, int], role: int, by: int) -> tuple[int, int, int]:
        out = list(c)
        out[role] += by
        return (out[0], out[1], out[2])

    # Grow: add the instance that helps most until the target is met.
    while attainment(counts) < target:
        if sum(counts) >= max_instances:
            raise PlanError(
                f"no fleet of at most {max_instances} instances reaches {100 * target:g}% attainment at "
                f"{rate:g} req/s (best: {100 * max(tried.values()):.1f}%); raise --max-instances"
            )
        options = [bump(counts, role, +1) for role in roles]
        # With two roles the options are compared by their attainment: those runs go to the end.
        counts = max(options, key=lambda c: (attainment(c, exact=len(options) > 1), -c[0]))

    # Shrink: drop instances while the target still holds.
    def shrink(c: tuple[int, int, int]) -> tuple[int, int, int]:
        changed = True
        while changed:
            changed = False
            for role in roles:
                if c[role] > max(1, least[role]) and attainment(bump(c, role, -1)) >= target:
                    c = bump(c, role, -1)
                    changed = True
        return c

    counts = shrink(counts)
    # Trade: a PD fleet no single removal shrinks may still have a smaller one of another split (the
    # grow step added the role that helped most then, which need not be the split the fewest
    # instances take). Any fleet one smaller with at most as many of both roles is covered by the
    # shrink (attainment does not rise as instances go), so the candidates are the two that give up
    # two of one role for one of the other; take one that meets the target and shrink again.
    while mode == "pd" and prefill is None:
        trades = [
            c
            for c in ((counts[0] + 1, counts[1] - 2, 0), (counts[0] - 2, counts[1] + 1, 0))
            if c[0] >= least[0] and c[1] >= 1
        ]
        better = next((c for c in trades if attainment(c) >= target), None)
        if better is None:
            break
        counts = shrink(better)
    final = attainment(counts, exact=True)
    worker_model = None
    if config.scheduling_policy == "binpack" and not config.enable_adaptive_pd:
        worker_model = _fit_worker_model(plans, outcomes[counts].results, rate)
    return PlanResult(
        mode=mode,
        rate=rate,
        target=target,
        prefill=counts[0],
        decode=counts[1],
        neutral=counts[2],
        attainment=final,
        estimate=estimate,
        tried=dict(tried),
        worker_model=worker_model,
        stopped=frozenset(stopped),
    )


def prefill_floor(
    plans: Sequence[RequestPlan], scored_from: float, predictor: LatencyPredictor, engine: SimConfig
) -> int:
    """The fewest instances that can compute the scored requests' prompts at their arrival rate.

    An instance computes at most one step budget of prompt tokens (``max_num_batched_tokens``) per
    prefill step, ``chunk / ttft(chunk)`` tokens a second (the profile's step cost grows linearly
    from a fixed part, so full chunks are the fastest it goes). Below this count the prompts arrive
    faster than any placement computes them, and the backlog grows for as long as the load lasts.
    A finite run hides that where the target lets a first token wait: ``interactive-batch`` at
    16 req/s brings 1.03 instances' worth of prompts, its batch class may wait 15 s for a first
    token, and over a 190 s run one prefill instance met 98 % with the backlog still growing; the
    rate, held, needs two. Aladdin sizes workers for a rate held (Eq. 7), so the plan does too.
    The prefill side of a neutral fleet is the same bound (its decodes only add to it).

    The load is the scored requests' (those after the warm-up): their number over the time they
    arrive in, and their mean prompt. 0 where prompts share cached prefixes (a prefix cache computes
    less than the prompt: no bound from the prompt alone) or with fewer than two scored requests.
    """
    scored = [p for p in plans if p.arrival_s >= scored_from]
    if len(scored) < 2 or any(p.hash_ids for p in scored):
        return 0
    span = scored[-1].arrival_s - scored[0].arrival_s
    if not span > 0:
        return 0
    chunk = max(int(engine.max_num_batched_tokens), 1)
    full_rate = chunk / max(float(predictor.ttft_profile.grid(float(chunk))), 1e-9) * 1000.0
    tokens_per_s = sum(p.prompt_tokens for p in scored[1:]) / span
    return math.ceil(tokens_per_s / full_rate - 1e-9)


def _misses_allowed(scored: int, target: float) -> int:
    """The most misses among ``scored`` requests that still meet ``target`` (as ``summarize`` divides)."""
    k = max(int(scored * (1.0 - target)), 0)
    while k > 0 and (scored - k) / scored < target:
        k -= 1
    while k < scored and (scored - k - 1) / scored >= target:
        k += 1
    return k


#: Heartbeat of the worker-count model's samples in ``plan`` (s).
HEARTBEAT_S = 10.0


def _fit_worker_model(plans: list[RequestPlan], results: Any, rate: float) -> dict[str, float] | None:
    """Aladdin's Eq. 7 fitted online over the heartbeats of a binpack run (see router.core.worker_count).

    The bins open per heartbeat are the instances a request was served on in it (best fit opens a
    new one only when no open one meets the constraints); lengths are what a router sees when a
    request arrives (prompt + max_tokens).
    """
    spans = [
        (r.decode_instance_id or r.prefill_instance_id, r.start_s, r.start_s + r.e2e_ms * 1e-3)
        for r in results
        if r.ok and r.e2e_ms is not None
    ]
    beats = samples_from_spans(
        [p.arrival_s for p in plans],
        [float(p.prompt_tokens + p.max_tokens) for p in plans],
        spans,
        heartbeat_s=HEARTBEAT_S,
    )
    model = WorkerCountModel()
    for beat in beats:
        model.observe(beat)
    fit = model.coefficients()
    if fit is None:
        return None
    predicted = model.predict(rate)
    return {
        "k5": fit[0],
        "c5": fit[1],
        "lower_rate": model.lower_rate,
        "predicted_workers": float(predicted) if predicted is not None else math.nan,
        "heartbeats": float(model.samples),
        "heartbeats_left_out": float(model.rejected),
    }


# --------------------------------------------------------------------------- CLI


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "plan",
        help="the fewest prefill/decode (or neutral) instances that meet an attainment target at a rate",
        description=(
            "Estimate the instances a workload needs at an arrival rate with the capacity model behind the "
            "router's slo_router_desired_instances signal (Aladdin's Eq. 7 fitted over heartbeats of the load) "
            "and the profile, then confirm and refine the estimate with the simulator (the router's scheduling core "
            "on the sim engine model): the printed fleet meets --attainment, one instance fewer of any role "
            "misses it (no fleet is answered whose prefill side the load outruns, however patient its first tokens may be). With --policy binpack (Aladdin, seed 001) a request its constraints refuse "
            "everywhere waits in the router queue, and one that misses its targets there is the paper's "
            "'open a new bin': the search adds an instance; the plan also prints Aladdin's worker-count "
            "model (Eq. 7, workers = ceil(k5 x rate + c5)) fitted over the planned fleet's run."
        ),
    )
    parser.add_argument(
        "--workload",
        default=DEFAULT_WORKLOAD,
        metavar="SPEC",
        help="as for `simulate` (default: %(default)s)",
    )
    parser.add_argument("--rate", type=float, required=True, metavar="R", help="mean arrival rate, req/s")
    parser.add_argument(
        "--attainment",
        type=float,
        required=True,
        metavar="A",
        help="target SLO attainment: 0.95 or 95 (percent)",
    )
    parser.add_argument(
        "--profile", default=DEFAULT_PROFILE, metavar="DIR", help="instance profile (default: %(default)s)"
    )
    parser.add_argument(
        "--mode", choices=("pd", "neutral"), default="pd", help="fleet kind (default: %(default)s)"
    )
    parser.add_argument(
        "--warmup-s",
        type=float,
        default=0.0,
        metavar="S",
        help="requests arriving in the first S seconds load the fleet but are not scored: the fleet fills "
        "from empty, and at high rates a short run is mostly that ramp, which an overloaded fleet still "
        "serves well (default: %(default)s, every request scored)",
    )
    parser.add_argument(
        "--prefill",
        type=int,
        metavar="N",
        help="--mode pd: hold N prefill instances and search the decoders only, the way Aladdin's split-phase "
        "evaluation counts decode instances per placement policy (default: search both roles)",
    )
    parser.add_argument(
        "--policy",
        default="slo",
        metavar="P",
        help=f"placement policy: a registered policy, {SLO_ADAPTIVE_PD}, or a policy .yaml (default: %(default)s)",
    )
    parser.add_argument(
        "--num-requests",
        type=int,
        default=DEFAULT_NUM_REQUESTS,
        metavar="N",
        help="requests per simulation (default: %(default)s)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the request plan and the policy (default: %(default)s)"
    )
    parser.add_argument(
        "--max-instances",
        type=int,
        default=DEFAULT_MAX_INSTANCES,
        metavar="N",
        help="give up beyond this fleet size (default: %(default)s)",
    )
    parser.add_argument(
        "--queue-policy",
        metavar="Q",
        help="router queue the simulated router runs: none (a request no instance may take is refused: "
        "a miss), fcfs, edf or priority (default: edf with --policy binpack, whose constraints hold "
        "requests in the queue as the router runs it, none otherwise)",
    )
    parser.add_argument(
        "--kv-capacity-tokens",
        type=int,
        default=SimConfig().kv_capacity_tokens,
        metavar="N",
        help="KV cache of every simulated instance, in tokens (default: %(default)s); a KV-limited fleet is "
        "where best fit's KV-over-life plan saves the instances JSQ's preemptions cost",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=SimConfig().max_num_seqs,
        metavar="N",
        help="most requests every simulated engine runs at once (default: %(default)s, vLLM's); a fleet of "
        "engines capped at a few sequences needs decoders for its concurrency, not only for its TPOT "
        "and KV, and the autoscaling estimate counts that too",
    )
    add_trace_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    parser.add_argument("--no-progress", action="store_true", help="do not report each simulation on stderr")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not (math.isfinite(args.attainment) and 0 < args.attainment <= 100):
        # Checked as typed: 150 is not a share of 1.5, it is a percentage out of range.
        print(
            error_line(
                f"--attainment {args.attainment:g}: must be a percentage within (0, 100] (or a share within (0, 1])"
            ),
            file=sys.stderr,
        )
        return 2
    target = args.attainment / 100.0 if args.attainment > 1 else args.attainment
    try:
        engine = SimConfig(kv_capacity_tokens=args.kv_capacity_tokens, max_num_seqs=args.max_num_seqs)
    except ValueError as exc:  # name the flags, not the SimConfig fields
        flags = {"kv_capacity_tokens": "--kv-capacity-tokens", "max_num_seqs": "--max-num-seqs"}
        print(error_line(name_flags(str(exc), flags)), file=sys.stderr)
        return 2
    try:
        config = SchedulerConfig(**policy_overrides(args.policy))
        build_policy(config)
        requests: list[RequestPlan] | None = None
        if is_trace(args.workload):
            trace = load_trace(args.workload, trace_options(args))
            workload = trace.workload()
            requests = trace.plans(args.num_requests, args.rate)
        else:
            workload = load_workload(args.workload)
    except (ConfigError, WorkloadError) as exc:
        flag = "--workload" if isinstance(exc, WorkloadError) else "--policy"
        print(error_line(f"{flag}: {exc}"), file=sys.stderr)
        return 2

    def progress(counts: tuple[int, int, int], value: float, stopped: bool) -> None:
        if args.no_progress:
            return
        p, d, n = counts
        fleet = f"{n} neutral" if args.mode == "neutral" else f"{p} prefill + {d} decode"
        if stopped:  # (the search knows enough: more scored requests missed than the target allows)
            # Not a measured attainment: the run stopped at the miss that put the target out of
            # reach, and the figure counts every request it did not reach as met.
            print(
                f"  {fleet}: below {100 * target:g}% (stopped early; even with every request not yet "
                f"run met it would be at most {100 * value:.1f}%)",
                file=sys.stderr,
                flush=True,
            )
        else:
            print(f"  {fleet}: {100 * value:.1f}%", file=sys.stderr, flush=True)

    queue_policy = args.queue_policy or ("edf" if args.policy == "binpack" else "none")
    try:
        QueueConfig(queue_policy=queue_policy)
    except (ConfigError, ValueError) as exc:
        print(f"error: --queue-policy: {exc}", file=sys.stderr)
        return 2
    try:
        result = plan_fleet(
            workload,
            args.rate,
            target,
            config,
            mode=args.mode,
            profile=args.profile,
            engine=engine,
            num_requests=args.num_requests,
            seed=args.seed,
            max_instances=args.max_instances,
            on_run=progress,
            queue_policy=queue_policy,
            requests=requests,
            prefill=args.prefill,
            warmup_s=args.warmup_s,
        )
    except (PlanError, FleetError, ProfileError, WorkloadError) as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    est = result.estimate
    if result.mode == "pd":
        print(
            f"{result.prefill} prefill + {result.decode} decode instances meet {100 * target:g}% at {args.rate:g} req/s "
            f"({100 * result.attainment:.1f}% simulated; capacity model: {est.prefill} + {est.decode}; "
            f"{len(result.tried)} simulations)"
        )
    else:
        print(
            f"{result.neutral} neutral instances meet {100 * target:g}% at {args.rate:g} req/s "
            f"({100 * result.attainment:.1f}% simulated; capacity model: {est.neutral}; {len(result.tried)} simulations)"
        )
    wm = result.worker_model
    if wm is not None:
        # A slope fitted to one rate's heartbeats can round to zero from below: print 0, not -0.000.
        wm = {**wm, "k5": round(wm["k5"], 3) + 0.0, "c5": round(wm["c5"], 2) + 0.0}
        print(
            f"Aladdin's worker-count model (Eq. 7) fitted over the planned fleet's binpack run: "
            f"N = ceil({wm['k5']:.3f} x rate + {wm['c5']:.2f}) above {wm['lower_rate']:.2f} req/s "
            f"({wm['heartbeats']:.0f} heartbeats of {HEARTBEAT_S:g} s); at {args.rate:g} req/s: "
            f"{wm['predicted_workers']:.0f} instances holding work"
        )
    return 0
