"""The relay pacing of vLLM legs (router.legs.paced_batches) over a real gRPC server stream.

A loopback gRPC server streams byte messages on a schedule the test sets (like vLLM's
``Generate``: one message per token per engine step); the client reads the call through
:func:`paced_batches`. Checked: nothing lost, reordered or duplicated; at most one batch per
interval while the stream runs; the end of the stream is not held back; messages that arrived
before an upstream failure come before the error; a shared :class:`RelayPacer` stretches the
interval with the number of streams it paces, within its bounds.
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
from hypothesis import given
from hypothesis import strategies as st

from router.legs import MAX_RELAY_HOLD_S, RelayPacer, paced_batches

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


async def _drain(call: Any, interval_s: float | RelayPacer) -> tuple[list[list[bytes]], list[float]]:
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


def test_the_pacer_stretches_the_interval_with_the_streams_it_paces() -> None:
    pacer = RelayPacer(0.005, 2000)
    held = []
    for active in (0, 1, 10, 16, 64, 100, 10_000):
        pacer.active = active
        held.append(pacer.interval_s())
    # A few streams keep the short interval; many share the budget; no token waits past the bound.
    assert held == pytest.approx([0.005, 0.005, 0.005, 0.008, 0.032, MAX_RELAY_HOLD_S, MAX_RELAY_HOLD_S])
    fixed = RelayPacer(0.005, 0)
    fixed.active = 500
    assert fixed.interval_s() == 0.005
    off = RelayPacer(0.0, 2000)
    off.active = 500
    assert off.interval_s() == 0.0


@given(
    st.floats(0, 0.1),
    st.floats(0, 1e6),
    st.lists(st.integers(0, 100_000), min_size=2, max_size=8),
)
def test_the_pacers_interval_is_bounded_and_grows_with_the_streams(
    minimum: float, budget: float, counts: list[int]
) -> None:
    pacer = RelayPacer(minimum, budget)
    held = []
    for active in sorted(counts):
        pacer.active = active
        held.append(pacer.interval_s())
    assert all(h == minimum for h in held) if minimum == 0 or budget == 0 else True
    assert all(minimum <= h <= max(minimum, MAX_RELAY_HOLD_S) for h in held)
    assert held == sorted(held)


@pytest.mark.parametrize("bad", [(-0.001, 10.0), (0.005, -1.0), (float("nan"), 1.0), (0.005, float("inf"))])
def test_the_pacer_refuses_a_negative_or_unbounded_setting(bad: tuple[float, float]) -> None:
    with pytest.raises(ValueError, match=r"min_interval_s|messages_per_s"):
        RelayPacer(*bad)


async def test_streams_sharing_a_budget_send_fewer_messages_each(channel: grpc.aio.Channel) -> None:
    # 20 streams of 40 messages 10 ms apart on one pacer (5 ms, 400 messages/s), which holds each
    # stream's tokens 50 ms (20 / 400 s, the bound), beside 20 streams on a fixed 5 ms interval at
    # the same time (same server, same host load): the fixed ones send about one batch per message
    # (they come further apart than the interval), the budgeted ones about one per 50 ms.
    # Nothing is lost or reordered, and the pacer counts no stream once they ended.
    shared = RelayPacer(0.005, 400)
    fixed = RelayPacer(0.005, 0)
    results = await asyncio.gather(
        *(_drain(_call(channel, 40, 10), shared) for _ in range(20)),
        *(_drain(_call(channel, 40, 10), fixed) for _ in range(20)),
    )
    for batches, _ in results:
        assert [m for b in batches for m in b] == [str(i).encode() for i in range(40)]
    budgeted = sum(len(batches) for batches, _ in results[:20])
    spaced = sum(len(batches) for batches, _ in results[20:])
    assert budgeted < spaced / 2, (budgeted, spaced)
    assert shared.active == 0


async def test_a_consumer_that_leaves_is_no_longer_counted_by_the_pacer(channel: grpc.aio.Channel) -> None:
    pacer = RelayPacer(0.005, 100)
    call = _call(channel, 1000, 5)
    async with contextlib.aclosing(paced_batches(call, pacer)) as stream:
        async for _ in stream:
            assert pacer.active == 1
            break
    assert pacer.active == 0
    call.cancel()
