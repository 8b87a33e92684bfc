"""``slo`` against ``load-balance`` through the router on equal stock vLLM engines, near capacity.

The stock-engine path of ``python -m bench vllm``, second part. ``ENGINES`` unmodified vLLM gRPC
engines (``python -m vllm.entrypoints.launchers.grpc_server``, the tiny model, the same settings
each, role neutral), one ``slo-router agent`` beside each, one CMS, and two routers on that CMS:
``--scheduling-policy slo`` and ``--scheduling-policy load-balance``, both with the bundled profile
and the router's online calibration (the agents' decode-step estimates correct it for these
engines). ``slo-router bench --engine vllm`` replays the mixed interactive/batch workload
(``scripts/stock-mixed.json``: 70 % interactive with TTFT and TPOT targets, 30 % batch with an e2e
target) open loop at each rate, the two routers taking turns on the same seed, the order swapped
every round. Nothing in either router was tuned for this workload or these engines.

The rates are the point: below the fleet's capacity both policies meet nearly everything, far past
it both fail nearly everything; ``--rates`` should bracket the knee (on a 2-core host at load
average 20-30, two engines of the tiny model met most of this mix at 12-16 requests/s and about a
third at 20). Figures only.

    .venv/bin/python -m bench.vllm_stock_slo --rates 12,16 --rounds 2 --duration 30
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.figures import Figure, print_load_average, without_vllm
from bench.vllm_stock import ENGINE_WAIT_S, _wait_line, cli_starter, stop_processes

REPO = Path(__file__).resolve().parent.parent
WORKLOAD = REPO / "scripts" / "stock-mixed.json"
POLICIES = ("slo", "load-balance")
ENGINES = 2
#: Per engine: a batch large enough that the fleet, not the batch cap, is the limit.
ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "1024", "--enforce-eager", "--max-num-seqs", "32"]
DEFAULT_RATES = (12.0, 16.0)
DEFAULT_ROUNDS = 2
DEFAULT_DURATION_S = 30.0
#: Requests per policy before the measured rounds (the calibration's first samples, the JIT).
WARMUP_S = 10.0


def _attainment(path: Path) -> dict[str, float]:
    data = json.loads(path.read_text())
    overall = data["overall"]
    out = {"all": 100 * overall["slo_attainment"], "goodput": overall["goodput_rps"]}
    for name, figures in data["classes"].items():
        out[name] = 100 * figures["slo_attainment"]
    return out


def _calibration(metrics_port: int) -> str:
    """The router's calibration factors per prediction (``slo_router_calibration_factor_ratio``)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    except OSError as exc:
        return f"metrics not read ({exc})"
    factors = [
        line.split("{", 1)[1].replace('"', "").replace("}", " =")
        for line in text.splitlines()
        if line.startswith("slo_router_calibration_factor_ratio{")
    ]
    return "; ".join(factors) or "none"


#: How often the probe asks each router's dry run (``Router.Schedule`` with ``explain``) while it serves.
PROBE_INTERVAL_S = 0.5


class Probe:
    """Asks a router's dry run, while a run goes, where a typical request of each class would go.

    Nothing is dispatched (``Router.Schedule``). Counts, per class, how often the request would
    wait in the router queue and which filter dropped the candidates: why a policy held requests
    that the fleet could have served. Runs in a thread of its own (the runs are subprocesses).
    """

    def __init__(self, port: int) -> None:
        import threading

        self.port = port
        self.counts: dict[str, dict[str, int]] = {}
        self.reasons: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Probe:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _loop(self) -> None:
        import grpc
        from slorouter.v1 import common_pb2, router_pb2, router_pb2_grpc

        requests = {
            "interactive": router_pb2.GenerateRequest(
                prompt_token_ids=[5 + i % 900 for i in range(200)],
                sampling=common_pb2.SamplingParams(max_tokens=48, ignore_eos=True),
                slo=common_pb2.SloTarget(ttft_ms=500.0, tpot_ms=60.0),
                slo_class="interactive",
            ),
            "batch": router_pb2.GenerateRequest(
                prompt_token_ids=[7 + i % 900 for i in range(600)],
                sampling=common_pb2.SamplingParams(max_tokens=64, ignore_eos=True),
                slo=common_pb2.SloTarget(e2e_ms=8000.0),
                slo_class="batch",
            ),
        }
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            while not self._stop.wait(PROBE_INTERVAL_S):
                for name, request in requests.items():
                    counts = self.counts.setdefault(name, {})
                    try:
                        answer = stub.Schedule(
                            router_pb2.ScheduleRequest(request=request, explain=True), timeout=5
                        )
                    except grpc.RpcError as exc:
                        counts[f"error {exc.code().name}"] = counts.get(f"error {exc.code().name}", 0) + 1
                        continue
                    counts["probes"] = counts.get("probes", 0) + 1
                    if answer.queued:
                        counts["queued"] = counts.get("queued", 0) + 1
                        self.reasons[name] = answer.queue_reason
                        for candidate in answer.trace:
                            if candidate.dropped_by:
                                key = f"dropped by {candidate.dropped_by}"
                                counts[key] = counts.get(key, 0) + 1

    def summary(self) -> str:
        parts = []
        for name, counts in self.counts.items():
            probes = max(1, counts.get("probes", 0))
            drops = ", ".join(
                f"{k} {v}" for k, v in sorted(counts.items()) if k.startswith(("dropped", "error"))
            )
            parts.append(
                f"{name}: would wait {100 * counts.get('queued', 0) / probes:.0f} % of {probes} probes"
                + (f" ({drops})" if drops else "")
                + (f", last reason: {self.reasons[name][:200]}" if name in self.reasons else "")
            )
        return "; ".join(parts)


def _run(options: argparse.Namespace, root: Path) -> dict[tuple[float, str], list[dict[str, float]]]:
    from workers.vllm_process import StockEngineProcess, build_tiny_model, free_port

    model = build_tiny_model(root / "model")
    cli = str(Path(sys.executable).parent / "slo-router")  # the bench runs below
    procs: list[subprocess.Popen[bytes]] = []
    engines = [
        StockEngineProcess(model, root / f"engine{i}.log", ENGINE_ARGS) for i in range(options.engines)
    ]
    start = cli_starter(root, procs)

    def bench(port: int, rate: float, seed: int, duration: float, out: Path) -> None:
        subprocess.run(
            [
                cli, "bench", "--engine", "vllm", "--target", f"127.0.0.1:{port}",
                "--workload", str(WORKLOAD), "--rate", f"{rate:g}", "--duration", f"{duration:g}",
                "--seed", str(seed), "--output", str(out), "--no-progress",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            check=True,
            timeout=duration + 120,
        )  # fmt: skip

    results: dict[tuple[float, str], list[dict[str, float]]] = {}
    try:
        started = time.perf_counter()
        for engine in engines:
            engine.wait_ready(ENGINE_WAIT_S)
        print(f"{len(engines)} engines ready after {time.perf_counter() - started:.0f} s", flush=True)
        cms_port = free_port()
        cms, cms_log = start("cms", "cms", "--listen", f"127.0.0.1:{cms_port}")
        _wait_line(cms_log, "listening", cms, 30)
        for i, engine in enumerate(engines):
            agent, log = start(
                f"agent{i}", "agent", "--engine", engine.address, "--cms", f"127.0.0.1:{cms_port}",
                "--instance-id", f"v{i}",
            )  # fmt: skip
            _wait_line(log, "registered vLLM engine", agent, 60)
        ports: dict[str, int] = {}
        metrics_ports: dict[str, int] = {}
        for policy in POLICIES:
            port, metrics_ports[policy] = free_port(), free_port()
            proc, log = start(
                f"router-{policy}", "router", "--cms", f"grpc://127.0.0.1:{cms_port}",
                "--listen", f"127.0.0.1:{port}", "--tokenizer", str(model),
                "--scheduling-policy", policy, "--metrics-port", str(metrics_ports[policy]),
                *options.router_args,
            )  # fmt: skip
            _wait_line(log, "health: SERVING", proc, 60)
            ports[policy] = port
        for policy, port in ports.items():
            bench(port, min(options.rates), 999, WARMUP_S, root / f"warmup-{policy}.json")
        seed = options.seed
        for round_index in range(options.rounds):
            order = list(POLICIES) if round_index % 2 == 0 else list(reversed(POLICIES))
            for rate in options.rates:
                seed += 1
                for policy in order:
                    time.sleep(3.0)  # the previous run's stragglers drain
                    out = root / f"r{rate:g}-s{seed}-{policy}.json"
                    with Probe(ports[policy]) as probe:
                        bench(ports[policy], rate, seed, options.duration, out)
                    figures = _attainment(out)
                    results.setdefault((rate, policy), []).append(figures)
                    print(
                        f"round {round_index + 1} rate {rate:g}/s seed {seed} {policy:>12}: attainment "
                        f"{figures['all']:5.1f} % (interactive {figures.get('interactive', 0):5.1f} %, "
                        f"batch {figures.get('batch', 0):5.1f} %), load average {os.getloadavg()[0]:.1f}",
                        flush=True,
                    )
                    print(f"    dry run during the run: {probe.summary()}", flush=True)
                    print(f"    calibration after the run: {_calibration(metrics_ports[policy])}", flush=True)
    finally:
        stop_processes(procs)
        for engine in engines:
            engine.stop(15)
    return results


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.vllm_stock_slo", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument(
        "--rates",
        default=",".join(f"{r:g}" for r in DEFAULT_RATES),
        help="arrival rates per second, comma-separated (default: %(default)s)",
    )
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="rounds (default: %(default)s)")
    parser.add_argument(
        "--duration", type=float, default=DEFAULT_DURATION_S, help="seconds per run (default: %(default)s)"
    )
    parser.add_argument("--engines", type=int, default=ENGINES, help="engines (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=100, help="first seed (default: %(default)s)")
    parser.add_argument(
        "--router-arg", dest="router_args", action="append", default=[], help="extra router flag (repeatable)"
    )
    options = parser.parse_args(argv)
    try:
        options.rates = [float(x) for x in options.rates.split(",")]
    except ValueError:
        parser.error(f"--rates {options.rates!r}: expected numbers separated by commas")
    if not all(0 < r <= 200 for r in options.rates):
        parser.error(f"--rates {options.rates}: each must be within (0, 200]")
    if not 1 <= options.rounds <= 20:
        parser.error(f"--rounds {options.rounds}: must be within 1-20")
    if not 5 <= options.duration <= 600:
        parser.error(f"--duration {options.duration}: must be within 5-600 seconds")
    if not 1 <= options.engines <= 4:
        parser.error(f"--engines {options.engines}: must be within 1-4")
    return options


def main(argv: list[str] | None = None) -> list[Figure]:
    """The slo-vs-load-balance rows of ``python -m bench vllm`` (or ``python -m bench.vllm_stock_slo``)."""
    from workers.vllm_process import MISSING_VENV_HINT, VLLM_PYTHON

    options = _parse(argv)
    what = f"`slo` vs `load-balance` attainment, {options.engines} stock vLLM engines, mixed workload"
    if not VLLM_PYTHON.exists():
        return without_vllm(what, MISSING_VENV_HINT)
    print_load_average()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-slo-") as tmp:
        try:
            results = _run(options, Path(tmp))
        except (RuntimeError, subprocess.SubprocessError) as exc:
            print(f"the slo-vs-load-balance benchmark failed: {exc}")
            return [Figure(what, f"not measured: {str(exc)[:200]}")]
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    print(
        f"workload {WORKLOAD.relative_to(REPO)}, {options.duration:g} s per run, {options.rounds} rounds "
        "(the policies alternate on the same seed); attainment: mean over rounds (each round's)"
    )
    print(f"{'rate/s':>6} | {'slo':>24} | {'load-balance':>24}")
    parts = []
    for rate in options.rates:
        cells = []
        means = []
        for policy in POLICIES:
            runs = results.get((rate, policy), [])
            mean = statistics.mean(r["all"] for r in runs) if runs else float("nan")
            means.append(mean)
            each = ", ".join(f"{r['all']:.1f}" for r in runs)
            cells.append(f"{mean:5.1f} % ({each})")
        print(f"{rate:>6g} | {cells[0]:>24} | {cells[1]:>24}")
        parts.append(f"{rate:g}/s: {means[0]:.1f} against {means[1]:.1f} %")
    text = "slo against load-balance, " + "; ".join(parts)
    print(text)
    return [Figure(what, text)]


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
