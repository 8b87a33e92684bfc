"""What every gRPC server of the project does alike (CMS, router, workers).

A server never shares a busy port (no ``SO_REUSEPORT``: a second instance on
the same address must fail, not split the traffic), reports a bind failure as
``OSError``, and serves ``grpc.health.v1`` and server reflection next to its
own service. It has explicit message size limits, serves TLS when given a
certificate, and answers a request that is not a valid protobuf message with
``INVALID_ARGUMENT`` and one log line (gRPC's default is ``UNKNOWN`` and a
traceback per request).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cms.transport import ServerTls, message_size_options

logger = logging.getLogger(__name__)


_Handler = Any  # grpc's RpcMethodHandler namedtuple (typed loosely by grpc-stubs)

#: Shortest keepalive interval a client may configure against our servers (s).
MIN_CLIENT_KEEPALIVE_S = 1.0

#: Every server accepts its clients' keepalive pings, idle or not, as often as once a
#: second. gRPC's defaults accept a ping without data only every 5 minutes and answer the
#: third early one with GOAWAY ENHANCE_YOUR_CALM "too_many_pings"; the client then doubles its
#: interval, so the router's keepalive (10 s) stretched to a minute and a frozen worker went
#: unnoticed that long.
KEEPALIVE_SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", round(MIN_CLIENT_KEEPALIVE_S * 1000)),
    ("grpc.http2.min_ping_interval_without_data_ms", round(MIN_CLIENT_KEEPALIVE_S * 1000)),
    # And never GOAWAY for pings (a ping costs the server an ACK frame, nothing more).
    ("grpc.http2.max_ping_strikes", 0),
)


class _Malformed:
    """What the request deserializer hands over instead of a message it could not parse."""

    __slots__ = ("error", "method")

    def __init__(self, method: str, error: Exception) -> None:
        self.method = method
        self.error = error


def _safe_deserializer(method: str, deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError, or anything a broken message makes protobuf raise
            return _Malformed(method, exc)

    return deserialize


async def _reject(request: _Malformed, context: grpc.aio.ServicerContext[Any, Any]) -> None:
    logger.warning(
        "%s: refused a request that is not a valid protobuf message (%s)", request.method, request.error
    )
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"the request is not a valid message for {request.method}: the bytes do not parse",
    )


def _guard(behavior: Callable[..., Any]) -> Callable[..., Any]:
    """``behavior`` with malformed requests refused before it runs."""
    if inspect.isasyncgenfunction(behavior):
        # Still an async generator, so gRPC drives the stream (writes, flow control, shutdown)
        # exactly as it does for the servicer's own generator.
        async def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            if isinstance(request, _Malformed):
                await _reject(request, context)
            # aclosing: when gRPC drops this generator, the servicer's own cleanup runs at once.
            async with contextlib.aclosing(behavior(request, context)) as messages:
                async for message in messages:
                    yield message

        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if isinstance(request, _Malformed):
            await _reject(request, context)
        return await behavior(request, context)

    return call


class MalformedRequestGuard(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Turns undecodable requests into ``INVALID_ARGUMENT`` (unary requests; all ours are).

    The guarded handler is built once per method and reused, so a call pays
    one dictionary lookup.
    """

    def __init__(self) -> None:
        self._guarded: dict[str, tuple[_Handler, _Handler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[_Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> _Handler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        cached = self._guarded.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        deserializer = _safe_deserializer(method, handler.request_deserializer)
        guarded: _Handler
        if handler.response_streaming:
            guarded = handler._replace(
                request_deserializer=deserializer, unary_stream=_guard(handler.unary_stream)
            )
        else:
            guarded = handler._replace(
                request_deserializer=deserializer, unary_unary=_guard(handler.unary_unary)
            )
        if len(self._guarded) < 256:  # methods of the services served here; unknown ones are not cached
            self._guarded[method] = (handler, guarded)
        return guarded


async def bind_server(
    listen: str,
    options: Sequence[tuple[str, Any]] = (),
    *,
    max_receive_bytes: int,
    max_send_bytes: int,
    tls: ServerTls | None = None,
    reuse_port: bool = False,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),  # type: ignore[type-arg]
) -> tuple[grpc.aio.Server, int]:
    """A new server bound to ``listen`` (``HOST:PORT``; port 0 picks one) and the port it got.

    Messages above ``max_receive_bytes`` are refused by gRPC with
    ``RESOURCE_EXHAUSTED`` before any handler runs. With ``tls`` the port
    speaks TLS only. ``reuse_port`` lets other processes listen on the same port
    (``SO_REUSEPORT``; the kernel spreads connections over them).

    Raises ``OSError`` when the address cannot be bound (the server is stopped first).
    """
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 1 if reuse_port else 0),
            *message_size_options(max_receive_bytes, max_send_bytes),
            *KEEPALIVE_SERVER_OPTIONS,
            *options,
        ],
        interceptors=[*interceptors, MalformedRequestGuard()],
    )
    try:
        if tls is not None:
            port = server.add_secure_port(listen, tls.credentials())
        else:
            port = server.add_insecure_port(listen)
    except RuntimeError as exc:
        await server.stop(None)
        raise OSError(f"cannot listen on {listen}: {exc}") from exc
    if port == 0:
        await server.stop(None)
        raise OSError(f"cannot listen on {listen}")
    return server, port


def add_health_and_reflection(server: grpc.aio.Server, service_name: str) -> Any:
    """Serve health checks and reflection for ``service_name``; returns the health servicer."""
    health_servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return health_servicer
