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


async def test_commands_batched_in_one_message_apply_in_order(start_worker: StartWorker) -> None:
    server = await start_worker()
    watcher = LoadWatcher(server.engine)
    async with Client(server.address) as client:
        call = client.stub.Streams()
        hello = await call.read()
        assert hello.accepts_batched_commands
        # A message carrying its own command and more; the leg started third is aborted
        # by a later command of the same message, before it produced anything.
        message = start(1, "b1", 16, 5)
        message.batched.extend(
            [
                start(2, "b2", 24, 7),
                start(3, "b3", 24, 3000),
                worker_pb2.StreamCommand(stream_id=3, abort=worker_pb2.AbortRequest(request_id="b3")),
            ]
        )
        await call.write(message)
        # A message with no command of its own, only batched ones (its stream id means nothing).
        await call.write(worker_pb2.StreamCommand(batched=[start(4, "b4", 8, 2), start(5, "b5", 8, 3)]))
        legs = Legs()
        await read_until(call, legs, {1, 2, 4, 5})
        await watcher.until(lambda: not server.engine.core.has_unfinished)
        call.cancel()
    assert legs.errors == {}
    assert {sid: len(legs.tokens[sid]) for sid in (1, 2, 4, 5)} == {1: 5, 2: 7, 4: 2, 5: 3}
    assert legs.prompt_tokens == {1: 16, 2: 24, 4: 8, 5: 8}
    assert 3 not in legs.tokens and 3 not in legs.errors  # aborted: no update follows
    assert server.engine.load().num_used_kv_tokens == 0


async def test_a_message_beyond_the_batch_bounds_starts_no_leg(start_worker: StartWorker) -> None:
    server = await start_worker()
    watcher = LoadWatcher(server.engine)
    async with Client(server.address) as client:
        call = client.stub.Streams()
        await call.read()
        nested = start(2, "n2", 8, 4)
        nested.batched.append(start(3, "n3", 8, 4))
        await call.write(worker_pb2.StreamCommand(batched=[start(1, "n1", 8, 4), nested]))
        n = limits.MAX_STREAM_BATCHED_COMMANDS + 1
        await call.write(worker_pb2.StreamCommand(batched=[start(10 + i, f"m{i}", 4, 2) for i in range(n)]))
        await call.write(start(1000, "after", 8, 4))  # the stream still serves
        legs = Legs()
        sids = {1, 2} | {10 + i for i in range(n)} | {1000}
        await read_until(call, legs, sids)
        await watcher.until(lambda: not server.engine.core.has_unfinished)
        call.cancel()
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert set(legs.errors) == sids - {1000}
    assert all(code == invalid and "batched" in details for code, details in legs.errors.values())
    assert "nest" in legs.errors[1][1] and str(limits.MAX_STREAM_BATCHED_COMMANDS) in legs.errors[10][1]
    assert 3 not in legs.errors and len(legs.tokens[1000]) == 4
    assert not any(legs.tokens.get(sid) for sid in sids - {1000})


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
