"""The vLLM worker's throughput through the Worker service, next to vLLM's ``AsyncLLM`` driven directly.

Both sides run the same tiny random model (:mod:`workers.vllm_tiny_model`)
with the same engine settings and the same workload: ``C`` concurrent
streams, each running requests of a 64-token prompt and 128 output tokens
(``ignore_eos``). "direct" calls ``AsyncLLM.generate`` in this process
(token-id prompts, delta outputs); the worker is ``slo-router worker --engine
vllm`` in a subprocess, driven over gRPC from this process in two ways: as
legs of one ``Worker.Streams`` call (:class:`router.mux.MuxConnection`, the
path the router uses by default; one message per engine step for all legs)
and with one ``Generate`` call per request (one message per request and
step, what any other client uses). A ratio worker/direct is what the wrapper
(engine adapter, gRPC service and client) costs; on a small CPU host the
client shares the cores with the engine, so the ratio includes its CPU time.

Both engines start together and the sides take turns, three rounds: other
load on the machine then hits all sides alike. Tokens/s is the best round's;
TTFT p50 is the median over every round's requests (a burst of 16 requests
per round gives 32 first tokens, too few for a median that holds still from
one round to the next: one round's p50 moved by ±10 ms between runs). Each
measurement starts :data:`IDLE_PAUSE_S` after the previous one: vLLM's model
process keeps polling for work at full speed for a second after its last
step (its shared-memory queue's busy loop), and vLLM's CPU thread binding
puts both engines' model processes on the same core (on a 2-core host: core
0, core 1 is left to the frontends), so without the pause a side would run
next to the other engine's poller.

``make bench`` runs :func:`main` in the main environment; the measuring
itself runs in the vLLM environment (``.venv-vllm``, ``make vllm-venv``).
Figures only, no assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.figures import Figure, print_load_average, without_vllm

#: Marks the line carrying the figures from the vLLM environment to ``make bench``.
FIGURES_PREFIX = "bench-vllm-figures: "
#: (concurrent streams, requests per stream)
WORKLOAD: tuple[tuple[int, int], ...] = ((1, 4), (16, 2), (64, 1))
ROUNDS = 3
#: Seconds between two measurements (see _compare).
IDLE_PAUSE_S = 1.5
PROMPT_TOKENS = 64
OUTPUT_TOKENS = 128
MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 64

OneRequest = Callable[[int], Awaitable[tuple[int, float]]]


@dataclass(frozen=True)
class Figures:
    concurrency: int
    requests: int
    tokens: int
    seconds: float
    ttft_p50_ms: float
    #: Every request's time to its first token (ms).
    ttfts_ms: tuple[float, ...] = ()
    #: CPU seconds during the measurement: this process (client, or the direct engine's
    #: frontend) and the worker's main process (its frontend: gRPC service + vLLM's AsyncLLM;
    #: vLLM's engine core and model processes are its children and not counted).
    client_cpu_s: float = 0.0
    worker_cpu_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def cpu_us_per_token(self, cpu_s: float) -> float:
        return cpu_s / self.tokens * 1e6 if self.tokens else 0.0


def _prompt(i: int) -> list[int]:
    # Distinct prompts (no prefix-cache reuse), word ids of the tiny vocabulary.
    return [4 + (i * 7919 + j * 104729) % 996 for j in range(PROMPT_TOKENS)]


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (Linux ``/proc``; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _measure(
    one_request: OneRequest, concurrency: int, per_stream: int, first_index: int, worker_pid: int = 0
) -> Figures:
    ttfts: list[float] = []
    tokens: list[int] = []

    async def stream(first: int) -> None:
        for k in range(per_stream):
            n, ttft = await one_request(first + k)
            tokens.append(n)
            ttfts.append(ttft)

    client_cpu, worker_cpu = time.process_time(), _process_cpu_s(worker_pid)
    start = time.perf_counter()
    await asyncio.gather(*(stream(first_index + s * per_stream) for s in range(concurrency)))
    elapsed = time.perf_counter() - start
    return Figures(
        concurrency,
        concurrency * per_stream,
        sum(tokens),
        elapsed,
        statistics.median(ttfts) * 1000,
        tuple(t * 1000 for t in ttfts),
        client_cpu_s=time.process_time() - client_cpu,
        worker_cpu_s=_process_cpu_s(worker_pid) - worker_cpu,
    )


def _direct_requests(llm: Any) -> OneRequest:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )

    async def one(i: int) -> tuple[int, float]:
        start = time.perf_counter()
        ttft = 0.0
        n = 0
        async for out in llm.generate(TokensPrompt(prompt_token_ids=_prompt(i)), params, f"direct-{i}"):
            if n == 0:
                ttft = time.perf_counter() - start
            n += len(out.outputs[0].token_ids)
        return n, ttft

    return one


def _worker_requests(stub: Any) -> OneRequest:
    from slorouter.v1 import common_pb2, worker_pb2

    sampling = common_pb2.SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True)

    async def one(i: int) -> tuple[int, float]:
        start = time.perf_counter()
        ttft = 0.0
        n = 0
        request = worker_pb2.WorkerGenerateRequest(
            request_id=f"worker-{i}", prompt_token_ids=_prompt(i), sampling=sampling
        )
        async for msg in stub.Generate(request, timeout=120):
            if n == 0:
                ttft = time.perf_counter() - start
            n += len(msg.token_ids)
        return n, ttft

    return one


def _streams_requests(connection: Any) -> OneRequest:
    """Requests as legs of one ``Worker.Streams`` call (:class:`router.mux.MuxConnection`), as the router sends them."""
    from slorouter.v1 import common_pb2, worker_pb2

    sampling = common_pb2.SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True)

    async def one(i: int) -> tuple[int, float]:
        start = time.perf_counter()
        ttft = 0.0
        n = 0
        leg = connection.start(
            worker_pb2.WorkerGenerateRequest(
                request_id=f"streams-{i}", prompt_token_ids=_prompt(i), sampling=sampling
            )
        )
        loop = asyncio.get_running_loop()
        try:
            while True:  # how router.forward.WorkerClient.stream waits on a leg
                if not leg.ready:
                    waiter = leg.waiter = loop.create_future()
                    await waiter
                    leg.waiter = None
                message = leg.take()
                if message is None:
                    if leg.error is not None:
                        raise RuntimeError(f"leg {i} failed: {leg.error}")
                    leg.ready = False
                    continue
                if not leg.finished:
                    leg.ready = False
                if n == 0:
                    ttft = time.perf_counter() - start
                n += len(message.token_ids)
                if message.finished:
                    return n, ttft
        finally:
            connection.release(leg)

    return one


async def _compare(model: Path, log_dir: Path) -> None:
    """Both halves, in the vLLM environment: start both engines, then alternate the measurements."""
    import grpc
    from slorouter.v1 import worker_pb2_grpc

    from router.mux import MuxConnection
    from workers import vllm_env
    from workers.vllm_process import VllmWorkerProcess

    vllm_env.apply_defaults()
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    started = time.perf_counter()
    flags = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager"]
    worker = VllmWorkerProcess(model, log_dir / "worker.log", [*flags, "--max-num-seqs", str(MAX_NUM_SEQS)])
    llm: Any = None
    try:
        engine_args = AsyncEngineArgs(
            model=str(model),
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            enforce_eager=True,
            max_num_seqs=MAX_NUM_SEQS,
        )
        llm = await asyncio.to_thread(AsyncLLM.from_engine_args, engine_args)
        address = await asyncio.to_thread(worker.wait_ready)
        print(f"both engines ready after {time.perf_counter() - started:.0f} s", flush=True)
        async with grpc.aio.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            mux = MuxConnection(channel, stub, address, lambda _: None)
            await mux.opened
            sides: dict[str, OneRequest] = {
                "direct": _direct_requests(llm),
                "streams": _streams_requests(mux),
                "generate": _worker_requests(stub),
            }
            for one in sides.values():
                await one(10**6)  # warm-up
            best: dict[tuple[str, int], Figures] = {}
            ttfts: dict[tuple[str, int], list[float]] = {}
            index = 0
            for _ in range(ROUNDS):
                for concurrency, per_stream in WORKLOAD:
                    for side, one in sides.items():
                        # vLLM's model process polls for work for a second after its last
                        # step, on the core both engines' model processes may be bound to:
                        # let the side that ran last go idle first.
                        await asyncio.sleep(IDLE_PAUSE_S)
                        figures = await _measure(one, concurrency, per_stream, index, worker.proc.pid)
                        index += concurrency * per_stream
                        key = (side, concurrency)
                        ttfts.setdefault(key, []).extend(figures.ttfts_ms)
                        if key not in best or figures.tokens_per_s > best[key].tokens_per_s:
                            best[key] = figures
            await mux.close()
    finally:
        worker.terminate()  # both shut down at once
        if llm is not None:
            llm.shutdown()
        worker.stop()
    print(
        f"workload: {PROMPT_TOKENS}-token prompts, {OUTPUT_TOKENS} output tokens, tiny Llama (float32, "
        f"eager, max_num_seqs {MAX_NUM_SEQS}); {ROUNDS} alternating rounds: tokens/s of the best round, "
        "TTFT p50 over every round's requests; worker via Worker.Streams (the router's path) and via "
        "Generate (one call per request)"
    )

    def ttft_p50(side: str, concurrency: int) -> float:
        return statistics.median(ttfts[(side, concurrency)])

    print(
        f"{'streams':>7} {'requests':>8} | {'direct tok/s':>12} {'TTFT p50':>9} | "
        f"{'Streams tok/s':>13} {'TTFT p50':>9} {'ratio':>5} | {'Generate tok/s':>14} {'TTFT p50':>9} {'ratio':>5}"
    )
    ratios: dict[str, dict[int, float]] = {"streams": {}, "generate": {}}
    added: dict[str, dict[int, float]] = {"streams": {}, "generate": {}}
    for concurrency, _ in WORKLOAD:
        d = best[("direct", concurrency)]
        direct_ttft = ttft_p50("direct", concurrency)
        row = f"{concurrency:>7} {d.requests:>8} | {d.tokens_per_s:>12.0f} {direct_ttft:>7.1f}ms"
        for side, width in (("streams", 13), ("generate", 14)):
            w = best[(side, concurrency)]
            ratio = w.tokens_per_s / d.tokens_per_s if d.tokens_per_s else float("nan")
            ratios[side][concurrency] = round(ratio, 2)
            ttft = ttft_p50(side, concurrency)
            added[side][concurrency] = round(ttft - direct_ttft, 1)
            row += f" | {w.tokens_per_s:>{width}.0f} {ttft:>7.1f}ms {ratio:>5.2f}"
        print(row)
    at = " / ".join(str(c) for c, _ in WORKLOAD)
    per_side = "; ".join(
        f"{side} {' / '.join(f'{added[side][c]:+.1f}' for c, _ in WORKLOAD)} ms" for side in added
    )
    print(f"TTFT p50 added (worker - direct) at {at} streams: {per_side}")
    # Where the CPU goes (of the best rounds above): per output token, this process
    # (direct: AsyncLLM's frontend; worker sides: the gRPC client) and the worker's frontend.
    print("CPU µs per output token (this process + the worker's frontend; engine processes not counted):")
    print(
        f"{'streams':>7} | {'direct':>8} | {'Streams client':>14} {'worker':>7} | {'Generate client':>15} {'worker':>7}"
    )
    for concurrency, _ in WORKLOAD:
        d = best[("direct", concurrency)]
        row = f"{concurrency:>7} | {d.cpu_us_per_token(d.client_cpu_s):>8.0f}"
        for side, width in (("streams", 14), ("generate", 15)):
            w = best[(side, concurrency)]
            row += f" | {w.cpu_us_per_token(w.client_cpu_s):>{width}.0f} {w.cpu_us_per_token(w.worker_cpu_s):>7.0f}"
        print(row)
    # For the parent process (make bench), which writes the speed-table row.
    print(FIGURES_PREFIX + json.dumps({"ratio": ratios, "ttft_added_ms": added}))


def _compare_main(model: str, log_dir: str) -> int:
    try:
        import uvloop
    except ImportError:
        asyncio.run(_compare(Path(model), Path(log_dir)))
    else:
        uvloop.run(_compare(Path(model), Path(log_dir)))
    return 0


def main() -> list[Figure]:
    """``make bench``: the wrapper worker vs ``AsyncLLM`` (:func:`worker_main`), then the stock engine path
    (its speed through the router, then ``slo`` against ``load-balance`` on two stock engines)."""
    from bench import vllm_stock, vllm_stock_slo

    figures = worker_main()
    print("\n--- stock vLLM gRPC engine (vllm serve --grpc) through the router ---", flush=True)
    figures += vllm_stock.main()
    print("\n--- slo against load-balance on two stock vLLM engines ---", flush=True)
    return figures + vllm_stock_slo.main([])


def worker_main() -> list[Figure]:
    """Build the tiny model and run :func:`_compare` in the vLLM environment."""
    from workers.vllm_env import subprocess_env
    from workers.vllm_process import MISSING_VENV_HINT, REPO, VLLM_PYTHON, build_tiny_model, vllm_env_ready

    streams = " / ".join(str(c) for c, _ in WORKLOAD)
    what = f"vLLM worker vs `AsyncLLM` direct, {streams} streams"
    if not vllm_env_ready():
        return without_vllm(what, MISSING_VENV_HINT)
    print_load_average()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "model")
        proc = subprocess.run(
            [str(VLLM_PYTHON), "-m", "bench.bench_vllm", "--model", str(model), "--log-dir", str(root)],
            cwd=REPO,
            env=subprocess_env({"HF_HUB_OFFLINE": "1"}),
            capture_output=True,
            text=True,
            timeout=600,
        )
        # vLLM logs to stdout; the figures are the lines this module printed.
        ours = [
            line
            for line in proc.stdout.splitlines()
            if not line.startswith(("(", "INFO", "WARNING", "[", FIGURES_PREFIX))
        ]
        print("\n".join(ours))
        if proc.returncode != 0:
            print(f"the vLLM benchmark failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
            return [Figure(what, f"not measured: the benchmark failed (exit {proc.returncode})")]
        found = [line for line in proc.stdout.splitlines() if line.startswith(FIGURES_PREFIX)]
        if not found:
            return [Figure(what, "not measured: no figures in the benchmark's output")]
        print(f"load average after: {os.getloadavg()[0]:.1f}")
        figures = json.loads(found[-1].removeprefix(FIGURES_PREFIX))
        ratios, added = figures["ratio"], figures["ttft_added_ms"]
        text = "; ".join(
            f"ratio {' / '.join(f'{ratios[side][str(c)]:.2f}' for c, _ in WORKLOAD)}, TTFT p50 added "
            f"{' / '.join(f'{added[side][str(c)]:+.1f}' for c, _ in WORKLOAD)} ms ({label})"
            for side, label in (("streams", "`Worker.Streams`"), ("generate", "`Generate`"))
        )
        return [Figure(what, text)]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", help="run the comparison on this model directory (in the vLLM environment)"
    )
    parser.add_argument("--log-dir", default=".", help="where the worker's log goes")
    cli = parser.parse_args()
    if cli.model:
        sys.exit(_compare_main(cli.model, cli.log_dir))
    main()
