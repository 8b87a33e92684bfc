"""Fixtures for the CMS tests: both stores, a server over each, a stub, and a task-leak check."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import grpc
import pytest
from slorouter.v1 import cms_pb2_grpc

from cms.memory import MemoryStore
from cms.redis_store import RedisStore
from cms.server import CmsServer, start_cms_server
from cms.store import CmsStore
from tests.cms import helpers

#: Short leases keep the suite fast (every lease test polls with a bounded deadline), yet long
#: enough that a starved event loop on a busy machine does not lapse a lease by accident.
LEASE_TTL_S = 1.0

_cluster_names = itertools.count()


@pytest.fixture(autouse=True)
def fresh_status_clock() -> None:
    """Status timestamps of this test count from now (see ``helpers.make_status``)."""
    helpers.reset_status_clock()


@pytest.fixture(autouse=True)
async def no_leaked_tasks() -> AsyncIterator[None]:
    """Every background loop a test starts must be stopped by the end of it."""
    before = asyncio.all_tasks()
    yield
    # Let cancelled tasks finish: gRPC's own call tasks take a few turns of the loop after a
    # server stop (more on a loaded machine); a real leak is still running a second later.
    for _ in range(100):
        await asyncio.sleep(0.01 if _ else 0)
        leaked = [t for t in asyncio.all_tasks() - before if t is not asyncio.current_task() and not t.done()]
        if not leaked:
            break
    assert not leaked, f"tasks left running: {leaked}"


@pytest.fixture(params=["memory", "redis"])
def store_kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    return kind


@pytest.fixture
async def store(store_kind: str, request: pytest.FixtureRequest) -> AsyncIterator[CmsStore]:
    """The same conformance cases run against each backend."""
    backend: CmsStore
    if store_kind == "memory":
        backend = MemoryStore()
    else:
        redis_url = request.getfixturevalue("redis_server")
        backend = RedisStore(redis_url, cluster_name=f"test{next(_cluster_names)}")
    yield backend
    await backend.close()


@pytest.fixture
async def cms_server(store: CmsStore) -> AsyncIterator[CmsServer]:
    server = await start_cms_server(store, lease_ttl_s=LEASE_TTL_S, watch_refresh_s=0.2)
    yield server
    await server.stop(0)


@pytest.fixture
async def stub(cms_server: CmsServer) -> AsyncIterator[cms_pb2_grpc.ClusterMetadataAsyncStub]:
    channel = grpc.aio.insecure_channel(cms_server.address)
    yield cms_pb2_grpc.ClusterMetadataStub(channel)
    await channel.close()
