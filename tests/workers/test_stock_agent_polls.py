"""How often ``slo-router agent`` calls a vLLM engine, over a real gRPC server on loopback.

The server is :mod:`bench.vllm_stock_synthetic`'s engine (vLLM's ``VllmEngine`` service, a fixed
token cadence) with its calls counted and its health switchable. Checked: ``GetLoads`` at every
poll, ``HealthCheck`` and ``GetServerInfo`` only once per ``--health-interval-s`` while the engine
is healthy; an unhealthy answer makes the status unschedulable at the next health probe, and from
then on every poll asks again, so the engine comes back at the first healthy answer.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_pb2_grpc

from bench.vllm_stock_synthetic import SyntheticEngine
from workers.stock_agent import AgentConfig, StockEngineAgent


class _CountedEngine(SyntheticEngine):
    def __init__(self) -> None:
        super().__init__(0.01, "counted")
        self.calls: Counter[str] = Counter()
        self.healthy = True

    async def HealthCheck(self, request: Any, context: Any) -> Any:
        self.calls["HealthCheck"] += 1
        return vllm_pb2.HealthCheckResponse(healthy=self.healthy, message="ok" if self.healthy else "dead")

    async def GetServerInfo(self, request: Any, context: Any) -> Any:
        self.calls["GetServerInfo"] += 1
        return await super().GetServerInfo(request, context)

    async def GetLoads(self, request: Any, context: Any) -> Any:
        self.calls["GetLoads"] += 1
        return await super().GetLoads(request, context)


@pytest.fixture
async def engine() -> AsyncIterator[tuple[_CountedEngine, str]]:
    server = grpc.aio.server()
    servicer = _CountedEngine()
    vllm_pb2_grpc.add_VllmEngineServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, f"127.0.0.1:{port}"
    await server.stop(None)


async def test_health_is_asked_once_per_interval_and_at_every_poll_while_unschedulable(
    engine: tuple[_CountedEngine, str],
) -> None:
    servicer, address = engine
    config = AgentConfig(
        engine=address, cms="127.0.0.1:1", instance_id="v", poll_interval_s=0.01, health_interval_s=0.3
    )
    agent = StockEngineAgent(config)
    try:
        started = time.monotonic()
        for _ in range(30):
            status = await agent.poll_once()
            assert status.schedulable
            await asyncio.sleep(0.01)
        elapsed = time.monotonic() - started
        assert servicer.calls["GetLoads"] == 30
        # The first poll and then one per 0.3 s (a generous bound: the polls may run slowly).
        bound = 2 + elapsed / 0.3
        assert 1 <= servicer.calls["HealthCheck"] <= bound, (servicer.calls, elapsed)
        assert servicer.calls["GetServerInfo"] == servicer.calls["HealthCheck"]

        servicer.healthy = False
        deadline = time.monotonic() + 5
        while (status := await agent.poll_once()).schedulable:
            assert time.monotonic() < deadline, "the unhealthy engine stayed schedulable"
            await asyncio.sleep(0.01)
        assert "unhealthy" in status.unschedulable_reason
        # Unschedulable: every poll asks again, and the first healthy answer brings it back.
        before = servicer.calls["HealthCheck"]
        for _ in range(3):
            assert not (await agent.poll_once()).schedulable
        assert servicer.calls["HealthCheck"] == before + 3
        servicer.healthy = True
        assert (await agent.poll_once()).schedulable
    finally:
        await agent.close()
