"""``Worker.Streams``: many legs on one stream, one batch per flush (real server, sim engine)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from slorouter.v1 import worker_pb2

from cms import limits
from workers.service import WorkerServer

from .conftest import StartWorker
from .helpers import Client, LoadWatcher, generate_request, prompt

_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]


class Legs:
    """What a Streams call delivered, per stream id."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.finish: dict[int, str] = {}
        self.errors: dict[int, tuple[int, str]] = {}
        self.prompt_tokens: dict[int, int] = {}
        self.batches: list[int] = []  # updates per batch

    def take(self, batch: worker_pb2.StreamBatch) -> None:
        self.batches.append(len(batch.updates))
        seen: set[int] = set()
        for update in batch.updates:
            assert update.stream_id not in seen, "two updates of one leg in one batch"
            seen.add(update.stream_id)
            if update.error_code:
                self.errors[update.stream_id] = (update.error_code, update.error_details)
                continue
            self.tokens.setdefault(update.stream_id, []).extend(update.token_ids)
            if update.num_prompt_tokens:
                self.prompt_tokens[update.stream_id] = update.num_prompt_tokens
            if update.finished:
                self.finish[update.stream_id] = update.finish_reason

    def ended(self) -> set[int]:
        return set(self.finish) | set(self.errors)


async def read_until(call: Any, legs: Legs, sids: set[int], timeout_s: float = 20.0) -> None:
    async def loop() -> None:
        while not sids <= legs.ended():
            batch = await call.read()
            assert batch is not _EOF
            legs.take(batch)

    await asyncio.wait_for(loop(), timeout_s)


def start(sid: int, rid: str, n_prompt: int, max_tokens: int) -> worker_pb2.StreamCommand:
    return worker_pb2.StreamCommand(
        stream_id=sid, generate=generate_request(rid, prompt(n_prompt), max_tokens)
    )


async def test_many_legs_get_exactly_max_tokens_in_shared_batches(start_worker: StartWorker) -> None:
    server = await start_worker()
    async with Client(server.address) as client:
        call = client.stub.Streams()
        hello = await call.read()
        assert len(hello.updates) == 0  # the worker serves Streams
        for i in range(12):
            await call.write(start(i + 1, f"r{i}", 32 + i, 20 + i))
        legs = Legs()
        await read_until(call, legs, set(range(1, 13)))
        await call.done_writing()
        assert await call.read() is _EOF  # every leg ended and the client is done: the call ends
    assert legs.errors == {}
    for i in range(12):
        assert len(legs.tokens[i + 1]) == 20 + i and legs.finish[i + 1] == "length"
        assert legs.prompt_tokens[i + 1] == 32 + i
    # One batch carries the tokens of every leg of an engine step: far fewer batches than updates.
    assert max(legs.batches) > 1
    assert len(legs.batches) < sum(legs.batches)


async def test_abort_command_and_closing_the_call_abort_on_the_engine(start_worker: StartWorker) -> None:
    server = await start_worker()
    watcher = LoadWatcher(server.engine)
    async with Client(server.address) as client:
        call = client.stub.Streams()
        await call.read()
        await call.write(start(1, "long-a", 100, 3000))
        await call.write(start(2, "long-b", 100, 3000))
        await watcher.until(lambda: server.engine.load().num_decode_requests == 2)
        await call.write(
            worker_pb2.StreamCommand(stream_id=1, abort=worker_pb2.AbortRequest(request_id="long-a"))
        )
        await watcher.until(lambda: server.engine.load().num_running_requests == 1)
        call.cancel()  # the router went away: its legs must not keep running
        await watcher.until(lambda: not server.engine.core.has_unfinished)
    assert server.engine.load().num_used_kv_tokens == 0


async def test_bad_commands_fail_their_leg_only(start_worker: StartWorker) -> None:
    server = await start_worker()
    async with Client(server.address) as client:
        call = client.stub.Streams()
        await call.read()
        await call.write(worker_pb2.StreamCommand(stream_id=1))  # carries nothing
        too_long = "x" * (limits.MAX_ID_BYTES + 1)
        await call.write(start(2, too_long, 8, 4))
        await call.write(start(3, "ok", 8, 4))
        await call.write(start(3, "again", 8, 400))  # stream id 3 may still be running
        await call.write(start(4, "empty", 0, 4))
        legs = Legs()
        await read_until(call, legs, {1, 2, 3, 4})
        call.cancel()
    codes = {sid: grpc.StatusCode.INVALID_ARGUMENT.value[0] for sid in (1, 2, 4)}
    assert {sid: code for sid, (code, _) in legs.errors.items() if sid != 3} == codes
    assert "command" in legs.errors[1][1]
    assert "generate.request_id" in legs.errors[2][1]
    assert "prompt" in legs.errors[4][1]
    # Stream id 3 either ran to its end or was refused as a duplicate while running; never both mixed up.
    if 3 in legs.errors:
        assert legs.errors[3][0] == grpc.StatusCode.ALREADY_EXISTS.value[0]
        assert len(legs.tokens.get(3, [])) in (0, 4)
    else:
        assert len(legs.tokens[3]) == 4


async def test_stopping_the_worker_ends_the_call(start_worker: StartWorker) -> None:
    server: WorkerServer = await start_worker()
    async with Client(server.address) as client:
        call = client.stub.Streams()
        await call.read()
        await call.write(start(1, "long", 100, 3000))
        first = await call.read()
        assert first.updates[0].stream_id == 1
        await server.stop(grace=0)
        try:
            while await call.read() is not _EOF:
                pass
        except grpc.aio.AioRpcError as exc:
            assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
