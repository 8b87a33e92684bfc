"""Running one request's legs on the workers: prefill, decode, neutral generate.

The servicer decides *where*; this module does the talking. Every worker call
has a deadline, a failure is classified once (retry elsewhere, recompute the
KV, or give up), and every leg that may hold state on a worker is remembered
so that a cancelled request can be aborted everywhere it ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import grpc
from slorouter.v1 import common_pb2, worker_pb2

from router.pool import ChannelPool

logger = logging.getLogger(__name__)

#: Codes that say "this instance could not do it": try another one.
RETRYABLE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)
#: Codes a Decode returns when the kv handle can no longer be pulled: recompute instead.
KV_GONE_CODES = frozenset({grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION})


class LegError(Exception):
    """A worker call failed.

    ``retryable`` means another instance may succeed; otherwise the request
    itself is at fault (the worker said INVALID_ARGUMENT, ...), and the code
    and message go back to the client.
    """

    def __init__(
        self, instance_id: str, code: grpc.StatusCode, details: str, *, kv_gone: bool = False
    ) -> None:
        super().__init__(f"{instance_id}: {code.name}: {details}")
        self.instance_id = instance_id
        self.code = code
        self.details = details
        self.kv_gone = kv_gone

    @property
    def retryable(self) -> bool:
        return self.code in RETRYABLE_CODES


def _leg_error(instance_id: str, exc: grpc.aio.AioRpcError) -> LegError:
    code = exc.code()
    return LegError(instance_id, code, exc.details() or "", kv_gone=code in KV_GONE_CODES)


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


def _merge(batch: list[worker_pb2.WorkerTokens]) -> worker_pb2.WorkerTokens:
    if len(batch) == 1:
        return batch[0]
    last = batch[-1]
    return worker_pb2.WorkerTokens(
        request_id=last.request_id,
        token_ids=[t for m in batch for t in m.token_ids],
        text="".join(m.text for m in batch),
        finished=last.finished,
        finish_reason=last.finish_reason,
        num_prompt_tokens=batch[0].num_prompt_tokens,
        num_cached_prompt_tokens=max(m.num_cached_prompt_tokens for m in batch),
    )


async def _coalesced(
    call: grpc.aio.UnaryStreamCall[Any, worker_pb2.WorkerTokens],
) -> AsyncIterator[worker_pb2.WorkerTokens]:
    """The messages of ``call``, merged when they arrive faster than the consumer takes them.

    A reader task drains the upstream stream into a list; each step of the
    consumer takes everything that arrived meanwhile as one message. So when
    the client (or the router itself) falls behind, every token that is ready
    goes out in one message instead of one message per token. The list holds
    at most the request's own tokens. Tokens that arrived before an upstream
    failure are delivered before the failure is raised.
    """
    # The first message goes straight through: no reader task yet, nothing to merge (TTFT path).
    first = await call.read()
    if first is _EOF:
        return
    assert isinstance(first, worker_pb2.WorkerTokens)
    yield first
    if first.finished:
        return

    pending: list[worker_pb2.WorkerTokens] = []
    ready = asyncio.Event()
    done = False
    failure: BaseException | None = None

    async def pump() -> None:
        nonlocal done, failure
        try:
            while (message := await call.read()) is not _EOF:
                pending.append(cast(worker_pb2.WorkerTokens, message))
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
                yield _merge(batch)
                continue
            if failure is not None:
                raise failure
            return
    finally:
        if not reader.done():
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader


class WorkerClient:
    """Calls the Worker service of the instances a request is placed on."""

    def __init__(self, pool: ChannelPool, *, abort_timeout_s: float = 1.0) -> None:
        self._pool = pool
        self._abort_timeout_s = abort_timeout_s
        self._background: set[asyncio.Task[None]] = set()

    async def prefill(
        self,
        target: Target,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: common_pb2.SamplingParams,
        timeout_s: float,
        ledger: LegLedger,
    ) -> worker_pb2.PrefillResponse:
        ledger.endpoints.add(target.endpoint)
        request = worker_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt_token_ids, sampling=sampling
        )
        try:
            response: worker_pb2.PrefillResponse = await self._pool.stub(target.endpoint).Prefill(
                request, timeout=timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            raise _leg_error(target.instance_id, exc) from exc
        return response

    async def stream(
        self,
        target: Target,
        request: worker_pb2.WorkerGenerateRequest | worker_pb2.DecodeRequest,
        timeout_s: float,
        ledger: LegLedger,
    ) -> AsyncIterator[worker_pb2.WorkerTokens]:
        """Stream a neutral ``Generate`` or a ``Decode``; failures surface as :class:`LegError`."""
        ledger.endpoints.add(target.endpoint)
        stub = self._pool.stub(target.endpoint)
        call: grpc.aio.UnaryStreamCall[Any, worker_pb2.WorkerTokens]
        if isinstance(request, worker_pb2.DecodeRequest):
            call = stub.Decode(request, timeout=timeout_s)
        else:
            call = stub.Generate(request, timeout=timeout_s)
        try:
            async for message in _coalesced(call):
                yield message
        except grpc.aio.AioRpcError as exc:
            raise _leg_error(target.instance_id, exc) from exc
        finally:
            call.cancel()  # no-op once the stream ended; stops it when the consumer left early

    def abort_all(self, request_id: str, ledger: LegLedger) -> None:
        """Fire ``Abort`` at every endpoint that may hold the request (in the background)."""
        for endpoint in ledger.endpoints:
            task = asyncio.get_running_loop().create_task(self._abort(endpoint, request_id))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        ledger.endpoints.clear()

    async def _abort(self, endpoint: str, request_id: str) -> None:
        try:
            await self._pool.stub(endpoint).Abort(
                worker_pb2.AbortRequest(request_id=request_id), timeout=self._abort_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            logger.debug("abort of %s on %s failed: %s", request_id, endpoint, exc.code().name)

    async def drain(self) -> None:
        """Wait for background aborts still in flight (shutdown)."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
