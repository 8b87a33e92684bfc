"""An embedded cluster for end-to-end router tests: CMS + sim workers + router, all on loopback."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
from slorouter.v1 import common_pb2, router_pb2, router_pb2_grpc

from cms.memory import MemoryStore
from cms.reader import open_reader
from cms.server import CmsServer, start_cms_server
from engine.model import SimConfig
from predictor import LatencyPredictor
from router.core.config import SchedulerConfig
from router.core.queue import QueueConfig
from router.core.scheduler import Scheduler
from router.core.slicing import SliceConfig
from router.server import GRPC_SERVERS, RouterServer, start_router_server
from router.service import ServiceConfig
from workers.kv_transfer import GrpcKvPeer
from workers.metadata import WorkerIdentity, WorkerRole
from workers.service import WorkerServer, start_worker_server
from workers.sim_engine import DEFAULT_PROFILE_DIR, SimEngine

#: The environment variable that picks the Router service's server of :func:`embedded_cluster`.
GRPC_SERVER_ENV = "SLO_ROUTER_TEST_GRPC_SERVER"

PREDICTOR = LatencyPredictor.from_files(DEFAULT_PROFILE_DIR / "ttft.json", DEFAULT_PROFILE_DIR / "tpot.json")


@dataclass
class Cluster:
    cms: CmsServer
    store: MemoryStore
    workers: dict[str, WorkerServer]
    engines: dict[str, SimEngine]
    router: RouterServer
    channel: grpc.aio.Channel
    stub: router_pb2_grpc.RouterAsyncStub
    extra: list[Any] = field(default_factory=list)

    async def kill_worker(self, instance_id: str) -> None:
        """Stop a worker abruptly: its streams break, its agent goes silent."""
        await self.workers.pop(instance_id).stop(grace=0)

    async def wait_for_instances(self, n: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            snap = self.router.reader.snapshot()
            if sum(1 for r in snap.instances if r.status is not None) >= n:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"only {len(snap.instances)} instances registered, wanted {n}")
            await asyncio.sleep(0.01)


def sim_config(**overrides: Any) -> SimConfig:
    values: dict[str, Any] = {"speed_factor": 20.0, "max_model_len": 4096, "kv_capacity_tokens": 65536}
    values.update(overrides)
    return SimConfig(**values)


@asynccontextmanager
async def embedded_cluster(
    *,
    prefill: int = 0,
    decode: int = 0,
    neutral: int = 0,
    policy: str = "slo",
    adaptive_pd: bool = False,
    service: ServiceConfig | None = None,
    engine_overrides: dict[str, Any] | None = None,
    scheduler_overrides: dict[str, Any] | None = None,
    seed: int = 0,
    slice_config: SliceConfig | None = None,
    dispatch_mode: str = "",
    http: bool = False,
    queue: QueueConfig | None = None,
    worker_streams: str = "mux",
    grpc_server: str | None = None,
) -> AsyncIterator[Cluster]:
    """``grpc_server``: what serves the Router service (``--grpc-server``); by default
    ``$SLO_ROUTER_TEST_GRPC_SERVER``, else the router's default, so a whole e2e module can run
    against either server."""
    grpc_server = grpc_server or os.environ.get(GRPC_SERVER_ENV) or GRPC_SERVERS[0]
    store = MemoryStore()
    cms = await start_cms_server(store, "127.0.0.1:0", lease_ttl_s=2.0)
    workers: dict[str, WorkerServer] = {}
    engines: dict[str, SimEngine] = {}
    roles: Sequence[tuple[WorkerRole, int]] = (
        (WorkerRole.PREFILL, prefill),
        (WorkerRole.DECODE, decode),
        (WorkerRole.NEUTRAL, neutral),
    )
    try:
        for role, count in roles:
            for i in range(count):
                instance_id = f"{role.value}-{i}"
                engine = SimEngine(
                    sim_config(**(engine_overrides or {})),
                    PREDICTOR,
                    kv_peer=GrpcKvPeer(),
                    rng=random.Random(seed + i),
                )
                engines[instance_id] = engine
                workers[instance_id] = await start_worker_server(
                    engine,
                    "127.0.0.1:0",
                    identity=WorkerIdentity(instance_id=instance_id, role=role),
                    cms=cms.address,
                    heartbeat_interval_s=0.2,
                )
        config = SchedulerConfig(
            scheduling_policy=policy, enable_adaptive_pd=adaptive_pd, **(scheduler_overrides or {})
        )
        scheduler = Scheduler(config, PREDICTOR, random.Random(seed))
        router = await start_router_server(
            open_reader("memory", store=store),
            scheduler,
            listen="127.0.0.1:0",
            service_config=service or ServiceConfig(max_retries=2, prefill_timeout_s=10, stream_timeout_s=30),
            slice_config=slice_config,
            dispatch_mode=dispatch_mode,
            http_listen="127.0.0.1:0" if http else "",
            queue_config=queue,
            worker_streams=worker_streams,
            grpc_server=grpc_server,
        )
        channel = grpc.aio.insecure_channel(router.address)
        cluster = Cluster(cms, store, workers, engines, router, channel, router_pb2_grpc.RouterStub(channel))
        await cluster.wait_for_instances(prefill + decode + neutral)
        try:
            yield cluster
        finally:
            await channel.close()
            await router.stop(grace=0)
    finally:
        for worker in workers.values():
            await worker.stop(grace=0)
        await cms.stop(grace=0)


def generate_request(
    n_prompt: int = 64, max_tokens: int = 16, *, request_id: str = "", **slo: float
) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=[(7 * i) % 250 + 1 for i in range(n_prompt)],
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        slo=common_pb2.SloTarget(**slo),
    )


def prefix_family_request(k: int, families: int = 3) -> tuple[int, router_pb2.GenerateRequest]:
    """Request ``k`` of ``families`` prompt families: a 512-token prefix its family shares, a 40-token tail."""
    family = k % families
    prefix = [(family * 31 + 7 * i) % 250 + 1 for i in range(512)]
    tail = [(k * 13 + i) % 250 + 1 for i in range(40)]
    return family, router_pb2.GenerateRequest(
        prompt_token_ids=prefix + tail,
        sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True),
    )


@dataclass
class StreamResult:
    tokens: list[int]
    messages: list[router_pb2.GenerateResponse]

    @property
    def first(self) -> router_pb2.GenerateResponse:
        return self.messages[0]

    @property
    def last(self) -> router_pb2.GenerateResponse:
        return self.messages[-1]


async def collect(
    stub: router_pb2_grpc.RouterAsyncStub, request: router_pb2.GenerateRequest, timeout_s: float = 30.0
) -> StreamResult:
    messages = [m async for m in stub.Generate(request, timeout=timeout_s)]
    tokens = [t for m in messages for t in m.token_ids]
    return StreamResult(tokens, messages)
