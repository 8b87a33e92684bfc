"""What a worker protocol's client needs from the router's forwarding, and nothing more.

:class:`router.forward.WorkerClient` serves this project's ``Worker`` protocol itself and hands
other protocols' endpoints (``vllm-grpc://``, :mod:`router.vllm_grpc`) to their own client. Those
clients reach back for the shared parts — deadlines, outcome reports to the outlier detector, the
error type, background tasks — through :class:`LegOwner`, so they depend on this module and not on
``router.forward`` (which depends on them).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Protocol

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


#: The end-of-stream marker ``call.read()`` returns (missing from the type stubs).
_EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]


async def ready_batches(call: Any) -> AsyncGenerator[list[Any], None]:
    """The rest of a server stream, as lists of the messages that arrived while the consumer worked.

    A reader task drains ``call``; each step of the consumer takes everything it read meanwhile,
    so a consumer that falls behind gets one batch instead of one message at a time (the list
    holds at most what the stream sent). Messages that arrived before an upstream failure are
    delivered before its ``grpc.aio.AioRpcError`` is raised. Use it under
    ``contextlib.aclosing`` so the reader stops as soon as the consumer does.
    """
    pending: list[Any] = []
    ready = asyncio.Event()
    done = False
    failure: grpc.aio.AioRpcError | None = None

    async def pump() -> None:
        nonlocal done, failure
        try:
            while (message := await call.read()) is not _EOF:
                pending.append(message)
                ready.set()
        except grpc.aio.AioRpcError as exc:
            failure = exc
        finally:
            done = True
            ready.set()

    reader = asyncio.get_running_loop().create_task(pump())
    try:
        while True:
            if not pending and not done:
                ready.clear()
                await ready.wait()
            if pending:
                batch = pending[:]
                pending.clear()
                yield batch
                continue
            if failure is not None:
                raise failure
            return
    finally:
        if not reader.done():
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader


async def paced_batches(call: Any, interval_s: float) -> AsyncGenerator[list[Any], None]:
    """Like :func:`ready_batches`, and at most one batch per ``interval_s`` while the stream runs.

    For an upstream that sends one message per token per engine step (vLLM's ``Generate``):
    relaying each as a message of its own costs the router a gRPC write (a ``sendmsg``, a wake-up
    of gRPC's poller) per token and per stream, which on a small host takes the cores the engine
    needs. Here a batch that is ready less than ``interval_s`` after the previous one was taken
    waits for the rest of the interval, collecting what arrives meanwhile; the end of the stream
    (or its failure) is delivered at once. So a message is at most ``interval_s`` late and the
    write rate per stream is at most ``1 / interval_s``. ``interval_s`` 0 is :func:`ready_batches`'s
    behaviour. One future per wait (no :class:`asyncio.Event`, no timeout task): this runs per token.
    """
    loop = asyncio.get_running_loop()
    pending: list[Any] = []
    waiter: asyncio.Future[None] | None = None
    holding = False
    done = False
    failure: grpc.aio.AioRpcError | None = None

    def wake() -> None:
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def pump() -> None:
        nonlocal done, failure
        try:
            while (message := await call.read()) is not _EOF:
                pending.append(message)
                if not holding:
                    wake()
        except grpc.aio.AioRpcError as exc:
            failure = exc
        finally:
            done = True
            wake()

    reader = loop.create_task(pump())
    taken = -math.inf
    try:
        while True:
            if not pending and not done:
                waiter = loop.create_future()
                await waiter
            if pending and not done and interval_s > 0:
                delay = taken + interval_s - loop.time()
                if delay > 0:
                    holding = True
                    waiter = loop.create_future()
                    timer = loop.call_later(delay, wake)
                    try:
                        await waiter
                    finally:
                        timer.cancel()
                        holding = False
            if pending:
                batch = pending[:]
                pending.clear()
                yield batch
                taken = loop.time()
                continue
            if failure is not None:
                raise failure
            return
    finally:
        if not reader.done():
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader


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
