"""A/B of router builds on one stock vLLM engine: CPU per token, messages per token, wake-ups.

``python -m bench.vllm_stock`` measures one router against the engine directly; on a shared
2-core host its wall-clock ratio moves with the neighbours' load more than with the router. This
harness answers "is build B cheaper than build A" instead: one engine (the bench's settings),
one CMS, one agent, and one ``slo-router router`` per variant, all started once; then short
rounds, the variants taking turns (and the engine alone, ``direct``, when asked), each
concurrency in each round. Per variant and concurrency it prints, summed over the rounds:

- tokens/s (median over rounds) and TTFT p50;
- the router's CPU ms per 1,000 tokens and per request (user + system, ``/proc/PID/stat``);
- the engine's CPU ms per 1,000 tokens (its server process and the ``EngineCore``);
- the agent's CPU ms per second of run (it polls whatever the load);
- messages the client received per token (the router's writes on the client leg);
- the router's context switches per token (every thread's voluntary + involuntary ones, from
  ``/proc/PID/task/*/status``): the wake-ups the forwarding costs.

A variant is ``NAME=DIR[:ROUTER ARGS]``: DIR holds the router's code (this checkout, ``.``, or
a ``git archive`` of another commit), run with this checkout's virtualenv and ``PYTHONPATH=DIR``.
``--agent-args`` gives the agent's extra flags (one agent for every variant). Figures only.

    .venv/bin/python -m bench.vllm_stock_ab --variant new=. --variant old=/tmp/old \\
        --streams 16,64 --rounds 4 --direct
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.figures import print_load_average
from bench.vllm_stock import (
    ENGINE_ARGS,
    OUTPUT_TOKENS,
    SyntheticEngineProcess,
    _cpu_s,
    _prompt,
    _wait_line,
    descendants,
    start_cms_and_agent,
    stop_processes,
)

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Cell:
    """One variant at one concurrency, summed over rounds."""

    rates: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    tokens: int = 0
    requests: int = 0
    messages: int = 0
    router_cpu: float = 0.0
    engine_cpu: float = 0.0
    client_cpu: float = 0.0
    agent_cpu: float = 0.0
    seconds: float = 0.0
    switches: int = 0


def _cpu_many(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += _cpu_s(pid)
    return total


def _switches(pid: int) -> int:
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            for line in (task / "status").read_text().splitlines():
                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def _self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _direct_one(stub: Any, i: int, output_tokens: int) -> tuple[int, int, float]:
    from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2

    request = vllm_pb2.GenerateRequest(
        request_id=f"direct-{i}",
        tokenized=vllm_pb2.TokenizedInput(input_ids=_prompt(i)),
        sampling_params=vllm_pb2.SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True),
        stream=True,
    )
    start = time.perf_counter()
    ttft = 0.0
    n = messages = 0
    async for response in stub.Generate(request, timeout=300):
        messages += 1
        if response.HasField("chunk"):
            if n == 0:
                ttft = time.perf_counter() - start
            n += len(response.chunk.token_ids)
    return n, messages, ttft


async def _routed_one(stub: Any, i: int, output_tokens: int) -> tuple[int, int, float]:
    from slorouter.v1 import common_pb2, router_pb2

    request = router_pb2.GenerateRequest(
        request_id=f"router-{i}",
        prompt_token_ids=_prompt(i),
        sampling=common_pb2.SamplingParams(max_tokens=output_tokens, ignore_eos=True),
    )
    start = time.perf_counter()
    ttft = 0.0
    n = messages = 0
    async for message in stub.Generate(request, timeout=300):
        messages += 1
        if n == 0 and message.token_ids:
            ttft = time.perf_counter() - start
        n += len(message.token_ids)
    return n, messages, ttft


def _parse_variant(text: str) -> tuple[str, Path, list[str]]:
    name, sep, rest = text.partition("=")
    if not sep or not name or name == "direct":
        raise SystemExit(f"--variant {text!r}: expected NAME=DIR[:ROUTER ARGS] (NAME not 'direct')")
    directory, _, args = rest.partition(":")
    path = Path(directory or ".").resolve()
    if not (path / "router" / "cli.py").exists():
        raise SystemExit(f"--variant {text!r}: {path} holds no router/cli.py")
    return name, path, shlex.split(args)


async def _run(options: argparse.Namespace, root: Path) -> dict[str, dict[int, Cell]]:
    import grpc
    from slorouter.v1 import router_pb2_grpc
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_pb2_grpc

    from workers.vllm_process import StockEngineProcess, build_tiny_model, free_port

    variants = [_parse_variant(v) for v in options.variant]
    agent_dir: Path = options.agent_dir
    model = build_tiny_model(root / "model")
    python = sys.executable
    procs: list[subprocess.Popen[bytes]] = []
    engine: Any
    if options.engine == "real":
        engine = StockEngineProcess(
            model,
            root / "engine.log",
            ENGINE_ARGS,
        )
    else:
        engine = SyntheticEngineProcess(root, options.engine.partition(":")[2] or "8", python)
        procs.append(engine.proc)

    def start(name: str, cwd: Path, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
        log = root / f"{name}.log"
        env = dict(os.environ, PYTHONPATH=str(cwd))
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [python, "-m", "router.cli", *args], stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env
            )
        procs.append(proc)
        return proc, log

    cells: dict[str, dict[int, Cell]] = {}
    try:
        await asyncio.to_thread(engine.wait_ready, 600.0)
        engine_pids = descendants(engine.proc.pid)
        cms_port, agent = start_cms_and_agent(
            lambda name, *args: start(name, REPO if name == "cms" else agent_dir, *args),
            engine.address,
            60,
            *shlex.split(options.agent_args),
        )
        routers: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
        for name, path, args in variants:
            port = free_port()
            proc, _ = start(
                f"router-{name}",
                path,
                "router",
                "--cms",
                f"grpc://127.0.0.1:{cms_port}",
                "--listen",
                f"127.0.0.1:{port}",
                "--tokenizer",
                str(model),
                "--scheduling-policy",
                "load-balance",
                *args,
            )
            routers[name] = (proc, port)
        for name, (proc, _) in routers.items():
            _wait_line(root / f"router-{name}.log", "health: SERVING", proc, 120)
        pids = ", ".join(f"{name} {proc.pid}" for name, (proc, _) in routers.items())
        print(
            f"ready: routers {pids}; agent {agent.pid}; engine {' '.join(map(str, engine_pids))}", flush=True
        )
        # Each router's CPU while the others (or the engine alone) run: its background cost.
        idle = {name: [0.0, 0.0] for name in routers}
        channels = [grpc.aio.insecure_channel(engine.address)]
        sides: dict[str, Any] = {}
        if options.direct:
            sides["direct"] = (None, vllm_pb2_grpc.VllmEngineStub(channels[0]), _direct_one)
        for name, (proc, port) in routers.items():
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
            channels.append(channel)
            sides[name] = (proc, router_pb2_grpc.RouterStub(channel), _routed_one)
        for _, stub, one in sides.values():
            await one(stub, 10**7, options.output_tokens)  # warm-up
        index = 0
        for round_index in range(options.rounds):
            order = list(sides.items())
            if round_index % 2:
                order.reverse()
            for concurrency in options.streams:
                for name, (proc, stub, one) in order:
                    await asyncio.sleep(options.pause_s)
                    cell = cells.setdefault(name, {}).setdefault(concurrency, Cell())
                    counts: list[tuple[int, int, float]] = []

                    async def stream(
                        base: int, stub: Any = stub, one: Any = one, counts: list[Any] = counts
                    ) -> None:
                        for k in range(options.per_stream):
                            counts.append(await one(stub, base + k, options.output_tokens))

                    idle_before = {n: _cpu_s(p.pid) for n, (p, _) in routers.items() if n != name}
                    router_before = _cpu_s(proc.pid) if proc is not None else 0.0
                    switches_before = _switches(proc.pid) if proc is not None else 0
                    engine_before = _cpu_many(engine_pids)
                    agent_before = _cpu_s(agent.pid)
                    client_before = _self_cpu()
                    started = time.perf_counter()
                    await asyncio.gather(
                        *(stream(index + s * options.per_stream) for s in range(concurrency))
                    )
                    elapsed = time.perf_counter() - started
                    index += concurrency * options.per_stream
                    tokens = sum(n for n, _, _ in counts)
                    cell.rates.append(tokens / elapsed)
                    cell.ttfts.extend(1000 * t for _, _, t in counts)
                    cell.tokens += tokens
                    cell.requests += len(counts)
                    cell.messages += sum(m for _, m, _ in counts)
                    cell.seconds += elapsed
                    if proc is not None:
                        cell.router_cpu += _cpu_s(proc.pid) - router_before
                        cell.switches += _switches(proc.pid) - switches_before
                    cell.engine_cpu += _cpu_many(engine_pids) - engine_before
                    cell.agent_cpu += _cpu_s(agent.pid) - agent_before
                    cell.client_cpu += _self_cpu() - client_before
                    for other, before in idle_before.items():
                        idle[other][0] += _cpu_s(routers[other][0].pid) - before
                        idle[other][1] += elapsed
            print(f"round {round_index + 1}/{options.rounds} done, load {os.getloadavg()[0]:.1f}", flush=True)
        for channel in channels:
            await channel.close(None)
    finally:
        stop_processes(procs)
        if options.engine == "real":
            engine.stop(15)
    for name, (cpu, seconds) in idle.items():
        print(f"router {name} while not serving: {1000 * cpu / max(1e-9, seconds):.1f} ms CPU per second")
    return cells


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.vllm_stock_ab", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--variant", action="append", default=[], help="NAME=DIR[:ROUTER ARGS] (repeatable)")
    parser.add_argument("--direct", action="store_true", help="also run the engine directly each round")
    parser.add_argument(
        "--streams", default="16,64", help="concurrencies, comma-separated (default: %(default)s)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: %(default)s)")
    parser.add_argument(
        "--per-stream", type=int, default=1, help="requests per stream per round (default: 1)"
    )
    parser.add_argument(
        "--output-tokens", type=int, default=OUTPUT_TOKENS, help="tokens per request (default: %(default)s)"
    )
    parser.add_argument("--pause-s", type=float, default=1.0, help="idle pause before each run (default: 1)")
    parser.add_argument(
        "--engine",
        default="real",
        help="real (vLLM's gRPC server, the tiny model) or synthetic:STEP_MS (bench.vllm_stock_synthetic: "
        "a fixed token cadence, for CPU per token that does not move with the host's load) (default: real)",
    )
    parser.add_argument("--agent-dir", default=".", help="the agent's code (default: this checkout)")
    parser.add_argument("--agent-args", default="", help="extra flags for the agent")
    options = parser.parse_args(argv)
    if not options.variant and not options.direct:
        parser.error("give at least one --variant or --direct")
    try:
        options.streams = [int(x) for x in options.streams.split(",")]
    except ValueError:
        parser.error(f"--streams {options.streams!r}: expected integers separated by commas")
    if options.engine != "real" and not options.engine.startswith("synthetic"):
        parser.error(f"--engine {options.engine!r}: expected real or synthetic:STEP_MS")
    if not 1 <= options.output_tokens <= 900:
        parser.error(f"--output-tokens {options.output_tokens}: must be within 1-900")
    if options.rounds < 1 or options.per_stream < 1 or any(s < 1 or s > 256 for s in options.streams):
        parser.error("--rounds and --per-stream must be ≥ 1 and each of --streams within 1-256")
    options.agent_dir = Path(options.agent_dir).resolve()
    print_load_average()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-ab-") as tmp:
        cells = asyncio.run(_run(options, Path(tmp)))
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    print(
        f"{'variant':>10} {'streams':>7} | {'tok/s med':>9} {'TTFT p50':>9} | {'router ms/1k':>12} "
        f"{'ms/req':>7} {'switch/tok':>10} {'msg/tok':>7} | {'engine ms/1k':>12} {'client ms/1k':>12} "
        f"{'agent ms/s':>10}"
    )
    for concurrency in options.streams:
        for name, by_streams in cells.items():
            c = by_streams[concurrency]
            k = max(1, c.tokens) / 1000
            print(
                f"{name:>10} {concurrency:>7} | {statistics.median(c.rates):>9.0f} "
                f"{statistics.median(c.ttfts):>7.1f}ms | {1000 * c.router_cpu / k:>12.1f} "
                f"{1000 * c.router_cpu / max(1, c.requests):>7.2f} {c.switches / max(1, c.tokens):>10.2f} "
                f"{c.messages / max(1, c.tokens):>7.2f} | {1000 * c.engine_cpu / k:>12.1f} "
                f"{1000 * c.client_cpu / k:>12.1f} {1000 * c.agent_cpu / max(1e-9, c.seconds):>10.1f}"
            )


if __name__ == "__main__":
    main()
