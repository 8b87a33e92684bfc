"""Slice-level dispatch in the router (``--dispatch-mode slice``): its flags.

Each request is served as a sequence of slices of at most ``--slice-tokens``
new tokens (seed 002, SCLS). The dispatcher is :mod:`router.core.slice_dispatch`
(registered as ``slice``), driven by the router's one asyncio driver
(:class:`router.admission.Admission`) like every other dispatcher: its placement
of a slice is a ``DISPATCH`` with a token cap; the service streams the leg with
``max_tokens`` at the cap, and a leg that ends there with output left is the
lifecycle's pause → requeue → resume (:meth:`router.admission.Admission.paused`):
the next leg is a ``Decode`` with the tokens generated so far and no KV handle,
so the instance recomputes prompt + generated tokens. A next slice placed at once
on the instance the leg runs on continues that leg instead (``continue_in_place``):
the worker's leg is asked for the request's whole ``max_tokens`` and the router
counts the tokens it relays, so at a slice's end it either lets the leg go on
(the engine never sees that boundary) or closes it (the worker aborts it) and
starts the rest where it is placed. The client sees one
stream: a slice's last message is forwarded without ``finished``, and nothing is
re-sent. Only neutral instances take slices (a slice is prefill and decode on
one instance); a fleet without schedulable neutral instances refuses the
request with ``UNAVAILABLE``.

``--dispatch-mode auto`` (:mod:`router.core.auto_dispatch`) starts with request
dispatch and moves new arrivals to slices once the engines' preemption counts
(the instances' status) show that slices pay.
"""

from __future__ import annotations

import argparse

from router.core.slicing import SliceConfig, add_slice_arguments, slice_config_of

#: ``--dispatch-mode`` values.
DISPATCH_MODES = ("request", "slice", "auto")


# --------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--dispatch-mode``, ``--slice-tokens`` and ``--slice-interval-ms`` (router and ``up``)."""
    group = parser.add_argument_group("dispatch")
    group.add_argument(
        "--dispatch-mode",
        choices=DISPATCH_MODES,
        default="request",
        help="request: place each whole request (the scheduling policy); slice: place requests "
        "--slice-tokens new tokens at a time, batched and offloaded max-min to neutral instances (SCLS, "
        "seed 002). On continuous-batching engines slices pay where the KV does not hold the load: "
        "where request dispatch makes the engines preempt about once per ten requests or more, slices "
        "keep a KV plan that holds, complete every request without preempting and do 1.0x-3x the "
        "work on long prompts and small KV; with long answers (hundreds of tokens) they do 0.91x-1.0x "
        "(a smaller decode batch, and a first slice waits for room; a slice that stays where it ran "
        "continues its leg there within that instance's KV, shortened to the room, else moved or "
        "waiting for an instance with room, so a boundary costs a re-prefill only where a slice moves "
        "or waits), and everywhere they lose SLO attainment to slo (a first slice "
        "waits for a schedule point and room in the plan: TTFT grows); where the KV holds request "
        "dispatch wins outright (slices 0.91-0.97x, attainment down by up to half). Where prompts "
        "share prefixes the engines cache (system prompts, documents), the slice plan books each prefix "
        "once per instance and sends a batch where its prefix is cached: 1.0x-1.6x request dispatch on "
        "shared-prefix mixes at 12-24k of KV; on the Mooncake conversations (long private histories) "
        "0.95-0.96x: keep request dispatch there (auto does). auto: finds that line live: request "
        "dispatch (the queue policy) while it reads what the engines' preemptions cost over at least its "
        "first 100 requests (the instances' status: the tokens the engines computed again for the "
        "requests they preempted, beyond their prefix caches, or only the preemption count where an "
        "engine does not say, or where most prompt tokens repeat an earlier prompt's prefix), then "
        "slices for every new arrival from the moment those tokens reach a quarter of the prompt tokens "
        "dispatched (or the engines preempted once per ten requests; requests already placed finish "
        "where they are); it stays on request dispatch if the first 100 end under that, or if the "
        "engines do not count preemptions (vLLM's own gRPC server behind 'slo-router agent'); the "
        "choice is logged and exported as slo_router_dispatch_mode. auto sees preemptions only: on a "
        "fleet of unequal instances where request dispatch loses to imbalance, not to preemptions "
        "(codegen on a fast 48k group beside a slow 12k group: slices 1.4x), it switches late or never; "
        "choose slice there. "
        "slice and auto take neutral instances only (default: %(default)s)",
    )
    add_slice_arguments(
        group,
        interval_help="slice mode: fixed time between schedule points (default: adaptive, "
        "max(0.5 x queued work of the least-loaded instance, 200 ms))",
    )


def slice_config_from_args(args: argparse.Namespace) -> SliceConfig | None:
    """The slice configuration the flags ask for (``slice`` and ``auto``), or ``None`` for request
    dispatch; errors name the flag."""
    if args.dispatch_mode == "request":
        return None
    return slice_config_of(args.slice_tokens, args.slice_interval_ms)


def dispatcher_from_args(args: argparse.Namespace) -> str:
    """The dispatcher ``--dispatch-mode`` names instead of the queue policy's ("" for ``request``)."""
    return "" if args.dispatch_mode == "request" else str(args.dispatch_mode)
