"""Replay a request plan against a router over the public ``Router.Generate`` API.

:func:`run_load` opens one ``grpc.aio`` channel, sends the plan's requests either
at their planned offsets (open loop) or from ``concurrency`` clients that each
send the next request when their last one ends (closed loop), and measures every
stream on the client side:

- TTFT: from sending to the first message that carries tokens;
- TPOT: mean gap per token after the first, ``(t_last_token - t_first_token) / (n - 1)``;
- e2e: from sending to the end of the stream (or to the error).

What a request carries depends on the fleet's engine (:attr:`LoadConfig.engine`). An answer's
length is the plan's (``RequestPlan.true_output_tokens``), and the router must not be told it: a
client sends a cap. Against ``sim`` engines, whose output is a pure function of the request
(:mod:`engine.outputs`), every request sends the plan's cap as ``max_tokens`` and a stop string
that first occurs in the sim engine's output exactly at the planned length
(:func:`engine.outputs.stop_string_at`): the engine stops there as any engine stops on a stop
string, finishing ``"stop"``, while the router, which passes sampling parameters through and never
reads a stop string, sees what ``slo-router simulate`` gives it -- the cap. A real model's output
cannot be steered that way, so against ``vllm`` an ``ignore_eos`` request sends its planned length
as ``max_tokens`` (the router then sees the length as the cap) and the others the plan's cap.

Every stream is checked against the response contract: the first message carries
the route, the last one has ``finished`` set and nothing follows it, the token
count equals ``max_tokens`` unless the finish reason is ``stop``, ``usage``
(when present) agrees with the tokens received, and against ``sim`` engines the answer
has its planned length (shorter only at an EOS, without ``ignore_eos``). A stream that breaks it is
recorded as an error with code ``BAD_STREAM``; a failed call with its gRPC status
code name; a failure inside the client with ``CLIENT_ERROR`` (and a logged traceback).

The run is bounded: the plan is finite, every call has a deadline
(``request_timeout_s``), no request is issued after ``duration_s``, requests still
running then get ``drain_timeout_s`` more before they are cancelled and recorded
as ``CANCELLED``, and at most ``max_in_flight`` requests are outstanding (an open
loop that reaches the bound sends late and reports the lag).
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TextIO

import grpc
from grpc_health.v1 import health_pb2
from slorouter.v1 import common_pb2, router_pb2, router_pb2_grpc

from cms import limits
from cms.transport import client_tls_from_arg, message_size_options, open_channel
from engine.outputs import prompt_digest, request_key, stop_string_at
from workload.report import BAD_STREAM, RequestResult
from workload.spec import RequestPlan, doc

#: Where ``slo-router bench`` sends requests by default (the router's usual loopback address).
DEFAULT_TARGET = "127.0.0.1:50051"

#: Error code of requests the load generator itself cancelled at the end of the run.
CANCELLED = "CANCELLED"

#: Error code of a request that failed inside the client (a bug or a local resource problem).
CLIENT_ERROR = "CLIENT_ERROR"

#: The engines ``LoadConfig.engine`` knows: how a request is made to end at its planned length.
ENGINES = ("sim", "vllm")

logger = logging.getLogger(__name__)


class LoadError(Exception):
    """The load generator cannot run (for example, the router cannot be reached)."""


@dataclass(frozen=True)
class LoadConfig:
    """How to replay a plan. Times are seconds; bounds keep every run finite."""

    target: str = field(default=DEFAULT_TARGET, metadata=doc("router address, HOST:PORT"))
    engine: str = field(
        default="sim",
        metadata=doc(
            "the fleet's engine: 'sim' sends the cap and a stop string at the planned length; "
            "'vllm' sends the planned length as max_tokens (ignore_eos classes)"
        ),
    )
    tls_ca_file: str | None = field(
        default=None, metadata=doc("CA bundle (PEM) to reach the router over TLS; None = plaintext")
    )
    concurrency: int = field(
        default=0, metadata=doc("closed loop with this many clients; 0 = open loop at planned offsets")
    )
    duration_s: float | None = field(
        default=None, metadata=doc("issue no request after this many seconds; None = the whole plan")
    )
    request_timeout_s: float = field(default=60.0, metadata=doc("gRPC deadline of each Generate call"))
    drain_timeout_s: float = field(
        default=30.0, metadata=doc("after duration_s, how long running requests may still finish")
    )
    connect_timeout_s: float = field(
        default=15.0,
        metadata=doc(
            "how long to wait for the router to accept connections and report SERVING (it has a view)"
        ),
    )
    max_in_flight: int = field(default=4096, metadata=doc("bound on outstanding requests (open loop)"))
    request_id_prefix: str = field(
        default="", metadata=doc("request ids are PREFIX + plan index; empty lets the router assign them")
    )
    model: str = field(default="", metadata=doc("GenerateRequest.model; empty lets the router choose"))
    progress_interval_s: float = field(default=0.5, metadata=doc("how often on_progress is called"))

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.concurrency < 0:
            raise ValueError(f"concurrency must be >= 0 (0 = open loop), got {self.concurrency}")
        for name in ("request_timeout_s", "connect_timeout_s", "progress_interval_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if not (math.isfinite(self.drain_timeout_s) and self.drain_timeout_s >= 0):
            raise ValueError(f"drain_timeout_s must be a finite number >= 0, got {self.drain_timeout_s!r}")
        if self.duration_s is not None and not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise ValueError(f"duration_s must be a finite number > 0 or None, got {self.duration_s!r}")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if not self.target:
            raise ValueError("target must be HOST:PORT of a router, got an empty string")
        if self.request_id_prefix:
            # The ids the run makes must pass the router's id limits (cms/limits.py).
            try:
                limits.check_id(self.request_id_prefix, "request_id_prefix")
            except limits.FieldLimitError as exc:
                raise ValueError(str(exc)) from None
            if len(self.request_id_prefix) > limits.MAX_ID_BYTES - 10:
                raise ValueError(
                    f"request_id_prefix must be at most {limits.MAX_ID_BYTES - 10} characters "
                    "(room for the request number)"
                )


@dataclass(frozen=True)
class Progress:
    """A snapshot of a running load, handed to ``on_progress``."""

    planned: int
    issued: int
    completed: int
    """Requests that are over (finished, failed, or cancelled by the run's end)."""
    errors: int
    in_flight: int
    elapsed_s: float
    duration_s: float | None
    done: bool = False
    """True on the last call, when the run is over."""


@dataclass(frozen=True)
class LoadResult:
    """Outcome of :func:`run_load`: one result per issued request, in plan order."""

    results: tuple[RequestResult, ...]
    planned: int
    duration_s: float
    """From the start of the run to the end of the last request (the report's window)."""
    stopped_by_duration: bool
    """True when ``duration_s`` cut the plan short."""
    max_send_lag_s: float
    """Largest delay between a request's planned and actual send time (open loop)."""


class _Stream:
    """Mutable measurements of one request while its stream runs (owned by one task)."""

    __slots__ = (
        "decode_instance_id",
        "end",
        "engine",
        "error_code",
        "error_message",
        "finish_reason",
        "finished",
        "first_token",
        "last_token",
        "messages",
        "plan",
        "predicted_tpot_ms",
        "predicted_ttft_ms",
        "prefill_instance_id",
        "queue_wait_ms",
        "sampling",
        "start",
        "tokens",
        "usage_tokens",
        "violation",
    )

    def __init__(
        self, plan: RequestPlan, sampling: common_pb2.SamplingParams, engine: str, start: float
    ) -> None:
        self.plan = plan
        self.sampling = sampling
        self.engine = engine
        self.start = start
        self.end: float | None = None
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.tokens = 0
        self.messages = 0
        self.finished = False
        self.finish_reason = ""
        self.usage_tokens: int | None = None
        self.queue_wait_ms = 0.0
        self.error_code: str | None = None
        self.error_message = ""
        self.violation = ""
        self.prefill_instance_id = ""
        self.decode_instance_id = ""
        self.predicted_ttft_ms: float | None = None
        self.predicted_tpot_ms: float | None = None

    def observe(self, msg: router_pb2.GenerateResponse, now: float) -> None:
        if self.messages == 0:
            if msg.HasField("route"):
                self.prefill_instance_id = msg.route.prefill_instance_id
                self.decode_instance_id = msg.route.decode_instance_id
                self.predicted_ttft_ms = msg.route.predicted_ttft_ms
                self.predicted_tpot_ms = msg.route.predicted_tpot_ms
            else:
                self._violate("the first message carries no route")
        self.messages += 1
        if self.finished:
            self._violate(f"message {self.messages} arrived after the finished one")
        if msg.token_ids:
            if self.first_token is None:
                self.first_token = now
            self.last_token = now
            self.tokens += len(msg.token_ids)
        if msg.finished:
            self.finished = True
            self.finish_reason = msg.finish_reason
            if msg.HasField("usage"):
                self.usage_tokens = msg.usage.completion_tokens
                self.queue_wait_ms = msg.usage.queue_wait_ms

    def _violate(self, what: str) -> None:
        if not self.violation:
            self.violation = what

    def check_end(self) -> None:
        """Contract checks that need the whole stream (called when it ended without an error status)."""
        plan, max_tokens = self.plan, self.sampling.max_tokens
        if not self.finished:
            self._violate("the stream ended without a finished message")
        elif self.finish_reason != "stop" and self.tokens != max_tokens:
            self._violate(
                f"{self.tokens} tokens received, max_tokens is {max_tokens} "
                f"(finish_reason {self.finish_reason!r})"
            )
        elif self.engine == "sim" and (
            self.tokens > plan.true_output_tokens
            or (plan.ignore_eos and self.tokens != plan.true_output_tokens)
        ):
            # A sim engine ends the answer at its planned length (earlier only at an EOS).
            self._violate(_not_a_sim_engine(self.tokens, plan.true_output_tokens))
        if self.usage_tokens is not None and self.usage_tokens != self.tokens:
            self._violate(f"usage.completion_tokens is {self.usage_tokens}, {self.tokens} tokens received")
        if self.violation:
            self.error_code = BAD_STREAM
            self.error_message = self.violation

    def result(self, run_start: float) -> RequestResult:
        plan = self.plan
        error_code, error_message = self.error_code, self.error_message
        if self.end is None:
            error_code = CANCELLED
            error_message = "cancelled by the load generator: the duration cap plus drain time ran out"
        ttft_ms = tpot_ms = None
        if self.first_token is not None:
            ttft_ms = (self.first_token - self.start) * 1e3
            if self.last_token is not None and self.tokens >= 2:
                tpot_ms = (self.last_token - self.first_token) * 1e3 / (self.tokens - 1)
        return RequestResult.of_plan(
            plan,
            start_s=self.start - run_start,
            completion_tokens=self.tokens,
            ttft_ms=ttft_ms,
            tpot_ms=tpot_ms,
            e2e_ms=None if self.end is None else (self.end - self.start) * 1e3,
            error_code=error_code,
            error_message=error_message,
            finish_reason=self.finish_reason,
            prefill_instance_id=self.prefill_instance_id,
            decode_instance_id=self.decode_instance_id,
            predicted_ttft_ms=self.predicted_ttft_ms,
            predicted_tpot_ms=self.predicted_tpot_ms,
            queue_wait_ms=self.queue_wait_ms,
        )


def _not_a_sim_engine(received: int, planned: int) -> str:
    return (
        f"{received} tokens received, the answer's planned length is {planned}: the engine did not "
        "stop at the sim engine's stop string (a real model's output differs; against a vLLM fleet "
        "run bench with --engine vllm)"
    )


def sent_sampling(
    plan: RequestPlan, engine: str = "sim", prompt_token_ids: list[int] | None = None
) -> common_pb2.SamplingParams:
    """The ``sampling`` sent for ``plan`` to a fleet of ``engine`` engines.

    The engine must end the answer at the plan's length (``true_output_tokens``; earlier only at
    its own EOS when the plan does not ``ignore_eos``) while the router sees only what a client
    sends. ``sim``: the plan's cap as ``max_tokens``, and when the answer is shorter than the cap,
    a stop string that first occurs in the sim engine's output at the planned length (the output
    is a pure function of the prompt and the seed, 0 here: :mod:`engine.outputs`). ``vllm``: a
    real model's output cannot be steered, and the only way to tell it a length is ``max_tokens``
    with ``ignore_eos``: so an ``ignore_eos`` plan sends its length as ``max_tokens`` (the router
    then sees the length as the cap, a limit of live benchmarking on real engines the simulator
    does not have), the others their cap (the model stops at its own EOS).
    """
    if engine == "vllm":
        max_tokens = plan.true_output_tokens if plan.ignore_eos else plan.max_tokens
        return common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=plan.ignore_eos)
    if engine != "sim":
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    length = plan.true_output_tokens
    if length >= plan.max_tokens:
        return common_pb2.SamplingParams(max_tokens=plan.max_tokens, ignore_eos=plan.ignore_eos)
    ids = plan.prompt_token_ids() if prompt_token_ids is None else prompt_token_ids
    stop = stop_string_at(request_key(0, prompt_digest(ids)), length, max_chars=limits.MAX_STOP_BYTES)
    if stop is None:
        # No short enough stop string (never seen in practice): the length goes out as the cap.
        return common_pb2.SamplingParams(max_tokens=length, ignore_eos=plan.ignore_eos)
    return common_pb2.SamplingParams(max_tokens=plan.max_tokens, ignore_eos=plan.ignore_eos, stop=[stop])


def build_request(plan: RequestPlan, config: LoadConfig) -> router_pb2.GenerateRequest:
    """The ``GenerateRequest`` of one planned request (SLO targets of ``None`` are sent as 0)."""
    prompt = plan.prompt_token_ids()
    return router_pb2.GenerateRequest(
        request_id=f"{config.request_id_prefix}{plan.index}" if config.request_id_prefix else "",
        model=config.model,
        prompt_token_ids=prompt,
        sampling=sent_sampling(plan, config.engine, prompt),
        slo=common_pb2.SloTarget(
            ttft_ms=plan.slo.ttft_ms or 0.0, tpot_ms=plan.slo.tpot_ms or 0.0, e2e_ms=plan.slo.e2e_ms or 0.0
        ),
        priority=plan.priority,
        slo_class=plan.class_name,
    )


class _Run:
    """One replay of a plan; :func:`run_load` is its only user."""

    def __init__(
        self,
        plans: Sequence[RequestPlan],
        config: LoadConfig,
        stub: router_pb2_grpc.RouterAsyncStub,
        clock: Callable[[], float],
    ) -> None:
        self.plans = plans
        self.config = config
        self.stub = stub
        self.clock = clock
        self.streams: list[_Stream] = []
        self.completed = 0
        self.errors = 0
        self.cancelled = 0
        self.start = clock()
        self.deadline = math.inf if config.duration_s is None else self.start + config.duration_s
        self.stopped_by_duration = False
        self.max_send_lag_s = 0.0

    def progress(self, *, done: bool = False) -> Progress:
        issued = len(self.streams)
        return Progress(
            planned=len(self.plans),
            issued=issued,
            completed=self.completed + self.cancelled,
            errors=self.errors + self.cancelled,
            in_flight=issued - self.completed - self.cancelled,
            elapsed_s=self.clock() - self.start,
            duration_s=self.config.duration_s,
            done=done,
        )

    async def one(self, plan: RequestPlan) -> None:
        request = build_request(plan, self.config)
        stream = _Stream(plan, request.sampling, self.config.engine, self.clock())
        self.streams.append(stream)
        call = self.stub.Generate(request, timeout=self.config.request_timeout_s)
        try:
            async for msg in call:
                stream.observe(msg, self.clock())
        except grpc.aio.AioRpcError as exc:
            stream.error_code = exc.code().name
            stream.error_message = exc.details() or ""
        except asyncio.CancelledError:
            call.cancel()
            self.cancelled += 1
            raise
        except Exception as exc:
            # One odd failure must not stop a long run; it is counted and logged with its traceback.
            logger.exception("request %d failed in the client", plan.index)
            call.cancel()
            stream.error_code = CLIENT_ERROR
            stream.error_message = f"{type(exc).__name__}: {exc}"
        else:
            stream.check_end()
        stream.end = self.clock()
        self.completed += 1
        if stream.error_code is not None:
            self.errors += 1

    async def open_loop(self, tasks: set[asyncio.Task[None]]) -> None:
        slots = asyncio.Semaphore(self.config.max_in_flight)

        def release(task: asyncio.Task[None]) -> None:
            tasks.discard(task)
            slots.release()

        for plan in self.plans:
            due = self.start + plan.arrival_s
            if due >= self.deadline:
                self.stopped_by_duration = True
                return
            delay = due - self.clock()
            if delay > 0:
                await asyncio.sleep(delay)
            await slots.acquire()
            now = self.clock()
            if now >= self.deadline:
                slots.release()
                self.stopped_by_duration = True
                return
            self.max_send_lag_s = max(self.max_send_lag_s, now - due)
            task = asyncio.create_task(self.one(plan), name=f"bench-request-{plan.index}")
            tasks.add(task)
            task.add_done_callback(release)

    async def closed_loop_client(self, shared: list[RequestPlan]) -> None:
        # Clients take plans from one shared list; pop() is atomic between awaits.
        for _ in range(len(self.plans)):
            if not shared:
                return
            if self.clock() >= self.deadline:
                self.stopped_by_duration = True
                return
            await self.one(shared.pop())


async def _tick(
    run: _Run, on_progress: Callable[[Progress], None], interval_s: float, stop: asyncio.Event
) -> None:
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval_s)
        except TimeoutError:
            on_progress(run.progress())


async def _finish(tasks: set[asyncio.Task[None]], timeout_s: float | None) -> None:
    """Wait for ``tasks`` up to ``timeout_s``, then cancel the rest and wait for them to unwind."""
    if tasks:
        await asyncio.wait(set(tasks), timeout=timeout_s)
    leftover = [t for t in tasks if not t.done()]
    for task in leftover:
        task.cancel()
    if leftover:
        await asyncio.gather(*leftover, return_exceptions=True)


async def run_load(
    plans: Sequence[RequestPlan],
    config: LoadConfig | None = None,
    *,
    channel: grpc.aio.Channel | None = None,
    clock: Callable[[], float] = time.monotonic,
    on_progress: Callable[[Progress], None] | None = None,
) -> LoadResult:
    """Replay ``plans`` against ``config.target`` (or over ``channel``) and measure every request.

    A channel passed in is used as is and left open; otherwise one is opened to
    ``config.target`` and closed before returning. Raises :class:`LoadError` when the
    channel does not connect within ``connect_timeout_s``. Cancelling the caller
    cancels every outstanding call and closes the channel.
    """
    config = config or LoadConfig()
    own_channel = channel is None
    if channel is None:
        tls = client_tls_from_arg(config.tls_ca_file)
        sizes = message_size_options(limits.SERVING_MAX_MESSAGE_BYTES, limits.SERVING_MAX_MESSAGE_BYTES)
        chan = open_channel(config.target, sizes, tls=tls)
    else:
        chan = channel
    try:
        try:
            await asyncio.wait_for(_router_ready(chan), timeout=config.connect_timeout_s)
        except TimeoutError:
            raise LoadError(
                f"cannot reach a router at {config.target} that can place a request within "
                f"{config.connect_timeout_s:g} s; start one (e.g. `slo-router up`), wait for its workers "
                "to register, or pass --target HOST:PORT"
            ) from None
        return await _replay(plans, config, router_pb2_grpc.RouterStub(chan), clock, on_progress)
    finally:
        if own_channel:
            await chan.close(None)


async def _router_ready(channel: grpc.aio.Channel) -> None:
    """Until the router connects, reports ``SERVING`` and can place a request now.

    A router answers ``NOT_SERVING`` until its first view arrives, and a view may hold part of a
    fleet (the prefill worker registered, the decode worker still retrying): requests sent then
    fail with "no prefill+decode pair". So wait for health, then for a ``Schedule`` dry run of a
    one-token request that is not ``UNAVAILABLE``. A server without health or ``Schedule`` is
    taken as ready once connected. The caller bounds the wait.
    """
    await channel.channel_ready()
    check = channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )
    schedule = router_pb2_grpc.RouterStub(channel).Schedule
    probe = router_pb2.ScheduleRequest(
        request=router_pb2.GenerateRequest(
            prompt_token_ids=[1], sampling=common_pb2.SamplingParams(max_tokens=1)
        )
    )
    while True:
        try:
            reply = await check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                await schedule(probe, timeout=2.0)
                return
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return  # no health or Schedule service, or a refusal that waiting does not cure
        await asyncio.sleep(0.1)


async def _replay(
    plans: Sequence[RequestPlan],
    config: LoadConfig,
    stub: router_pb2_grpc.RouterAsyncStub,
    clock: Callable[[], float],
    on_progress: Callable[[Progress], None] | None,
) -> LoadResult:
    run = _Run(plans, config, stub, clock)
    stop = asyncio.Event()
    ticker = (
        asyncio.create_task(_tick(run, on_progress, config.progress_interval_s, stop), name="bench-progress")
        if on_progress is not None
        else None
    )
    requests: set[asyncio.Task[None]] = set()
    clients: set[asyncio.Task[None]] = set()
    try:
        if config.concurrency > 0:
            shared = list(reversed(plans))
            clients = {
                asyncio.create_task(run.closed_loop_client(shared), name=f"bench-client-{i}")
                for i in range(min(config.concurrency, len(plans)))
            }
            timeout = None if config.duration_s is None else config.duration_s + config.drain_timeout_s
            await _finish(clients, timeout)
        else:
            await run.open_loop(requests)
            await _finish(requests, config.drain_timeout_s if run.stopped_by_duration else None)
    finally:
        await _finish(clients | requests, 0)
        stop.set()
        if ticker is not None:
            await ticker
    if on_progress is not None:
        on_progress(run.progress(done=True))
    results = sorted((s.result(run.start) for s in run.streams), key=lambda r: r.index)
    ends = [s.end for s in run.streams if s.end is not None]
    end = max(ends) if len(ends) == len(run.streams) and ends else clock()
    return LoadResult(
        results=tuple(results),
        planned=len(plans),
        duration_s=max(0.0, end - run.start) if run.streams else 0.0,
        stopped_by_duration=run.stopped_by_duration,
        max_send_lag_s=run.max_send_lag_s,
    )


class ProgressBar:
    """A plain-text progress line for ``on_progress``.

    On a terminal it redraws one line in place; otherwise it prints a line every
    ``plain_interval_s`` of run time so logs stay short.
    """

    def __init__(
        self, stream: TextIO | None = None, *, width: int = 30, plain_interval_s: float = 10.0
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.plain_interval_s = plain_interval_s
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_len = 0
        self._last_plain_s = -math.inf

    def __call__(self, p: Progress) -> None:
        # The bar follows completions, not arrivals: sending ends with the duration, the run does not.
        fraction = 1.0 if p.done or not p.planned else p.completed / p.planned
        filled = round(fraction * self.width)
        clock = f"{p.elapsed_s:.1f} s"
        if p.duration_s and not p.done:
            clock += (
                " (sending)" if p.elapsed_s < p.duration_s else " (sending over; waiting for the last ones)"
            )
        line = (
            f"[{'#' * filled}{'.' * (self.width - filled)}] {p.completed}/{p.planned} done, "
            f"{p.in_flight} in flight, {p.errors} errors, {clock}"
        )
        if self.tty:
            self.stream.write("\r" + line.ljust(self._last_len))
            self._last_len = len(line)
        elif p.done or p.elapsed_s - self._last_plain_s >= self.plain_interval_s:
            self._last_plain_s = p.elapsed_s
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the progress line (a newline on a terminal)."""
        if self.tty and self._last_len:
            self.stream.write("\n")
            self.stream.flush()
