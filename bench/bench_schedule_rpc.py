"""What a ``Router.Schedule`` call costs against a gRPC health check on the same server.

A router serves in a child process over a fixed view of 256 and of 2,048
loaded instances (the fleet of :mod:`bench.bench_scheduler`, kept fresh). This
process calls, one at a time, the standard health ``Check``, ``Schedule``
without ``explain`` and ``Schedule`` with ``explain`` (the per-candidate
trace), and prints for each the mean wall time per call, the router process's
CPU time per call (from ``/proc``), and both as a multiple of the health
check's. Figures only; nothing is asserted.

    python -m bench schedule_rpc
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from slorouter.v1 import common_pb2, router_pb2, router_pb2_grpc

from bench.bench_scheduler import fleet
from bench.figures import Figure
from cms.reader import ClusterReader
from fleet.snapshot import ClusterSnapshot
from predictor import LatencyPredictor

REPO = Path(__file__).resolve().parent.parent
PROFILE = REPO / "profiling_data" / "qwen2.5-7b-2xv100-linear"
SIZES = (256, 2048)
#: Calls timed per row (the explained trace is slow at 2,048 instances: fewer of those).
CALLS = 1000
EXPLAIN_CALLS = 200
_TICKS = os.sysconf("SC_CLK_TCK")


class FixedReader(ClusterReader):
    """A reader whose view never changes: ``fleet(n)`` stamped as taken now (so nothing is stale)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        base = fleet(n, seed=3)
        self._view = ClusterSnapshot(instances=base.instances, taken_at_s=time.monotonic(), version=1)

    async def start(self) -> None:
        self._install(self._view)

    async def stop(self) -> None:
        return None


async def _serve(n: int) -> None:
    from router.core.config import SchedulerConfig
    from router.core.scheduler import Scheduler
    from router.server import start_router_server

    predictor = LatencyPredictor.from_files(PROFILE / "ttft.json", PROFILE / "tpot.json")
    config = SchedulerConfig(instance_staleness_s=1e9)
    scheduler = Scheduler(config, predictor, random.Random(1))
    server = await start_router_server(FixedReader(n), scheduler, listen="127.0.0.1:0")
    print(f"listening {server.address}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
    await server.stop(grace=0)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


async def _time(call: Callable[[], Awaitable[object]], pid: int, calls: int = CALLS) -> tuple[float, float]:
    for _ in range(30):  # warm-up
        await call()
    cpu0, t0 = _cpu_s(pid), time.perf_counter()
    for _ in range(calls):
        await call()
    return (time.perf_counter() - t0) / calls * 1e6, (_cpu_s(pid) - cpu0) / calls * 1e6


async def _measure(address: str, pid: int, n: int) -> tuple[float, float, float, float]:
    async with grpc.aio.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        router = router_pb2_grpc.RouterStub(channel)
        request = router_pb2.GenerateRequest(
            prompt_token_ids=[(7 * i) % 250 + 1 for i in range(512)],
            sampling=common_pb2.SamplingParams(max_tokens=128),
        )
        plain = router_pb2.ScheduleRequest(request=request)
        explained = router_pb2.ScheduleRequest(request=request, explain=True)
        check = health_pb2.HealthCheckRequest(service="")
        rows = [
            ("health Check", await _time(lambda: health.Check(check, timeout=10), pid)),
            ("Schedule", await _time(lambda: router.Schedule(plain, timeout=10), pid)),
            (
                "Schedule explain",
                await _time(lambda: router.Schedule(explained, timeout=10), pid, EXPLAIN_CALLS),
            ),
        ]
    base_wall, base_cpu = rows[0][1]
    print(f"{n} instances, {CALLS} sequential calls each ({EXPLAIN_CALLS} with explain):")
    for name, (wall, cpu) in rows:
        print(
            f"  {name:<17} {wall:8.0f} µs/call ({wall / base_wall:5.2f}x)"
            f"   router CPU {cpu:7.0f} µs/call ({cpu / base_cpu:5.2f}x)"
        )
    (plain_wall, plain_cpu), (explain_wall, explain_cpu) = rows[1][1], rows[2][1]
    return plain_wall / base_wall, plain_cpu / base_cpu, explain_wall / base_wall, explain_cpu / base_cpu


def _run(n: int) -> tuple[float, float, float, float] | None:
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.bench_schedule_rpc", "--serve", str(n)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        if not line.startswith("listening "):
            print(f"the router did not start for {n} instances; no figures")
            return None
        return asyncio.run(_measure(line.split()[1], child.pid, n))
    finally:
        if child.stdin is not None:
            child.stdin.close()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        if child.stdout is not None:
            child.stdout.close()


def main() -> list[Figure]:
    figures = []
    for n in SIZES:
        ratios = _run(n)
        what = f"`Schedule` vs a health check, {n} instances (wall / router CPU)"
        if ratios is None:
            figures.append(Figure(what, "not measured: the router did not start"))
            continue
        wall, cpu, explain_wall, explain_cpu = ratios
        figures.append(
            Figure(what, f"{wall:.2f}x / {cpu:.2f}x; with `explain` {explain_wall:.1f}x / {explain_cpu:.1f}x")
        )
    return figures


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
        asyncio.run(_serve(int(sys.argv[2])))
    else:
        main()
