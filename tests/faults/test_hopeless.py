"""Hopeless requests are refused at once: a target no idle instance could meet at arrival, and under
overload a request predicted to start only after its wait limit, not when that limit runs out."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
from slorouter.v1 import common_pb2, router_pb2, router_pb2_grpc

from tests.faults.up_cluster import UpCluster, small_request, up_cluster, wait_serving


def test_an_unmeetable_target_is_refused_at_arrival_with_the_reason(shared_up: UpCluster) -> None:
    cluster = shared_up
    wait_serving(cluster.router)
    cases = {"tpot_ms=1": {"tpot_ms": 1.0}, "tpot_ms=3": {"tpot_ms": 3.0}, "ttft_ms=1": {"ttft_ms": 1.0}}
    with grpc.insecure_channel(cluster.router) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for name, slo in cases.items():
            started = time.monotonic()
            try:
                for _ in stub.Generate(
                    small_request(f"hopeless-{name.replace('=', '-')}", **slo), timeout=20
                ):
                    pass
                raise AssertionError(f"{name} was served")
            except grpc.RpcError as exc:
                elapsed = time.monotonic() - started
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (name, exc)  # type: ignore[attr-defined]
                assert "below the best prediction" in (exc.details() or ""), exc.details()  # type: ignore[attr-defined]
            assert elapsed < 1.0, f"{name}: refused after {elapsed:.2f} s"
        # A meetable target still runs.
        for _ in stub.Generate(small_request("fine", tpot_ms=500.0), timeout=20):
            pass
    # The HTTP edge says the same, as 429.
    req = urllib.request.Request(
        f"http://{cluster.http}/v1/completions",
        json.dumps({"prompt": "hi", "max_tokens": 4}).encode(),
        {"content-type": "application/json", "x-slo-tpot-ms": "1"},
    )
    started = time.monotonic()
    try:
        urllib.request.urlopen(req, timeout=20)
        raise AssertionError("served")
    except urllib.error.HTTPError as exc:
        assert exc.code == 429
        assert "TPOT target" in json.loads(exc.read())["error"]["message"]
    assert time.monotonic() - started < 1.0


async def _one(stub: router_pb2_grpc.RouterStub, i: int, prompt: list[int]) -> tuple[str, float]:
    started = time.monotonic()
    request = router_pb2.GenerateRequest(
        request_id=f"flood-{i}",
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=2, ignore_eos=True),
        slo=common_pb2.SloTarget(ttft_ms=1500.0, tpot_ms=60_000.0),
    )
    try:
        async for _ in stub.Generate(request, timeout=60):
            pass
        return "OK", time.monotonic() - started
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, time.monotonic() - started


def test_under_overload_requests_that_cannot_start_before_their_wait_limit_are_refused_early(
    tmp_path: Path,
) -> None:
    wait_s = 8.0
    flags = ["--speed-factor", "1", "--max-queue-wait-ms", str(wait_s * 1000)]
    with up_cluster(tmp_path, *flags) as cluster:
        wait_serving(cluster.router)
        prompt = [1 + i % 500 for i in range(3000)]  # ~0.2-0.3 s of prefill each at speed 1

        async def flood() -> list[tuple[str, float]]:
            async with grpc.aio.insecure_channel(cluster.router) as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                return await asyncio.gather(*(_one(stub, i, prompt) for i in range(100)))

        started = time.monotonic()
        results = asyncio.run(flood())
        total = time.monotonic() - started
        # Refused as hopeless: RESOURCE_EXHAUSTED when it could not start before its wait limit,
        # DEADLINE_EXCEEDED when, late, its first token could not come within its late allowance
        # (--late-policy serve: router.core.queue.LATE_ALLOWANCE); whichever the queue saw first.
        refusals = ("RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED")
        refused = [t for code, t in results if code in refusals]
        served = [t for code, t in results if code == "OK"]
        other = [code for code, _ in results if code not in ("OK", *refusals)]
        print(f"{len(served)} served, {len(refused)} refused (slowest refusal {max(refused, default=0):.1f} s), "
              f"all done in {total:.1f} s")  # fmt: skip
        assert not other, other
        assert len(refused) >= 50, f"only {len(refused)} refused: the flood did not overload the fleet"
        # Refused when found hopeless, well before the wait limit.
        early = [t for t in refused if t < wait_s / 2]
        assert len(early) >= 0.9 * len(refused), (
            f"{len(refused) - len(early)} refusals came late: {sorted(refused)}"
        )
