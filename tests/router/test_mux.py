"""The router's legs on ``Worker.Streams`` (``--worker-streams mux``) against real sim workers.

Real gRPC servers on loopback: the worker servicer is the real one, wrapped to count the
RPCs it serves; an "old" worker answers ``Streams`` with UNIMPLEMENTED as a worker built
before the RPC existed does.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from slorouter.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from router.core.health import OutlierConfig, OutlierDetector
from router.forward import LegError, WorkerClient
from router.legs import LegLedger
from router.pool import ChannelPool
from tests.workers.helpers import LoadWatcher, make_engine, prompt
from workers.metadata import WorkerIdentity, build_metadata
from workers.service import WorkerServicer
from workers.sim_engine import SimEngine


@dataclass(frozen=True)
class _Target:
    instance_id: str
    endpoint: str


class _CountingContext:
    """A Streams call's server context that counts the messages it reads (and can hide batching)."""

    def __init__(self, context: Any, servicer: CountingServicer) -> None:
        self._context = context
        self._servicer = servicer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def read(self) -> Any:
        message = await self._context.read()
        if isinstance(message, worker_pb2.StreamCommand):
            self._servicer.messages.append(len(message.batched) + (message.WhichOneof("command") is not None))
        return message

    async def write(self, batch: worker_pb2.StreamBatch) -> None:
        if self._servicer.unbatched:
            batch.accepts_batched_commands = False  # as a worker from before batched commands
        await self._context.write(batch)


class CountingServicer(WorkerServicer):
    """The real servicer, counting the streaming RPCs it serves (``old``: no Streams, as before it existed).

    ``messages``: the commands each Streams message carried; ``unbatched``: the worker does not
    offer batched commands (as one built before they existed).
    """

    def __init__(self, *args: Any, old: bool = False, unbatched: bool = False) -> None:
        super().__init__(*args)
        self.calls: collections.Counter[str] = collections.Counter()
        self.old = old
        self.unbatched = unbatched
        self.messages: list[int] = []

    async def Generate(self, request: Any, context: Any) -> None:  # type: ignore[override]
        self.calls["Generate"] += 1
        await super().Generate(request, context)

    async def Streams(self, request_iterator: Any, context: Any) -> None:  # type: ignore[override]
        self.calls["Streams"] += 1
        if self.old:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        await super().Streams(request_iterator, _CountingContext(context, self))


class HungStreams(worker_pb2_grpc.WorkerServicer):
    """Accepts Streams calls and never answers (a hung worker)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def Streams(self, request_iterator: Any, context: Any) -> None:  # type: ignore[override]
        await self.release.wait()


@dataclass
class Worker:
    engine: SimEngine
    servicer: CountingServicer
    server: grpc.aio.Server
    target: _Target
    watcher: LoadWatcher


async def _worker(*, old: bool = False, unbatched: bool = False, **engine_overrides: Any) -> Worker:
    engine = make_engine(**engine_overrides)
    await engine.start()
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    metadata = build_metadata(engine.info, WorkerIdentity(instance_id="w"), f"127.0.0.1:{port}")
    servicer = CountingServicer(engine, metadata, old=old, unbatched=unbatched)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    await server.start()
    return Worker(engine, servicer, server, _Target("w", f"127.0.0.1:{port}"), LoadWatcher(engine))


async def _stop(worker: Worker) -> None:
    await worker.server.stop(0)
    await worker.engine.stop()


def _generate(rid: str, max_tokens: int, n_prompt: int = 64) -> worker_pb2.WorkerGenerateRequest:
    return worker_pb2.WorkerGenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt(n_prompt),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


async def _tokens(stream: AsyncIterator[worker_pb2.WorkerTokens]) -> tuple[list[int], str, int]:
    tokens: list[int] = []
    reason = ""
    messages = 0
    async for message in stream:
        messages += 1
        tokens.extend(message.token_ids)
        if message.finished:
            reason = message.finish_reason
    return tokens, reason, messages


@pytest.fixture
async def pool() -> AsyncIterator[ChannelPool]:
    pool = ChannelPool()
    yield pool
    await pool.close()


@pytest.mark.parametrize("streams", ["mux", "per-request"])
async def test_legs_get_exactly_max_tokens_on_one_call_per_connection(
    pool: ChannelPool, streams: str
) -> None:
    worker = await _worker()
    client = WorkerClient(pool, streams=streams)
    try:
        results = await asyncio.gather(
            *(
                _tokens(client.stream(worker.target, _generate(f"r{i}", 10 + i), 30.0, LegLedger()))
                for i in range(16)
            )
        )
        for i, (tokens, reason, _) in enumerate(results):
            assert len(tokens) == 10 + i and reason == "length"
        if streams == "mux":
            assert worker.servicer.calls == {"Streams": 1}
        else:
            assert worker.servicer.calls == {"Generate": 16}
    finally:
        await client.close()
        await _stop(worker)


@pytest.mark.parametrize("unbatched", [False, True])
async def test_legs_started_together_go_out_in_one_message_when_the_worker_offers_it(
    pool: ChannelPool, unbatched: bool
) -> None:
    worker = await _worker(unbatched=unbatched)
    client = WorkerClient(pool)
    try:
        tokens, _, _ = await _tokens(client.stream(worker.target, _generate("first", 3), 30.0, LegLedger()))
        assert len(tokens) == 3 and worker.servicer.messages == [1]
        # Sixteen legs started in one loop iteration (a burst of requests).
        results = await asyncio.gather(
            *(
                _tokens(client.stream(worker.target, _generate(f"b{i}", 5 + i), 30.0, LegLedger()))
                for i in range(16)
            )
        )
        assert [len(tokens) for tokens, _, _ in results] == [5 + i for i in range(16)]
        if unbatched:  # one command per message, as before
            assert worker.servicer.messages == [1] * 17
        else:
            assert worker.servicer.messages == [1, 16]
        assert worker.servicer.calls == {"Streams": 1}
    finally:
        await client.close()
        await _stop(worker)


async def test_a_worker_without_streams_is_asked_once_then_served_per_request(pool: ChannelPool) -> None:
    worker = await _worker(old=True)
    client = WorkerClient(pool, streams="mux")
    try:
        for i in range(3):
            tokens, reason, _ = await _tokens(
                client.stream(worker.target, _generate(f"o{i}", 5), 30.0, LegLedger())
            )
            assert len(tokens) == 5 and reason == "length"
        assert worker.servicer.calls == {"Streams": 1, "Generate": 3}
    finally:
        await client.close()
        await _stop(worker)


async def test_a_consumer_that_leaves_early_aborts_its_leg_on_the_worker(pool: ChannelPool) -> None:
    worker = await _worker()
    client = WorkerClient(pool)
    try:
        stream = client.stream(worker.target, _generate("leave", 3000), 30.0, LegLedger())
        await anext(stream)
        await anext(stream)
        await stream.aclose()  # the client went away
        await worker.watcher.until(lambda: not worker.engine.core.has_unfinished)
        # The connection stays up for the next leg.
        tokens, _, _ = await _tokens(client.stream(worker.target, _generate("next", 7), 30.0, LegLedger()))
        assert len(tokens) == 7 and worker.servicer.calls == {"Streams": 1}
    finally:
        await client.close()
        await _stop(worker)


async def test_a_leg_past_its_deadline_fails_and_is_aborted(pool: ChannelPool) -> None:
    worker = await _worker(speed_factor=1.0)
    client = WorkerClient(pool)
    try:
        with pytest.raises(LegError) as info:
            await _tokens(client.stream(worker.target, _generate("slow", 3000), 0.5, LegLedger()))
        assert info.value.code is grpc.StatusCode.DEADLINE_EXCEEDED and info.value.retryable
        await worker.watcher.until(lambda: not worker.engine.core.has_unfinished)
    finally:
        await client.close()
        await _stop(worker)


async def test_a_worker_stopped_mid_stream_fails_every_leg_retryably(pool: ChannelPool) -> None:
    worker = await _worker(speed_factor=1.0)
    health = OutlierDetector(OutlierConfig(consecutive_failures=6))
    client = WorkerClient(pool, health=health)
    got_first = asyncio.Event()
    firsts = 0

    async def leg(i: int) -> LegError | None:
        nonlocal firsts
        first = True
        try:
            async for _ in client.stream(worker.target, _generate(f"k{i}", 3000), 30.0, LegLedger()):
                if first:
                    first = False
                    firsts += 1
                    if firsts == 6:
                        got_first.set()
        except LegError as exc:
            return exc
        return None

    legs = [asyncio.create_task(leg(i)) for i in range(6)]
    try:
        await asyncio.wait_for(got_first.wait(), 20)
        await worker.server.stop(0)  # as a killed worker: every stream on the connection breaks
        errors = await asyncio.wait_for(asyncio.gather(*legs), 20)
        for error in errors:
            assert error is not None and error.retryable, error
            assert error.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), error
        # Each request's failure is evidence against the instance, as with one call per request.
        assert health.ejections_total == 1
    finally:
        for task in legs:
            task.cancel()
        await client.close()
        await worker.engine.stop()


async def test_a_hung_worker_costs_one_first_message_deadline(pool: ChannelPool) -> None:
    servicer = HungStreams()
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = WorkerClient(pool, first_message_timeout_s=0.3)
    try:
        with pytest.raises(LegError) as info:
            await _tokens(
                client.stream(_Target("h", f"127.0.0.1:{port}"), _generate("h", 4), 30.0, LegLedger())
            )
        assert info.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
        assert "--worker-first-message-timeout-s" in info.value.details
    finally:
        servicer.release.set()
        await client.close()
        await server.stop(0)


async def test_a_slow_consumer_gets_merged_messages_not_a_queue(pool: ChannelPool) -> None:
    worker = await _worker()
    client = WorkerClient(pool)
    try:
        stream = client.stream(worker.target, _generate("slow-reader", 200), 30.0, LegLedger())
        first = await anext(stream)
        # Do not read while the worker produces the rest: the leg merges it.
        await worker.watcher.until(lambda: not worker.engine.core.has_unfinished, timeout_s=20)
        tokens, reason, messages = await _tokens(stream)
        assert len(first.token_ids) + len(tokens) == 200 and reason == "length"
        # Without merging this would be one message per step (about 199); the leg hands over what
        # arrived while nobody read as one message, plus the few batches still on the wire.
        assert messages <= 5
    finally:
        await client.close()
        await _stop(worker)


def test_the_mode_is_checked() -> None:
    with pytest.raises(ValueError, match="streams must be one of mux, per-request"):
        WorkerClient(ChannelPool(), streams="batched")
