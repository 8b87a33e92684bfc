"""Bounds on the HTTP connection itself, ahead of any ASGI code: the edge's first line of defence.

uvicorn's HTTP/1.1 protocol (``httptools``) accepts a request head of any size
and any number of headers, never closes a connection that sent nothing, and
takes every connection the kernel hands it. On the router that matters more
than on a plain web server: the HTTP edge shares its event loop with the gRPC
service (and, under ``up``, the embedded CMS), so a client that makes the
parser chew a 128 MB header stalls every gRPC call for seconds, and one that
opens thousands of idle sockets eats the file descriptors gRPC needs.

:func:`bounded_protocol` makes a subclass of uvicorn's protocol that holds
:class:`EdgeLimits` before the parser sees a byte:

- **head size**: the bytes of a request head (request line + headers) are
  counted as they arrive; past ``max_header_bytes`` the connection gets
  ``431`` at once and the rest of its bytes are dropped unparsed (cheap: no
  parser, no copy) for a short linger, so the client can read the answer,
  then it is closed.
- **header count**: more than ``max_headers`` header lines: ``431``.
- **header timeout**: a head that started must be complete within
  ``header_timeout_s`` (slow-loris): ``408`` and close.
- **idle timeout**: a connection with no request in progress (new, or
  between keep-alive requests) is closed after ``idle_timeout_s``.
- **connection limit**: at most ``max_connections`` open; one more is closed
  as soon as it is accepted (its file descriptor goes back at once).
  :func:`default_max_connections` keeps the default well below the process's
  open-file limit, so gRPC always has descriptors left.

Counts of everything refused are kept in :class:`EdgeStats` (exported by the
router as metrics).
"""

from __future__ import annotations

import asyncio
import json
import resource
from dataclasses import dataclass, field
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

#: Default bound of a request head (request line and headers), bytes.
DEFAULT_MAX_HEADER_BYTES = 32 << 10
#: Default bound of the number of header lines.
DEFAULT_MAX_HEADERS = 100
#: Default time a started request head may take to arrive, seconds.
DEFAULT_HEADER_TIMEOUT_S = 10.0
#: Default time a connection may sit with no request in progress, seconds.
DEFAULT_IDLE_TIMEOUT_S = 30.0
#: Largest connection limit the default picks.
MAX_DEFAULT_CONNECTIONS = 4096
#: How long a refused connection's further bytes are dropped before it is closed (s).
REFUSAL_LINGER_S = 1.0


def default_max_connections(nofile: int | None = None) -> int:
    """Half the process's soft open-file limit minus 64 (at least 16, at most 4096).

    The other half stays for gRPC (listeners, clients, worker channels), the
    CMS, logs and the Python runtime: with systemd's default of 1,024 that is
    448 HTTP connections and 576 descriptors for everything else.
    """
    if nofile is None:
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if nofile == resource.RLIM_INFINITY or nofile <= 0:
            nofile = 1 << 20
    return max(16, min(MAX_DEFAULT_CONNECTIONS, nofile // 2 - 64))


@dataclass(frozen=True)
class EdgeLimits:
    """Bounds of one HTTP listener's connections (see the module docstring)."""

    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_headers: int = DEFAULT_MAX_HEADERS
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    #: 0: :func:`default_max_connections` of this process's open-file limit.
    max_connections: int = 0

    def __post_init__(self) -> None:
        if not 1024 <= self.max_header_bytes <= 16 << 20:
            raise ValueError(f"max_header_bytes must be within [1024, 16 MiB], got {self.max_header_bytes}")
        if not 1 <= self.max_headers <= 10_000:
            raise ValueError(f"max_headers must be within [1, 10000], got {self.max_headers}")
        for name in ("header_timeout_s", "idle_timeout_s"):
            value = getattr(self, name)
            if not 0 < value <= 3600:
                raise ValueError(f"{name} must be within (0, 3600] s, got {value!r}")
        if self.max_connections < 0:
            raise ValueError(
                f"max_connections must be >= 0 (0 = from the open-file limit), got {self.max_connections}"
            )

    @property
    def connections(self) -> int:
        """The connection limit in force."""
        return self.max_connections or default_max_connections()


@dataclass
class EdgeStats:
    """What the bounds refused, by reason (monotonic counts)."""

    refused: dict[str, int] = field(
        default_factory=lambda: {
            "connection_limit": 0,
            "header_too_large": 0,
            "too_many_headers": 0,
            "header_timeout": 0,
            "idle_timeout": 0,
        }
    )
    open_connections: int = 0

    def count(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1


_REASONS = {431: "Request Header Fields Too Large", 408: "Request Timeout"}


def _refusal(status: int, message: str) -> bytes:
    body = json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": status}}
    ).encode()
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class _TooManyHeaders(Exception):
    pass


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with :class:`EdgeLimits` held (set by :func:`bounded_protocol`)."""

    limits: EdgeLimits = EdgeLimits()
    stats: EdgeStats = EdgeStats()
    max_connections: int = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True
        self._head_bytes = 0
        self._head_tail = b""
        self._header_count = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._refused = False

    # -- connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        over = len(self.connections) >= self.max_connections
        super().connection_made(transport)
        if over:
            self.stats.count("connection_limit")
            self._refused = True
            transport.abort()  # the descriptor goes back now; nothing is read or written
            return
        self.stats.open_connections = len(self.connections)
        # Idle until the first byte: uvicorn's keep-alive timer, which data_received cancels.
        self.timeout_keep_alive_task = self.loop.call_later(self.limits.idle_timeout_s, self._idle_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)
        self.stats.open_connections = len(self.connections)

    def _idle_timeout(self) -> None:
        if not self.transport.is_closing():
            self.stats.count("idle_timeout")
            self.transport.close()

    def timeout_keep_alive_handler(self) -> None:
        self._idle_timeout()

    # -- the request head

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self._in_head and not self.transport.is_closing():
            self.stats.count("header_timeout")
            seconds = self.limits.header_timeout_s
            self._refuse(408, f"the request head did not arrive within {seconds:g} s")

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status``, drop whatever else arrives for a moment (unparsed), then close."""
        self._refused = True
        self._cancel_head_timer()
        self._unset_keepalive_if_required()
        self.transport.write(_refusal(status, message))
        self.loop.call_later(REFUSAL_LINGER_S, self.transport.close)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_head:
            limit = self.limits.max_header_bytes
            if self._head_bytes + len(data) > limit:
                # Too much for a head unless the head ends within the limit in this chunk.
                window = self._head_tail + data[: limit - self._head_bytes + 4]
                if window.find(b"\r\n\r\n") < 0:
                    self.stats.count("header_too_large")
                    self._refuse(431, f"the request head is larger than {limit} bytes")
                    return
            self._head_bytes += len(data)
            self._head_tail = data[-3:]
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timeout)
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except Exception as exc:  # httptools' errors, and a header-count refusal from on_header
            if isinstance(exc.__context__, _TooManyHeaders):
                self.stats.count("too_many_headers")
                self._refuse(431, f"the request has more than {self.limits.max_headers} header lines")
                return
            if getattr(self, "parser", None) is None:  # the connection was lost while parsing
                return
            import httptools

            if isinstance(exc, httptools.HttpParserUpgrade):
                self._unsupported_upgrade_warning()
                return
            if not isinstance(exc, httptools.HttpParserError):
                raise
            self.send_400_response("Invalid HTTP request received.")

    def on_message_begin(self) -> None:
        self._header_count = 0
        super().on_message_begin()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.limits.max_headers:
            raise _TooManyHeaders
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        self._head_tail = b""
        self._cancel_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True  # the next bytes on this connection start a new head


def bounded_protocol(limits: EdgeLimits, stats: EdgeStats) -> type[BoundedHttpProtocol]:
    """A protocol class (uvicorn's ``http=``) holding ``limits``, counting into ``stats``."""
    return type(
        "BoundedHttpProtocol",
        (BoundedHttpProtocol,),
        {"limits": limits, "stats": stats, "max_connections": limits.connections},
    )
