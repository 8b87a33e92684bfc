"""Sim worker speed: the engine model in virtual time, the real-time step loop, and the Worker service.

Prints figures only (no assertions):

- the clockless core stepping a saturated engine (what a virtual-time simulator pays per step);
- the real-time engine with near-zero step times: wall time per step and per token, i.e. the
  step loop's own overhead on top of the profile's step time;
- a sim worker in its own process (uvloop, as ``slo-router worker`` runs), driven through gRPC by
  concurrent ``Generate`` streams: sustained tokens/s with the profile's steps made negligible
  (what this machine allows), and with steps 10x faster than the profile next to what the
  profile allows (how closely the worker follows its profile under load).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Coroutine
from typing import Any

from slorouter.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from bench.figures import Figure
from engine.interface import Sampling
from engine.model import ProfileCostModel, SimConfig, SimCore, SimRequestSpec
from predictor import LatencyPredictor
from workers.sim_engine import DEFAULT_PROFILE_DIR, SimEngine

_PREDICTOR = LatencyPredictor.from_files(DEFAULT_PROFILE_DIR / "ttft.json", DEFAULT_PROFILE_DIR / "tpot.json")
#: Makes every profiled step last well under a microsecond, so what remains is our own overhead.
_FAST = 1e6


def _run(coro: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(coro)


def _core_figures() -> Figure:
    config = SimConfig(max_num_batched_tokens=2048, max_num_seqs=128, kv_capacity_tokens=262144)
    core = SimCore(config, ProfileCostModel(_PREDICTOR))
    n_requests, output = 2000, 128
    for i in range(n_requests):
        core.add(SimRequestSpec(f"r{i}", 256 + (i * 37) % 512, output))
    steps = tokens = 0
    virtual_ms = 0.0
    start = time.perf_counter()
    while (step := core.schedule()) is not None:
        virtual_ms += step.duration_ms
        tokens += len(core.finish_step(step).outputs)
        steps += 1
    wall = time.perf_counter() - start
    print(f"core (virtual time): {steps} steps, {tokens} tokens in {wall:.2f} s wall")
    print(
        f"  {wall / steps * 1e6:8.1f} us per step   {steps / wall:10.0f} steps/s   {tokens / wall:10.0f} tokens/s"
    )
    print(f"  simulated {virtual_ms / 1000:.1f} s of engine time ({virtual_ms / 1000 / wall:.0f}x real time)")
    return Figure(
        "sim engine core (virtual time)",
        f"{wall / steps * 1e6:.0f} µs/step, {tokens / wall / 1000:.0f}k tokens/s",
    )


async def _engine_figures() -> None:
    for concurrency in (1, 64):
        engine = SimEngine(
            SimConfig(speed_factor=_FAST, max_num_seqs=128, kv_capacity_tokens=262144), _PREDICTOR
        )
        await engine.start()
        output = 2000 if concurrency == 1 else 200

        async def consume(i: int, engine: SimEngine = engine, output: int = output) -> int:
            n = 0
            async for delta in engine.generate(f"r{i}", tuple(range(1, 65)), Sampling(max_tokens=output)):
                n += len(delta.token_ids)
            return n

        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(consume(i) for i in range(concurrency))))
        wall = time.perf_counter() - start
        steps = engine.load().num_steps
        await engine.stop()
        print(
            f"engine step loop, {concurrency:3d} streams: {wall / steps * 1e6:8.1f} us per step "
            f"({wall / tokens * 1e6:6.1f} us per token), {tokens / wall:9.0f} tokens/s over {steps} steps"
        )


async def _grpc_figures(speed_factor: float, runs: tuple[tuple[int, int], ...]) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.cli", "--log-level", "WARNING", "worker",
        "--speed-factor", str(speed_factor), "--max-num-seqs", "256", "--kv-capacity-tokens", "1048576",
        "--listen", "127.0.0.1:0",
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode().strip()
        address = line.rsplit(" ", 1)[-1]
        async with asyncio.timeout(60):
            channel = grpc_channel(address)
            stub = worker_pb2_grpc.WorkerStub(channel)
            try:
                for concurrency, output in runs:
                    await _drive(stub, concurrency, output, warm=True)
                    tokens, messages, wall = await _drive(stub, concurrency, output)
                    line = (
                        f"worker over gRPC (speed x{speed_factor:g}), {concurrency:3d} streams: "
                        f"{tokens / wall:8.0f} tokens/s, {messages / wall:6.0f} messages/s "
                        f"({tokens / messages:4.1f} tokens/message)"
                    )
                    if speed_factor != _FAST:
                        # Steady decode of the whole batch at the middle of its context.
                        step_ms = _PREDICTOR.predict_tpot_ms(concurrency, concurrency * (64 + output / 2))
                        line += f"; the profile allows {concurrency * 1000 * speed_factor / step_ms:8.0f}"
                    print(line)
            finally:
                await channel.close(None)
    finally:
        proc.terminate()
        await proc.wait()


def grpc_channel(address: str) -> Any:
    import grpc

    return grpc.aio.insecure_channel(address)


async def _drive(stub: Any, concurrency: int, output: int, *, warm: bool = False) -> tuple[int, int, float]:
    tag = "w" if warm else "m"

    async def one(i: int) -> tuple[int, int]:
        request = worker_pb2.WorkerGenerateRequest(
            request_id=f"{tag}{concurrency}-{i}",
            prompt_token_ids=list(range(1, 65)),
            sampling=common_pb2.SamplingParams(max_tokens=output if not warm else 8, ignore_eos=True),
        )
        tokens = messages = 0
        async for msg in stub.Generate(request, timeout=60):
            tokens += len(msg.token_ids)
            messages += 1
        return tokens, messages

    start = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(concurrency)))
    wall = time.perf_counter() - start
    return sum(r[0] for r in results), sum(r[1] for r in results), wall


def main() -> list[Figure]:
    print(f"machine: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    core = _core_figures()
    _run(_engine_figures())
    # Steps made negligible: the ceiling this machine puts on one sim worker.
    _run(_grpc_figures(_FAST, ((1, 2000), (16, 500), (64, 200))))
    # Steps 10x faster than the profile: the worker should deliver what the profile allows.
    _run(_grpc_figures(10.0, ((1, 200), (64, 100))))
    return [core]


if __name__ == "__main__":
    main()
