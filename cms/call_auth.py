"""A bearer token on the calls that make a worker do or stop work (router → worker, worker → worker).

The Worker service's ``Prefill``, ``Generate``, ``Decode``, ``Streams`` and
``Abort`` start, run or cut a request, and ``KvEvents`` tells which prompt blocks it
has seen. Anyone who can reach a worker and read
the CMS view (every instance's endpoint) could otherwise cut other clients'
streams with ``Abort`` or use the engine directly. With a worker token
(``--worker-auth-token-file`` on the router and on every worker; ``up`` makes
one) the worker refuses those six calls without ``authorization: Bearer
<token>`` (``UNAUTHENTICATED``); ``GetInfo``, health and reflection stay open.

:class:`RequireToken` is the server side (an interceptor, so the servicer is
untouched); :func:`send_token` the client side, on every call of a channel
(:func:`send_token`; :func:`cms.transport.open_channel` ``call_token=``). The token is compared in
constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import grpc

from cms.auth import read_client_token_text
from fleet.flags import file_problem

_Handler = Any  # grpc's RpcMethodHandler namedtuple

#: The Worker methods that need the token.
PROTECTED_WORKER_METHODS = frozenset(
    f"/slorouter.v1.Worker/{name}"
    for name in ("Prefill", "Generate", "Decode", "Streams", "Abort", "KvEvents")
)


def read_worker_token(path: str | None, flag: str = "--worker-auth-token-file") -> str | None:
    """The token in ``path`` (None without one); ``ValueError`` naming ``flag``."""
    if not path:
        return None
    try:
        return read_client_token_text(Path(path).read_text(encoding="utf-8"), "")
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {file_problem(exc)}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag} {path}: {exc}") from None


def _refusal(message: str) -> Callable[..., Any]:
    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return refuse


def _refusal_stream(message: str) -> Callable[..., Any]:
    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # type: ignore[unreachable]  # an async generator, as gRPC expects of a streaming handler

    return refuse


class RequireToken(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Refuses ``methods`` unless the call carries ``authorization: Bearer <token>``."""

    def __init__(self, token: str, methods: Iterable[str] = PROTECTED_WORKER_METHODS) -> None:
        if not token:
            raise ValueError("the worker token is empty")
        self._expected = f"Bearer {token}".encode()
        self._methods = frozenset(methods)
        self._refused: dict[str, _Handler] = {}

    def _allowed(self, metadata: Any) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(given, self._expected)
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[_Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> _Handler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method not in self._methods:
            return handler
        if self._allowed(handler_call_details.invocation_metadata):
            return handler
        refused = self._refused.get(method)
        if refused is None:
            message = (
                f"{method.rsplit('/', 1)[1]} needs the worker token ('authorization: Bearer <token>', "
                "the router's and workers' --worker-auth-token-file)"
            )
            if handler.request_streaming and handler.response_streaming:
                refused = handler._replace(stream_stream=_refusal_stream(message))
            elif handler.response_streaming:
                refused = handler._replace(unary_stream=_refusal_stream(message))
            elif handler.request_streaming:
                refused = handler._replace(stream_unary=_refusal(message))
            else:
                refused = handler._replace(unary_unary=_refusal(message))
            self._refused[method] = refused
        return refused


class _WithToken:
    def __init__(self, token: str) -> None:
        self._entry = ("authorization", f"Bearer {token}")

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata.add(*self._entry)
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


class _UnaryUnary(_WithToken, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[type-arg]
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _UnaryStream(_WithToken, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[type-arg]
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _StreamUnary(_WithToken, grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[type-arg]
    async def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(self._details(details), request_iterator)


class _StreamStream(_WithToken, grpc.aio.StreamStreamClientInterceptor):  # type: ignore[type-arg]
    async def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(self._details(details), request_iterator)


def send_token(token: str) -> list[Any]:
    """Client interceptors adding ``authorization: Bearer <token>`` to every call of a channel.

    One per call kind: a channel files each interceptor under the first kind it is an
    instance of, so one object implementing all four would only see unary calls.
    """
    return [kind(token) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
