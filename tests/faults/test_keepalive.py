"""Keepalive that holds: no GOAWAY on an idle fleet, and a frozen (SIGSTOPped) decode worker is
declared dead within --worker-keepalive-s + --worker-keepalive-timeout-s, its streams resumed
elsewhere token-exact."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import grpc
from slorouter.v1 import common_pb2, router_pb2, router_pb2_grpc

from tests.faults.up_cluster import child_pid, up_cluster, wait_serving
from workers.sim_engine import output_token, prompt_digest, request_key

PROMPT = list(range(1, 33))
SEED = 5
KEEPALIVE_S = 2.0
KEEPALIVE_TIMEOUT_S = 1.0
#: The documented bound for this configuration: interval + timeout.
BOUND_S = KEEPALIVE_S + KEEPALIVE_TIMEOUT_S


async def _stream(stub: router_pb2_grpc.RouterStub, request_id: str, max_tokens: int) -> dict[str, object]:
    tokens: list[int] = []
    arrivals: list[float] = []
    result: dict[str, object] = {"decode": "", "finish_reason": "", "code": "OK", "gaps": 0}
    request = router_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=PROMPT,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, seed=SEED, ignore_eos=True),
        slo=common_pb2.SloTarget(ttft_ms=60_000, tpot_ms=60_000),
    )
    try:
        async for message in stub.Generate(request, timeout=90):
            arrivals.append(time.monotonic())
            if message.HasField("route"):
                result["decode"] = message.route.decode_instance_id
            if message.first_token_index != len(tokens):
                result["gaps"] = int(result["gaps"]) + 1  # type: ignore[call-overload]
            tokens.extend(message.token_ids)
            if message.finished:
                result["finish_reason"] = message.finish_reason
    except grpc.aio.AioRpcError as exc:
        result["code"] = f"{exc.code().name}: {exc.details()}"
    result["tokens"] = tokens
    result["arrivals"] = arrivals
    return result


def test_a_sigstopped_decode_worker_is_found_within_the_keepalive_bound(tmp_path: Path) -> None:
    max_tokens = 800
    flags = ["--decode", "2", "--speed-factor", "4", "--worker-keepalive-s", str(KEEPALIVE_S),
             "--worker-keepalive-timeout-s", str(KEEPALIVE_TIMEOUT_S)]  # fmt: skip
    with up_cluster(tmp_path, *flags) as cluster:
        wait_serving(cluster.router)
        # An idle fleet for a while: pings every 2 s must not draw GOAWAY (too_many_pings).
        time.sleep(2 * KEEPALIVE_S)
        wait_serving(cluster.router, timeout_s=5)
        stopped: list[int] = []

        async def run() -> tuple[list[dict[str, object]], float, str]:
            async with grpc.aio.insecure_channel(cluster.router) as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                streams = [asyncio.ensure_future(_stream(stub, f"frozen-{i}", max_tokens)) for i in range(6)]
                await asyncio.sleep(1.5)
                victim = "decode-0"
                pid = child_pid(cluster, victim)
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
                frozen_at = time.monotonic()
                try:
                    results = await asyncio.wait_for(asyncio.gather(*streams), 75)
                finally:
                    os.kill(pid, signal.SIGCONT)
                return results, frozen_at, victim

        try:
            results, frozen_at, victim = asyncio.run(run())
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
        key = request_key(SEED, prompt_digest(PROMPT))
        expected = [output_token(key, i) for i in range(max_tokens)]
        on_victim = 0
        worst = 0.0
        for i, result in enumerate(results):
            assert result["code"] == "OK", (i, result["code"], cluster.tail())
            assert result["finish_reason"] == "length", i
            assert result["gaps"] == 0, i
            assert result["tokens"] == expected, f"frozen-{i}: not token-exact"
            arrivals = [t for t in result["arrivals"] if t >= frozen_at]  # type: ignore[attr-defined]
            if result["decode"] == victim:
                on_victim += 1
            # No stream went silent longer than the bound (plus re-placement and scheduling slack).
            stall = max((b - a for a, b in zip([frozen_at, *arrivals], arrivals, strict=False)), default=0.0)
            worst = max(worst, stall)
            assert stall < BOUND_S + 2.5, f"frozen-{i} stalled {stall:.1f} s (bound {BOUND_S:g} s)"
        print(f"longest silence of a stream after SIGSTOP: {worst:.2f} s (bound {BOUND_S:g} s)")
        assert on_victim >= 1, "no stream ran on the frozen worker; the test proved nothing"
        assert "too_many_pings" not in cluster.tail()
