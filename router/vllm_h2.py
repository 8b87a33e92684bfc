"""A lean HTTP/2 reader for vLLM's streamed ``Generate``: many tokens per event-loop wake-up.

Why not ``grpc.aio`` for this one call: vLLM's ``Generate`` sends one message per request per
engine step, and ``grpc.aio`` completes every message read as an event of its own (gRPC's poller
thread writes a byte to a socket, the event loop wakes, reads it, runs the callback, resumes the
task that awaited ``read()``): about one loop wake-up and two thread switches per token,
measured at 0.93 wake-ups per token on the router, the largest part of its CPU per token. The
bytes themselves arrive batched (one TCP read carries the tokens of many streams), so here the
connection is an :class:`asyncio.Protocol` that parses every gRPC message of every stream in one
``data_received`` call and hands each stream its messages in a list: one wake-up per TCP read,
one per paced batch on the consumer side.

What is implemented is the client half of gRPC over HTTP/2 that a unary-request, server-streaming
call needs, over cleartext TCP (TLS endpoints keep ``grpc.aio``): the connection preface and
SETTINGS, HPACK headers (the server's decoded with the ``hpack`` package; the requests' are
literals that need no table), length-prefixed messages (uncompressed; a
compressed one fails the call), flow control both ways, the ``grpc-status``/``grpc-message``
trailers, RST_STREAM (both ways: a cancelled stream is reset, which the server sees as the
client's cancel), GOAWAY (streams the server did not take fail UNAVAILABLE, new calls open a new
connection), PING (answered; and sent after :data:`KEEPALIVE_S` of silence while streams are open,
the connection closed if no answer comes in :data:`KEEPALIVE_TIMEOUT_S`, like the gRPC channel's
keepalive), the call's deadline (``grpc-timeout`` for the server, a timer here). A failure is a
:class:`CallError` with the gRPC status code ``grpc.aio`` would have raised, so the caller
classifies it exactly as before.
"""

from __future__ import annotations

import asyncio
import math
import struct
import urllib.parse
from collections.abc import AsyncGenerator
from typing import Any, Protocol, cast

import grpc

from router.legs import RelayPacer

try:
    import hpack
except ImportError:  # an environment made before the dependency: the router reads with grpc.aio
    hpack = None  # type: ignore[assignment]

#: False in an environment without the ``hpack`` package (``make venv`` installs it): the vLLM
#: client then reads streams with ``grpc.aio`` whatever ``--vllm-transport`` says.
AVAILABLE = hpack is not None

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _PRIORITY, _RST_STREAM, _SETTINGS, _PUSH_PROMISE, _PING, _GOAWAY, _WINDOW_UPDATE, _CONT = (
    range(10)
)
_END_STREAM = 0x1
_ACK = 0x1
_END_HEADERS = 0x4
_PADDED = 0x8
_PRIORITY_FLAG = 0x20
_S_ENABLE_PUSH, _S_MAX_CONCURRENT, _S_INITIAL_WINDOW, _S_MAX_FRAME = 2, 3, 4, 5
#: HTTP/2's initial window and frame size before the peer's SETTINGS say otherwise.
_DEFAULT_WINDOW = 65_535
_DEFAULT_FRAME = 16_384
#: Receive windows this client grants: per stream (its SETTINGS) and for the connection. Returned
#: in WINDOW_UPDATEs once half is used, so a stream of small messages never waits on one.
STREAM_WINDOW = 4 << 20
CONNECTION_WINDOW = 32 << 20
#: Streams silent this long get the connection a PING; no answer within the timeout closes it
#: (every stream on it fails UNAVAILABLE), as the gRPC channels' keepalive does.
KEEPALIVE_S = 20.0
KEEPALIVE_TIMEOUT_S = 5.0
#: The longest the reader leaves the engine's bytes in the socket while every stream's relay holds
#: for its pacing interval (:meth:`H2Connection._coalesce`): the messages of one engine step,
#: written one by one, are then read in one wake-up of the event loop instead of several.
READ_COALESCE_S = 0.001
#: Fewer open streams than this on a connection: no read pause. The engine writes one message per
#: stream per step, so with a few streams a step's messages are read in one or two wake-ups anyway,
#: and the pause's own timer would add a wake-up instead of saving one (measured at one stream).
READ_COALESCE_MIN_STREAMS = 4
#: A pause ends this long before the first relay's hold does, so that its batch holds every
#: message that arrived before its interval ended (the loop reads before that timer fires).
READ_COALESCE_MARGIN_S = 0.0003
#: A stream id past this opens a new connection (ids are 31-bit and never reused).
_MAX_STREAM_ID = (1 << 31) - 1 - 2
_RST_CODES = {
    0x7: grpc.StatusCode.UNAVAILABLE,  # REFUSED_STREAM: the server did not start it
    0x8: grpc.StatusCode.CANCELLED,
    0xB: grpc.StatusCode.RESOURCE_EXHAUSTED,  # ENHANCE_YOUR_CALM
    0xC: grpc.StatusCode.PERMISSION_DENIED,  # INADEQUATE_SECURITY
}
_HTTP_CODES = {
    "400": grpc.StatusCode.INTERNAL,
    "401": grpc.StatusCode.UNAUTHENTICATED,
    "403": grpc.StatusCode.PERMISSION_DENIED,
    "404": grpc.StatusCode.UNIMPLEMENTED,
    "429": grpc.StatusCode.UNAVAILABLE,
    "502": grpc.StatusCode.UNAVAILABLE,
    "503": grpc.StatusCode.UNAVAILABLE,
    "504": grpc.StatusCode.UNAVAILABLE,
}
_CODES = {code.value[0]: code for code in grpc.StatusCode}
_CANCEL = 0x8


class CallError(Exception):
    """A call ended with a gRPC status other than OK (or the connection failed: UNAVAILABLE)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return bytes((n >> 16, (n >> 8) & 0xFF, n & 0xFF, kind, flags)) + stream_id.to_bytes(4, "big") + payload


def _hpack_int(value: int, prefix_bits: int, first: int) -> bytes:
    """An HPACK integer with a ``prefix_bits`` prefix, the rest of the first byte ``first`` (RFC 7541 5.1)."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 127) | 128)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: bytes, value: bytes) -> bytes:
    """One header as a literal never indexed, with a literal name and no Huffman (RFC 7541 6.2.3)."""
    return b"\x10" + _hpack_int(len(name), 7, 0) + name + _hpack_int(len(value), 7, 0) + value


def _grpc_timeout(seconds: float) -> str:
    """``grpc-timeout`` for ``seconds`` (at most 8 digits: milliseconds, else seconds, else hours)."""
    ms = max(1, math.ceil(seconds * 1000))
    if ms < 10**8:
        return f"{ms}m"
    s = math.ceil(seconds)
    return f"{s}S" if s < 10**8 else f"{min(10**8 - 1, math.ceil(s / 3600))}H"


class MessageSink(Protocol):
    """Where a call's response messages go as the connection parses them.

    :meth:`feed` runs inside the connection's ``data_received`` for every whole message (its
    bytes, without gRPC's 5-byte prefix); an exception fails the call INTERNAL ("cannot parse a
    response message"). :meth:`take` runs in the consumer and returns what was fed since the last
    take as one item. A sink that merges as it is fed (:class:`router.vllm_grpc.GenerateMerge`)
    keeps no object per message: the tokens go straight into one list.
    """

    def feed(self, payload: bytes) -> None: ...

    def take(self) -> Any: ...


class H2Stream:
    """One call's receiving end: its :class:`MessageSink`, and how the call ended.

    The connection feeds each whole message to :attr:`sink`, sets :attr:`ready` and wakes the
    consumer's :attr:`waiter` unless the consumer is :attr:`holding` (a paced relay collecting for
    its interval); the end of the call always wakes it.
    """

    __slots__ = (
        "buf",
        "conn",
        "done",
        "error",
        "got_headers",
        "hold_until",
        "holding",
        "id",
        "ready",
        "send_window",
        "sink",
        "unacked",
        "waiter",
    )

    def __init__(self, conn: H2Connection, stream_id: int, sink: MessageSink) -> None:
        self.conn = conn
        self.id = stream_id
        self.sink = sink
        #: A message was fed since the consumer's last :meth:`take`.
        self.ready = False
        self.buf = bytearray()
        self.done = False
        self.error: CallError | None = None
        self.got_headers = False
        self.holding = False
        #: When the consumer's hold ends (the loop's clock), while it holds.
        self.hold_until = 0.0
        self.waiter: asyncio.Future[None] | None = None
        self.unacked = 0
        self.send_window = conn.peer_initial_window

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def end(self, code: grpc.StatusCode, details: str = "") -> None:
        """The call is over (``code`` OK: cleanly); wakes the consumer."""
        if self.done:
            return
        self.done = True
        if code is not grpc.StatusCode.OK:
            self.error = CallError(code, details)
        self.conn.forget(self)
        self.wake()

    def cancel(
        self, code: grpc.StatusCode = grpc.StatusCode.CANCELLED, details: str = "Locally cancelled"
    ) -> None:
        """Stop the call: RST_STREAM(CANCEL) to the server (it cancels the request), ``code`` here."""
        if self.done:
            return
        self.conn.reset(self.id)
        self.end(code, details)

    async def wait(self) -> None:
        """Return when a message is ready or the call is over."""
        if self.ready or self.done:
            return
        waiter = self.waiter = self.conn.loop.create_future()
        try:
            await waiter
        finally:
            self.waiter = None

    def take(self) -> Any:
        """What the sink holds since the last take (see :meth:`MessageSink.take`)."""
        self.ready = False
        return self.sink.take()


#: The bytes that are each a whole HPACK indexed header field (RFC 7541 §6.1: ``1xxxxxxx``, index
#: 1-126; 0x80 is no index and 0xFF starts a longer one).
_ONE_BYTE_INDEXED = bytes(range(0x81, 0xFF))
#: Most remembered header blocks per connection (:class:`IndexedBlocks`).
MAX_REMEMBERED_BLOCKS = 64


class IndexedBlocks:
    """An HPACK decoder that remembers the header blocks made only of one-byte indexed fields.

    A gRPC peer sends the same headers on every call of a connection, and after the first call
    HPACK encodes them as references to its tables (gRPC's own client: nine one-byte references
    for a whole request's headers; a server's response headers and trailers alike), which the
    ``hpack`` package decodes in 10-20 µs of Python per block. An indexed field never changes
    the dynamic table, so such a block decodes to the same headers for as long as the table is
    unchanged; only a block holding anything else (a literal that may be added to the table, a
    table size update) can change it, and decoding one forgets every remembered block.
    """

    __slots__ = ("_blocks", "_decoder")

    def __init__(self, decoder: Any) -> None:
        self._decoder = decoder
        self._blocks: dict[bytes, Any] = {}

    def decode(self, block: bytes) -> Any:
        """``decoder.decode(block, raw=True)``: the (name, value) byte pairs, in order (read-only)."""
        found = self._blocks.get(block)
        if found is not None:
            return found
        headers = tuple(self._decoder.decode(block, raw=True))
        if block and not block.translate(None, _ONE_BYTE_INDEXED):
            if len(self._blocks) < MAX_REMEMBERED_BLOCKS:
                self._blocks[block] = headers
        elif self._blocks:
            self._blocks.clear()
        return headers


class CoalescedWrites:
    """Frames queued during one event-loop iteration leave in one ``transport.write`` (both sides of
    the router's HTTP/2: this client, and the Router service's server in ``router.h2_server``).

    A write to a loopback socket wakes the peer at once, and on a busy host the writer is then often
    preempted in the system call: with one write per frame, a burst of calls reaches the peer (or a
    step's messages reach the clients) one preemption at a time. The class using it sets
    ``transport``, ``closed``, ``loop``, ``_out`` (empty) and ``_send_scheduled`` (False).
    """

    transport: asyncio.Transport | None
    closed: bool
    loop: asyncio.AbstractEventLoop
    _out: list[bytes]
    _send_scheduled: bool

    def _write(self, data: bytes) -> None:
        """Queue ``data`` for this iteration's write (dropped once the connection is closed)."""
        if self.transport is None or self.closed:
            return
        self._out.append(data)
        if not self._send_scheduled:
            self._send_scheduled = True
            self.loop.call_soon(self._send)

    def _send(self) -> None:
        self._send_scheduled = False
        out = self._out
        if not out or self.transport is None or self.closed:
            out.clear()
            return
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        self.transport.write(data)


class H2Connection(CoalescedWrites, asyncio.Protocol):
    """One HTTP/2 connection to a gRPC server, carrying any number of :class:`H2Stream` calls."""

    def __init__(self, authority: str, max_message_bytes: int) -> None:
        self.authority = authority
        self.max_message_bytes = max_message_bytes
        self.transport: asyncio.Transport | None = None
        self.closed = False
        #: No new streams here (GOAWAY, retired, ids used up); the pool opens another connection.
        self.draining = False
        self._streams: dict[int, H2Stream] = {}
        self._next_id = 1
        self._header_blocks: dict[str, bytes] = {}
        #: Frames queued in this loop iteration (:meth:`_write`).
        self._out: list[bytes] = []
        self._send_scheduled = False
        self._decoder = IndexedBlocks(hpack.Decoder())
        self._in = b""
        self._headers_sid = 0
        self._headers_block = bytearray()
        self._headers_end_stream = False
        self.peer_initial_window = _DEFAULT_WINDOW
        self._peer_max_frame = _DEFAULT_FRAME
        self._peer_max_streams = 1 << 31
        self._send_window = _DEFAULT_WINDOW
        #: Request bodies waiting for send window: (stream, bytes left).
        self._blocked: list[tuple[H2Stream, bytes]] = []
        self._conn_unacked = 0
        self._loop = self.loop = asyncio.get_running_loop()
        self._last_rx = self._loop.time()
        self._ping_at: float | None = None
        self._keepalive: asyncio.TimerHandle | None = None
        #: The pending end of a read pause (:meth:`_coalesce`), while reading is paused.
        self._resume: asyncio.TimerHandle | None = None
        #: Read pauses so far (for tests and diagnostics).
        self.read_pauses = 0

    # ------------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; they have its methods.
        self.transport = cast(asyncio.Transport, transport)
        settings = struct.pack(">HIHI", _S_ENABLE_PUSH, 0, _S_INITIAL_WINDOW, STREAM_WINDOW)
        self.transport.write(
            PREFACE
            + _frame(_SETTINGS, 0, 0, settings)
            + _frame(_WINDOW_UPDATE, 0, 0, (CONNECTION_WINDOW - _DEFAULT_WINDOW).to_bytes(4, "big"))
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = self.draining = True
        if self._keepalive is not None:
            self._keepalive.cancel()
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        why = f": {exc}" if exc is not None else ""
        for stream in list(self._streams.values()):
            stream.end(grpc.StatusCode.UNAVAILABLE, f"connection to {self.authority} lost{why}")

    def data_received(self, data: bytes) -> None:
        self._last_rx = self._loop.time()
        self._ping_at = None
        if self._in:
            data = self._in + data
        pos = 0
        end = len(data)
        try:
            while end - pos >= 9:
                length = (data[pos] << 16) | (data[pos + 1] << 8) | data[pos + 2]
                start = pos + 9
                if end - start < length:
                    break
                kind = data[pos + 3]
                flags = data[pos + 4]
                sid = int.from_bytes(data[pos + 5 : start], "big") & 0x7FFFFFFF
                pos = start + length
                if kind == _DATA:
                    self._on_data(sid, flags, data[start:pos])
                elif kind in (_HEADERS, _CONT):
                    self._on_headers(kind, sid, flags, data[start:pos])
                else:
                    self._on_control(kind, sid, flags, data[start:pos])
        except _ProtocolError as exc:
            self._fail_connection(str(exc))
            return
        self._in = data[pos:]
        if len(self._streams) >= READ_COALESCE_MIN_STREAMS and self._resume is None:
            self._coalesce()

    def _coalesce(self) -> None:
        """Pause reading briefly when no consumer wants a message now.

        vLLM's server writes each stream's message of an engine step on its own, so a reader that
        reads whenever bytes arrive wakes several times per step. While every stream's relay holds
        for its pacing interval (:func:`paced_stream_batches`; at least
        :data:`READ_COALESCE_MIN_STREAMS` of them) nobody takes a message before the first hold
        ends: the reader then leaves the bytes in the socket for up to
        :data:`READ_COALESCE_S`, ending the pause :data:`READ_COALESCE_MARGIN_S` before that first
        hold does, and reads them all at once. A stream waiting for its first message, or for the
        next one after a quiet interval, is not holding: no pause then, so neither the first token
        nor a lone token waits. The end of a call that comes during a pause waits for the pause.
        """
        first = math.inf
        for stream in self._streams.values():
            if not stream.holding:
                return
            if stream.hold_until < first:
                first = stream.hold_until
        pause = min(READ_COALESCE_S, first - READ_COALESCE_MARGIN_S - self._loop.time())
        if pause < READ_COALESCE_MARGIN_S or self.transport is None or self.closed:
            return
        self.transport.pause_reading()
        self.read_pauses += 1
        self._resume = self._loop.call_later(pause, self._read_again)

    def _read_again(self) -> None:
        """End a read pause (its timer, a new call, or the connection closing)."""
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
            if self.transport is not None and not self.closed:
                self.transport.resume_reading()

    # ------------------------------------------------------------------ frames

    def _on_data(self, sid: int, flags: int, payload: bytes) -> None:
        n = len(payload)
        self._conn_unacked += n
        if self._conn_unacked >= CONNECTION_WINDOW // 2:
            self._write(_frame(_WINDOW_UPDATE, 0, 0, self._conn_unacked.to_bytes(4, "big")))
            self._conn_unacked = 0
        stream = self._streams.get(sid)
        if stream is None:
            return  # a stream this client reset or that ended: only the connection window counts it
        if flags & _PADDED:
            payload = payload[1 : n - payload[0]]
        if not (flags & _END_STREAM):
            stream.unacked += n
            if stream.unacked >= STREAM_WINDOW // 2:
                self._write(_frame(_WINDOW_UPDATE, 0, sid, stream.unacked.to_bytes(4, "big")))
                stream.unacked = 0
        buf = stream.buf
        if buf:
            buf += payload
            if len(buf) >= 5:
                length = int.from_bytes(buf[1:5], "big")
                if length <= self.max_message_bytes and len(buf) - 5 < length:
                    # A message spread over frames: parse once it is whole, not at every frame
                    # (copying the growing buffer each time would be quadratic in its size).
                    self._data_end(stream, flags)
                    return
            payload = bytes(buf)
            buf.clear()
        pos = 0
        size = len(payload)
        while size - pos >= 5:
            length = int.from_bytes(payload[pos + 1 : pos + 5], "big")
            if length > self.max_message_bytes:
                stream.cancel(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"received message larger than max ({length} vs. {self.max_message_bytes})",
                )
                return
            if size - pos - 5 < length:
                break
            if payload[pos]:
                stream.cancel(grpc.StatusCode.INTERNAL, "compressed message received; none was asked for")
                return
            try:
                stream.sink.feed(payload[pos + 5 : pos + 5 + length])
            except Exception as exc:  # the message's own parser: any failure is a bad message
                stream.cancel(grpc.StatusCode.INTERNAL, f"cannot parse a response message: {exc}")
                return
            pos += 5 + length
            stream.ready = True
        if pos < size:
            buf += payload[pos:]
        self._data_end(stream, flags)

    @staticmethod
    def _data_end(stream: H2Stream, flags: int) -> None:
        if stream.ready and not stream.holding:
            stream.wake()
        if flags & _END_STREAM:
            stream.end(grpc.StatusCode.INTERNAL, "the server ended the stream without a gRPC status")

    def _on_headers(self, kind: int, sid: int, flags: int, payload: bytes) -> None:
        if kind == _HEADERS:
            if self._headers_sid:
                raise _ProtocolError("HEADERS while another header block is open")
            if flags & _PADDED:
                payload = payload[1 : len(payload) - payload[0]]
            if flags & _PRIORITY_FLAG:
                payload = payload[5:]
            self._headers_sid = sid
            self._headers_end_stream = bool(flags & _END_STREAM)
        elif sid != self._headers_sid:
            raise _ProtocolError("CONTINUATION of no open header block")
        self._headers_block += payload
        if len(self._headers_block) > 1 << 20:
            raise _ProtocolError("header block over 1 MiB")
        if not (flags & _END_HEADERS):
            return
        block = bytes(self._headers_block)
        self._headers_block.clear()
        self._headers_sid = 0
        try:
            # Every block is decoded, whoever it is for: HPACK's table is the connection's.
            headers = dict(self._decoder.decode(block))
        except hpack.HPACKError as exc:
            raise _ProtocolError(f"bad header block: {exc}") from exc
        stream = self._streams.get(sid)
        if stream is None:
            return
        if not stream.got_headers:
            stream.got_headers = True
            status = headers.get(b":status", b"").decode("ascii", "replace")
            if status != "200":
                http = _HTTP_CODES.get(status, grpc.StatusCode.UNKNOWN)
                stream.cancel(http, f"HTTP status {status or '(none)'} from {self.authority}")
                return
            if b"grpc-status" not in headers:  # response headers; the messages follow
                if self._headers_end_stream:
                    stream.end(grpc.StatusCode.INTERNAL, "the server ended the stream without a gRPC status")
                return
        if not self._headers_end_stream:
            stream.cancel(grpc.StatusCode.INTERNAL, "trailers without END_STREAM")
            return
        value = headers.get(b"grpc-status", b"")
        code = _CODES.get(int(value), grpc.StatusCode.UNKNOWN) if value.isdigit() else grpc.StatusCode.UNKNOWN
        details = urllib.parse.unquote_to_bytes(headers.get(b"grpc-message", b"")).decode("utf-8", "replace")
        if code is grpc.StatusCode.OK and stream.buf:
            code, details = grpc.StatusCode.INTERNAL, "the stream ended inside a message"
        stream.end(code, details)

    def _on_control(self, kind: int, sid: int, flags: int, payload: bytes) -> None:
        if kind == _SETTINGS:
            if flags & _ACK:
                return
            for i in range(0, len(payload) - 5, 6):
                key, value = struct.unpack_from(">HI", payload, i)
                if key == _S_INITIAL_WINDOW:
                    delta = value - self.peer_initial_window
                    self.peer_initial_window = value
                    for open_stream in self._streams.values():
                        open_stream.send_window += delta
                elif key == _S_MAX_FRAME:
                    self._peer_max_frame = value
                elif key == _S_MAX_CONCURRENT:
                    self._peer_max_streams = value
            self._write(_frame(_SETTINGS, _ACK, 0))
            self._flush()
        elif kind == _WINDOW_UPDATE:
            increment = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
            if sid == 0:
                self._send_window += increment
            elif (updated := self._streams.get(sid)) is not None:
                updated.send_window += increment
            self._flush()
        elif kind == _PING:
            if not (flags & _ACK):
                self._write(_frame(_PING, _ACK, 0, payload))
        elif kind == _RST_STREAM:
            reset = self._streams.get(sid)
            if reset is not None:
                code = int.from_bytes(payload[:4], "big")
                reset.end(
                    _RST_CODES.get(code, grpc.StatusCode.INTERNAL),
                    f"stream reset by {self.authority} (HTTP/2 error {code})",
                )
        elif kind == _GOAWAY:
            last = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
            self.draining = True
            for refused in [s for s in self._streams.values() if s.id > last]:
                refused.end(grpc.StatusCode.UNAVAILABLE, f"{self.authority} is going away (GOAWAY)")
            if not self._streams:
                self.close()
        # PRIORITY, PUSH_PROMISE (refused by ENABLE_PUSH 0) and unknown types are ignored.

    # ------------------------------------------------------------------ calls

    def _request_headers(self, path: str) -> bytes:
        """The constant request headers of ``path``, HPACK-encoded once per path.

        Every header is a literal "never indexed" (no Huffman): the encoding touches no HPACK table,
        so the same bytes serve every call, and no encoder runs per request.
        """
        block = self._header_blocks.get(path)
        if block is None:
            block = b"".join(
                _literal(name, value)
                for name, value in (
                    (b":method", b"POST"),
                    (b":scheme", b"http"),
                    (b":path", path.encode()),
                    (b":authority", self.authority.encode()),
                    (b"content-type", b"application/grpc"),
                    (b"te", b"trailers"),
                )
            )
            if len(self._header_blocks) < 16:
                self._header_blocks[path] = block
        return block

    @property
    def usable(self) -> bool:
        """Takes a new stream now (not closing, ids left, under the server's concurrency limit)."""
        return not self.draining and len(self._streams) < self._peer_max_streams

    def start(self, path: str, body: bytes, timeout_s: float, sink: MessageSink) -> H2Stream:
        """Open a call to ``path`` sending one request message ``body``; its responses go to ``sink``."""
        sid = self._next_id
        self._next_id += 2
        if self._next_id > _MAX_STREAM_ID:
            self.draining = True
        stream = H2Stream(self, sid, sink)
        self._streams[sid] = stream
        self._read_again()  # a new call's first message is read as soon as it comes
        block = self._request_headers(path) + _literal(b"grpc-timeout", _grpc_timeout(timeout_s).encode())
        limit = self._peer_max_frame
        frames = [_frame(_HEADERS, _END_HEADERS if len(block) <= limit else 0, sid, block[:limit])]
        for i in range(limit, len(block), limit):
            last = i + limit >= len(block)
            frames.append(_frame(_CONT, _END_HEADERS if last else 0, sid, block[i : i + limit]))
        self._blocked.append((stream, len(body).to_bytes(5, "big") + body))
        self._flush(frames)  # one write: the headers, and the body as far as the windows allow
        self._arm_keepalive()
        return stream

    def _flush(self, out: list[bytes] | None = None) -> None:
        """Send ``out`` and what the windows allow of the waiting request bodies (the last frame of a
        body ends its stream), in one write: a write to a loopback socket is a system call that
        also runs the receiver's side of TCP."""
        out = out if out is not None else []
        if not self._blocked:
            if out:
                self._write(b"".join(out))
            return
        still: list[tuple[H2Stream, bytes]] = []
        for stream, left in self._blocked:
            if stream.done:
                continue
            while left:
                n = min(len(left), self._send_window, stream.send_window, self._peer_max_frame)
                if n <= 0:
                    break
                self._send_window -= n
                stream.send_window -= n
                chunk, left = left[:n], left[n:]
                out.append(_frame(_DATA, 0 if left else _END_STREAM, stream.id, chunk))
            if left:
                still.append((stream, left))
        self._blocked = still
        if out:
            self._write(b"".join(out))

    def reset(self, sid: int) -> None:
        self._write(_frame(_RST_STREAM, 0, sid, _CANCEL.to_bytes(4, "big")))

    def forget(self, stream: H2Stream) -> None:
        self._streams.pop(stream.id, None)
        if self.draining and not self._streams and not self.closed:
            self.close()

    def retire(self) -> None:
        """Take no new streams; close once the running ones end."""
        self.draining = True
        if not self._streams:
            self.close()

    def close(self) -> None:
        self.draining = True
        if self.transport is not None and not self.closed:
            self._send()  # what is queued (a reset, an acknowledgement) goes before the close
            self.transport.close()

    def _fail_connection(self, why: str) -> None:
        for stream in list(self._streams.values()):
            stream.end(grpc.StatusCode.UNAVAILABLE, f"HTTP/2 protocol error from {self.authority}: {why}")
        if self.transport is not None:
            self.transport.abort()
        self.closed = self.draining = True

    # ------------------------------------------------------------------ keepalive

    def _arm_keepalive(self) -> None:
        if self._keepalive is None and not self.closed:
            self._keepalive = self._loop.call_later(KEEPALIVE_TIMEOUT_S, self._check_alive)

    def _check_alive(self) -> None:
        """Every few seconds while streams are open: PING after :data:`KEEPALIVE_S` of silence."""
        self._keepalive = None
        if self.closed or not self._streams:
            return
        now = self._loop.time()
        if self._ping_at is not None and now - self._ping_at >= KEEPALIVE_TIMEOUT_S:
            why = f"no answer to a keepalive PING within {KEEPALIVE_TIMEOUT_S:g} s"
            for stream in list(self._streams.values()):
                stream.end(grpc.StatusCode.UNAVAILABLE, f"{self.authority}: {why}")
            if self.transport is not None:
                self.transport.abort()
            self.closed = self.draining = True
            return
        if self._ping_at is None and now - self._last_rx >= KEEPALIVE_S:
            self._ping_at = now
            self._write(_frame(_PING, 0, 0, bytes(8)))
        self._arm_keepalive()


class _ProtocolError(Exception):
    """The server broke HTTP/2 (the connection is closed, its streams fail UNAVAILABLE)."""


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` → (host, port)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class H2Pool:
    """One :class:`H2Connection` per address (a new one when the current one drains), LRU-bounded."""

    def __init__(self, max_connections: int, max_message_bytes: int) -> None:
        self._max = max_connections
        self._max_message = max_message_bytes
        self._conns: dict[str, H2Connection] = {}
        self._opening: dict[str, asyncio.Future[H2Connection]] = {}

    async def connection(self, address: str, timeout_s: float) -> H2Connection:
        """The usable connection to ``address``, opened within ``timeout_s`` (``OSError``/``TimeoutError``)."""
        conn = self._conns.get(address)
        if conn is not None and conn.usable:
            self._conns[address] = self._conns.pop(address)  # most recently used last
            return conn
        opening = self._opening.get(address)
        if opening is not None:
            return await asyncio.shield(opening)
        future: asyncio.Future[H2Connection] = asyncio.get_running_loop().create_future()
        self._opening[address] = future
        try:
            host, port = split_host_port(address)
            async with asyncio.timeout(timeout_s):
                _, protocol = await asyncio.get_running_loop().create_connection(
                    lambda: H2Connection(address, self._max_message), host, port
                )
            new = protocol
            old = self._conns.pop(address, None)
            if old is not None:
                old.retire()
            self._conns[address] = new
            while len(self._conns) > self._max:
                self._conns.pop(next(iter(self._conns))).retire()
            future.set_result(new)
            return new
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: a failed connect with no other waiter is not an error
            raise
        finally:
            del self._opening[address]

    @property
    def read_pauses(self) -> int:
        """Read pauses of the open connections (:meth:`H2Connection._coalesce`), for diagnostics."""
        return sum(conn.read_pauses for conn in self._conns.values())

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()


async def paced_stream_batches(stream: H2Stream, pacer: RelayPacer) -> AsyncGenerator[Any, None]:
    """:func:`router.legs.paced_batches` for an :class:`H2Stream`: the same pacing, no reader task.

    Yields what :meth:`H2Stream.take` returns (the sink's merge of the messages since the last
    take). The connection already parses each TCP read into the streams' sinks, so no task per
    stream reads message by message. After each batch the consumer sleeps until the pacer's
    interval is over (the connection does not wake a holding consumer; the end of the call does,
    at once) and takes what arrived meanwhile; only when nothing did does it wait for the next
    message, which then goes out at once. So a streaming relay wakes once per batch, at its
    interval's end, not also at the first message after each batch. Raises the call's
    :class:`CallError` after the messages before it.
    """
    loop = stream.conn.loop
    pacer.active += 1
    try:
        while True:
            if not stream.ready and not stream.done:
                await stream.wait()
            if stream.ready:
                yield stream.take()
                if pacer.min_interval_s > 0 and not stream.done:
                    await _hold(stream, loop, pacer.interval_s())
                continue
            if stream.error is not None:
                raise stream.error
            return
    finally:
        pacer.active -= 1


async def _hold(stream: H2Stream, loop: asyncio.AbstractEventLoop, delay: float) -> None:
    """Sleep ``delay`` seconds, or until the call ends, while the connection fills the sink."""
    stream.holding = True
    stream.hold_until = loop.time() + delay
    waiter = stream.waiter = loop.create_future()
    timer = loop.call_later(delay, stream.wake)
    try:
        await waiter
    finally:
        timer.cancel()
        stream.holding = False
        stream.waiter = None
