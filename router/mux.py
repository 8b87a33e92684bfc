"""The router's side of ``Worker.Streams``: one stream per worker connection, demultiplexed.

A :class:`MuxConnection` holds one long-lived ``Streams`` call to a worker.
Legs (a neutral ``Generate`` or a ``Decode``) are started on it with a
command carrying a connection-unique ``stream_id``; one reader task takes the
worker's batches (one per engine step, with the new tokens of every leg that
produced some) and hands each update to its :class:`MuxLeg`, whose consumer
(:meth:`router.forward.WorkerClient.stream`) turns what is pending into one
:class:`Tokens` record (the fields of a ``WorkerTokens`` message), as the
per-request path's coalescing does.

Commands queued while the writer was busy (a burst of requests started in
one loop iteration) go out as one message (``StreamCommand.batched``) when the
worker's first batch offers it: one message to write and read instead of one
per leg, and the worker hands the burst to its engine at once.

Backpressure: the reader never waits for a consumer (one slow client must not
stall every other request on the connection). A leg merges what its consumer
has not taken yet into one pending record, so it holds at most the request's
own output; a leg whose pending tokens would pass ``limits.MAX_OUTPUT_TOKENS``
(a worker sending more than any request may produce) fails with
RESOURCE_EXHAUSTED and is aborted on the worker. The commands waiting to be
written are at most two per leg (a start and an abort).

Failure: when the call breaks (the worker was killed, its connection timed out
on keepalive, the channel closed) every leg still on it fails with the call's
status, exactly as each of their per-request calls would have; the connection
is dropped and the next leg to that endpoint opens a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import grpc
from slorouter.v1 import worker_pb2, worker_pb2_grpc

from cms import limits

logger = logging.getLogger(__name__)

_EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]
_CODES: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


class Tokens:
    """What a leg produced since its consumer's previous take (the fields of ``WorkerTokens``).

    A plain record rather than a ``WorkerTokens`` message: the router only reads it (the
    service copies what it forwards), and building a protobuf message per token, then
    reading its fields back through wrappers, was a measurable share of the token path.
    """

    __slots__ = (
        "finish_reason",
        "finished",
        "num_cached_prompt_tokens",
        "num_prompt_tokens",
        "request_id",
        "text",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        token_ids: list[int],
        text: str,
        finished: bool,
        finish_reason: str,
        num_prompt_tokens: int,
        num_cached_prompt_tokens: int,
    ) -> None:
        self.request_id = request_id
        self.token_ids = token_ids
        self.text = text
        self.finished = finished
        self.finish_reason = finish_reason
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_prompt_tokens = num_cached_prompt_tokens


class MuxLeg:
    """One request's leg on a :class:`MuxConnection`: the merged updates its consumer has not taken."""

    __slots__ = (
        "cached",
        "error",
        "expired",
        "finish_reason",
        "finished",
        "num_prompt",
        "num_tokens",
        "ready",
        "request_id",
        "stream_id",
        "text",
        "token_ids",
        "waiter",
    )

    def __init__(self, stream_id: int, request_id: str) -> None:
        self.stream_id = stream_id
        self.request_id = request_id
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.finished = False
        self.finish_reason = ""
        self.num_prompt = 0
        self.cached = 0
        #: Tokens received in all (the bound of the pending record).
        self.num_tokens = 0
        #: (code, details) once the leg failed; raised after the tokens received before it.
        self.error: tuple[grpc.StatusCode, str] | None = None
        #: The error is a deadline of the router's (the worker still runs the leg: abort it).
        self.expired = False
        #: Something to take (or an error): the consumer does not wait.
        self.ready = False
        #: The consumer's wait, while it waits. A bare future rather than an ``asyncio.Event``:
        #: ``Event.wait`` looks the running loop up on every call (a ``getpid`` system call in
        #: CPython's check), once per token.
        self.waiter: asyncio.Future[None] | None = None

    def take(self) -> Tokens | None:
        """What arrived since the last call as one record (None: nothing but, maybe, an error)."""
        text = self.text
        if not (self.token_ids or self.finished or text or self.num_prompt or self.cached):
            return None
        message = Tokens(
            self.request_id,
            self.token_ids,
            (text[0] if len(text) == 1 else "".join(text)) if text else "",
            self.finished,
            self.finish_reason,
            self.num_prompt,
            self.cached,
        )
        self.token_ids = []
        if text:
            self.text = []
        self.num_prompt = 0
        self.cached = 0
        return message

    def expire(self, details: str) -> None:
        """A deadline passed (a timer of the consumer's): the leg fails DEADLINE_EXCEEDED."""
        if self.error is None and not self.finished:
            self.expired = True
            self.fail(grpc.StatusCode.DEADLINE_EXCEEDED, details)

    def fail(self, code: grpc.StatusCode, details: str) -> None:
        if self.error is None and not self.finished:
            self.error = (code, details)
            self.notify()

    def notify(self) -> None:
        """Wake the consumer: there is something to take."""
        self.ready = True
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class MuxConnection:
    """One ``Worker.Streams`` call to an endpoint and the legs running on it."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        stub: worker_pb2_grpc.WorkerAsyncStub,
        endpoint: str,
        on_closed: Callable[[MuxConnection], None],
    ) -> None:
        self.channel = channel
        self.endpoint = endpoint
        self._stub = stub
        self._on_closed = on_closed
        self._legs: dict[int, MuxLeg] = {}
        self._next_id = 0
        self._outbox: deque[worker_pb2.StreamCommand] = deque()
        self._outbox_ready = asyncio.Event()
        self._call: Any = None
        #: The worker reads several commands per message (it said so in its first batch).
        self._batch_commands = False
        #: Done when the worker's first (empty) batch arrived; its exception when the call failed first.
        self.opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # Its failure is read by the legs waiting on it; there may be none left to read it.
        self.opened.add_done_callback(lambda future: future.cancelled() or future.exception())
        self.closed = False
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"streams-{endpoint}")

    def __len__(self) -> int:
        return len(self._legs)

    # ------------------------------------------------------------------ legs

    def start(self, request: worker_pb2.WorkerGenerateRequest | worker_pb2.DecodeRequest) -> MuxLeg:
        """Start a leg (the command is written in the background)."""
        self._next_id += 1
        sid = self._next_id
        leg = MuxLeg(sid, request.request_id)
        if self.closed:
            leg.fail(grpc.StatusCode.UNAVAILABLE, f"the Streams call to {self.endpoint} is closed")
            return leg
        self._legs[sid] = leg
        if isinstance(request, worker_pb2.DecodeRequest):
            self._send(worker_pb2.StreamCommand(stream_id=sid, decode=request))
        else:
            self._send(worker_pb2.StreamCommand(stream_id=sid, generate=request))
        return leg

    def release(self, leg: MuxLeg) -> None:
        """Forget a leg that ended (finished or failed on the worker's word): nothing to abort."""
        self._legs.pop(leg.stream_id, None)

    def abort(self, leg: MuxLeg) -> None:
        """Stop a leg the consumer left before its end: the worker aborts its request."""
        if self._legs.pop(leg.stream_id, None) is not None and not self.closed:
            self._send(
                worker_pb2.StreamCommand(
                    stream_id=leg.stream_id, abort=worker_pb2.AbortRequest(request_id=leg.request_id)
                )
            )

    def _send(self, command: worker_pb2.StreamCommand) -> None:
        self._outbox.append(command)
        self._outbox_ready.set()

    # ------------------------------------------------------------------ the call

    async def close(self) -> None:
        """Cancel the call (every leg on it fails UNAVAILABLE) and wait for the reader to end."""
        if self._call is not None:
            self._call.cancel()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _write(self, call: Any) -> None:
        outbox = self._outbox
        while True:
            while outbox:
                message = outbox.popleft()
                if outbox and self._batch_commands:
                    # What queued meanwhile goes in the same message: one gRPC message to
                    # write and read, and the legs of a burst reach the engine together.
                    size = message.ByteSize()
                    batched: list[worker_pb2.StreamCommand] = []
                    while outbox and len(batched) < limits.MAX_STREAM_BATCHED_COMMANDS:
                        size += outbox[0].ByteSize()
                        if size > limits.STREAM_COMMANDS_BATCH_BYTES:
                            break
                        batched.append(outbox.popleft())
                    message.batched.extend(batched)
                await call.write(message)
            self._outbox_ready.clear()
            await self._outbox_ready.wait()

    async def _run(self) -> None:
        call = self._call = self._stub.Streams()  # type: ignore[call-arg]  # written with call.write
        writer: asyncio.Task[None] | None = None
        failure: tuple[grpc.StatusCode, str] = (
            grpc.StatusCode.UNAVAILABLE,
            f"the worker at {self.endpoint} ended the Streams call",
        )
        try:
            hello = await call.read()
            if hello is _EOF:
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), failure[1], ""
                )
            self._batch_commands = bool(hello.accepts_batched_commands)  # type: ignore[attr-defined]
            self.opened.set_result(None)
            writer = asyncio.get_running_loop().create_task(self._write(call))
            legs = self._legs
            while (batch := await call.read()) is not _EOF:
                for update in batch.updates:  # type: ignore[attr-defined]
                    leg = legs.get(update.stream_id)
                    if leg is None:  # aborted meanwhile
                        continue
                    if update.error_code:
                        legs.pop(update.stream_id, None)
                        code = _CODES.get(update.error_code, grpc.StatusCode.UNKNOWN)
                        leg.fail(code, update.error_details)
                        continue
                    ids = update.token_ids
                    if ids:
                        leg.num_tokens += len(ids)
                        if leg.num_tokens > limits.MAX_OUTPUT_TOKENS:
                            self.abort(leg)
                            leg.fail(
                                grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"token_ids: the worker sent {leg.num_tokens} tokens for one request; "
                                f"the limit is {limits.MAX_OUTPUT_TOKENS}",
                            )
                            continue
                        leg.token_ids.extend(ids)
                    if update.text:
                        leg.text.append(update.text)
                    if update.num_prompt_tokens:
                        leg.num_prompt = update.num_prompt_tokens
                    if update.num_cached_prompt_tokens:
                        leg.cached = update.num_cached_prompt_tokens
                    if update.finished:
                        legs.pop(update.stream_id, None)
                        leg.finished = True
                        leg.finish_reason = update.finish_reason
                    leg.ready = True  # leg.notify(), inline (once per token)
                    waiter = leg.waiter
                    if waiter is not None and not waiter.done():
                        waiter.set_result(None)
        except grpc.aio.AioRpcError as exc:
            failure = (exc.code(), exc.details() or "")
            if not self.opened.done():
                self.opened.set_exception(exc)
        except asyncio.CancelledError:
            failure = (grpc.StatusCode.UNAVAILABLE, f"the Streams call to {self.endpoint} was closed")
            raise
        finally:
            self.closed = True
            if writer is not None:
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                    await writer
            call.cancel()
            if not self.opened.done():
                self.opened.set_exception(
                    grpc.aio.AioRpcError(failure[0], grpc.aio.Metadata(), grpc.aio.Metadata(), failure[1], "")
                )
            legs_left = list(self._legs.values())
            self._legs.clear()
            for leg in legs_left:
                leg.fail(*failure)
            self._on_closed(self)
