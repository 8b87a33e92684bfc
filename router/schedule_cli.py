"""``slo-router schedule``: ask a running router where a request would go now, and why.

A dry run of the router's decision (``Router.Schedule``): the same policy,
view, in-flight load and queue the router's next ``Generate`` would meet, and
nothing is recorded or sent to a worker. It prints the chosen instance of
each stage with its predicted TTFT and TPOT; with ``--top N`` (or
``--explain``, every candidate) also, per stage, the candidates the decision
weighed: which filter dropped each and what was predicted there. When no
instance may take the request now, it says how many queued requests it would
wait behind, and why. ``--json`` prints the response as it came.

    slo-router schedule --prompt-tokens 3000 --max-tokens 256 --ttft-ms 1000 --top 5
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from typing import Any

import grpc
from google.protobuf import json_format
from slorouter.v1 import common_pb2, router_pb2, router_pb2_grpc

from cms import limits
from cms.transport import client_tls_from_arg, message_size_options, open_channel, target_error
from fleet.flags import error_line
from router.server import DEFAULT_LISTEN

DESCRIPTION = """\
Ask a running router where a request would go now, and why: a dry run of its
decision (Router.Schedule) with the same policy, cluster view, in-flight load
and queue its next Generate would meet. Nothing is recorded or sent to a worker.

It prints the chosen instance of each stage with its predicted TTFT and TPOT;
with --top N (or --explain: every candidate) also, per stage, the candidates the
decision weighed, which filter dropped each and what was predicted there. When
no instance may take the request now, it says how many queued requests it would
wait behind, and why. --json prints the ScheduleResponse as it came.

example:
  slo-router schedule --prompt-tokens 3000 --max-tokens 256 --ttft-ms 1000 --top 5
"""
DEFAULT_TARGET = DEFAULT_LISTEN  # where `slo-router router` and `up` listen by default
#: Above this many candidates per stage ``--top`` is the whole trace anyway (``--explain``).
MAX_TOP = 4096


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "schedule",
        help="ask a running router where a request would go now, and why (a dry run; nothing is sent)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--target", default=DEFAULT_TARGET, help="router address HOST:PORT (default: %(default)s)"
    )
    parser.add_argument("--tls-ca", default=None, help="CA bundle (PEM): reach the router over TLS")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument(
        "--prompt-tokens",
        type=int,
        default=512,
        metavar="N",
        help="a prompt of N token ids (only its length matters to the decision; default: %(default)s)",
    )
    prompt.add_argument(
        "--prompt", default=None, metavar="TEXT", help="a text prompt, tokenized by the router"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=128, metavar="N", help="sampling.max_tokens (default: %(default)s)"
    )
    parser.add_argument("--ttft-ms", type=float, default=0.0, help="TTFT target (default: the router's)")
    parser.add_argument("--tpot-ms", type=float, default=0.0, help="TPOT target (default: the router's)")
    parser.add_argument("--e2e-ms", type=float, default=0.0, help="end-to-end target (default: none)")
    parser.add_argument("--priority", type=int, default=0, help="request priority (default: %(default)s)")
    parser.add_argument("--slo-class", default="", metavar="NAME", help="the request's SLO class label")
    parser.add_argument("--model", default="", help="GenerateRequest.model (default: any)")
    trace = parser.add_mutually_exclusive_group()
    trace.add_argument(
        "--top",
        type=int,
        default=0,
        metavar="N",
        help="also list the N most telling candidates per stage (ScheduleRequest.explain_top)",
    )
    trace.add_argument("--explain", action="store_true", help="also list every candidate of every stage")
    parser.add_argument("--json", action="store_true", help="print the ScheduleResponse as JSON")
    parser.add_argument(
        "--timeout-s", type=float, default=10.0, help="deadline of the call in seconds (default: %(default)s)"
    )
    parser.set_defaults(func=run)


def _check(args: argparse.Namespace) -> str | None:
    """The first flag out of bounds, as an error message naming it."""
    bad_target = target_error(args.target, "router")
    if bad_target is not None:
        return bad_target
    if args.prompt is None and not 1 <= args.prompt_tokens <= limits.MAX_TOKEN_IDS:
        return f"--prompt-tokens {args.prompt_tokens}: must be within [1, {limits.MAX_TOKEN_IDS}]"
    if args.prompt is not None and not args.prompt:
        return "--prompt: must not be empty"
    if not 1 <= args.max_tokens <= limits.MAX_OUTPUT_TOKENS:
        return f"--max-tokens {args.max_tokens}: must be within [1, {limits.MAX_OUTPUT_TOKENS}]"
    for flag, value in (("--ttft-ms", args.ttft_ms), ("--tpot-ms", args.tpot_ms), ("--e2e-ms", args.e2e_ms)):
        if not (math.isfinite(value) and value >= 0):
            return f"{flag} {value}: must be a finite number >= 0 (0: the router's default)"
    if not 0 <= args.top <= MAX_TOP:
        return f"--top {args.top}: must be within [0, {MAX_TOP}]"
    if not (math.isfinite(args.timeout_s) and args.timeout_s > 0):
        return f"--timeout-s {args.timeout_s}: must be a finite number > 0"
    return None


def build_request(args: argparse.Namespace) -> router_pb2.ScheduleRequest:
    generate = router_pb2.GenerateRequest(
        model=args.model,
        sampling=common_pb2.SamplingParams(max_tokens=args.max_tokens),
        slo=common_pb2.SloTarget(ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms, e2e_ms=args.e2e_ms),
        priority=args.priority,
        slo_class=args.slo_class,
    )
    if args.prompt is not None:
        generate.prompt = args.prompt
    else:
        generate.prompt_token_ids.extend((7 * i) % 250 + 1 for i in range(args.prompt_tokens))
    return router_pb2.ScheduleRequest(request=generate, explain=args.explain, explain_top=args.top)


def _ms(value: float) -> str:
    return f"{value:.1f} ms" if value > 0 else "-"  # the wire's 0: not predicted


def render(response: router_pb2.ScheduleResponse) -> str:
    """The response as a few lines of text (the choices, then the trace per stage)."""
    if response.queued:
        ahead = response.queue_position
        return (
            f"no instance may take it now: it would wait in the router queue behind {ahead} "
            f"request{'' if ahead == 1 else 's'} ({response.queue_reason})"
        )
    lines = [f"policy {response.policy}, mode {response.mode}"]
    if response.mode == "neutral":
        choices = [("neutral", response.prefill)]
    else:
        choices = [("prefill", response.prefill), ("decode", response.decode)]
    for stage, choice in choices:
        if choice.instance_id:
            lines.append(
                f"  {stage:<8} {choice.instance_id} ({choice.endpoint})  predicted TTFT "
                f"{_ms(choice.predicted_ttft_ms)}, TPOT {_ms(choice.predicted_tpot_ms)}"
            )
    if response.trace:
        width = max(len(t.instance_id) for t in response.trace)
        lines.append("candidates (* chosen; dropped by: the first filter that refused it):")
        lines.append(f"  {'stage':<8} {'instance':<{width}}   {'TTFT':>10} {'TPOT':>10}  dropped by")
        for t in response.trace:
            mark = "*" if t.selected else " "
            lines.append(
                f"  {t.stage:<8} {t.instance_id:<{width}} {mark} {_ms(t.predicted_ttft_ms):>10} "
                f"{_ms(t.predicted_tpot_ms):>10}  {t.dropped_by or '-'}"
            )
    return "\n".join(lines)


async def _call(args: argparse.Namespace, request: router_pb2.ScheduleRequest) -> router_pb2.ScheduleResponse:
    sizes = message_size_options(limits.SERVING_MAX_MESSAGE_BYTES, limits.SERVING_MAX_MESSAGE_BYTES)
    async with open_channel(args.target, sizes, tls=client_tls_from_arg(args.tls_ca)) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        response: router_pb2.ScheduleResponse = await stub.Schedule(request, timeout=args.timeout_s)
        return response


def run(args: argparse.Namespace) -> int:
    problem = _check(args)
    if problem is not None:
        print(error_line(problem), file=sys.stderr)
        return 2
    try:
        response = asyncio.run(_call(args, build_request(args)))
    except ValueError as exc:  # --tls-ca unreadable
        print(error_line(exc), file=sys.stderr)
        return 2
    except grpc.aio.AioRpcError as exc:
        code = exc.code()
        if code is grpc.StatusCode.UNAVAILABLE or code is grpc.StatusCode.DEADLINE_EXCEEDED:
            print(
                f"error: no answer from a router at {args.target} ({code.name}: {exc.details()}); "
                "start one (e.g. `slo-router up`) or pass --target HOST:PORT",
                file=sys.stderr,
            )
        else:
            print(
                error_line(f"the router refused the request ({code.name}): {exc.details()}"), file=sys.stderr
            )
        return 1
    if args.json:
        print(json_format.MessageToJson(response, preserving_proto_field_name=True))
    else:
        print(render(response))
    return 0
