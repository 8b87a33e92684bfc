"""Metrics, health and reflection of the router and workers."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import CollectorRegistry, generate_latest

from tests.router.e2e.cluster import collect, embedded_cluster, generate_request
from workers.telemetry import EngineCollector


def _value(text: str, prefix: str) -> float:
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {prefix!r} in:\n{text}")


async def test_router_metrics_count_outcomes_latencies_and_prediction_error() -> None:
    async with embedded_cluster(prefill=1, decode=1) as cluster:
        await asyncio.gather(*(collect(cluster.stub, generate_request(64, 8)) for _ in range(5)))
        with pytest.raises(grpc.aio.AioRpcError):
            await collect(cluster.stub, generate_request(64, 0))
        text = generate_latest(cluster.router.observer.registry).decode()
        assert _value(text, 'slo_router_requests_total{outcome="ok"}') == 5
        assert _value(text, 'slo_router_requests_total{outcome="invalid"}') == 1
        assert _value(text, "slo_router_ttft_seconds_count") == 5
        assert _value(text, "slo_router_tpot_seconds_count") == 5
        assert _value(text, "slo_router_schedule_latency_seconds_count") == 5
        assert _value(text, 'slo_router_ttft_prediction_error_seconds_count{group="prefill"}') == 5
        assert _value(text, 'slo_router_tpot_prediction_error_seconds_count{group="decode"}') == 5
        assert _value(text, 'slo_router_instances{health="healthy",role="prefill"}') == 1
        assert _value(text, 'slo_router_instances{health="healthy",role="decode"}') == 1
        assert _value(text, "slo_router_inflight_entries") == 0
        # Every request ended: none is left in a live phase of its lifecycle.
        for phase in ("queued", "placed", "prefilling", "transferring", "decoding", "paused"):
            assert _value(text, f'slo_router_requests_in_phase{{phase="{phase}"}}') == 0
        # Packing: nobody is over-packed by 5 small requests; the load of the last minute needs a fleet.
        assert _value(text, 'slo_router_instance_overpacked{instance="decode-0"}') == 0
        assert _value(text, 'slo_router_instance_overpacked{instance="prefill-0"}') == 0
        assert _value(text, 'slo_router_instance_cache_hit_rate{instance="decode-0"}') >= 0
        assert _value(text, 'slo_router_desired_instances{role="prefill"}') >= 1
        assert _value(text, 'slo_router_desired_instances{role="decode"}') >= 1
        assert _value(text, 'slo_router_desired_instances{role="neutral"}') == 0


async def test_worker_metrics_follow_the_engine_load() -> None:
    async with embedded_cluster(neutral=1, engine_overrides={"speed_factor": 2.0}) as cluster:
        engine = cluster.engines["neutral-0"]
        registry = CollectorRegistry()
        registry.register(EngineCollector(engine, "neutral-0"))
        call = cluster.stub.Generate(generate_request(64, 500), timeout=30)
        await call.read()
        text = generate_latest(registry).decode()
        assert _value(text, 'slo_router_worker_running_requests{instance="neutral-0"}') == 1
        assert _value(text, 'slo_router_worker_kv_used_tokens{instance="neutral-0"}') > 64
        call.cancel()


async def test_router_health_and_reflection() -> None:
    async with embedded_cluster(neutral=1) as cluster:
        health = health_pb2_grpc.HealthStub(cluster.channel)
        response = await health.Check(health_pb2.HealthCheckRequest(service="slorouter.v1.Router"))
        assert response.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(cluster.channel)
        responses = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = set()
        async for item in responses:
            names |= {s.name for s in item.list_services_response.service}
        assert {"slorouter.v1.Router", "grpc.health.v1.Health"} <= names


async def test_router_calibrates_from_the_workers_step_samples() -> None:
    # The engine runs 4x faster than the profile the router predicts it with.
    async with embedded_cluster(
        neutral=1, engine_overrides={"speed_factor": 4.0}, scheduler_overrides={"calibration": "scale"}
    ) as cluster:
        for _ in range(6):  # one at a time: every status carries the steps of the previous request
            await collect(cluster.stub, generate_request(64, 32))
        text = generate_latest(cluster.router.observer.registry).decode()
        tpot = _value(text, 'slo_router_calibration_factor_ratio{group="",prediction="tpot"}')
        # Real sleeps overshoot a little, so the learned factor sits at or above 1/4, far below 1.
        assert 0.2 <= tpot < 0.5
        assert _value(text, 'slo_router_calibration_drifted_instances{group=""}') == 1
        assert _value(text, 'slo_router_tpot_observed_over_predicted_ratio_count{group="neutral"}') == 6
