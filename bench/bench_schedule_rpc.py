"""What a ``Router.Schedule`` call costs against a gRPC health check on the same server.

A router serves in a child process over a fixed view of 256 and of 2,048
loaded instances (the fleet of :mod:`bench.bench_scheduler`, kept fresh), on
uvloop and with the gRPC settings of ``slo-router router`` (uvloop makes every call cheaper, the
health check too, so the ratios come out higher than on asyncio's loop). This
process calls it over one channel, one call at a time: the standard health
``Check``, ``Schedule`` without ``explain``, ``Schedule`` with ``explain``
(the per-candidate trace) and with ``explain_top`` 8 (the trace cut to the 8
most telling candidates per stage), in rounds that run a block of each kind side by
side (in alternating order), so that other work on the machine weighs on every
kind alike. Per round and kind it takes the median wall time of a call and the
router process's CPU time per call (every thread's, from ``/proc/PID/task/*/
schedstat``, in ns); it prints the median over the rounds, and the range, of
each as a multiple of the health check's in the same round. Figures only;
nothing is asserted.

    python -m bench schedule_rpc
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
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
from router.cli import grpc_environment

REPO = Path(__file__).resolve().parent.parent
PROFILE = REPO / "profiling_data" / "qwen2.5-7b-2xv100-linear"
SIZES = (256, 2048)
#: Rounds, and calls of each kind per round (the explained trace is slow at 2,048 instances: fewer).
ROUNDS = 15
BLOCK = 100
EXPLAIN_BLOCK = 20
#: ``ScheduleRequest.explain_top`` of the fourth kind of call.
TOP = 8


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
    from router.core.rng import PeekableRandom
    from router.core.scheduler import Scheduler
    from router.server import start_router_server

    predictor = LatencyPredictor.from_files(PROFILE / "ttft.json", PROFILE / "tpot.json")
    config = SchedulerConfig(instance_staleness_s=1e9)
    scheduler = Scheduler(config, predictor, PeekableRandom(1))  # as the router builds it
    server = await start_router_server(FixedReader(n), scheduler, listen="127.0.0.1:0")
    print(f"listening {server.address}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
    await server.stop(grace=0)


def _cpu_ns(pid: int) -> int:
    """CPU time of every thread of process ``pid`` so far (ns; ``schedstat``, exact, unlike ``stat``'s ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended since the listing
            total += int((task / "schedstat").read_text().split()[0])
    return total


class _Row:
    """One kind of call: per round, the median wall time of a call and the router CPU per call (µs)."""

    def __init__(self, name: str, call: Callable[[], Awaitable[object]], calls: int) -> None:
        self.name, self.call, self.calls = name, call, calls
        self.wall: list[float] = []
        self.cpu: list[float] = []

    async def block(self, pid: int) -> None:
        walls = []
        cpu0 = _cpu_ns(pid)
        for _ in range(self.calls):
            t0 = time.perf_counter()
            await self.call()
            walls.append(time.perf_counter() - t0)
        self.cpu.append((_cpu_ns(pid) - cpu0) / self.calls / 1e3)
        self.wall.append(statistics.median(walls) * 1e6)


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):5.2f}x ({min(values):.2f}-{max(values):.2f})"


async def _measure(address: str, pid: int, n: int) -> tuple[float, ...]:
    async with grpc.aio.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        router = router_pb2_grpc.RouterStub(channel)
        request = router_pb2.GenerateRequest(
            prompt_token_ids=[(7 * i) % 250 + 1 for i in range(512)],
            sampling=common_pb2.SamplingParams(max_tokens=128),
        )
        plain = router_pb2.ScheduleRequest(request=request)
        explained = router_pb2.ScheduleRequest(request=request, explain=True)
        top = router_pb2.ScheduleRequest(request=request, explain_top=TOP)
        check = health_pb2.HealthCheckRequest(service="")
        rows = [
            _Row("health Check", lambda: health.Check(check, timeout=10), BLOCK),
            _Row("Schedule", lambda: router.Schedule(plain, timeout=10), BLOCK),
            _Row("Schedule explain", lambda: router.Schedule(explained, timeout=10), EXPLAIN_BLOCK),
            _Row(f"explain_top {TOP}", lambda: router.Schedule(top, timeout=10), BLOCK),
        ]
        for row in rows:  # warm-up
            for _ in range(30):
                await row.call()
        for k in range(ROUNDS):
            # Side by side, in alternating order: a change of load on the machine hits every kind alike.
            for row in rows if k % 2 == 0 else rows[::-1]:
                await row.block(pid)
    base = rows[0]
    print(
        f"{n} instances: {ROUNDS} rounds of {BLOCK} calls of each kind ({EXPLAIN_BLOCK} with explain),"
        " one at a time; median over the rounds (range):"
    )
    ratios = []
    for row in rows:
        wall = [w / b for w, b in zip(row.wall, base.wall, strict=True)]
        cpu = [c / b for c, b in zip(row.cpu, base.cpu, strict=True)]
        ratios.append((statistics.median(wall), statistics.median(cpu)))
        print(
            f"  {row.name:<17} wall {statistics.median(row.wall):7.0f} µs/call {_spread(wall)}"
            f"   router CPU {statistics.median(row.cpu):7.0f} µs/call {_spread(cpu)}"
        )
    return ratios[1][0], ratios[1][1], ratios[2][0], ratios[2][1], ratios[3][0], ratios[3][1]


def _run(n: int) -> tuple[float, ...] | None:
    env = dict(os.environ)
    grpc_environment(env)  # gRPC's settings as `slo-router router` has them (read when gRPC loads)
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.bench_schedule_rpc", "--serve", str(n)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env,
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
        wall, cpu, explain_wall, explain_cpu, top_wall, top_cpu = ratios
        figures.append(
            Figure(
                what,
                f"{wall:.2f}x / {cpu:.2f}x; with `explain` {explain_wall:.1f}x / {explain_cpu:.1f}x,"
                f" with `explain_top` {TOP} {top_wall:.1f}x / {top_cpu:.1f}x"
                + ("; goal router CPU ≤ 1.5x" if n == 256 else ""),
            )
        )
    return figures


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--serve":
        import uvloop  # the event loop `slo-router router` serves on (router.server.run)

        uvloop.run(_serve(int(sys.argv[2])))
    else:
        main()
