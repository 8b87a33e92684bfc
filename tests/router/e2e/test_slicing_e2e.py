"""``--dispatch-mode slice`` end to end: streams crossing several slices arrive whole and in order."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from slorouter.v1 import common_pb2, router_pb2, router_pb2_grpc

from router.core.slicing import SliceConfig
from tests.router.e2e.cluster import Cluster, collect, embedded_cluster, generate_request
from tests.router.e2e.up_process import start_up, wait_for_line
from workers.sim_engine import output_token, prompt_digest, request_key

REPO = Path(__file__).resolve().parents[3]
SLICES = SliceConfig(slice_tokens=8, interval_ms=20.0, recompute_share=None)


def doubling_slices(answer: int, first: int) -> int:
    """Slices an answer of ``answer`` tokens crosses when each is as long as the answer so far (≤ 8 × first)."""
    count = produced = 0
    while produced < answer:
        produced += min(max(first, min(8 * first, produced)), answer - produced)
        count += 1
    return count


def expected_tokens(request: router_pb2.GenerateRequest) -> list[int]:
    """What one uninterrupted sim Generate of ``request`` streams (ignore_eos: exactly max_tokens)."""
    key = request_key(request.sampling.seed, prompt_digest(list(request.prompt_token_ids)))
    return [output_token(key, p) for p in range(request.sampling.max_tokens)]


async def settled(cluster: Cluster, timeout_s: float = 5.0) -> None:
    """Wait (bounded) until no slice waits and no engine holds a request."""
    deadline = time.monotonic() + timeout_s
    dispatcher = cluster.router.service._admission.dispatcher
    assert dispatcher.name == "slice"
    while len(dispatcher) or any(e.core.has_unfinished for e in cluster.engines.values()):
        assert time.monotonic() < deadline, "slices or engine requests left behind"
        await asyncio.sleep(0.02)


async def test_streams_crossing_many_slices_arrive_whole_and_in_order() -> None:
    async with embedded_cluster(neutral=2, slice_config=SLICES) as cluster:
        requests = [generate_request(30 + 7 * i, 20 + 5 * i, request_id=f"s{i}") for i in range(12)]
        results = await asyncio.gather(*(collect(cluster.stub, r) for r in requests))
        for request, result in zip(requests, results, strict=True):
            n = request.sampling.max_tokens
            assert result.tokens == expected_tokens(request)  # none lost, repeated or reordered
            assert len(result.tokens) == n
            assert all(not m.finished for m in result.messages[:-1])
            assert result.last.finished and result.last.finish_reason == "length"
            assert result.first.route.policy == "slice"
            assert all(not m.HasField("route") for m in result.messages[1:])
            usage = result.last.usage
            assert usage.completion_tokens == n
            assert 0 < usage.ttft_ms <= usage.e2e_ms
            assert usage.tpot_ms > 0
        await settled(cluster)
        dispatcher = cluster.router.service._admission.dispatcher
        # Every slice was placed once; a resumed slice is as long as the answer so far (8, 8, 16,
        # 32, 64, 64, ... tokens: SliceConfig.grow_with_answer). The router counts a slice's tokens
        # per message it relays, and a message may carry several (more on a loaded host, where the
        # router reads several at once): a slice may end past its cap, and an answer then crosses
        # fewer boundaries, never more.
        counters = dispatcher.counters()
        slices = counters["slices"]
        assert len(requests) < slices <= sum(doubling_slices(r.sampling.max_tokens, 8) for r in requests)
        # A slice placed where its request ran continued its leg there (the engine saw no new
        # request); only first slices and slices that moved started a leg on an engine (and a
        # start retried elsewhere, which a loaded host may cause).
        legs = sum(len(e.core._recent_admitted) for e in cluster.engines.values())
        assert len(requests) + counters["moved"] <= legs < slices
        # Each slice's placement went through the in-flight account and left it.
        assert len(cluster.router.service._placer.scheduler.inflight) == 0
        assert cluster.router.service.active_requests == 0


async def test_an_eos_ends_the_request_inside_a_slice() -> None:
    overrides = {"eos_probability": 0.03}
    async with (
        embedded_cluster(neutral=2, slice_config=SLICES, engine_overrides=overrides) as sliced,
        embedded_cluster(neutral=1, engine_overrides=overrides) as whole,
    ):
        requests = [
            router_pb2.GenerateRequest(
                request_id=f"e{i}",
                prompt_token_ids=[(11 * k + i) % 250 + 1 for k in range(40)],
                sampling=common_pb2.SamplingParams(max_tokens=120, seed=i),
            )
            for i in range(8)
        ]
        for request in requests:
            a = await collect(sliced.stub, request)
            b = await collect(whole.stub, request)
            assert a.tokens == b.tokens
            assert a.last.finish_reason == b.last.finish_reason
        await settled(sliced)


async def test_a_cancelled_client_leaves_no_slice_behind() -> None:
    async with embedded_cluster(neutral=2, slice_config=SLICES) as cluster:
        call = cluster.stub.Generate(generate_request(50, 2000, request_id="gone"), timeout=30)
        got = 0
        async for message in call:
            got += len(message.token_ids)
            if got >= 20:  # past two slices
                break
        call.cancel()
        await settled(cluster)
        # The router still serves.
        result = await collect(cluster.stub, generate_request(20, 17, request_id="after"))
        assert len(result.tokens) == 17


async def test_slice_mode_without_neutral_instances_is_unavailable() -> None:
    async with embedded_cluster(prefill=1, decode=1, slice_config=SLICES) as cluster:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(cluster.stub, generate_request(20, 10))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "neutral" in (info.value.details() or "")


# ----------------------------------------------------------------------------- slo-router up


async def _drive(address: str) -> list[tuple[router_pb2.GenerateRequest, list[int], str]]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        requests = [generate_request(24 + 5 * i, 40 + 9 * i, request_id=f"up{i}") for i in range(10)]
        results = await asyncio.gather(*(collect(stub, r, timeout_s=60) for r in requests))
        return [(r, res.tokens, res.last.finish_reason) for r, res in zip(requests, results, strict=True)]


@pytest.mark.timeout(180)
def test_up_neutral_2_slice_mode_streams_exactly_max_tokens() -> None:
    up = start_up(
        "--neutral", "2", "--dispatch-mode", "slice", "--slice-tokens", "16", "--speed-factor", "20"
    )
    try:
        address = wait_for_line(up, "router listening on ")
        for request, tokens, reason in asyncio.run(_drive(address)):
            assert tokens == expected_tokens(request)
            assert len(tokens) == request.sampling.max_tokens  # 40..121 tokens: 3 to 8 slices each
            assert reason == "length"
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=30)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait(timeout=10)
        if up.stdout is not None:
            up.stdout.close()


def test_up_refuses_slices_without_neutral_workers() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "router.cli", "up", "--prefill", "1", "--decode", "1", "--dispatch-mode", "slice"],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--neutral" in done.stderr


def test_router_names_a_bad_slice_flag() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "router.cli", "up", "--neutral", "1", "--dispatch-mode", "slice",
         "--slice-tokens", "0"],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--slice-tokens" in done.stderr


async def test_slice_requests_feed_the_router_metrics() -> None:
    async with embedded_cluster(neutral=1, slice_config=SLICES) as cluster:
        await collect(cluster.stub, generate_request(20, 30, request_id="m"))
        registry = cluster.router.observer.registry
        assert registry.get_sample_value("slo_router_requests_total", {"outcome": "ok"}) == 1.0
        assert registry.get_sample_value("slo_router_ttft_seconds_count") == 1.0


async def test_killing_the_worker_of_a_running_slice_loses_and_duplicates_nothing() -> None:
    # The slice's leg fails over like any decode (the tokens so far kept), and the slices after it
    # are placed by the dispatcher on the instance left.
    async with embedded_cluster(
        neutral=2, slice_config=SLICES, engine_overrides={"speed_factor": 5.0}
    ) as cluster:
        request = generate_request(64, 120, request_id="survivor")
        tokens: list[int] = []
        killed = ""
        async for message in cluster.stub.Generate(request, timeout=60):
            tokens.extend(message.token_ids)
            if not killed and len(tokens) >= 20:
                busy = [
                    i for i, e in cluster.engines.items() if e.core.has_unfinished and i in cluster.workers
                ]
                if busy:
                    killed = busy[0]
                    await cluster.kill_worker(killed)
        assert killed
        assert tokens == expected_tokens(request)
        assert len(tokens) == 120
        dispatcher = cluster.router.service._admission.dispatcher
        assert len(dispatcher) == 0 and cluster.router.service.active_requests == 0
