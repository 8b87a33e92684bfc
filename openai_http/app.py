"""A Starlette app speaking OpenAI's HTTP API over a :class:`Backend`, and a uvicorn server for it.

The app parses and bounds the request (:mod:`openai_http.protocol`), asks the
backend for the text pieces of the completion and returns them as one JSON
response or as server-sent events. The backend's first piece is awaited
before the response starts, so a request refused at placement gets a proper
HTTP status (400/429/503) rather than an error inside a 200 stream; a failure
after the first piece becomes an ``error`` event followed by ``[DONE]``.

The two completion routes are served on the ASGI interface itself, in front
of the Starlette app that serves the rest: a streamed completion sends one
chunk per backend piece, and every layer between the piece and uvicorn's
``send`` (Starlette's response machinery and its middleware each wrap ``send``
in a coroutine of their own) was paid once per token.

A client that goes away cancels its request: a watcher on the connection
cancels the stream, or the collection of a plain response. Either way the
backend's generator is closed at once, which is where the backend releases
what the request held.

:class:`HttpServer` runs uvicorn on the caller's event loop (next to a gRPC
server), on a socket it binds itself (so port 0 works and the bound port is
known), without touching the process's signal handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import time
import uuid
from collections.abc import AsyncGenerator, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import MappingProxyType
from typing import Any, Protocol

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from openai_http.bounded import EdgeLimits, EdgeStats, bounded_protocol
from openai_http.protocol import (
    ApiError,
    ChunkEncoder,
    Kind,
    ParsedRequest,
    Usage,
    chunk_body,
    decode_json,
    models_body,
    parse_request,
    response_body,
    sse,
    usage_chunk_body,
)

#: Largest request body accepted (bytes).
DEFAULT_MAX_BODY_BYTES = 8 << 20
#: Time the whole request body may take to arrive once its head did (s); then 408.
DEFAULT_BODY_TIMEOUT_S = 30.0
#: The routes served on ASGI directly (POST only; other methods get Starlette's 405).
_COMPLETION_PATHS = {"/v1/completions": Kind.COMPLETION, "/v1/chat/completions": Kind.CHAT}
#: Status logged for a request whose client went away before the response.
CLIENT_CLOSED = 499


#: The event that ends a stream.
_DONE = b"data: [DONE]\n\n"
#: The headers of a piece that carries none.
_NO_HEADERS: Mapping[str, str] = MappingProxyType({})


#: Bodies larger than this are decoded and checked on the parser thread, not on the event loop.
OFFLOAD_PARSE_BYTES = 256 << 10
_PARSER: ThreadPoolExecutor | None = None


def _parser() -> ThreadPoolExecutor:
    """One thread for large bodies: several at once queue behind each other, not beside the loop."""
    global _PARSER
    if _PARSER is None:
        _PARSER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="http-parse")
    return _PARSER


def _parse(kind: Kind, raw: bytes, render_chat: Any) -> ParsedRequest:
    return parse_request(kind, decode_json(raw), render_chat)


class Piece:
    """Some new text of a completion. The first piece may carry response headers; the last, the usage.

    A plain slotted class (one is built per token): a frozen dataclass's ``__init__``
    cost several times as much.
    """

    __slots__ = ("finish_reason", "finished", "headers", "text", "usage")

    def __init__(
        self,
        text: str,
        finished: bool = False,
        finish_reason: str = "",
        usage: Usage | None = None,
        headers: Mapping[str, str] = _NO_HEADERS,
    ) -> None:
        self.text = text
        self.finished = finished
        #: "length" | "stop" | ... ; set on the last piece.
        self.finish_reason = finish_reason
        self.usage = usage
        self.headers = headers


class Backend(Protocol):
    """What serves the completions behind the HTTP API."""

    #: ``owned_by`` in ``/v1/models``.
    owner: str

    def generate(self, request: ParsedRequest, headers: Mapping[str, str]) -> AsyncGenerator[Piece, None]:
        """An async generator of the completion's pieces, ending with one whose ``finished`` is set.

        Raises :class:`ApiError` (before or after the first piece). The app
        closes it when the client goes away, and iterates it to the end
        otherwise.
        """
        ...

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The prompt for a list of chat messages."""
        ...

    def models(self) -> Sequence[tuple[str, int]]:
        """(model name, max_model_len or 0) of each model served."""
        ...

    def health(self) -> str | None:
        """``None`` when ready to serve, else why not (``/health`` returns 503 with it)."""
        ...

    def metrics(self) -> tuple[bytes, str]:
        """The Prometheus exposition and its content type."""
        ...


def error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _read_body(request: Request, limit: int, timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is larger than {limit} bytes")
    chunks = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                chunks += chunk
                if len(chunks) > limit:
                    raise ApiError(413, f"the request body is larger than {limit} bytes")
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s") from None
    return bytes(chunks)


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _EventStream(Response):
    """Server-sent events, sent on the ASGI interface one chunk per piece.

    Closes the backend's generator however the response ends; a watcher on the
    connection cancels the stream when the client goes away (uvicorn's ``send``
    drops what is sent after a disconnect without a word, so nothing else would
    stop it).
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        parsed: ParsedRequest,
        pieces: AsyncGenerator[Piece, None],
        first: Piece,
        response_id: str,
        created: int,
        model: str,
    ) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers(first.headers)
        self._parsed = parsed
        self._pieces = pieces
        self._first = first
        self._id = response_id
        self._created = created
        self._model = model

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        streaming = True
        client_gone = False

        async def watch() -> None:
            nonlocal client_gone
            await _until_disconnect(receive)
            if streaming:
                client_gone = True
                task.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            await self._stream(send)  # ends the response
            streaming = False
        except asyncio.CancelledError:
            if not client_gone:
                raise
            task.uncancel()  # the client went away: the response ends here
        finally:
            streaming = False
            watcher.cancel()
            await _close(self._pieces)

    async def _stream(self, send: Send) -> None:
        parsed, first = self._parsed, self._first
        kind, include_usage = parsed.kind, parsed.include_usage
        response_id, created, model = self._id, self._created, self._model
        body = sse(
            chunk_body(
                kind,
                response_id,
                created,
                model,
                first.text,
                first.finish_reason if first.finished else None,
                first=True,
                include_usage=include_usage,
            )
        )
        await send({"type": "http.response.body", "body": body, "more_body": True})
        encode = ChunkEncoder(kind, response_id, created, model, include_usage=include_usage).encode
        last = first
        # The last piece's chunk goes out with the end of the stream, in one write.
        tail = b""
        try:
            async for piece in self._pieces:
                last = piece
                if piece.finished:
                    tail = encode(piece.text, piece.finish_reason)
                elif piece.text:
                    body = encode(piece.text, None)
                    await send({"type": "http.response.body", "body": body, "more_body": True})
        except ApiError as exc:
            body = tail + sse(exc.body()) + _DONE
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        if include_usage:
            usage = last.usage or Usage(0, 0)
            tail += sse(usage_chunk_body(kind, response_id, created, model, usage))
        await send({"type": "http.response.body", "body": tail + _DONE, "more_body": False})


async def _close(pieces: AsyncGenerator[Piece, None]) -> None:
    await pieces.aclose()


class OpenAIApp:
    """The routes; :attr:`app` is the ASGI application."""

    def __init__(
        self,
        backend: Backend,
        *,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        extra_routes: Sequence[BaseRoute] = (),
    ) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        self._backend = backend
        self._max_body_bytes = max_body_bytes
        self._created = int(time.time())
        #: The ASGI application.
        self.app: ASGIApp = self._asgi
        self._starlette = Starlette(
            routes=[
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/metrics", self._metrics, methods=["GET"]),
                *extra_routes,
            ],
            exception_handlers={404: self._not_found, 405: self._not_allowed},
        )

    async def _asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The completion routes straight on ASGI (see the module's docstring); the rest through Starlette."""
        if scope["type"] == "http" and scope["method"] == "POST":
            kind = _COMPLETION_PATHS.get(scope["path"])
            if kind is not None:
                response = await self._serve(Request(scope, receive), kind)
                await response(scope, receive, send)
                return
        await self._starlette(scope, receive, send)

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        return error_response(ApiError(404, f"no route {request.url.path}"))

    async def _not_allowed(self, request: Request, exc: Exception) -> Response:
        return error_response(ApiError(405, f"{request.method} is not allowed on {request.url.path}"))

    async def _models(self, request: Request) -> Response:
        return JSONResponse(models_body(self._backend.models(), self._created, self._backend.owner))

    async def _health(self, request: Request) -> Response:
        problem = self._backend.health()
        if problem is not None:
            return error_response(ApiError(503, problem))
        return JSONResponse({"status": "ok"})

    async def _metrics(self, request: Request) -> Response:
        body, content_type = self._backend.metrics()
        return Response(body, media_type=content_type)

    async def _completions(self, request: Request) -> Response:
        return await self._serve(request, Kind.COMPLETION)

    async def _chat(self, request: Request) -> Response:
        return await self._serve(request, Kind.CHAT)

    async def _serve(self, request: Request, kind: Kind) -> Response:
        try:
            raw = await _read_body(request, self._max_body_bytes)
            if len(raw) > OFFLOAD_PARSE_BYTES:
                # Decoding and checking a large body (a 7 MB list of token ids: ~0.5 s) would hold
                # the event loop the gRPC service shares; one parser thread takes it, and the loop
                # keeps turning except while JSON's C scanner holds the interpreter.
                parsed = await asyncio.get_running_loop().run_in_executor(
                    _parser(), _parse, kind, raw, self._backend.render_chat
                )
            else:
                parsed = parse_request(kind, decode_json(raw), self._backend.render_chat)
            pieces = self._backend.generate(parsed, request.headers)
            try:
                first = await anext(pieces)
            except StopAsyncIteration:
                raise ApiError(502, "the backend produced no output") from None
        except ApiError as exc:
            return error_response(exc)
        prefix = "cmpl-" if kind is Kind.COMPLETION else "chatcmpl-"
        response_id = prefix + uuid.uuid4().hex
        model = parsed.model or (self._backend.models() or [("", 0)])[0][0]
        created = int(time.time())
        if parsed.stream:
            return _EventStream(parsed, pieces, first, response_id, created, model)
        collector = asyncio.ensure_future(self._collect(pieces, first))
        watcher = asyncio.ensure_future(_until_disconnect(request.receive))
        try:
            await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not collector.done():  # the client went away: stop the request
                collector.cancel()
            await asyncio.gather(watcher, collector, return_exceptions=True)
            await _close(pieces)
        if collector.cancelled():
            return Response(status_code=CLIENT_CLOSED)
        error = collector.exception()
        if isinstance(error, ApiError):
            return error_response(error)
        if error is not None:
            raise error
        text, last = collector.result()
        usage = last.usage or Usage(0, 0)
        body = response_body(kind, response_id, created, model, text, last.finish_reason, usage)
        return JSONResponse(body, headers=dict(first.headers))

    @staticmethod
    async def _collect(pieces: AsyncGenerator[Piece, None], first: Piece) -> tuple[str, Piece]:
        texts = [first.text]
        last = first
        async for piece in pieces:
            texts.append(piece.text)
            last = piece
        if not last.finished:
            raise ApiError(502, "the completion ended without a finish reason")
        return "".join(texts), last


# ---------------------------------------------------------------------- serving


def split_host_port(listen: str, flag: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) as the flag ``flag`` takes it; raises ``ValueError`` naming it."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{flag} expects HOST:PORT with a port in 0..65535, got {listen!r}")
    return host.strip("[]"), int(port)


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the process's entry point owns those."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """Serves an ASGI app with uvicorn on the running event loop. ``start()`` / idempotent ``stop()``."""

    def __init__(
        self,
        app: Any,
        listen: str,
        *,
        flag: str = "--http-listen",
        limits: EdgeLimits | None = None,
        stats: EdgeStats | None = None,
        graceful_shutdown_s: float = 2.0,
    ) -> None:
        self._host, self._port = split_host_port(listen, flag)
        self._app = app
        self.limits = limits or EdgeLimits()
        #: What the connection bounds refused (:mod:`openai_http.bounded`).
        self.stats = stats or EdgeStats()
        self._graceful_shutdown_s = graceful_shutdown_s
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._socket: socket.socket | None = None
        self.address = ""

    async def start(self, timeout_s: float = 10.0) -> None:
        """Bind (raises ``OSError`` when the address is taken) and serve until :meth:`stop`."""
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self._host, self._port))
        except OSError:
            sock.close()
            raise
        self._socket = sock
        port = sock.getsockname()[1]
        host = f"[{self._host}]" if family == socket.AF_INET6 else self._host
        self.address = f"{host}:{port}"
        config = uvicorn.Config(
            self._app,
            # The bounded HTTP/1.1 protocol: head size and count, header and idle timeouts, a
            # connection limit (openai_http.bounded).
            http=bounded_protocol(self.limits, self.stats),
            interface="asgi3",
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_keep_alive=max(1, round(self.limits.idle_timeout_s)),
            timeout_graceful_shutdown=max(1, math.ceil(self._graceful_shutdown_s)),
        )
        self._server = _Server(config)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self._server.started:
            if self._task.done():
                await self._task
                raise OSError(f"the HTTP server on {self.address} stopped while starting")
            if asyncio.get_running_loop().time() > deadline:
                await self.stop()
                raise OSError(f"the HTTP server on {self.address} did not start within {timeout_s:g} s")
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        """Stop accepting, let open responses finish briefly, close the socket."""
        server, task, self._server, self._task = self._server, self._task, None, None
        if server is not None and task is not None:
            server.should_exit = True
            await task
        if self._socket is not None:
            self._socket.close()
            self._socket = None
