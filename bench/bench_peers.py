"""This router against its peers, on one sim fleet, one seeded workload, one HTTP client.

``python -m bench peers`` starts ``slo-router up --worker-http`` (sim workers,
each with an OpenAI-compatible HTTP face, and the CMS), then runs each router
in turn in front of those same workers and replays the same seeded workload
through it over the OpenAI HTTP API:

* this router (``slo-router router --http-listen``, reading the fleet from the
  CMS) with its ``slo`` policy (queue policy ``edf``, the default; then ``qlm``
  and ``sa``) and its ``load-balance`` policy;
* ``vllm-router`` (PyPI, Rust) with ``round_robin`` and ``power_of_two``
  (load polled from the workers' ``/get_load``);
* ``smg`` (PyPI, Rust; the successor of ``sglang-router``) with ``least_load``
  and ``power_of_two`` (load from the workers' ``/metrics``).

Load polling intervals of the peers are set to 1 s (their defaults are 10 and
30 s), so nobody routes on stale load by configuration. Every request carries
its SLO in ``x-slo-*`` headers; the peers ignore them.

For each router it prints SLO attainment, goodput, TTFT and TPOT p50/p99 as
the client measures them, output tokens/s, and the router's CPU time per
request (user + system of the router process and its children, from
``/proc``), and writes ``out/peers/peers.json`` and ``out/peers/peers.png``.

The peers live in their own environment, ``.venv-peers`` (``make
peers-venv``); a missing peer is skipped with a message saying so. The fleet
is neutral: the peers' P/D modes speak vLLM's and SGLang's KV-transfer
protocols, which the sim workers do not implement. ``BENCH_PEERS_ONLY=a,b``
runs only the routers named ``a`` or ``b`` exactly, or else whose name contains
them (``BENCH_PEERS_ONLY="slo-router slo"``: only ``slo``). Figures only;
nothing is asserted.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2 as httpx

from bench.figures import Figure
from engine.outputs import prompt_digest, request_key, stop_string_at
from openai_http.protocol import MAX_STOP_CHARS
from workload.report import BenchReport, RequestResult, report_to_dict, summarize
from workload.spec import RequestPlan, iter_requests, load_workload

REPO = Path(__file__).resolve().parent.parent
PEER_VENV = REPO / ".venv-peers"
OUT_DIR = REPO / "out" / "peers"
WORKERS = 4
#: The sim workers run the bundled profile in real time, so the router's predictions match them.
SPEED_FACTOR = 1.0
#: Arrival rate of the mixed workload (req/s): at the edge of what 4 such workers sustain (at 6
#: req/s every router meets the SLO for 92-95 % of requests; at 9 the policies differ).
RATE_PER_S = 9.0
DURATION_S = 40.0
SEED = 0
#: How long requests still running at the end of the window may take to finish.
DRAIN_S = 60.0
_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class RouterSpec:
    name: str
    kind: str  # "ours" | "vllm-router" | "smg"
    args: tuple[str, ...]


ROUTERS: tuple[RouterSpec, ...] = (
    RouterSpec("slo-router slo", "ours", ("--scheduling-policy", "slo")),
    # The queue policies beyond the default edf that run on a neutral fleet of this workload (no
    # priorities in it, so ``priority`` would order as edf does).
    RouterSpec("slo-router slo+qlm", "ours", ("--scheduling-policy", "slo", "--queue-policy", "qlm")),
    RouterSpec("slo-router slo+sa", "ours", ("--scheduling-policy", "slo", "--queue-policy", "sa")),
    RouterSpec("slo-router load-balance", "ours", ("--scheduling-policy", "load-balance")),
    RouterSpec("vllm-router round_robin", "vllm-router", ("--policy", "round_robin")),
    RouterSpec("vllm-router power_of_two", "vllm-router", ("--policy", "power_of_two")),
    RouterSpec("smg least_load", "smg", ("--policy", "least_load")),
    RouterSpec("smg power_of_two", "smg", ("--policy", "power_of_two")),
)


def peer_missing(kind: str) -> str | None:
    """Why the peer ``kind`` cannot run here, or ``None``."""
    python = PEER_VENV / "bin" / "python"
    if kind == "vllm-router":
        if not (PEER_VENV / "bin" / "vllm-router").exists():
            return f"vllm-router is not installed in {PEER_VENV} (run `make peers-venv`)"
        return None
    if kind == "smg":
        found = (
            python.exists()
            and subprocess.run(
                [str(python), "-c", "import smg"], capture_output=True, check=False, timeout=60
            ).returncode
            == 0
        )
        return None if found else f"smg is not installed in {PEER_VENV} (run `make peers-venv`)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_s(root: int) -> float:
    """User + system CPU seconds of ``root`` and every descendant still alive."""
    children: dict[int, list[int]] = {}
    stats: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry.name)
        children.setdefault(int(fields[1]), []).append(pid)
        stats[pid] = (int(fields[11]) + int(fields[12])) / _TICKS
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, 0.0)
        todo.extend(children.get(pid, []))
    return total


def _prompt_text(plan: RequestPlan) -> str:
    # One ASCII letter per token: the sim workers' byte tokenizer counts exactly prompt_tokens.
    return "".join(chr(97 + t % 26) for t in plan.prompt_token_ids())


def _body(plan: RequestPlan) -> dict[str, Any]:
    """The completion request of one plan, as ``slo-router bench --engine sim`` sends it: the cap as
    ``max_tokens`` and, when the planned answer is shorter, a stop string that first occurs in the
    sim worker's output at the planned length (:func:`engine.outputs.stop_string_at`, keyed by the
    prompt's bytes, which are its token ids under the byte tokenizer, and seed 0). Every router
    passes ``stop`` through, so each one's fleet generates the same tokens, and none is told a length.
    """
    prompt = _prompt_text(plan)
    body: dict[str, Any] = {
        "model": "sim",
        "prompt": prompt,
        "max_tokens": plan.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": plan.ignore_eos,
    }
    length = plan.true_output_tokens
    if length < plan.max_tokens:
        key = request_key(0, prompt_digest(list(prompt.encode("ascii"))))
        stop = stop_string_at(key, length, max_chars=MAX_STOP_CHARS)
        if stop is None:  # no short enough stop string: the length goes out as the cap
            body["max_tokens"] = length
        else:
            body["stop"] = [stop]
    return body


async def _one(client: httpx.AsyncClient, url: str, plan: RequestPlan, t0: float) -> RequestResult:
    headers = {"x-slo-class": plan.class_name}
    for name, value in (("ttft", plan.slo.ttft_ms), ("tpot", plan.slo.tpot_ms), ("e2e", plan.slo.e2e_ms)):
        if value is not None:
            headers[f"x-slo-{name}-ms"] = f"{value:g}"
    body = _body(plan)
    start = time.perf_counter()

    def result(**measured: Any) -> RequestResult:
        return RequestResult.of_plan(plan, start_s=start - t0, **measured)

    first: float | None = None
    last = start
    tokens = 0
    reason = ""
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:200]
                return result(
                    error_code=f"HTTP_{response.status_code}", error_message=text,
                    e2e_ms=(time.perf_counter() - start) * 1e3,
                )  # fmt: skip
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(str(chunk["error"])[:200])
                for choice in chunk.get("choices") or ():
                    if choice.get("text"):
                        now = time.perf_counter()
                        first = now if first is None else first
                        last = now
                    reason = choice.get("finish_reason") or reason
                if chunk.get("usage"):
                    tokens = int(chunk["usage"]["completion_tokens"])
    except (httpx.HTTPError, RuntimeError, ValueError) as exc:
        return result(
            error_code="BAD_STREAM", error_message=str(exc)[:200],
            e2e_ms=(time.perf_counter() - start) * 1e3,
        )  # fmt: skip
    end = time.perf_counter()
    return result(
        completion_tokens=tokens,
        ttft_ms=(first - start) * 1e3 if first is not None else None,
        tpot_ms=(last - first) / (tokens - 1) * 1e3 if first is not None and tokens > 1 else None,
        e2e_ms=(end - start) * 1e3,
        finish_reason=reason,
    )


async def replay(url: str, plans: Sequence[RequestPlan]) -> tuple[list[RequestResult], float]:
    """Send every plan at its arrival time; (results, the length of the arrival window in s)."""
    limits = httpx.Limits(max_connections=2048, max_keepalive_connections=256)
    timeout = httpx.Timeout(DURATION_S + DRAIN_S, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        t0 = time.perf_counter()

        async def at(plan: RequestPlan) -> RequestResult:
            await asyncio.sleep(max(0.0, plan.arrival_s - (time.perf_counter() - t0)))
            return await _one(client, url, plan, t0)

        results = await asyncio.gather(*(at(p) for p in plans))
    return list(results), max(p.arrival_s for p in plans) if plans else 0.0


def _wait_ready(url: str, process: subprocess.Popen[Any], timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        try:
            body = {"model": "sim", "prompt": "ready?", "max_tokens": 1}
            if httpx.post(url + "/v1/completions", json=body, timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    return False


def _start_router(
    spec: RouterSpec,
    cms: str,
    worker_urls: Sequence[str],
    cms_token_file: str,
    worker_token_file: str = "",
    metrics_port: int = 0,
) -> tuple[subprocess.Popen[Any], str]:
    """Start one router; ``metrics_port`` (this router only): serve its Prometheus metrics there."""
    port = _free_port()
    if spec.kind == "ours":
        # BENCH_OURS_DIAG=1: the router runs under scripts/prefix_queue_diag.py, which prints why its
        # queued requests waited when it stops; BENCH_OURS_LAUNCH=SCRIPT (a path in the repository, e.g.
        # scripts/prefix_exact_diag.py): under that script instead.
        launch = (
            [str(REPO / os.environ["BENCH_OURS_LAUNCH"])]
            if os.environ.get("BENCH_OURS_LAUNCH")
            else [str(REPO / "scripts" / "prefix_queue_diag.py")]
            if os.environ.get("BENCH_OURS_DIAG")
            else ["-m", "router.cli"]
        )
        cmd = [
            sys.executable, *launch, "--log-level", "WARNING", "router", "--cms", f"grpc://{cms}",
            "--cms-auth-token-file", cms_token_file,
            "--listen", "127.0.0.1:0", "--http-listen", f"127.0.0.1:{port}", *spec.args,
        ]  # fmt: skip
        if metrics_port:
            cmd += ["--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1"]
        if worker_token_file:  # the workers ask their callers for it (slo-router up's worker token)
            cmd += ["--worker-auth-token-file", worker_token_file]
    elif spec.kind == "vllm-router":
        cmd = [
            str(PEER_VENV / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *worker_urls, "--prometheus-port", str(_free_port()), "--log-level", "warning",
            "--worker-startup-check-interval", "1", *spec.args,
        ]  # fmt: skip
    else:
        cmd = [
            str(PEER_VENV / "bin" / "python"), "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *worker_urls, "--prometheus-port", str(_free_port()),
            "--prometheus-host", "127.0.0.1", "--log-level", "warn", "--backend", "vllm",
            "--load-monitor-interval", "1", *spec.args,
        ]  # fmt: skip
    # BENCH_OURS_LOG=FILE: this router's log goes to FILE (appended; BENCH_OURS_LOG_LEVEL, default WARNING).
    log_path = os.environ.get("BENCH_OURS_LOG", "") if spec.kind == "ours" else ""
    if log_path:
        level = os.environ.get("BENCH_OURS_LOG_LEVEL", "WARNING")
        cmd[cmd.index("--log-level") + 1] = level
        with open(log_path, "a") as log:
            log.write(f"=== {time.strftime('%H:%M:%S')} {spec.name}\n")
            process = subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL, cwd=REPO
            )
    else:
        process = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, cwd=REPO
        )
    return process, f"http://127.0.0.1:{port}"


def _stop(process: subprocess.Popen[Any]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def placement_decisions(metrics_port: int) -> float | None:
    """How many placement decisions this router has made (its ``slo_router_schedule_latency_seconds``
    count: one per decision, a queue pass's refused attempts included); None when unreadable."""
    try:
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("slo_router_schedule_latency_seconds_count"):
            return float(line.rsplit(" ", 1)[1])
    return None


def _row(
    name: str, report: BenchReport, cpu_ms: float, decisions_per_placed: float | None = None
) -> dict[str, Any]:
    o = report.overall
    return {
        "router": name,
        "requests": o.requests,
        "errors": o.errors,
        "slo_attainment": o.slo_attainment,
        "goodput_rps": o.goodput_rps,
        "ttft_p50_ms": o.ttft.p50_ms,
        "ttft_p99_ms": o.ttft.p99_ms,
        "tpot_p50_ms": o.tpot.p50_ms,
        "tpot_p99_ms": o.tpot.p99_ms,
        "output_tokens_per_s": o.output_tokens_per_s,
        "router_cpu_ms_per_request": cpu_ms,
        "decisions_per_placed": decisions_per_placed,
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    print(
        f"{'router':<26}{'SLO met':>8}{'goodput':>9}{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}{'p99':>7}"
        f"{'tok/s':>8}{'CPU/req':>9}{'errors':>7}{'dec/placed':>11}"
    )
    for r in rows:
        print(
            f"{r['router']:<26}{r['slo_attainment'] * 100:7.1f}%{r['goodput_rps']:7.2f}/s"
            f"{_fmt(r['ttft_p50_ms'], '8.0f')}ms{_fmt(r['ttft_p99_ms'], '6.0f')}ms"
            f"{_fmt(r['tpot_p50_ms'], '8.1f')}ms{_fmt(r['tpot_p99_ms'], '5.1f')}ms"
            f"{r['output_tokens_per_s']:8.0f}{r['router_cpu_ms_per_request']:7.2f}ms{r['errors']:7d}"
            f"{_fmt(r.get('decisions_per_placed'), '11.2f')}"
        )


def _plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; no PNG")
        return
    names = [r["router"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (
        ("SLO attainment (%)", [r["slo_attainment"] * 100 for r in rows]),
        ("TTFT p99 (ms)", [r["ttft_p99_ms"] or 0 for r in rows]),
        ("router CPU per request (ms)", [r["router_cpu_ms_per_request"] for r in rows]),
    )
    for ax, (title, values) in zip(axes, panels, strict=True):
        ax.barh(
            names, values, color=["tab:blue" if n.startswith("slo-router") else "tab:gray" for n in names]
        )
        ax.set_title(title)
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _start_fleet(extra: Sequence[str] = ()) -> tuple[subprocess.Popen[str], str, list[str], str, str]:
    """``slo-router up`` with sim workers behind HTTP faces (``extra``: more ``up`` flags)."""
    cmd = [
        sys.executable, "-m", "router.cli", "up", "--neutral", str(WORKERS), "--worker-http",
        "--speed-factor", str(SPEED_FACTOR), "--seed", str(SEED), "--listen", "127.0.0.1:0", "--http-listen", "",
        *extra,
    ]  # fmt: skip
    # BENCH_FLEET_LOG=FILE: the fleet's log (CMS, workers, up's own router) goes to FILE (appended).
    log_path = os.environ.get("BENCH_FLEET_LOG", "")
    if log_path:
        with open(log_path, "a") as log:
            log.write(f"=== {time.strftime('%H:%M:%S')} fleet\n")
            up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO)
    else:
        up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO)
    cms, urls, token_file, worker_token_file = "", [], "", ""
    assert up.stdout is not None
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        line = up.stdout.readline()
        if not line:
            break
        if line.startswith("cms listening on "):
            cms = line.split()[-1]
        if line.startswith("cms read token for other routers: "):
            token_file = line.split()[-1]
        if line.startswith("worker token for other routers: "):
            worker_token_file = line.split()[-1]
        if line.startswith("worker HTTP APIs: "):
            urls = [part.split("@", 1)[1].removesuffix("/v1") for part in line[18:].strip().split(", ")]
        if line.startswith("router listening on "):
            break
    return up, cms, urls, token_file, worker_token_file


def selected(routers: Sequence[RouterSpec]) -> list[RouterSpec]:
    """The routers ``BENCH_PEERS_ONLY`` names (comma-separated): a part equal to a router's name picks
    that router alone, any other part every router whose name contains it; all without the variable."""
    only = [part for part in os.environ.get("BENCH_PEERS_ONLY", "").split(",") if part]
    if not only:
        return list(routers)
    names = {r.name for r in routers}
    return [r for r in routers if any(r.name == part if part in names else part in r.name for part in only)]


def main() -> list[Figure]:
    spec = load_workload("mixed").with_arrival(rate_per_s=RATE_PER_S)
    plans = [p for p in iter_requests(spec, SEED, max_requests=10_000) if p.arrival_s < DURATION_S]
    runnable = []
    for router in selected(ROUTERS):
        why = peer_missing(router.kind)
        if why is None:
            runnable.append(router)
        else:
            print(f"skipping {router.name}: {why}")
    print(
        f"fleet: {WORKERS} neutral sim workers (bundled 7B profile, x{SPEED_FACTOR:g}); workload: "
        f"mixed, poisson {RATE_PER_S:g} req/s for {DURATION_S:g} s = {len(plans)} requests, seed {SEED}"
    )
    up, cms, urls, token_file, worker_token_file = _start_fleet()
    rows: list[dict[str, Any]] = []
    details: dict[str, Any] = {}
    try:
        if not cms or len(urls) != WORKERS:
            print("the sim fleet did not start; no figures")
            return []
        for router in runnable:
            metrics_port = _free_port() if router.kind == "ours" else 0
            process, url = _start_router(router, cms, urls, token_file, worker_token_file, metrics_port)
            decisions = None
            try:
                if not _wait_ready(url, process):
                    print(f"{router.name}: did not become ready; skipped")
                    continue
                time.sleep(1.5)  # let load polling and the workers settle
                before = placement_decisions(metrics_port) if metrics_port else None
                cpu0 = _cpu_s(process.pid)
                results, window = asyncio.run(replay(url + "/v1/completions", plans))
                cpu = _cpu_s(process.pid) - cpu0
                after = placement_decisions(metrics_port) if metrics_port else None
                if before is not None and after is not None:
                    decisions = after - before
            finally:
                _stop(process)
            report = summarize(results, window, class_slos=spec.class_slos())
            placed = sum(1 for r in results if r.error_code is None)
            per_placed = None if decisions is None else decisions / max(placed, 1)
            rows.append(_row(router.name, report, cpu / max(1, len(results)) * 1e3, per_placed))
            details[router.name] = report_to_dict(report)
            print_table(rows[-1:])
            time.sleep(2.0)  # the fleet drains before the next router
    finally:
        _stop(up)
        if up.stdout is not None:
            up.stdout.close()
    if not rows:
        return []
    print("\nall routers, same fleet and workload:")
    print_table(rows)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    meta = {
        "workers": WORKERS,
        "speed_factor": SPEED_FACTOR,
        "rate_per_s": RATE_PER_S,
        "duration_s": DURATION_S,
        "seed": SEED,
        "requests": len(plans),
    }
    (OUT_DIR / "peers.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "reports": details}, indent=1)
    )
    _plot(rows, OUT_DIR / "peers.png")
    print(f"wrote {OUT_DIR / 'peers.json'} and {OUT_DIR / 'peers.png'}")
    return _figures(rows)


def _figures(rows: Sequence[dict[str, Any]]) -> list[Figure]:
    ours = [r for r in rows if r["router"].startswith("slo-router")]
    peers = [r for r in rows if not r["router"].startswith("slo-router")]
    if not ours or not peers:
        return []
    best_ours = max(ours, key=lambda r: r["slo_attainment"])
    best_peer = max(peers, key=lambda r: r["slo_attainment"])
    # Each of this router's rows by name (its policies differ by the SLO machinery), the peers' range.
    cpu = ", ".join(
        f"{r['router'].removeprefix('slo-router ')} {r['router_cpu_ms_per_request']:.1f} ms" for r in ours
    )
    peer_cpu = sorted(r["router_cpu_ms_per_request"] for r in peers)
    return [
        Figure(
            f"SLO attainment, mixed workload at {RATE_PER_S:g} req/s on {WORKERS} sim workers",
            f"{best_ours['router']} {best_ours['slo_attainment'] * 100:.1f} %, "
            f"best peer ({best_peer['router']}) {best_peer['slo_attainment'] * 100:.1f} %",
        ),
        Figure(
            "router CPU per request, same run",
            f"slo-router {cpu}; peers {peer_cpu[0]:.1f}-{peer_cpu[-1]:.1f} ms",
        ),
    ]


if __name__ == "__main__":
    main()
