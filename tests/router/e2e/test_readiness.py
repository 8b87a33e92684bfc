"""Readiness: the router's gRPC health says NOT_SERVING until its first cluster view arrives.

Real parts only: a router reading a CMS over ``grpc://``, the CMS absent at
first and started later on the address the router was given.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from slorouter.v1 import common_pb2, router_pb2, router_pb2_grpc

from cms.memory import MemoryStore
from cms.reader import GrpcClusterReader, open_reader
from cms.server import start_cms_server
from predictor import LatencyPredictor
from router.core.config import SchedulerConfig
from router.core.scheduler import Scheduler
from router.server import SERVICE_NAME, RouterServer, start_router_server
from workers.sim_engine import DEFAULT_PROFILE_DIR

PREDICTOR = LatencyPredictor.from_files(DEFAULT_PROFILE_DIR / "ttft.json", DEFAULT_PROFILE_DIR / "tpot.json")
Status = health_pb2.HealthCheckResponse.ServingStatus


async def _free_cms_address() -> str:
    """An address a CMS just served on and released (nothing listens there now)."""
    cms = await start_cms_server(MemoryStore(), "127.0.0.1:0")
    address = cms.address
    await cms.stop(grace=0)
    return address


async def _router(cms_address: str) -> RouterServer:
    scheduler = Scheduler(SchedulerConfig(scheduling_policy="slo"), PREDICTOR, random.Random(0))
    reader = open_reader(f"grpc://{cms_address}", backoff_max_s=0.2)
    return await start_router_server(reader, scheduler, source=f"grpc://{cms_address}")


async def _health(channel: grpc.aio.Channel) -> tuple[Status, Status]:
    stub = health_pb2_grpc.HealthStub(channel)
    whole = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    service = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
    return whole.status, service.status


async def _until(condition: object, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_not_serving_without_a_cms_and_serving_once_its_first_view_arrives(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    address = await _free_cms_address()
    router = await _router(address)
    channel = grpc.aio.insecure_channel(router.address)
    cms = None
    try:
        assert isinstance(router.reader, GrpcClusterReader)
        await _until(lambda: router.reader.streams_opened >= 2, 10.0)  # it tried, and tried again
        assert await _health(channel) == (
            health_pb2.HealthCheckResponse.NOT_SERVING,
            health_pb2.HealthCheckResponse.NOT_SERVING,
        )
        assert not router.ready
        assert f"waiting for the first cluster view from grpc://{address}" in caplog.text
        assert "no cluster view yet" in caplog.text
        assert "keeping the last view" not in caplog.text  # it never had one
        # A request now fails fast and says why.
        stub = router_pb2_grpc.RouterStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            request = router_pb2.GenerateRequest(
                prompt_token_ids=[1, 2, 3], sampling=common_pb2.SamplingParams(max_tokens=4)
            )
            async for _ in stub.Generate(request, timeout=5):
                pass
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
        assert "no cluster view yet" in (failed.value.details() or "")

        cms = await start_cms_server(MemoryStore(), address)
        await _until(lambda: router.ready, 15.0)
        assert await _health(channel) == (
            health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.SERVING,
        )
        assert f"first cluster view from grpc://{address}: 0 instances" in caplog.text
    finally:
        await channel.close(None)
        await router.stop(grace=0)
        if cms is not None:
            await cms.stop(grace=0)


async def test_serving_at_once_over_an_in_process_store() -> None:
    store = MemoryStore()
    scheduler = Scheduler(SchedulerConfig(), PREDICTOR, random.Random(0))
    router = await start_router_server(open_reader("memory", store=store), scheduler)
    channel = grpc.aio.insecure_channel(router.address)
    try:
        await _until(lambda: router.ready, 10.0)
        assert await _health(channel) == (
            health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.SERVING,
        )
    finally:
        await channel.close(None)
        await router.stop(grace=0)
