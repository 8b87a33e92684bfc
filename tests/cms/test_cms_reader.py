"""Router-side readers: memory, grpc:// and redis://; snapshots, versions, loss and recovery."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import pytest

from cms.memory import MemoryStore
from cms.reader import ClusterReader, GrpcClusterReader, open_reader
from cms.redis_store import RedisStore
from cms.server import CmsServer, start_cms_server
from cms.store import CmsStore
from cms.testing import RedisServer
from fleet.snapshot import EMPTY_SNAPSHOT, ClusterSnapshot
from tests.cms.helpers import eventually, make_metadata, make_status, now_offset_ms

LONG = 30.0


def _status_id(snapshot: ClusterSnapshot, instance_id: str) -> int | None:
    record = snapshot.by_id().get(instance_id)
    if record is None or record.status is None:
        return None
    return record.status.update_id


@pytest.fixture(params=["memory", "grpc", "redis"])
async def reader_and_store(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[ClusterReader, CmsStore]]:
    """A reader of each kind, plus the store it ends up reading."""
    server: CmsServer | None = None
    store: CmsStore
    if request.param == "redis":
        store = RedisStore(request.getfixturevalue("redis_server"), cluster_name="readers")
        reader = open_reader(request.getfixturevalue("redis_server"), cluster_name="readers")
    else:
        store = MemoryStore()
        if request.param == "memory":
            reader = open_reader("memory", store=store)
        else:
            server = await start_cms_server(store, watch_refresh_s=0.2)
            reader = open_reader(server.url)
    await reader.start()
    yield reader, store
    await reader.stop()
    await reader.stop()  # idempotent
    if server is not None:
        await server.stop(0)
    await store.close()


async def test_reader_follows_changes(reader_and_store: tuple[ClusterReader, CmsStore]) -> None:
    reader, store = reader_and_store
    assert reader.snapshot() is EMPTY_SNAPSHOT or reader.snapshot().version >= 1
    assert await reader.wait_for_version(1, 5.0)
    await store.register(make_metadata("p0"), LONG)
    await store.register(make_metadata("d0"), LONG)
    await eventually(lambda: len(reader.snapshot().instances) == 2, what="two instances")
    snap = reader.snapshot()
    assert all(r.status is None for r in snap.instances)  # no status yet
    await store.report(make_status("p0", 5), LONG)
    await eventually(lambda: _status_id(reader.snapshot(), "p0") == 5, what="p0's status")
    await store.deregister("d0")
    await eventually(lambda: [r.instance_id for r in reader.snapshot().instances] == ["p0"], what="d0 gone")


async def test_snapshots_are_immutable_and_versions_grow(
    reader_and_store: tuple[ClusterReader, CmsStore],
) -> None:
    reader, store = reader_and_store
    await store.register(make_metadata("p0"), LONG)
    await store.report(make_status("p0", 1), LONG)
    await eventually(lambda: _status_id(reader.snapshot(), "p0") == 1, what="update 1")
    first = reader.snapshot()
    await store.report(make_status("p0", 2), LONG)
    await eventually(lambda: _status_id(reader.snapshot(), "p0") == 2, what="update 2")
    assert _status_id(first, "p0") == 1
    assert reader.snapshot().version > first.version
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.version = 99  # type: ignore[misc]
    # Periodic refreshes arrive without any change.
    assert await reader.wait_for_version(reader.snapshot().version + 2, 5.0)


async def test_ages_grow_while_a_snapshot_is_held(reader_and_store: tuple[ClusterReader, CmsStore]) -> None:
    reader, store = reader_and_store
    await store.register(make_metadata("p0"), LONG)
    await store.report(make_status("p0", 1, timestamp_ms=now_offset_ms()), LONG)
    await eventually(lambda: _status_id(reader.snapshot(), "p0") == 1, what="the status")
    snap = reader.snapshot()
    record = snap.instances[0]
    assert 0 <= snap.age_s(record, snap.taken_at_s) < 1.0
    assert snap.age_s(record, snap.taken_at_s + 10) == pytest.approx(record.status_age_s + 10)


async def test_wait_for_version_times_out() -> None:
    reader = open_reader("memory", store=MemoryStore())
    assert not await reader.wait_for_version(1, 0.05)  # never started: nothing arrives


async def test_grpc_reader_keeps_last_view_and_recovers() -> None:
    store = MemoryStore()
    server = await start_cms_server(store, watch_refresh_s=0.2)
    port = server.port
    reader = GrpcClusterReader(server.url, backoff_max_s=0.2, idle_timeout_s=1.0)
    await reader.start()
    try:
        await store.register(make_metadata("p0"), LONG)
        await store.report(make_status("p0", 3), LONG)
        await eventually(lambda: _status_id(reader.snapshot(), "p0") == 3, what="the status")
        await server.stop(0)
        await eventually(lambda: not reader.connected, what="the reader to notice")
        kept = reader.snapshot()
        assert _status_id(kept, "p0") == 3  # the last view stays
        record = kept.instances[0]
        # The CMS's silence does not age the instances: ages stop at the last view (static stability).
        assert reader.source_lost and kept.source_lost_at_s is not None
        assert kept.age_s(record, kept.taken_at_s + 5) == pytest.approx(record.status_age_s)
        opened = reader.streams_opened
        await eventually(lambda: reader.streams_opened >= opened + 2, what="reconnect attempts")
        assert _status_id(reader.snapshot(), "p0") == 3

        await store.report(make_status("p0", 4), LONG)
        server = await start_cms_server(store, f"127.0.0.1:{port}", watch_refresh_s=0.2)
        await eventually(lambda: _status_id(reader.snapshot(), "p0") == 4, timeout_s=5.0, what="recovery")
        assert reader.connected
        await eventually(lambda: not reader.source_lost, what="ages to run again")
        snap = reader.snapshot()
        assert snap.age_s(snap.instances[0], snap.taken_at_s + 5) > snap.instances[0].status_age_s + 4.9
    finally:
        await reader.stop()
        await server.stop(0)


async def test_redis_reader_keeps_last_view_when_redis_dies(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server)
    reader = open_reader(redis_server, rewarm_s=1.0)
    await reader.start()
    try:
        await store.register(make_metadata("p0"), LONG)
        await store.report(make_status("p0", 1), LONG)
        await eventually(lambda: _status_id(reader.snapshot(), "p0") == 1, what="the status")
        redis_server.stop()
        await eventually(lambda: not reader.connected, what="the reader to notice")
        assert _status_id(reader.snapshot(), "p0") == 1 and reader.source_lost
        redis_server.start()  # back, but empty
        await eventually(lambda: reader.connected, what="the reader to reconnect")
        # While re-warming, the instance the agents have not re-registered yet is carried over ...
        assert _status_id(reader.snapshot(), "p0") == 1
        # ... until rewarm_s is over: then the view is the store's as it is.
        await eventually(lambda: not reader.snapshot().instances, what="the empty view")
        assert not reader.source_lost
    finally:
        await reader.stop()
        await store.close()


def test_open_reader_rejects_bad_specs() -> None:
    with pytest.raises(ValueError, match="store"):
        open_reader("memory")
    with pytest.raises(ValueError, match="grpc://"):
        open_reader("http://127.0.0.1:1")
