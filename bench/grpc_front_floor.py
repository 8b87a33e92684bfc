"""The floor of the router's two gRPC servers: a no-op server-streaming call, grpc.aio against h2.

What ``--grpc-server`` changes, without the router's own work: one process serves a method that
answers one 20-byte message at once (``grpc.aio``'s server, or :class:`router.h2_server.H2Server`,
each in a process of its own on uvloop, as the router runs), and a ``grpc.aio`` client on one
channel sends bursts of B concurrent calls. Printed per server and burst size: the median and 90th
percentile of the time from a call's send to its message, and the server process's CPU per call
(user + system, ``/proc``). The two servers take turns, ``--reps`` times, the order swapped each
time. Figures only.

    .venv/bin/python -m bench.grpc_front_floor
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.figures import print_load_average

REPO = Path(__file__).resolve().parent.parent
SERVERS = ("grpcio", "h2")
WARM_CALLS = 20


async def _serve(kind: str) -> None:
    import grpc

    from router.h2_server import CallInfo, H2Server, Method

    async def one(request: bytes, call: CallInfo) -> Any:
        yield bytes(20)

    if kind == "h2":
        h2 = H2Server({"/t.T/S": Method(one, streaming=True)}, max_message_bytes=1 << 20)
        port = await h2.start("127.0.0.1:0")
    else:
        server = grpc.aio.server()

        async def handler(request: bytes, context: Any) -> Any:
            yield bytes(20)

        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "t.T", {"S": grpc.unary_stream_rpc_method_handler(handler)}
                ),
            )
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
    print(port, flush=True)
    await asyncio.sleep(3600)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _measure(port: int, calls: int, burst: int) -> list[float]:
    import grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        method = channel.unary_stream("/t.T/S", request_serializer=None, response_deserializer=None)

        async def one() -> float:
            start = time.perf_counter()
            async for _ in method(b"", timeout=30):
                break
            return (time.perf_counter() - start) * 1e3

        for _ in range(WARM_CALLS):
            await one()
        times: list[float] = []
        for _ in range(max(1, calls // burst)):
            times += await asyncio.gather(*(one() for _ in range(burst)))
            await asyncio.sleep(0.005)
        return times


def _start_servers() -> dict[str, tuple[subprocess.Popen[str], int]]:
    """One server process per kind, each with the port it listens on."""
    procs: dict[str, tuple[subprocess.Popen[str], int]] = {}
    for kind in SERVERS:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.grpc_front_floor", "--serve", kind],
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        assert proc.stdout is not None
        procs[kind] = (proc, int(proc.stdout.readline()))
    return procs


async def _run(
    procs: dict[str, tuple[subprocess.Popen[str], int]], reps: int, bursts: list[int], calls: int
) -> None:
    times: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, int], float] = {}
    for rep in range(reps):
        order = list(SERVERS) if rep % 2 == 0 else list(SERVERS)[::-1]
        for burst in bursts:
            for kind in order:
                proc, port = procs[kind]
                before = _cpu_s(proc.pid)
                got = await _measure(port, calls, burst)
                cpu[(kind, burst)] = cpu.get((kind, burst), 0.0) + _cpu_s(proc.pid) - before
                times.setdefault((kind, burst), []).extend(got)
        print(f"rep {rep + 1}/{reps} done, load {os.getloadavg()[0]:.1f}", flush=True)
    print(f"{'server':>7} {'burst':>5} | {'p50 ms':>7} {'p90 ms':>7} | {'server CPU µs/call':>18}")
    for burst in bursts:
        for kind in SERVERS:
            got = times[(kind, burst)]
            p90 = statistics.quantiles(got, n=10)[-1]
            per_call = 1e6 * cpu[(kind, burst)] / (len(got) + reps * WARM_CALLS)
            print(f"{kind:>7} {burst:>5} | {statistics.median(got):>7.2f} {p90:>7.2f} | {per_call:>18.0f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.grpc_front_floor", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--reps", type=int, default=4, help="turns of each server (default: %(default)s)")
    parser.add_argument(
        "--bursts", default="1,16,64", help="burst sizes, comma-separated (default: %(default)s)"
    )
    parser.add_argument(
        "--calls", type=int, default=640, help="calls per burst size per turn (default: %(default)s)"
    )
    parser.add_argument("--serve", choices=SERVERS, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    import uvloop

    if options.serve:
        uvloop.run(_serve(options.serve))
        return
    if not 1 <= options.reps <= 50 or not 16 <= options.calls <= 100_000:
        parser.error("--reps must be within 1-50 and --calls within 16-100000")
    try:
        bursts = [int(b) for b in options.bursts.split(",")]
    except ValueError:
        parser.error(f"--bursts {options.bursts!r}: expected integers separated by commas")
    if any(not 1 <= b <= 1024 for b in bursts):
        parser.error(f"--bursts {options.bursts!r}: each must be within 1-1024")
    print_load_average()
    procs = _start_servers()
    try:
        asyncio.run(_run(procs, options.reps, bursts, options.calls))
    finally:
        for proc, _ in procs.values():
            proc.kill()
            proc.wait()
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
