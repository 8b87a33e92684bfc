"""The router's own HTTP/2 server (``--grpc-server h2``) against real gRPC clients.

Every test runs a real server on 127.0.0.1 port 0 and talks to it with gRPC's own Python client
(``grpc.insecure_channel`` in a thread, or ``grpc.aio``): the router's services over sim workers,
or :class:`router.h2_server.H2Server` alone with test methods where the server's mechanics (flow
control, stream bounds) are the subject. The end of the module runs a subset of the router's e2e
tests, and the SIGTERM drain test, with ``--grpc-server h2``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import grpc
import hpack
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import generate_latest
from slorouter.v1 import common_pb2, router_pb2, router_pb2_grpc

from router import h2_server
from router.h2_server import CallInfo, H2Server, Method, RpcError
from router.server import check_grpc_server, resolve_grpc_server
from router.vllm_h2 import (
    _DATA,
    _END_HEADERS,
    _END_STREAM,
    _HEADERS,
    _SETTINGS,
    _WINDOW_UPDATE,
    PREFACE,
    _frame,
)
from tests.faults import test_shutdown as _shutdown
from tests.router.e2e import test_router_e2e as _e2e
from tests.router.e2e.cluster import GRPC_SERVER_ENV, embedded_cluster, generate_request

ROUTER = "slorouter.v1.Router"


@pytest.fixture(autouse=True)
def _h2_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clusters this module starts without naming a server use h2 (the e2e tests imported below)."""
    monkeypatch.setenv(GRPC_SERVER_ENV, "h2")


def _generate(address: str, request: router_pb2.GenerateRequest, timeout_s: float = 30.0) -> list[Any]:
    with grpc.insecure_channel(address) as channel:
        return list(router_pb2_grpc.RouterStub(channel).Generate(request, timeout=timeout_s))


def _rpc_error(call: Any) -> grpc.RpcError:
    try:
        call()
    except grpc.RpcError as exc:
        return exc
    raise AssertionError("the call succeeded")


def _metric(cluster: Any, prefix: str) -> float:
    text = generate_latest(cluster.router.observer.registry).decode()
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _until(condition: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        await asyncio.sleep(0.01)
    return bool(condition())


# ---------------------------------------------------------------------- the Router service


@pytest.mark.parametrize("layout", [{"neutral": 1}, {"prefill": 1, "decode": 1}])
async def test_generate_streams_what_the_grpcio_front_streams(layout: dict[str, int]) -> None:
    requests = [generate_request(48 + 16 * i, 20 + i, request_id=f"same-{i}") for i in range(3)]
    seen: dict[str, list[tuple[Any, ...]]] = {}
    for front in ("grpcio", "h2"):
        async with embedded_cluster(**layout, grpc_server=front, seed=5) as cluster:
            assert isinstance(cluster.router.server, H2Server) == (front == "h2")
            out = []
            for request in requests:
                messages = await asyncio.to_thread(_generate, cluster.router.address, request)
                first, last = messages[0], messages[-1]
                out.append(
                    (
                        [t for m in messages for t in m.token_ids],
                        [m.first_token_index for m in messages][:1],
                        last.finished,
                        last.finish_reason,
                        last.usage.prompt_tokens,
                        last.usage.completion_tokens,
                        first.route.prefill_instance_id,
                        first.route.decode_instance_id,
                        {m.request_id for m in messages},
                    )
                )
            seen[front] = out
    assert seen["h2"] == seen["grpcio"]
    assert [len(o[0]) for o in seen["h2"]] == [20, 21, 22]


async def test_schedule_and_its_errors_match_the_grpcio_front() -> None:
    request = generate_request(200, 8, request_id="probe")
    bad = router_pb2.GenerateRequest(
        prompt_token_ids=[1, 2, 3], sampling=common_pb2.SamplingParams(max_tokens=0)
    )
    seen: dict[str, tuple[Any, ...]] = {}
    for front in ("grpcio", "h2"):
        async with embedded_cluster(prefill=1, decode=1, grpc_server=front) as cluster:

            def calls(address: str) -> tuple[Any, ...]:
                with grpc.insecure_channel(address) as channel:
                    stub = router_pb2_grpc.RouterStub(channel)
                    dry = stub.Schedule(router_pb2.ScheduleRequest(request=request, explain=True), timeout=10)
                    error = _rpc_error(
                        lambda: stub.Schedule(router_pb2.ScheduleRequest(request=bad), timeout=10)
                    )
                    return (
                        dry.mode,
                        dry.policy,
                        dry.prefill.instance_id,
                        dry.decode.instance_id,
                        dry.phase,
                        sorted((t.stage, t.instance_id, t.selected) for t in dry.trace),
                        error.code(),  # type: ignore[attr-defined]
                        error.details(),  # type: ignore[attr-defined]
                    )

            seen[front] = await asyncio.to_thread(calls, cluster.router.address)
            assert "probe" not in cluster.router.scheduler.inflight
    assert seen["h2"] == seen["grpcio"]
    assert seen["h2"][0] == "pd" and seen["h2"][6] == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens" in seen["h2"][7]


async def test_health_check_watch_and_reflection() -> None:
    async with embedded_cluster(neutral=1) as cluster:
        address = cluster.router.address

        def check(service: str) -> Any:
            with grpc.insecure_channel(address) as channel:
                return health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=5
                )

        assert (await asyncio.to_thread(check, ROUTER)).status == health_pb2.HealthCheckResponse.SERVING
        assert (await asyncio.to_thread(check, "")).status == health_pb2.HealthCheckResponse.SERVING
        error = await asyncio.to_thread(_rpc_error, lambda: check("no.such.Service"))
        assert error.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]

        channel = cluster.channel
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=ROUTER))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        unknown = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="other"))
        assert (await unknown.read()).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        unknown.cancel()
        await cluster.router.health.enter_graceful_shutdown()
        changed = await asyncio.wait_for(watch.read(), 5)
        assert changed.status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()

        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        names: set[str] = set()
        files = 0
        async for item in reflection.ServerReflectionInfo(
            iter(
                [
                    reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(file_containing_symbol=ROUTER),
                ]
            ),
            timeout=5,
        ):
            names |= {s.name for s in item.list_services_response.service}
            files += len(item.file_descriptor_response.file_descriptor_proto)
        assert {ROUTER, "grpc.health.v1.Health"} <= names
        assert files >= 1


async def test_a_deadline_ends_the_call_and_aborts_on_the_worker() -> None:
    async with embedded_cluster(neutral=1, engine_overrides={"speed_factor": 2.0}) as cluster:
        started = time.monotonic()
        error = await asyncio.to_thread(
            _rpc_error, lambda: _generate(cluster.router.address, generate_request(64, 3000), 0.5)
        )
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
        assert time.monotonic() - started < 10
        engine = cluster.engines["neutral-0"]
        assert await _until(lambda: engine.load().num_running_requests == 0)
        assert await _until(lambda: cluster.router.service.active_requests == 0)
        assert len(cluster.router.scheduler.inflight) == 0
        assert cluster.router.server.open_streams == 0  # type: ignore[union-attr]


async def test_a_client_cancel_reaches_the_worker_and_the_inflight_account() -> None:
    async with embedded_cluster(prefill=1, decode=1, engine_overrides={"speed_factor": 2.0}) as cluster:
        address = cluster.router.address
        reached: dict[str, Any] = {}

        def cancel_after_three_tokens() -> None:
            with grpc.insecure_channel(address) as channel:
                call = router_pb2_grpc.RouterStub(channel).Generate(
                    generate_request(64, 2000, request_id="to-cancel"), timeout=60
                )
                received = 0
                for message in call:
                    received += len(message.token_ids)
                    if received >= 3:
                        break
                # Streaming: the service holds it (the in-flight account may already have handed its
                # load to the workers' statuses, which report it admitted).
                reached["inflight"] = cluster.router.service.active_requests == 1
                call.cancel()
                reached["received"] = received

        await asyncio.to_thread(cancel_after_three_tokens)
        assert reached["inflight"] and reached["received"] >= 3
        decode = cluster.engines["decode-0"]
        assert await _until(lambda: "to-cancel" not in cluster.router.scheduler.inflight)
        assert await _until(
            lambda: decode.load().num_running_requests == 0 and decode.load().num_used_kv_tokens == 0
        )
        assert await _until(lambda: _metric(cluster, 'slo_router_requests_total{outcome="cancelled"}') == 1)
        assert cluster.router.service.active_requests == 0


async def test_an_oversized_request_is_refused_and_the_connection_keeps_serving() -> None:
    async with embedded_cluster(neutral=1) as cluster:
        address = cluster.router.address

        def both() -> tuple[grpc.RpcError, int]:
            with grpc.insecure_channel(address) as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                huge = router_pb2.GenerateRequest(
                    prompt="x" * (9 << 20), sampling=common_pb2.SamplingParams(max_tokens=4)
                )
                error = _rpc_error(lambda: list(stub.Generate(huge, timeout=30)))
                after = list(stub.Generate(generate_request(32, 4), timeout=30))
                return error, sum(len(m.token_ids) for m in after)

        error, tokens = await asyncio.to_thread(both)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
        assert "larger than max" in error.details()  # type: ignore[attr-defined]
        assert tokens == 4


async def test_compressed_requests_are_inflated_within_the_message_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inflated: list[str] = []
    decompress = h2_server._decompress

    def counted(data: bytes, encoding: str, limit: int) -> bytes:
        inflated.append(encoding)
        return decompress(data, encoding, limit)

    monkeypatch.setattr(h2_server, "_decompress", counted)
    async with embedded_cluster(neutral=1) as cluster:
        address = cluster.router.address

        def calls() -> tuple[int, int, grpc.RpcError]:
            with grpc.insecure_channel(address) as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                gzip = list(
                    stub.Generate(generate_request(2000, 5), timeout=30, compression=grpc.Compression.Gzip)
                )
                deflate = list(
                    stub.Generate(generate_request(2000, 6), timeout=30, compression=grpc.Compression.Deflate)
                )
                # 9 MiB of text compresses to a few KiB: refused once inflated past the limit.
                bomb = router_pb2.GenerateRequest(
                    prompt="x" * (9 << 20), sampling=common_pb2.SamplingParams(max_tokens=4)
                )
                error = _rpc_error(
                    lambda: list(stub.Generate(bomb, timeout=30, compression=grpc.Compression.Gzip))
                )
                return sum(len(m.token_ids) for m in gzip), sum(len(m.token_ids) for m in deflate), error

        gzip, deflate, error = await asyncio.to_thread(calls)
        assert (gzip, deflate) == (5, 6)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
        assert "once inflated" in error.details()  # type: ignore[attr-defined]
        assert inflated == ["gzip", "deflate", "gzip"]


async def test_unknown_methods_and_malformed_requests() -> None:
    async with embedded_cluster(neutral=1) as cluster:
        address = cluster.router.address

        def calls() -> list[tuple[Any, str]]:
            with grpc.insecure_channel(address) as channel:
                out = []
                for path in (f"/{ROUTER}/NoSuchMethod", "/no.such.Service/Call"):
                    error = _rpc_error(lambda p=path: channel.unary_unary(p)(b"", timeout=5))  # type: ignore[misc]
                    out.append((error.code(), error.details()))  # type: ignore[attr-defined]
                generate = channel.unary_stream(f"/{ROUTER}/Generate")
                error = _rpc_error(lambda: list(generate(b"\xff\xff\xff\xff", timeout=5)))
                out.append((error.code(), error.details()))  # type: ignore[attr-defined]
                return out

        (m1, d1), (m2, d2), (m3, d3) = await asyncio.to_thread(calls)
        assert m1 == m2 == grpc.StatusCode.UNIMPLEMENTED
        assert "NoSuchMethod" in d1 and "no.such.Service" in d2
        assert m3 == grpc.StatusCode.INVALID_ARGUMENT and "do not parse" in d3


async def test_many_concurrent_streams_past_the_stream_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    # A low limit of concurrent streams per connection: the client queues what is past it; every
    # call completes, and the server never has more open than the limit.
    monkeypatch.setattr(h2_server, "MAX_CONCURRENT_STREAMS", 8)
    async with embedded_cluster(neutral=2) as cluster:
        server = cluster.router.server
        assert isinstance(server, H2Server)
        most = 0
        done = asyncio.Event()

        async def sample() -> None:
            nonlocal most
            while not done.is_set():
                most = max(most, server.open_streams)
                await asyncio.sleep(0.002)

        sampler = asyncio.ensure_future(sample())

        async def one(i: int) -> int:
            call = cluster.stub.Generate(generate_request(32, 6, request_id=f"many-{i}"), timeout=60)
            return sum([len(m.token_ids) async for m in call])

        try:
            async with asyncio.timeout(90):
                counts = await asyncio.gather(*(one(i) for i in range(80)))
        finally:
            done.set()
            await sampler
        assert counts == [6] * 80
        assert 2 <= most <= 8
        assert server.open_streams == 0


async def test_many_concurrent_streams_on_one_connection() -> None:
    async with embedded_cluster(neutral=2) as cluster:

        async def one(i: int) -> int:
            call = cluster.stub.Generate(generate_request(32, 5, request_id=f"burst-{i}"), timeout=60)
            return sum([len(m.token_ids) async for m in call])

        async with asyncio.timeout(90):
            counts = await asyncio.gather(*(one(i) for i in range(300)))
        assert counts == [5] * 300
        assert _metric(cluster, 'slo_router_requests_total{outcome="ok"}') == 300


# ---------------------------------------------------------------------- the server's mechanics

BIG = 64 << 10


class _Big:
    """A streaming test method of large messages, counting what its handler produced."""

    def __init__(self) -> None:
        self.produced = 0
        self.closed = asyncio.Event()

    async def stream(self, request: bytes, call: CallInfo) -> AsyncGenerator[bytes, None]:
        try:
            for _ in range(2000):  # 128 MiB at most: bounded even if flow control failed
                self.produced += 1
                yield bytes(BIG)
        finally:
            self.closed.set()


async def _echo(request: bytes, call: CallInfo) -> bytes:
    if request == b"fail":
        raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, "asked to fail: ünïcode %")
    return request


async def test_a_slow_reader_neither_grows_the_server_nor_stalls_other_streams() -> None:
    big = _Big()
    other = _Big()
    server = H2Server(
        {
            "/t.T/Big": Method(big.stream, streaming=True),
            "/t.T/Other": Method(other.stream, streaming=True),
            "/t.T/Echo": Method(_echo, streaming=False),
        },
        max_message_bytes=1 << 20,
    )
    port = await server.start("127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            slow = channel.unary_stream("/t.T/Big")(b"", timeout=60)
            assert len(await slow.read()) == BIG
            # The reader stops reading: the handler soon stops being asked for messages.
            await asyncio.sleep(0.5)
            stalled = big.produced
            await asyncio.sleep(0.5)
            assert big.produced == stalled < 2000
            (conn,) = server._connections
            (stream,) = conn.streams.values()
            assert stream.pending_bytes <= h2_server.STREAM_BUFFER_BYTES + BIG + 5
            assert conn.transport is not None
            assert conn.transport.get_write_buffer_size() <= h2_server.WRITE_HIGH_WATER + BIG + 64
            # Other calls on the same connection go on: a unary one, and a stream read to its end.
            assert await channel.unary_unary("/t.T/Echo")(b"ping", timeout=5) == b"ping"
            async with asyncio.timeout(30):
                read = [m async for m in channel.unary_stream("/t.T/Other")(b"", timeout=30)]
            assert len(read) == 2000 and other.closed.is_set()
            # The stalled stream was never cut: it reads on from where it stopped.
            more = [await slow.read() for _ in range(50)]
            assert all(len(m) == BIG for m in more)
            # The client's cancel ends the stalled handler.
            slow.cancel()
            await asyncio.wait_for(big.closed.wait(), 5)
            assert await _until(lambda: server.open_streams == 0, 5)
    finally:
        await server.stop(0)


async def test_a_handler_error_is_the_calls_status() -> None:
    server = H2Server({"/t.T/Echo": Method(_echo, streaming=False)}, max_message_bytes=1 << 20)
    port = await server.start("127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await channel.unary_unary("/t.T/Echo")(b"fail", timeout=5)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert info.value.details() == "asked to fail: ünïcode %"
            assert await channel.unary_unary("/t.T/Echo")(b"", timeout=5) == b""
    finally:
        await server.stop(0)


async def test_stop_sends_goaway_and_ends_running_calls_unavailable() -> None:
    big = _Big()
    server = H2Server({"/t.T/Big": Method(big.stream, streaming=True)}, max_message_bytes=1 << 20)
    port = await server.start("127.0.0.1:0")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream("/t.T/Big")(b"", timeout=30)
        await call.read()
        await server.stop(0.2)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            while await call.read() is not grpc.aio.EOF:
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert big.closed.is_set()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await channel.unary_stream("/t.T/Big")(b"", timeout=2).read()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_drain_refuses_new_calls_and_ends_running_streams_unavailable() -> None:
    async with embedded_cluster(neutral=1, engine_overrides={"speed_factor": 2.0}) as cluster:
        calls = [
            cluster.stub.Generate(generate_request(64, 3000, request_id=f"long-{i}"), timeout=60)
            for i in range(2)
        ]
        for call in calls:
            assert (await call.read()).token_ids
        stopping = asyncio.ensure_future(cluster.router.stop(grace=1.0, drain_timeout_s=0.8))
        health = health_pb2_grpc.HealthStub(cluster.channel)
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
        async with asyncio.timeout(5):  # the drain has begun once health says so
            async for answer in watch:
                if answer.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
        watch.cancel()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await cluster.stub.Generate(generate_request(16, 2), timeout=5).read()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                while await call.read() is not grpc.aio.EOF:
                    pass
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "--drain-timeout-s" in (ended.value.details() or "")
        await asyncio.wait_for(stopping, 20)


def test_h2_refuses_tls_and_auto_picks_grpcio_for_it() -> None:
    assert resolve_grpc_server("auto", tls=False) == "h2"
    assert resolve_grpc_server("auto", tls=True) == "grpcio"
    assert resolve_grpc_server("grpcio", tls=False) == "grpcio"
    check_grpc_server("auto", tls=True)
    check_grpc_server("h2", tls=False)
    with pytest.raises(ValueError, match="--grpc-server h2 serves cleartext"):
        check_grpc_server("h2", tls=True)
    with pytest.raises(ValueError, match="--grpc-server 'h3'"):
        check_grpc_server("h3", tls=False)


def test_grpc_timeout_parsing() -> None:
    assert h2_server.parse_timeout("250m") == pytest.approx(0.25)
    assert h2_server.parse_timeout("2S") == 2.0
    assert h2_server.parse_timeout("1H") == 3600.0
    assert h2_server.parse_timeout("123456789m") is None  # 9 digits
    assert h2_server.parse_timeout("10x") is None
    assert h2_server.parse_timeout("m") is None


# ---------------------------------------------------------------------- existing tests, over h2

test_e2e_pd_concurrent_generate_all_complete = _e2e.test_pd_concurrent_generate_all_complete
test_e2e_pd_tokens_match_a_neutral_generate = _e2e.test_pd_tokens_match_a_neutral_generate
test_e2e_text_prompt_is_tokenized_by_the_router = _e2e.test_text_prompt_is_tokenized_by_the_router
test_e2e_schedule_matches_generate_decision = _e2e.test_schedule_matches_generate_decision
test_e2e_killing_a_decode_worker_mid_stream = (
    _e2e.test_killing_a_decode_worker_mid_stream_loses_and_duplicates_nothing
)
test_e2e_client_cancel_aborts_on_the_workers = _e2e.test_client_cancel_aborts_on_the_workers
test_e2e_deadline_aborts_on_the_workers = _e2e.test_deadline_aborts_on_the_workers
test_e2e_invalid_requests_are_refused = _e2e.test_invalid_requests_are_refused_and_the_router_keeps_serving
test_e2e_duplicate_in_flight_request_id_is_refused = _e2e.test_duplicate_in_flight_request_id_is_refused
test_e2e_empty_fleet_is_unavailable = _e2e.test_empty_fleet_is_unavailable


def test_sigterm_under_load_drains_with_h2(tmp_path: Path) -> None:
    """``slo-router up --grpc-server h2`` (the module's fixture sets the variable ``up_cluster`` reads):
    the SIGTERM drain test as it runs for grpcio."""
    _shutdown.test_sigterm_under_load_drains_and_ends_every_stream_cleanly(tmp_path)


class _Trailers:
    """The ``grpc-status`` of each stream a raw HTTP/2 connection's server answers, as frames arrive."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader
        self.decoder = hpack.Decoder()
        self.buf = b""
        self.statuses: dict[int, str] = {}

    async def until(self, done: Any, timeout_s: float = 10.0) -> dict[int, str]:
        """Read frames until ``done(statuses)`` holds (bounded in time); the statuses so far."""
        async with asyncio.timeout(timeout_s):
            while not done(self.statuses):
                data = await self.reader.read(65536)
                assert data, f"the server closed the connection: {self.statuses}"
                self.buf += data
                while len(self.buf) >= 9 and len(self.buf) >= 9 + int.from_bytes(self.buf[:3], "big"):
                    length, kind, sid = self.buf[:3], self.buf[3], int.from_bytes(self.buf[5:9], "big")
                    size = int.from_bytes(length, "big")
                    payload, self.buf = self.buf[9 : 9 + size], self.buf[9 + size :]
                    if kind == _HEADERS:
                        fields = dict(self.decoder.decode(payload))
                        if "grpc-status" in fields:
                            self.statuses[sid] = fields["grpc-status"]
        return self.statuses


async def test_a_connection_holding_too_many_unfinished_requests_is_refused_stream_by_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Streams whose requests never end hold at most the connection's bound: the stream that would
    pass it is refused RESOURCE_EXHAUSTED, the ones within it are left alone and still served."""
    monkeypatch.setattr(h2_server, "MAX_HELD_REQUEST_BYTES", 1 << 20)
    server = H2Server({"/t.T/Echo": Method(_echo, streaming=False)}, max_message_bytes=256 << 10)
    port = await server.start("127.0.0.1:0")
    encoder = hpack.Encoder()
    chunk = 200 << 10  # each stream declares a 210 KiB message and sends 200 KiB of it
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        # Windows wide enough for the echoed answer: this client never sends WINDOW_UPDATE.
        window = (4).to_bytes(2, "big") + (4 << 20).to_bytes(4, "big")
        out = [
            PREFACE,
            _frame(_SETTINGS, 0, 0, window),
            _frame(_WINDOW_UPDATE, 0, 0, (4 << 20).to_bytes(4, "big")),
        ]
        for sid in range(1, 20, 2):  # ten streams: 2,000 KiB against a bound of 1,024 KiB
            headers = [(":method", "POST"), (":scheme", "http"), (":path", "/t.T/Echo"),
                       (":authority", "localhost"), ("content-type", "application/grpc"), ("te", "trailers")]  # fmt: skip
            out.append(_frame(_HEADERS, _END_HEADERS, sid, encoder.encode(headers)))
            body = b"\0" + (210 << 10).to_bytes(4, "big") + b"x" * chunk
            for i in range(0, len(body), 16384):
                out.append(_frame(_DATA, 0, sid, body[i : i + 16384]))
        writer.write(b"".join(out))
        await writer.drain()
        (conn,) = server._connections
        assert await _until(lambda: sum(len(s.body) for s in conn.streams.values()) > 0, 5)
        trailers = _Trailers(reader)
        statuses = await trailers.until(lambda got: len(got) >= 5)
        held = sum(len(s.body) for s in conn.streams.values())
        assert held <= 1 << 20, held
        # The first five fit (5 x 205 KiB); every later one was refused, and none of the first.
        assert set(statuses) == set(range(11, 20, 2)), statuses
        assert set(statuses.values()) == {str(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])}
        # A stream within the bound is still served: its request ends (10 KiB more), its answer comes.
        writer.write(_frame(_DATA, _END_STREAM, 1, b"x" * (10 << 10)))  # within one frame of the default size
        await writer.drain()
        statuses = await trailers.until(lambda got: 1 in got)
        assert statuses[1] == "0"
        writer.close()
    finally:
        await server.stop(0)
