"""The Router gRPC service: validate, place, forward, stream back.

``Generate`` runs one request end to end: it validates the request, asks the
scheduler for a placement over the current cluster view, records the dispatch
in the in-flight account at once, runs prefill and decode on the chosen
workers (or a neutral generate), and streams the tokens back. Failures before
the first token are retried on other instances; a decode failure after tokens
were sent re-places decode without repeating or dropping a token; a client
cancel or deadline aborts every leg on the workers.

Router errors are mapped to gRPC status codes here and nowhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from slorouter.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2

from cms import limits
from router.admission import Admission, RunHandle
from router.core.decision import Choice
from router.core.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    RetriesExhaustedError,
    RouterError,
    ShuttingDownError,
    status_name,
)
from router.core.lifecycle import Phase, RequestState
from router.core.protocols import VLLM_GRPC_SCHEME
from router.core.queue import QueueConfig
from router.core.request import Mode
from router.forward import LegError, LegTokens, WorkerClient
from router.legs import LegLedger
from router.placement import PlacementRequest, Placer, PrefillTiming
from router.route import Route
from router.telemetry import RequestObserver
from router.tokenize import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServiceConfig:
    """How the Router service treats requests (the scheduling knobs live in the scheduler's config)."""

    #: Default TTFT target when a request sets none (ms).
    ttft_slo_ms: float = 6000.0
    #: Default TPOT target when a request sets none (ms).
    tpot_slo_ms: float = 50.0
    #: Extra attempts on other instances after a failure before the first token.
    max_retries: int = 2
    #: Deadline of one Prefill call (s).
    prefill_timeout_s: float = 60.0
    #: Deadline of one Decode or neutral Generate stream (s).
    stream_timeout_s: float = 600.0
    #: Longest prompt the router accepts when instances advertise no max_model_len (tokens).
    max_prompt_tokens: int = 131072

    def __post_init__(self) -> None:
        for name in ("ttft_slo_ms", "tpot_slo_ms", "prefill_timeout_s", "stream_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")


#: The request id of a ``Schedule`` dry run whose request names none.
_DRY_RUN_ID = "schedule-dry-run"


def _error_code(exc: RouterError) -> grpc.StatusCode:
    """Router errors as gRPC status codes (the mapping itself: :func:`router.core.errors.status_name`)."""
    return _STATUS[status_name(exc)]


_STATUS = {code.name: code for code in grpc.StatusCode}


def call_status(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The gRPC status a call that raised ``exc`` ends with (None: not one of the service's own
    errors). Every gRPC front door (the ``grpc.aio`` servicer, :mod:`router.h2_server`) maps with it."""
    if isinstance(exc, RouterError):
        return _error_code(exc), str(exc)
    if isinstance(exc, LegError):
        # The worker refused the request itself (not an instance failure): pass its verdict on.
        return exc.code, f"worker {exc.instance_id}: {exc.details}"
    return None


#: The finish reason a worker gives a request it aborted.
_ABORT = "abort"


def _unrequested_abort(instance_id: str, tokens: int) -> LegError:
    """A worker ended a leg with finish reason "abort" that the router did not abort.

    Someone else cut it (an ``Abort`` from another client, an operator, the engine): for the
    client that is a failure of the instance, never a normal finish. As a retryable
    ``LegError`` it is retried (before the first token) or resumed token-exact elsewhere.
    """
    return LegError(
        instance_id,
        grpc.StatusCode.UNAVAILABLE,
        f"the worker aborted the request after {tokens} tokens without the router asking",
    )


async def _close_stream(stream: AsyncIterator[Any]) -> None:
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()


def _cap_end(sampling: common_pb2.SamplingParams, tokens: int, cap: int) -> int:
    """The output length at which a placement that may generate ``cap`` new tokens after ``tokens``
    ends (0: no cap of its own, or one at or past the request's own ``max_tokens``).

    The router enforces it, not the worker: the leg is asked for the request's whole ``max_tokens``
    and the router counts the tokens it relays, so that at the cap the dispatcher may let the leg
    go on where it runs (:attr:`router.admission.Admitted.continues`: the engine never sees the
    slice's end) or stop it and resume the rest elsewhere.
    """
    end = min(sampling.max_tokens, tokens + cap) if cap else 0
    return 0 if end >= sampling.max_tokens else end


def _at_cap(out: Generated, progress: RequestState, cap_end: int) -> bool:
    """Whether ``out`` takes the request to its placement's cap with output left (the leg is paused
    there; an answer that ends at the cap just ends)."""
    return bool(cap_end) and not out.finished and len(progress.tokens) >= cap_end


class Generated:
    """One step of a request's output: the fields of a ``GenerateResponse``, as a plain record.

    :meth:`RouterService.generate` yields these; the gRPC ``Generate`` turns each
    into a message (:meth:`message`), the HTTP edge reads them as they are. A
    protobuf message built per token only to have its fields read back was a
    measurable share of the edge's token path.
    """

    __slots__ = (
        "finish_reason",
        "finished",
        "first_token_index",
        "late",
        "request_id",
        "route",
        "text",
        "token_ids",
        "usage",
    )

    def __init__(
        self,
        request_id: str,
        first_token_index: int,
        token_ids: Sequence[int],
        text: str,
        finished: bool,
        finish_reason: str,
    ) -> None:
        self.request_id = request_id
        self.first_token_index = first_token_index
        self.token_ids = token_ids
        self.text = text
        self.finished = finished
        self.finish_reason = finish_reason
        #: Set on the first step.
        self.route: router_pb2.RouteInfo | None = None
        #: On the first step: the request left the router queue late (its TTFT target was out of
        #: reach); known before any token, so the HTTP edge can say so in a response header.
        self.late = False
        #: Set on the last step.
        self.usage: router_pb2.Usage | None = None

    def message(self) -> router_pb2.GenerateResponse:
        out = router_pb2.GenerateResponse(
            request_id=self.request_id,
            first_token_index=self.first_token_index,
            token_ids=self.token_ids,
            text=self.text,
            finished=self.finished,
            finish_reason=self.finish_reason,
        )
        if self.route is not None:
            out.route.CopyFrom(self.route)
        if self.usage is not None:
            out.usage.CopyFrom(self.usage)
        return out


@dataclass
class _Started:
    """A placed request whose first token exists: where it runs and how to continue it."""

    route: Route
    first: Generated
    #: PD: the prefill's KV handle for the decode leg.
    kv_handle: bytes = b""
    #: Neutral: the still-open Generate stream on the instance.
    stream: AsyncIterator[LegTokens] | None = None
    #: The output length at which this placement reaches its cap (0: none; see _cap_end): the router pauses it there.
    cap_end: int = 0
    #: A timed prefill (see Placer.time_prefill): the timing, the prompt tokens computed and when
    #: the first token arrived. Handed to the calibration after the token went out, not before.
    timed: tuple[PrefillTiming, int, float] | None = None


def _route_info(route: Route) -> router_pb2.RouteInfo:
    ttft, tpot = route.prefill.predicted_ttft_ms, route.decode.predicted_tpot_ms
    return router_pb2.RouteInfo(
        prefill_instance_id=route.prefill.instance_id,
        decode_instance_id=route.decode.instance_id,
        predicted_ttft_ms=ttft if ttft == ttft else 0.0,
        predicted_tpot_ms=tpot if tpot == tpot else 0.0,
        policy=route.policy,
    )


class RouterService(router_pb2_grpc.RouterServicer):
    """Implements ``slorouter.v1.Router`` over a :class:`Placer` and a :class:`WorkerClient`."""

    def __init__(
        self,
        placer: Placer,
        workers: WorkerClient,
        tokenizer: Tokenizer,
        config: ServiceConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        observer: RequestObserver | None = None,
        admission: Admission | None = None,
    ) -> None:
        self._placer = placer
        self._workers = workers
        self._tokenizer = tokenizer
        self._config = config
        self._clock = clock
        self._observer = observer or RequestObserver()
        self._admission: Admission = admission or Admission(
            placer, QueueConfig(queue_policy="none"), clock=clock, observer=self._observer
        )
        self._active: set[str] = set()
        #: SIGTERM: no new request starts (:meth:`begin_drain`); then the running ones end (:meth:`abandon`).
        self._draining = False
        self._abandoned = False
        #: Set while no request runs (a drain waits on it).
        self._idle = asyncio.Event()
        self._idle.set()
        #: With ``--processes N``: this process's slot, sent as ``slo-router-process`` trailing metadata.
        self.process_label = ""

    @property
    def active_requests(self) -> int:
        return len(self._active)

    @property
    def draining(self) -> bool:
        return self._draining

    def begin_drain(self) -> None:
        """Shutdown, first step: refuse new requests and every queued one at once (``UNAVAILABLE``)."""
        self._draining = True
        self._admission.refuse_queued(
            ShuttingDownError("the router is shutting down: the request had not started; retry elsewhere")
        )

    async def wait_idle(self, timeout_s: float, force: asyncio.Event | None = None) -> bool:
        """Wait until no request runs, at most ``timeout_s`` (or until ``force`` is set); whether idle."""
        waits = [asyncio.ensure_future(self._idle.wait())]
        if force is not None:
            waits.append(asyncio.ensure_future(force.wait()))
        try:
            await asyncio.wait(waits, timeout=max(timeout_s, 0.0), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waits:
                waiter.cancel()
        return not self._active

    def abandon(self) -> None:
        """Shutdown, last step (``--drain-timeout-s`` ran out): every running stream ends with an error
        at its next message (``UNAVAILABLE``; an SSE stream gets an error event and ``[DONE]``)."""
        self._abandoned = True

    # ------------------------------------------------------------------ validation

    def _prepare(self, request: router_pb2.GenerateRequest, *, dry_run: bool = False) -> PlacementRequest:
        # The shared bounds first (Schedule and Generate alike, and the same ones the workers
        # apply), so nothing oversized reaches the tokenizer, the scheduler or a worker.
        try:
            limits.check_generate_request(request)
        except limits.FieldLimitError as exc:
            raise InvalidRequestError(str(exc)) from None
        # Each field of the message is read once (a read builds a wrapper object or a Python value).
        ids = request.prompt_token_ids
        model = request.model
        max_tokens = request.sampling.max_tokens
        slo = request.slo
        ttft_ms, tpot_ms, e2e_ms = slo.ttft_ms, slo.tpot_ms, slo.e2e_ms
        self._placer.check_model(model)
        # The message's repeated field is used as is (it is never modified): no copy per request.
        prompt_ids: Sequence[int] = ids if len(ids) > 0 else self._tokenizer.encode(request.prompt)
        prompt_len = len(prompt_ids)
        if not prompt_len:
            raise InvalidRequestError("prompt tokenizes to zero tokens; send a non-empty prompt")
        limit = self._placer.max_model_len(model)
        if limit > 0 and prompt_len + max_tokens > limit:
            raise InvalidRequestError(
                f"prompt ({prompt_len} tokens) + sampling.max_tokens ({max_tokens}) "
                f"exceeds the serving limit of {limit} tokens; shorten the prompt or lower max_tokens"
            )
        if prompt_len > self._config.max_prompt_tokens:
            raise InvalidRequestError(
                f"prompt has {prompt_len} tokens, above the router's limit of "
                f"{self._config.max_prompt_tokens} (--max-prompt-tokens)"
            )
        e2e_only = e2e_ms > 0 and not ttft_ms and not tpot_ms
        return PlacementRequest(
            # A random id (as uuid4().hex, 32 hex digits, without building a UUID object). A dry
            # run records nothing under its id (the queue ranks by arrival order, not by id), so it
            # needs none: no system call for it (os.urandom costs 1-13 µs here).
            request_id=request.request_id or (_DRY_RUN_ID if dry_run else os.urandom(16).hex()),
            prompt_token_ids=prompt_ids,
            model=model,
            # With an e2e target the core derives what the request leaves unset (0).
            ttft_slo_ms=ttft_ms or (0.0 if e2e_only else self._config.ttft_slo_ms),
            tpot_slo_ms=tpot_ms or (0.0 if e2e_ms else self._config.tpot_slo_ms),
            priority=request.priority,
            e2e_slo_ms=e2e_ms,
            max_tokens=max_tokens,
            slo_class=request.slo_class,
            arrival_s=self._clock() if self._admission.enabled else None,
        )

    # ------------------------------------------------------------------ Schedule

    async def Schedule(
        self, request: router_pb2.ScheduleRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> router_pb2.ScheduleResponse:
        try:
            return self.schedule(request)
        except RouterError as exc:
            await context.abort(_error_code(exc), str(exc))

    def schedule(self, request: router_pb2.ScheduleRequest) -> router_pb2.ScheduleResponse:
        """The ``Schedule`` dry run without a gRPC context (every front door's); raises :class:`RouterError`."""
        queue = self._admission.dry_run_queue()
        prepared = self._prepare(request.request, dry_run=True)
        top = request.explain_top
        return self._placer.dry_run(prepared, queue, explain=request.explain or top > 0, explain_top=top)

    # ------------------------------------------------------------------ Generate

    async def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        if self.process_label:
            context.set_trailing_metadata((("slo-router-process", self.process_label),))
        try:
            async with contextlib.aclosing(self.generate(request)) as messages:
                async for message in messages:
                    yield message.message()
        except (RouterError, LegError) as exc:
            code, details = call_status(exc) or (grpc.StatusCode.UNKNOWN, str(exc))
            await context.abort(code, details)

    async def generate(self, request: router_pb2.GenerateRequest) -> AsyncGenerator[Generated, None]:
        """Run one request end to end; the path every front door (gRPC, HTTP) shares.

        Raises :class:`RouterError` when the request is refused or fails, and
        :class:`LegError` when a worker refused it; both are already counted in the
        metrics. Callers close the iterator (``contextlib.aclosing``) so that a
        client that goes away releases the accounting and aborts the worker legs.
        """
        progress = RequestState(started=self._clock(), listener=self._observer.phase_changed)
        try:
            if self._draining:
                raise ShuttingDownError(
                    "the router is shutting down and takes no new requests; retry elsewhere"
                )
            prepared = self._prepare(request)
        except RouterError as exc:
            progress.end(Phase.FAILED)
            self._observer.rejected(exc)
            # The id is the client's: log a bounded prefix of it, never the whole string.
            logger.info("rejected request %r: %s", request.request_id[:64] or "(no id)", exc)
            raise
        request_id = prepared.request_id
        progress.request_id = request_id
        progress.prompt_tokens = len(prepared.prompt_token_ids)
        if request_id in self._active:
            progress.end(Phase.FAILED)
            self._observer.outcome("duplicate")
            raise DuplicateRequestError(
                f"request_id {request_id!r} is already in flight; use a new id or leave it empty"
            )
        self._active.add(request_id)
        self._idle.clear()
        ledger = LegLedger()
        finished = False
        try:
            source = self._run(prepared, request.sampling, ledger, progress)
            async for message in source:
                if self._abandoned:
                    raise ShuttingDownError(
                        f"the router shut down after {len(progress.tokens)} tokens (--drain-timeout-s ran "
                        "out); retry elsewhere"
                    )
                finished = message.finished
                if finished:
                    progress.end(Phase.DONE)
                yield message
            self._completed(progress)
        except RouterError as exc:
            self._observer.rejected(exc)
            logger.info("request %s failed while %s: %s", request_id, progress.phase.value, exc)
            raise
        except LegError:
            self._observer.outcome("worker_error")
            raise
        except (asyncio.CancelledError, GeneratorExit):
            progress.end(Phase.CANCELLED)
            self._observer.outcome("cancelled")
            raise
        finally:
            # Whatever ended it otherwise (a worker's refusal, a router error) failed it.
            progress.end(Phase.FAILED)
            self._active.discard(request_id)
            if not self._active:
                self._idle.set()
            self._admission.outcome(
                prepared,
                finished=finished,
                ttft_s=progress.ttft_s,
                tpot_s=progress.tpot_s,
                e2e_s=self._clock() - progress.started,
            )
            self._admission.release(request_id, len(progress.tokens) if finished else None)
            if not finished:
                # Cancelled, deadline, or failed part-way: nothing may keep running for it.
                self._workers.abort_all(request_id, ledger)

    def _confirm(self, target: Choice, request_id: str) -> None:
        """A stock vLLM engine (no admitted ids in its status) runs the request now: see Placer.confirm."""
        if target.endpoint.startswith(VLLM_GRPC_SCHEME):
            self._placer.confirm(request_id, target.instance_id)

    def _completed(self, progress: RequestState) -> None:
        self._observer.completed(progress.route, progress.tpot_s, self._clock() - progress.started)

    def _usage(self, req: PlacementRequest, progress: RequestState) -> router_pb2.Usage:
        now = self._clock()
        first = progress.first_token_at if progress.first_token_at is not None else now
        last = progress.last_token_at if progress.last_token_at is not None else first
        n = len(progress.tokens)
        # Called once, when the stream finishes: the answer's length teaches the length predictor.
        self._placer.lengths.observe(req.slo_class, len(req.prompt_token_ids), n)
        theta = self._placer.theta
        if theta is not None and n > 1:
            # binpack's θ learns from the TPOT each answer got against its target (none if e2e-judged).
            theta.observe((last - first) / (n - 1) * 1e3, req.tpot_slo_ms, req.slo_class)
        return router_pb2.Usage(
            prompt_tokens=len(req.prompt_token_ids),
            completion_tokens=n,
            ttft_ms=(first - progress.started) * 1e3,
            tpot_ms=((last - first) / (n - 1) * 1e3) if n > 1 else 0.0,
            e2e_ms=(now - progress.started) * 1e3,
            cached_prompt_tokens=progress.cached_prompt_tokens,
            queue_wait_ms=progress.queue_wait_s * 1e3,
            late=progress.late,
        )

    def _after_first(self, started: _Started, progress: RequestState) -> None:
        """The first token's bookkeeping, once it went to the client: the TTFT metrics and a timed
        prefill's calibration sample (both with the times noted when the token arrived)."""
        if progress.first_token_at is not None:
            self._observer.first_token(started.route, progress.first_token_at - progress.started)
        if started.timed is not None:
            timing, computed, arrived = started.timed
            started.timed = None
            self._placer.prefill_timed(timing, computed, arrived)

    def _note_tokens(self, progress: RequestState, token_ids: Sequence[int]) -> None:
        if not token_ids:
            return
        progress.add_tokens(token_ids, self._clock())
        if progress.request_id:
            # The decode leg's KV holds the prompt and every token produced (packing's exact peak).
            self._placer.advance(progress.request_id, progress.prompt_tokens + len(progress.tokens))

    async def _first_token(
        self,
        req: PlacementRequest,
        sampling: common_pb2.SamplingParams,
        ledger: LegLedger,
        progress: RequestState,
    ) -> _Started:
        """Place the request and get its first token, trying other instances when one fails."""
        excluded: set[str] = set()
        failures: list[str] = []
        while True:
            if self._draining and failures:
                raise ShuttingDownError(
                    "the router is shutting down; the request failed on a worker and is not retried here: "
                    + "; ".join(failures)
                )
            admitted = await self._admission.place(req, exclude=frozenset(excluded))
            route = admitted.route
            progress.queue_wait_s += admitted.waited_s
            progress.late = progress.late or admitted.late
            progress.route = route
            progress.to(Phase.PLACED)
            cap_end = _cap_end(sampling, 0, admitted.cap)
            try:
                started = await self._start(route, req, sampling, ledger, progress)
                started.cap_end = cap_end
                return started
            except LegError as exc:
                if not exc.retryable:
                    raise
                # Failed before its first token: pause, and wait for another placement.
                progress.pause(f"{exc.instance_id} failed before the first token")
                progress.requeue()
                failures.append(str(exc))
                excluded.add(exc.instance_id)
                self._admission.release(req.request_id)
                self._observer.retried("first_token")
                logger.warning("request %s: %s; trying another instance", req.request_id, exc)
                if len(failures) > self._config.max_retries:
                    raise RetriesExhaustedError(
                        f"no instance produced a first token after {len(failures)} attempts "
                        f"(--max-retries {self._config.max_retries}): " + "; ".join(failures)
                    ) from exc

    async def _start(
        self,
        route: Route,
        req: PlacementRequest,
        sampling: common_pb2.SamplingParams,
        ledger: LegLedger,
        progress: RequestState,
    ) -> _Started:
        prefill = route.prefill
        progress.to(Phase.PREFILLING)
        timing = self._placer.time_prefill(prefill)  # a stock engine's prefill, timed here
        if route.mode is Mode.PD:
            response = await self._workers.prefill(
                prefill,
                req.request_id,
                req.prompt_token_ids,
                sampling,
                self._config.prefill_timeout_s,
                ledger,
            )
            if response.finished and response.finish_reason == _ABORT:
                raise _unrequested_abort(prefill.instance_id, len(progress.tokens))
            self._confirm(prefill, req.request_id)
            timed = None
            if timing is not None:
                computed = len(req.prompt_token_ids) - response.num_cached_prompt_tokens
                timed = (timing, computed, self._placer.now())
            index = len(progress.tokens)
            self._note_tokens(progress, [response.first_token_id])
            if not response.finished:
                progress.to(Phase.TRANSFERRING)
            first = Generated(
                req.request_id,
                index,
                [response.first_token_id],
                response.text,
                response.finished,
                response.finish_reason,
            )
            return _Started(route, first, kv_handle=response.kv_handle, timed=timed)
        stream = self._workers.stream(
            prefill,
            worker_pb2.WorkerGenerateRequest(
                request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, sampling=sampling
            ),
            self._config.stream_timeout_s,
            ledger,
        )
        async for message in stream:
            if not message.token_ids and not message.finished:
                continue
            if message.finished and message.finish_reason == _ABORT:
                await _close_stream(stream)
                raise _unrequested_abort(prefill.instance_id, len(progress.tokens))
            self._confirm(prefill, req.request_id)
            index = len(progress.tokens)
            self._note_tokens(progress, message.token_ids)
            progress.cached_prompt_tokens = max(
                progress.cached_prompt_tokens, message.num_cached_prompt_tokens
            )
            timed = None
            if timing is not None:
                timed = (
                    timing,
                    len(req.prompt_token_ids) - progress.cached_prompt_tokens,
                    self._placer.now(),
                )
            if not message.finished:
                progress.to(Phase.DECODING)
            first = Generated(
                req.request_id,
                index,
                message.token_ids,
                message.text,
                message.finished,
                message.finish_reason,
            )
            return _Started(route, first, stream=stream, timed=timed)
        raise LegError(
            prefill.instance_id, grpc.StatusCode.UNAVAILABLE, "stream ended before the first token"
        )

    async def _next_part(
        self,
        req: PlacementRequest,
        sampling: common_pb2.SamplingParams,
        progress: RequestState,
        running: Choice,
        stream: AsyncIterator[LegTokens] | None,
    ) -> tuple[Choice, int, bool]:
        """At a placement's cap: where the rest runs, its cap's end (see _cap_end), and whether the
        ``stream`` running on ``running`` goes on (else it is closed, which stops the leg on its
        worker, before the rest waits for a placement)."""
        progress.pause("the slice ended")
        progress.requeue()
        future = self._admission.pause(req.request_id, len(progress.tokens))
        goes_on = (
            stream is not None
            and future.done()
            and not future.cancelled()
            and future.result().continues
            and future.result().route.decode.instance_id == running.instance_id
        )
        if not goes_on and stream is not None:
            await _close_stream(stream)
        admitted = await self._admission.placed(req.request_id, future)
        progress.queue_wait_s += admitted.waited_s
        progress.to(Phase.PLACED)
        end = _cap_end(sampling, len(progress.tokens), admitted.cap)
        return (running if goes_on else admitted.route.decode), end, goes_on

    async def _resumed(
        self, req: PlacementRequest, handle: RunHandle, progress: RequestState
    ) -> tuple[Choice, bytes]:
        """After an eviction: the instance the queue pulls the request to next, and no KV (recompute)."""
        logger.info(
            "request %s: evicted after %d tokens; waiting in the queue", req.request_id, len(progress.tokens)
        )
        progress.pause("evicted by the queue")
        progress.requeue()
        admitted = await self._admission.resume(req.request_id)
        progress.queue_wait_s += admitted.waited_s
        progress.to(Phase.PLACED)
        return admitted.route.decode, b""

    async def _run(
        self,
        req: PlacementRequest,
        sampling: common_pb2.SamplingParams,
        ledger: LegLedger,
        progress: RequestState,
    ) -> AsyncIterator[Generated]:
        """Place the request, stream its first token, then the rest; re-place decode when its instance fails.

        One generator from the placement to the last token: each generator between the
        worker's message and the client is one more hop per token.
        """
        started = await self._first_token(req, sampling, ledger, progress)
        first = started.first
        first.route = _route_info(started.route)
        first.late = progress.late
        progress.route = started.route
        cap_end = started.cap_end
        paused = _at_cap(first, progress, cap_end)
        if first.finished:
            first.usage = self._usage(req, progress)
        try:
            yield first
        finally:
            # What only the router's books need waits until the first token is out: in a burst,
            # every request's first token would otherwise wait for the others' bookkeeping too.
            self._after_first(started, progress)
        if first.finished:
            return
        request_id = req.request_id
        stream = started.stream
        target: Choice = started.route.decode
        kv_handle = started.kv_handle
        excluded: set[str] = set()
        failures = 0
        # Under --queue-policy qlm the queue may evict this request while it streams: the leg is
        # aborted, nothing more of it is relayed, and it continues from a new placement with the
        # tokens the client has (see router.admission).
        handle = self._admission.attach(
            req.request_id,
            lambda: len(progress.tokens),
            lambda: self._workers.abort_all(req.request_id, ledger),
        )
        while True:
            if paused:
                # The leg reached its placement's cap (a slice): pause, requeue, and either go on
                # where it runs (the dispatcher continued it there) or resume after the tokens so
                # far where the dispatcher places the rest.
                paused = False
                target, cap_end, goes_on = await self._next_part(req, sampling, progress, target, stream)
                if not goes_on:
                    stream = None
                    kv_handle = b""
            if stream is None:
                if progress.phase is Phase.PLACED:
                    # Resumed: on a KV still held it decodes at once, else it recomputes its context.
                    progress.to(Phase.DECODING if kv_handle else Phase.PREFILLING)
                stream = self._workers.stream(
                    target,
                    worker_pb2.DecodeRequest(
                        request_id=req.request_id,
                        prompt_token_ids=req.prompt_token_ids,
                        sampling=sampling,
                        kv_handle=kv_handle,
                        generated_token_ids=progress.tokens,
                    ),
                    self._config.stream_timeout_s,
                    ledger,
                )
            confirmed = False
            try:
                async for message in stream:
                    if handle is not None and handle.evicted:
                        continue  # the aborted leg's last messages: the client gets them from the next run
                    if not confirmed:
                        confirmed = True
                        self._confirm(target, request_id)
                        progress.advance(Phase.DECODING)
                    if message.finished and message.finish_reason == _ABORT:
                        # Not asked for by the router (its own aborts end the leg above or close
                        # the request): keep this message's tokens, resume the rest elsewhere.
                        if message.token_ids:
                            index = len(progress.tokens)
                            self._note_tokens(progress, message.token_ids)
                            yield Generated(request_id, index, message.token_ids, message.text, False, "")
                        await _close_stream(stream)
                        raise _unrequested_abort(target.instance_id, len(progress.tokens))
                    index = len(progress.tokens)
                    self._note_tokens(progress, message.token_ids)
                    if message.num_cached_prompt_tokens:
                        progress.cached_prompt_tokens = message.num_cached_prompt_tokens
                    out = Generated(
                        request_id,
                        index,
                        message.token_ids,
                        message.text,
                        message.finished,
                        message.finish_reason,
                    )
                    paused = _at_cap(out, progress, cap_end)
                    if out.finished:
                        out.usage = self._usage(req, progress)
                        yield out
                        return
                    yield out
                    if paused:
                        break
                if paused:
                    continue
                if handle is not None and handle.evicted:
                    stream = None
                    target, kv_handle = await self._resumed(req, handle, progress)
                    continue
                raise LegError(
                    target.instance_id, grpc.StatusCode.UNAVAILABLE, "stream ended before finishing"
                )
            except LegError as exc:
                stream = None
                if handle is not None and handle.evicted:
                    target, kv_handle = await self._resumed(req, handle, progress)
                    continue
                if exc.kv_gone and kv_handle:
                    # The prefill side no longer holds the KV: recompute prompt + generated tokens.
                    logger.info(
                        "request %s: KV gone (%s); recomputing on %s", req.request_id, exc, target.instance_id
                    )
                    kv_handle = b""
                    progress.pause("the KV was gone")
                    progress.requeue()
                    progress.to(Phase.PLACED)
                    continue
                if not exc.retryable:
                    raise
                failures += 1
                excluded.add(exc.instance_id)
                self._observer.retried("decode")
                if failures > self._config.max_retries:
                    raise RetriesExhaustedError(
                        f"decode failed on {failures} instances after {len(progress.tokens)} tokens "
                        f"(--max-retries {self._config.max_retries}): {exc}"
                    ) from exc
                logger.warning(
                    "request %s: decode on %s failed (%s); re-placing",
                    req.request_id,
                    target.instance_id,
                    exc,
                )
                progress.pause(f"decode on {exc.instance_id} failed")
                progress.requeue()
                target = self._placer.place_decode(
                    req, len(progress.tokens), exclude=frozenset(excluded), abandoned=exc.instance_id
                )
                progress.to(Phase.PLACED)
