"""Faults: Redis outage and restart, CMS restart over Redis, and authentication."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from slorouter.v1 import cms_pb2, cms_pb2_grpc

from cms.agent import AgentWriter
from cms.memory import MemoryStore
from cms.reader import ClusterReader, GrpcClusterReader, open_reader
from cms.redis_store import RedisStore
from cms.server import SERVICE_NAME, start_cms_server
from cms.testing import RedisServer
from tests.cms.helpers import eventually, make_metadata, make_status

if TYPE_CHECKING:
    Stub = cms_pb2_grpc.ClusterMetadataAsyncStub

IDS = ("p0", "p1", "d0", "d1")


def _agent(target: str, instance_id: str, **kwargs: object) -> AgentWriter:
    options: dict[str, object] = {"heartbeat_interval_s": 0.1, "rpc_timeout_s": 0.5, "backoff_max_s": 0.2}
    options.update(kwargs)
    return AgentWriter(target, make_metadata(instance_id), **options)  # type: ignore[arg-type]


def _whole(reader: ClusterReader, update_id: int) -> bool:
    """Every instance is in the reader's view with status ``update_id``."""
    records = reader.snapshot().by_id()
    return set(records) == set(IDS) and all(
        (s := records[i].status) is not None and s.update_id == update_id for i in IDS
    )


async def test_redis_outage_and_restart(redis_server: RedisServer) -> None:
    lease_s = 1.5
    store = RedisStore(redis_server, cluster_name="faults")
    server = await start_cms_server(store, lease_ttl_s=lease_s, watch_refresh_s=0.2)
    agents = [_agent(server.address, i) for i in IDS]
    via_cms = GrpcClusterReader(server.url, backoff_max_s=0.2)
    direct = open_reader(redis_server, cluster_name="faults")
    channel = grpc.aio.insecure_channel(server.address)
    stub: Stub = cms_pb2_grpc.ClusterMetadataStub(channel)
    try:
        for reader in (via_cms, direct):
            await reader.start()
        for agent in agents:
            await agent.start()
            agent.publish(make_status(agent.instance_id, 1))
        for reader in (via_cms, direct):
            await eventually(lambda r=reader: _whole(r, 1), what="the whole view before the outage")

        redis_server.stop()
        # Writes fail cleanly: UNAVAILABLE, which agents retry.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ReportStatus(cms_pb2.ReportStatusRequest(status=make_status("p0", 1)), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.GetClusterView(cms_pb2.GetClusterViewRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        health = health_pb2_grpc.HealthStub(channel)

        async def not_serving() -> bool:
            request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
            response = await health.Check(request, timeout=5)
            return response.status == health_pb2.HealthCheckResponse.NOT_SERVING

        await eventually(not_serving, what="health to report the store outage")
        failed = {a.instance_id: a.reports_failed for a in agents}
        await eventually(
            lambda: all(a.reports_failed >= failed[a.instance_id] + 2 for a in agents),
            what="agents to keep retrying",
        )
        for agent in agents:
            agent.publish(make_status(agent.instance_id, 2))  # newer load while the CMS cannot store it
        # Readers keep the last view.
        await eventually(lambda: not via_cms.connected and not direct.connected, what="readers to notice")
        assert _whole(via_cms, 1) and _whole(direct, 1)

        redis_server.start()  # back, and empty
        loop = asyncio.get_running_loop()
        restarted = loop.time()
        for reader in (via_cms, direct):
            await eventually(
                lambda r=reader: _whole(r, 2),
                timeout_s=2 * lease_s - (loop.time() - restarted),
                what="the whole view within two lease periods",
            )
        assert all(a.registrations >= 2 and a.registered for a in agents)
        response = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        for agent in agents:
            await agent.stop()
        await via_cms.stop()
        await direct.stop()
        await channel.close()
        await server.stop(0)
        await store.close()


async def test_cms_restart_over_redis_loses_no_registration(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server)
    server = await start_cms_server(store, lease_ttl_s=3.0)
    port = server.port
    agents = [_agent(server.address, i) for i in IDS]
    try:
        for agent in agents:
            await agent.start()
            agent.publish(make_status(agent.instance_id, 7))

        async def whole(view_stub: Stub) -> bool:
            view = await view_stub.GetClusterView(cms_pb2.GetClusterViewRequest(), timeout=5)
            return {
                s.metadata.instance_id for s in view.instances if s.has_status and s.status.update_id == 7
            } == set(IDS)

        async with grpc.aio.insecure_channel(server.address) as channel:
            await eventually(lambda: whole(cms_pb2_grpc.ClusterMetadataStub(channel)), what="all registered")

        await server.stop(0)
        await store.close()
        store = RedisStore(redis_server)  # a new CMS process: new client, same Redis
        server = await start_cms_server(store, f"127.0.0.1:{port}", lease_ttl_s=3.0)
        async with grpc.aio.insecure_channel(server.address) as channel:
            assert await whole(
                cms_pb2_grpc.ClusterMetadataStub(channel)
            )  # nothing lost, nobody re-registered
        assert all(a.registrations == 1 for a in agents)
        sent = {a.instance_id: a.reports_sent for a in agents}
        await eventually(
            lambda: all(a.reports_sent > sent[a.instance_id] for a in agents),
            what="agents to resume reporting",
        )
        assert all(a.registrations == 1 for a in agents)
    finally:
        for agent in agents:
            await agent.stop()
        await server.stop(0)
        await store.close()


async def test_auth_refuses_bad_calls_reads_included() -> None:
    store = MemoryStore()
    server = await start_cms_server(store, auth_token="s3cret")
    channel = grpc.aio.insecure_channel(server.address)
    stub: Stub = cms_pb2_grpc.ClusterMetadataStub(channel)
    good = (("authorization", "Bearer s3cret"),)
    bad_tokens: list[tuple[tuple[str, str], ...] | None] = [
        None,
        (("authorization", "Bearer wrong"),),
        (("authorization", "s3cret"),),
        (("authorization", "Bearer s3cret "),),
    ]
    try:
        for metadata in bad_tokens:
            writes = [
                stub.GetClusterView(cms_pb2.GetClusterViewRequest(), metadata=metadata),
                stub.RegisterInstance(
                    cms_pb2.RegisterInstanceRequest(metadata=make_metadata("p0")), metadata=metadata
                ),
                stub.ReportStatus(cms_pb2.ReportStatusRequest(status=make_status("p0")), metadata=metadata),
                stub.DeregisterInstance(
                    cms_pb2.DeregisterInstanceRequest(instance_id="p0"), metadata=metadata
                ),
            ]
            for call in writes:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "token" in (info.value.details() or "")
        assert (await store.read_view()).instances == ()  # nothing got through

        await stub.RegisterInstance(
            cms_pb2.RegisterInstanceRequest(metadata=make_metadata("p0")), metadata=good
        )
        await stub.ReportStatus(cms_pb2.ReportStatusRequest(status=make_status("p0", 1)), metadata=good)
        # Reads need the token too.
        view = await stub.GetClusterView(cms_pb2.GetClusterViewRequest(), metadata=good)
        assert [s.metadata.instance_id for s in view.instances] == ["p0"]
        anonymous = open_reader(server.url)
        reader = open_reader(server.url, auth_token="s3cret")
        await anonymous.start()
        await reader.start()
        try:
            await eventually(lambda: len(reader.snapshot().instances) == 1, what="a watch with the token")
            assert anonymous.snapshot().instances == ()  # refused, it never got a view
        finally:
            await reader.stop()
            await anonymous.stop()
        removed = await stub.DeregisterInstance(
            cms_pb2.DeregisterInstanceRequest(instance_id="p0"), metadata=good
        )
        assert removed.removed

        # Agents: the right token works; a wrong one is refused but never raises.
        ok = _agent(server.address, "p1", auth_token="s3cret")
        refused = _agent(server.address, "p2", auth_token="nope")
        for agent in (ok, refused):
            await agent.start()
            agent.publish(make_status(agent.instance_id, 1))
        await eventually(
            lambda: ok.reports_sent >= 1 and refused.registrations_failed >= 2, what="both agents"
        )
        assert not refused.registered
        assert [r.instance_id for r in (await store.read_view()).instances] == ["p1"]
        await ok.stop()
        await refused.stop()
        assert (await store.read_view()).instances == ()  # the authorised agent deregistered on stop
    finally:
        await channel.close()
        await server.stop(0)
