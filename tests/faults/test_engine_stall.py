"""A worker whose engine stalls while its agent keeps heart-beating stops getting requests, and gets them again.

The pieces run in this process (real gRPC servers on loopback, sim engines,
the CMS with the memory store, the router): the sim engine's ``stall()``
fault hook stops its step loop deterministically.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest

from cms.memory import MemoryStore
from cms.reader import ClusterReader, open_reader
from cms.server import start_cms_server
from router.core.config import SchedulerConfig
from router.core.scheduler import Scheduler
from router.server import RouterServer, start_router_server
from router.service import ServiceConfig
from tests.router.e2e.cluster import PREDICTOR, sim_config
from workers.kv_transfer import GrpcKvPeer
from workers.metadata import WorkerIdentity, WorkerRole
from workers.service import WorkerServer, start_worker_server
from workers.sim_engine import SimEngine

from .fleet import SteadyLoad, failures

ENGINE_STALL_S = 0.5


@dataclass
class Pieces:
    router: RouterServer
    engines: dict[str, SimEngine]

    def status(self, instance_id: str):  # type: ignore[no-untyped-def]
        return self.router.reader.snapshot().by_id()[instance_id].status


@asynccontextmanager
async def _pieces() -> AsyncIterator[Pieces]:
    store = MemoryStore()
    cms = await start_cms_server(store, "127.0.0.1:0", lease_ttl_s=3.0)
    workers: list[WorkerServer] = []
    engines: dict[str, SimEngine] = {}
    router: RouterServer | None = None
    try:
        for i, (instance_id, role) in enumerate(
            (("p0", WorkerRole.PREFILL), ("d0", WorkerRole.DECODE), ("d1", WorkerRole.DECODE))
        ):
            engine = SimEngine(sim_config(), PREDICTOR, kv_peer=GrpcKvPeer(), rng=random.Random(i))
            engines[instance_id] = engine
            workers.append(
                await start_worker_server(
                    engine,
                    "127.0.0.1:0",
                    identity=WorkerIdentity(instance_id=instance_id, role=role),
                    cms=cms.address,
                    heartbeat_interval_s=0.2,
                    engine_stall_s=ENGINE_STALL_S,
                )
            )
        config = SchedulerConfig(scheduling_policy="load-balance", dispatch_top_k=2)
        reader: ClusterReader = open_reader("memory", store=store)
        router = await start_router_server(
            reader,
            Scheduler(config, PREDICTOR, random.Random(0)),
            service_config=ServiceConfig(max_retries=2, prefill_timeout_s=30, stream_timeout_s=60),
            # Longer than the stall: requests held by the stalled engine wait for it rather than
            # being moved, so the engine keeps holding work and only its own report can keep
            # traffic away (the router's outlier detection is not what is tested here).
            worker_first_message_timeout_s=20.0,
        )
        yield Pieces(router, engines)
    finally:
        for engine in engines.values():
            engine.resume()
        if router is not None:
            await router.stop(grace=0)
        for worker in workers:
            await worker.stop(grace=0)
        await cms.stop(grace=0)


async def _until(predicate, load: SteadyLoad, timeout_s: float, what: str) -> float:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        await load.run_for(0.02)
    return time.monotonic()


@pytest.mark.timeout(90)
async def test_a_stalled_engine_stops_getting_requests_until_its_steps_resume() -> None:
    async with _pieces() as pieces:
        await _until_ready(pieces)
        load = SteadyLoad(pieces.router.address, rate_hz=10)
        await load.start()
        try:
            await _until(lambda: any(o.decode == "d1" for o in load.outcomes), load, 10.0, "d1 takes traffic")
            pieces.engines["d1"].stall()
            stalled = time.monotonic()
            # Within its bound (engine_stall_s, a check period, the report and the view) d1 is unschedulable.
            marked = await _until(
                lambda: not pieces.status("d1").schedulable, load, ENGINE_STALL_S * 1.25 + 3.0, "d1 marked"
            )
            assert "engine stalled" in pieces.status("d1").unschedulable_reason
            await load.run_for(3.0)
            assert not pieces.status("d1").schedulable  # it still holds work and finishes no step
            pieces.engines["d1"].resume()
            resumed = time.monotonic()
            await _until(lambda: pieces.status("d1").schedulable, load, 5.0, "d1 schedulable again")
            await _until(
                lambda: any(o.decode == "d1" and o.ok for o in load.since(resumed)),
                load,
                20.0,
                "d1 used again",
            )
        finally:
            outcomes = await load.stop()
    assert failures(outcomes) == []
    # Requests it held waited for it and finished; after it was marked it got nothing new.
    assert [o.request_id for o in outcomes if marked <= o.started_s < resumed and o.decode == "d1"] == []
    assert len([o for o in outcomes if stalled <= o.started_s < resumed]) >= 20


async def _until_ready(pieces: Pieces) -> None:
    deadline = time.monotonic() + 10.0
    while not all(
        (r := pieces.router.reader.snapshot().by_id().get(i)) is not None and r.status is not None
        for i in ("p0", "d0", "d1")
    ):
        if time.monotonic() > deadline:
            raise AssertionError("the workers did not register in time")
        await asyncio.sleep(0.02)
