"""The router hop's cost: the same sim workers driven directly and through the router.

Starts ``slo-router up --neutral 2`` (router and workers in their own
processes), then from this process:

* streams 64 concurrent requests straight to the workers (Worker.Generate,
  alternating between them) and through the router (Router.Generate), and
  prints tokens/s of each and their ratio, and the CPU time the router's
  process (router + embedded CMS) spends per forwarded message and per request;
* sends one request at a time and prints TTFT p50/p99 of each path and the
  TTFT the router adds.

Figures only; nothing is asserted.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx2 as httpx
from slorouter.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

from bench.figures import Figure
from bench.vllm_stock import pin_threads
from cms.call_auth import read_worker_token

REPO = Path(__file__).resolve().parent.parent
#: Runs as (sim worker speed, the workers' --stream-interval-ms, router --processes, router
#: --worker-streams, pinned): the bundled profile in real time, 20x faster (the hop is then the
#: bottleneck) with the multiplexed worker streams and with one call per request, 20x faster with
#: the workers merging the tokens of the steps within 5 ms into one message (fewer messages through
#: every hop), 20x faster with two router processes on the port, and 20x faster with the router
#: (and the embedded CMS) pinned to one core and the workers and this client to the other.
RUNS = (
    (1.0, 0.0, 1, "mux", False),
    (1.0, 0.0, 1, "per-request", False),
    (20.0, 0.0, 1, "mux", False),
    (20.0, 0.0, 1, "per-request", False),
    (20.0, 5.0, 1, "mux", False),
    (20.0, 0.0, 2, "mux", False),
    (20.0, 0.0, 1, "mux", True),
    (20.0, 0.0, 1, "per-request", True),
)
#: The pinned runs: the router's process on ROUTER_CORE, the workers and this client on OTHER_CORE.
ROUTER_CORE, OTHER_CORE = 0, 1
#: Client connections to the router with --processes > 1 (SO_REUSEPORT spreads connections, not calls).
CLIENT_CONNECTIONS = 8
STREAMS = 64
REQUESTS = 192
MAX_TOKENS = 128
TTFT_SAMPLES = 60


def _prompt(i: int, n: int = 64) -> list[int]:
    return [(i * 13 + k) % 250 + 1 for k in range(n)]


def _sampling(max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)


StreamFn = Callable[[int, int], AsyncIterator[int]]


async def _throughput(stream: StreamFn) -> tuple[float, float, int]:
    """Tokens/s over REQUESTS requests, STREAMS at a time; tokens per message; messages received."""
    gate = asyncio.Semaphore(STREAMS)
    tokens = 0
    messages = 0

    async def one(i: int) -> None:
        nonlocal tokens, messages
        async with gate:
            async for n in stream(i, MAX_TOKENS):
                tokens += n
                messages += 1

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(REQUESTS)))
    return tokens / (time.perf_counter() - start), tokens / max(messages, 1), messages


def _own_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` itself (not its children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _ttfts(stream: StreamFn) -> list[float]:
    """TTFT of one request at a time on an idle fleet (max_tokens 1: nothing runs between requests)."""
    samples = []
    for i in range(TTFT_SAMPLES):
        start = time.perf_counter()
        first: float | None = None
        async for _ in stream(10_000 + i, 1):
            if first is None:
                first = (time.perf_counter() - start) * 1e3
        assert first is not None
        samples.append(first)
    return samples


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(frozen=True)
class HopFigures:
    direct_tps: float
    router_tps: float
    direct_ttft_p50_ms: float
    router_ttft_p50_ms: float
    #: CPU of the `up` process (router + embedded CMS) per forwarded message, at STREAMS streams.
    router_cpu_us_per_message: float
    #: The same per request (MAX_TOKENS tokens).
    router_cpu_ms_per_request: float


async def _measure(
    router_addr: str,
    worker_addrs: list[str],
    speed: float,
    interval_ms: float,
    router_pids: list[int],
    worker_token: str | None = None,
) -> HopFigures:
    # One connection per router process's share: a separate subchannel pool per channel.
    router_channels = [
        grpc.aio.insecure_channel(router_addr, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(CLIENT_CONNECTIONS if len(router_pids) > 1 else 1)
    ]
    worker_channels = [grpc.aio.insecure_channel(a) for a in worker_addrs]
    routers = [router_pb2_grpc.RouterStub(c) for c in router_channels]
    workers = [worker_pb2_grpc.WorkerStub(c) for c in worker_channels]

    def router_cpu_s() -> float:
        return sum(_own_cpu_s(pid) for pid in router_pids)

    async def via_router(i: int, max_tokens: int) -> AsyncIterator[int]:
        request = router_pb2.GenerateRequest(prompt_token_ids=_prompt(i), sampling=_sampling(max_tokens))
        async for message in routers[i % len(routers)].Generate(request, timeout=120):
            yield len(message.token_ids)

    # The workers ask their callers for `up`'s worker token, as they ask the router.
    auth = (("authorization", f"Bearer {worker_token}"),) if worker_token else None

    async def direct(i: int, max_tokens: int) -> AsyncIterator[int]:
        request = worker_pb2.WorkerGenerateRequest(
            request_id=f"direct-{i}", prompt_token_ids=_prompt(i), sampling=_sampling(max_tokens)
        )
        async for message in workers[i % len(workers)].Generate(request, timeout=120, metadata=auth):
            yield len(message.token_ids)

    try:
        await _throughput(direct)  # warm-up: channels, caches
        direct_tps, direct_batch, _ = await _throughput(direct)
        cpu0 = router_cpu_s()
        router_tps, router_batch, forwarded = await _throughput(via_router)
        router_cpu = router_cpu_s() - cpu0
        print(
            f"{STREAMS} concurrent streams, {REQUESTS} requests x {MAX_TOKENS} tokens, sim speed x{speed:g}, "
            f"worker --stream-interval-ms {interval_ms:g}, router --processes {len(router_pids)}:"
        )
        print(f"  direct to workers : {direct_tps:9.0f} tokens/s  ({direct_batch:.2f} tokens/message)")
        print(
            f"  through the router: {router_tps:9.0f} tokens/s  ({router_batch:.2f} tokens/message)"
            f"  ratio {router_tps / direct_tps:.2f}"
        )
        # The `up` process holds the router and the CMS (which takes the workers' status reports).
        print(
            f"  router (+CMS) CPU : {router_cpu / max(forwarded, 1) * 1e6:9.1f} µs per forwarded message, "
            f"{router_cpu / REQUESTS * 1e3:.2f} ms per request"
        )
        direct_ttft = await _ttfts(direct)
        router_ttft = await _ttfts(via_router)
        d50, r50 = statistics.median(direct_ttft), statistics.median(router_ttft)
        print(f"one stream at a time, {TTFT_SAMPLES} requests of 64 prompt tokens:")
        print(f"  TTFT direct : p50 {d50:6.2f} ms  p99 {_pct(direct_ttft, 0.99):6.2f} ms")
        print(f"  TTFT router : p50 {r50:6.2f} ms  p99 {_pct(router_ttft, 0.99):6.2f} ms")
        print(f"  added by the router hop: p50 {r50 - d50:+.2f} ms")
        return HopFigures(
            direct_tps,
            router_tps,
            d50,
            r50,
            router_cpu / max(forwarded, 1) * 1e6,
            router_cpu / REQUESTS * 1e3,
        )
    finally:
        for channel in [*router_channels, *worker_channels]:
            await channel.close(None)


#: The HTTP edge runs: --worker-streams modes, each twice, alternating (the machine is shared).
EDGE_RUNS = ("mux", "per-request", "mux", "per-request")


async def _edge_traffic(base: str, requests: int) -> int:
    """REQUESTS streamed ``/v1/completions`` of MAX_TOKENS tokens, STREAMS at a time; SSE chunks received."""
    gate = asyncio.Semaphore(STREAMS)
    chunks = 0
    limits = httpx.Limits(max_connections=STREAMS + 8)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:

        async def one(i: int) -> None:
            nonlocal chunks
            body = {
                "model": "sim",
                "prompt": _prompt(i),
                "max_tokens": MAX_TOKENS,
                "stream": True,
                "ignore_eos": True,
            }
            async with gate, http.stream("POST", f"{base}/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks += 1

        await asyncio.gather(*(one(i) for i in range(requests)))
    return chunks


def _edge(streams: str) -> tuple[float, float] | None:
    """The `up` process's CPU per request and per SSE chunk through the HTTP edge (sim at real speed)."""
    cmd = [
        sys.executable, "-m", "router.cli", "up", "--neutral", "2", "--listen", "127.0.0.1:0",
        "--http-listen", "127.0.0.1:0", "--scheduling-policy", "load-balance", "--worker-streams", streams,
    ]  # fmt: skip
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO)
    try:
        assert up.stdout is not None
        base = ""
        for line in up.stdout:
            if line.startswith("OpenAI-compatible HTTP API on "):
                base = line.split()[-1].removesuffix("/v1")
                break
        if not base:
            print("slo-router up did not start; no figures")
            return None
        asyncio.run(_edge_traffic(base, STREAMS // 2))  # warm-up
        load = os.getloadavg()[0]
        cpu0 = _own_cpu_s(up.pid)
        chunks = asyncio.run(_edge_traffic(base, REQUESTS))
        cpu = _own_cpu_s(up.pid) - cpu0
        print(
            f"HTTP edge, {STREAMS} streams of {MAX_TOKENS} tokens (/v1/completions streamed), --worker-streams "
            f"{streams}: up (+CMS) CPU {cpu / REQUESTS * 1e3:.2f} ms per request, {cpu / max(chunks, 1) * 1e6:.1f} "
            f"µs per SSE chunk; load average {load:.1f}-{os.getloadavg()[0]:.1f}",
            flush=True,
        )
        return cpu / REQUESTS * 1e3, cpu / max(chunks, 1) * 1e6
    finally:
        up.terminate()
        up.wait(timeout=30)
        if up.stdout is not None:
            up.stdout.close()


def main(
    runs_wanted: tuple[tuple[float, float, int, str, bool], ...] = RUNS,
    edge_runs: tuple[str, ...] = EDGE_RUNS,
) -> list[Figure]:
    runs = {run: _run(*run) for run in runs_wanted}
    edge: dict[str, list[tuple[float, float]]] = {}
    for streams in edge_runs:
        measured = _edge(streams)
        if measured is not None:
            edge.setdefault(streams, []).append(measured)
    figures = []
    for (speed, interval, processes, streams, pinned), hop in runs.items():
        what = f"router hop, {STREAMS} streams, sim workers " + (
            "at the profile's real speed" if speed == 1.0 else f"{speed:g}x faster"
        )
        what += f", --worker-streams {streams}"
        if interval:
            what += f", worker --stream-interval-ms {interval:g}"
        if processes > 1:
            what += f", router --processes {processes}"
        if pinned:
            what += ", router pinned to one core, workers and client to the other"
        if hop is None:
            figures.append(Figure(what, "not measured: `slo-router up` did not start"))
            continue
        figures.append(
            Figure(
                what,
                f"{hop.router_tps:.0f} vs {hop.direct_tps:.0f} tokens/s direct "
                f"(ratio {hop.router_tps / hop.direct_tps:.2f}); router + CMS CPU "
                f"{hop.router_cpu_us_per_message:.0f} µs per forwarded message, "
                f"{hop.router_cpu_ms_per_request:.1f} ms per request",
            )
        )
    added = [
        f"{hop.router_ttft_p50_ms - hop.direct_ttft_p50_ms:+.1f} ms (x{speed:g}, {streams})"
        for (speed, interval, processes, streams, pinned), hop in runs.items()
        if hop is not None and not interval and processes == 1 and not pinned
    ]
    figures.append(Figure("TTFT added by the router hop, one stream", "p50 " + ", ".join(added)))
    for streams, samples in edge.items():
        figures.append(
            Figure(
                f"HTTP edge, {STREAMS} streams of {MAX_TOKENS} tokens, sim at real speed, --worker-streams {streams}",
                "up (+CMS) CPU"
                + (f", {len(samples)} runs: " if len(samples) > 1 else " ")
                + ", ".join(f"{ms:.1f} ms per request ({us:.0f} µs per SSE chunk)" for ms, us in samples),
            )
        )
    return figures


def _run(speed: float, interval_ms: float, processes: int, streams: str, pinned: bool) -> HopFigures | None:
    cmd = [
        sys.executable, "-m", "router.cli", "up", "--neutral", "2", "--listen", "127.0.0.1:0",
        "--speed-factor", str(speed), "--scheduling-policy", "load-balance", "--http-listen", "",
        "--worker-stream-interval-ms", str(interval_ms), "--processes", str(processes),
        "--worker-streams", streams,
    ]  # fmt: skip
    if pinned and len(os.sched_getaffinity(0)) < 2:
        print("fewer than 2 cores: no pinned run")
        return None
    own_cores = os.sched_getaffinity(0)
    # Pinned: up and the workers it spawns start on OTHER_CORE; once up listens, its threads
    # (router + embedded CMS) move to ROUTER_CORE, and this process to OTHER_CORE.
    up = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=REPO,
        preexec_fn=(lambda: os.sched_setaffinity(0, {OTHER_CORE})) if pinned else None,
    )
    try:
        router_addr, worker_addrs, worker_token_file = "", [], ""
        # The up process (router + CMS) and the router processes it started with --processes.
        router_pids = [up.pid]
        assert up.stdout is not None
        for line in up.stdout:
            if line.startswith("router process "):
                router_pids.append(int(line.split("(pid ")[1].split(")")[0]))
            if line.startswith("worker token for other routers: "):
                worker_token_file = line.split()[-1]
            if line.startswith("workers: "):
                worker_addrs = [part.split("@")[1].strip(", \n") for part in line[9:].split(", ")]
            if line.startswith("router listening on "):
                router_addr = line.split()[-1]
                break
        if not router_addr:
            print("slo-router up did not start; no figures")
            return None
        if pinned:
            pin_threads(up.pid, {ROUTER_CORE})
            pin_threads(os.getpid(), {OTHER_CORE})
            print(
                f"pinned: router (+CMS) on core {ROUTER_CORE}, workers and this client on core {OTHER_CORE}"
            )
        print(f"router --worker-streams {streams}; load average {os.getloadavg()[0]:.1f}")
        worker_token = read_worker_token(worker_token_file or None)
        return asyncio.run(_measure(router_addr, worker_addrs, speed, interval_ms, router_pids, worker_token))
    finally:
        if pinned:
            pin_threads(os.getpid(), own_cores)
        up.terminate()
        up.wait(timeout=30)
        if up.stdout is not None:
            up.stdout.close()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m bench.bench_router", description="the router hop's cost (default: every run)"
    )
    parser.add_argument("--speed", type=float, help="only runs at this sim speed")
    parser.add_argument("--worker-streams", choices=("mux", "per-request"), help="only runs in this mode")
    parser.add_argument("--pinned", action="store_true", help="only the pinned runs")
    parser.add_argument("--unpinned", action="store_true", help="only the runs without pinning")
    parser.add_argument("--edge", action="store_true", help="only the HTTP edge runs")
    parser.add_argument("--no-edge", action="store_true", help="no HTTP edge runs")
    args = parser.parse_args()
    main(
        ()
        if args.edge
        else tuple(
            run
            for run in RUNS
            if (args.speed is None or run[0] == args.speed)
            and (args.worker_streams is None or run[3] == args.worker_streams)
            and not (args.pinned and not run[4])
            and not (args.unpinned and run[4])
        ),
        () if args.no_edge else tuple(m for m in EDGE_RUNS if args.worker_streams in (None, m)),
    )
