"""``Worker.Streams``: many requests' legs on one stream, one batch of tokens per flush.

With the per-request RPCs (``Generate``/``Decode``) a worker running 30
requests sends 30 messages per engine step, and the router pays gRPC's
per-message cost (two completion-queue events, a dozen system calls, GIL
hand-offs) for each. On ``Streams`` the router starts and aborts legs with
commands on one long-lived stream per connection, and this side sends, per
flush, ONE :class:`~slorouter.v1.worker_pb2.StreamBatch` holding the new
tokens of every leg that produced some.

Commands: a message may carry several (``StreamCommand.batched``, offered in
the first batch); they apply in order in one loop iteration, so the legs a
client started together begin their engine requests together (see
:meth:`StreamsSession._message`).

How a flush is cut: each leg has a task that drains its engine stream into
a per-leg pending record and wakes the writer. The engine's step loop hands
out the deltas of one step together (the tasks wake in the same loop
iteration), and the writer yields once to the loop before it takes what is
pending, so one step's tokens go out as one batch. With ``stream_interval_s``
the writer also holds the next batch until that long after the previous one.

Bounds: a leg's pending record merges what the writer has not sent yet (a
router that reads slowly gets fewer, larger updates), so it holds at most the
request's own output; at most :data:`cms.limits.MAX_STREAM_LEGS` legs run on
one stream (a start beyond it fails that leg with RESOURCE_EXHAUSTED); every
command carries the bounds of the request it wraps (``check_stream_command``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from slorouter.v1 import worker_pb2

from cms import limits
from engine.interface import Engine, EngineError, InvalidRequestError, TokenDelta

logger = logging.getLogger(__name__)

_Context = grpc.aio.ServicerContext[worker_pb2.StreamCommand, worker_pb2.StreamBatch]
#: Opens a leg: (prompt tokens, the engine's delta stream), or raises EngineError.
Opener = Callable[[worker_pb2.StreamCommand], tuple[int, AsyncIterator[TokenDelta]]]
StatusFor = Callable[[EngineError], grpc.StatusCode]
_EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]


class _Pending:
    """What one leg produced since the last batch (merged)."""

    __slots__ = ("cached", "details", "error", "finish_reason", "finished", "num_prompt", "text", "token_ids")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.finished = False
        self.finish_reason = ""
        self.num_prompt = 0
        self.cached = 0
        self.error = 0
        self.details = ""

    def update(self, stream_id: int) -> worker_pb2.StreamUpdate:
        return worker_pb2.StreamUpdate(
            stream_id=stream_id,
            token_ids=self.token_ids,
            text="".join(self.text),
            finished=self.finished,
            finish_reason=self.finish_reason,
            num_prompt_tokens=self.num_prompt,
            num_cached_prompt_tokens=self.cached,
            error_code=self.error,
            error_details=self.details,
        )


class StreamsSession:
    """One ``Worker.Streams`` call: reads commands, runs the legs, writes batches."""

    def __init__(
        self,
        engine: Engine,
        context: _Context,
        open_leg: Opener,
        status_for: StatusFor,
        stream_interval_s: float = 0.0,
    ) -> None:
        self._engine = engine
        self._context = context
        self._open_leg = open_leg
        self._status_for = status_for
        self._interval_s = stream_interval_s
        self._legs: dict[int, asyncio.Task[None]] = {}
        self._pending: dict[int, _Pending] = {}
        self._ready = asyncio.Event()
        self._reading = True

    async def run(self) -> None:
        """Serve the call until the client closes it (or cancels: every leg is aborted then)."""
        # "This worker serves Streams", and reads several commands per message.
        await self._context.write(worker_pb2.StreamBatch(accepts_batched_commands=True))
        reader = asyncio.get_running_loop().create_task(self._read())
        try:
            await self._write_loop()
        finally:
            reader.cancel()
            legs = list(self._legs.values())
            self._legs.clear()
            for task in legs:
                task.cancel()  # each aborts its request on the engine
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            if legs:
                await asyncio.gather(*legs, return_exceptions=True)

    # ------------------------------------------------------------------ commands

    async def _read(self) -> None:
        try:
            while (message := await self._context.read()) is not _EOF:
                assert isinstance(message, worker_pb2.StreamCommand)
                self._message(message)
        except grpc.aio.AioRpcError as exc:  # the call broke: the writer ends with it
            logger.debug("Streams: reading commands failed: %s", exc.code().name)
        finally:
            self._reading = False
            self._ready.set()

    def _message(self, message: worker_pb2.StreamCommand) -> None:
        """One message's commands, in order, in this loop iteration.

        The legs they start begin their engine requests together in the next
        iteration, so the legs of a burst a client wrote as one message reach
        the engine before it starts its next step (one at a time, the first
        would start a step alone and the others wait for the next).
        """
        if not message.batched:
            self._command(message)
            return
        try:
            limits.check_stream_message(message)
        except limits.FieldLimitError as exc:
            problem = str(exc)
        else:
            problem = ""
        commands = list(message.batched)
        if message.WhichOneof("command") is not None:
            commands.insert(0, message)
        for command in commands:
            if problem and command.WhichOneof("command") != "abort":
                # Aborts still apply (they only stop legs); no leg starts from such a message.
                self._fail(command.stream_id, grpc.StatusCode.INVALID_ARGUMENT, problem)
            else:
                self._command(command)

    def _command(self, command: worker_pb2.StreamCommand) -> None:
        sid = command.stream_id
        kind = command.WhichOneof("command")
        if kind == "abort":
            task = self._legs.pop(sid, None)
            self._pending.pop(sid, None)
            if task is not None:
                task.cancel()  # aborts the request on the engine (see _pump)
            return
        if sid in self._legs:
            self._fail(
                sid, grpc.StatusCode.ALREADY_EXISTS, f"stream_id: {sid} is already running on this stream"
            )
            return
        if len(self._legs) >= limits.MAX_STREAM_LEGS:
            self._fail(
                sid,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"Streams: {len(self._legs)} legs run on this stream; the limit is {limits.MAX_STREAM_LEGS}",
            )
            return
        try:
            try:
                limits.check_stream_command(command)
            except limits.FieldLimitError as exc:
                raise InvalidRequestError(str(exc)) from None
            num_prompt, stream = self._open_leg(command)
        except EngineError as exc:
            self._fail(sid, self._status_for(exc), str(exc) or type(exc).__name__)
            return
        request_id = command.generate.request_id if kind == "generate" else command.decode.request_id
        self._legs[sid] = asyncio.get_running_loop().create_task(
            self._pump(sid, request_id, num_prompt, stream), name=f"streams-leg-{request_id}"
        )

    # ------------------------------------------------------------------ legs

    def _slot(self, sid: int) -> _Pending:
        pending = self._pending.get(sid)
        if pending is None:
            pending = self._pending[sid] = _Pending()
            self._ready.set()
        return pending

    def _fail(self, sid: int, code: grpc.StatusCode, details: str) -> None:
        pending = self._slot(sid)
        pending.error = code.value[0]
        pending.details = details

    async def _pump(
        self, sid: int, request_id: str, num_prompt: int, stream: AsyncIterator[TokenDelta]
    ) -> None:
        finished = False
        first = True
        try:
            async for delta in stream:
                pending = self._slot(sid)
                pending.token_ids.extend(delta.token_ids)
                if delta.text:
                    pending.text.append(delta.text)
                if first or delta.finished:
                    pending.num_prompt = num_prompt
                if delta.num_cached_prompt_tokens:
                    pending.cached = delta.num_cached_prompt_tokens
                first = False
                if delta.finished:
                    finished = pending.finished = True
                    pending.finish_reason = delta.finish_reason
                    break
            if not finished:
                self._fail(sid, grpc.StatusCode.INTERNAL, "the engine's stream ended without a final delta")
        except EngineError as exc:
            self._fail(sid, self._status_for(exc), str(exc) or type(exc).__name__)
        except asyncio.CancelledError:
            # Aborted by the client (or the call went away): the request must not keep running.
            if not finished:
                await self._engine.abort(request_id)
            raise
        except Exception as exc:  # a bug in a backend: fail the leg, as the per-request RPC would (UNKNOWN)
            logger.exception("Streams: leg %s failed", request_id)
            self._fail(sid, grpc.StatusCode.UNKNOWN, f"{type(exc).__name__}: {exc}")
        finally:
            if self._legs.get(sid) is asyncio.current_task():
                del self._legs[sid]
            aclose: Any = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    # ------------------------------------------------------------------ batches

    async def _write_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending:
                if not self._reading and not self._legs:
                    return
                self._ready.clear()
                await self._ready.wait()
                continue
            # The other legs of this engine step wake in this loop iteration: take them too.
            await asyncio.sleep(0)
            pending, self._pending = self._pending, {}
            sent_at = loop.time()
            await self._context.write(
                worker_pb2.StreamBatch(updates=[p.update(sid) for sid, p in pending.items()])
            )
            if self._interval_s:
                # As --stream-interval-ms on the per-request RPCs: what the steps in between
                # produce is merged into the next batch.
                wait = self._interval_s - (loop.time() - sent_at)
                if wait > 0:
                    await asyncio.sleep(wait)
