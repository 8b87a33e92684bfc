"""The sa queue policy through the real gRPC router: CMS + sim workers + router on loopback."""

from __future__ import annotations

import asyncio

from router.core.queue import QueueConfig
from tests.router.e2e.cluster import collect, embedded_cluster, generate_request


async def test_sa_serves_a_burst_of_code_and_chat_requests() -> None:
    queue = QueueConfig(queue_policy="sa", sa_max_batch=4)
    async with embedded_cluster(neutral=1, queue=queue) as cluster:
        requests = []
        for i in range(24):
            if i % 2:  # code: judged end to end
                requests.append(
                    generate_request(48 + 4 * i, 10 + i % 7, request_id=f"code-{i}", e2e_ms=30000.0)
                )
            else:  # chat: TTFT and TPOT
                requests.append(
                    generate_request(
                        96 + 2 * i, 8 + i % 5, request_id=f"chat-{i}", ttft_ms=10000.0, tpot_ms=200.0
                    )
                )
        results = await asyncio.wait_for(asyncio.gather(*(collect(cluster.stub, r) for r in requests)), 60)
        for request, result in zip(requests, results, strict=True):
            assert result.first.request_id == request.request_id
            assert len(result.tokens) == request.sampling.max_tokens  # nothing lost or repeated
            assert result.last.finished and result.last.usage.completion_tokens == request.sampling.max_tokens
            assert result.first.route.prefill_instance_id == "neutral-0"
        admission = cluster.router.service._admission
        planner = admission.queue.planner
        assert planner is not None and planner.stats.runs >= 1
        # Released in batches of at most 4: the burst needed at least 24 / 4 of them.
        assert planner.stats.batches_released >= 6
        assert len(admission.queue) == 0 and not planner.running
        assert len(cluster.router.scheduler.inflight) == 0
        assert cluster.router.service.active_requests == 0
