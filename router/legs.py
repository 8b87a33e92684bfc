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


#: The longest a paced relay holds a stream's tokens however many streams share the budget
#: (:class:`RelayPacer`): about the time between two frames of a screen, so a reader sees a stream
#: as steady while the router's writes stay bounded.
MAX_RELAY_HOLD_S = 0.05


class RelayPacer:
    """How long a paced relay (:func:`paced_batches`) holds a stream's tokens, for all its streams.

    ``min_interval_s`` (``--vllm-stream-interval-ms``) is the hold of one stream; with
    ``messages_per_s`` (``--vllm-stream-messages-per-s``) > 0 it is stretched so that the streams
    running together write about that many messages per second: ``active / messages_per_s``, at
    most :data:`MAX_RELAY_HOLD_S`. The router's cost on this path is per message (a gRPC write is a
    ``sendmsg`` and wake-ups of gRPC's poller and the event loop), so a fixed interval lets its
    CPU grow with the number of streams until it takes the cores the engines need; a budget keeps
    the write rate flat and lets each message carry more tokens instead. A few streams keep the
    short interval. ``min_interval_s`` 0 turns pacing off altogether.
    """

    __slots__ = ("active", "messages_per_s", "min_interval_s")

    def __init__(self, min_interval_s: float, messages_per_s: float = 0.0) -> None:
        if not (math.isfinite(min_interval_s) and min_interval_s >= 0):
            raise ValueError(f"min_interval_s must be a finite number >= 0, got {min_interval_s!r}")
        if not (math.isfinite(messages_per_s) and messages_per_s >= 0):
            raise ValueError(f"messages_per_s must be a finite number >= 0, got {messages_per_s!r}")
        self.min_interval_s = min_interval_s
        self.messages_per_s = messages_per_s
        #: Paced streams running now (past their first message).
        self.active = 0

    def interval_s(self) -> float:
        """The hold now: see the class docstring."""
        base = self.min_interval_s
        if base <= 0 or self.messages_per_s <= 0:
            return base
        return max(base, min(MAX_RELAY_HOLD_S, self.active / self.messages_per_s))


async def paced_batches(call: Any, interval_s: float | RelayPacer) -> AsyncGenerator[list[Any], None]:
    """Like :func:`ready_batches`, and at most one batch per ``interval_s`` while the stream runs.

    For an upstream that sends one message per token per engine step (vLLM's ``Generate``):
    relaying each as a message of its own costs the router a gRPC write (a ``sendmsg``, a wake-up
    of gRPC's poller) per token and per stream, which on a small host takes the cores the engine
    needs. Here a batch that is ready less than ``interval_s`` after the previous one was taken
    waits for the rest of the interval, collecting what arrives meanwhile; the end of the stream
    (or its failure) is delivered at once. So a message is at most ``interval_s`` late and the
    write rate per stream is at most ``1 / interval_s``. ``interval_s`` 0 is :func:`ready_batches`'s
    behaviour. A :class:`RelayPacer` instead of a number stretches the interval with the number of
    streams it paces. After each batch the consumer sleeps out the interval at once and takes what
    came meanwhile, so a streaming relay wakes once per batch (not also at the first message after
    it); only after an interval with nothing in it does it wait for the next message, which then
    goes out at once. One future per wait (no :class:`asyncio.Event`, no timeout task): this runs
    per token.
    """
    pacer = interval_s if isinstance(interval_s, RelayPacer) else RelayPacer(interval_s)
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
    pacer.active += 1
    try:
        while True:
            if not pending and not done:
                waiter = loop.create_future()
                await waiter
            if pending:
                batch = pending[:]
                pending.clear()
                yield batch
                if pacer.min_interval_s > 0 and not done:
                    # Sleep out the interval at once (the reader does not wake a holding
                    # consumer; the end of the stream does): one wake-up per batch.
                    holding = True
                    waiter = loop.create_future()
                    timer = loop.call_later(pacer.interval_s(), wake)
                    try:
                        await waiter
                    finally:
                        timer.cancel()
                        holding = False
                continue
            if failure is not None:
                raise failure
            return
    finally:
        pacer.active -= 1
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

    @property
    def connect_timeout_s(self) -> float: ...

    def succeeded(self, target: Target) -> None: ...

    def failed(self, target: Target, code: grpc.StatusCode, details: str) -> Exception: ...

    def failed_call(self, target: Target, exc: grpc.aio.AioRpcError) -> Exception: ...

    def first_message_error(self, target: Target) -> Exception: ...

    def keep(self, task: asyncio.Task[None]) -> None: ...

    async def await_channel(self, channel: grpc.aio.Channel, target: Target) -> None: ...
