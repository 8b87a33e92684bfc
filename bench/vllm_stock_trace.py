"""Where a request's time to first token goes inside the router, on the synthetic vLLM engine.

``python -m bench.vllm_stock`` says how much TTFT the router adds; this says where. One
:mod:`bench.vllm_stock_synthetic` engine (it costs nothing and answers on a fixed step, so the
host's load moves the engine's share little), a CMS, an agent and one ``slo-router router``
process whose interpreter loads a trace hook (a ``sitecustomize`` module this harness writes
into a temporary directory put first on the router's ``PYTHONPATH``; nothing of it is in the
router's code). The hook notes, per request, on the monotonic clock every process shares:

- ``enter``: the router's ``generate`` starts (the gRPC server has accepted and parsed the call);
- ``placed``: the admission returned the decision;
- ``sent``: the HTTP/2 write carrying the request to the engine left;
- ``back``: the engine's first message for it was parsed;
- ``out``: the router's ``generate`` yields the first token (the gRPC write follows);
- ``first``: the client has the first token (the client notes its send and this one).

and the router's event-loop thread's CPU time at each, so with one stream (nothing interleaved)
the CPU between two stages is that stage's own work. Bursts of 1, 16 and 64 concurrent requests
(128 tokens each) run ``--rounds`` times after a warm-up; printed are the median times of each
stage from the client's send, the 90th percentile of the client's TTFT, the router's CPU per
request (user + system, ``/proc``), and the loop's CPU per stage per burst size (at one stream
each stage's own work; in a burst ``enter``→``placed`` still is, since a request placed at once
never pauses on the way, while the later stages interleave with the other requests'). ``--noop``
replaces the router's ``generate`` with one that answers a token at once (the gRPC server's own
floor for a burst, whichever ``--grpc-server`` serves it). Figures only.

    .venv/bin/python -m bench.vllm_stock_trace --rounds 6
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.figures import print_load_average
from bench.vllm_stock import (
    OUTPUT_TOKENS,
    SyntheticEngineProcess,
    _cpu_s,
    _prompt,
    _wait_line,
    start_cms_and_agent,
    stock_router_args,
    stop_processes,
)

REPO = Path(__file__).resolve().parent.parent
STAGES = ("enter", "placed", "sent", "back", "out")

#: The router process's trace hook (written as ``sitecustomize.py``; active only in a process whose
#: environment names the output file, so the CMS and the agent started beside it are untouched).
HOOK = r"""
import atexit, json, os, sys, time

_OUT = os.environ.get("SLO_ROUTER_BENCH_TRACE")
if _OUT and sys.orig_argv[3:4] == ["router"]:
    import router.admission as _admission
    import router.service as _service
    import router.vllm_h2 as _h2

    _times = {}
    _clock, _cpu = time.perf_counter, time.thread_time

    def _mark(rid, stage):
        entry = _times.setdefault(rid, {})
        if stage not in entry:
            entry[stage] = (_clock(), _cpu())

    if os.environ.get("SLO_ROUTER_BENCH_NOOP"):
        from slorouter.v1 import router_pb2 as _pb

        class _Answer:
            def __init__(self, rid):
                self._rid = rid

            def message(self):
                return _pb.GenerateResponse(
                    request_id=self._rid, token_ids=[5], finished=True, finish_reason="length"
                )

        # ``generate`` is what both fronts call (the grpc.aio servicer's ``Generate`` and the h2
        # server's method): answering there is each server's floor.
        async def _noop(self, request):
            yield _Answer(request.request_id)

        _service.RouterService.generate = _noop

    _generate = _service.RouterService.generate

    async def _traced_generate(self, request):
        rid = request.request_id
        _mark(rid, "enter")
        inner = _generate(self, request)
        try:
            async for message in inner:
                _mark(rid, "out")
                yield message
        finally:
            await inner.aclose()

    _service.RouterService.generate = _traced_generate
    _place = _admission.Admission.place

    async def _traced_place(self, req, **kwargs):
        admitted = await _place(self, req, **kwargs)
        _mark(req.request_id, "placed")
        return admitted

    _admission.Admission.place = _traced_place
    _ids = {}
    _unsent = []
    _start = _h2.H2Connection.start

    def _traced_start(self, path, body, timeout_s, sink):
        stream = _start(self, path, body, timeout_s, sink)
        # GenerateRequest's field 1 (request_id) leads its encoding: tag 0x0a, a short length, the id.
        if body[:1] == b"\x0a" and body[1] < 128:
            rid = body[2 : 2 + body[1]].decode()
            _ids[id(stream)] = rid
            _unsent.append(rid)
        return stream

    _h2.H2Connection.start = _traced_start
    _send = _h2.H2Connection._send

    def _traced_send(self):
        for rid in _unsent:
            _mark(rid, "sent")
        _unsent.clear()
        return _send(self)

    _h2.H2Connection._send = _traced_send
    _data_end = _h2.H2Connection._data_end

    def _traced_data_end(stream, flags):
        if stream.ready:
            rid = _ids.get(id(stream))
            if rid is not None:
                _mark(rid, "back")
        return _data_end(stream, flags)

    _h2.H2Connection._data_end = staticmethod(_traced_data_end)

    _profile_out = os.environ.get("SLO_ROUTER_BENCH_PROFILE")
    if _profile_out:
        import cProfile

        _profiler = cProfile.Profile()
        _profiler.enable()  # the main thread: the router's event loop

    def _dump():
        with open(_OUT, "w") as out:
            json.dump(_times, out)
        if _profile_out:
            _profiler.disable()
            _profiler.dump_stats(_profile_out)

    atexit.register(_dump)
"""


async def _run(options: argparse.Namespace, root: Path) -> None:
    import grpc
    from slorouter.v1 import common_pb2, router_pb2, router_pb2_grpc

    from workers.vllm_process import build_tiny_model, free_port

    model = build_tiny_model(root / "model")
    hook_dir = root / "hook"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(HOOK)
    trace = root / "trace.json"
    procs: list[subprocess.Popen[bytes]] = []
    engine = SyntheticEngineProcess(root, str(options.step_ms), sys.executable)
    procs.append(engine.proc)

    def start(
        name: str, *args: str, env: dict[str, str] | None = None
    ) -> tuple[subprocess.Popen[bytes], Path]:
        log = root / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "router.cli", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=options.router_dir if name == "router" else REPO,
                env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
            )
        procs.append(proc)
        return proc, log

    client: dict[str, tuple[int, float, float]] = {}
    cpu: dict[int, list[float]] = {}
    try:
        await asyncio.to_thread(engine.wait_ready, 60.0)
        cms_port, _ = start_cms_and_agent(start, engine.address, 60)
        router_port = free_port()
        hook_env = {
            "PYTHONPATH": f"{hook_dir}{os.pathsep}{options.router_dir}",
            "SLO_ROUTER_BENCH_TRACE": str(trace),
        }
        if options.noop:
            hook_env["SLO_ROUTER_BENCH_NOOP"] = "1"
        if options.profile:
            hook_env["SLO_ROUTER_BENCH_PROFILE"] = options.profile
        router, router_log = start(
            "router",
            *stock_router_args(cms_port, router_port, model),
            *options.router_args.split(),
            env=hook_env,
        )
        _wait_line(router_log, "health: SERVING", router, 120)
        sampling = common_pb2.SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router_port}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)

            async def one(i: int, burst: int, counted: bool) -> None:
                request = router_pb2.GenerateRequest(
                    request_id=f"trace-{i}", prompt_token_ids=_prompt(i), sampling=sampling
                )
                sent = time.perf_counter()
                first = 0.0
                async for message in stub.Generate(request, timeout=300):
                    if not first and message.token_ids:
                        first = time.perf_counter()
                if counted:
                    client[request.request_id] = (burst, sent, first)

            index = 0
            for round_index in range(options.rounds + 1):
                for burst in options.streams:
                    await asyncio.sleep(options.pause_s)
                    before = _cpu_s(router.pid)
                    await asyncio.gather(*(one(index + k, burst, round_index > 0) for k in range(burst)))
                    if round_index > 0:
                        cpu.setdefault(burst, []).append(1000 * (_cpu_s(router.pid) - before) / burst)
                    index += burst
        router.send_signal(signal.SIGTERM)
        router.wait(60)
    finally:
        stop_processes(procs)
    times: dict[str, dict[str, list[float]]] = json.loads(trace.read_text())
    stages = ("enter",) if options.noop else STAGES
    print(
        f"{'streams':>7} | {'router CPU ms/req':>17} | median ms from the client's send: "
        + " ".join(f"{s:>6}" for s in (*stages, "first"))
        + f" | {'first p90':>9}"
    )
    for burst in options.streams:
        rows = []
        for rid, (b, sent, first) in client.items():
            marks = times.get(rid, {})
            if b != burst or any(s not in marks for s in stages):
                continue
            rows.append([(marks[s][0] - sent) * 1000 for s in stages] + [(first - sent) * 1000])
        if not rows:
            print(f"{burst:>7} | no traced request")
            continue
        medians = [statistics.median(column) for column in zip(*rows, strict=True)]
        firsts = sorted(row[-1] for row in rows)
        p90 = firsts[min(len(firsts) - 1, int(0.9 * len(firsts)))]
        print(
            f"{burst:>7} | {statistics.median(cpu[burst]):>17.2f} | {'':>34}"
            + " ".join(f"{m:>6.1f}" for m in medians)
            + f" | {p90:>9.1f}"
        )
    if options.noop:
        return
    for burst in options.streams:
        steps: list[list[float]] = []
        for rid, (b, _, _) in client.items():
            marks = times.get(rid, {})
            if b == burst and all(s in marks for s in STAGES):
                steps.append([1e6 * (marks[b_][1] - marks[a][1]) for a, b_ in itertools.pairwise(STAGES)])
        if not steps:
            continue
        # enter→placed runs without a pause (the decision never waits when it dispatches at once), so
        # it is that request's own CPU in a burst too; the later stages interleave with the others'.
        named = ", ".join(
            f"{a}→{b} {statistics.median(column):.0f}"
            for (a, b), column in zip(itertools.pairwise(STAGES), zip(*steps, strict=True), strict=True)
        )
        print(f"{burst} stream(s), the router loop's CPU per stage (µs, median of {len(steps)}): {named}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.vllm_stock_trace", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rounds", type=int, default=6, help="counted rounds after a warm-up (default: 6)")
    parser.add_argument(
        "--streams", default="1,16,64", help="burst sizes, comma-separated (default: %(default)s)"
    )
    parser.add_argument("--step-ms", type=float, default=8.0, help="the synthetic engine's step (default: 8)")
    parser.add_argument(
        "--pause-s", type=float, default=1.0, help="idle pause before each burst (default: 1)"
    )
    parser.add_argument("--router-args", default="", help="extra flags for the router")
    parser.add_argument(
        "--router-dir",
        default=str(REPO),
        help="the router's code (a `git archive` of another commit; default: this checkout)",
    )
    parser.add_argument(
        "--noop", action="store_true", help="the router's Generate answers at once (the gRPC server's floor)"
    )
    parser.add_argument(
        "--profile",
        default="",
        metavar="FILE",
        help="write the router event loop's cProfile stats to FILE (pstats; slows the router)",
    )
    options = parser.parse_args(argv)
    options.router_dir = Path(options.router_dir).resolve()
    if options.profile:
        options.profile = str(Path(options.profile).resolve())  # the router runs in --router-dir
    if not (options.router_dir / "router" / "cli.py").exists():
        parser.error(f"--router-dir {options.router_dir}: holds no router/cli.py")
    try:
        options.streams = [int(x) for x in options.streams.split(",")]
    except ValueError:
        parser.error(f"--streams {options.streams!r}: expected integers separated by commas")
    if not 1 <= options.rounds <= 100 or any(not 1 <= s <= 256 for s in options.streams):
        parser.error("--rounds must be within 1-100 and each of --streams within 1-256")
    if not 0.5 <= options.step_ms <= 10_000:
        parser.error(f"--step-ms {options.step_ms}: must be within 0.5-10000")
    print_load_average()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-trace-") as tmp:
        asyncio.run(_run(options, Path(tmp)))
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
