"""``--dispatch-mode auto`` end to end: sim workers whose KV does not hold the load preempt, their
statuses carry the counts through the CMS, and the router moves new arrivals to slices; every
request, placed before or after the switch, streams its whole answer."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

from router.core.auto_dispatch import Auto
from router.core.slicing import SliceConfig
from tests.router.e2e.cluster import collect, embedded_cluster, generate_request
from tests.router.e2e.test_slicing_e2e import REPO, expected_tokens

SLICES = SliceConfig(slice_tokens=16, interval_ms=20.0, recompute_share=None)
#: Two sim workers of 1,024 KV tokens each: 40 requests of 64 + 120 tokens at once preempt.
STARVED = {"kv_capacity_tokens": 1024, "max_model_len": 1024, "speed_factor": 20.0}


async def test_a_kv_starved_fleet_switches_to_slices_and_every_request_completes_whole() -> None:
    async with embedded_cluster(
        neutral=2,
        policy="least-requests",
        slice_config=SLICES,
        dispatch_mode="auto",
        engine_overrides=STARVED,
    ) as cluster:
        dispatcher = cluster.router.service._admission.dispatcher
        assert isinstance(dispatcher, Auto) and dispatcher.mode == "request"
        registry = cluster.router.observer.registry
        assert registry.get_sample_value("slo_router_dispatch_mode", {"mode": "request"}) == 1.0
        first = [generate_request(64, 120, request_id=f"a{i}") for i in range(40)]
        results = await asyncio.gather(*(collect(cluster.stub, r) for r in first))
        for request, result in zip(first, results, strict=True):
            assert result.tokens == expected_tokens(request)  # whole, through the preemptions
            assert result.first.route.policy != "slice"
        preempted = sum(e.core.num_preemptions for e in cluster.engines.values())
        assert preempted >= 10, preempted  # the fleet is KV-starved: the pilot sees it
        assert dispatcher.decided and dispatcher.mode == "slice", dispatcher.reason
        assert registry.get_sample_value("slo_router_dispatch_mode", {"mode": "slice"}) == 1.0
        assert registry.get_sample_value("slo_router_dispatch_mode", {"mode": "request"}) == 0.0
        later = [generate_request(48 + i, 40 + 3 * i, request_id=f"b{i}") for i in range(8)]
        results = await asyncio.gather(*(collect(cluster.stub, r) for r in later))
        for request, result in zip(later, results, strict=True):
            assert result.tokens == expected_tokens(request)
            assert result.first.route.policy == "slice"
            assert result.last.finished and result.last.usage.completion_tokens == request.sampling.max_tokens
        deadline = time.monotonic() + 5.0
        while len(dispatcher) or any(e.core.has_unfinished for e in cluster.engines.values()):
            assert time.monotonic() < deadline, "requests left behind"
            await asyncio.sleep(0.02)
        assert len(cluster.router.service._placer.scheduler.inflight) == 0
        assert cluster.router.service.active_requests == 0


def test_up_refuses_auto_without_neutral_workers() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "router.cli", "up", "--prefill", "1", "--decode", "1", "--dispatch-mode", "auto"],
        capture_output=True, text=True, cwd=REPO, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--dispatch-mode auto runs on neutral workers" in done.stderr
