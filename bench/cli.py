"""``slo-router bench``: drive a router with a workload and report SLO attainment per class."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import math
import sys
import time
from typing import Any

from bench.loadgen import DEFAULT_TARGET, ENGINES, LoadConfig, LoadError, LoadResult, ProgressBar, run_load
from cms.transport import target_error
from fleet.flags import error_line
from router.core.config import name_flags
from workload.prediction import format_prediction_error, prediction_error
from workload.report import (
    BenchReport,
    PlotUnavailableError,
    format_table,
    plot_report,
    summarize,
    write_json,
)
from workload.sequence import request_sequence, shape_arrivals
from workload.spec import (
    CLASS_PRESETS,
    DEFAULT_WORKLOAD,
    WORKLOAD_PRESETS,
    RequestPlan,
    WorkloadError,
    WorkloadSpec,
    load_workload,
    workload_to_dict,
)
from workload.traces import Trace, add_trace_arguments, is_trace, load_trace, trace_options

#: Requests planned when neither --num-requests nor --duration is given.
DEFAULT_NUM_REQUESTS = 200

#: Plan size of a closed-loop run bounded only by --duration (the clients stop at the
#: duration; the plan just has to be long enough).
CLOSED_LOOP_PLAN_CAP = 100_000


def _presets_help() -> str:
    lines = []
    for name, cls in CLASS_PRESETS.items():
        lines.append(f"  {name:<10} {cls.slo.describe():<26} prompt {cls.prompt.describe()}")
        lines.append(f"  {'':<10} {'share ' + format(cls.share, 'g'):<26} output {cls.output.describe()}")
    mixes = "; ".join(
        f"{name} = {' + '.join(classes)}" for name, classes in WORKLOAD_PRESETS.items() if len(classes) > 1
    )
    lines.append(f"  workload presets: {mixes}; each class preset alone is also a workload (share 1)")
    return "\n".join(lines)


EPILOG = f"""\
workload spec (--workload):
  a preset name         {", ".join(WORKLOAD_PRESETS)} (default: {DEFAULT_WORKLOAD})
  a weighted mix        chat=0.7,code=0.3   (class presets, weights normalised)
  a JSON or YAML file   my-workload.yaml
  a trace               trace:FILE  (Azure CSV, raw Azure CSV or Mooncake JSONL; its own timing
                        unless --rate; --trace-speed, --trace-window, --trace-classes; see
                        docs/real-traces.md)

class presets (lengths in tokens; lognormal(median,sigma,min,max) is clipped to [min,max]):
{_presets_help()}

  chat is judged on TTFT and mean TPOT; code and summarize on end-to-end latency only.

workload file (YAML shown; JSON has the same keys):
  name: support-bot
  arrival: {{process: gamma, rate_per_s: 6, burstiness: 0.5}}   # or cv: 1.4 instead of burstiness;
                                                             # or {{process: closed, concurrency: 16}}
  token_id_low: 0          # prompt token ids are drawn uniformly from [low, high)
  token_id_high: 256
  model: ""                # GenerateRequest.model (bench only: simulate refuses it)
  classes:
    - name: chat
      share: 0.8
      ttft_ms: 800         # omit or null: no target (tpot_ms, e2e_ms alike)
      tpot_ms: 40
      prompt: lognormal(384,1.0,16,4096)   # or fixed(N), uniform(MIN,MAX), or a mapping
      output: uniform(32,512)  # the answer's true length (the engine stops there)
      max_tokens: 1024     # the cap each request sends; omit: output's largest value
      ignore_eos: true     # false: an engine with eos_probability > 0 may stop earlier
      priority: 0          # GenerateRequest.priority
    - preset: code         # start from a class preset, override what you need
      share: 0.2           # (targets it does not name keep the preset's; null removes one)
      e2e_ms: 3000

arrivals: --rate R is a Poisson process at R req/s; with --burstiness B the gaps are
gamma with shape B (mean 1/R, coefficient of variation 1/sqrt(B): B<1 burstier,
B>1 smoother); --concurrency C is a closed loop of C clients. The flags override
the workload file's arrival section. Default: Poisson at 2 req/s.

answer lengths (--engine): each request's answer has its planned length (the class's output
distribution, or the trace's), and the router is not told it: it sees the cap (max_tokens),
as in `slo-router simulate`, and learns lengths from the answers that finished.
  sim   (default; the workers of `slo-router up`) max_tokens is the cap; a sim engine's output is
        a pure function of the request, so bench adds a stop string that first occurs in it at
        the planned length: the engine stops there and reports finish_reason "stop" (the router
        passes stop strings through and never reads them). An answer longer than planned (or
        shorter, in an ignore_eos class) is a BAD_STREAM error: against a real model, pass
        --engine vllm.
  vllm  a real model's output cannot be steered: an ignore_eos class sends its planned length
        as max_tokens (the router then sees the length as the cap, which simulate never gives
        it); other classes send the cap and the model stops at its own EOS.

attainment: a request meets its SLO when it completed without error and TTFT <=
ttft_ms, mean TPOT <= tpot_ms and e2e <= e2e_ms, for each target its class sets.
Goodput counts requests (and their output tokens) per second that met their SLO.
"""


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="drive a router with a workload and report SLO attainment, goodput and latencies",
        description=(
            "Replay a seeded workload against a router's public Router.Generate API and report, per "
            "SLO class and overall, SLO attainment, goodput, TTFT/TPOT/e2e p50/p90/p99 and errors "
            "by gRPC code."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--target", default=DEFAULT_TARGET, help="router address HOST:PORT (default: %(default)s)"
    )
    parser.add_argument("--tls-ca", default=None, help="CA bundle (PEM): reach the router over TLS")
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default=LoadConfig.engine,
        help="the fleet's engine, which decides how an answer is made to end at its planned length "
        "(see 'answer lengths' below; default: %(default)s)",
    )
    load = parser.add_mutually_exclusive_group()
    load.add_argument(
        "--rate",
        type=float,
        metavar="R",
        help="open loop: mean arrivals per second (default: the workload's, 2)",
    )
    load.add_argument("--concurrency", type=int, metavar="C", help="closed loop: C clients, one request each")
    parser.add_argument(
        "--burstiness",
        type=float,
        metavar="B",
        help="gamma shape of inter-arrival gaps (1 = Poisson, <1 burstier); open loop only",
    )
    parser.add_argument(
        "--num-requests",
        type=int,
        metavar="N",
        help=f"requests to plan (default: {DEFAULT_NUM_REQUESTS} when --duration is not given)",
    )
    parser.add_argument(
        "--duration",
        type=float,
        metavar="S",
        help="stop issuing requests after S seconds (running ones get --drain-timeout-s more)",
    )
    parser.add_argument(
        "--workload",
        default=DEFAULT_WORKLOAD,
        metavar="SPEC",
        help="preset, class mix or JSON/YAML file; see below (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the plan (default: %(default)s)")
    parser.add_argument("--output", metavar="FILE.json", help="write every figure and every request as JSON")
    parser.add_argument(
        "--plot", metavar="FILE.png", help="write latency CDFs and attainment per class (needs matplotlib)"
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=LoadConfig.request_timeout_s,
        help="deadline of each Generate call in seconds (default: %(default)s)",
    )
    parser.add_argument(
        "--drain-timeout-s",
        type=float,
        default=LoadConfig.drain_timeout_s,
        help="after --duration, how long running requests may finish before being cancelled "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--connect-timeout-s",
        type=float,
        default=LoadConfig.connect_timeout_s,
        help="how long to wait for the router to accept a connection (default: %(default)s)",
    )
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=LoadConfig.max_in_flight,
        help="bound on outstanding requests in open loop; beyond it sends are late (default: %(default)s)",
    )
    parser.add_argument("--model", default="", help="GenerateRequest.model (default: the workload's, or any)")
    parser.add_argument(
        "--request-id-prefix",
        default="",
        help="send request ids PREFIX<index> (default: let the router assign them)",
    )
    parser.add_argument("--no-progress", action="store_true", help="do not draw the progress bar on stderr")
    parser.add_argument(
        "--print-workload",
        action="store_true",
        help="print the resolved workload as JSON (a starting point for a file) and exit",
    )
    add_trace_arguments(parser)
    parser.set_defaults(func=run)


def resolve_workload(args: argparse.Namespace) -> WorkloadSpec:
    """The workload of ``--workload`` with the arrival flags applied (the rule ``simulate`` uses too)."""
    spec = shape_arrivals(
        load_workload(args.workload), rate=args.rate, burstiness=args.burstiness, concurrency=args.concurrency
    )
    if args.model:
        spec = dataclasses.replace(spec, model=args.model)
    return spec


def load_source(args: argparse.Namespace) -> tuple[WorkloadSpec, Trace | None]:
    """The workload of ``--workload`` with the arrival flags applied, and the trace it came from (if any)."""
    if not is_trace(args.workload):
        return resolve_workload(args), None
    if args.concurrency is not None or args.burstiness is not None:
        raise WorkloadError("a trace replays its own arrivals: drop --concurrency and --burstiness")
    trace = load_trace(args.workload, trace_options(args))
    spec = trace.workload()
    if args.model:
        spec = dataclasses.replace(spec, model=args.model)
    return spec, trace


def plan_requests(args: argparse.Namespace, spec: WorkloadSpec, trace: Trace | None) -> list[RequestPlan]:
    """The requests ``bench`` sends: :func:`workload.sequence.request_sequence`, the function
    ``simulate`` plans with, so the same workload, seed and rate give the same requests on both."""
    num_requests = args.num_requests
    if num_requests is None and args.duration is None and trace is None:
        num_requests = DEFAULT_NUM_REQUESTS
    if num_requests is None and not spec.arrival.open_loop:
        num_requests = CLOSED_LOOP_PLAN_CAP
    # The rate is already in a workload's arrival process; a trace is rescaled to it here.
    return request_sequence(
        spec if trace is None else trace,
        seed=args.seed,
        num_requests=num_requests,
        rate=args.rate if trace is not None else None,
        duration_s=args.duration,
    )


#: Config and workload fields behind bench's flags: errors name the flag the user typed.
FLAG_OF_FIELD: dict[str, str] = {
    "request_timeout_s": "--timeout-s",
    "drain_timeout_s": "--drain-timeout-s",
    "connect_timeout_s": "--connect-timeout-s",
    "max_in_flight": "--max-in-flight",
    "duration_s": "--duration",
    "num_requests": "--num-requests",
    "request_id_prefix": "--request-id-prefix",
}


def _usage_error(exc: Exception) -> int:
    print(error_line(f"{name_flags(str(exc), FLAG_OF_FIELD)}"), file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    bad_target = target_error(args.target, "router")
    if bad_target is not None:
        print(error_line(bad_target), file=sys.stderr)
        return 2
    # The arrival flags, before they are merged into the workload (whose own errors name its file).
    if args.rate is not None and not (math.isfinite(args.rate) and args.rate > 0):
        print(error_line(f"--rate {args.rate}: must be a finite number > 0 (requests/s)"), file=sys.stderr)
        return 2
    if args.burstiness is not None and not (math.isfinite(args.burstiness) and args.burstiness > 0):
        print(error_line(f"--burstiness {args.burstiness}: must be a finite number > 0"), file=sys.stderr)
        return 2
    if args.concurrency is not None and args.concurrency < 1:
        print(error_line(f"--concurrency {args.concurrency}: must be >= 1"), file=sys.stderr)
        return 2
    try:
        spec, trace = load_source(args)
    except (WorkloadError, ValueError) as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    if args.print_workload:
        print(json.dumps(workload_to_dict(spec), indent=2))
        return 0
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print(
            "error: --plot needs matplotlib: `pip install 'slo-router[plot]'` (or `pip install matplotlib`), "
            "or drop --plot",
            file=sys.stderr,
        )
        return 2
    try:
        plans = plan_requests(args, spec, trace)
        config = LoadConfig(
            target=args.target,
            engine=args.engine,
            tls_ca_file=args.tls_ca,
            concurrency=0 if spec.arrival.open_loop else spec.arrival.concurrency,
            duration_s=args.duration,
            request_timeout_s=args.timeout_s,
            drain_timeout_s=args.drain_timeout_s,
            connect_timeout_s=args.connect_timeout_s,
            max_in_flight=args.max_in_flight,
            request_id_prefix=args.request_id_prefix,
            model=spec.model,
        )
    except (WorkloadError, ValueError) as exc:
        return _usage_error(exc)
    if not plans:
        print("error: the plan is empty; raise --duration, --rate or --num-requests", file=sys.stderr)
        return 2

    title = (
        f"slo-router bench: {spec.name}, {spec.arrival.describe()}, seed {args.seed}, target {args.target}, "
        f"engine {args.engine}"
    )
    print(title, file=sys.stderr)
    bar = None if args.no_progress else ProgressBar(sys.stderr)
    started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    try:
        outcome = _run_event_loop(plans, config, bar)
    except LoadError as exc:
        print(error_line(exc), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted; no report written", file=sys.stderr)
        return 130
    finally:
        if bar is not None:
            bar.close()

    meta = {
        "title": title,
        "target": args.target,
        "engine": args.engine,
        "seed": args.seed,
        "started_at": started_at,
        "workload": workload_to_dict(spec),
        "planned": outcome.planned,
        "issued": len(outcome.results),
        "stopped_by_duration": outcome.stopped_by_duration,
        "max_send_lag_s": outcome.max_send_lag_s,
        "request_timeout_s": config.request_timeout_s,
        # The router's predicted TTFT/TPOT (each response's route) against what the request saw.
        "prediction_error": prediction_error(outcome.results),
    }
    report = summarize(outcome.results, outcome.duration_s, class_slos=spec.class_slos(), meta=meta)
    print(_format(report, outcome))
    if args.output:
        write_json(args.output, report, outcome.results)
        print(f"wrote {args.output}", file=sys.stderr)
    if args.plot:
        try:
            plot_report(args.plot, report, outcome.results)
        except PlotUnavailableError as exc:
            print(error_line(exc), file=sys.stderr)
            return 2
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _format(report: BenchReport, outcome: LoadResult) -> str:
    text = format_table(report)
    error = report.meta.get("prediction_error")
    if error is not None and (error["ttft"]["count"] or error["tpot"]["count"]):
        # Beside the latencies it is about: before the error causes, which end the summary.
        line = format_prediction_error(error)
        head, sep, causes = text.partition("\nerrors by code")
        text = f"{head}\n{line}{sep}{causes}"
    notes = []
    if outcome.stopped_by_duration:
        notes.append(
            f"the duration cap stopped the run after {len(outcome.results)} of {outcome.planned} requests"
        )
    if outcome.max_send_lag_s > 0.1:
        notes.append(f"requests were sent up to {outcome.max_send_lag_s:.2f} s late (max in flight reached?)")
    return text + "".join(f"\nnote: {n}" for n in notes)


def _run_event_loop(plans: list[RequestPlan], config: LoadConfig, bar: ProgressBar | None) -> LoadResult:
    # uvloop is set up here, at the entry point, and nowhere else.
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; stay usable without it
        return asyncio.run(run_load(plans, config, on_progress=bar))
    result: LoadResult = uvloop.run(run_load(plans, config, on_progress=bar))
    return result
