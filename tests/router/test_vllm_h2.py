"""The router's HTTP/2 reader of vLLM's ``Generate`` (router.vllm_h2) against a real gRPC server.

A ``grpc.aio`` server of vLLM's ``VllmEngine`` service on loopback plays the engine; what it
sends is scripted by the request id. Every behaviour is checked on both transports
(``--vllm-transport h2`` and ``grpc``): the reader must end, fail and cancel a call exactly as
``grpc.aio`` does, so that retries, failover, deadlines and aborts behave the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from slorouter.v1 import common_pb2, worker_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_pb2_grpc

from router.forward import LegError, WorkerClient
from router.legs import LegLedger
from router.pool import ChannelPool
from router.vllm_grpc import VLLM_TRANSPORTS, GenerateMerge
from router.vllm_h2 import STREAM_WINDOW, IndexedBlocks, _grpc_timeout, _literal

#: The reader's HPACK package (pyproject; `make venv` installs it): without it the file is skipped.
hpack = pytest.importorskip("hpack")

#: Tokens per chunk of a "big" stream: enough that a stream crosses the reader's receive window.
BIG_CHUNK = 20_000
#: Tokens of a "huge" stream's chunks: a message of ~2 MB, well over a hundred 16 KiB frames.
HUGE_CHUNK = 1_000_000


@dataclass(frozen=True)
class _Target:
    instance_id: str
    endpoint: str


class ScriptedEngine(vllm_pb2_grpc.VllmEngineServicer):  # type: ignore[misc]
    """``Generate`` by the request id's prefix (see the module docstring); token k of a request is
    ``len(prompt) + k``, so the continuation of a resumed call is checkable."""

    def __init__(self) -> None:
        self.prompts: dict[str, int] = {}
        self.cancelled: set[str] = set()
        self.release = asyncio.Event()

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        rid = request.request_id
        n_prompt = len(request.tokenized.input_ids)
        self.prompts[rid] = n_prompt
        count = request.sampling_params.max_tokens
        # A client's cancel that lands while grpc sends a message cancels grpc's task there, outside
        # this generator (left suspended until it is collected): the call's end is what says so.
        context.add_done_callback(lambda ctx: self.cancelled.add(rid) if ctx.cancelled() else None)
        try:
            if rid.startswith("refuse"):
                await context.abort(grpc.StatusCode.NOT_FOUND, "kv handle gone: 100% ✓")
            for k in range(count):
                ids = [(n_prompt + k) % 1000] * BIG_CHUNK if rid.startswith("big") else [n_prompt + k]
                if rid.startswith("huge"):  # one message over a hundred HTTP/2 frames and more
                    ids = [(n_prompt + k) % 1000] * HUGE_CHUNK
                yield vllm_pb2.GenerateResponse(
                    chunk=vllm_pb2.GenerateStreamChunk(token_ids=ids, prompt_tokens=n_prompt)
                )
                if rid.startswith("fail") and k == 1:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad request: 100% ✓ ünïcode")
                if rid.startswith("hang"):
                    await self.release.wait()
                if rid.startswith("slow"):
                    await asyncio.sleep(0.002)
            yield vllm_pb2.GenerateResponse(
                complete=vllm_pb2.GenerateComplete(finish_reason="length", prompt_tokens=n_prompt)
            )
        except asyncio.CancelledError:
            self.cancelled.add(rid)
            raise


@contextlib.asynccontextmanager
async def _engine() -> AsyncIterator[tuple[ScriptedEngine, grpc.aio.Server, str]]:
    servicer = ScriptedEngine()
    server = grpc.aio.server()
    vllm_pb2_grpc.add_VllmEngineServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield servicer, server, f"vllm-grpc://127.0.0.1:{port}"
    finally:
        servicer.release.set()
        await server.stop(0)


@contextlib.asynccontextmanager
async def _client(transport: str, **kw: Any) -> AsyncIterator[WorkerClient]:
    pool = ChannelPool()
    client = WorkerClient(pool, **kw)
    client.vllm.set_transport(transport)
    client.vllm.set_pacing(0.0, 0.0)
    try:
        yield client
    finally:
        await client.close()
        await pool.close()


def _request(rid: str, prompt: int, max_tokens: int) -> worker_pb2.WorkerGenerateRequest:
    return worker_pb2.WorkerGenerateRequest(
        request_id=rid,
        prompt_token_ids=list(range(1, prompt + 1)),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


async def _collect(client: WorkerClient, target: _Target, request: Any, timeout_s: float = 30.0) -> list[int]:
    ids: list[int] = []
    finished = False
    async for message in client.stream(target, request, timeout_s, LegLedger()):
        assert not finished, "a message after the last one"
        ids.extend(message.token_ids)
        finished = message.finished
    assert finished
    return ids


@pytest.mark.parametrize("transport", VLLM_TRANSPORTS)
async def test_streams_arrive_whole_and_in_order_many_at_once(transport: str) -> None:
    async with _engine() as (engine, _, endpoint), _client(transport) as client:
        target = _Target("v", endpoint)
        prompts = [1 + (7 * i) % 50 for i in range(64)]
        results = await asyncio.gather(
            *(_collect(client, target, _request(f"ok-{i}", p, 40)) for i, p in enumerate(prompts))
        )
        for p, ids in zip(prompts, results, strict=True):
            assert ids == list(range(p, p + 40))
        # A decode leg resumes after the tokens the client has: prompt + generated go up, the rest comes.
        decode = worker_pb2.DecodeRequest(
            request_id="ok-resume",
            prompt_token_ids=[1, 2, 3],
            generated_token_ids=[3, 4],
            sampling=common_pb2.SamplingParams(max_tokens=6),
        )
        assert await _collect(client, target, decode) == [5, 6, 7, 8]
        assert engine.prompts["ok-resume"] == 5


@pytest.mark.parametrize("transport", VLLM_TRANSPORTS)
async def test_a_large_prompt_and_a_large_answer_pass_the_flow_control_windows(transport: str) -> None:
    async with _engine() as (engine, _, endpoint), _client(transport) as client:
        target = _Target("v", endpoint)
        # 60,000 token ids are ~180 KB of request: more than HTTP/2's initial 64 KiB window.
        assert await _collect(client, target, _request("ok-long", 60_000, 3)) == [60_000, 60_001, 60_002]
        assert engine.prompts["ok-long"] == 60_000
        # A stream of 400 chunks of 20,000 ids (~12 MB): several times the reader's window per stream.
        chunks = 400
        assert chunks * BIG_CHUNK * 2 > 2 * STREAM_WINDOW
        ids = await _collect(client, target, _request("big-1", 10, chunks))
        assert len(ids) == chunks * BIG_CHUNK
        assert ids[::BIG_CHUNK] == [(10 + k) % 1000 for k in range(chunks)]
        ids = await _collect(client, target, _request("huge-1", 500, 2))
        assert ids == [500] * HUGE_CHUNK + [501] * HUGE_CHUNK


@pytest.mark.parametrize("transport", VLLM_TRANSPORTS)
async def test_an_error_status_keeps_its_code_and_message_after_the_tokens_before_it(transport: str) -> None:
    async with _engine() as (_, _, endpoint), _client(transport) as client:
        target = _Target("v", endpoint)
        got: list[int] = []
        with pytest.raises(LegError) as info:
            async for message in client.stream(target, _request("fail-1", 4, 10), 30.0, LegLedger()):
                got.extend(message.token_ids)
        assert got == [4, 5]
        assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT and not info.value.retryable
        assert info.value.details == "bad request: 100% ✓ ünïcode"
        # An error before any message (trailers only): a gone KV handle is recomputed, not retried.
        with pytest.raises(LegError) as info:
            await _collect(client, target, _request("refuse-1", 4, 10))
        assert info.value.code is grpc.StatusCode.NOT_FOUND and info.value.kv_gone
        assert info.value.details == "kv handle gone: 100% ✓"


@pytest.mark.parametrize("transport", VLLM_TRANSPORTS)
async def test_a_deadline_ends_the_call_and_a_consumer_leaving_cancels_it_on_the_engine(
    transport: str,
) -> None:
    async with _engine() as (engine, _, endpoint), _client(transport) as client:
        target = _Target("v", endpoint)
        got: list[int] = []
        with pytest.raises(LegError) as info:
            async for message in client.stream(target, _request("hang-deadline", 3, 10), 0.5, LegLedger()):
                got.extend(message.token_ids)
        assert got == [3]
        assert info.value.code is grpc.StatusCode.DEADLINE_EXCEEDED and info.value.retryable
        stream = client.stream(target, _request("hang-leave", 3, 10), 30.0, LegLedger())
        first = await anext(stream)
        assert list(first.token_ids) == [3]
        await stream.aclose()  # type: ignore[attr-defined]  # the client went away: the engine's call is cancelled (vLLM aborts)
        for _ in range(100):
            if {"hang-deadline", "hang-leave"} <= engine.cancelled:
                break
            await asyncio.sleep(0.05)
        assert {"hang-deadline", "hang-leave"} <= engine.cancelled


@pytest.mark.parametrize("transport", VLLM_TRANSPORTS)
async def test_an_engine_that_dies_mid_stream_or_is_down_is_a_retryable_failure(transport: str) -> None:
    async with _engine() as (_, server, endpoint), _client(transport, connect_timeout_s=1.0) as client:
        target = _Target("v", endpoint)
        got: list[int] = []
        with pytest.raises(LegError) as info:
            async for message in client.stream(target, _request("hang-kill", 3, 10), 30.0, LegLedger()):
                got.extend(message.token_ids)
                await server.stop(0)
        assert got == [3]
        assert info.value.retryable and info.value.code in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.CANCELLED,
        )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free = s.getsockname()[1]
        with pytest.raises(LegError) as info:
            await _collect(client, _Target("w", f"vllm-grpc://127.0.0.1:{free}"), _request("ok-x", 3, 2))
        assert info.value.code is grpc.StatusCode.UNAVAILABLE and info.value.retryable


async def test_the_h2_reader_takes_the_tokens_of_many_streams_in_few_batches() -> None:
    """What the reader is for: under load, a consumer's step takes several tokens at once."""
    async with _engine() as (_, _, endpoint), _client("h2") as client:
        client.vllm.set_pacing(0.005, 0.0)
        target = _Target("v", endpoint)
        messages = 0

        async def one(i: int) -> None:
            nonlocal messages
            async for message in client.stream(target, _request(f"slow-{i}", 2, 50), 30.0, LegLedger()):
                messages += 1
                assert message.token_ids or message.finished

        await asyncio.gather(*(one(i) for i in range(16)))
        assert messages < 16 * 50


async def test_paced_streams_lose_nothing_while_the_reader_pauses_and_a_new_call_is_not_held() -> None:
    """While every relay holds for its interval the reader leaves the engine's bytes in the socket
    for a moment (it pauses: checked); every token still arrives, in order, and a call started
    meanwhile gets its first message well within a hold interval."""
    async with _engine() as (_, _, endpoint), _client("h2") as client:
        client.vllm.set_pacing(0.03, 0.0)
        target = _Target("v", endpoint)
        results = await asyncio.gather(
            *(_collect(client, target, _request(f"slow-{i}", 1 + i, 60)) for i in range(8))
        )
        for i, ids in enumerate(results):
            assert ids == list(range(1 + i, 61 + i))
        assert client.vllm.h2_read_pauses > 0

        late: list[float] = []
        streaming = [asyncio.Event() for _ in range(8)]

        async def slow(i: int) -> list[int]:
            ids: list[int] = []
            finished = False
            async for message in client.stream(target, _request(f"slow-b{i}", 2, 60), 30.0, LegLedger()):
                assert not finished, "a message after the last one"
                ids.extend(message.token_ids)
                finished = message.finished
                streaming[i].set()
            assert finished
            return ids

        async def newcomer() -> None:
            # Once every other stream has its first message, they are streaming and holding.
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in streaming)), 30.0)
            started = asyncio.get_running_loop().time()
            async for message in client.stream(target, _request("ok-new", 3, 1), 30.0, LegLedger()):
                if message.token_ids:
                    late.append(asyncio.get_running_loop().time() - started)

        _, *slow_ids = await asyncio.gather(newcomer(), *(slow(i) for i in range(8)))
        assert all(ids == list(range(2, 62)) for ids in slow_ids)
        assert late and late[0] < 0.5, late  # a liveness bound with margin, not a timing figure


@settings(max_examples=50, deadline=None)
@given(st.floats(min_value=0.0005, max_value=1e7))
def test_grpc_timeout_is_at_most_eight_digits_and_never_shorter(seconds: float) -> None:
    value = _grpc_timeout(seconds)
    digits, unit = value[:-1], value[-1]
    assert digits.isdigit() and 1 <= len(digits) <= 8
    assert int(digits) * {"m": 1e-3, "S": 1.0, "H": 3600.0}[unit] >= seconds - 1e-9


_HEADER_NAMES = [":path", ":authority", "content-type", "grpc-timeout", "te", "x-a", "x-b"]
_HEADER_VALUES = ["/a/B", "h:1", "application/grpc", "300S", "299S", "trailers", "v" * 40, ""]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.tuples(st.sampled_from(_HEADER_NAMES), st.sampled_from(_HEADER_VALUES)), max_size=6),
            # The encoder's table size, when it changes (small ones evict at every insertion).
            st.sampled_from([None, None, None, 0, 64, 200, 4096]),
            st.booleans(),  # Huffman
        ),
        max_size=25,
    )
)
def test_remembered_header_blocks_decode_as_the_decoder_does(calls: list[Any]) -> None:
    """``IndexedBlocks`` gives every block's headers as a plain decoder does, through table
    insertions, evictions (small tables) and size updates, however blocks repeat."""
    encoder = hpack.Encoder()
    plain, remembering = hpack.Decoder(), IndexedBlocks(hpack.Decoder())
    for headers, table_size, huffman in calls:
        if table_size is not None:
            encoder.header_table_size = table_size
        for _ in range(2):  # each call's headers twice: the second is often all references
            block = encoder.encode(headers, huffman=huffman)
            expected = [tuple(h) for h in plain.decode(block, raw=True)]
            assert [tuple(h) for h in remembering.decode(block)] == expected


def test_a_repeated_block_of_references_is_decoded_once() -> None:
    encoder = hpack.Encoder()
    headers = [(":path", "/slorouter.v1.Router/Generate"), ("content-type", "application/grpc")]
    plain, blocks = hpack.Decoder(), IndexedBlocks(hpack.Decoder())

    def both(block: bytes) -> Any:
        expected = [tuple(h) for h in plain.decode(block, raw=True)]
        got = blocks.decode(block)
        assert [tuple(h) for h in got] == expected
        return got

    both(encoder.encode(headers))  # literals: added to both tables
    again = encoder.encode(headers)
    assert all(b > 0x80 for b in again)  # two references
    first = both(again)
    assert both(again) is first  # remembered
    both(encoder.encode([("x-new", "1")]))  # a literal added to the table: the references move
    moved = both(again)  # the same bytes now name other entries, and decode to them
    assert moved is not first and moved != first


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=1, max_size=300), st.binary(max_size=300))
def test_request_header_literals_decode_to_themselves(name: bytes, value: bytes) -> None:
    """The hand-encoded literals are HPACK a standard decoder reads (lengths past one byte too)."""
    decoded = hpack.Decoder().decode(_literal(name, value) + _literal(b"te", b"trailers"), raw=True)
    assert [tuple(h) for h in decoded] == [(name, value), (b"te", b"trailers")]


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _unpacked_chunk(ids: list[int], prompt: int, cached: int) -> bytes:
    """A chunk whose token ids are encoded one tag each (valid protobuf a server may send)."""
    body = b"".join(b"\x08" + _varint(i) for i in ids)
    body += b"\x10" + _varint(prompt) + b"\x20" + _varint(cached)
    return b"\x0a" + _varint(len(body)) + body


_UINT32 = st.integers(min_value=0, max_value=(1 << 32) - 1)
_CHUNK = st.builds(
    lambda ids, prompt, completion, cached, index, logprobs: vllm_pb2.GenerateResponse(
        chunk=vllm_pb2.GenerateStreamChunk(
            token_ids=ids,
            prompt_tokens=prompt,
            completion_tokens=completion,
            cached_tokens=cached,
            index=index,
            output_logprobs=vllm_pb2.OutputLogProbs(token_logprobs=[-0.5]) if logprobs else None,
        )
    ).SerializeToString(),
    st.lists(st.one_of(st.integers(0, 300), _UINT32), max_size=40),
    _UINT32,
    _UINT32,
    _UINT32,
    st.integers(0, 3),
    st.booleans(),
)
_OTHER = st.one_of(
    st.builds(
        _unpacked_chunk,
        st.lists(st.integers(0, 70_000), max_size=5),
        st.integers(0, 500),
        st.integers(0, 500),
    ),
    st.sampled_from(["length", "stop", "abort", "error", "other"]).map(
        lambda reason: vllm_pb2.GenerateResponse(
            complete=vllm_pb2.GenerateComplete(output_ids=[1, 2], finish_reason=reason)
        ).SerializeToString()
    ),
    st.just(b""),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.one_of(_CHUNK, _OTHER), max_size=6), min_size=1, max_size=4))
def test_the_readers_chunk_decoder_merges_exactly_what_protobuf_parses(batches: list[list[bytes]]) -> None:
    """The HTTP/2 reader decodes vLLM's token chunks by hand; every take must equal the one that
    the ``grpc.aio`` path makes from protobuf's parse of the same messages (packed and unpacked
    ids, multi-byte and 32-bit values, logprobs and other messages handed to protobuf, an error
    end, what follows the end)."""

    def error() -> Exception:
        return RuntimeError("failed")

    fed = GenerateMerge("r", None, error)
    parsed = GenerateMerge("r", None, error)
    for batch in batches:
        for data in batch:
            fed.feed(data)
            parsed.add(vllm_pb2.GenerateResponse.FromString(data))
        outs: list[tuple[list[int], bool, str, int, int] | None] = []
        for merge in (fed, parsed):
            try:
                out = merge.take()
            except RuntimeError:
                outs.append(None)
                continue
            fields = (out.token_ids, out.finished, out.finish_reason, out.num_prompt_tokens)
            outs.append((*fields, out.num_cached_prompt_tokens))
        assert outs[0] == outs[1]
        if outs[0] is None:
            break


def test_a_malformed_chunk_fails_as_protobuf_fails() -> None:
    """Bytes that are no ``GenerateResponse`` (a varint running past the end) raise protobuf's error,
    which the connection turns into INTERNAL ("cannot parse a response message")."""
    merge = GenerateMerge("r", None, lambda: RuntimeError("failed"))
    with pytest.raises(Exception, match=r"(?i)pars|decod|truncat"):
        merge.feed(b"\x0a\x03\x0a\x01\x85")
    assert merge.take().token_ids == []
