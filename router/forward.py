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
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, cast

import grpc
from slorouter.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from router.core.health import OutlierDetector
from router.core.protocols import VLLM_GRPC_SCHEME
from router.legs import LegLedger, Target, ready_batches
from router.mux import MuxConnection, Tokens
from router.pool import ChannelPool
from router.vllm_grpc import VllmGrpcClient

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
#: Codes that are evidence against the instance itself (it is down, hung or broken), which
#: the outlier detector counts. An overloaded or draining worker (RESOURCE_EXHAUSTED, ABORTED)
#: is healthy and says so; a client that went away is no evidence at all.
EVIDENCE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)


#: ``--worker-streams``: ``mux`` runs every leg to a worker on one ``Worker.Streams`` call per
#: connection; ``per-request`` makes each leg its own ``Generate``/``Decode`` call.
WORKER_STREAMS = ("mux", "per-request")
#: After a worker answered ``Streams`` with UNIMPLEMENTED, ask it again after this long (it may
#: have been upgraded on the same endpoint).
NO_MUX_RETRY_S = 60.0


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


#: What a leg's stream yields: the per-request call's messages, or a multiplexed leg's records
#: (the same fields).
LegTokens = worker_pb2.WorkerTokens | Tokens

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


class FirstMessageTimeoutError(Exception):
    """A worker call produced no first message within its first-message deadline."""


async def _coalesced(
    call: grpc.aio.UnaryStreamCall[Any, worker_pb2.WorkerTokens],
    first_timeout_s: float,
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
    # Its deadline is a timer on this task (asyncio.timeout), not a task of its own.
    try:
        async with asyncio.timeout(first_timeout_s):
            first = await call.read()
    except TimeoutError as exc:
        raise FirstMessageTimeoutError from exc
    if first is _EOF:
        return
    assert isinstance(first, worker_pb2.WorkerTokens)
    yield first
    if first.finished:
        return

    async with contextlib.aclosing(ready_batches(call)) as batches:
        async for batch in batches:
            yield _merge(cast(list[worker_pb2.WorkerTokens], batch))


class WorkerClient:
    """Calls the Worker service of the instances a request is placed on.

    Every call has two deadlines besides its own overall one: the channel
    must be connected within ``connect_timeout_s`` (an endpoint that accepts
    TCP connections but never completes the HTTP/2 handshake otherwise
    holds a call for gRPC's 20 s connect deadline), and the first message
    (a Prefill's response, a stream's first tokens) must arrive within
    ``first_message_timeout_s``. Both surface as a retryable
    ``UNAVAILABLE``/``DEADLINE_EXCEEDED`` :class:`LegError`, so a dead or hung
    endpoint costs a request one bounded attempt of its retry budget.

    With a ``health`` detector, every call's outcome is reported to it: a
    first message is a success, a failure with a code in
    :data:`EVIDENCE_CODES` (or a missed deadline) a failure, which may
    eject the instance from placement (see :mod:`router.core.health`).
    """

    def __init__(
        self,
        pool: ChannelPool,
        *,
        abort_timeout_s: float = 1.0,
        connect_timeout_s: float = 2.0,
        first_message_timeout_s: float = 30.0,
        health: OutlierDetector | None = None,
        clock: Callable[[], float] = time.monotonic,
        streams: str = "mux",
    ) -> None:
        if streams not in WORKER_STREAMS:
            raise ValueError(f"streams must be one of {', '.join(WORKER_STREAMS)}, got {streams!r}")
        for name, value in (
            ("abort_timeout_s", abort_timeout_s),
            ("connect_timeout_s", connect_timeout_s),
            ("first_message_timeout_s", first_message_timeout_s),
        ):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        self._pool = pool
        self._abort_timeout_s = abort_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._first_timeout_s = first_message_timeout_s
        self.health = health
        self._clock = clock
        self._background: set[asyncio.Task[None]] = set()
        self.streams = streams
        #: The open ``Worker.Streams`` call per endpoint (``streams="mux"``).
        self._muxes: dict[str, MuxConnection] = {}
        #: Endpoints that answered ``Streams`` with UNIMPLEMENTED, and when (re-probed after a while).
        self._no_mux: dict[str, float] = {}
        #: The client of ``vllm-grpc://`` endpoints (vLLM's own gRPC service, see router.vllm_grpc).
        self.vllm = VllmGrpcClient(self, max_channels=pool.max_channels, tls=pool.tls)

    # ------------------------------------------------------------------ outcomes

    def _succeeded(self, target: Target) -> None:
        if self.health is not None:
            self.health.success(target.instance_id, self._clock())

    def _failed(self, error: LegError) -> LegError:
        if self.health is not None and error.code in EVIDENCE_CODES:
            self.health.failure(error.instance_id, self._clock(), f"{error.code.name}: {error.details}")
        return error

    # The same outcomes and deadlines for the other protocols' clients (router.vllm_grpc).

    @property
    def first_message_timeout_s(self) -> float:
        return self._first_timeout_s

    @property
    def connect_timeout_s(self) -> float:
        return self._connect_timeout_s

    def succeeded(self, target: Target) -> None:
        self._succeeded(target)

    def failed(self, target: Target, code: grpc.StatusCode, details: str) -> LegError:
        return self._failed(LegError(target.instance_id, code, details, kv_gone=code in KV_GONE_CODES))

    def failed_call(self, target: Target, exc: grpc.aio.AioRpcError) -> LegError:
        return self._failed(_leg_error(target.instance_id, exc))

    def first_message_error(self, target: Target) -> LegError:
        return self._first_message_error(target)

    def keep(self, task: asyncio.Task[None]) -> None:
        """Hold a background task until it ends (:meth:`drain` waits for it)."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _connected(self, target: Target) -> worker_pb2_grpc.WorkerAsyncStub:
        """The stub of ``target`` once its channel is connected (fails fast, or after the connect deadline)."""
        channel, stub = self._pool.entry(target.endpoint)
        await self.await_channel(channel, target)
        return stub

    async def await_channel(self, channel: grpc.aio.Channel, target: Target) -> None:
        """Return once ``channel`` is connected; a retryable :class:`LegError` if it fails or takes too long."""
        state = channel.get_state(try_to_connect=True)
        if state is grpc.ChannelConnectivity.READY:
            return
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                while state is not grpc.ChannelConnectivity.READY:
                    if state is grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                        raise self._failed(
                            LegError(
                                target.instance_id,
                                grpc.StatusCode.UNAVAILABLE,
                                f"cannot connect to {target.endpoint} (connection failed; the worker is down "
                                "or unreachable)",
                            )
                        )
                    await channel.wait_for_state_change(state)
                    state = channel.get_state(try_to_connect=True)
        except TimeoutError:
            raise self._failed(
                LegError(
                    target.instance_id,
                    grpc.StatusCode.UNAVAILABLE,
                    f"no connection to {target.endpoint} within {self._connect_timeout_s:g} s "
                    "(--worker-connect-timeout-s): the endpoint accepts but does not answer",
                )
            ) from None

    def _first_message_details(self, target: Target) -> str:
        return (
            f"no first message from {target.endpoint} within {self._first_timeout_s:g} s "
            "(--worker-first-message-timeout-s): the worker is hung or overloaded"
        )

    def _first_message_error(self, target: Target) -> LegError:
        return self._failed(
            LegError(
                target.instance_id, grpc.StatusCode.DEADLINE_EXCEEDED, self._first_message_details(target)
            )
        )

    # ------------------------------------------------------------------ calls

    async def prefill(
        self,
        target: Target,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: common_pb2.SamplingParams,
        timeout_s: float,
        ledger: LegLedger,
    ) -> worker_pb2.PrefillResponse:
        if target.endpoint.startswith(VLLM_GRPC_SCHEME):
            return await self.vllm.prefill(target, request_id, prompt_token_ids, sampling, timeout_s, ledger)
        ledger.endpoints.add(target.endpoint)
        request = worker_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt_token_ids, sampling=sampling
        )
        stub = await self._connected(target)
        # A Prefill's response is its first message: the tighter deadline wins.
        first_bound = self._first_timeout_s < timeout_s
        try:
            response: worker_pb2.PrefillResponse = await stub.Prefill(
                request, timeout=min(timeout_s, self._first_timeout_s)
            )
        except grpc.aio.AioRpcError as exc:
            if first_bound and exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                raise self._first_message_error(target) from exc
            raise self._failed(_leg_error(target.instance_id, exc)) from exc
        self._succeeded(target)
        return response

    def stream(
        self,
        target: Target,
        request: worker_pb2.WorkerGenerateRequest | worker_pb2.DecodeRequest,
        timeout_s: float,
        ledger: LegLedger,
    ) -> AsyncIterator[LegTokens]:
        """Stream a neutral ``Generate`` or a ``Decode``; failures surface as :class:`LegError`.

        With ``streams="mux"`` the leg runs on the endpoint's ``Worker.Streams`` call (one per
        connection, see :mod:`router.mux`); a worker that does not offer it is served with the
        per-request RPC (and asked again after :data:`NO_MUX_RETRY_S`). A ``vllm-grpc://``
        endpoint is served by :attr:`vllm` (vLLM's own ``Generate``), whose iterator is returned
        as it is: a generator in between would be one more hop per message.
        """
        if target.endpoint.startswith(VLLM_GRPC_SCHEME):
            return self.vllm.stream(target, request, timeout_s, ledger)
        return self._worker_stream(target, request, timeout_s, ledger)

    async def _worker_stream(
        self,
        target: Target,
        request: worker_pb2.WorkerGenerateRequest | worker_pb2.DecodeRequest,
        timeout_s: float,
        ledger: LegLedger,
    ) -> AsyncIterator[LegTokens]:
        """:meth:`stream` on this project's ``Worker`` service."""
        ledger.endpoints.add(target.endpoint)
        stub = await self._connected(target)
        if self.streams == "mux":
            connection = await self._mux(target)
            if connection is not None:
                # The leg's loop is here rather than in a generator of its own: every generator
                # between the worker's message and the client is one more hop per token.
                leg = connection.start(request)
                # The deadlines are two timers per leg (not one per message): the first-message
                # one, cancelled by the first update, and the leg's overall one. Either fails the
                # leg locally (DEADLINE_EXCEEDED), after the tokens that arrived before it, and
                # the leg is then aborted on the worker.
                loop = asyncio.get_running_loop()
                deadline = loop.call_later(timeout_s, leg.expire, "Deadline Exceeded")
                first_timer: asyncio.TimerHandle | None = None
                if self._first_timeout_s < timeout_s:
                    first_timer = loop.call_later(
                        self._first_timeout_s, leg.expire, self._first_message_details(target)
                    )
                first = True
                ended = False
                try:
                    while True:
                        if not leg.ready:
                            waiter = leg.waiter = loop.create_future()
                            await waiter
                            leg.waiter = None
                        tokens = leg.take()
                        if tokens is None:
                            if leg.error is not None:
                                ended = not leg.expired
                                code, details = leg.error
                                raise self._failed(
                                    LegError(target.instance_id, code, details, kv_gone=code in KV_GONE_CODES)
                                )
                            leg.ready = False
                            continue
                        if leg.error is None and not leg.finished:
                            leg.ready = False
                        if first:
                            first = False
                            if first_timer is not None:
                                first_timer.cancel()
                            self._succeeded(target)
                        if tokens.finished:
                            ended = True
                        yield tokens
                        if ended:
                            return
                finally:
                    deadline.cancel()
                    if first_timer is not None:
                        first_timer.cancel()
                    if ended:
                        connection.release(leg)
                    else:  # the consumer left early, or a deadline passed: stop the leg on the worker
                        connection.abort(leg)
        call: grpc.aio.UnaryStreamCall[Any, worker_pb2.WorkerTokens]
        if isinstance(request, worker_pb2.DecodeRequest):
            call = stub.Decode(request, timeout=timeout_s)
        else:
            call = stub.Generate(request, timeout=timeout_s)
        first = True
        try:
            async for message in _coalesced(call, self._first_timeout_s):
                if first:
                    first = False
                    self._succeeded(target)
                yield message
        except FirstMessageTimeoutError as exc:
            raise self._first_message_error(target) from exc
        except grpc.aio.AioRpcError as exc:
            raise self._failed(_leg_error(target.instance_id, exc)) from exc
        finally:
            call.cancel()  # no-op once the stream ended; stops it when the consumer left early

    async def _mux(self, target: Target) -> MuxConnection | None:
        """The open ``Streams`` call to ``target`` (opened on first use); None: the worker lacks it."""
        endpoint = target.endpoint
        channel, stub = self._pool.entry(endpoint)
        connection = self._muxes.get(endpoint)
        if connection is None or connection.closed or connection.channel is not channel:
            refused_at = self._no_mux.get(endpoint)
            if refused_at is not None:
                if self._clock() - refused_at < NO_MUX_RETRY_S:
                    return None
                del self._no_mux[endpoint]
            connection = MuxConnection(channel, stub, endpoint, self._mux_closed)
            self._muxes[endpoint] = connection
        if connection.opened.done() and connection.opened.exception() is None:
            return connection
        try:
            # The worker answers a new Streams call at once with an empty batch: its first message.
            async with asyncio.timeout(self._first_timeout_s):
                await asyncio.shield(connection.opened)
        except TimeoutError:
            await connection.close()
            raise self._first_message_error(target) from None
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.UNIMPLEMENTED:
                logger.info("worker %s does not serve Worker.Streams: per-request calls", endpoint)
                now = self._clock()
                if len(self._no_mux) >= self._pool.max_channels:  # bounded like the channels
                    self._no_mux = {e: t for e, t in self._no_mux.items() if now - t < NO_MUX_RETRY_S}
                self._no_mux[endpoint] = now
                return None
            raise self._failed(_leg_error(target.instance_id, exc)) from exc
        return connection

    def _mux_closed(self, connection: MuxConnection) -> None:
        if self._muxes.get(connection.endpoint) is connection:
            del self._muxes[connection.endpoint]

    async def close(self) -> None:
        """Close the ``Streams`` calls (shutdown; their legs fail UNAVAILABLE)."""
        connections = list(self._muxes.values())
        self._muxes.clear()
        for connection in connections:
            await connection.close()
        await self.vllm.close()

    def abort_all(self, request_id: str, ledger: LegLedger) -> None:
        """Fire ``Abort`` at every endpoint that may hold the request (in the background)."""
        for endpoint in ledger.endpoints:
            task = asyncio.get_running_loop().create_task(self._abort(endpoint, request_id))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        ledger.endpoints.clear()

    async def _abort(self, endpoint: str, request_id: str) -> None:
        if endpoint.startswith(VLLM_GRPC_SCHEME):
            await self.vllm.abort(endpoint, request_id, self._abort_timeout_s)
            return
        try:
            await self._pool.entry(endpoint)[1].Abort(
                worker_pb2.AbortRequest(request_id=request_id), timeout=self._abort_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            logger.debug("abort of %s on %s failed: %s", request_id, endpoint, exc.code().name)

    async def drain(self) -> None:
        """Wait for background aborts still in flight, then close the ``Streams`` calls (shutdown)."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self.close()
