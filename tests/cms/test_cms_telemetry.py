"""The CMS's Prometheus metrics follow its view."""

from __future__ import annotations

import asyncio

import grpc
from prometheus_client import CollectorRegistry, generate_latest
from slorouter.v1 import cms_pb2, cms_pb2_grpc

from cms.memory import MemoryStore
from cms.server import start_cms_server
from cms.telemetry import CmsCollector


async def test_metrics_count_instances_by_role_and_health() -> None:
    server = await start_cms_server(MemoryStore(), "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = cms_pb2_grpc.ClusterMetadataStub(channel)
            await stub.RegisterInstance(
                cms_pb2.RegisterInstanceRequest(
                    metadata=cms_pb2.InstanceMetadata(
                        instance_id="p0", endpoint="127.0.0.1:1", role=cms_pb2.INSTANCE_ROLE_PREFILL
                    )
                )
            )
            await stub.ReportStatus(
                cms_pb2.ReportStatusRequest(
                    status=cms_pb2.InstanceStatus(instance_id="p0", update_id=1, schedulable=True)
                )
            )
        registry = CollectorRegistry()
        registry.register(CmsCollector(server))
        text = ""
        for _ in range(200):  # the view pump publishes within its coalescing interval
            text = generate_latest(registry).decode()
            if 'slo_router_cms_instances{health="schedulable",role="prefill"} 1.0' in text:
                break
            await asyncio.sleep(0.01)
        assert 'slo_router_cms_instances{health="schedulable",role="prefill"} 1.0' in text
        assert 'slo_router_cms_instances{health="schedulable",role="decode"} 0.0' in text
        assert "slo_router_cms_store_up 1.0" in text
        assert "slo_router_cms_watchers 0.0" in text
    finally:
        await server.stop(grace=0)
