"""The stock-engine path of ``python -m bench vllm``: an unmodified vLLM gRPC engine, direct and through the router.

One engine (``python -m vllm.entrypoints.launchers.grpc_server``, what ``vllm serve --grpc``
runs) on the tiny model; ``slo-router agent`` registers it with a CMS; ``slo-router router``
(a process of its own, as deployed) routes to it over vLLM's gRPC. The same workload as the
worker comparison (``C`` concurrent streams of 64-token prompts and 128 output tokens,
``ignore_eos``) runs two ways: "direct" calls the engine's ``VllmEngine.Generate``; "router"
calls ``Router.Generate``.

How the comparison is kept fair on a shared host: the two sides run in *pairs*, back to back,
each concurrency in each round, the order swapped every round (direct then router, router then
direct), so a neighbour's burst of load hits both sides of some pairs rather than one side of
all of them. A warm-up round runs first and is not counted. Each round gives, per concurrency,
the ratio of the two sides' tokens/s and the difference of their TTFT medians; the summary is
the median of those per-round figures over the rounds, with the smallest and largest beside
it, and every round's figures are printed, so a noisy host shows as spread rather than as a
verdict. The router process's CPU seconds (user + system, from ``/proc``) per request and per
1,000 tokens relayed are printed too: they move much less with the neighbours' load than
wall-clock ratios do.

What "TTFT added" means at 16 streams: the 16 requests of a burst start at once, direct or
through the router. Direct, the engine's TTFT includes its own intake of the burst (one
request after another through its gRPC server) and its batching; through the router, each
request also passes the router's intake, decision and dispatch, which run one after the other
on the router's event loop, so the 16th request reaches the engine after the router's work for
the 15 before it. ``--engine synthetic:STEP_MS`` runs the same harness against
:mod:`bench.vllm_stock_synthetic` (an engine that costs nothing and answers on a fixed step), so
the router's share can be seen without the real engine's variance. Figures only, no assertions.

``--fronts grpcio,h2`` runs one router per ``--grpc-server`` (both on the same CMS and engine) and
adds each as a side of the same rounds: direct, then each router, back to back, the order rotated
every round; each router is judged against the direct run of its own round.

``--pin`` gives the engine a core of its own: every process and thread of the engine (the gRPC
API server, the ``EngineCore``, its worker) on one core, and the CMS, the agent, the routers and
this client on the others (:class:`PinLayout`), for both sides alike. Unpinned, on a 2-core host
without a GPU the engine's intake, scheduler and forward passes run on the cores the router's event
loop uses, so router CPU during a burst can delay the engine too; a GPU host does not couple them.
``--pin compute`` puts only the engine's worker process (the forward passes) on that core, and the
engine's API server and ``EngineCore`` with the router side. The pinned figures are those of a host
where the engine has compute of its own; the unpinned ones are this host's. The header says which
core holds what. ``--pin off,engine,compute`` takes the layouts in turn within each round (every
thread moved between them), so they are compared under the same neighbours' load; ``--pool
OUTPUT...`` pools saved outputs' rounds per layout and runs nothing.

    .venv/bin/python -m bench.vllm_stock                      # the real engine (needs .venv-vllm)
    .venv/bin/python -m bench.vllm_stock --engine synthetic:8 --rounds 8
    .venv/bin/python -m bench.vllm_stock --fronts grpcio,h2   # both gRPC servers of the router
    .venv/bin/python -m bench.vllm_stock --fronts h2 --pin    # the engine on a core of its own
    .venv/bin/python -m bench.vllm_stock --fronts h2 --pin compute   # only its forward passes there
    .venv/bin/python -m bench.vllm_stock --fronts h2 --pin off,engine  # both, in turn in each round
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.figures import Figure, print_load_average, without_vllm

#: (concurrent streams, requests per stream) of one run: the Done-when figures are tokens/s at 16
#: and 64 streams and TTFT at 1 and 16.
WORKLOAD: tuple[tuple[int, int], ...] = ((1, 6), (16, 2), (64, 1))
#: Counted rounds (a warm-up round runs before them); a round took 15-20 s on the real engine on
#: the loaded 2-core host, so the whole benchmark fits in about 5 minutes with the engine's start.
ROUNDS = 10
IDLE_PAUSE_S = 1.0
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
    """Run ``concurrency`` streams of ``per_stream`` requests each: (tokens/s, TTFTs in ms, tokens)."""
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


@dataclass
class Run:
    """One side at one concurrency in one round."""

    rate: float
    ttft_p50: float
    tokens: int
    requests: int
    #: The router process's CPU seconds during the run (while "direct" runs: its idle cost).
    router_cpu_s: float


@dataclass
class Pairs:
    """Every counted round's runs, per (side, concurrency)."""

    runs: dict[tuple[str, int], list[Run]] = field(default_factory=dict)
    load: list[float] = field(default_factory=list)

    def add(self, side: str, concurrency: int, run: Run) -> None:
        self.runs.setdefault((side, concurrency), []).append(run)

    def ratios(self, concurrency: int, side: str = "router") -> list[float]:
        """Per round: ``side``'s tokens/s ÷ direct tokens/s of the same round."""
        pairs = zip(self.runs[(side, concurrency)], self.runs[("direct", concurrency)], strict=True)
        return [r.rate / d.rate if d.rate else float("nan") for r, d in pairs]

    def ttft_added(self, concurrency: int, side: str = "router") -> list[float]:
        """Per round: ``side``'s TTFT p50 − direct TTFT p50 of the same round (ms)."""
        pairs = zip(self.runs[(side, concurrency)], self.runs[("direct", concurrency)], strict=True)
        return [r.ttft_p50 - d.ttft_p50 for r, d in pairs]


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


#: ``--pin`` layouts: what goes on the engine's core.
PIN_LAYOUTS = ("engine", "compute")


@dataclass(frozen=True)
class PinLayout:
    """``--pin``: which cores hold the engine, and which the router side (CMS, agent, routers, client).

    ``engine``: every process and thread of the engine (the gRPC API server, the ``EngineCore``,
    the worker that computes the forward passes) on the engine's core. ``compute``: only the
    worker process there, and the engine's API server and ``EngineCore`` with the router side:
    what a GPU host separates is the forward pass from everything on the CPU, the engine's own
    intake and scheduling included.
    """

    engine: frozenset[int]
    rest: frozenset[int]
    mode: str = "engine"

    def engine_env(self) -> dict[str, str]:
        """The engine's environment under this layout.

        vLLM's CPU worker binds its OpenMP threads (the forward pass) to the cores
        ``VLLM_CPU_OMP_THREADS_BIND`` lists, one thread per core. Its default, ``auto``, derives
        the list from the cores the process may use and keeps one back for the ``EngineCore``
        process when there are enough (unpinned on 2 cores: one OpenMP thread, bound to core 0,
        which the router may use too); on a single allowed core it warns and binds to that core.
        Naming the engine's cores makes the count (``OMP_NUM_THREADS``, set by vLLM from the
        list) and the binding explicit: one OpenMP thread per engine core, on that core, never on
        the router's.
        """
        return {"VLLM_CPU_OMP_THREADS_BIND": _cpu_list(self.engine)}

    def cores_for(self, title: str) -> frozenset[int]:
        """The cores of one of the engine's processes, by its command line (vLLM titles its worker
        process ``VLLM::Worker…``)."""
        if self.mode == "engine" or "::Worker" in title:
            return self.engine
        return self.rest

    def spawn_cores(self) -> frozenset[int]:
        """The cores the engine's first process starts on (its children inherit them)."""
        return self.engine if self.mode == "engine" else self.rest

    def describe(self) -> str:
        """The header line: which core holds what."""
        if self.mode == "engine":
            held = "the engine (every process and thread of it; a vLLM engine's OpenMP threads bound there)"
            others = "CMS, agent, router(s), this client"
        else:
            held = "the engine's worker process (the forward pass: its OpenMP threads bound there)"
            others = "the engine's API server and EngineCore, CMS, agent, router(s), this client"
        return f"pinned ({self.mode}): core {_cpu_list(self.engine)} = {held}; core {_cpu_list(self.rest)} = {others}"


def _cpu_list(cores: frozenset[int] | set[int]) -> str:
    return ",".join(str(c) for c in sorted(cores))


def _role(title: str, root: bool) -> str:
    """A short name for one of the engine's processes in the header."""
    if "VLLM::" in title:
        return title.split("VLLM::", 1)[1].split()[0]
    return "server" if root else (title.split()[0].rsplit("/", 1)[-1] if title else "?")


def pin_layout(allowed: set[int], mode: str = "engine") -> PinLayout:
    """The engine's core is the highest allowed one, the others the rest (ValueError below 2 cores)."""
    if mode not in PIN_LAYOUTS:
        raise ValueError(f"--pin {mode!r}: expected one of {', '.join(PIN_LAYOUTS)}")
    if len(allowed) < 2:
        raise ValueError(f"--pin needs at least 2 usable cores, this process may use {sorted(allowed)}")
    engine = max(allowed)
    return PinLayout(frozenset({engine}), frozenset(allowed - {engine}), mode)


#: How a figure's title names its layout.
PIN_WHAT = {
    "off": "not pinned",
    "engine": "the engine pinned to a core of its own",
    "compute": "the engine's worker (its forward passes) pinned to a core of its own",
}


def parse_layouts(text: str, allowed: set[int]) -> list[PinLayout | None]:
    """``--pin``'s value: comma-separated layouts among ``off`` (None) and :data:`PIN_LAYOUTS`, each
    once ("": unpinned only). ValueError for anything else, or a pinned layout on fewer than 2 cores."""
    names = [name.strip() for name in text.split(",") if name.strip()] or ["off"]
    if any(name not in ("off", *PIN_LAYOUTS) for name in names) or len(set(names)) != len(names):
        raise ValueError(f"--pin {text!r}: distinct values among off, {', '.join(PIN_LAYOUTS)}")
    return [None if name == "off" else pin_layout(allowed, name) for name in names]


def process_title(pid: int) -> str:
    """The command line of ``pid`` as one string ("" once it ended)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def pin_threads(pid: int, cores: frozenset[int] | set[int]) -> int:
    """Pin every thread of ``pid`` to ``cores`` (``sched_setaffinity`` of a pid moves only the thread
    of that id); returns how many were pinned. Threads created afterwards inherit their creator's mask."""
    pinned = 0
    with contextlib.suppress(FileNotFoundError):  # the process ended
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setaffinity(int(tid), cores)
                pinned += 1
    return pinned


def descendants(root: int) -> list[int]:
    """``root`` and every process below it (from ``/proc``; read once the engine has started)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def allowed_cores(pids: list[int]) -> set[int]:
    """The union of the cores every thread of ``pids`` may run on (what a pinning achieved)."""
    cores: set[int] = set()
    for pid in pids:
        with contextlib.suppress(FileNotFoundError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    cores |= os.sched_getaffinity(int(tid))
    return cores


@contextlib.contextmanager
def spawned_on(cores: frozenset[int] | set[int] | None) -> Iterator[None]:
    """Children forked inside the block start on ``cores`` (the calling thread's mask, which a fork
    inherits, set for the block and restored); None: unchanged. The engine's processes then never
    run a thread elsewhere, even during its start."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


#: vLLM's CPU engine logs its OpenMP binding: "local_rank=0, core ids=[0, 1]".
_OMP_CORES = re.compile(r"local_rank=\d+, core ids=\[([\d, ]*)\]")


def engine_omp_cores(log_text: str) -> str | None:
    """The cores the engine's OpenMP threads were bound to, from its log ("0,1"); None if not logged."""
    found = _OMP_CORES.findall(log_text)
    if not found:
        return None
    return ",".join(c.strip() for c in found[-1].split(",") if c.strip())


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


def start_cms_and_agent(
    start: Callable[..., tuple[subprocess.Popen[bytes], Path]],
    engine_address: str,
    timeout_s: float,
    *agent_args: str,
) -> tuple[int, subprocess.Popen[bytes]]:
    """A CMS on a free port and an agent registering the engine at ``engine_address`` with it,
    each started by ``start(name, *cli_args)`` and awaited (the agent for twice ``timeout_s``).
    Returns the CMS's port and the agent's process."""
    from workers.vllm_process import free_port

    cms_port = free_port()
    cms, cms_log = start("cms", "cms", "--listen", f"127.0.0.1:{cms_port}")
    _wait_line(cms_log, "listening", cms, timeout_s)
    agent, agent_log = start(
        "agent",
        "agent",
        "--engine",
        engine_address,
        "--cms",
        f"127.0.0.1:{cms_port}",
        "--instance-id",
        "v0",
        *agent_args,
    )
    _wait_line(agent_log, "registered vLLM engine", agent, 2 * timeout_s)
    return cms_port, agent


class SyntheticEngineProcess:
    """:mod:`bench.vllm_stock_synthetic` in a process of its own (the interface the harness uses)."""

    def __init__(self, root: Path, step_ms: str, python: str) -> None:
        from workers.vllm_process import free_port

        self.address = f"127.0.0.1:{free_port()}"
        self.log = root / "engine.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    python,
                    "-m",
                    "bench.vllm_stock_synthetic",
                    "--port",
                    self.address.rsplit(":", 1)[1],
                    "--step-ms",
                    step_ms,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=Path(__file__).resolve().parent.parent,
            )

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        _wait_line(self.log, "synthetic vLLM engine on", self.proc, timeout_s)


def stock_router_args(cms_port: int, router_port: int, model: Path | str) -> list[str]:
    """``slo-router router`` flags of the stock-vLLM benches: the CMS, a loopback port, the model's
    tokenizer, and ``load-balance`` placement (one engine: the path is measured, not the choice)."""
    return [
        "router",
        "--cms",
        f"grpc://127.0.0.1:{cms_port}",
        "--listen",
        f"127.0.0.1:{router_port}",
        "--tokenizer",
        str(model),
        "--scheduling-policy",
        "load-balance",
    ]


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


def _label(layout: PinLayout | None) -> str:
    return layout.mode if layout else "off"


def thread_masks(pids: list[int]) -> dict[int, set[int]]:
    """Every thread of ``pids`` and the cores it may run on now (what :func:`apply_layout` restores)."""
    masks: dict[int, set[int]] = {}
    for pid in pids:
        with contextlib.suppress(FileNotFoundError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    masks[int(tid)] = os.sched_getaffinity(int(tid))
    return masks


def apply_layout(
    layout: PinLayout | None,
    engine_pids: list[int],
    router_side: list[int],
    unpinned: dict[int, set[int]],
    every_core: set[int],
) -> None:
    """Move every thread of the engine's processes and of the router side to ``layout``'s cores;
    None: back to the masks they had unpinned (``unpinned``, the engine's OpenMP threads keep their
    binding), a thread started since on ``every_core``."""
    for pid in engine_pids:
        if layout:
            pin_threads(pid, layout.cores_for(process_title(pid)))
            continue
        with contextlib.suppress(FileNotFoundError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(ProcessLookupError):
                    os.sched_setaffinity(int(tid), unpinned.get(int(tid), every_core))
    for pid in router_side:
        pin_threads(pid, layout.rest if layout else every_core)


async def _run(
    root: Path,
    engine_spec: str,
    rounds: int,
    workload: tuple[tuple[int, int], ...],
    router_args: list[str],
    fronts: list[str] | None = None,
    layouts: list[PinLayout | None] | None = None,
) -> dict[str, Pairs]:
    """The paired rounds, per layout (``off``, ``engine``, ``compute``). ``fronts``: one router per
    ``--grpc-server`` value, sides ``router-NAME`` (None: one router as ``router_args`` say, side
    ``router``); ``layouts``: the cores of each side (None: unpinned only); several are taken in
    turn within each round, on the same engine and routers, moved between them."""
    import grpc
    from slorouter.v1 import router_pb2_grpc
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_pb2_grpc

    from workers.vllm_process import StockEngineProcess, build_tiny_model, free_port

    layouts = layouts or [None]
    pinned = [layout for layout in layouts if layout]
    model = build_tiny_model(root / "model")
    procs: list[subprocess.Popen[bytes]] = []
    engine: Any
    own_cores = os.sched_getaffinity(0)
    # One pinned layout: the engine is forked on its cores (so are its children, whose masks it
    # passes on), and this process (every thread) moves to the other cores before the CMS, agent and
    # routers are forked from it, so each inherits its side's mask from the start. Layouts in turn:
    # every process starts unpinned and is moved before each layout's runs; the engine's OpenMP
    # threads are bound to the engine's core in every layout (what "off" then differs in is only
    # who else may run there).
    alone = pinned[0] if len(layouts) == 1 and pinned else None
    with spawned_on(alone.spawn_cores() if alone else None):
        if engine_spec == "real":
            engine = StockEngineProcess(
                model, root / "engine.log", ENGINE_ARGS, env=pinned[0].engine_env() if pinned else None
            )
        else:
            engine = SyntheticEngineProcess(root, engine_spec.partition(":")[2] or "8", sys.executable)
            procs.append(engine.proc)
    if alone:
        pin_threads(os.getpid(), alone.rest)
    start = cli_starter(root, procs)
    results = {_label(layout): Pairs() for layout in layouts}
    try:
        started = time.perf_counter()
        await asyncio.to_thread(engine.wait_ready, ENGINE_WAIT_S)
        print(f"engine ready after {time.perf_counter() - started:.0f} s", flush=True)
        engine_pids = descendants(engine.proc.pid)
        omp = engine_omp_cores(engine.log_path.read_text(errors="replace")) if engine_spec == "real" else None
        cms_port, _ = start_cms_and_agent(start, engine.address, 30)
        routers: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
        for front in fronts or [""]:
            name = f"router-{front}" if front else "router"
            port = free_port()
            extra = ["--grpc-server", front] if front else []
            proc, log = start(name, *stock_router_args(cms_port, port, model), *extra, *router_args)
            _wait_line(log, "health: SERVING", proc, 60)
            routers[name] = (proc, port)
            print(f"{name} pid {proc.pid}", flush=True)
        router_side = [os.getpid(), *(p.pid for p in procs if p is not engine.proc)]
        unpinned = thread_masks(engine_pids + router_side)

        def report(layout: PinLayout | None) -> None:
            roles = ", ".join(
                f"{_role(process_title(pid), pid == engine.proc.pid)} {_cpu_list(allowed_cores([pid]))}"
                for pid in engine_pids
            )
            print(
                f"{layout.describe() if layout else 'not pinned (every process may run on every core)'}\n"
                f"  cores in use: engine processes {roles}{f' (OpenMP threads bound to {omp})' if omp else ''}; "
                f"CMS, agent, router(s) and this client {_cpu_list(allowed_cores(router_side))}",
                flush=True,
            )

        if alone:
            # Again, now that every thread exists: a thread a library started with its own mask moves too.
            apply_layout(alone, engine_pids, router_side, unpinned, own_cores)
        if len(layouts) == 1:
            report(alone)
        async with contextlib.AsyncExitStack() as channels:
            engine_channel = await channels.enter_async_context(grpc.aio.insecure_channel(engine.address))
            sides: dict[str, OneRequest] = {"direct": _direct(vllm_pb2_grpc.VllmEngineStub(engine_channel))}
            for name, (_, port) in routers.items():
                channel = await channels.enter_async_context(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
                sides[name] = _routed(router_pb2_grpc.RouterStub(channel))
            # While direct runs, its CPU column is the first router's idle cost.
            pids = {"direct": next(iter(routers.values()))[0].pid} | {
                n: p.pid for n, (p, _) in routers.items()
            }
            index = 0
            header = (
                "round  streams | direct tok/s TTFT p50 | side     tok/s TTFT p50 | ratio  added | "
                "router CPU ms/req | load" + (" | pinned" if len(layouts) > 1 else "")
            )
            names = list(sides)
            for round_index in range(rounds + 1):
                warm = round_index == 0
                # Pairs back to back, the order changed every round (swapped for two sides, rotated
                # for more): a burst of the neighbours' load falls on both sides of a pair more often
                # than on one side of every pair. Layouts in turn are rotated the same way.
                if len(names) == 2:
                    order = names if round_index % 2 else names[::-1]
                else:
                    k = round_index % len(names)
                    order = names[k:] + names[:k]
                k = round_index % len(layouts)
                for layout in layouts[k:] + layouts[:k]:
                    pairs = results[_label(layout)]
                    if len(layouts) > 1:
                        apply_layout(layout, engine_pids, router_side, unpinned, own_cores)
                        if warm:
                            report(layout)
                    if round_index == 1 and layout is layouts[k]:
                        print(header, flush=True)
                    for concurrency, per_stream in workload:
                        got: dict[str, Run] = {}
                        for side in order:
                            await asyncio.sleep(IDLE_PAUSE_S)
                            before = _cpu_s(pids[side])
                            rate, times, tokens = await _measure(sides[side], concurrency, per_stream, index)
                            index += concurrency * per_stream
                            got[side] = Run(
                                rate,
                                statistics.median(times),
                                tokens,
                                len(times),
                                _cpu_s(pids[side]) - before,
                            )
                        if warm:
                            continue
                        for side, run in got.items():
                            pairs.add(side, concurrency, run)
                        d = got["direct"]
                        load = os.getloadavg()[0]
                        for side in routers:
                            r = got[side]
                            print(
                                f"{round_index:>5} {concurrency:>8} | {d.rate:>12.0f} {d.ttft_p50:>6.1f}ms | "
                                f"{side.removeprefix('router-')[:6]:<6} {r.rate:>6.0f} {r.ttft_p50:>6.1f}ms | "
                                f"{r.rate / d.rate if d.rate else float('nan'):>5.2f} {r.ttft_p50 - d.ttft_p50:>+6.1f} | "
                                f"{1000 * r.router_cpu_s / max(1, r.requests):>17.2f} | {load:.1f}"
                                + (f" | {_label(layout)}" if len(layouts) > 1 else ""),
                                flush=True,
                            )
                    if not warm:
                        pairs.load.append(os.getloadavg()[0])
                if warm:
                    print(f"warm-up round done (not counted), load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        if pinned:
            pin_threads(os.getpid(), own_cores)
        stop_processes(procs)
        if engine_spec == "real":
            engine.stop(15)
    return results


#: A per-round row as :func:`_run` prints it (the layout column only when layouts took turns).
_ROUND_ROW = re.compile(
    r"^\s*(?P<round>\d+)\s+(?P<streams>\d+) \|\s+(?P<d_rate>[\d.]+)\s+(?P<d_ttft>[\d.]+)ms \| "
    r"(?P<side>\S+)\s+(?P<r_rate>[\d.]+)\s+(?P<r_ttft>[\d.]+)ms \|\s+\S+\s+\S+ \|\s+(?P<cpu>[\d.]+) \| "
    r"(?P<load>[\d.]+)(?: \| (?P<layout>\w+))?\s*$"
)


def pool_rounds(texts: list[str]) -> dict[str, Pairs]:
    """The per-round rows of saved runs' output, pooled per layout (``off`` when a run printed none),
    as :class:`Pairs` for :func:`summarize`: the median over every round of every run. A row's
    router side is ``router-NAME`` (NAME as printed: a front's name, or ``router`` alone)."""
    per_stream = dict(WORKLOAD)
    results: dict[str, Pairs] = {}
    for text in texts:
        seen: set[tuple[str, int, int]] = set()
        rounds: set[tuple[str, int]] = set()
        for line in text.splitlines():
            m = _ROUND_ROW.match(line)
            if m is None or int(m["streams"]) not in per_stream:
                continue
            layout, concurrency = m["layout"] or "off", int(m["streams"])
            pairs = results.setdefault(layout, Pairs())
            requests = concurrency * per_stream[concurrency]
            tokens = requests * OUTPUT_TOKENS
            if (layout, int(m["round"]), concurrency) not in seen:
                seen.add((layout, int(m["round"]), concurrency))
                pairs.add(
                    "direct", concurrency, Run(float(m["d_rate"]), float(m["d_ttft"]), tokens, requests, 0.0)
                )
            if (layout, int(m["round"])) not in rounds:
                rounds.add((layout, int(m["round"])))
                pairs.load.append(float(m["load"]))
            side = m["side"] if m["side"] == "router" else f"router-{m['side']}"
            cpu_s = float(m["cpu"]) * requests / 1000
            pairs.add(side, concurrency, Run(float(m["r_rate"]), float(m["r_ttft"]), tokens, requests, cpu_s))
    return results


def layout_differences(texts: list[str], a: str, b: str, side: str, concurrency: int) -> list[float]:
    """Per round of saved outputs where layouts ``a`` and ``b`` took turns: ``a``'s TTFT added at
    ``concurrency`` minus ``b``'s in the same round (ms), for router side ``side`` (as printed)."""
    out: list[float] = []
    for text in texts:
        added: dict[tuple[str, int], float] = {}
        for line in text.splitlines():
            m = _ROUND_ROW.match(line)
            if m and m["side"] == side and int(m["streams"]) == concurrency:
                added[(m["layout"] or "off", int(m["round"]))] = float(m["r_ttft"]) - float(m["d_ttft"])
        out.extend(added[(a, r)] - added[(b, r)] for layout, r in added if layout == a and (b, r) in added)
    return out


def _quartiles(values: list[float]) -> str:
    """``median (first quartile…third quartile)``."""
    if len(values) < 2:
        return f"{statistics.median(values):+.1f}"
    q1, _, q3 = statistics.quantiles(values, n=4)
    return f"{statistics.median(values):+.1f} ({q1:+.1f}…{q3:+.1f})"


def _spread(values: list[float], fmt: str) -> str:
    """``median (min–max)`` of per-round figures."""
    return f"{format(statistics.median(values), fmt)} ({format(min(values), fmt)}–{format(max(values), fmt)})"


def summarize(
    pairs: Pairs, workload: tuple[tuple[int, int], ...], side: str = "router"
) -> tuple[str, list[str]]:
    """The figure's text and the lines printed under the per-round table (``side``: which router)."""
    lines = [
        f"{'streams':>7} | {'direct tok/s':>12} {'router tok/s':>12} | {'ratio, median (min–max)':>24} | "
        f"{'TTFT added ms, median (min–max)':>32} | {'router CPU ms/req':>17} {'ms/1k tok':>9}"
    ]
    ratios: dict[int, str] = {}
    added: dict[int, str] = {}
    for concurrency, _ in workload:
        direct, routed = pairs.runs[("direct", concurrency)], pairs.runs[(side, concurrency)]
        ratios[concurrency] = _spread(pairs.ratios(concurrency, side), ".2f")
        added[concurrency] = _spread(pairs.ttft_added(concurrency, side), "+.1f")
        cpu = sum(r.router_cpu_s for r in routed)
        per_req = 1000 * cpu / max(1, sum(r.requests for r in routed))
        per_k = 1e6 * cpu / max(1, sum(r.tokens for r in routed))
        lines.append(
            f"{concurrency:>7} | {statistics.median(r.rate for r in direct):>12.0f} "
            f"{statistics.median(r.rate for r in routed):>12.0f} | {ratios[concurrency]:>24} | "
            f"{added[concurrency]:>32} | {per_req:>17.2f} {per_k:>9.0f}"
        )
    done = []
    for concurrency in (16, 64):
        if concurrency in ratios:
            done.append(
                f"tokens/s router ÷ direct at {concurrency} streams {ratios[concurrency]} (goal ≥ 0.90)"
            )
    for concurrency in (1, 16):
        if concurrency in added:
            done.append(
                f"TTFT added at {concurrency} stream{'s' if concurrency > 1 else ''} {added[concurrency]} ms (goal ≤ 5)"
            )
    rounds = len(pairs.load)
    text = "; ".join(done) + f"; medians over {rounds} paired rounds (min–max)"
    return text, lines


def _pooled(paths: list[str]) -> list[Figure]:
    """``--pool``: the summary of saved outputs' rounds, per layout and router side."""
    results = pool_rounds([Path(path).read_text(errors="replace") for path in paths])
    figures = []
    order = ("off", *PIN_LAYOUTS)
    for layout, pairs in sorted(
        results.items(), key=lambda item: order.index(item[0]) if item[0] in order else 9
    ):
        workload = tuple((c, n) for c, n in WORKLOAD if ("direct", c) in pairs.runs)
        sides = sorted({side for side, _ in pairs.runs if side != "direct"})
        for side in sides:
            print(
                f"{PIN_WHAT.get(layout, layout)}, {side} ({len(pairs.load)} rounds from {len(paths)} file(s), "
                f"load {min(pairs.load):.1f}–{max(pairs.load):.1f}):"
            )
            text, lines = summarize(pairs, workload, side)
            for line in lines:
                print(line)
            print(text)
            quartiles = " / ".join(_quartiles(pairs.ttft_added(c, side)) for c, _ in workload)
            print(
                f"TTFT added at {' / '.join(str(c) for c, _ in workload)} streams, median (quartiles): {quartiles} ms"
            )
            figures.append(Figure(f"pooled rounds, {PIN_WHAT.get(layout, layout)}, {side}", text))
    texts = [Path(path).read_text(errors="replace") for path in paths]
    for a in PIN_LAYOUTS:
        for b in ("off", *PIN_LAYOUTS):
            for side in sorted(
                {side for pairs in results.values() for side, _ in pairs.runs if side != "direct"}
            ):
                printed = side.removeprefix("router-")[:6]
                for concurrency, _ in WORKLOAD:
                    diffs = (
                        layout_differences(texts, a, b, printed, concurrency) if a < b or b == "off" else []
                    )
                    if diffs:
                        print(
                            f"within a round, {a} − {b} TTFT added at {concurrency} streams ({side}): "
                            f"{_quartiles(diffs)} ms, {a} lower in {sum(d < 0 for d in diffs)} of {len(diffs)}"
                        )
    return figures


def main(argv: list[str] | None = None) -> list[Figure]:
    """The stock-engine rows of ``python -m bench vllm`` (and ``python -m bench.vllm_stock [options]``)."""
    from workers.vllm_process import MISSING_VENV_HINT, VLLM_PYTHON

    parser = argparse.ArgumentParser(prog="python -m bench.vllm_stock", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rounds", type=int, default=ROUNDS, help="counted rounds, after one warm-up (default: %(default)s)"
    )
    parser.add_argument(
        "--engine",
        default="real",
        help="real (vLLM's gRPC server, the tiny model) or synthetic:STEP_MS (bench.vllm_stock_synthetic: no "
        "engine cost, a token per request every STEP_MS) (default: real)",
    )
    parser.add_argument(
        "--streams",
        default=",".join(str(c) for c, _ in WORKLOAD),
        help="concurrencies, comma-separated, from %(default)s (default: all)",
    )
    parser.add_argument(
        "--router-args",
        default="",
        help='extra flags for the router, e.g. "--queue-policy none" (default: none)',
    )
    parser.add_argument(
        "--fronts",
        default=os.environ.get("BENCH_VLLM_STOCK_FRONTS", ""),
        metavar="grpcio,h2",
        help="one router per --grpc-server value given (comma-separated), each a side of the same paired "
        "rounds (default: $BENCH_VLLM_STOCK_FRONTS, else one router with the default server)",
    )
    parser.add_argument(
        "--pin",
        nargs="?",
        const="engine",
        default="",
        metavar="off,engine,compute",
        help="engine (bare --pin): the engine's processes on one core, the CMS, agent, routers and this "
        "client on the others; compute: only the engine's worker process (its forward passes) on that core; "
        "off: unpinned. Both sides alike. Several, comma-separated: taken in turn within each round, on the "
        "same engine and routers (default: unpinned)",
    )
    parser.add_argument(
        "--pool",
        nargs="+",
        metavar="OUTPUT",
        help="run nothing: pool the per-round rows of saved outputs of this bench, per layout, and print "
        "their summary (medians over every round of every file)",
    )
    options = parser.parse_args([] if argv is None else argv)
    if options.pool:
        return _pooled(options.pool)
    per_stream = dict(WORKLOAD)
    try:
        wanted = [int(x) for x in options.streams.split(",")]
    except ValueError:
        parser.error(f"--streams {options.streams!r}: expected integers separated by commas")
    if any(c not in per_stream for c in wanted):
        parser.error(f"--streams {options.streams!r}: each must be one of {', '.join(map(str, per_stream))}")
    if not 1 <= options.rounds <= 100:
        parser.error(f"--rounds {options.rounds}: must be within 1-100")
    if options.engine != "real" and not options.engine.startswith("synthetic"):
        parser.error(f"--engine {options.engine!r}: expected real or synthetic:STEP_MS")
    fronts = [f for f in options.fronts.split(",") if f]
    from router.server import GRPC_SERVERS

    if any(f not in GRPC_SERVERS for f in fronts) or len(set(fronts)) != len(fronts):
        parser.error(f"--fronts {options.fronts!r}: distinct values among {', '.join(GRPC_SERVERS)}")
    try:
        layouts = parse_layouts(options.pin, os.sched_getaffinity(0))
    except ValueError as exc:
        parser.error(str(exc))
    workload = tuple((c, per_stream[c]) for c in wanted)
    streams = " / ".join(str(c) for c, _ in workload)
    what = f"stock vLLM gRPC engine through the router vs direct, {streams} streams"
    if options.engine == "real" and not VLLM_PYTHON.exists():
        return without_vllm(what, MISSING_VENV_HINT)
    print_load_average()
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-stock-") as tmp:
        try:
            results = asyncio.run(
                _run(
                    Path(tmp),
                    options.engine,
                    options.rounds,
                    workload,
                    shlex.split(options.router_args),
                    fronts or None,
                    layouts,
                )
            )
        except RuntimeError as exc:
            print(f"the stock-engine benchmark failed: {exc}")
            return [Figure(what, f"not measured: {str(exc)[:200]}")]
    loads = [load for pairs in results.values() for load in pairs.load]
    print(
        f"load average after: {os.getloadavg()[0]:.1f}; during the rounds "
        f"{min(loads):.1f}–{max(loads):.1f}; {time.perf_counter() - began:.0f} s in all"
    )
    engine = "tiny Llama (float32, eager, max_num_seqs 64)" if options.engine == "real" else options.engine
    print(
        f"router flags: {options.router_args or '(defaults)'}; workload: {PROMPT_TOKENS}-token prompts, {OUTPUT_TOKENS} output tokens, {engine}; per concurrency "
        f"{', '.join(f'{c}×{n}' for c, n in workload)} (streams × requests each); "
        "router = slo-router router "
        "(own process) → vLLM's gRPC; ratio and TTFT added are per round (router vs direct back to back), "
        "summarized as the median over rounds (min–max)"
    )
    figures = []
    for layout in layouts:
        pairs = results[_label(layout)]
        where = ""
        if layout or len(layouts) > 1:
            print(layout.describe() if layout else "not pinned (every process may run on every core):")
            where = f", {PIN_WHAT[_label(layout)]}"
        for front in fronts or [""]:
            side = f"router-{front}" if front else "router"
            text, lines = summarize(pairs, workload, side)
            if front:
                print(f"--grpc-server {front}:")
            for line in lines:
                print(line)
            print(text)
            figures.append(Figure((f"{what} (--grpc-server {front})" if front else what) + where, text))
    return figures


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main(sys.argv[1:])
