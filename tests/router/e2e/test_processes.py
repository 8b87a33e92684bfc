"""``slo-router router --processes 2``: two router processes on one port, real processes on loopback."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import grpc
from slorouter.v1 import common_pb2, router_pb2, router_pb2_grpc

from tests.faults.fleet import Fleet, wait_until_serving

CHANNELS = 16
PER_CHANNEL = 3
MAX_TOKENS = 8


async def _one(stub: router_pb2_grpc.RouterAsyncStub, request_id: str) -> tuple[str, list[int], int, str]:
    """(process label, tokens, first_token_index gaps, status name) of one Generate."""
    call = stub.Generate(
        router_pb2.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=list(range(1, 33)),
            sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
        ),
        timeout=60,
    )
    tokens: list[int] = []
    gaps = 0
    try:
        async for message in call:
            gaps += message.first_token_index != len(tokens)
            tokens.extend(message.token_ids)
    except grpc.aio.AioRpcError as exc:
        return "", tokens, gaps, exc.code().name
    trailing = dict(await call.trailing_metadata() or ())
    return str(trailing.get("slo-router-process", "")), tokens, gaps, "OK"


def _gone(pids: list[int], timeout_s: float) -> bool:
    """True once none of ``pids`` exists (bounded wait)."""
    deadline = time.monotonic() + timeout_s
    while any(os.path.exists(f"/proc/{pid}") for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


async def test_requests_spread_over_the_processes_and_none_is_lost(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    try:
        cms = fleet.cms()
        workers = [fleet.worker(f"neutral-{i}", "neutral", cms.address) for i in range(2)]
        fleet.wait_listening(*workers)
        router = fleet.router(f"grpc://{cms.address}", "--processes", "2")
        children = [
            int(line.split("(pid ")[1].split(")")[0])
            for line in (tmp_path / "router.out").read_text().splitlines()
            if line.startswith("router process ")
        ]
        assert len(children) == 1, (tmp_path / "router.out").read_text()
        await wait_until_serving(router.address)
        # SO_REUSEPORT spreads connections, not calls: one channel per client connection.
        channels = [
            grpc.aio.insecure_channel(router.address, options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(CHANNELS)
        ]
        try:
            stubs = [router_pb2_grpc.RouterStub(c) for c in channels]
            results = await asyncio.gather(
                *(_one(stubs[i % CHANNELS], f"p-{i}") for i in range(CHANNELS * PER_CHANNEL))
            )
        finally:
            for channel in channels:
                await channel.close()
        assert [r[3] for r in results] == ["OK"] * len(results)
        assert all(len(r[1]) == MAX_TOKENS and r[2] == 0 for r in results)
        served_by = {r[0] for r in results}
        assert served_by == {"0", "1"}, served_by
        # The started process goes with the first one.
        router.signal(signal.SIGTERM)
        assert router.popen.wait(timeout=30) == 0
        assert await asyncio.to_thread(_gone, children, 30.0)
    finally:
        fleet.close()
