"""CMS speed: ReportStatus calls/s, ReportStatuses and StatusBatcher statuses/s, status → watcher latency.

For each store (memory, and a throwaway loopback redis-server) a real CMS
process is started with ``slo-router cms``; the clients run in this process.
Figures only, no assertions. Client and server share the machine's cores, so
the calls/s are a floor for the server alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import selectors
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
from slorouter.v1 import cms_pb2, cms_pb2_grpc

from bench.figures import Figure
from cms.agent import StatusBatcher
from cms.memory import MemoryStore
from cms.redis_store import RedisStore
from cms.store import CmsStore
from cms.testing import RedisServer, find_redis_server

ROOT = Path(__file__).resolve().parent.parent
AGENTS = 32
#: ReportStatuses row: this many agent connections, each carrying the statuses of BATCH instances.
BATCH_AGENTS = 8
BATCH = 128
INGEST_GOAL = 20_000
THROUGHPUT_S = 3.0
LATENCY_SAMPLES = 120
BACKGROUND_AGENTS = 16
BACKGROUND_PERIOD_S = 0.02
PROBE_SPACING_S = 0.03


def _metadata(instance_id: str) -> cms_pb2.InstanceMetadata:
    return cms_pb2.InstanceMetadata(
        instance_id=instance_id,
        endpoint="127.0.0.1:9000",
        role=cms_pb2.INSTANCE_ROLE_DECODE,
        model="bench",
        kv_capacity_tokens=1 << 20,
    )


def _status(instance_id: str, update_id: int) -> cms_pb2.InstanceStatus:
    return cms_pb2.InstanceStatus(
        instance_id=instance_id,
        update_id=update_id,
        timestamp_ms=int(time.time() * 1000),
        schedulable=True,
        num_running_requests=update_id % 64,
        num_decode_requests=update_id % 64,
        num_decode_tokens=(update_id % 64) * 700,
        num_used_kv_tokens=(update_id % 64) * 700,
        admitted_request_ids=[f"req-{instance_id}-{update_id - k}" for k in range(8)],
    )


@contextmanager
def _cms_process(store: str) -> Iterator[str]:
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "router.cli", "--log-level", "WARNING", "cms"),
            *("--listen", "127.0.0.1:0", "--store", store, "--lease-ttl-s", "30"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=None,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ)
            ready = selector.select(timeout=30)
        line = proc.stdout.readline() if ready else ""
        if not line.startswith("cms listening on "):
            raise RuntimeError(f"the CMS did not start: {line!r}")
        yield line.split()[3]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate(timeout=15)


async def _throughput(address: str) -> tuple[float, float]:
    """ReportStatus calls/s with AGENTS concurrent agents, each on its own channel; and p50 RTT in ms."""
    channels = [grpc.aio.insecure_channel(address) for _ in range(AGENTS)]
    stubs = [cms_pb2_grpc.ClusterMetadataStub(c) for c in channels]
    rtts: list[float] = []
    try:
        for i, stub in enumerate(stubs):
            await stub.RegisterInstance(
                cms_pb2.RegisterInstanceRequest(metadata=_metadata(f"tp{i}")), timeout=5
            )
        stop_at = time.perf_counter() + THROUGHPUT_S

        async def agent(i: int, stub: cms_pb2_grpc.ClusterMetadataAsyncStub) -> int:
            calls = 0
            while time.perf_counter() < stop_at:
                start = time.perf_counter()
                request = cms_pb2.ReportStatusRequest(status=_status(f"tp{i}", calls + 1))
                await stub.ReportStatus(request, timeout=5)
                rtts.append(time.perf_counter() - start)
                calls += 1
            return calls

        began = time.perf_counter()
        counts = await asyncio.gather(*(agent(i, s) for i, s in enumerate(stubs)))
        elapsed = time.perf_counter() - began
        return sum(counts) / elapsed, statistics.median(rtts) * 1000
    finally:
        for channel in channels:
            await channel.close(None)


async def _batched_throughput(address: str) -> tuple[float, float]:
    """Statuses/s through ReportStatuses with BATCH_AGENTS connections of BATCH instances each; p50 RTT (ms).

    Every call carries one fresh status (a new update_id) per instance, built per call, so the
    client's cost of making statuses is in the figure too.
    """
    channels = [grpc.aio.insecure_channel(address) for _ in range(BATCH_AGENTS)]
    stubs = [cms_pb2_grpc.ClusterMetadataStub(c) for c in channels]
    rtts: list[float] = []
    failed: list[str] = []
    try:
        for a, stub in enumerate(stubs):
            for k in range(BATCH):
                await stub.RegisterInstance(
                    cms_pb2.RegisterInstanceRequest(metadata=_metadata(f"bt{a}-{k}")), timeout=5
                )
        stop_at = time.perf_counter() + THROUGHPUT_S

        async def agent(a: int, stub: cms_pb2_grpc.ClusterMetadataAsyncStub) -> int:
            sent = 0
            update_id = 0
            while time.perf_counter() < stop_at:
                update_id += 1
                request = cms_pb2.ReportStatusesRequest(
                    statuses=[_status(f"bt{a}-{k}", update_id) for k in range(BATCH)]
                )
                start = time.perf_counter()
                try:
                    response = await stub.ReportStatuses(request, timeout=10)
                except grpc.aio.AioRpcError as exc:  # e.g. a Redis timeout on a starved host
                    failed.append(exc.code().name)
                    continue
                rtts.append(time.perf_counter() - start)
                sent += sum(1 for outcome in response.outcomes if outcome.code == 0)
            return sent

        began = time.perf_counter()
        counts = await asyncio.gather(*(agent(a, s) for a, s in enumerate(stubs)))
        elapsed = time.perf_counter() - began
        if failed:
            print(f"  ({len(failed)} ReportStatuses calls failed, not counted: {sorted(set(failed))})")
        return sum(counts) / elapsed, statistics.median(rtts) * 1000 if rtts else float("nan")
    finally:
        for channel in channels:
            await channel.close(None)


async def _batcher_throughput(address: str) -> tuple[float, float]:
    """Statuses/s through the agent's StatusBatcher: BATCH_AGENTS batchers (connections), each
    shared by BATCH instances that report again as soon as their last status was answered; and
    the mean statuses per call (the batches form by themselves, there is no timer)."""
    batchers = [StatusBatcher(address, rpc_timeout_s=10.0) for _ in range(BATCH_AGENTS)]
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = cms_pb2_grpc.ClusterMetadataStub(channel)
            for a in range(BATCH_AGENTS):
                for k in range(BATCH):
                    await stub.RegisterInstance(
                        cms_pb2.RegisterInstanceRequest(metadata=_metadata(f"sb{a}-{k}")), timeout=5
                    )
        stop_at = time.perf_counter() + THROUGHPUT_S

        async def instance(batcher: StatusBatcher, iid: str) -> int:
            sent = 0
            while time.perf_counter() < stop_at:
                code, _ = await batcher.report(_status(iid, sent + 1))
                sent += code == grpc.StatusCode.OK
            return sent

        began = time.perf_counter()
        counts = await asyncio.gather(
            *(instance(b, f"sb{a}-{k}") for a, b in enumerate(batchers) for k in range(BATCH))
        )
        elapsed = time.perf_counter() - began
        calls = sum(b.calls for b in batchers)
        return sum(counts) / elapsed, sum(b.statuses for b in batchers) / max(calls, 1)
    finally:
        for batcher in batchers:
            await batcher.close()


async def _latency(address: str, loaded: bool) -> tuple[float, float, float]:
    """Milliseconds from sending an accepted ReportStatus to a watcher holding the view with it.

    Returns p50, p99, and the p50 of the ReportStatus round trip for reference.
    """
    channel = grpc.aio.insecure_channel(address)
    stub = cms_pb2_grpc.ClusterMetadataStub(channel)
    seen: dict[int, float] = {}
    arrived = asyncio.Event()
    watch = stub.WatchClusterView(cms_pb2.GetClusterViewRequest())
    background: list[asyncio.Task[None]] = []

    async def follow() -> None:
        async for view in watch:
            now = time.perf_counter()
            for state in view.instances:
                if state.metadata.instance_id == "probe" and state.has_status:
                    seen.setdefault(state.status.update_id, now)
                    arrived.set()

    async def noise(i: int) -> None:
        update_id = 0
        while True:
            update_id += 1
            await stub.ReportStatus(
                cms_pb2.ReportStatusRequest(status=_status(f"bg{i}", update_id)), timeout=5
            )
            await asyncio.sleep(BACKGROUND_PERIOD_S)

    follower = asyncio.create_task(follow())
    try:
        await stub.RegisterInstance(cms_pb2.RegisterInstanceRequest(metadata=_metadata("probe")), timeout=5)
        if loaded:
            for i in range(BACKGROUND_AGENTS):
                await stub.RegisterInstance(
                    cms_pb2.RegisterInstanceRequest(metadata=_metadata(f"bg{i}")), timeout=5
                )
            background = [asyncio.create_task(noise(i)) for i in range(BACKGROUND_AGENTS)]
        latencies: list[float] = []
        rtts: list[float] = []
        base = int(time.time() * 1e6)  # fresh ids even if the store kept an older probe
        for k in range(1, LATENCY_SAMPLES + 1):
            update_id = base + k
            arrived.clear()
            sent = time.perf_counter()
            response = await stub.ReportStatus(
                cms_pb2.ReportStatusRequest(status=_status("probe", update_id)), timeout=5
            )
            rtts.append(time.perf_counter() - sent)
            assert response.accepted
            with contextlib.suppress(asyncio.TimeoutError):
                while update_id not in seen:  # bounded: each wait ends with a view or the timeout
                    await asyncio.wait_for(arrived.wait(), 5.0)
                    arrived.clear()
            if update_id in seen:
                latencies.append(seen[update_id] - sent)
            # Space probes beyond the push coalescing window, so each one shows the latency of
            # a change that arrives at a random time rather than one queued behind the previous probe.
            await asyncio.sleep(PROBE_SPACING_S)
        latencies.sort()
        p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
        return statistics.median(latencies) * 1000, p99 * 1000, statistics.median(rtts) * 1000
    finally:
        for task in [*background, follower]:
            task.cancel()
        await asyncio.gather(*background, follower, return_exceptions=True)
        watch.cancel()
        await channel.close(None)


async def _direct_store(store: CmsStore) -> float:
    """In-process store.report calls/s (no gRPC), one caller."""
    try:
        await store.register(_metadata("direct"), 30.0)
        count = 0
        stop_at = time.perf_counter() + 1.0
        began = time.perf_counter()
        while time.perf_counter() < stop_at:
            count += 1
            await store.report(_status("direct", count), 30.0)
        return count / (time.perf_counter() - began)
    finally:
        await store.close()


def _run_store(label: str, spec: str, direct: CmsStore) -> tuple[float, float, float, float, float, float]:
    """Prints the store's figures; returns calls/s with AGENTS agents, the idle latency p50, p99 (ms),
    the store's own ingest (statuses/s in-process, no gRPC) statuses/s through ReportStatuses and
    through the agent's StatusBatcher."""
    ingest = asyncio.run(_direct_store(direct))
    print(f"{label}: store.report in-process, 1 caller: {ingest:9.0f} calls/s", flush=True)
    with _cms_process(spec) as address:
        rate, rtt = asyncio.run(_throughput(address))
        print(
            f"{label}: ReportStatus over gRPC, {AGENTS} concurrent agents: {rate:9.0f} calls/s (rtt p50 {rtt:.2f} ms)"
        )
        try:
            batched, batch_rtt = asyncio.run(_batched_throughput(address))
        except grpc.aio.AioRpcError as exc:  # registering 1,024 instances failed, e.g. a starved Redis
            print(f"{label}: ReportStatuses row not measured: {exc.code().name}: {exc.details()}", flush=True)
            batched, batch_rtt = float("nan"), float("nan")
        print(
            f"{label}: ReportStatuses over gRPC, {BATCH_AGENTS} agents x {BATCH} statuses per call: "
            f"{batched:9.0f} status/s (rtt p50 {batch_rtt:.2f} ms)"
            + (f"; goal >= {INGEST_GOAL} status/s (memory store)" if label == "memory" else ""),
            flush=True,
        )
        try:
            through, per_call = asyncio.run(_batcher_throughput(address))
        except grpc.aio.AioRpcError as exc:  # registering 1,024 instances failed, e.g. a starved Redis
            print(f"{label}: StatusBatcher row not measured: {exc.code().name}: {exc.details()}", flush=True)
            through, per_call = float("nan"), float("nan")
        print(
            f"{label}: StatusBatcher (agent side), {BATCH_AGENTS} connections x {BATCH} instances: "
            f"{through:9.0f} status/s ({per_call:.0f} statuses per call)",
            flush=True,
        )
        idle = (0.0, 0.0)
        for loaded in (False, True):
            p50, p99, rtt = asyncio.run(_latency(address, loaded))
            if not loaded:
                idle = (p50, p99)
            load = (
                f"{BACKGROUND_AGENTS} agents reporting every {BACKGROUND_PERIOD_S * 1000:.0f} ms"
                if loaded
                else "idle"
            )
            print(
                f"{label}: status sent -> watcher updated ({load}): p50 {p50:6.2f} ms  p99 {p99:6.2f} ms"
                f"  (ReportStatus rtt p50 {rtt:.2f} ms)",
                flush=True,
            )
    return rate, idle[0], idle[1], ingest, batched, through


def main() -> list[Figure]:
    print(f"CMS process per store (slo-router cms, uvloop); clients in this process; {os.cpu_count()} CPUs")
    memory = _run_store("memory", "memory", MemoryStore())
    if find_redis_server() is None:
        print("redis: skipped (no redis-server installed)")
        return [
            Figure(
                f"ReportStatus, {AGENTS} concurrent agents, memory",
                f"{memory[0]:.0f} calls/s (Redis: not measured, no redis-server)",
            ),
            Figure(
                "status ingest, one CMS, memory store: ReportStatuses / StatusBatcher / ReportStatus / the store alone",
                f"{memory[4]:.0f} / {memory[5]:.0f} / {memory[0]:.0f} / {memory[3]:.0f} status/s; goal ≥ 20,000 status/s",
            ),
            Figure(
                "status accepted → watcher updated, idle, memory",
                f"p50 {memory[1]:.1f} ms, p99 {memory[2]:.1f} ms",
            ),
        ]
    with tempfile.TemporaryDirectory() as workdir, RedisServer(Path(workdir)) as redis:
        red = _run_store("redis ", redis.url, RedisStore(redis.url, cluster_name="bench"))
    return [
        Figure(
            f"ReportStatus, {AGENTS} concurrent agents, memory / Redis",
            f"{memory[0]:.0f} / {red[0]:.0f} calls/s",
        ),
        Figure(
            "status ingest, one CMS, memory store: ReportStatuses / StatusBatcher / ReportStatus / the store alone",
            f"{memory[4]:.0f} / {memory[5]:.0f} / {memory[0]:.0f} / {memory[3]:.0f} status/s; goal ≥ 20,000 status/s",
        ),
        Figure(
            f"ReportStatuses, {BATCH_AGENTS} agents x {BATCH} statuses per call, Redis",
            f"{red[4]:.0f} status/s",
        ),
        Figure(
            "status accepted → watcher updated, idle, memory / Redis",
            f"p50 {memory[1]:.1f} / {red[1]:.1f} ms, p99 {memory[2]:.1f} / {red[2]:.1f} ms",
        ),
    ]


if __name__ == "__main__":
    main()
