"""The control plane goes away under a steady load; requests keep succeeding while the workers are up.

Real processes on loopback: a CMS (``slo-router cms``), sim workers and a router
reading the CMS over gRPC. The router keeps routing on its last view while the
CMS or its Redis is gone (static stability), and a restarted CMS that lost its
state does not empty the fleet while the agents re-register (re-warming).
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from slorouter.v1 import cms_pb2, cms_pb2_grpc

from cms.testing import RedisServer

from .fleet import Fleet, SteadyLoad, failures, wait_for_instances

STALENESS_S = 5.0  # the router's default --instance-staleness-seconds


async def _start_fleet(fleet: Fleet, cms_store: str) -> tuple[str, str]:
    cms = fleet.cms("--store", cms_store)
    workers = [fleet.worker("p0", "prefill", cms.address), fleet.worker("d0", "decode", cms.address)]
    fleet.wait_listening(*workers)
    router = fleet.router(f"grpc://{cms.address}")
    await wait_for_instances(router.address, {"p0", "d0"})
    return cms.address, router.address


@pytest.mark.timeout(120)
async def test_a_cms_kill_fails_no_request(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    try:
        cms_address, router_address = await _start_fleet(fleet, "memory")
        load = SteadyLoad(router_address, rate_hz=10)
        await load.start()
        await load.run_for(2.0)
        cms = fleet.procs[0]
        cms.kill()
        killed = time.monotonic()
        await load.run_for(STALENESS_S + 4.0)  # well past the staleness bound
        # Back on the same address with the memory store: empty until the agents re-register.
        fleet.cms("--store", "memory", listen=cms_address, name="cms-restarted")
        restarted = time.monotonic()
        await load.run_for(6.0)
        outcomes = await load.stop()
    finally:
        fleet.close()
    assert failures(outcomes) == []
    during = [o for o in outcomes if killed + STALENESS_S + 0.5 <= o.started_s < restarted]
    assert len(during) >= 20, "the load must have run through the outage, past the staleness bound"
    assert len(load.since(restarted)) >= 20


@pytest.mark.timeout(180)
async def test_redis_frozen_then_down_for_30_s_fails_no_request(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    fleet = Fleet(tmp_path)
    try:
        cms_address, router_address = await _start_fleet(fleet, redis_server.url)
        load = SteadyLoad(router_address, rate_hz=8)
        await load.start()
        await load.run_for(2.0)

        # Frozen Redis (SIGSTOP): the CMS answers UNAVAILABLE after one Redis timeout, not at the
        # client's deadline.
        redis_server.pause()
        async with grpc.aio.insecure_channel(cms_address) as channel:
            stub = cms_pb2_grpc.ClusterMetadataStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.GetClusterView(cms_pb2.GetClusterViewRequest(), timeout=8.0)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
        await load.run_for(STALENESS_S + 1.0)
        redis_server.resume()
        await load.run_for(3.0)

        # Redis down for 30 s, and back empty.
        redis_server.stop()
        stopped = time.monotonic()
        await load.run_for(30.0)
        redis_server.start()
        restarted = time.monotonic()
        await load.run_for(6.0)
        outcomes = await load.stop()
    finally:
        redis_server.resume()
        fleet.close()
    assert failures(outcomes) == []
    assert len([o for o in outcomes if stopped + STALENESS_S <= o.started_s < restarted]) >= 100
    assert len(load.since(restarted)) >= 20
