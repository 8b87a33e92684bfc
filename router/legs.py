"""What a worker protocol's client needs from the router's forwarding, and nothing more.

:class:`router.forward.WorkerClient` serves this project's ``Worker`` protocol itself and hands
other protocols' endpoints (``vllm-grpc://``, :mod:`router.vllm_grpc`) to their own client. Those
clients reach back for the shared parts — deadlines, outcome reports to the outlier detector, the
error type, background tasks — through :class:`LegOwner`, so they depend on this module and not on
``router.forward`` (which depends on them).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

import grpc


class Target(Protocol):
    """Where a leg runs (a scheduler :class:`~router.core.decision.Choice` is one)."""

    @property
    def instance_id(self) -> str: ...

    @property
    def endpoint(self) -> str: ...


@dataclass
class LegLedger:
    """Worker endpoints that may hold state for a request (to abort on cancel)."""

    endpoints: set[str] = field(default_factory=set)


class LegOwner(Protocol):
    """The forwarding's shared mechanism, as a protocol client calls it (WorkerClient is one).

    The ``failed*`` and ``first_message_error`` methods report the outcome to the outlier
    detector and return the error to raise; ``succeeded`` reports a success.
    """

    @property
    def first_message_timeout_s(self) -> float: ...

    def succeeded(self, target: Target) -> None: ...

    def failed(self, target: Target, code: grpc.StatusCode, details: str) -> Exception: ...

    def failed_call(self, target: Target, exc: grpc.aio.AioRpcError) -> Exception: ...

    def first_message_error(self, target: Target) -> Exception: ...

    def keep(self, task: asyncio.Task[None]) -> None: ...

    async def await_channel(self, channel: grpc.aio.Channel, target: Target) -> None: ...
