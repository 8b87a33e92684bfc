"""``slo-router predict``: print TTFT and TPOT predictions for one instance's load."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fleet.flags import error_line
from predictor.latency import LatencyPredictor


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "predict",
        help="predict TTFT/TPOT from profiling JSON for a given load",
        description=(
            "Predict the time to first token of a prefill backlog and the time per output token of a "
            "decode batch, from a TTFT and a TPOT profile (the seed JSON schema; p50 is used)."
        ),
    )
    parser.add_argument("--ttft-profiling-data-path", required=True, help="TTFT profile JSON")
    parser.add_argument("--tpot-profiling-data-path", required=True, help="TPOT profile JSON")
    parser.add_argument(
        "--prefill-tokens",
        type=int,
        required=True,
        help="prompt tokens still to prefill on the instance, the new request's included",
    )
    parser.add_argument("--decode-requests", type=int, default=0, help="requests in the decode batch")
    parser.add_argument(
        "--decode-tokens", type=int, default=0, help="total context tokens of the decode batch"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="the instance's chunked-prefill token budget per step (default: %(default)s)",
    )
    parser.set_defaults(func=run)


def check_args(args: argparse.Namespace) -> None:
    """``ValueError`` naming the first flag out of range."""
    if args.prefill_tokens < 1:
        raise ValueError(f"--prefill-tokens {args.prefill_tokens}: must be >= 1 (the new request's prompt)")
    if args.decode_requests < 0:
        raise ValueError(f"--decode-requests {args.decode_requests}: must be >= 0")
    if args.decode_tokens < 0:
        raise ValueError(f"--decode-tokens {args.decode_tokens}: must be >= 0")
    if args.decode_requests == 0 and args.decode_tokens > 0:
        raise ValueError(f"--decode-tokens {args.decode_tokens}: needs --decode-requests >= 1")
    if args.decode_tokens < args.decode_requests:
        raise ValueError(
            f"--decode-tokens {args.decode_tokens}: a decode batch of --decode-requests "
            f"{args.decode_requests} holds at least one token per request"
        )
    if args.max_num_batched_tokens < 1:
        raise ValueError(f"--max-num-batched-tokens {args.max_num_batched_tokens}: must be >= 1")


def run(args: argparse.Namespace) -> int:
    try:
        check_args(args)
        lp = LatencyPredictor.from_files(args.ttft_profiling_data_path, args.tpot_profiling_data_path)
        ttft = lp.predict_ttft_ms(
            args.prefill_tokens, args.decode_requests, args.decode_tokens, args.max_num_batched_tokens
        )
    except ValueError as exc:  # ProfileError included: the message names the file and entry
        print(error_line(exc), file=sys.stderr)
        return 2
    tpot = lp.predict_tpot_ms(args.decode_requests, args.decode_tokens)
    print(f"predicted_ttft_ms: {ttft:.3f}")
    print(f"predicted_tpot_ms: {tpot:.3f}")
    return 0
