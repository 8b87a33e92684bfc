"""The stock-engine path of ``python -m bench vllm``: an unmodified vLLM gRPC engine, direct and through the router.

One engine (``python -m vllm.entrypoints.launchers.grpc_server``, what ``vllm serve --grpc``
runs) on the tiny model; ``slo-router agent`` registers it with a CMS; ``slo-router router``
(a process of its own, as deployed) routes to it over vLLM's gRPC. The same workload as the
worker comparison (``C`` concurrent streams of 64-token prompts and 128 output tokens,
``ignore_eos``) runs two ways, alternating, :data:`ROUNDS` rounds: "direct" calls the engine's
``VllmEngine.Generate``; "router" calls ``Router.Generate``. Tokens/s is the best round's, TTFT p50
the median over every round. The ratio router/direct is what the router hop costs (on a small
host the router shares the cores with the engine and the client). The router process's CPU
seconds (user + system, from ``/proc``) over its rounds, per 1,000 tokens relayed, is printed
beside them: on a shared host wall-clock ratios swing with the neighbours' load, CPU per token
much less. Figures only, no assertions.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench.figures import Figure, print_load_average, without_vllm

WORKLOAD: tuple[tuple[int, int], ...] = ((1, 4), (16, 2), (64, 1))
ROUNDS = 3
IDLE_PAUSE_S = 1.5
PROMPT_TOKENS = 64
OUTPUT_TOKENS = 128
MAX_NUM_SEQS = 64
#: The CPU engine the stock-vLLM benchmarks serve the tiny model with.
ENGINE_ARGS = [
    "--dtype",
    "float32",
    "--max-model-len",
    "1024",
    "--enforce-eager",
    "--max-num-seqs",
    str(MAX_NUM_SEQS),
]
#: A CPU engine starts in about 25 s on an idle 2-core host and took over 3 minutes on a busy one.
ENGINE_WAIT_S = 600.0

OneRequest = Callable[[int], Awaitable[tuple[int, float]]]


def stop_processes(procs: list[subprocess.Popen[Any]]) -> None:
    """Terminate ``procs`` newest first, then wait up to 10 s for each and kill what is left."""
    for proc in reversed(procs):
        proc.terminate()
    for proc in reversed(procs):
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _prompt(i: int) -> list[int]:
    return [4 + (i * 7919 + j * 104729) % 996 for j in range(PROMPT_TOKENS)]


def _direct(stub: Any) -> OneRequest:
    from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2

    async def one(i: int) -> tuple[int, float]:
        request = vllm_pb2.GenerateRequest(
            request_id=f"direct-{i}",
            tokenized=vllm_pb2.TokenizedInput(input_ids=_prompt(i)),
            sampling_params=vllm_pb2.SamplingParams(
                temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True
            ),
            stream=True,
        )
        start = time.perf_counter()
        ttft = 0.0
        n = 0
        async for response in stub.Generate(request, timeout=300):
            if response.HasField("chunk"):
                if n == 0:
                    ttft = time.perf_counter() - start
                n += len(response.chunk.token_ids)
        return n, ttft

    return one


def _routed(stub: Any) -> OneRequest:
    from slorouter.v1 import common_pb2, router_pb2

    sampling = common_pb2.SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True)

    async def one(i: int) -> tuple[int, float]:
        request = router_pb2.GenerateRequest(
            request_id=f"router-{i}", prompt_token_ids=_prompt(i), sampling=sampling
        )
        start = time.perf_counter()
        ttft = 0.0
        n = 0
        async for message in stub.Generate(request, timeout=300):
            if n == 0 and message.token_ids:
                ttft = time.perf_counter() - start
            n += len(message.token_ids)
        return n, ttft

    return one


async def _measure(
    one: OneRequest, concurrency: int, per_stream: int, first: int
) -> tuple[float, list[float], int]:
    tokens: list[int] = []
    ttfts: list[float] = []

    async def stream(base: int) -> None:
        for k in range(per_stream):
            n, ttft = await one(base + k)
            tokens.append(n)
            ttfts.append(ttft * 1000)

    start = time.perf_counter()
    await asyncio.gather(*(stream(first + s * per_stream) for s in range(concurrency)))
    return sum(tokens) / (time.perf_counter() - start), ttfts, sum(tokens)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cli_starter(
    root: Path, procs: list[subprocess.Popen[bytes]]
) -> Callable[..., tuple[subprocess.Popen[bytes], Path]]:
    """``start(name, *args)``: run ``slo-router *args`` with its output in ``root/name.log``, kept in ``procs``."""
    cli = str(Path(sys.executable).parent / "slo-router")

    def start(name: str, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
        log = root / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen([cli, *args], stdout=out, stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc, log

    return start


def _wait_line(path: Path, marker: str, proc: subprocess.Popen[bytes], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in path.read_text(errors="replace").splitlines():
            if marker in line:
                return line
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}: {path.read_text()[-2000:]}")
        time.sleep(0.1)
    raise RuntimeError(f"no {marker!r} in {path} within {timeout_s} s")


async def _run(root: Path) -> dict[str, Any]:
    import grpc
    from slorouter.v1 import router_pb2_grpc
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_pb2_grpc

    from workers.vllm_process import StockEngineProcess, build_tiny_model, free_port

    model = build_tiny_model(root / "model")
    engine = StockEngineProcess(
        model,
        root / "engine.log",
        ENGINE_ARGS,
    )
    procs: list[subprocess.Popen[bytes]] = []
    start = cli_starter(root, procs)

    try:
        started = time.perf_counter()
        await asyncio.to_thread(engine.wait_ready, ENGINE_WAIT_S)
        print(f"engine ready after {time.perf_counter() - started:.0f} s", flush=True)
        cms_port, router_port = free_port(), free_port()
        cms, cms_log = start("cms", "cms", "--listen", f"127.0.0.1:{cms_port}")
        _wait_line(cms_log, "listening", cms, 30)
        agent, agent_log = start(
            "agent",
            "agent",
            "--engine",
            engine.address,
            "--cms",
            f"127.0.0.1:{cms_port}",
            "--instance-id",
            "v0",
        )
        _wait_line(agent_log, "registered vLLM engine", agent, 60)
        router, router_log = start(
            "router",
            "router",
            "--cms",
            f"grpc://127.0.0.1:{cms_port}",
            "--listen",
            f"127.0.0.1:{router_port}",
            "--tokenizer",
            str(model),
            "--scheduling-policy",
            "load-balance",
        )
        _wait_line(router_log, "health: SERVING", router, 60)
        print(f"router pid {router.pid}", flush=True)
        async with (
            grpc.aio.insecure_channel(engine.address) as engine_channel,
            grpc.aio.insecure_channel(f"127.0.0.1:{router_port}") as router_channel,
        ):
            sides: dict[str, OneRequest] = {
                "direct": _direct(vllm_pb2_grpc.VllmEngineStub(engine_channel)),
                "router": _routed(router_pb2_grpc.RouterStub(router_channel)),
            }
            for one in sides.values():
                await one(10**6)  # warm-up
            best: dict[tuple[str, int], float] = {}
            ttfts: dict[tuple[str, int], list[float]] = {}
            # The router process's CPU seconds and the tokens it relayed, per side and concurrency:
            # on a shared host the wall-clock ratio is noisy, CPU per token much less so.
            cpu: dict[tuple[str, int], float] = {}
            relayed: dict[tuple[str, int], int] = {}
            index = 0
            for _ in range(ROUNDS):
                for concurrency, per_stream in WORKLOAD:
                    for side, one in sides.items():
                        await asyncio.sleep(IDLE_PAUSE_S)
                        before = _cpu_s(router.pid)
                        rate, times, tokens = await _measure(one, concurrency, per_stream, index)
                        key = (side, concurrency)
                        cpu[key] = cpu.get(key, 0.0) + _cpu_s(router.pid) - before
                        relayed[key] = relayed.get(key, 0) + tokens
                        index += concurrency * per_stream
                        best[key] = max(best.get(key, 0.0), rate)
                        ttfts.setdefault(key, []).extend(times)
    finally:
        stop_processes(procs)
        engine.stop(15)
    rows = []
    for concurrency, per_stream in WORKLOAD:
        d, r = best[("direct", concurrency)], best[("router", concurrency)]
        dt, rt = (statistics.median(ttfts[(s, concurrency)]) for s in ("direct", "router"))
        per_k = 1000 * cpu[("router", concurrency)] / max(1, relayed[("router", concurrency)])
        idle_k = 1000 * cpu[("direct", concurrency)] / max(1, relayed[("direct", concurrency)])
        rows.append((concurrency, concurrency * per_stream, d, dt, r, rt, per_k, idle_k))
    return {"rows": rows}


def main() -> list[Figure]:
    """The stock-engine rows of ``python -m bench vllm``."""
    from workers.vllm_process import MISSING_VENV_HINT, VLLM_PYTHON

    streams = " / ".join(str(c) for c, _ in WORKLOAD)
    what = f"stock vLLM gRPC engine through the router vs direct, {streams} streams"
    if not VLLM_PYTHON.exists():
        return without_vllm(what, MISSING_VENV_HINT)
    print_load_average()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-stock-") as tmp:
        try:
            result = asyncio.run(_run(Path(tmp)))
        except RuntimeError as exc:
            print(f"the stock-engine benchmark failed: {exc}")
            return [Figure(what, f"not measured: {str(exc)[:200]}")]
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    print(
        f"workload: {PROMPT_TOKENS}-token prompts, {OUTPUT_TOKENS} output tokens, tiny Llama (float32, eager, "
        f"max_num_seqs {MAX_NUM_SEQS}); {ROUNDS} alternating rounds: tokens/s of the best round, TTFT p50 over "
        "every round's requests; router = slo-router router (own process) → vLLM's gRPC"
    )
    print(
        f"{'streams':>7} {'requests':>8} | {'direct tok/s':>12} {'TTFT p50':>9} | {'router tok/s':>12} "
        f"{'TTFT p50':>9} {'ratio':>5} | {'router CPU ms/1k tok':>20} {'(idle)':>6}"
    )
    ratios, added, cpu = [], [], []
    for concurrency, requests, d, dt, r, rt, per_k, idle_k in result["rows"]:
        ratio = r / d if d else float("nan")
        ratios.append(ratio)
        added.append(rt - dt)
        cpu.append(per_k)
        print(
            f"{concurrency:>7} {requests:>8} | {d:>12.0f} {dt:>7.1f}ms | {r:>12.0f} {rt:>7.1f}ms {ratio:>5.2f} | "
            f"{per_k * 1000:>20.0f} {idle_k * 1000:>6.0f}"
        )
    text = (
        f"ratio {' / '.join(f'{x:.2f}' for x in ratios)}, TTFT p50 added "
        f"{' / '.join(f'{x:+.1f}' for x in added)} ms, router CPU "
        f"{' / '.join(f'{x * 1000:.0f}' for x in cpu)} ms per 1,000 tokens"
    )
    print(text)
    return [Figure(what, text)]


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
