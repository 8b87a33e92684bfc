"""This router against its peers' cache-aware policies, on a prefix-heavy workload with prefix caching.

``python -m bench peers_prefix`` runs like ``python -m bench peers`` (same HTTP client, same
workers behind OpenAI-compatible faces, peers from ``.venv-peers``) with two changes:

* the sim workers cache prompt KV by content (``slo-router up --prefix-cache-block-tokens 16``:
  16-token blocks, chained hashes, LRU eviction), and report their prefix-cache counters on
  ``/metrics`` (vLLM's ``vllm:prefix_cache_queries_total`` / ``_hits_total``);
* the workload is ``prefix-heavy`` with 48 shared 3,072-token prefixes (system prompts) before
  each request's own turn: more than one worker's KV holds, so where a prompt goes decides
  what is reused. The prompt text is one letter per token, so the peers' text radix trees see
  the same sharing as the workers' token blocks.

Routers: this router's ``slo`` with ``--prefix-cache-routing exact`` (an index fed by the sim
workers' KV events, ``Worker.KvEvents``: prompt hashes chained in the workers' 16-token
blocks, looked up every 256 tokens), with
``approximate`` (its routing history, 256-token blocks) and with ``off``; vLLM router's and SMG's
``cache_aware`` (router-side radix trees), SMG's ``prefix_hash``, the consistent hashing both
offer (``consistent_hash`` / ``consistent_hashing``), and SMG's ``power_of_two`` as a
cache-blind reference.

Each router gets a fresh fleet (cold caches), so none inherits another's cache.
``BENCH_OURS_ARGS="--flag value ..."`` adds flags to this router's command line (to see which
of its predictions holds requests back), and this router's rows end with its own account of the
run from its ``/metrics`` (requests by outcome, router-queue waits and events).
``BENCH_PEERS_ONLY=a,b`` runs only the routers whose name contains ``a`` or ``b`` (e.g. ``slo-router``), those
``a`` names first (to alternate which of two runs first on the host). Per router it
prints the usual table plus the fleet's prefix-cache hit rate over its run (from the workers'
counters). When this router and a peer both ran, it prints how many of this router's requests got
their first token over 5 s past their TTFT target (held in its queue as late) and how many of those
the peer, which places every request on arrival, served within their SLO in its run.

To see a run from the inside: ``BENCH_OURS_SAMPLE=FILE`` appends, every 0.5 s, this router's
instances by health (healthy / stale / unschedulable / ejected), its queue, its requests by phase,
its CPU use and the host's load; ``BENCH_OURS_LOG=FILE`` (with ``BENCH_OURS_LOG_LEVEL``, default
WARNING) keeps this router's log and ``BENCH_FLEET_LOG=FILE`` the fleet's (CMS, workers, agents).
Figures only; nothing is asserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx2 as httpx

from bench import bench_peers as peers
from bench.figures import Figure
from workload.report import RequestResult, report_to_dict, slo_met, summarize
from workload.spec import iter_requests, load_workload

RATE_PER_S = 8.0
DURATION_S = 40.0
GROUPS = 48
WORKER_BLOCK = 16
ROUTER_BLOCK = 256

ROUTERS: tuple[peers.RouterSpec, ...] = (
    peers.RouterSpec(
        "slo-router slo cache approx",
        "ours",
        (
            "--scheduling-policy",
            "slo",
            "--prefix-cache-routing",
            "approximate",
            "--prefix-block-tokens",
            str(ROUTER_BLOCK),
        ),
    ),
    peers.RouterSpec(
        "slo-router slo cache exact",
        "ours",
        (
            "--scheduling-policy",
            "slo",
            "--prefix-cache-routing",
            "exact",
            "--prefix-block-tokens",
            str(ROUTER_BLOCK),
            "--prefix-chain-block-tokens",
            str(WORKER_BLOCK),  # the workers' KV events name 16-token blocks; lookups per 256 tokens
        ),
    ),
    peers.RouterSpec(
        "slo-router slo no-cache", "ours", ("--scheduling-policy", "slo", "--prefix-cache-routing", "off")
    ),
    peers.RouterSpec("vllm-router cache_aware", "vllm-router", ("--policy", "cache_aware")),
    peers.RouterSpec("vllm-router consistent_hash", "vllm-router", ("--policy", "consistent_hash")),
    peers.RouterSpec("smg cache_aware", "smg", ("--policy", "cache_aware")),
    peers.RouterSpec("smg prefix_hash", "smg", ("--policy", "prefix_hash")),
    peers.RouterSpec("smg consistent_hashing", "smg", ("--policy", "consistent_hashing")),
    peers.RouterSpec("smg power_of_two", "smg", ("--policy", "power_of_two")),
)

_COUNTER = re.compile(r"^vllm:prefix_cache_(queries|hits)_total\{[^}]*\} ([0-9.eE+-]+)$", re.M)


def cache_counters(urls: Sequence[str]) -> tuple[float, float]:
    """(prompt tokens looked up, found cached), summed over the workers' /metrics."""
    queries = hits = 0.0
    with httpx.Client(timeout=10.0) as client:
        for url in urls:
            text = client.get(url + "/metrics").text
            for kind, value in _COUNTER.findall(text):
                if kind == "queries":
                    queries += float(value)
                else:
                    hits += float(value)
    return queries, hits


_DIAGNOSIS = re.compile(
    r"^(slo_router_queue_events_total|slo_router_calibration_factor_ratio|slo_router_queue_wait_seconds_(?:count|sum)"
    r"|slo_router_requests_total)(\{[^}]*\})? ([0-9.eE+-]+)$",
    re.M,
)


def print_router_diagnosis(port: int) -> None:
    """This router's own account of the run: why requests waited (its queue's events), how long, and
    how much slower than their profiles its calibration found the workers."""
    with httpx.Client(timeout=10.0) as client:
        text = client.get(f"http://127.0.0.1:{port}/metrics").text
    found = [f"{name}{labels or ''}={float(value):g}" for name, labels, value in _DIAGNOSIS.findall(text)]
    print(f"{'':<26}router: " + ", ".join(found), flush=True)


_SAMPLED = re.compile(
    r"^(slo_router_instances|slo_router_queue_requests|slo_router_requests_in_phase|slo_router_queue_events_total)"
    r"(\{[^}]*\})? ([0-9.eE+-]+)$",
    re.M,
)


class MetricsSampler:
    """``BENCH_OURS_SAMPLE=FILE``: every 0.5 s of a run, one line of this router's instance health, queue
    and phase gauges, its CPU use (cores) and the host's load average, appended to FILE (to see when and why the router
    stopped placing)."""

    def __init__(self, port: int, path: str, name: str, pid: int) -> None:
        self._port, self._path, self._name, self._pid = port, path, name, pid
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MetricsSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        t0 = time.monotonic()
        cpu0, at0 = peers._cpu_s(self._pid), t0
        with open(self._path, "a") as out, httpx.Client(timeout=5.0) as client:
            out.write(f"=== {time.strftime('%H:%M:%S')} {self._name}\n")
            while not self._stop.wait(0.5):
                try:
                    text = client.get(f"http://127.0.0.1:{self._port}/metrics").text
                except httpx.HTTPError as exc:
                    out.write(f"{time.monotonic() - t0:6.1f} scrape failed: {exc}\n")
                    continue
                parts: dict[str, float] = {}
                for name, labels, value in _SAMPLED.findall(text):
                    short = name.removeprefix("slo_router_")
                    if short == "instances" and "neutral" not in labels:
                        continue
                    key = short + "".join(
                        v for v in re.findall(r'="([^"]*)"', labels or "") if v not in ("neutral",)
                    )
                    parts[key] = parts.get(key, 0.0) + float(value)
                shown = " ".join(f"{k}={v:g}" for k, v in sorted(parts.items()) if v)
                load = os.getloadavg()[0]
                cpu, at = peers._cpu_s(self._pid), time.monotonic()
                share = (cpu - cpu0) / max(at - at0, 1e-3)  # the router's CPU, in cores, since the last line
                cpu0, at0 = cpu, at
                out.write(f"{at - t0:6.1f} load={load:.1f} cpu={share:.2f} {shown}\n")
                out.flush()


#: A request this router served this much past its TTFT target (ms) is counted as held back (see below).
HELD_PAST_MS = 5000.0


def held_back_against(ours: Sequence[RequestResult], peer: Sequence[RequestResult]) -> tuple[int, int, int]:
    """This router's requests whose first token came over ``HELD_PAST_MS`` past their TTFT target (its
    queue held them as late), how many of those the peer, which sends every request at once, served
    within their SLO in its own run of the same workload, and how many of them this router met."""
    peer_met = {r.index: slo_met(r) for r in peer}
    held = [r for r in ours if r.ttft_ms is not None and r.ttft_ms > (r.slo.ttft_ms or 0.0) + HELD_PAST_MS]
    return len(held), sum(1 for r in held if peer_met.get(r.index, False)), sum(1 for r in held if slo_met(r))


def refused_against(ours: Sequence[RequestResult], peer: Sequence[RequestResult]) -> tuple[int, int, int]:
    """This router's requests that ended without an answer (refused: late past its allowance, or by
    the arrival check), how many of those the peer served, and how many it served within their SLO."""
    peer_by = {r.index: r for r in peer}
    refused = [r for r in ours if r.error_code is not None]
    there = [peer_by[r.index] for r in refused if r.index in peer_by]
    return len(refused), sum(1 for r in there if r.error_code is None), sum(1 for r in there if slo_met(r))


def in_named_order(routers: Sequence[peers.RouterSpec]) -> list[peers.RouterSpec]:
    """``routers`` in the order ``BENCH_PEERS_ONLY`` names them (by the first part naming each; routers
    one part names keep their order here): ``"slo cache exact,slo cache approx"`` runs the exact index
    first, so a comparison of two routers can alternate which runs on the host first."""
    only = [part for part in os.environ.get("BENCH_PEERS_ONLY", "").split(",") if part]
    names = {r.name for r in routers}

    def first(router: peers.RouterSpec) -> int:
        for k, part in enumerate(only):
            if router.name == part if part in names else part in router.name:
                return k
        return len(only)

    return sorted(routers, key=first)


def main() -> list[Figure]:
    spec = load_workload("prefix-heavy").with_arrival(rate_per_s=RATE_PER_S)
    spec = dataclasses.replace(spec, classes=(dataclasses.replace(spec.classes[0], prefix_groups=GROUPS),))
    plans = [p for p in iter_requests(spec, peers.SEED, max_requests=10_000) if p.arrival_s < DURATION_S]
    # The sim workers behind HTTP generate to max_tokens (no EOS): each request asks for its own
    # answer's length, so the work is the workload's output distribution, not the class's cap.
    plans = [dataclasses.replace(p, max_tokens=p.true_output_tokens) for p in plans]
    runnable = []
    for router in in_named_order(peers.selected(ROUTERS)):
        why = peers.peer_missing(router.kind)
        if why is None:
            runnable.append(router)
        else:
            print(f"skipping {router.name}: {why}")
    print(
        f"fleet: {peers.WORKERS} neutral sim workers with prefix caching ({WORKER_BLOCK}-token blocks); "
        f"workload: prefix-heavy ({GROUPS} shared 3072-token prefixes), poisson {RATE_PER_S:g} req/s for "
        f"{DURATION_S:g} s = {len(plans)} requests, seed {peers.SEED}"
    )
    rows: list[dict[str, Any]] = []
    details: dict[str, Any] = {}
    served: dict[str, list[RequestResult]] = {}
    for router in runnable:
        # The fleet's own router (``up`` starts one; the bench routes through its own routers) follows
        # no KV events: otherwise every worker feeds two event streams and that idle router spends CPU
        # on every step's events, host load that slows whichever router the bench measures.
        up, cms, urls, token_file, worker_token = peers._start_fleet(
            ("--prefix-cache-block-tokens", str(WORKER_BLOCK), "--prefix-cache-routing", "off")
        )
        try:
            if not cms or len(urls) != peers.WORKERS:
                print(f"{router.name}: the sim fleet did not start; skipped")
                continue
            metrics_port = peers._free_port() if router.kind == "ours" else 0
            if metrics_port:
                extra = tuple(os.environ.get("BENCH_OURS_ARGS", "").split())
                router = dataclasses.replace(
                    router, args=(*router.args, *extra, "--metrics-port", str(metrics_port))
                )
            process, url = peers._start_router(router, cms, urls, token_file, worker_token)
            try:
                if not peers._wait_ready(url, process):
                    print(f"{router.name}: did not become ready; skipped")
                    continue
                time.sleep(1.5)
                before = cache_counters(urls)
                cpu0 = peers._cpu_s(process.pid)
                sample = os.environ.get("BENCH_OURS_SAMPLE", "") if metrics_port else ""
                with (
                    MetricsSampler(metrics_port, sample, router.name, process.pid)
                    if sample
                    else contextlib.nullcontext()
                ):
                    results, window = asyncio.run(peers.replay(url + "/v1/completions", plans))
                cpu = peers._cpu_s(process.pid) - cpu0
                after = cache_counters(urls)
                if metrics_port:
                    print_router_diagnosis(metrics_port)
            finally:
                peers._stop(process)
        finally:
            peers._stop(up)
            if up.stdout is not None:
                up.stdout.close()
        report = summarize(results, window, class_slos=spec.class_slos())
        row = peers._row(router.name, report, cpu / max(1, len(results)) * 1e3)
        queried = after[0] - before[0]
        row["cache_hit_rate"] = (after[1] - before[1]) / queried if queried > 0 else 0.0
        rows.append(row)
        details[router.name] = report_to_dict(report)
        served[router.name] = results
        peers.print_table(rows[-1:])
        print(f"{'':<26}prefix-cache hit rate {row['cache_hit_rate'] * 100:.1f} %", flush=True)
    if not rows:
        return []
    print("\nall routers, same workload, each on a fresh fleet:")
    peers.print_table(rows)
    for r in rows:
        print(f"  {r['router']:<28} cache_hit_rate {r['cache_hit_rate'] * 100:5.1f} %")
    # Would the requests this router's queue held past their target have met their SLO had they been
    # placed at once? The peers place every request on arrival: the same request in their runs says.
    for mine in (name for name in served if name.startswith("slo-router")):
        for other in (name for name in served if not name.startswith("slo-router")):
            held, met_there, met_here = held_back_against(served[mine], served[other])
            print(
                f"  {mine}: {held} requests served over {HELD_PAST_MS / 1e3:g} s past their TTFT target "
                f"(met here: {met_here}); {other} met the SLO for {met_there} of them"
            )
            refused, served_there, met_there = refused_against(served[mine], served[other])
            print(
                f"  {mine}: {refused} requests refused; {other} served {served_there} of them, "
                f"{met_there} within their SLO"
            )
    peers.OUT_DIR.mkdir(parents=True, exist_ok=True)
    meta = {"workers": peers.WORKERS, "rate_per_s": RATE_PER_S, "duration_s": DURATION_S, "groups": GROUPS}
    path = peers.OUT_DIR / "peers_prefix.json"
    # Per request (index, TTFT ms, TPOT ms, error code, SLO met, error message), to set the routers' runs side by side.
    requests = {
        name: [
            [r.index, r.ttft_ms, r.tpot_ms, r.error_code, slo_met(r), r.error_message[:600]] for r in results
        ]
        for name, results in served.items()
    }
    path.write_text(
        json.dumps({"meta": meta, "rows": rows, "reports": details, "requests": requests}, indent=1)
    )
    print(f"wrote {path}")
    ours = [r for r in rows if r["router"].startswith("slo-router")]
    others = [r for r in rows if not r["router"].startswith("slo-router")]
    if not ours or not others:
        return []
    best = max(ours, key=lambda r: r["slo_attainment"])
    peer = max(others, key=lambda r: r["slo_attainment"])
    return [
        Figure(
            f"SLO attainment, prefix-heavy at {RATE_PER_S:g} req/s, prefix caching on",
            f"{best['router']} {best['slo_attainment'] * 100:.1f} % (hit {best['cache_hit_rate'] * 100:.1f} %), "
            f"best peer ({peer['router']}) {peer['slo_attainment'] * 100:.1f} % (hit {peer['cache_hit_rate'] * 100:.1f} %)",
        )
    ]


if __name__ == "__main__":
    main()
