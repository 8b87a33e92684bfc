"""``slo-router router --processes 2``: two router processes on one port, real processes on loopback."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import grpc
import pytest
from slorouter.v1 import common_pb2, router_pb2, router_pb2_grpc

from tests.faults.fleet import Fleet, Proc, wait_until_serving

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


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


async def _spread_and_stop(fleet: Fleet, proc: Proc, out: Path, address: str) -> None:
    """48 requests over 16 connections: all complete, both processes serve; the second exits with the first."""
    lines = _lines(out)
    children = [
        int(line.split("(pid ")[1].split(")")[0]) for line in lines if line.startswith("router process ")
    ]
    assert len(children) == 1, lines
    await wait_until_serving(address)
    # SO_REUSEPORT spreads connections, not calls: one channel per client connection.
    channels = [
        grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(CHANNELS)
    ]
    try:
        stubs = [router_pb2_grpc.RouterStub(c) for c in channels]
        results = await asyncio.gather(
            *(_one(stubs[i % CHANNELS], f"p-{i}") for i in range(CHANNELS * PER_CHANNEL))
        )
    finally:
        for channel in channels:
            await channel.close(None)
    assert [r[3] for r in results] == ["OK"] * len(results)
    assert all(len(r[1]) == MAX_TOKENS and r[2] == 0 for r in results)
    served_by = {r[0] for r in results}
    assert served_by == {"0", "1"}, served_by
    # The started process goes with the first one.
    proc.signal(signal.SIGTERM)
    assert proc.popen.wait(timeout=30) == 0
    assert await asyncio.to_thread(_gone, children, 30.0)


async def test_router_processes_spread_requests_and_lose_none(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    try:
        cms = fleet.cms()
        workers = [fleet.worker(f"neutral-{i}", "neutral", cms.address) for i in range(2)]
        fleet.wait_listening(*workers)
        router = fleet.router(f"grpc://{cms.address}", "--processes", "2")
        await _spread_and_stop(fleet, router, tmp_path / "router.out", router.address)
    finally:
        fleet.close()


async def test_up_processes_spread_requests_and_lose_none(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    try:
        up = fleet.spawn(
            "up",
            ["up", "--neutral", "2", "--processes", "2", "--speed-factor", "20", "--listen", "127.0.0.1:0",
             "--http-listen", "", "--scheduling-policy", "load-balance", "--max-queue-size", "512"],
        )  # fmt: skip
        out = tmp_path / "up.out"
        address = next(
            line.split()[-1]
            for line in out.read_text().splitlines()
            if line.startswith("router listening on ")
        )
        await _spread_and_stop(fleet, up, out, address)
    finally:
        fleet.close()


def test_up_gives_its_router_processes_its_scheduling_flags_and_not_its_own() -> None:
    from router.cli import build_parser
    from router.up import _router_argv, plan_cluster

    given = ["--log-level", "DEBUG", "up", "--neutral", "2", "--worker-http", "--processes=2",
             "--max-queue-size", "9", "--speed-factor", "3", "--http-listen", "", "--tpot-slo", "40"]  # fmt: skip
    args = build_parser().parse_args(given)
    args.argv = given
    plan = plan_cluster(args)
    argv = _router_argv(
        args, plan, "127.0.0.1:7", Path("/secrets/router.token"), Path("/secrets/worker-call.token")
    )
    assert argv[:3] == ["--log-level", "DEBUG", "router"]
    assert argv[argv.index("--cms") + 1] == "grpc://127.0.0.1:7"
    assert argv[argv.index("--ttft-profiling-data-path") + 1] == str(plan.profile / "ttft.json")
    assert argv[-8:-4] == ["--max-queue-size", "9", "--tpot-slo", "40"]
    assert argv[-4:] == ["--prefix-block-tokens", "256", "--prefix-chain-block-tokens", "0"]
    for up_only in ("--neutral", "--worker-http", "--processes=2", "--speed-factor", "--http-listen"):
        assert up_only not in argv
    # What the router command makes of them.
    routed = build_parser().parse_args(argv)
    assert routed.command == "router" and routed.max_queue_size == 9 and routed.tpot_slo == 40


@pytest.mark.parametrize(
    ("given", "block", "chain"),
    [
        (["--prefix-cache-block-tokens", "16"], 256, 16),  # events in 16, lookups in 256
        (["--prefix-cache-block-tokens", "48"], 48, 48),  # 256 is no multiple of 48
        (["--prefix-cache-block-tokens", "16", "--prefix-cache-routing", "approximate"], 256, 0),
        (["--prefix-cache-block-tokens", "16", "--prefix-chain-block-tokens", "32"], 256, 32),  # the user's
        ([], 256, 0),
    ],
)
def test_up_hashes_prompts_in_the_workers_cache_block(given: list[str], block: int, chain: int) -> None:
    from router.cli import build_parser
    from router.up import _router_argv, plan_cluster

    argv_in = ["up", "--neutral", "2", "--processes=2", "--http-listen", "", *given]
    args = build_parser().parse_args(argv_in)
    args.argv = argv_in
    plan = plan_cluster(args)
    assert (plan.config.prefix_block_tokens, plan.config.prefix_chain_block_tokens) == (block, chain)
    argv = _router_argv(args, plan, "127.0.0.1:7", Path("/s/r.token"), Path("/s/w.token"))
    routed = build_parser().parse_args(argv)
    assert (routed.prefix_block_tokens, routed.prefix_chain_block_tokens) == (block, chain)


async def test_router_processes_end_when_the_first_is_killed(tmp_path: Path) -> None:
    # No clean shutdown: the kernel's parent-death signal (router.lifetime) ends the started process.
    fleet = Fleet(tmp_path)
    try:
        cms = fleet.cms()
        worker = fleet.worker("neutral-0", "neutral", cms.address)
        fleet.wait_listening(worker)
        router = fleet.router(f"grpc://{cms.address}", "--processes", "2")
        lines = _lines(tmp_path / "router.out")
        children = [
            int(line.split("(pid ")[1].split(")")[0]) for line in lines if line.startswith("router process ")
        ]
        assert len(children) == 1, lines
        assert not await asyncio.to_thread(_gone, children, 0.0)
        router.signal(signal.SIGKILL)
        router.popen.wait(timeout=30)
        assert await asyncio.to_thread(_gone, children, 30.0)
    finally:
        fleet.close()
