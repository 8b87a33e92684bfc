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
``BENCH_PEERS_ONLY=a,b`` runs only the routers whose name contains ``a`` or ``b`` (e.g. ``slo-router``). Per router it
prints the usual table plus the fleet's prefix-cache hit rate over its run (from the workers'
counters). Figures only; nothing is asserted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import time
from collections.abc import Sequence
from typing import Any

import httpx2 as httpx

from bench import bench_peers as peers
from bench.figures import Figure
from workload.report import report_to_dict, summarize
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


def main() -> list[Figure]:
    spec = load_workload("prefix-heavy").with_arrival(rate_per_s=RATE_PER_S)
    spec = dataclasses.replace(spec, classes=(dataclasses.replace(spec.classes[0], prefix_groups=GROUPS),))
    plans = [p for p in iter_requests(spec, peers.SEED, max_requests=10_000) if p.arrival_s < DURATION_S]
    # The sim workers behind HTTP generate to max_tokens (no EOS): each request asks for its own
    # answer's length, so the work is the workload's output distribution, not the class's cap.
    plans = [dataclasses.replace(p, max_tokens=p.true_output_tokens) for p in plans]
    runnable = []
    for router in peers.selected(ROUTERS):
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
    for router in runnable:
        up, cms, urls, token_file, worker_token = peers._start_fleet(
            ("--prefix-cache-block-tokens", str(WORKER_BLOCK))
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
        peers.print_table(rows[-1:])
        print(f"{'':<26}prefix-cache hit rate {row['cache_hit_rate'] * 100:.1f} %", flush=True)
    if not rows:
        return []
    print("\nall routers, same workload, each on a fresh fleet:")
    peers.print_table(rows)
    for r in rows:
        print(f"  {r['router']:<28} cache_hit_rate {r['cache_hit_rate'] * 100:5.1f} %")
    peers.OUT_DIR.mkdir(parents=True, exist_ok=True)
    meta = {"workers": peers.WORKERS, "rate_per_s": RATE_PER_S, "duration_s": DURATION_S, "groups": GROUPS}
    path = peers.OUT_DIR / "peers_prefix.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows, "reports": details}, indent=1))
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
