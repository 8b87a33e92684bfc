"""The relay pacing of vLLM legs (router.legs.paced_batches) over a real gRPC server stream.

A loopback gRPC server streams byte messages on a schedule the test sets (like vLLM's
``Generate``: one message per token per engine step); the client reads the call through
:func:`paced_batches`. Checked: nothing lost, reordered or duplicated; at most one batch per
interval while the stream runs; the end of the stream is not held back; messages that arrived
before an upstream failure come before the error.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from router.legs import paced_batches

_METHOD = "/test.Paced/Stream"


async def _schedule(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> AsyncIterator[bytes]:
    """Request ``count,gap_ms,fail``: ``count`` messages ``gap_ms`` apart, then end (or fail)."""
    count, gap_ms, fail = (int(x) for x in request.decode().split(","))
    for i in range(count):
        if i:
            await asyncio.sleep(gap_ms / 1e3)
        yield str(i).encode()
    if fail:
        await context.abort(grpc.StatusCode.UNAVAILABLE, "engine went away")


@pytest.fixture
async def channel() -> AsyncIterator[grpc.aio.Channel]:
    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "test.Paced", {"Stream": grpc.unary_stream_rpc_method_handler(_schedule)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        yield ch
    await server.stop(None)


def _call(channel: grpc.aio.Channel, count: int, gap_ms: int, fail: bool = False) -> Any:
    stub = channel.unary_stream(_METHOD, request_serializer=None, response_deserializer=None)
    return stub(f"{count},{gap_ms},{int(fail)}".encode(), timeout=30)


async def _drain(call: Any, interval_s: float) -> tuple[list[list[bytes]], list[float]]:
    batches: list[list[bytes]] = []
    taken: list[float] = []
    async with contextlib.aclosing(paced_batches(call, interval_s)) as stream:
        async for batch in stream:
            batches.append(batch)
            taken.append(time.monotonic())
    return batches, taken


async def test_a_paced_stream_delivers_every_message_in_order_at_most_once_per_interval(
    channel: grpc.aio.Channel,
) -> None:
    interval = 0.05
    batches, taken = await _drain(_call(channel, 40, 5), interval)
    assert [m for b in batches for m in b] == [str(i).encode() for i in range(40)]
    # 40 messages over ~0.2 s: without pacing about one batch each; paced, a handful.
    assert len(batches) <= 12, [len(b) for b in batches]
    # Every batch but the last (the end of the stream flushes at once) waited out the interval.
    gaps = [b - a for a, b in itertools.pairwise(taken[:-1])]
    assert all(g >= interval * 0.9 for g in gaps), gaps


async def test_interval_zero_relays_each_message_when_the_consumer_keeps_up(
    channel: grpc.aio.Channel,
) -> None:
    batches, _ = await _drain(_call(channel, 10, 20), 0.0)
    assert [m for b in batches for m in b] == [str(i).encode() for i in range(10)]
    assert len(batches) >= 8  # messages 20 ms apart, nothing to wait for


async def test_the_end_of_the_stream_is_not_held_back(channel: grpc.aio.Channel) -> None:
    # A 5 s interval, two messages and the end 10 ms later: the second batch goes out with the
    # end of the stream, not after the interval (a generous bound: it is a liveness property).
    started = time.monotonic()
    batches, _ = await _drain(_call(channel, 2, 10), 5.0)
    assert [m for b in batches for m in b] == [b"0", b"1"]
    assert time.monotonic() - started < 2.5


async def test_messages_before_an_upstream_failure_come_before_its_error(channel: grpc.aio.Channel) -> None:
    got: list[bytes] = []
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        async with contextlib.aclosing(paced_batches(_call(channel, 5, 5, fail=True), 1.0)) as stream:
            async for batch in stream:
                got.extend(batch)
    assert failure.value.code() is grpc.StatusCode.UNAVAILABLE
    assert got == [str(i).encode() for i in range(5)]


async def test_a_consumer_that_leaves_stops_the_reader(channel: grpc.aio.Channel) -> None:
    call = _call(channel, 1000, 5)
    async with contextlib.aclosing(paced_batches(call, 0.02)) as stream:
        async for _ in stream:
            break
    # The reader task was cancelled with the generator: no task is left reading the call.
    await asyncio.sleep(0)
    readers = [t for t in asyncio.all_tasks() if "pump" in repr(t.get_coro())]
    assert readers == []
    call.cancel()
