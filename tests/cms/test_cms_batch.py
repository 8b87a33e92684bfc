"""ReportStatuses: many statuses per call, the same auth, bounds and store semantics as ReportStatus.

Real CMS gRPC servers on 127.0.0.1 port 0; the fallback case serves the service without the
batched method, as a CMS from before it does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from slorouter.v1 import cms_pb2, cms_pb2_grpc

from cms import limits
from cms.agent import AgentWriter, StatusBatcher
from cms.auth import TokenTable
from cms.memory import MemoryStore
from cms.server import SERVICE_NAME, CmsServer, start_cms_server
from cms.store import CmsStore
from tests.cms.helpers import eventually, make_metadata, make_status

ADMIN = "admin-token-0123456789abcdef0123"
NODE = "node-a-token-0123456789abcdef012"
TOKENS = TokenTable.of([("node-a", NODE, "write:a0,a1"), ("admin", ADMIN)])


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@pytest.fixture
async def cms() -> AsyncIterator[tuple[MemoryStore, CmsServer]]:
    store = MemoryStore()
    server = await start_cms_server(store, tokens=TOKENS, lease_ttl_s=5.0)
    yield store, server
    await server.stop(0)


async def _view(stub: cms_pb2_grpc.ClusterMetadataAsyncStub) -> dict[str, cms_pb2.InstanceState]:
    view = await stub.GetClusterView(cms_pb2.GetClusterViewRequest(), metadata=_bearer(ADMIN), timeout=5)
    return {state.metadata.instance_id: state for state in view.instances}


async def _register(stub: cms_pb2_grpc.ClusterMetadataAsyncStub, token: str, *ids: str) -> None:
    for iid in ids:
        await stub.RegisterInstance(
            cms_pb2.RegisterInstanceRequest(metadata=make_metadata(iid)), metadata=_bearer(token), timeout=5
        )


async def test_batch_is_stored_and_visible_in_the_view(cms: tuple[MemoryStore, CmsServer]) -> None:
    _, server = cms
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = cms_pb2_grpc.ClusterMetadataStub(channel)
        await _register(stub, NODE, "a0", "a1")
        response = await stub.ReportStatuses(
            cms_pb2.ReportStatusesRequest(
                statuses=[
                    make_status("a0", 7, num_running_requests=3),
                    make_status("a1", 9, num_waiting_requests=2),
                ]
            ),
            metadata=_bearer(NODE),
            timeout=5,
        )
        assert [(o.accepted, o.code) for o in response.outcomes] == [(True, 0), (True, 0)]
        view = await _view(stub)
        assert view["a0"].has_status and view["a0"].status.update_id == 7
        assert view["a0"].status.num_running_requests == 3
        assert view["a1"].status.update_id == 9 and view["a1"].status.num_waiting_requests == 2
        # Same store semantics as ReportStatus: an id that is not newer is a heartbeat, and an
        # unregistered instance gets NOT_FOUND for its own status only.
        await _register(stub, ADMIN, "z9")
        await stub.DeregisterInstance(
            cms_pb2.DeregisterInstanceRequest(instance_id="z9"), metadata=_bearer(ADMIN), timeout=5
        )
        response = await stub.ReportStatuses(
            cms_pb2.ReportStatusesRequest(statuses=[make_status("a0", 7), make_status("z9", 1)]),
            metadata=_bearer(ADMIN),
            timeout=5,
        )
        # a0 belongs to node-a: the admin token may write any id, but the store refuses another owner.
        codes = [grpc.StatusCode.PERMISSION_DENIED.value[0], grpc.StatusCode.NOT_FOUND.value[0]]
        assert [o.code for o in response.outcomes] == codes
        assert "register it again" in response.outcomes[1].message
        response = await stub.ReportStatuses(
            cms_pb2.ReportStatusesRequest(statuses=[make_status("a0", 7)]), metadata=_bearer(NODE), timeout=5
        )
        assert [(o.accepted, o.code) for o in response.outcomes] == [(False, 0)]


async def test_one_foreign_id_refuses_the_whole_batch(cms: tuple[MemoryStore, CmsServer]) -> None:
    _, server = cms
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = cms_pb2_grpc.ClusterMetadataStub(channel)
        await _register(stub, NODE, "a0")
        await _register(stub, ADMIN, "b0")
        batch = cms_pb2.ReportStatusesRequest(statuses=[make_status("a0", 5), make_status("b0", 5)])
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ReportStatuses(batch, metadata=_bearer(NODE), timeout=5)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "'b0'" in (refused.value.details() or "")
        view = await _view(stub)
        assert not view["a0"].has_status and not view["b0"].has_status  # nothing of it was stored


async def test_malformed_status_refuses_the_whole_batch_naming_it(cms: tuple[MemoryStore, CmsServer]) -> None:
    _, server = cms
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = cms_pb2_grpc.ClusterMetadataStub(channel)
        await _register(stub, NODE, "a0", "a1")
        bad = make_status("a1", 5, admitted_request_ids=["r"] * (limits.MAX_ADMITTED_REQUEST_IDS + 1))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ReportStatuses(
                cms_pb2.ReportStatusesRequest(statuses=[make_status("a0", 5), bad]),
                metadata=_bearer(NODE),
                timeout=5,
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (refused.value.details() or "").startswith("statuses[1]: ")
        assert "admitted_request_ids" in (refused.value.details() or "")
        assert not (await _view(stub))["a0"].has_status


async def test_oversize_batch_is_refused_naming_the_field(cms: tuple[MemoryStore, CmsServer]) -> None:
    _, server = cms
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = cms_pb2_grpc.ClusterMetadataStub(channel)
        await _register(stub, NODE, "a0")
        statuses = [make_status("a0", k) for k in range(1, limits.MAX_REPORT_BATCH + 2)]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ReportStatuses(
                cms_pb2.ReportStatusesRequest(statuses=statuses), metadata=_bearer(NODE), timeout=5
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = refused.value.details() or ""
        assert details.startswith("statuses: ") and str(limits.MAX_REPORT_BATCH) in details
        assert not (await _view(stub))["a0"].has_status
        full = await stub.ReportStatuses(
            cms_pb2.ReportStatusesRequest(statuses=statuses[: limits.MAX_REPORT_BATCH]),
            metadata=_bearer(NODE),
            timeout=5,
        )
        assert len(full.outcomes) == limits.MAX_REPORT_BATCH  # the bound itself is accepted


def _without_batch(service: cms_pb2_grpc.ClusterMetadataServicer) -> Any:
    """The unary methods of the service as a CMS from before ReportStatuses served them."""
    pairs: dict[str, tuple[Any, Any]] = {
        "RegisterInstance": (cms_pb2.RegisterInstanceRequest, cms_pb2.RegisterInstanceResponse),
        "ReportStatus": (cms_pb2.ReportStatusRequest, cms_pb2.ReportStatusResponse),
        "DeregisterInstance": (cms_pb2.DeregisterInstanceRequest, cms_pb2.DeregisterInstanceResponse),
        "GetClusterView": (cms_pb2.GetClusterViewRequest, cms_pb2.ClusterView),
    }
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(service, name),
            request_deserializer=request.FromString,
            response_serializer=response.SerializeToString,
        )
        for name, (request, response) in pairs.items()
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


def _stored(store: MemoryStore, iid: str, update_id: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        record = (await store.read_view()).by_id().get(iid)
        return record is not None and record.status is not None and record.status.update_id == update_id

    return check


async def test_agent_uses_the_batch_and_falls_back_to_unary_on_an_old_cms() -> None:
    store = MemoryStore()
    new = await start_cms_server(store, lease_ttl_s=5.0)
    old = grpc.aio.server()
    old.add_generic_rpc_handlers((_without_batch(new.service),))
    port = old.add_insecure_port("127.0.0.1:0")
    await old.start()
    try:
        for target, batched in ((new.address, True), (f"127.0.0.1:{port}", False)):
            iid = "new0" if batched else "old0"
            agent = AgentWriter(target, make_metadata(iid), heartbeat_interval_s=0.1, rpc_timeout_s=2.0)
            async with agent:
                agent.publish(make_status(iid, 3, num_running_requests=4))

                found: bool = await eventually(_stored(store, iid, 3), timeout_s=10)
                assert found
                assert agent.batched is batched
                assert agent.reports_sent >= 1 and agent.reports_failed == 0
    finally:
        await old.stop(0)
        await new.stop(0)


async def test_batch_on_each_store(store: CmsStore) -> None:
    """Memory and Redis alike: a batch larger than the store-write concurrency lands whole."""
    server = await start_cms_server(store, lease_ttl_s=5.0)
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = cms_pb2_grpc.ClusterMetadataStub(channel)
            ids = [f"s{k}" for k in range(100)]
            for iid in ids:
                await stub.RegisterInstance(
                    cms_pb2.RegisterInstanceRequest(metadata=make_metadata(iid)), timeout=5
                )
            statuses = [make_status(iid, 11 + k) for k, iid in enumerate(ids)]
            response = await stub.ReportStatuses(cms_pb2.ReportStatusesRequest(statuses=statuses), timeout=10)
            assert (
                all(o.accepted and o.code == 0 for o in response.outcomes) and len(response.outcomes) == 100
            )
            view = await stub.GetClusterView(cms_pb2.GetClusterViewRequest(), timeout=5)
            got = {s.metadata.instance_id: s.status.update_id for s in view.instances}
            assert got == {iid: 11 + k for k, iid in enumerate(ids)}
    finally:
        await server.stop(0)


async def test_writers_sharing_a_batcher_send_together_and_fall_back() -> None:
    store = MemoryStore()
    new = await start_cms_server(store, lease_ttl_s=5.0)
    old = grpc.aio.server()
    old.add_generic_rpc_handlers((_without_batch(new.service),))
    port = old.add_insecure_port("127.0.0.1:0")
    await old.start()
    try:
        async with grpc.aio.insecure_channel(new.address) as channel:
            await _register(cms_pb2_grpc.ClusterMetadataStub(channel), ADMIN, *[f"n{k}" for k in range(3)])
        for target, batched in ((new.address, True), (f"127.0.0.1:{port}", False)):
            batcher = StatusBatcher(target, rpc_timeout_s=2.0)
            try:
                # Three reports made together leave in one call (the batcher has no timer: the
                # call goes once the loop runs it, by when all three are queued).
                results = await asyncio.gather(
                    *(batcher.report(make_status(f"n{k}", 20 + k)) for k in range(3))
                )
                assert results == [(grpc.StatusCode.OK, "")] * 3
                assert batcher.batched is batched
                assert (batcher.calls, batcher.statuses) == ((1, 3) if batched else (0, 0))
                missing = await batcher.report(make_status("never-registered", 1))
                assert missing[0] == grpc.StatusCode.NOT_FOUND
            finally:
                await batcher.close()
        # Writers on one batcher: each registers itself, their statuses share the connection.
        batcher = StatusBatcher(new.address, rpc_timeout_s=2.0)
        writers = [AgentWriter(new.address, make_metadata(f"w{k}"), batcher=batcher) for k in range(4)]
        try:
            for k, writer in enumerate(writers):
                await writer.start()
                writer.publish(make_status(f"w{k}", 5))
            for k in range(4):
                found: bool = await eventually(_stored(store, f"w{k}", 5), timeout_s=10)
                assert found
            assert batcher.statuses >= 4 and all(w.batched for w in writers)
        finally:
            for writer in writers:
                await writer.stop()
            await batcher.close()
    finally:
        await old.stop(0)
        await new.stop(0)


async def test_batcher_splits_by_bytes_below_the_message_limit() -> None:
    store = MemoryStore()
    server = await start_cms_server(store, lease_ttl_s=5.0)
    batcher = StatusBatcher(server.address, rpc_timeout_s=5.0)
    try:
        ids = [f"big{k}" for k in range(24)]
        async with grpc.aio.insecure_channel(server.address) as channel:
            await _register(cms_pb2_grpc.ClusterMetadataStub(channel), ADMIN, *ids)
        long_ids = ["r" * limits.MAX_ID_BYTES] * limits.MAX_ADMITTED_REQUEST_IDS  # ~66 KB a status
        statuses = [make_status(iid, 2, admitted_request_ids=long_ids) for iid in ids]
        assert sum(s.ByteSize() for s in statuses) > limits.CMS_MAX_RECEIVE_BYTES  # one call would not fit
        results = await asyncio.gather(*(batcher.report(s) for s in statuses))
        assert results == [(grpc.StatusCode.OK, "")] * len(ids)
        assert batcher.calls >= 2 and batcher.statuses == len(ids)
    finally:
        await batcher.close()
        await server.stop(0)
