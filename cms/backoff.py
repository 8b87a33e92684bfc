"""Retry timing shared by the CMS clients: capped exponential backoff with full jitter."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_random_exponential

#: First backoff window; each failure doubles it up to the cap.
BACKOFF_INITIAL_S = 0.1
#: Shortest wait between attempts, so a failing peer never sees a hot loop.
BACKOFF_MIN_S = 0.02


def retrying(
    *,
    backoff_max_s: float,
    retry_on: type[BaseException],
    before_sleep: Callable[[RetryCallState], Awaitable[None] | None] | None = None,
) -> AsyncRetrying:
    """Retry forever on ``retry_on``, waiting uniformly in [min, min(cap, 0.1 s * 2^n)]."""
    if not backoff_max_s > 0:
        raise ValueError(f"backoff_max_s must be > 0, got {backoff_max_s}")
    return AsyncRetrying(
        wait=wait_random_exponential(
            multiplier=BACKOFF_INITIAL_S,
            max=backoff_max_s,
            min=min(BACKOFF_MIN_S, backoff_max_s),
        ),
        retry=retry_if_exception_type(retry_on),
        before_sleep=before_sleep,
        reraise=True,
    )


def channel_options(backoff_max_s: float) -> list[tuple[str, int]]:
    """gRPC channel options that keep its own reconnect backoff within ours.

    gRPC's default grows to 120 s, which would leave a client idle long after
    its CMS came back.
    """
    cap_ms = max(100, round(backoff_max_s * 1000))
    return [
        ("grpc.initial_reconnect_backoff_ms", min(100, cap_ms)),
        ("grpc.min_reconnect_backoff_ms", min(100, cap_ms)),
        ("grpc.max_reconnect_backoff_ms", cap_ms),
    ]


def strip_grpc_scheme(target: str) -> str:
    """``grpc://host:port`` or ``host:port`` → ``host:port``."""
    target = target.removeprefix("grpc://")
    if not target or "://" in target:
        raise ValueError(f"CMS target {target!r} is not host:port or grpc://host:port")
    return target
