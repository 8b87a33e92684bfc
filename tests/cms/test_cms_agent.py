"""AgentWriter against a real in-process CMS: register, coalesce, heartbeat, re-register, retry, stop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest

from cms.agent import AgentWriter
from cms.memory import MemoryStore
from cms.server import CmsServer, start_cms_server
from cms.store import CmsStore
from cms.testing import free_loopback_port
from tests.cms.conftest import LEASE_TTL_S
from tests.cms.helpers import eventually, make_metadata, make_status

LEASE = 1.0


def make_agent(target: str, instance_id: str = "p0", **kwargs: object) -> AgentWriter:
    options: dict[str, object] = {"heartbeat_interval_s": 0.1, "rpc_timeout_s": 0.5, "backoff_max_s": 0.2}
    options.update(kwargs)
    return AgentWriter(target, make_metadata(instance_id), **options)  # type: ignore[arg-type]


@pytest.fixture
async def memory_cms() -> AsyncIterator[tuple[MemoryStore, CmsServer]]:
    store = MemoryStore()
    server = await start_cms_server(store, lease_ttl_s=LEASE, watch_refresh_s=0.2)
    yield store, server
    await server.stop(0)


async def _status_of(store: CmsStore, instance_id: str = "p0") -> object:
    record = (await store.read_view()).by_id().get(instance_id)
    return record.status if record is not None else None


async def test_registers_and_publishes(cms_server: CmsServer, store: CmsStore) -> None:
    agent = make_agent(cms_server.url)  # the grpc:// form works too
    await agent.start()
    try:
        await eventually(lambda: agent.registered, what="registration")
        assert agent.lease_ttl_s == pytest.approx(LEASE_TTL_S)
        agent.publish(make_status("ignored-id", 3, num_waiting_requests=2))

        async def published() -> bool:
            status = await _status_of(store)
            return status is not None and status.update_id == 3  # type: ignore[attr-defined]

        await eventually(published, what="the published status in the store")
        status = (await store.read_view()).instances[0].status
        assert status is not None and status.instance_id == "p0" and status.num_waiting_requests == 2
    finally:
        await agent.stop()


async def test_publishes_coalesce_latest_wins(memory_cms: tuple[MemoryStore, CmsServer]) -> None:
    store, server = memory_cms
    agent = make_agent(server.address, heartbeat_interval_s=5.0)
    await agent.start()
    try:
        await eventually(lambda: agent.registered, what="registration")
        for update_id in range(1, 201):  # all before the loop gets a turn
            agent.publish(make_status("p0", update_id))

        async def last() -> bool:
            status = await _status_of(store)
            return status is not None and status.update_id == 200  # type: ignore[attr-defined]

        await eventually(last, what="update 200")
        assert agent.reports_sent <= 3
    finally:
        await agent.stop()


async def test_heartbeats_refresh_timestamp_and_keep_lease(memory_cms: tuple[MemoryStore, CmsServer]) -> None:
    store, server = memory_cms
    ticks = iter(range(10**6))
    agent = make_agent(server.address, clock=lambda: 1_000.0 + next(ticks))
    await agent.start()
    try:
        agent.publish(make_status("p0", 9, timestamp_ms=5, num_running_requests=4))
        await eventually(lambda: agent.reports_sent >= 1, what="the first report")
        sent = agent.reports_sent
        # Stay alive across several leases with no new status: heartbeats only.
        loop = asyncio.get_running_loop()
        end = loop.time() + 2 * LEASE
        while loop.time() < end:
            assert [r.instance_id for r in (await store.read_view()).instances] == ["p0"]
            await asyncio.sleep(LEASE / 4)
        status = (await store.read_view()).instances[0].status
        assert status is not None
        assert status.update_id == 9 and status.num_running_requests == 4
        assert status.timestamp_ms >= 1_000_000  # refreshed from the injected clock
        assert agent.reports_sent > sent + 3
        assert agent.registrations == 1
    finally:
        await agent.stop()


async def test_lease_kept_before_any_status(memory_cms: tuple[MemoryStore, CmsServer]) -> None:
    store, server = memory_cms
    agent = make_agent(server.address)
    await agent.start()
    try:
        await eventually(lambda: agent.registered, what="registration")
        loop = asyncio.get_running_loop()
        end = loop.time() + 2 * LEASE
        while loop.time() < end:
            view = await store.read_view()
            assert [r.instance_id for r in view.instances] == ["p0"]
            assert view.instances[0].status is None
            await asyncio.sleep(LEASE / 4)
        assert agent.registrations >= 2  # renewed by re-registering
    finally:
        await agent.stop()


async def test_reregisters_after_not_found_and_resends() -> None:
    # A long lease: only NOT_FOUND, not a lapsed lease, can make the agent re-register in time.
    store = MemoryStore()
    server = await start_cms_server(store, lease_ttl_s=60.0)
    agent = make_agent(server.address)
    await agent.start()
    try:
        agent.publish(make_status("p0", 4, num_decode_requests=3))
        await eventually(lambda: agent.reports_sent >= 1, what="the first report")
        await store.deregister("p0")  # the CMS forgets the instance behind the agent's back

        async def back() -> bool:
            status = await _status_of(store)
            return status is not None and status.num_decode_requests == 3  # type: ignore[attr-defined]

        await eventually(back, timeout_s=5.0, what="re-registration with the last status")
        assert agent.registrations == 2
    finally:
        await agent.stop()
        await server.stop(0)


async def test_start_with_cms_down_then_cms_appears() -> None:
    port = free_loopback_port()
    agent = make_agent(f"127.0.0.1:{port}")
    await agent.start()  # returns at once, does not raise
    agent.publish(make_status("p0", 1))
    store = MemoryStore()
    server: CmsServer | None = None
    try:
        await eventually(lambda: agent.registrations_failed >= 1, what="a failed try")
        assert not agent.registered
        server = await start_cms_server(store, f"127.0.0.1:{port}", lease_ttl_s=LEASE)

        async def arrived() -> bool:
            return await _status_of(store) is not None

        await eventually(arrived, timeout_s=5.0, what="the agent to reach the late CMS")
        assert agent.registered
    finally:
        await agent.stop()
        if server is not None:
            await server.stop(0)


async def test_stop_deregisters_at_once_and_is_idempotent(memory_cms: tuple[MemoryStore, CmsServer]) -> None:
    store, server = memory_cms
    agent = make_agent(server.address)
    await agent.start()
    agent.publish(make_status("p0", 1))
    await eventually(lambda: agent.reports_sent >= 1, what="the first report")
    await asyncio.gather(agent.stop(), agent.stop())
    assert (await store.read_view()).instances == ()
    assert not agent.registered
    await agent.stop()
    agent.publish(make_status("p0", 2))  # after stop: ignored, no error


async def test_stop_with_cms_down_is_bounded() -> None:
    agent = make_agent(f"127.0.0.1:{free_loopback_port()}", rpc_timeout_s=0.3)
    await agent.start()
    await eventually(lambda: agent.registrations_failed >= 1, what="a first attempt")
    await asyncio.wait_for(agent.stop(), 5.0)


async def test_publish_from_another_thread(memory_cms: tuple[MemoryStore, CmsServer]) -> None:
    store, server = memory_cms
    agent = make_agent(server.address)
    await agent.start()
    try:
        await eventually(lambda: agent.registered, what="registration")
        thread = threading.Thread(target=agent.publish, args=(make_status("p0", 77),))
        thread.start()
        thread.join(5.0)

        async def arrived() -> bool:
            status = await _status_of(store)
            return status is not None and status.update_id == 77  # type: ignore[attr-defined]

        await eventually(arrived, what="the status published from a thread")
    finally:
        await agent.stop()


async def test_rejected_status_is_dropped_not_retried(memory_cms: tuple[MemoryStore, CmsServer]) -> None:
    store, server = memory_cms
    agent = AgentWriter(
        server.address,
        make_metadata("p0", kv_capacity_tokens=100),
        heartbeat_interval_s=0.1,
        backoff_max_s=0.2,
    )
    await agent.start()
    try:
        agent.publish(make_status("p0", 1, num_used_kv_tokens=500))  # over capacity: INVALID_ARGUMENT
        await eventually(lambda: agent.reports_failed >= 1, what="the rejection")
        agent.publish(make_status("p0", 2, num_used_kv_tokens=50))

        async def good() -> bool:
            status = await _status_of(store)
            return status is not None and status.update_id == 2  # type: ignore[attr-defined]

        await eventually(good, what="the next good status")
        assert agent.reports_failed == 1
    finally:
        await agent.stop()


async def test_bad_metadata_never_raises_into_the_worker(memory_cms: tuple[MemoryStore, CmsServer]) -> None:
    store, server = memory_cms
    agent = AgentWriter(server.address, make_metadata("p0", endpoint="nowhere"), backoff_max_s=0.1)
    await agent.start()
    agent.publish(make_status("p0", 1))
    await eventually(lambda: agent.registrations_failed >= 3, what="a few refused registrations")
    assert not agent.registered and agent.registrations == 0
    assert (await store.read_view()).instances == ()
    await agent.stop()


def test_constructor_checks() -> None:
    with pytest.raises(ValueError, match="heartbeat_interval_s"):
        AgentWriter("127.0.0.1:1", make_metadata("p0"), heartbeat_interval_s=0)
    with pytest.raises(ValueError, match="instance_id"):
        AgentWriter("127.0.0.1:1", make_metadata(""))
    with pytest.raises(ValueError, match="host:port"):
        AgentWriter("http://127.0.0.1:1", make_metadata("p0"))


async def test_reregisters_after_a_lapsed_lease() -> None:
    store = MemoryStore()
    server = await start_cms_server(store, lease_ttl_s=0.6)
    port = server.port
    agent = make_agent(server.address)
    await agent.start()
    try:
        agent.publish(make_status("p0", 6, num_waiting_requests=1))
        await eventually(lambda: agent.reports_sent >= 1, what="the first report")
        await server.stop(0)

        async def lapsed() -> bool:
            return not (await store.read_view()).instances

        await eventually(lapsed, timeout_s=4.0, what="the lease to lapse while the CMS is away")
        server = await start_cms_server(store, f"127.0.0.1:{port}", lease_ttl_s=0.6)

        async def back() -> bool:
            status = await _status_of(store)
            return status is not None and status.update_id == 6  # type: ignore[attr-defined]

        await eventually(back, what="the agent to re-register and resend its last status")
        assert agent.registrations >= 2
    finally:
        await agent.stop()
        await server.stop(0)
