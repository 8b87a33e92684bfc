"""The ClusterMetadata gRPC service over both stores: RPC semantics, watch streams, health, reflection."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from slorouter.v1 import cms_pb2, cms_pb2_grpc

from cms.memory import MemoryStore
from cms.server import SERVICE_NAME, CmsServer, start_cms_server
from cms.store import CmsStore
from cms.view import LatestSlot
from tests.cms.conftest import LEASE_TTL_S
from tests.cms.helpers import DECODE, eventually, make_metadata, make_status

if TYPE_CHECKING:
    Stub = cms_pb2_grpc.ClusterMetadataAsyncStub


class Watcher:
    """Reads a WatchClusterView stream in the background and keeps what arrived."""

    def __init__(self, stub: Stub, model: str = "") -> None:
        self.call = stub.WatchClusterView(cms_pb2.GetClusterViewRequest(model=model))
        self.views: list[cms_pb2.ClusterView] = []
        self.error: grpc.aio.AioRpcError | None = None
        self.ended = False
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for view in self.call:
                self.views.append(view)
        except grpc.aio.AioRpcError as exc:
            self.error = exc
        self.ended = True

    def latest_status(self, instance_id: str) -> cms_pb2.InstanceStatus | None:
        if not self.views:
            return None
        for state in self.views[-1].instances:
            if state.metadata.instance_id == instance_id and state.has_status:
                return state.status
        return None

    async def close(self) -> None:
        self.call.cancel()
        await asyncio.wait({self._task})


@pytest.fixture
async def watchers(stub: Stub) -> AsyncIterator[list[Watcher]]:
    opened: list[Watcher] = []
    yield opened
    for watcher in opened:
        await watcher.close()


async def _register(
    stub: Stub, instance_id: str = "p0", **fields: object
) -> cms_pb2.RegisterInstanceResponse:
    return await stub.RegisterInstance(
        cms_pb2.RegisterInstanceRequest(metadata=make_metadata(instance_id, **fields))  # type: ignore[arg-type]
    )


async def test_register_returns_lease(stub: Stub) -> None:
    response = await _register(stub)
    assert response.lease_ttl_ms == round(LEASE_TTL_S * 1000)


async def test_report_for_unknown_instance_is_not_found(stub: Stub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.ReportStatus(cms_pb2.ReportStatusRequest(status=make_status("ghost")))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "register" in (info.value.details() or "")


async def test_report_accepted_vs_heartbeat(stub: Stub) -> None:
    await _register(stub)
    first = await stub.ReportStatus(cms_pb2.ReportStatusRequest(status=make_status("p0", 5)))
    beat = await stub.ReportStatus(
        cms_pb2.ReportStatusRequest(status=make_status("p0", 5, timestamp_ms=1_500))
    )
    assert first.accepted and not beat.accepted


async def test_get_cluster_view_content_ages_and_model_filter(stub: Stub) -> None:
    await _register(stub, "p0", model="tiny")
    await _register(stub, "d0", model="big", role=DECODE)
    await stub.ReportStatus(cms_pb2.ReportStatusRequest(status=make_status("p0", 3, num_waiting_requests=4)))
    view = await stub.GetClusterView(cms_pb2.GetClusterViewRequest())
    assert [s.metadata.instance_id for s in view.instances] == ["d0", "p0"]
    d0, p0 = view.instances
    assert not d0.has_status
    assert p0.has_status and p0.status.num_waiting_requests == 4
    assert 0 <= p0.status_age_ms < 1000
    assert view.version > 0 and view.generated_at_ms > 0
    only_big = await stub.GetClusterView(cms_pb2.GetClusterViewRequest(model="big"))
    assert [s.metadata.instance_id for s in only_big.instances] == ["d0"]


async def test_deregister_and_lease_expiry_through_rpc(stub: Stub) -> None:
    await _register(stub, "p0")
    await _register(stub, "p1")
    removed = await stub.DeregisterInstance(cms_pb2.DeregisterInstanceRequest(instance_id="p0"))
    again = await stub.DeregisterInstance(cms_pb2.DeregisterInstanceRequest(instance_id="p0"))
    assert removed.removed and not again.removed
    view = await stub.GetClusterView(cms_pb2.GetClusterViewRequest())
    assert [s.metadata.instance_id for s in view.instances] == ["p1"]

    async def empty() -> bool:
        return not (await stub.GetClusterView(cms_pb2.GetClusterViewRequest())).instances

    await eventually(empty, timeout_s=LEASE_TTL_S + 3, what="p1's lease to lapse")


async def test_watch_pushes_changes_and_expiry(stub: Stub, watchers: list[Watcher]) -> None:
    watcher = Watcher(stub)
    watchers.append(watcher)
    await eventually(lambda: watcher.views, what="the initial view")
    await _register(stub, "p0")
    await stub.ReportStatus(cms_pb2.ReportStatusRequest(status=make_status("p0", 7, num_running_requests=2)))
    status = await eventually(lambda: watcher.latest_status("p0"), what="p0's status in the watch")
    assert status.update_id == 7 and status.num_running_requests == 2
    await eventually(
        lambda: watcher.views[-1].instances == [], timeout_s=LEASE_TTL_S + 3, what="the expiry to be pushed"
    )
    versions = [v.version for v in watcher.views]
    assert versions == sorted(versions)


async def test_watch_pushes_periodically_without_change(stub: Stub, watchers: list[Watcher]) -> None:
    watcher = Watcher(stub)  # on an idle cluster: nothing ever changes
    watchers.append(watcher)
    await eventually(lambda: len(watcher.views) >= 4, timeout_s=5.0, what="periodic pushes")
    quiet = watcher.views
    assert len({v.version for v in quiet}) == 1  # nothing changed, still pushed
    gaps = [b.generated_at_ms - a.generated_at_ms for a, b in itertools.pairwise(quiet)]
    assert max(gaps) <= 1000


async def test_new_watcher_gets_current_view_at_once(stub: Stub, watchers: list[Watcher]) -> None:
    await _register(stub, "p0")
    await stub.ReportStatus(cms_pb2.ReportStatusRequest(status=make_status("p0", 1)))
    late = Watcher(stub, model="tiny")
    watchers.append(late)
    status = await eventually(lambda: late.latest_status("p0"), what="the view for a late watcher")
    assert status.update_id == 1


async def test_watch_coalesces_bursts_latest_wins() -> None:
    store = MemoryStore()
    server = await start_cms_server(store, watch_min_interval_s=0.05, watch_refresh_s=1.0)
    channel = grpc.aio.insecure_channel(server.address)
    watcher = Watcher(cms_pb2_grpc.ClusterMetadataStub(channel))
    try:
        await store.register(make_metadata("p0"), 30.0)
        await eventually(lambda: watcher.views, what="the initial view")
        start = len(watcher.views)
        for update_id in range(1, 501):  # a burst far faster than the push rate
            await store.report(make_status("p0", update_id), 30.0)
        status = await eventually(
            lambda: (s := watcher.latest_status("p0")) is not None and s.update_id == 500 and s,
            what="the last update of the burst",
        )
        assert status.update_id == 500
        assert len(watcher.views) - start <= 5  # 500 changes, a handful of pushes
    finally:
        await watcher.close()
        await channel.close()
        await server.stop(0)


async def test_slow_watcher_neither_blocks_writers_nor_grows(stub: Stub, cms_server: CmsServer) -> None:
    await _register(stub, "p0")
    # A watcher that never reads: its stream backs up in flow control.
    stalled = stub.WatchClusterView(cms_pb2.GetClusterViewRequest())
    try:
        await eventually(lambda: cms_server.service.watchers == 1, what="the stalled watcher to subscribe")
        big_ids = [f"request-{i:06d}" for i in range(256)]
        for update_id in range(1, 201):
            await stub.ReportStatus(
                cms_pb2.ReportStatusRequest(
                    status=make_status("p0", update_id, admitted_request_ids=big_ids)
                ),
                timeout=5.0,
            )
        # The writers finished; a live watcher still sees the newest state right away.
        fresh = Watcher(stub)
        try:
            await eventually(
                lambda: (s := fresh.latest_status("p0")) is not None and s.update_id == 200,
                what="the newest view",
            )
        finally:
            await fresh.close()
    finally:
        stalled.cancel()


def test_latest_slot_keeps_one_item() -> None:
    async def scenario() -> None:
        slot: LatestSlot[int] = LatestSlot()
        for i in range(10_000):
            slot.put(i)
        assert await slot.get() == 9_999
        assert slot.overwritten == 9_999
        getter = asyncio.create_task(slot.get())
        await asyncio.sleep(0)
        assert not getter.done()
        slot.put(1)
        assert await getter == 1

    asyncio.run(scenario())


async def test_watch_streams_end_cleanly_on_server_stop(store: CmsStore) -> None:
    server = await start_cms_server(store)
    channel = grpc.aio.insecure_channel(server.address)
    watcher = Watcher(cms_pb2_grpc.ClusterMetadataStub(channel))
    try:
        await eventually(lambda: watcher.views, what="the initial view")
        await server.stop(1.0)
        await eventually(lambda: watcher.ended, what="the stream to end")
        assert watcher.error is None
        await server.stop(1.0)  # idempotent
    finally:
        await watcher.close()
        await channel.close()


async def test_too_many_watchers_is_resource_exhausted() -> None:
    server = await start_cms_server(MemoryStore(), max_watchers=1)
    channel = grpc.aio.insecure_channel(server.address)
    stub = cms_pb2_grpc.ClusterMetadataStub(channel)
    first = Watcher(stub)
    second: Watcher | None = None
    try:
        await eventually(lambda: first.views, what="the first watcher")
        second = Watcher(stub)
        await eventually(lambda: second.ended, what="the second watcher to be refused")
        assert second.error is not None and second.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await first.close()
        if second is not None:
            await second.close()
        await channel.close()
        await server.stop(0)


async def test_health_and_reflection(cms_server: CmsServer) -> None:
    async with grpc.aio.insecure_channel(cms_server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            response = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert response.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = set()
        async for response in call:
            names = {s.name for s in response.list_services_response.service}
            break
        call.cancel()
        assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names


async def test_bad_server_arguments() -> None:
    store = MemoryStore()
    with pytest.raises(ValueError, match="lease_ttl_s"):
        await start_cms_server(store, lease_ttl_s=0)
    with pytest.raises(ValueError, match="watch_refresh_s"):
        await start_cms_server(store, watch_refresh_s=2.0)
    with pytest.raises(ValueError, match="HOST:PORT"):
        await start_cms_server(store, "nowhere")
    with pytest.raises(ValueError, match="auth_token"):
        await start_cms_server(store, auth_token=" ")
    taken = await start_cms_server(store)
    try:
        with pytest.raises(OSError):
            await start_cms_server(store, taken.address)
    finally:
        await taken.stop(0)
