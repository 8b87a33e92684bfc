"""The Worker gRPC service over an :class:`engine.interface.Engine`, and a way to run it.

:func:`start_worker_server` binds a ``grpc.aio`` server with the Worker
service, the standard ``grpc.health.v1`` health service and server
reflection, starts the engine and (when given a CMS address) the status
agent, and returns a :class:`WorkerServer`.

Errors: the engine's exception tree (:mod:`engine.interface`) is mapped to gRPC
status codes in :func:`status_for`, the one place that does so:

=============================  ======================
``InvalidRequestError``        ``INVALID_ARGUMENT``
``DuplicateRequestError``      ``ALREADY_EXISTS``
``KvHandleError``              ``NOT_FOUND``
``EngineShuttingDownError``    ``UNAVAILABLE``
``EngineOverloadedError``      ``RESOURCE_EXHAUSTED``
any other ``EngineError``      ``INTERNAL``
=============================  ======================

A client that cancels a call aborts its request on the engine. Tokens a slow
client has not taken yet are merged by the engine, so each message carries
everything ready (see :class:`engine.interface.DeltaCollector`).

``Streams`` carries many requests' generate/decode legs on one call, with one
message per engine step for all of them (:mod:`workers.streams`); the router
uses it by default, and ``Generate``/``Decode`` stay for every other client.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
from grpc_health.v1 import health_pb2
from slorouter.v1 import cms_pb2, common_pb2, worker_pb2, worker_pb2_grpc

from cms import limits
from cms.call_auth import RequireToken
from cms.serving import add_health_and_reflection, bind_server
from cms.transport import ClientTls, ServerTls
from engine.interface import (
    DuplicateRequestError,
    EndpointAware,
    Engine,
    EngineError,
    EngineOverloadedError,
    EngineShuttingDownError,
    InvalidRequestError,
    KvHandleError,
    Sampling,
    TextTokenizer,
    TokenDelta,
    TokenizingEngine,
    validate_request,
)
from engine.tokenizer import SimpleTokenizer
from workers.kv_auth import KvSigner
from workers.kv_events import KvEventHub, TooManySubscribersError
from workers.metadata import WorkerIdentity, build_metadata
from workers.streams import StreamsSession

if TYPE_CHECKING:
    from openai_http.app import HttpServer
    from workers.agent import StatusAgent

logger = logging.getLogger(__name__)

#: Upper bound of ``stream_interval_s`` (``--stream-interval-ms``): longer would starve a stream's reader.
MAX_STREAM_INTERVAL_S = 1.0

SERVICE_NAME: str = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name

_Context = grpc.aio.ServicerContext[Any, Any]

_CODES: tuple[tuple[type[EngineError], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (DuplicateRequestError, grpc.StatusCode.ALREADY_EXISTS),
    (KvHandleError, grpc.StatusCode.NOT_FOUND),
    (EngineShuttingDownError, grpc.StatusCode.UNAVAILABLE),
    (EngineOverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
)


def status_for(exc: EngineError) -> grpc.StatusCode:
    """The gRPC status code of an engine error (see the module docstring)."""
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


async def _abort(context: _Context, exc: EngineError) -> NoReturn:
    await context.abort(status_for(exc), str(exc) or type(exc).__name__)
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises


def sampling_from_proto(params: common_pb2.SamplingParams) -> Sampling:
    """Engine sampling parameters; zero values mean the engine default (max_tokens excepted)."""
    return Sampling(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p if params.top_p > 0 else 1.0,
        top_k=params.top_k,
        seed=params.seed,
        stop=tuple(params.stop),
        ignore_eos=params.ignore_eos,
    )


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Maps the Worker RPCs onto an engine; knows nothing of any backend."""

    def __init__(
        self,
        engine: Engine,
        metadata: cms_pb2.InstanceMetadata,
        tokenizer: TextTokenizer | None = None,
        kv_signer: KvSigner | None = None,
        stream_interval_s: float = 0.0,
    ) -> None:
        if not (math.isfinite(stream_interval_s) and 0 <= stream_interval_s <= MAX_STREAM_INTERVAL_S):
            raise ValueError(
                f"stream_interval_s must be within [0, {MAX_STREAM_INTERVAL_S:g}] s, got {stream_interval_s!r}"
            )
        self._stream_interval_s = stream_interval_s
        self._engine = engine
        self._metadata = metadata
        self._kv_signer = kv_signer
        if tokenizer is None:
            tokenizer = engine.tokenizer if isinstance(engine, TokenizingEngine) else SimpleTokenizer()
        self._tokenizer = tokenizer

    @staticmethod
    def _check_bounds(request: Any) -> None:
        """The shared field bounds (:mod:`cms.limits`), before anything reaches the engine."""
        try:
            limits.check_worker_request(request)
        except limits.FieldLimitError as exc:
            raise InvalidRequestError(str(exc)) from None

    def _prompt(self, token_ids: Any, text: str) -> tuple[int, ...]:
        if token_ids and text:
            raise InvalidRequestError("prompt: send exactly one of prompt_token_ids and prompt, not both")
        if text:
            return tuple(self._tokenizer.encode(text))
        return tuple(token_ids)

    async def Generate(  # type: ignore[override]
        self, request: worker_pb2.WorkerGenerateRequest, context: _Context
    ) -> None:
        rid = request.request_id
        try:
            num_prompt, stream = self.open_generate(
                rid, request.prompt_token_ids, request.prompt, request.sampling
            )
            await self._stream(context, rid, num_prompt, stream)
        except EngineError as exc:
            await _abort(context, exc)

    def open_generate(
        self, request_id: str, token_ids: Sequence[int], text: str, sampling: common_pb2.SamplingParams
    ) -> tuple[int, AsyncIterator[TokenDelta]]:
        """Validate a generate request and hand it to the engine: (prompt tokens, the delta stream).

        The path the gRPC ``Generate`` and the HTTP face share. Raises
        :class:`~engine.interface.EngineError`; the caller aborts the request on
        the engine when it stops reading before the last delta.
        """
        try:  # the shared field bounds (cms/limits.py) first, for the HTTP face too
            limits.check_id(request_id, "request_id")
            limits.check_text(text, "prompt", limits.MAX_PROMPT_TEXT_BYTES)
            limits.check_token_ids(token_ids, "prompt_token_ids")
            limits.check_sampling(sampling)
        except limits.FieldLimitError as exc:
            raise InvalidRequestError(str(exc)) from None
        prompt = self._prompt(token_ids, text)
        params = sampling_from_proto(sampling)
        validate_request(self._engine.info, request_id, prompt, params)
        return len(prompt), self._engine.generate(request_id, prompt, params)

    async def Decode(  # type: ignore[override]
        self, request: worker_pb2.DecodeRequest, context: _Context
    ) -> None:
        rid = request.request_id
        try:
            self._check_bounds(request)
            num_prompt, stream = self.open_decode(request)
            await self._stream(context, rid, num_prompt, stream)
        except EngineError as exc:
            await _abort(context, exc)

    def open_decode(self, request: worker_pb2.DecodeRequest) -> tuple[int, AsyncIterator[TokenDelta]]:
        """Validate a decode request (bounds already checked) and hand it to the engine."""
        rid = request.request_id
        prompt = tuple(request.prompt_token_ids)
        generated = tuple(request.generated_token_ids)
        sampling = sampling_from_proto(request.sampling)
        validate_request(self._engine.info, rid, prompt, sampling, generated)
        kv_handle = request.kv_handle
        if self._kv_signer is not None:
            kv_handle = self._kv_signer.open(rid, kv_handle)
        return len(prompt), self._engine.decode(rid, prompt, sampling, kv_handle, generated)

    def _open_leg(self, command: worker_pb2.StreamCommand) -> tuple[int, AsyncIterator[TokenDelta]]:
        if command.HasField("decode"):
            return self.open_decode(command.decode)
        request = command.generate
        return self.open_generate(
            request.request_id, request.prompt_token_ids, request.prompt, request.sampling
        )

    async def Streams(  # type: ignore[override]
        self, request_iterator: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        """Many legs on one stream, one batch per flush (see :mod:`workers.streams`)."""
        session = StreamsSession(self._engine, context, self._open_leg, status_for, self._stream_interval_s)
        await session.run()

    async def KvEvents(  # type: ignore[override]
        self, request: worker_pb2.KvEventsRequest, context: _Context
    ) -> None:
        """The prefix cache's block events: a snapshot, then a batch per step (:mod:`workers.kv_events`)."""
        hub = getattr(self._engine, "kv_events", None)
        if not isinstance(hub, KvEventHub):
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                "this worker's engine publishes no prefix-cache events; route with --prefix-cache-routing "
                "approximate",
            )
        if not hub.block_tokens:
            await context.write(worker_pb2.KvEventBatch(block_tokens=0))
            return
        try:
            sub = hub.subscribe()
        except TooManySubscribersError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        try:
            while True:
                for batch in await sub.next():
                    await context.write(batch)  # waits while the subscriber's window is full
        finally:
            hub.unsubscribe(sub)

    async def _stream(
        self, context: _Context, request_id: str, num_prompt_tokens: int, stream: AsyncIterator[TokenDelta]
    ) -> None:
        finished = False
        first = True
        interval = self._stream_interval_s
        loop = asyncio.get_running_loop()
        try:
            async for delta in stream:
                finished = delta.finished
                sent_at = loop.time()
                await context.write(
                    worker_pb2.WorkerTokens(
                        request_id=request_id,
                        token_ids=delta.token_ids,
                        text=delta.text,
                        finished=delta.finished,
                        finish_reason=delta.finish_reason,
                        num_prompt_tokens=num_prompt_tokens if first or delta.finished else 0,
                        num_cached_prompt_tokens=delta.num_cached_prompt_tokens,
                    )
                )
                first = False
                if finished:
                    break
                if interval:
                    # Hold the next message until `interval` after this one: the engine merges the
                    # tokens of the steps in between (DeltaCollector), so a fast engine sends fewer,
                    # larger messages and every hop after it (router, client) handles fewer.
                    wait = interval - (loop.time() - sent_at)
                    if wait > 0:
                        await asyncio.sleep(wait)
        except asyncio.CancelledError:
            # The client went away: its request must not keep running.
            if not finished:
                await self._engine.abort(request_id)
            raise
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: _Context
    ) -> worker_pb2.PrefillResponse:
        rid = request.request_id
        try:
            self._check_bounds(request)
            prompt = self._prompt(request.prompt_token_ids, request.prompt)
            sampling = sampling_from_proto(request.sampling)
            validate_request(self._engine.info, rid, prompt, sampling)
            try:
                result = await self._engine.prefill(rid, prompt, sampling)
            except asyncio.CancelledError:
                await self._engine.abort(rid)
                raise
        except EngineError as exc:
            await _abort(context, exc)
        kv_handle = result.kv_handle
        if self._kv_signer is not None:
            kv_handle = self._kv_signer.sign(rid, kv_handle)
        return worker_pb2.PrefillResponse(
            request_id=rid,
            first_token_id=result.first_token_id,
            text=result.text,
            kv_handle=kv_handle,
            finished=result.finished,
            finish_reason=result.finish_reason,
            num_prompt_tokens=result.num_prompt_tokens or len(prompt),
        )

    async def Abort(self, request: worker_pb2.AbortRequest, context: _Context) -> worker_pb2.AbortResponse:
        try:
            self._check_bounds(request)
        except InvalidRequestError as exc:
            await _abort(context, exc)
        return worker_pb2.AbortResponse(found=await self._engine.abort(request.request_id))

    async def GetInfo(
        self, request: worker_pb2.GetInfoRequest, context: _Context
    ) -> cms_pb2.InstanceMetadata:
        return self._metadata


def _split_listen(listen: str) -> tuple[str, int]:
    host, sep, port_text = listen.rpartition(":")
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(f"listen address {listen!r} is not HOST:PORT (PORT 0 picks a free port)")
    return host, int(port_text)


_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", "*"})


class WorkerServer:
    """A running worker: Worker service + health + reflection over one engine, and its agent.

    ``address`` is the ``host:port`` other processes reach it at (the bound
    port; a wildcard listen host is replaced by the advertised host).
    """

    def __init__(
        self,
        server: grpc.aio.Server,
        engine: Engine,
        health_servicer: Any,
        metadata: cms_pb2.InstanceMetadata,
        port: int,
        agent: StatusAgent | None,
    ) -> None:
        self._server = server
        self.engine = engine
        self._health = health_servicer
        self.metadata = metadata
        self.port = port
        self.address = metadata.endpoint
        self.agent = agent
        #: The OpenAI-compatible HTTP face, when started with ``http_listen``.
        self.http: HttpServer | None = None
        self._stopping: asyncio.Task[None] | None = None

    @property
    def instance_id(self) -> str:
        return self.metadata.instance_id

    async def stop(self, grace: float | None = 1.0) -> None:
        """Deregister, stop taking calls, give running ones ``grace`` seconds, stop the engine. Idempotent."""
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_task(self._stop(grace))
        await asyncio.shield(self._stopping)

    async def _stop(self, grace: float | None) -> None:
        if self.agent is not None:
            await self.agent.stop()
        if self.http is not None:
            await self.http.stop()
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace)
        await self.engine.stop()

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()


async def start_worker_server(
    engine: Engine,
    listen: str = "127.0.0.1:0",
    *,
    identity: WorkerIdentity | None = None,
    advertise_host: str | None = None,
    cms: str | None = None,
    cms_auth_token: str | None = None,
    tokenizer: TextTokenizer | None = None,
    agent_coalesce_s: float = 0.005,
    heartbeat_interval_s: float = 0.5,
    cms_backoff_max_s: float = 5.0,
    http_listen: str = "",
    engine_stall_s: float = 30.0,
    kv_signer: KvSigner | None = None,
    tls: ServerTls | None = None,
    cms_tls: ClientTls | None = None,
    stream_interval_s: float = 0.0,
    worker_token: str | None = None,
) -> WorkerServer:
    """Start ``engine`` and serve it on ``listen`` (``HOST:PORT``; port 0 picks one).

    With ``cms`` (``host:port`` or ``grpc://host:port``) a status agent
    registers the instance there and keeps its status current; a CMS that is
    down is retried in the background and never delays or breaks serving.
    ``advertise_host`` is the host put into the registered endpoint (default:
    the listen host, or this machine's host name when listening on a
    wildcard address). ``agent_coalesce_s``, ``heartbeat_interval_s`` and
    ``cms_backoff_max_s`` tune the agent; ``engine_stall_s`` is how long an engine
    holding work may finish no step before the agent reports it unschedulable (0 = off).
    ``kv_signer`` signs the kv handles this worker hands out and checks those it
    is given (:mod:`workers.kv_auth`); ``tls`` serves TLS only; ``cms_tls``
    reaches the CMS over TLS. ``stream_interval_s`` > 0 spaces a stream's messages
    at least that far apart (the first goes at once; tokens in between are merged
    into the next). With ``worker_token``, ``Prefill``, ``Generate``, ``Decode``, ``Streams`` and
    ``Abort`` need it (:mod:`cms.call_auth`). ``WorkerServer.stop()`` stops the agent, the
    server and the engine. With ``http_listen`` (``HOST:PORT``) the engine is
    also served over OpenAI's HTTP API (:mod:`workers.http_face`). Raises
    ``OSError`` when an address cannot be bound.
    """
    identity = identity if identity is not None else WorkerIdentity()
    host, _ = _split_listen(listen)
    server, port = await bind_server(
        listen,
        max_receive_bytes=limits.SERVING_MAX_MESSAGE_BYTES,
        max_send_bytes=limits.SERVING_MAX_MESSAGE_BYTES,
        tls=tls,
        interceptors=[RequireToken(worker_token)] if worker_token else (),
    )
    if worker_token is None:
        logger.warning(
            "the Worker service needs no token (no --worker-auth-token-file): anyone who reaches this "
            "worker can run requests on it and Abort other clients' requests"
        )
    if kv_signer is None:
        logger.warning(
            "kv handles are not signed (no kv key): anyone who reaches this worker can make it call "
            "Abort on an endpoint of their choosing; give --kv-key-file"
        )
    if advertise_host is None:
        advertise_host = socket.gethostname() if host in _WILDCARD_HOSTS else host
    endpoint = f"{advertise_host}:{port}"
    if isinstance(engine, EndpointAware):
        engine.set_endpoint(endpoint)
    await engine.start()
    agent: StatusAgent | None = None
    try:
        # Only a started engine knows all its facts (vLLM sizes its KV cache while starting).
        metadata = build_metadata(engine.info, identity, endpoint)
        servicer = WorkerServicer(engine, metadata, tokenizer, kv_signer, stream_interval_s)
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
        health_servicer = add_health_and_reflection(server, SERVICE_NAME)
        await server.start()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        if cms:
            from workers.agent import StatusAgent, make_cms_sink

            sink = make_cms_sink(
                cms,
                metadata,
                auth_token=cms_auth_token,
                heartbeat_interval_s=heartbeat_interval_s,
                backoff_max_s=cms_backoff_max_s,
                tls=cms_tls,
            )
            agent = StatusAgent(
                engine, metadata, sink, coalesce_s=agent_coalesce_s, engine_stall_s=engine_stall_s
            )
            await agent.start()
    except BaseException:
        await server.stop(None)
        await engine.stop()
        raise
    logger.info("worker %s serving on %s", metadata.instance_id, endpoint)
    worker = WorkerServer(server, engine, health_servicer, metadata, port, agent)
    if http_listen:
        from workers.http_face import start_http_face

        try:
            worker.http = await start_http_face(servicer, engine, metadata, http_listen)
        except BaseException:
            await worker.stop(grace=0)
            raise
    return worker
