"""Store conformance: the same rules, checked against MemoryStore and a real Redis."""

from __future__ import annotations

import asyncio

import pytest
from slorouter.v1 import cms_pb2

from cms.errors import (
    AlreadyExistsError,
    ClockSkewError,
    InstanceNotFoundError,
    InvalidArgumentError,
    PermissionDeniedError,
)
from cms.memory import MemoryStore
from cms.redis_store import RedisStore
from cms.store import CmsStore, open_store
from fleet.snapshot import ClusterSnapshot
from tests.cms import helpers
from tests.cms.helpers import DECODE, eventually, make_metadata, make_status

TTL = 0.6
LONG_TTL = 30.0
U64_MAX = 2**64 - 1


async def _only(store: CmsStore) -> tuple[cms_pb2.InstanceMetadata, cms_pb2.InstanceStatus | None, float]:
    view = await store.read_view()
    assert len(view.instances) == 1, view
    record = view.instances[0]
    return record.metadata, record.status, record.status_age_s


async def test_register_shows_instance_without_status(store: CmsStore) -> None:
    before = await store.read_view()
    await store.register(make_metadata("p0"), LONG_TTL)
    view = await store.read_view()
    assert [r.instance_id for r in view.instances] == ["p0"]
    assert view.instances[0].status is None
    assert view.instances[0].metadata == make_metadata("p0")
    assert view.version > before.version


async def test_status_for_unregistered_instance_is_not_found(store: CmsStore) -> None:
    with pytest.raises(InstanceNotFoundError, match="register it again"):
        await store.report(make_status("ghost"), LONG_TTL)
    assert (await store.read_view()).instances == ()


async def test_newer_update_id_replaces_whole_status(store: CmsStore) -> None:
    await store.register(make_metadata("p0"), LONG_TTL)
    assert await store.report(
        make_status("p0", 1, num_waiting_requests=3, admitted_request_ids=["a"]), LONG_TTL
    )
    assert await store.report(make_status("p0", 2, timestamp_ms=2_000, num_running_requests=5), LONG_TTL)
    _, status, _ = await _only(store)
    assert status == make_status("p0", 2, timestamp_ms=2_000, num_running_requests=5)


async def test_a_preemption_count_round_trips_and_unreported_differs_from_zero(store: CmsStore) -> None:
    await store.register(make_metadata("p0"), LONG_TTL)
    await store.register(make_metadata("p1"), LONG_TTL)
    await store.report(make_status("p0", 1, num_preemptions=0), LONG_TTL)
    await store.report(make_status("p1", 1), LONG_TTL)
    statuses = {r.instance_id: r.status for r in (await store.read_view()).instances}
    assert statuses["p0"] is not None and statuses["p0"].HasField("num_preemptions")
    assert statuses["p0"].num_preemptions == 0
    assert statuses["p1"] is not None and not statuses["p1"].HasField("num_preemptions")
    # A newer status carries the count on; a heartbeat keeps it.
    await store.report(make_status("p0", 2, timestamp_ms=2_000, num_preemptions=17), LONG_TTL)
    await store.report(make_status("p0", 2, timestamp_ms=3_000), LONG_TTL)
    status = {r.instance_id: r.status for r in (await store.read_view()).instances}["p0"]
    assert status is not None and status.num_preemptions == 17


@pytest.mark.parametrize("update_id", [7, 3], ids=["equal", "older"])
async def test_not_newer_update_id_is_a_heartbeat(store: CmsStore, update_id: int) -> None:
    await store.register(make_metadata("p0"), LONG_TTL)
    await store.report(make_status("p0", 7, timestamp_ms=1_000, num_waiting_requests=3), LONG_TTL)
    beat = make_status("p0", update_id, timestamp_ms=2_500, schedulable=False, num_waiting_requests=99)
    assert await store.report(beat, LONG_TTL) is False
    _, status, _ = await _only(store)
    assert status is not None
    # Only the timestamp and schedulable move; the load stays from update 7.
    assert status == make_status("p0", 7, timestamp_ms=2_500, schedulable=False, num_waiting_requests=3)


async def test_late_heartbeat_cannot_roll_back_schedulable(store: CmsStore) -> None:
    await store.register(make_metadata("p0"), LONG_TTL)
    await store.report(make_status("p0", 2, timestamp_ms=2_500, schedulable=False), LONG_TTL)
    assert await store.report(make_status("p0", 2, timestamp_ms=2_000, schedulable=True), LONG_TTL) is False
    _, status, _ = await _only(store)
    expected = make_status("p0", 2, timestamp_ms=2_500).timestamp_ms
    assert status is not None and status.timestamp_ms == expected and not status.schedulable


async def test_update_ids_compare_as_full_uint64(store: CmsStore) -> None:
    await store.register(make_metadata("p0"), LONG_TTL)
    assert await store.report(make_status("p0", 9), LONG_TTL)
    assert await store.report(make_status("p0", 10), LONG_TTL)  # longer decimal, not lexically smaller
    assert await store.report(make_status("p0", U64_MAX - 1), LONG_TTL)
    assert await store.report(make_status("p0", U64_MAX), LONG_TTL)
    assert not await store.report(make_status("p0", U64_MAX - 1, timestamp_ms=2_000), LONG_TTL)
    _, status, _ = await _only(store)
    assert status is not None and status.update_id == U64_MAX


async def test_reregister_replaces_metadata_and_keeps_status(store: CmsStore) -> None:
    await store.register(make_metadata("p0", endpoint="10.0.0.2:9001"), LONG_TTL)
    await store.report(make_status("p0", 4, num_decode_requests=2), LONG_TTL)
    moved = make_metadata("p0", endpoint="10.0.0.2:9001", role=DECODE, labels={"zone": "b"})
    await store.register(moved, LONG_TTL)
    metadata, status, _ = await _only(store)
    assert metadata == moved
    assert status == make_status("p0", 4, num_decode_requests=2)


async def test_identical_reregister_only_renews(store: CmsStore) -> None:
    await store.register(make_metadata("p0", labels={"a": "1", "b": "2"}), LONG_TTL)
    version = (await store.read_view()).version
    await store.register(make_metadata("p0", labels={"b": "2", "a": "1"}), LONG_TTL)
    assert (await store.read_view()).version == version


async def test_deregister_removes_at_once(store: CmsStore) -> None:
    await store.register(make_metadata("p0"), LONG_TTL)
    await store.register(make_metadata("p1"), LONG_TTL)
    await store.report(make_status("p0"), LONG_TTL)
    assert await store.deregister("p0") is True
    assert [r.instance_id for r in (await store.read_view()).instances] == ["p1"]
    assert await store.deregister("p0") is False
    with pytest.raises(InstanceNotFoundError):
        await store.report(make_status("p0", 2), LONG_TTL)


async def test_lapsed_lease_removes_instance_and_its_status(store: CmsStore) -> None:
    await store.register(make_metadata("p0"), TTL)
    await store.report(make_status("p0"), TTL)
    await store.register(make_metadata("keep"), LONG_TTL)

    async def gone() -> bool:
        return [r.instance_id for r in (await store.read_view()).instances] == ["keep"]

    await eventually(gone, timeout_s=TTL + 3, what="p0's lease to lapse")
    with pytest.raises(InstanceNotFoundError):
        await store.report(make_status("p0", 2), TTL)
    await store.register(make_metadata("p0"), TTL)
    view = await store.read_view()
    assert view.by_id()["p0"].status is None  # the lapsed status did not come back


@pytest.mark.parametrize("renew", ["status", "heartbeat", "register"])
async def test_writes_renew_the_lease(store: CmsStore, renew: str) -> None:
    ttl = 0.8
    await store.register(make_metadata("p0"), ttl)
    await store.report(make_status("p0", 1), ttl)
    loop = asyncio.get_running_loop()
    end = loop.time() + 1.5 * ttl
    update_id = 1
    while loop.time() < end:  # bounded: a lease and a half of renewals, one every eighth of a lease
        if renew == "status":
            update_id += 1
            await store.report(make_status("p0", update_id), ttl)
        elif renew == "heartbeat":
            await store.report(make_status("p0", 1, timestamp_ms=helpers.now_offset_ms()), ttl)
        else:
            await store.register(make_metadata("p0"), ttl)
        assert [r.instance_id for r in (await store.read_view()).instances] == ["p0"]
        await asyncio.sleep(ttl / 8)


async def test_status_age_is_the_age_of_its_measurement(store: CmsStore) -> None:
    await store.register(make_metadata("p0"), LONG_TTL)
    await store.report(make_status("p0", 1), LONG_TTL)
    _, _, age = await _only(store)
    assert 0 <= age < 1.0

    async def aged() -> float:
        return (await _only(store))[2] >= 0.2

    await eventually(aged, what="the status age to grow")
    await store.report(
        make_status("p0", 1, timestamp_ms=helpers.now_offset_ms()), LONG_TTL
    )  # heartbeat: fresh again
    _, _, age = await _only(store)
    assert age < 0.2
    # A report that repeats an old measurement (30 s old) stays as old as the measurement,
    # although the store has just received it.
    await store.report(make_status("p0", 2, timestamp_ms=1_000 - 30_000), LONG_TTL)
    _, _, age = await _only(store)
    assert age >= 30.0


async def test_version_moves_on_changes_not_on_plain_heartbeats(store: CmsStore) -> None:
    await store.register(make_metadata("p0"), LONG_TTL)
    await store.report(make_status("p0", 1, timestamp_ms=1_000), LONG_TTL)
    v1 = (await store.read_view()).version
    await store.report(make_status("p0", 1, timestamp_ms=2_000), LONG_TTL)
    assert (await store.read_view()).version == v1
    await store.report(make_status("p0", 1, timestamp_ms=3_000, schedulable=False), LONG_TTL)
    v2 = (await store.read_view()).version
    assert v2 > v1
    await store.report(make_status("p0", 2, timestamp_ms=3_000, schedulable=False), LONG_TTL)
    assert (await store.read_view()).version > v2


async def test_kv_use_above_registered_capacity_is_invalid(store: CmsStore) -> None:
    await store.register(make_metadata("p0", kv_capacity_tokens=1000), LONG_TTL)
    await store.report(make_status("p0", 1, num_used_kv_tokens=1000), LONG_TTL)
    with pytest.raises(InvalidArgumentError, match=r"num_used_kv_tokens 1001 .*kv_capacity_tokens 1000"):
        await store.report(make_status("p0", 2, num_used_kv_tokens=1001), LONG_TTL)
    _, status, _ = await _only(store)
    assert status is not None and status.update_id == 1
    # Capacity 0 means unknown: no bound.
    await store.register(make_metadata("p1", kv_capacity_tokens=0), LONG_TTL)
    assert await store.report(make_status("p1", 1, num_used_kv_tokens=10**15), LONG_TTL)


async def test_view_is_sorted_and_complete(store: CmsStore) -> None:
    ids = [f"i{n:02d}" for n in range(20)]
    for iid in reversed(ids):
        await store.register(make_metadata(iid), LONG_TTL)
        if int(iid[1:]) % 2:
            await store.report(make_status(iid, 5), LONG_TTL)
    view = await store.read_view()
    assert [r.instance_id for r in view.instances] == ids
    assert [r.status is not None for r in view.instances] == [n % 2 == 1 for n in range(20)]


async def test_wait_changed_wakes_on_change_and_times_out_otherwise(store: CmsStore) -> None:
    await store.register(make_metadata("p0"), LONG_TTL)
    version = (await store.read_view()).version
    loop = asyncio.get_running_loop()
    start = loop.time()
    await store.wait_changed(version, 0.2)
    assert loop.time() - start >= 0.15  # nothing changed: waited out the timeout
    await asyncio.wait_for(store.wait_changed(version - 1, 10.0), 2.0)  # already different: at once
    await store.wait_changed(version, 0.05)  # (the Redis store now holds a standing subscription)
    await asyncio.wait_for(store.wait_changed(version - 1, 10.0), 2.0)

    waiter = asyncio.create_task(store.wait_changed(version, 10.0))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    await store.report(make_status("p0", 1), LONG_TTL)
    await asyncio.wait_for(waiter, 5.0)


async def test_snapshot_is_immutable_value(store: CmsStore) -> None:
    await store.register(make_metadata("p0"), LONG_TTL)
    await store.report(make_status("p0", 1, num_waiting_requests=1), LONG_TTL)
    first = await store.read_view()
    await store.report(make_status("p0", 2, num_waiting_requests=2), LONG_TTL)
    assert isinstance(first, ClusterSnapshot)
    status = first.instances[0].status
    assert status is not None and status.num_waiting_requests == 1


async def test_store_copies_what_it_is_given() -> None:
    store = MemoryStore()
    metadata = make_metadata("p0")
    status = make_status("p0", 1, num_waiting_requests=1)
    await store.register(metadata, LONG_TTL)
    await store.report(status, LONG_TTL)
    metadata.endpoint = "mutated:1"
    status.num_waiting_requests = 42
    record = (await store.read_view()).instances[0]
    assert record.metadata.endpoint == "127.0.0.1:9000"
    assert record.status is not None and record.status.num_waiting_requests == 1


async def test_memory_store_with_fake_clock_expires_and_ages_exactly() -> None:
    now = [100.0]
    wall0 = make_status("p0", 1).timestamp_ms / 1000
    store = MemoryStore(clock=lambda: now[0], wall_clock=lambda: wall0 + now[0] - 100.0)
    await store.register(make_metadata("p0"), 2.0)
    await store.report(make_status("p0", 1), 2.0)
    now[0] = 101.5
    view = await store.read_view()
    assert view.taken_at_s == 101.5
    assert view.instances[0].status_age_s == pytest.approx(1.5)
    assert view.age_s(view.instances[0], 103.0) == pytest.approx(3.0)
    await store.report(make_status("p0", 1, timestamp_ms=2_500), 2.0)  # heartbeat measured at 101.5
    now[0] = 103.4
    assert len((await store.read_view()).instances) == 1
    now[0] = 103.5
    assert (await store.read_view()).instances == ()


async def test_bad_lease_ttl_is_a_programming_error() -> None:
    store = MemoryStore()
    with pytest.raises(ValueError, match="lease_ttl_s"):
        await store.register(make_metadata("p0"), 0)


def test_open_store_specs(redis_server: str) -> None:
    assert isinstance(open_store("memory"), MemoryStore)
    with pytest.raises(ValueError, match="memory"):
        open_store("postgres://x")
    with pytest.raises(ValueError, match="cluster_name"):
        RedisStore(redis_server, cluster_name="bad name{}")


# -- Redis-specific layout and sharing ------------------------------------------------------------


async def test_redis_layout_namespaced_separate_keys_with_ttl(redis_server: str) -> None:
    import redis.asyncio as aioredis

    store = RedisStore(redis_server, cluster_name="alpha")
    other = RedisStore(redis_server, cluster_name="beta")
    raw = aioredis.Redis.from_url(redis_server)
    try:
        await store.register(make_metadata("p0"), 10.0)
        await store.report(make_status("p0", 1), 10.0)
        keys = sorted(k.decode() for k in await raw.keys("*"))
        assert keys == [
            "slorouter:{alpha}:epochs",
            "slorouter:{alpha}:instances",
            "slorouter:{alpha}:meta:p0",
            "slorouter:{alpha}:status:p0",
            "slorouter:{alpha}:version",
        ]
        for kind in ("meta", "status"):
            ttl_ms = await raw.pttl(store.key(kind, "p0"))
            assert 0 < ttl_ms <= 10_000
        assert (await other.read_view()).instances == ()  # another cluster sees nothing
    finally:
        await raw.aclose()
        await store.close()
        await other.close()


async def test_redis_replicas_share_one_view_and_survive_restart(redis_server: str) -> None:
    first = RedisStore(redis_server, cluster_name="shared")
    second = RedisStore(redis_server, cluster_name="shared")
    try:
        await first.register(make_metadata("p0"), LONG_TTL)
        await second.report(make_status("p0", 3), LONG_TTL)  # written through another replica
        waiter = asyncio.create_task(second.wait_changed((await second.read_view()).version, 10.0))
        await asyncio.sleep(0.05)
        await first.report(make_status("p0", 4), LONG_TTL)
        await asyncio.wait_for(waiter, 5.0)  # pub/sub woke the other replica
        await first.close()
        restarted = RedisStore(redis_server, cluster_name="shared")  # a CMS restart: a new client
        try:
            view = await restarted.read_view()
            status = view.instances[0].status
            assert status is not None and status.update_id == 4
        finally:
            await restarted.close()
    finally:
        await first.close()
        await second.close()


async def test_a_live_id_cannot_move_to_another_endpoint(store: CmsStore) -> None:
    await store.register(make_metadata("d0", endpoint="127.0.0.1:9000"), LONG_TTL)
    with pytest.raises(AlreadyExistsError, match=r"127\.0\.0\.1:9000"):
        await store.register(make_metadata("d0", endpoint="127.0.0.1:6666"), LONG_TTL)
    (record,) = (await store.read_view()).instances
    assert record.metadata.endpoint == "127.0.0.1:9000"
    # Free again once its owner deregisters it.
    assert await store.deregister("d0")
    await store.register(make_metadata("d0", endpoint="127.0.0.1:6666"), LONG_TTL)
    (record,) = (await store.read_view()).instances
    assert record.metadata.endpoint == "127.0.0.1:6666"


async def test_a_lapsed_id_is_free_for_another_owner(store: CmsStore) -> None:
    await store.register(make_metadata("d0", endpoint="127.0.0.1:9000"), 0.2, owner="a")
    await eventually(lambda: _no_instances(store), what="the lease to lapse")
    await store.register(make_metadata("d0", endpoint="127.0.0.1:6666"), LONG_TTL, owner="b")
    with pytest.raises(PermissionDeniedError):
        await store.report(make_status("d0", 1), LONG_TTL, owner="a")


async def _no_instances(store: CmsStore) -> bool:
    return (await store.read_view()).instances == ()


async def test_only_the_owner_writes_an_instance(store: CmsStore) -> None:
    await store.register(make_metadata("d0"), LONG_TTL, owner="worker.d0")
    await store.report(make_status("d0", 1), LONG_TTL, owner="worker.d0")
    with pytest.raises(PermissionDeniedError, match="another credential"):
        await store.register(make_metadata("d0"), LONG_TTL, owner="worker.p0")
    with pytest.raises(PermissionDeniedError):
        await store.report(make_status("d0", U64_MAX), LONG_TTL, owner="worker.p0")
    with pytest.raises(PermissionDeniedError):
        await store.deregister("d0", owner="worker.p0")
    _, status, _ = await _only(store)
    assert status is not None and status.update_id == 1
    assert await store.deregister("d0", owner="worker.d0")


async def test_a_reregistration_starts_a_new_epoch(store: CmsStore) -> None:
    first = await store.register(make_metadata("d0"), LONG_TTL)
    assert await store.report(make_status("d0", U64_MAX), LONG_TTL)  # poisoned
    assert not await store.report(make_status("d0", 5, timestamp_ms=1_100), LONG_TTL)
    second = await store.register(make_metadata("d0"), LONG_TTL)  # the worker restarted
    assert second > first
    assert await store.report(make_status("d0", 5, timestamp_ms=1_200, epoch=second), LONG_TTL)
    assert await store.report(make_status("d0", 6, timestamp_ms=1_300, epoch=second), LONG_TTL)
    # A late report of the old registration neither updates nor renews anything.
    assert not await store.report(make_status("d0", U64_MAX, timestamp_ms=1_400, epoch=first), LONG_TTL)
    _, status, _ = await _only(store)
    assert status is not None and status.update_id == 6
    with pytest.raises(InstanceNotFoundError, match="register it again"):
        await store.report(make_status("d0", 7, epoch=second + 1000), LONG_TTL)


async def test_a_timestamp_in_the_future_is_refused_as_clock_skew(store: CmsStore) -> None:
    await store.register(make_metadata("d0"), LONG_TTL)
    with pytest.raises(ClockSkewError, match="ahead of this CMS's clock"):
        await store.report(make_status("d0", 1, timestamp_ms=1_000 + 60_000), LONG_TTL)
    assert (await _only(store))[1] is None
    assert await store.report(make_status("d0", 1, timestamp_ms=1_000 + 500), LONG_TTL)  # within the bound
