"""``slo-router simulate``: compare scheduling policies over arrival rates on a simulated fleet, in virtual time."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import sys
from collections.abc import Callable
from typing import Any, cast

from engine.model import SimConfig
from fleet.flags import error_line
from predictor import ProfileError
from router.core.calibration import CALIBRATION_MODES
from router.core.config import SchedulerConfig, name_flags
from router.core.dispatchers import reads_qlm_config
from router.core.errors import ConfigError
from router.core.policies import build_policy
from router.core.qlm import QlmConfig
from router.core.queue import QueueConfig
from router.core.registry import POLICIES
from router.core.request import Role
from sim import slicing
from sim.cluster import SimFleet
from sim.fleet import (
    DEFAULT_PROFILE,
    FleetError,
    FleetSpec,
    fleet_from_counts,
    fleet_to_dict,
    load_fleet,
    with_true_profile,
)
from sim.sweep import (
    SLO_ADAPTIVE_PD,
    PolicyChoice,
    SweepPoint,
    format_desired_table,
    format_prediction_table,
    format_sweep_table,
    plot_sweep,
    policy_overrides,
    run_sweep,
    sweep_meta,
    write_sweep_json,
)
from workload.report import PlotUnavailableError
from workload.sequence import request_sequence, shape_arrivals
from workload.spec import DEFAULT_WORKLOAD, RequestPlan, WorkloadError, WorkloadSpec, load_workload
from workload.traces import Trace, add_trace_arguments, is_trace, load_trace, trace_options

DEFAULT_POLICIES = f"round-robin,random,least-requests,power-of-two,load-balance,slo,{SLO_ADAPTIVE_PD}"
DEFAULT_RATES = "2,4,8"
DEFAULT_QUEUE_POLICIES = "edf"
DEFAULT_NUM_REQUESTS = 1000
DEFAULT_FLEET = (2, 2)  # prefill, decode

#: SimConfig fields with a command-line flag (every fleet group starts from them).
ENGINE_FLAGS = (
    "max_num_batched_tokens",
    "kv_capacity_tokens",
    "block_size",
    "max_model_len",
    "max_num_seqs",
    "max_waiting_requests",
    "kv_bandwidth_gbps",
    "kv_bytes_per_token",
)

#: Ground-truth knobs: (flag, SimConfig field). The engines step this way; the router still predicts
#: with the profile, so these make a fleet the router was not profiled on.
TRUTH_FLAGS = (
    ("--true-speed", "speed_factor"),
    ("--true-noise", "noise"),
    ("--true-kv-slowdown", "kv_slowdown"),
)

#: Scheduler flags that select the policy (--policies replaces them) or the calibration (--calibrations).
_POLICY_FLAGS = frozenset({"--scheduling-policy", "--enable-adaptive-pd", "--policy-config", "--calibration"})

EPILOG = f"""\
fleet (one of):
  --prefill N --decode M     disaggregated: N prefill + M decode instances on --profile
  --neutral K                K neutral instances (prefill and decode on one) on --profile
  --fleet SPEC               groups ROLE=COUNT[:PROFILE], comma-separated, each with its own
                             profile, e.g. prefill=4:qwen2.5-7b-2xv100-linear,decode=4:llama3-70b-4xh100-roofline
  --fleet FILE.yaml|.json    groups with per-group engine knobs:
                               engine: {{max_num_batched_tokens: 2048}}    # defaults for every group
                               groups:
                                 - {{role: prefill, count: 4, profile: qwen2.5-7b-2xv100-linear}}
                                 - role: decode
                                   count: 4
                                   profile: path/to/profile-dir           # holds ttft.json + tpot.json
                                   name: d-slow                           # instance ids d-slow-000, ...
                                   engine: {{kv_capacity_tokens: 131072, noise: 0.05}}
  default: --prefill {DEFAULT_FLEET[0]} --decode {DEFAULT_FLEET[1]} on {DEFAULT_PROFILE}
  A PROFILE is a directory with ttft.json and tpot.json, or a bundled name under
  profiling_data/ of the checkout. The router predicts each group with the group's own profile.
  Engine knobs are the sim worker's (SimConfig fields): the "sim engine" flags set them for
  every group, a fleet file may override any of them per group (speed_factor makes a group
  run faster than the profile the router predicts it with: a mis-profiled group).
  --print-fleet shows the resolved fleet.

ground truth (what the engines really do; the router still predicts with each group's profile):
  --true-speed 0.7           every engine runs at 0.7x the speed of its profile
  --true-noise 0.05          seeded per-step noise (relative std-dev)
  --true-kv-slowdown 0.3     a step takes up to 30 % longer as the KV cache fills
  --true-profile DIR         engines step at another profile (a fleet file: true_profile per group,
                             the compact form: ROLE=COUNT:PROFILE:TRUE_PROFILE)
  A fleet file's per-group engine fields (speed_factor, noise, kv_slowdown) win over these.

calibration (--calibrations off,scale,refit): each policy runs once per mode of the router's
  online calibration (--calibration of `slo-router router`); default: refit. Every run reports
  its prediction error (|observed - predicted| / predicted of TTFT and TPOT: median, p90, bias)
  after --warmup-requests.

policies (--policies): a registered policy ({", ".join(POLICIES.names())}),
  {SLO_ADAPTIVE_PD} (the slo policy with --enable-adaptive-pd: every instance may take
  either role per request), or a policy YAML file (--policy-config format).

workload: as for `slo-router bench --workload` (presets, class mixes, JSON/YAML files, trace:FILE);
  a trace replays its own timing unless --rates is given (then its gaps are scaled to each rate;
  --burstiness is refused, as in bench); --rates sets the mean arrival rate of each run, the
  workload's burstiness (or --burstiness) shapes the gaps, and a closed-loop workload is replayed
  as Poisson arrivals. The same workload, --seed, --num-requests and rate give the same requests
  as `slo-router bench` (same arrival times, prompts, caps and answer lengths).

what is simulated: the router's scheduling core places every request at its arrival on the
  live load of the simulated instances (status pushed on every change, as the agents do);
  each instance runs the sim engine model step by step in virtual time (continuous batching,
  chunked prefill, KV blocks with preemption, step times from its profile); PD requests
  prefill on P, hold the KV, move it to D at the KV bandwidth and decode there. A request
  with no placement (e.g. slo predicts a miss everywhere) is rejected (RESOURCE_EXHAUSTED)
  and misses its SLO. Output lengths: a request carries only its max_tokens cap; the engine
  stops it at its true length (the workload's output distribution, the trace's, or an EOS
  drawn with eos_probability when the class has ignore_eos: false), and policies that need a
  length use an online estimate learned from finished requests (--oracle-lengths: the truth,
  for ablations). Not simulated: network/RPC latency besides the KV transfer, worker
  failures and retries.

router queue (--queue-policies, default edf): a request no instance may take at once waits in
  the router's queue (the same code as the router's --queue-policy) in virtual time instead of
  being rejected; none rejects at once. Each policy runs with each queue policy. qlm (neutral
  fleets) groups requests into per-instance virtual queues, places and orders them itself (the
  --policies entry is not consulted) and evicts loose requests for tight ones (--qlm-*).

output: a table per rate, policy and queue policy, then the prediction error of each run;
  --output writes JSON {{"meta": ..., "results": [one object per (policy, calibration, queue
  policy, rate) with policy, calibration, queue_policy, rate, slo_attainment (0-1), goodput /
  goodput_rps (req/s meeting their SLO), rejected, late, queue_wait_ms {{p50, p99}},
  mean_latency_ms, g (SLO-meeting requests / summed e2e seconds), by_class, ttft_p99_ms,
  tpot_p99_ms, preemptions, mean_busy_instances ({{"prefill", "decode", "neutral"}}:
  time-average of instances holding such work), prediction_error ({{ttft, tpot}}: {{median,
  p90, bias, count}}), and every other figure of `bench`]}}; --plot a PNG of attainment
  and goodput against the rate. Same flags and seed give the same JSON.
"""


class _SkipFlags:
    """Forwards ``add_argument`` to a parser or group, except for the flags in ``skip``."""

    def __init__(self, target: argparse._ActionsContainer, skip: frozenset[str]) -> None:
        self._target = target
        self._skip = skip

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action | None:
        if any(name in self._skip for name in names):
            return None
        return self._target.add_argument(*names, **kwargs)


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help="compare scheduling policies over arrival rates on a simulated fleet, in virtual time",
        description=(
            "Replay a seeded workload on a simulated fleet with each policy and arrival rate, using the "
            "router's own scheduling core and the sim worker's engine model in virtual time (no sockets, "
            "no sleeping), and compare SLO attainment, goodput and latencies."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    fleet = parser.add_argument_group("fleet")
    fleet.add_argument("--prefill", type=int, metavar="N", help="prefill instances (with --decode)")
    fleet.add_argument("--decode", type=int, metavar="M", help="decode instances (with --prefill)")
    fleet.add_argument(
        "--neutral", type=int, metavar="K", help="neutral instances (instead of prefill/decode)"
    )
    fleet.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        metavar="DIR",
        help="profile of --prefill/--decode/--neutral instances: a directory with ttft.json and tpot.json, "
        "or a bundled name (default: %(default)s)",
    )
    fleet.add_argument(
        "--fleet", metavar="SPEC", help="heterogeneous fleet: ROLE=COUNT[:PROFILE],... or a file"
    )
    fleet.add_argument("--print-fleet", action="store_true", help="print the resolved fleet as JSON and exit")
    fleet.add_argument(
        "--true-profile",
        metavar="DIR",
        help="profile the engines really step at (default: each group's own profile)",
    )
    defaults = SimConfig()
    docs = {f.name: str(f.metadata.get("doc", "")) for f in dataclasses.fields(SimConfig)}
    engine = parser.add_argument_group("sim engine (every instance; a fleet file may override per group)")
    for name in ENGINE_FLAGS:
        default = getattr(defaults, name)
        engine.add_argument(
            "--" + name.replace("_", "-"),
            type=type(default),
            default=default,
            metavar="N" if isinstance(default, int) else "X",
            help=f"{docs[name]} (default: %(default)s)",
        )

    for flag, name in TRUTH_FLAGS:
        engine.add_argument(
            flag,
            dest=name,
            type=float,
            default=getattr(defaults, name),
            metavar="X",
            help=f"{docs[name]} (default: %(default)s)",
        )

    sweep = parser.add_argument_group("sweep")
    sweep.add_argument(
        "--calibrations",
        default=None,
        metavar="C1,C2,...",
        help="online calibration modes to compare: off, scale, refit (default: refit; --dispatch-modes "
        "runs refit and takes no --calibrations)",
    )
    sweep.add_argument(
        "--warmup-requests",
        type=int,
        default=0,
        metavar="N",
        help="leave each run's first N requests out of its prediction error (default: %(default)s)",
    )
    sweep.add_argument(
        "--measure-from",
        type=int,
        default=0,
        metavar="N",
        help="report every figure (attainment, latencies, refusals, hit rate) over each run's requests "
        "from the Nth on (0-based, in arrival order); the first N run as a warm-up that fills the "
        "engines' prefix caches and the router's view, and are left out (default: %(default)s, all)",
    )
    sweep.add_argument(
        "--policies",
        default=DEFAULT_POLICIES,
        metavar="P1,P2,...",
        help="policies to compare (default: %(default)s)",
    )
    sweep.add_argument(
        "--queue-policies",
        default=None,
        metavar="Q1,Q2,...",
        help="router queue policies to compare with each policy: none (refuse at once), fcfs, edf, priority, "
        "sa (bursts of mixed-SLO work on engines of 1-2 sequences; on larger engines at and past capacity "
        "edf leads), qlm (e2e deadlines in overload; neutral fleets; not beside long-prompt streams past "
        "capacity) "
        f"(default: {DEFAULT_QUEUE_POLICIES}; --dispatch-modes runs request dispatch without a router queue, "
        "as engines behind a balancer, and takes no --queue-policies)",
    )
    sweep.add_argument(
        "--rates",
        default=None,
        metavar="R1,R2,...",
        help=f"mean arrival rates, req/s (default: {DEFAULT_RATES}; a trace: its own timing)",
    )
    sweep.add_argument(
        "--workload",
        default=DEFAULT_WORKLOAD,
        metavar="SPEC",
        help="preset, class mix or JSON/YAML file, as for `bench` (default: %(default)s)",
    )
    sweep.add_argument(
        "--burstiness",
        type=float,
        metavar="B",
        help="gamma shape of inter-arrival gaps (1 = Poisson, <1 burstier)",
    )
    sweep.add_argument(
        "--num-requests",
        type=int,
        default=None,
        metavar="N",
        help=f"requests per run (default: {DEFAULT_NUM_REQUESTS}; a trace: the first N, default all)",
    )
    sweep.add_argument(
        "--seed", type=int, default=0, help="seed of the plan and the policies' RNG (default: %(default)s)"
    )
    sweep.add_argument("--output", metavar="FILE.json", help="write every figure of every run as JSON")
    sweep.add_argument(
        "--plot", metavar="FILE.png", help="write attainment and goodput vs rate (needs matplotlib)"
    )
    sweep.add_argument("--no-progress", action="store_true", help="do not report each run on stderr")
    sweep.add_argument(
        "--oracle-lengths",
        action="store_true",
        help="ablation: give policies each request's true output length (default: an online estimate "
        "learned from finished requests; every row is then labelled POLICY/oracle)",
    )
    add_trace_arguments(parser)
    slicing.add_arguments(parser)

    scheduler = parser.add_argument_group("scheduler (as for the router; --policies picks the policy)")
    SchedulerConfig.add_arguments(cast(argparse.ArgumentParser, _SkipFlags(scheduler, _POLICY_FLAGS)))
    queue = parser.add_argument_group("router queue (as for the router; --queue-policies picks the policy)")
    QueueConfig.add_arguments(_SkipFlags(queue, frozenset({"--queue-policy"})))
    qlm = parser.add_argument_group("qlm queue policy (request groups, virtual queues, eviction)")
    QlmConfig.add_arguments(_SkipFlags(qlm, frozenset({"--qlm-eviction"})))
    qlm.add_argument(
        "--qlm-eviction",
        default="on",
        metavar="on|off|on,off",
        help="evict running loose requests for a tight group that would miss; on,off runs qlm both ways "
        "(qlm and qlm-noevict rows) (default: %(default)s)",
    )
    parser.set_defaults(func=run)


def _fleet(args: argparse.Namespace) -> FleetSpec:
    spec = _base_fleet(args)
    return spec if args.true_profile is None else with_true_profile(spec, args.true_profile)


def _base_fleet(args: argparse.Namespace) -> FleetSpec:
    try:
        engine = SimConfig(
            **{name: getattr(args, name) for name in ENGINE_FLAGS},
            **{name: getattr(args, name) for _, name in TRUTH_FLAGS},
        )
    except ValueError as exc:  # name the flag, not the SimConfig field
        flags = {n: "--" + n.replace("_", "-") for n in ENGINE_FLAGS} | {n: f for f, n in TRUTH_FLAGS}
        raise ValueError(name_flags(str(exc), flags)) from exc
    counts = (args.prefill, args.decode, args.neutral)
    if args.fleet is not None:
        if any(c is not None for c in counts):
            raise FleetError("give --fleet, or --prefill/--decode/--neutral, not both")
        return load_fleet(args.fleet, engine=engine)
    if args.neutral is not None:
        if args.prefill is not None or args.decode is not None:
            raise FleetError("give --neutral K, or --prefill N with --decode M, not both")
        return fleet_from_counts(neutral=args.neutral, profile=args.profile, engine=engine)
    if (args.prefill is None) != (args.decode is None):
        raise FleetError("--prefill and --decode go together (or use --neutral, or --fleet)")
    prefill, decode = (args.prefill, args.decode) if args.prefill is not None else DEFAULT_FLEET
    return fleet_from_counts(prefill=prefill, decode=decode, profile=args.profile, engine=engine)


def parse_rates(text: str) -> list[float]:
    """``R1,R2,...``: distinct finite rates > 0, in the order given."""
    rates: list[float] = []
    for part in text.split(","):
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"--rates: {part.strip()!r} is not a number; write e.g. --rates 2,4,8") from None
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"--rates: every rate must be a finite number > 0, got {part.strip()!r}")
        if rate in rates:
            raise ValueError(f"--rates: {part.strip()} is listed twice")
        rates.append(rate)
    return rates


def parse_calibrations(text: str) -> list[str]:
    """``C1,C2,...``: distinct calibration modes (off, scale, refit), in the order given."""
    modes: list[str] = []
    for part in text.split(","):
        mode = part.strip()
        if mode not in CALIBRATION_MODES:
            raise ValueError(
                f"--calibrations: {mode!r} is not a calibration mode; write some of {','.join(CALIBRATION_MODES)}"
            )
        if mode in modes:
            raise ValueError(f"--calibrations: {mode} is listed twice")
        modes.append(mode)
    return modes


def parse_policies(text: str, args: argparse.Namespace) -> list[PolicyChoice]:
    """``P1,P2,...``: one scheduler config per policy, the other scheduler flags applied to each."""
    try:  # the other scheduler flags, once, with a policy that is always valid
        SchedulerConfig.from_namespace(args, **policy_overrides("round-robin"))
    except ConfigError as exc:
        raise ValueError(name_flags(str(exc), SchedulerConfig.flags())) from exc
    choices: list[PolicyChoice] = []
    for raw in text.split(","):
        name = raw.strip()
        if not name:
            raise ValueError("--policies: empty policy name; write e.g. --policies round-robin,slo")
        if any(c.label == name for c in choices):
            raise ValueError(f"--policies: {name!r} is listed twice")
        try:
            config = SchedulerConfig.from_namespace(args, **policy_overrides(name))
            build_policy(config)  # a policy file is read here, so its errors surface before any run
        except ConfigError as exc:
            raise ValueError(
                f"--policies: {name!r}: {exc} (also accepted: {SLO_ADAPTIVE_PD}, or a policy .yaml file)"
            ) from exc
        choices.append(PolicyChoice(name, config))
    return choices


def parse_qlm(args: argparse.Namespace) -> list[QlmConfig]:
    """One qlm config per ``--qlm-eviction`` value; errors name the flag."""
    values = [v.strip() for v in str(args.qlm_eviction).split(",") if v.strip()]
    if not values or len(set(values)) != len(values) or any(v not in ("on", "off") for v in values):
        raise ValueError(f"--qlm-eviction: expected on, off or on,off, got {args.qlm_eviction!r}")
    configs: list[QlmConfig] = []
    for value in values:
        try:
            configs.append(QlmConfig.from_namespace(args, eviction=value))
        except ValueError as exc:
            raise ValueError(name_flags(str(exc), QlmConfig.flags())) from exc
    return configs


def parse_queue_policies(text: str, args: argparse.Namespace) -> list[QueueConfig]:
    """``Q1,Q2,...``: one queue config per policy, the other queue flags applied to each."""
    queues: list[QueueConfig] = []
    for raw in text.split(","):
        name = raw.strip()
        if any(q.queue_policy == name for q in queues):
            raise ValueError(f"--queue-policies: {name!r} is listed twice")
        try:
            queues.append(QueueConfig.from_namespace(args, queue_policy=name))
        except ConfigError as exc:
            flags = {**QueueConfig.flags(), "queue_policy": "--queue-policies"}
            raise ValueError(name_flags(str(exc), flags)) from exc
    return queues


def load_source(args: argparse.Namespace) -> tuple[WorkloadSpec, Trace | None, list[float]]:
    """The workload (open loop), the trace it came from (if ``--workload trace:FILE``) and the rates.

    Also settles ``args.num_requests`` (a trace's length, else :data:`DEFAULT_NUM_REQUESTS`).
    """
    trace: Trace | None = None
    if is_trace(args.workload):
        if args.burstiness is not None:  # as `bench` says: the trace's own gaps are replayed, only rescaled
            raise WorkloadError("a trace replays its own arrivals: drop --burstiness")
        trace = load_trace(args.workload, trace_options(args))
        workload = trace.workload()
        if args.num_requests is None:
            args.num_requests = len(trace.records)
        rates = [workload.arrival.rate_per_s] if args.rates is None else parse_rates(args.rates)
    else:
        workload = shape_arrivals(load_workload(args.workload), burstiness=args.burstiness, open_loop=True)
        if workload.model:
            raise WorkloadError(
                f"workload {args.workload}: 'model' ({workload.model!r}) is not simulated (a simulated "
                "fleet serves any model); remove it from the file for simulate"
            )
        rates = parse_rates(args.rates or DEFAULT_RATES)
    if args.num_requests is None:
        args.num_requests = DEFAULT_NUM_REQUESTS
    return workload, trace, rates


def run_plans(
    args: argparse.Namespace, workload: WorkloadSpec, trace: Trace | None
) -> Callable[[WorkloadSpec, float], list[RequestPlan]]:
    """Each rate's requests, as :func:`sim.sweep.run_sweep` asks for them: the function ``slo-router
    bench`` plans with (:func:`workload.sequence.request_sequence`), so the same workload, seed and
    rate give the same requests on both. A trace keeps its own timing unless ``--rates`` is given."""
    source: WorkloadSpec | Trace = workload if trace is None else trace
    native = trace is not None and args.rates is None

    def plans(_spec: WorkloadSpec, rate: float) -> list[RequestPlan]:
        return request_sequence(
            source, seed=args.seed, num_requests=args.num_requests, rate=None if native else rate
        )

    return plans


def run(args: argparse.Namespace) -> int:
    try:
        spec = _fleet(args)
    except (FleetError, ValueError) as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    if args.print_fleet:
        print(json.dumps(fleet_to_dict(spec), indent=2))
        return 0
    try:
        workload, trace, rates = load_source(args)
        policies = parse_policies(args.policies, args)
        if args.dispatch_modes is not None:
            # Request dispatch there runs each policy without a router queue and with the router's
            # default calibration (sim.slicing): say so rather than run without what the flag asked for.
            for flag, given in (
                ("--queue-policies", args.queue_policies),
                ("--calibrations", args.calibrations),
            ):
                if given is not None:
                    raise ValueError(
                        f"{flag} is not used with --dispatch-modes (request dispatch there runs each policy "
                        "without a router queue, as engines behind a balancer, with the router's default "
                        "calibration, refit); compare it in a run without --dispatch-modes"
                    )
        queues = parse_queue_policies(args.queue_policies or DEFAULT_QUEUE_POLICIES, args)
        if spec.disaggregated and any(q.queue_policy == "qlm" for q in queues):
            # The router refuses every request UNAVAILABLE on such a fleet; say it before any run.
            raise ValueError(
                "--queue-policies qlm needs a neutral fleet (it places whole requests): use --neutral K, "
                "or another queue policy (edf, sa) on prefill/decode instances"
            )
        qlm = parse_qlm(args)
        if args.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
        calibrations = parse_calibrations(args.calibrations or "refit")
        if not 0 <= args.warmup_requests < args.num_requests:
            raise ValueError(f"--warmup-requests must be in [0, --num-requests), got {args.warmup_requests}")
        if not 0 <= args.measure_from < args.num_requests:
            raise ValueError(f"--measure-from must be in [0, --num-requests), got {args.measure_from}")
        if args.measure_from and args.dispatch_modes is not None:
            raise ValueError("--measure-from is not supported with --dispatch-modes; drop one of them")
        fleet = SimFleet(spec, profile_label=policies[0].config.profile_label)
    except (WorkloadError, ProfileError, ValueError) as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print(
            "error: --plot needs matplotlib: `pip install 'slo-router[plot]'` (or `pip install matplotlib`), "
            "or drop --plot",
            file=sys.stderr,
        )
        return 2

    arrivals = workload.arrival.describe().split(",")[0]
    if trace is not None:
        arrivals = (
            f"{trace.format} trace, {len(trace.records)} requests over {trace.span_s:.0f} s"
            + (
                f", replayed at {args.trace_speed:g}x"
                if args.rates is None
                else ", timing scaled to each rate"
            )
            + f", classes {trace.rule.describe()}, max_tokens {trace.max_tokens}"
        )
    title = (
        f"slo-router simulate: {spec.describe()}; workload {workload.name} "
        f"({arrivals}), {args.num_requests} requests per run"
        + (f" (figures over requests {args.measure_from}.., after a warm-up)" if args.measure_from else "")
        + f", seed {args.seed}"
        + (", ORACLE output lengths (ablation)" if args.oracle_lengths else "")
    )
    print(title, file=sys.stderr)

    def progress(point: SweepPoint, done: int, total: int) -> None:
        if args.no_progress:
            return
        speed = point.report.overall.requests / point.wall_s if point.wall_s > 0 else float("inf")
        print(
            f"[{done}/{total}] {point.label}+{point.queue_policy} @ {point.rate:g} req/s: attainment "
            f"{100.0 * point.report.overall.slo_attainment:.1f}%, {point.wall_s:.1f} s wall "
            f"({speed:,.0f} simulated requests/s)",
            file=sys.stderr,
            flush=True,
        )

    if args.dispatch_modes is not None:
        return slicing.run_cli(
            args,
            fleet,
            workload,
            policies,
            rates,
            title,
            progress,
            plans_for=run_plans(args, workload, trace),
        )
    try:
        points = run_sweep(
            fleet,
            workload,
            policies,
            rates,
            num_requests=args.num_requests,
            seed=args.seed,
            on_run=progress,
            calibrations=calibrations,
            warmup_requests=args.warmup_requests,
            queues=queues,
            qlm=qlm,
            oracle_lengths=args.oracle_lengths,
            plans_for=run_plans(args, workload, trace),
            measure_from=args.measure_from,
        )
    except KeyboardInterrupt:
        print("\ninterrupted; no report written", file=sys.stderr)
        return 130
    except FleetError as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    print(title)
    print(format_sweep_table(points))
    print()
    print(format_prediction_table(points))
    desired = format_desired_table(points, pd=not all(r is Role.NEUTRAL for r in fleet.roles))
    if desired:
        print()
        print(desired)
    meta = sweep_meta(fleet, workload, policies, rates, num_requests=args.num_requests, seed=args.seed)
    meta["calibrations"] = calibrations
    meta["oracle_lengths"] = args.oracle_lengths
    if trace is not None:
        meta["trace"] = {
            "path": trace.path,
            "format": trace.format,
            "requests": len(trace.records),
            "speed": args.trace_speed,
            "window": args.trace_window,
            "classes": args.trace_classes,
            "max_tokens": trace.max_tokens,
        }
    meta["warmup_requests"] = args.warmup_requests
    meta["measure_from"] = args.measure_from
    meta["queue_policies"] = [q.queue_policy for q in queues]
    meta["queue"] = dataclasses.asdict(queues[0]) | {"queue_policy": None}
    if any(reads_qlm_config(q.queue_policy) for q in queues):
        meta["qlm"] = [dataclasses.asdict(q) for q in qlm]
    if args.output:
        write_sweep_json(args.output, points, meta)
        print(f"wrote {args.output}", file=sys.stderr)
    if args.plot:
        try:
            plot_sweep(args.plot, points, title=title.removeprefix("slo-router simulate: "))
        except PlotUnavailableError as exc:
            print(error_line(exc), file=sys.stderr)
            return 2
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
