"""The router's own HTTP/2 server for its gRPC services (``--grpc-server h2``).

Why not ``grpc.aio`` for the Router service: measured with ``perf`` on the router relaying a stock
vLLM engine (docs/vllm-grpc.md), each message ``grpc.aio`` writes to a client costs 60-90 µs of
router CPU (the ``sendmsg``, an ``eventfd`` kick of gRPC's poller thread, the poller's wake-up of
the event loop, the Python that resumes the servicer: five system calls and two or three thread
switches), about half the router's CPU per token at 16 streams; and its intake accepts one call per
event-loop pass (one ``request_call`` outstanding), so the median request of a burst of 16 sent
together waited 5.7 ms to reach a handler that did nothing. Here the server is an
:class:`asyncio.Protocol` per connection, as :mod:`router.vllm_h2` is for the engine's side: every
frame one network read carries is parsed in one ``data_received`` call, so every call of a burst
starts in the same pass; and every message written during one event-loop iteration, for every
stream of a connection, goes out in one ``transport.write`` (no thread, no completion queue).

What is implemented is the server half of gRPC over HTTP/2 for unary-request calls (unary and
server-streaming responses), over cleartext TCP:

- the connection preface and SETTINGS (``MAX_CONCURRENT_STREAMS`` bounds the calls per connection,
  a call past it is refused with ``REFUSED_STREAM``, which gRPC clients retry transparently),
  HPACK (requests decoded with the ``hpack`` package; the responses' few headers are literals that
  need no table), PING answered, GOAWAY (sent on shutdown; a client's closes the connection once
  its calls end);
- length-prefixed messages, at most ``max_message_bytes`` (a larger request is refused
  ``RESOURCE_EXHAUSTED`` as soon as its length prefix arrives, before its bytes are kept); a
  request compressed with ``gzip`` or ``deflate`` is inflated (bounded by the same limit), any
  other ``grpc-encoding`` refused ``UNIMPLEMENTED``; responses are not compressed;
- ``grpc-timeout``: at the deadline the handler is cancelled and the call ends
  ``DEADLINE_EXCEEDED``;
- RST_STREAM from the client (its cancel) and a lost connection cancel the handler's task, which is
  what ``grpc.aio`` does on a client's cancel, so the service sees the same ``CancelledError``;
- flow control both ways: the request side returns window as it takes the bytes (a request is
  bounded by the message limit); on the response side a stream's frames wait for the client's
  window, and the handler waits (it is not asked for its next message) once a stream holds more
  than :data:`STREAM_BUFFER_BYTES` unsent, or while the socket's buffer is over its high-water
  mark: a client that does not read stalls its own stream, never the process's memory or the
  other streams;
- trailers with ``grpc-status``, ``grpc-message`` (percent-encoded) and the trailing metadata a
  handler set; a call that fails before its first message gets one trailers-only HEADERS frame.

Not here: TLS (``--grpc-server h2`` with ``--tls-cert`` refuses to start), compressed responses.
:func:`router_methods` maps the router's services onto it: ``Router.Generate`` and
``Router.Schedule`` through :class:`router.service.RouterService`'s context-free entries (the code
the ``grpc.aio`` servicer runs), ``grpc.health.v1.Health``'s ``Check`` and ``Watch`` over
:class:`HealthState`, and server reflection (``grpc_reflection``'s servicer; the one
client-streaming method). Any other method ends ``UNIMPLEMENTED``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import struct
import urllib.parse
import zlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import grpc
import hpack
from grpc_health.v1 import health_pb2

# HTTP/2's frame types, flags and settings: one definition, the engine-side reader's.
from router.vllm_h2 import (
    _ACK,
    _CONT,
    _DATA,
    _END_HEADERS,
    _END_STREAM,
    _GOAWAY,
    _HEADERS,
    _PADDED,
    _PING,
    _PRIORITY_FLAG,
    _RST_STREAM,
    _S_ENABLE_PUSH,
    _S_INITIAL_WINDOW,
    _S_MAX_CONCURRENT,
    _S_MAX_FRAME,
    _SETTINGS,
    _WINDOW_UPDATE,
    PREFACE,
    CoalescedWrites,
    IndexedBlocks,
    _frame,
    _literal,
    split_host_port,
)

logger = logging.getLogger(__name__)

_S_HEADER_TABLE, _S_MAX_HEADER_LIST = 1, 6  # the two settings only the server side reads
_NO_ERROR, _PROTOCOL_ERROR, _FLOW_CONTROL_ERROR, _REFUSED_STREAM, _CANCEL = 0x0, 0x1, 0x3, 0x7, 0x8
_DEFAULT_WINDOW = 65_535
_DEFAULT_FRAME = 16_384
_MAX_WINDOW = (1 << 31) - 1

#: Calls one connection may have open at once (``SETTINGS_MAX_CONCURRENT_STREAMS``); a gRPC client
#: queues the calls past it. The router's own bounds (``--max-queue-size`` plus what runs) refuse
#: overload with a reason before this does.
MAX_CONCURRENT_STREAMS = 8192
#: Connections the server keeps at once; one past it is closed at once (GOAWAY).
MAX_CONNECTIONS = 4096
#: The request side's windows: per stream (its SETTINGS) and for the connection. A unary request
#: is bounded by the message limit, so a stream's window is returned as its bytes arrive.
STREAM_WINDOW = 1 << 20
CONNECTION_WINDOW = 16 << 20
#: Largest header block (all CONTINUATIONs together) and decoded header list a request may carry.
MAX_HEADER_BYTES = 16 << 10
#: Bytes of requests not yet whole that one connection may hold, in all its streams (at least two
#: messages of the largest size): each stream is bounded by the message limit, but a client that
#: opened thousands of streams and never ended them would otherwise hold that limit thousands of
#: times over. The stream that would pass it is refused ``RESOURCE_EXHAUSTED``; the others go on.
MAX_HELD_REQUEST_BYTES = 64 << 20
#: A stream's response bytes waiting for the client's window beyond which its handler is not asked
#: for its next message (the handler waits in ``send``).
STREAM_BUFFER_BYTES = 256 << 10
#: The socket's write buffer above which every handler of the connection waits before it sends more.
WRITE_HIGH_WATER = 1 << 20

_CODES = {code.value[0]: code for code in grpc.StatusCode}
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
_STATUS_200 = b"\x88"  # ":status: 200", index 8 of HPACK's static table
_RESPONSE_HEADERS = _STATUS_200 + _literal(b"content-type", b"application/grpc")


class RpcError(Exception):
    """Raised by a handler: the call ends with ``code`` and ``details`` (never OK)."""

    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class CallInfo:
    """What a handler may read of its call (the request's metadata) and set (trailing metadata)."""

    __slots__ = ("metadata", "method", "trailing")

    def __init__(self, method: str, metadata: Mapping[str, str]) -> None:
        self.method = method
        #: The request's custom headers (lower-case names; pseudo-headers and gRPC's own left out).
        self.metadata = metadata
        #: (name, value) pairs sent with ``grpc-status``.
        self.trailing: list[tuple[str, str]] = []


UnaryHandler = Callable[[bytes, CallInfo], Awaitable[bytes]]
StreamHandler = Callable[[bytes, CallInfo], AsyncGenerator[bytes, None]]
BidiHandler = Callable[[AsyncIterator[bytes], CallInfo], AsyncGenerator[bytes, None]]


@dataclass(frozen=True)
class Method:
    """One served method: its handler takes the request's bytes; ``streaming``: it yields messages.

    ``client_streaming`` (with ``streaming``): the handler takes an async iterator of the request
    messages' bytes instead, started as soon as the call's headers arrive (server reflection's
    ``ServerReflectionInfo`` is the one such method served).
    """

    handler: UnaryHandler | StreamHandler | BidiHandler
    streaming: bool
    client_streaming: bool = False


def _grpc_message(details: str) -> bytes:
    """``grpc-message``'s percent-encoding: the bytes outside printable ASCII, and ``%`` itself."""
    return urllib.parse.quote(details, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~", encoding="utf-8").encode(
        "ascii"
    )


def parse_timeout(value: str) -> float | None:
    """``grpc-timeout`` in seconds (None: malformed). At most 8 digits and one unit, as gRPC writes it."""
    if not 2 <= len(value) <= 9 or not value[:-1].isdigit() or value[-1] not in _TIMEOUT_UNITS:
        return None
    return int(value[:-1]) * _TIMEOUT_UNITS[value[-1]]


class _Stream:
    """One call on a connection: the request's bytes coming in, the response's going out."""

    __slots__ = (
        "body",
        "call",
        "conn",
        "done",
        "drained",
        "encoding",
        "headers_sent",
        "id",
        "inbox",
        "inbox_bytes",
        "method",
        "pending",
        "pending_bytes",
        "recv_closed",
        "send_window",
        "task",
        "timeout_s",
        "timer",
        "trailers",
        "unacked",
    )

    def __init__(
        self, conn: _Connection, sid: int, method: str, call: CallInfo, timeout_s: float | None
    ) -> None:
        self.conn = conn
        self.id = sid
        self.method = method
        self.call = call
        self.timeout_s = timeout_s
        #: The request's ``grpc-encoding`` (how a message flagged compressed is compressed).
        self.encoding = ""
        self.body = bytearray()
        #: A client-streaming call's request messages not yet taken by its handler (None: unary).
        self.inbox: list[bytes] | None = None
        self.inbox_bytes = 0
        self.unacked = 0
        #: The client sent END_STREAM (or the request was refused: further DATA is dropped).
        self.recv_closed = False
        #: The response is over (trailers queued or the stream reset): nothing more is sent.
        self.done = False
        self.headers_sent = False
        self.send_window = conn.peer_initial_window
        #: DATA payloads not yet sent for want of window, and their size.
        self.pending: list[bytes] = []
        self.pending_bytes = 0
        #: The trailers' block, queued behind ``pending``.
        self.trailers: bytes | None = None
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        #: Set while the handler waits for ``pending`` to drain.
        self.drained: asyncio.Future[None] | None = None

    # ------------------------------------------------------------------ sending

    def send(self, message: bytes) -> None:
        """Queue one response message (with HEADERS before the first)."""
        if self.done:
            return
        conn = self.conn
        if not self.headers_sent:
            self.headers_sent = True
            conn.write_headers(self.id, _RESPONSE_HEADERS, end_stream=False)
        data = len(message).to_bytes(5, "big") + message
        if not self.pending and len(data) <= min(self.send_window, conn.send_window, conn.peer_max_frame):
            self.send_window -= len(data)
            conn.send_window -= len(data)
            conn.write(_frame(_DATA, 0, self.id, data))
            return
        self.pending.append(data)
        self.pending_bytes += len(data)
        conn.blocked[self.id] = self
        conn.flush_blocked()

    @property
    def must_wait(self) -> bool:
        return self.pending_bytes > STREAM_BUFFER_BYTES or self.conn.write_paused

    async def wait_writable(self) -> None:
        """Until the stream's unsent bytes are under :data:`STREAM_BUFFER_BYTES` and the socket drains."""
        while not self.done and self.must_wait:
            waiter = self.drained = self.conn.loop.create_future()
            try:
                await waiter
            finally:
                self.drained = None

    def wake(self) -> None:
        waiter = self.drained
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def requests(self) -> AsyncGenerator[bytes, None]:
        """A client-streaming call's request messages, as they arrive, until the client's END_STREAM."""
        inbox = self.inbox
        assert inbox is not None
        while True:
            if inbox:
                message = inbox.pop(0)
                self.inbox_bytes -= len(message)
                yield message
                continue
            if self.recv_closed or self.done:
                return
            waiter = self.drained = self.conn.loop.create_future()
            try:
                await waiter
            finally:
                self.drained = None

    def finish(self, code: grpc.StatusCode, details: str = "") -> None:
        """End the call with ``code`` (trailers after whatever is still queued)."""
        if self.done:
            return
        self.done = True
        if self.timer is not None:
            self.timer.cancel()
        block = b"" if self.headers_sent else _RESPONSE_HEADERS
        block += _literal(b"grpc-status", str(code.value[0]).encode())
        if details:
            block += _literal(b"grpc-message", _grpc_message(details))
        for name, value in self.call.trailing:
            block += _literal(name.encode("ascii", "replace"), value.encode("ascii", "replace"))
        self.headers_sent = True
        if self.pending:
            self.trailers = block
            self.conn.flush_blocked()
        else:
            self.conn.write_headers(self.id, block, end_stream=True)
            self.conn.closed_stream(self)
        self.wake()

    def reset(self, error: int) -> None:
        """RST_STREAM: the call is over for both sides, with nothing more sent."""
        if self.timer is not None:
            self.timer.cancel()
        if not self.done or self.pending or self.trailers is not None:
            self.conn.write(_frame(_RST_STREAM, 0, self.id, error.to_bytes(4, "big")))
        self.done = True
        self.pending.clear()
        self.pending_bytes = 0
        self.trailers = None
        self.conn.closed_stream(self)
        self.wake()

    def cancel_task(self) -> None:
        task = self.task
        if task is not None and not task.done():
            task.cancel()

    def expire(self) -> None:
        """The call's deadline passed: the handler is cancelled, the client told DEADLINE_EXCEEDED."""
        self.timer = None
        if self.done:
            return
        # What the client's window still held back is dropped: the status goes out now.
        self.pending.clear()
        self.pending_bytes = 0
        self.conn.blocked.pop(self.id, None)
        self.finish(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        self.cancel_task()


class _Connection(CoalescedWrites, asyncio.Protocol):
    """One client connection: its streams, HPACK decoder, windows and write queue."""

    def __init__(self, server: H2Server) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.streams: dict[int, _Stream] = {}
        self.blocked: dict[int, _Stream] = {}
        self._decoder = IndexedBlocks(hpack.Decoder(max_header_list_size=MAX_HEADER_BYTES))
        self._in = b""
        self._preface = False
        self._last_sid = 0
        self._headers_sid = 0
        self._headers_flags = 0
        self._headers_block = bytearray()
        self._conn_unacked = 0
        #: At least the bytes of unfinished requests the streams hold (``body``): grown by every
        #: DATA payload, set to the exact sum whenever it passes the bound (:meth:`_hold`).
        self._held = 0
        self.peer_initial_window = _DEFAULT_WINDOW
        self.peer_max_frame = _DEFAULT_FRAME
        self.send_window = _DEFAULT_WINDOW
        self._out: list[bytes] = []
        self._send_scheduled = False
        self.write_paused = False
        #: GOAWAY sent (shutdown): streams above ``_goaway_sid`` are refused.
        self.going_away = False
        self._goaway_sid = 0
        #: The client sent GOAWAY: close once its calls end.
        self._peer_away = False

    # ------------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        settings = struct.pack(
            ">HIHIHIHI",
            _S_MAX_CONCURRENT,
            MAX_CONCURRENT_STREAMS,
            _S_INITIAL_WINDOW,
            STREAM_WINDOW,
            _S_MAX_HEADER_LIST,
            MAX_HEADER_BYTES,
            _S_ENABLE_PUSH,
            0,
        )
        self.transport.write(
            _frame(_SETTINGS, 0, 0, settings)
            + _frame(_WINDOW_UPDATE, 0, 0, (CONNECTION_WINDOW - _DEFAULT_WINDOW).to_bytes(4, "big"))
        )
        if not self.server.admit(self):
            self.goaway(_NO_ERROR, "too many connections")
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.forget(self)
        for stream in list(self.streams.values()):
            stream.done = True
            if stream.timer is not None:
                stream.timer.cancel()
            stream.cancel_task()
            stream.wake()
            self.server.closed()
        self.streams.clear()
        self.blocked.clear()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        for stream in list(self.streams.values()):
            stream.wake()

    def data_received(self, data: bytes) -> None:
        if self._in:
            data = self._in + data
        pos = 0
        if not self._preface:
            if len(data) < len(PREFACE):
                if not PREFACE.startswith(data):
                    self._fail(_PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                    return
                self._in = data
                return
            if not data.startswith(PREFACE):
                self._fail(_PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                return
            self._preface = True
            pos = len(PREFACE)
        end = len(data)
        try:
            while end - pos >= 9:
                length = (data[pos] << 16) | (data[pos + 1] << 8) | data[pos + 2]
                if length > _DEFAULT_FRAME:
                    raise _ProtocolError(f"a frame of {length} bytes, above the 16384 this server allows")
                start = pos + 9
                if end - start < length:
                    break
                kind = data[pos + 3]
                flags = data[pos + 4]
                sid = int.from_bytes(data[pos + 5 : start], "big") & 0x7FFFFFFF
                pos = start + length
                if self._headers_sid and kind != _CONT:
                    raise _ProtocolError("a frame inside an open header block")
                if kind == _DATA:
                    self._on_data(sid, flags, data[start:pos])
                elif kind in (_HEADERS, _CONT):
                    self._on_headers(kind, sid, flags, data[start:pos])
                else:
                    self._on_control(kind, sid, flags, data[start:pos])
                if self.closed:
                    return
        except _ProtocolError as exc:
            self._fail(_PROTOCOL_ERROR, str(exc))
            return
        self._in = data[pos:]

    # ------------------------------------------------------------------ frames in

    def _on_headers(self, kind: int, sid: int, flags: int, payload: bytes) -> None:
        if kind == _HEADERS:
            if flags & _PADDED:
                if not payload or payload[0] >= len(payload):
                    raise _ProtocolError("bad padding")
                payload = payload[1 : len(payload) - payload[0]]
            if flags & _PRIORITY_FLAG:
                payload = payload[5:]
            if not sid:
                raise _ProtocolError("HEADERS on stream 0")
            self._headers_sid = sid
            self._headers_flags = flags
        elif sid != self._headers_sid:
            raise _ProtocolError("CONTINUATION of no open header block")
        self._headers_block += payload
        if len(self._headers_block) > MAX_HEADER_BYTES:
            raise _ProtocolError(f"a header block over {MAX_HEADER_BYTES} bytes")
        if not ((flags if kind == _CONT else self._headers_flags) & _END_HEADERS):
            return
        block = bytes(self._headers_block)
        self._headers_block.clear()
        self._headers_sid = 0
        try:
            headers = self._decoder.decode(block)
        except hpack.HPACKError as exc:
            raise _ProtocolError(f"bad header block: {exc}") from exc
        end_stream = bool(self._headers_flags & _END_STREAM)
        existing = self.streams.get(sid)
        if existing is not None or sid <= self._last_sid:
            # Trailers from the client (a unary request has none) or a reused id.
            if existing is not None and end_stream:
                self._request_end(existing)
                return
            raise _ProtocolError(f"HEADERS for stream {sid}, which is not new")
        if not sid & 1:
            raise _ProtocolError(f"client stream id {sid} is even")
        self._last_sid = sid
        self._new_stream(sid, headers, end_stream)

    def _new_stream(self, sid: int, headers: Any, end_stream: bool) -> None:
        if self.going_away or len(self.streams) >= MAX_CONCURRENT_STREAMS:
            self.write(_frame(_RST_STREAM, 0, sid, _REFUSED_STREAM.to_bytes(4, "big")))
            return
        path = ""
        content_type = ""
        timeout = ""
        encoding = ""
        metadata: dict[str, str] = {}
        for raw_name, raw_value in headers:
            name = raw_name.decode("ascii", "replace")
            value = raw_value.decode("utf-8", "replace")
            if name == ":path":
                path = value
            elif name == "content-type":
                content_type = value
            elif name == "grpc-timeout":
                timeout = value
            elif name == "grpc-encoding":
                encoding = value
            elif (
                not name.startswith(":") and not name.startswith("grpc-") and name not in ("te", "user-agent")
            ):
                metadata[name] = value
        timeout_s = parse_timeout(timeout) if timeout else None
        stream = _Stream(self, sid, path, CallInfo(path, metadata), timeout_s)
        self.streams[sid] = stream
        self.server.opened()
        stream.encoding = encoding
        stream.recv_closed = end_stream
        if not content_type.startswith("application/grpc"):
            stream.finish(grpc.StatusCode.INTERNAL, f"content-type {content_type!r} is not application/grpc")
            self._refuse_rest(stream)
            return
        if timeout and timeout_s is None:
            stream.finish(grpc.StatusCode.INTERNAL, f"malformed grpc-timeout {timeout!r}")
            self._refuse_rest(stream)
            return
        if self.server.methods.get(path) is None:
            stream.finish(grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {path}")
            self._refuse_rest(stream)
            return
        if timeout_s is not None:
            stream.timer = self.loop.call_later(timeout_s, stream.expire)
        method = self.server.methods[path]
        if method.client_streaming:
            stream.inbox = []
            stream.task = self.loop.create_task(self.server.run(stream, method, stream.requests()))
            return
        if end_stream:
            self._request_end(stream)

    def _refuse_rest(self, stream: _Stream) -> None:
        """The call was answered before its request ended: the client need send no more of it."""
        if not stream.recv_closed:
            stream.recv_closed = True
            self.write(_frame(_RST_STREAM, 0, stream.id, _NO_ERROR.to_bytes(4, "big")))

    def _on_data(self, sid: int, flags: int, payload: bytes) -> None:
        n = len(payload)
        self._conn_unacked += n
        if self._conn_unacked >= CONNECTION_WINDOW // 2:
            self.write(_frame(_WINDOW_UPDATE, 0, 0, self._conn_unacked.to_bytes(4, "big")))
            self._conn_unacked = 0
        stream = self.streams.get(sid)
        if stream is None or stream.recv_closed:
            if sid > self._last_sid:
                raise _ProtocolError(f"DATA on idle stream {sid}")
            return
        if flags & _PADDED:
            if not payload or payload[0] >= n:
                raise _ProtocolError("bad padding")
            payload = payload[1 : n - payload[0]]
        stream.unacked += n
        if stream.unacked >= STREAM_WINDOW // 2 and not flags & _END_STREAM:
            self.write(_frame(_WINDOW_UPDATE, 0, sid, stream.unacked.to_bytes(4, "big")))
            stream.unacked = 0
        if stream.done:
            # Answered already (an expired deadline): the rest of the request is dropped.
            stream.recv_closed = bool(flags & _END_STREAM)
            return
        if not self._hold(stream, len(payload)):
            return
        stream.body += payload
        body = stream.body
        if stream.inbox is not None:
            self._take_messages(stream, bool(flags & _END_STREAM))
            return
        if len(body) >= 5:
            length = int.from_bytes(body[1:5], "big")
            limit = self.server.max_message_bytes
            if length > limit:
                stream.finish(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"Received message larger than max ({length} vs. {limit})",
                )
                stream.body = bytearray()
                self._refuse_rest(stream)
                return
            if len(body) > 5 + length:
                stream.finish(grpc.StatusCode.UNIMPLEMENTED, f"{stream.method} takes one request message")
                self._refuse_rest(stream)
                return
        if flags & _END_STREAM:
            self._request_end(stream)

    def _hold(self, stream: _Stream, n: int) -> bool:
        """Whether ``stream`` may keep ``n`` more request bytes within :data:`MAX_HELD_REQUEST_BYTES`;
        if not, it is answered ``RESOURCE_EXHAUSTED`` (what it held is dropped) and told to stop."""
        limit = max(MAX_HELD_REQUEST_BYTES, 2 * self.server.max_message_bytes)
        self._held += n
        if self._held <= limit:
            return True
        # An upper bound only (bodies shrink as requests complete): the exact sum, at most once per
        # ``limit`` bytes received unless the connection really holds that much.
        self._held = sum(len(s.body) for s in self.streams.values()) + n
        if self._held <= limit:
            return True
        self._held -= n + len(stream.body)
        stream.body = bytearray()
        stream.finish(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"this connection holds over {limit >> 20} MiB of requests not yet whole; end them before "
            "sending more",
        )
        stream.cancel_task()
        self._refuse_rest(stream)
        return False

    def _take_messages(self, stream: _Stream, end: bool) -> None:
        """A client-streaming call: hand its handler every whole message received (bounded: at most
        ``max_message_bytes`` waiting in all, else ``RESOURCE_EXHAUSTED``)."""
        body = stream.body
        inbox = stream.inbox
        assert inbox is not None
        limit = self.server.max_message_bytes
        pos = 0
        while len(body) - pos >= 5:
            length = int.from_bytes(body[pos + 1 : pos + 5], "big")
            if length > limit or stream.inbox_bytes + length > limit:
                stream.finish(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"Received message larger than max ({length} vs. {limit})",
                )
                stream.cancel_task()
                self._refuse_rest(stream)
                return
            if len(body) - pos - 5 < length:
                break
            if body[pos]:
                stream.finish(
                    grpc.StatusCode.UNIMPLEMENTED, "compressed messages are not supported by this server"
                )
                stream.cancel_task()
                self._refuse_rest(stream)
                return
            inbox.append(bytes(body[pos + 5 : pos + 5 + length]))
            stream.inbox_bytes += length
            pos += 5 + length
        del body[:pos]
        if end:
            stream.recv_closed = True
            if body:
                stream.finish(
                    grpc.StatusCode.INTERNAL, f"{stream.method}: the request ended inside a message"
                )
                stream.cancel_task()
        stream.wake()

    def _request_end(self, stream: _Stream) -> None:
        """The request is whole: start its handler (in this pass, with every other call of the read)."""
        if stream.inbox is not None:
            self._take_messages(stream, True)
            return
        stream.recv_closed = True
        if stream.done:
            return
        body = bytes(stream.body)
        stream.body = bytearray()
        if len(body) < 5 or len(body) != 5 + int.from_bytes(body[1:5], "big"):
            stream.finish(
                grpc.StatusCode.INTERNAL, f"{stream.method}: the request did not carry exactly one message"
            )
            return
        request = body[5:]
        if body[0]:
            try:
                request = _decompress(request, stream.encoding, self.server.max_message_bytes)
            except RpcError as exc:
                stream.finish(exc.code, exc.details)
                return
        self.server.start_call(stream, self.server.methods[stream.method], request)

    def _on_control(self, kind: int, sid: int, flags: int, payload: bytes) -> None:
        if kind == _SETTINGS:
            if flags & _ACK:
                return
            if sid or len(payload) % 6:
                raise _ProtocolError("malformed SETTINGS")
            for i in range(0, len(payload), 6):
                key, value = struct.unpack_from(">HI", payload, i)
                if key == _S_INITIAL_WINDOW:
                    if value > _MAX_WINDOW:
                        raise _ProtocolError("SETTINGS_INITIAL_WINDOW_SIZE above 2^31-1")
                    delta = value - self.peer_initial_window
                    self.peer_initial_window = value
                    for open_stream in self.streams.values():
                        open_stream.send_window += delta
                elif key == _S_MAX_FRAME:
                    self.peer_max_frame = max(_DEFAULT_FRAME, min(value, (1 << 24) - 1))
            self.write(_frame(_SETTINGS, _ACK, 0))
            self.flush_blocked()
        elif kind == _WINDOW_UPDATE:
            increment = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
            if sid == 0:
                self.send_window += increment
                if self.send_window > _MAX_WINDOW:
                    raise _ProtocolError("connection window above 2^31-1")
            elif (stream := self.streams.get(sid)) is not None:
                stream.send_window += increment
            self.flush_blocked()
        elif kind == _PING:
            if not flags & _ACK:
                self.write(_frame(_PING, _ACK, 0, payload))
        elif kind == _RST_STREAM:
            stream = self.streams.get(sid)
            if stream is not None:
                # The client cancelled: the handler is cancelled, as grpc.aio cancels its task.
                stream.done = True
                stream.pending.clear()
                stream.pending_bytes = 0
                stream.trailers = None
                if stream.timer is not None:
                    stream.timer.cancel()
                self.closed_stream(stream)
                stream.cancel_task()
                stream.wake()
        elif kind == _GOAWAY:
            self._peer_away = True
            if not self.streams:
                self.close()
        # PRIORITY and unknown frame types are ignored (RFC 9113 5.5).

    # ------------------------------------------------------------------ frames out

    def write_headers(self, sid: int, block: bytes, *, end_stream: bool) -> None:
        flags = _END_STREAM if end_stream else 0
        limit = self.peer_max_frame
        if len(block) <= limit:
            self.write(_frame(_HEADERS, flags | _END_HEADERS, sid, block))
            return
        self.write(_frame(_HEADERS, flags, sid, block[:limit]))
        for i in range(limit, len(block), limit):
            last = i + limit >= len(block)
            self.write(_frame(_CONT, _END_HEADERS if last else 0, sid, block[i : i + limit]))

    def flush_blocked(self) -> None:
        """Send what the windows allow of the streams' waiting frames, then their trailers."""
        if not self.blocked:
            return
        for sid, stream in list(self.blocked.items()):
            pending = stream.pending
            while pending:
                data = pending[0]
                n = min(len(data), stream.send_window, self.send_window, self.peer_max_frame)
                if n <= 0:
                    break
                stream.send_window -= n
                self.send_window -= n
                stream.pending_bytes -= n
                if n == len(data):
                    pending.pop(0)
                else:
                    pending[0] = data[n:]
                    data = data[:n]
                self.write(_frame(_DATA, 0, sid, data))
            if not pending:
                del self.blocked[sid]
                if stream.trailers is not None:
                    self.write_headers(sid, stream.trailers, end_stream=True)
                    stream.trailers = None
                    self.closed_stream(stream)
            if not stream.must_wait:
                stream.wake()
            if self.send_window <= 0:
                break

    def closed_stream(self, stream: _Stream) -> None:
        """The response side is over; the stream is forgotten once the request side is too."""
        if stream.pending or stream.trailers is not None:
            return
        self.blocked.pop(stream.id, None)
        if self.streams.get(stream.id) is stream:
            # DATA the client still sends for it is dropped (only the windows count it).
            del self.streams[stream.id]
            self.server.closed()
        if not self.streams and (self._peer_away or self.going_away):
            self.close()

    #: Queue a frame: everything queued during one event-loop iteration goes out in one write.
    write = CoalescedWrites._write

    def goaway(self, error: int, why: str = "") -> None:
        """GOAWAY: no stream past the last one started will be served."""
        if self.going_away:
            return
        self.going_away = True
        self._goaway_sid = self._last_sid
        self.write(
            _frame(_GOAWAY, 0, 0, self._last_sid.to_bytes(4, "big") + error.to_bytes(4, "big") + why.encode())
        )

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self._send()
            self.transport.close()
        self.closed = True

    def _fail(self, error: int, why: str) -> None:
        logger.info("closing an HTTP/2 connection: %s", why)
        self.goaway(error, why[:200])
        self._send()
        for stream in list(self.streams.values()):
            stream.done = True
            stream.cancel_task()
        if self.transport is not None:
            self.transport.close()
        self.closed = True


def _decompress(data: bytes, encoding: str, limit: int) -> bytes:
    """A compressed request message (``gzip`` or ``deflate``), at most ``limit`` bytes once inflated."""
    if encoding not in ("gzip", "deflate"):
        raise RpcError(
            grpc.StatusCode.UNIMPLEMENTED,
            f"grpc-encoding {encoding[:40]!r} is not supported here (identity, gzip, deflate)",
        )
    inflate = zlib.decompressobj(31 if encoding == "gzip" else 15)
    try:
        out = inflate.decompress(data, limit + 1)
    except zlib.error as exc:
        raise RpcError(
            grpc.StatusCode.INTERNAL, f"cannot decompress the request ({encoding}): {exc}"
        ) from None
    if len(out) > limit:
        raise RpcError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"Received message larger than max (over {limit} once inflated)",
        )
    if not inflate.eof:
        raise RpcError(
            grpc.StatusCode.INTERNAL, f"cannot decompress the request ({encoding}): it is cut short"
        )
    return out


class _ProtocolError(Exception):
    """The client broke HTTP/2: GOAWAY(PROTOCOL_ERROR) and the connection is closed."""


class H2Server:
    """Serves ``methods`` (``/package.Service/Method`` → :class:`Method`) over HTTP/2 on one address."""

    def __init__(self, methods: Mapping[str, Method], *, max_message_bytes: int) -> None:
        self.methods = dict(methods)
        self.max_message_bytes = max_message_bytes
        self.loop = asyncio.get_running_loop()
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        #: Streams open on every connection; ``_idle`` is set while there are none.
        self.open_streams = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._stopping = False
        self.port = 0
        #: Calls whose request is whole, waiting for their handler to start (:meth:`start_call`).
        self._starts: collections.deque[tuple[_Stream, Method, bytes]] = collections.deque()
        self._start_scheduled = False

    async def start(self, listen: str, *, reuse_port: bool = False) -> int:
        """Listen on ``listen`` (``HOST:PORT``, port 0 picks one); the port bound. ``OSError`` if it cannot."""
        host, port = split_host_port(listen)
        try:
            server = await self.loop.create_server(
                lambda: _Connection(self), host or None, port, reuse_port=reuse_port or None, backlog=1024
            )
        except OSError as exc:
            raise OSError(f"cannot listen on {listen}: {exc}") from exc
        self._server = server
        self.port = int(server.sockets[0].getsockname()[1])
        return self.port

    def admit(self, conn: _Connection) -> bool:
        if self._stopping or len(self._connections) >= MAX_CONNECTIONS:
            return False
        self._connections.add(conn)
        return True

    def forget(self, conn: _Connection) -> None:
        self._connections.discard(conn)

    def opened(self) -> None:
        self.open_streams += 1
        self._idle.clear()

    def closed(self) -> None:
        self.open_streams -= 1
        if self.open_streams <= 0:
            self._idle.set()

    def start_call(self, stream: _Stream, method: Method, request: bytes) -> None:
        """Start the handler of a call whose request is whole: one call per event-loop iteration.

        Every call of a read is parsed in that read's pass, but their handlers start one per loop
        iteration, in arrival order: a handler runs up to its first wait (for the Router's
        ``Generate``: the decision, then the request's write to the engine, which goes out at the
        end of the iteration), so each call's engine request leaves before the next call's decision
        rather than all of a burst's after all of its decisions.
        """
        self._starts.append((stream, method, request))
        if not self._start_scheduled:
            self._start_scheduled = True
            self.loop.call_soon(self._start_next)

    def _start_next(self) -> None:
        self._start_scheduled = False
        starts = self._starts
        while starts:
            stream, method, request = starts.popleft()
            if not stream.done:  # not cancelled, expired or refused meanwhile
                stream.task = self.loop.create_task(self.run(stream, method, request))
                break
        if starts:
            self._start_scheduled = True
            self.loop.call_soon(self._start_next)

    async def run(self, stream: _Stream, method: Method, request: bytes | AsyncIterator[bytes]) -> None:
        """One call: the handler's messages out, then its status (the stream's task)."""
        try:
            if method.streaming:
                handler = cast(StreamHandler, method.handler)
                async with contextlib.aclosing(handler(request, stream.call)) as messages:  # type: ignore[arg-type]
                    async for message in messages:
                        if stream.done:
                            return
                        stream.send(message)
                        if stream.must_wait:
                            await stream.wait_writable()
            else:
                unary = cast(UnaryHandler, method.handler)
                message = await unary(cast(bytes, request), stream.call)
                stream.send(message)
            stream.finish(grpc.StatusCode.OK)
        except RpcError as exc:
            stream.finish(exc.code, exc.details)
        except asyncio.CancelledError:
            # The client's cancel, its connection's loss, the deadline or the server's stop.
            if not stream.done:
                stream.reset(_CANCEL)
            raise
        except Exception as exc:
            logger.exception("%s failed", stream.method)
            stream.finish(grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc)}: {exc}")

    async def stop(self, grace: float | None) -> None:
        """GOAWAY to every client, let the running calls end for ``grace`` seconds, then cancel them
        (``UNAVAILABLE``) and close every connection."""
        self._stopping = True
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.goaway(_NO_ERROR, "server shutting down")
            if not conn.streams:
                conn.close()
        if grace:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await self._idle.wait()
        tasks = []
        for conn in list(self._connections):
            for stream in list(conn.streams.values()):
                stream.finish(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
                if stream.task is not None and not stream.task.done():
                    stream.task.cancel()
                    tasks.append(stream.task)
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        for conn in list(self._connections):
            conn.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


# ---------------------------------------------------------------------- the router's services


class HealthState:
    """``grpc.health.v1`` statuses per service name, with the interface of ``grpc_health``'s aio
    servicer that the router drives (:meth:`set`, :meth:`enter_graceful_shutdown`)."""

    def __init__(self) -> None:
        self._status: dict[str, int] = {"": health_pb2.HealthCheckResponse.SERVING}
        self._changed = asyncio.Event()
        self._shutting_down = False

    async def set(self, service: str, status: int) -> None:
        if self._shutting_down:
            return
        self._set(service, status)

    def _set(self, service: str, status: int) -> None:
        self._status[service] = status
        self._changed.set()
        self._changed = asyncio.Event()

    async def enter_graceful_shutdown(self) -> None:
        """Every service ``NOT_SERVING`` from now on; later :meth:`set` calls are ignored."""
        if self._shutting_down:
            return
        self._shutting_down = True
        for service in list(self._status):
            self._set(service, health_pb2.HealthCheckResponse.NOT_SERVING)

    def get(self, service: str) -> int | None:
        return self._status.get(service)

    async def check(self, request: bytes, call: CallInfo) -> bytes:
        service = _health_request(request).service
        status = self._status.get(service)
        if status is None:
            raise RpcError(grpc.StatusCode.NOT_FOUND, f"unknown service {service[:200]!r}")
        return cast(bytes, health_pb2.HealthCheckResponse(status=status).SerializeToString())

    async def watch(self, request: bytes, call: CallInfo) -> AsyncGenerator[bytes, None]:
        """The service's status now, then each change (``SERVICE_UNKNOWN`` while it is not known)."""
        service = _health_request(request).service
        last: int | None = None
        while True:
            changed = self._changed
            status = self._status.get(service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            if status != last:
                last = status
                yield health_pb2.HealthCheckResponse(status=status).SerializeToString()
            await changed.wait()


def _health_request(request: bytes) -> health_pb2.HealthCheckRequest:
    return cast(health_pb2.HealthCheckRequest, _parse(health_pb2.HealthCheckRequest, request, HEALTH_CHECK))


def _parse(kind: Any, data: bytes, method: str) -> Any:
    """``kind`` parsed from ``data``; ``INVALID_ARGUMENT`` (and one log line) if the bytes do not parse,
    as the ``grpc.aio`` servers' guard answers (:mod:`cms.serving`)."""
    message = kind()
    try:
        message.ParseFromString(data)
    except Exception as exc:  # DecodeError, or anything a broken message makes protobuf raise
        logger.warning("%s: refused a request that is not a valid protobuf message (%s)", method, exc)
        raise RpcError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the request is not a valid message for {method}: the bytes do not parse",
        ) from None
    return message


HEALTH_SERVICE = "grpc.health.v1.Health"
HEALTH_CHECK = f"/{HEALTH_SERVICE}/Check"
HEALTH_WATCH = f"/{HEALTH_SERVICE}/Watch"
REFLECTION_SERVICE = "grpc.reflection.v1alpha.ServerReflection"
REFLECTION_INFO = f"/{REFLECTION_SERVICE}/ServerReflectionInfo"


def router_methods(service: Any, health: HealthState, service_name: str) -> dict[str, Method]:
    """The Router service (``service``: a :class:`router.service.RouterService`) and health checks.

    ``Generate`` runs :meth:`RouterService.generate`, the path the ``grpc.aio`` servicer and the
    HTTP edge share, and maps its errors with :func:`router.service.call_status`, as the servicer
    does; ``Schedule`` runs :meth:`RouterService.schedule`.
    """
    from slorouter.v1 import router_pb2

    from router.service import call_status

    generate_path = f"/{service_name}/Generate"
    schedule_path = f"/{service_name}/Schedule"

    async def generate(request: bytes, call: CallInfo) -> AsyncGenerator[bytes, None]:
        message = _parse(router_pb2.GenerateRequest, request, generate_path)
        if service.process_label:
            call.trailing.append(("slo-router-process", service.process_label))
        try:
            async with contextlib.aclosing(service.generate(message)) as steps:
                async for step in steps:
                    yield step.message().SerializeToString()
        except Exception as exc:
            status = call_status(exc)
            if status is None:
                raise
            raise RpcError(*status) from None

    async def schedule(request: bytes, call: CallInfo) -> bytes:
        message = _parse(router_pb2.ScheduleRequest, request, schedule_path)
        try:
            response = service.schedule(message)
        except Exception as exc:
            status = call_status(exc)
            if status is None:
                raise
            raise RpcError(*status) from None
        return cast(bytes, response.SerializeToString())

    return {
        generate_path: Method(generate, streaming=True),
        schedule_path: Method(schedule, streaming=False),
        HEALTH_CHECK: Method(health.check, streaming=False),
        HEALTH_WATCH: Method(health.watch, streaming=True),
        REFLECTION_INFO: Method(
            reflection_handler((service_name, HEALTH_SERVICE, REFLECTION_SERVICE)),
            streaming=True,
            client_streaming=True,
        ),
    }


def reflection_handler(service_names: tuple[str, ...]) -> BidiHandler:
    """Server reflection (``grpcurl`` and the like) over ``grpc_reflection``'s own servicer."""
    from grpc_reflection.v1alpha import reflection_pb2
    from grpc_reflection.v1alpha._async import ReflectionServicer

    servicer = ReflectionServicer(service_names)

    async def info(requests: AsyncIterator[bytes], call: CallInfo) -> AsyncGenerator[bytes, None]:
        async def parsed() -> AsyncGenerator[Any, None]:
            async for raw in requests:
                yield _parse(reflection_pb2.ServerReflectionRequest, raw, REFLECTION_INFO)

        async with contextlib.aclosing(servicer.ServerReflectionInfo(parsed(), None)) as responses:
            async for response in responses:
                yield response.SerializeToString()

    return info
