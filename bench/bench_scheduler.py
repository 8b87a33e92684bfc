"""Scheduling-decision latency: ``Scheduler.schedule`` over fleets of 16, 256 and 4096 instances.

Per fleet size and policy (``slo`` on a half-prefill/half-decode fleet, and
``slo`` with adaptive PD), a loop of decisions on a loaded snapshot: each
decision is recorded in the in-flight account as the router would, and each
request's entries leave 32 decisions later (as if the instances had admitted
it), so the in-flight account stays realistic. Timed: the ``schedule`` call
only. Also printed: the cost of building the per-snapshot columns when a new
snapshot arrives (paid once per snapshot, not per decision). Figures only.

``python -m bench.bench_scheduler --cpu`` times the same decision loops (the
32k-token rows too) with the thread's CPU time instead of the wall clock: on a
machine shared with other work, compare two versions with it (alternating runs).
``--index`` times the prefix index alone on the 32k-token rows' traffic (its
dispatches and lookups recorded from a run, replayed on a fresh index).
"""

from __future__ import annotations

import random
import statistics
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slorouter.v1 import cms_pb2

from bench.figures import Figure
from fleet.prefix import id_block_hashes
from fleet.snapshot import ClusterSnapshot, InstanceRecord
from predictor import LatencyPredictor
from router.core.config import SchedulerConfig
from router.core.errors import NoInstanceError
from router.core.request import ScheduleInput
from router.core.scheduler import Scheduler

PROFILE = Path(__file__).resolve().parent.parent / "profiling_data" / "qwen2.5-7b-2xv100-linear"
SIZES = (16, 256, 4096)
#: The decision p99 goals at SIZES on a quiet host (adaptive PD: 1.5x these).
P99_GOALS_US = (100.0, 150.0, 500.0)


def fleet(n: int, seed: int) -> ClusterSnapshot:
    """A loaded fleet: half prefill-role, half decode-role, 8 instances per node."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        prefill = i % 2 == 0
        md = cms_pb2.InstanceMetadata(
            instance_id=f"inst-{i:05d}",
            endpoint=f"10.0.{i // 250}.{i % 250}:50051",
            role=cms_pb2.INSTANCE_ROLE_PREFILL if prefill else cms_pb2.INSTANCE_ROLE_DECODE,
            node_id=f"node-{i // 8}",
            max_num_batched_tokens=2048,
            kv_capacity_tokens=200_000,
        )
        batch = rng.randint(0, 4) if prefill else rng.randint(0, 48)
        st = cms_pb2.InstanceStatus(
            instance_id=md.instance_id,
            update_id=1,
            schedulable=rng.random() > 0.02,
            num_waiting_requests=rng.randint(0, 4),
            num_running_requests=batch,
            num_uncomputed_prefill_tokens=rng.choice((0, 0, rng.randint(1, 6000))) if prefill else 0,
            num_decode_requests=batch,
            num_decode_tokens=batch * rng.randint(100, 1500),
            num_used_kv_tokens=rng.randint(0, 150_000),
        )
        records.append(InstanceRecord(metadata=md, status=st, status_age_s=rng.uniform(0.0, 0.3)))
    return ClusterSnapshot(instances=tuple(records), taken_at_s=1000.0, version=1)


def _percentiles(samples_us: list[float]) -> tuple[float, float]:
    samples_us.sort()
    return statistics.median(samples_us), samples_us[max(0, int(len(samples_us) * 0.99) - 1)]


def measure(
    n: int,
    adaptive: bool,
    lp: LatencyPredictor,
    decisions: int,
    clock: Callable[[], int] = time.perf_counter_ns,
) -> tuple[float, float]:
    """p50 and p99 (µs) of ``decisions`` decisions on ``fleet(n)``, timed with ``clock`` (ns).

    ``time.thread_time_ns`` times the thread's CPU instead of the wall: on a machine
    shared with other work it leaves out the time other processes held the core.
    """
    config = SchedulerConfig(
        scheduling_policy="slo", enable_adaptive_pd=adaptive, ttft_slo_ms=8000, tpot_slo_ms=80
    )
    scheduler = Scheduler(config, lp, random.Random(1))
    snapshot = fleet(n, seed=n)
    rng = random.Random(2)
    pending: deque[str] = deque()
    samples = []
    now = 1000.0
    for k in range(decisions + 200):
        request = ScheduleInput(f"req-{k}", prompt_tokens=rng.randint(64, 3000))
        start = clock()
        try:
            decision = scheduler.schedule(snapshot, request, now)
        except NoInstanceError:
            # A refusal is a decision too (adaptive PD keeps its targets in every pass; in the
            # router the request would wait in the queue): timed, nothing recorded.
            decision = None
        elapsed = clock() - start
        if decision is not None:
            scheduler.record(decision, now)
            pending.append(request.request_id)
        if len(pending) > 32:
            scheduler.inflight.release(pending.popleft())
        now += 0.0005
        if k >= 200:  # warm-up: caches, reserves, in-flight steady state
            samples.append(elapsed / 1e3)
    return _percentiles(samples)


#: The long-prompt rows: a 32k-token prompt, hashed in 512-token prefix blocks (64 hashes).
LONG_PROMPT_TOKENS = 32768
PREFIX_BLOCK = 512


def measure_long_prompt(
    n: int,
    lp: LatencyPredictor,
    decisions: int,
    routing: str,
    clock: Callable[[], int] = time.perf_counter_ns,
) -> tuple[float, float]:
    """Decision latency for 32k-token prompts: ``slo`` with ``--prefix-cache-routing routing``.

    With ``approximate`` the index first learns 8 prompt families (each 48 shared blocks then 16
    of its own) sent to every instance in turn, then every decision looks up a prompt of one of
    them (its hashes computed outside the timed call, as the router does before scheduling) and
    is dispatched, so the index keeps learning. ``off`` is today's decision on the same prompts.
    """
    config = SchedulerConfig(
        scheduling_policy="slo",
        ttft_slo_ms=60000,
        tpot_slo_ms=200,
        prefix_cache_routing=routing,
        prefix_block_tokens=PREFIX_BLOCK,
    )
    scheduler = Scheduler(config, lp, random.Random(1))
    snapshot = fleet(n, seed=n)
    rng = random.Random(3)
    blocks = LONG_PROMPT_TOKENS // PREFIX_BLOCK

    def prompt_hashes(family: int, own: int) -> tuple[int, ...]:
        ids = [family * 1000 + j for j in range(48)] + [10**6 + own * 100 + j for j in range(blocks - 48)]
        return id_block_hashes(ids, LONG_PROMPT_TOKENS, PREFIX_BLOCK)

    if scheduler.prefix is not None:
        ids = [r.metadata.instance_id for r in snapshot.instances]
        for k, instance_id in enumerate(ids):
            scheduler.prefix.dispatched(instance_id, prompt_hashes(k % 8, k), 10_000_000)
    pending: deque[str] = deque()
    samples = []
    now = 1000.0
    for k in range(decisions + 100):
        hashes = prompt_hashes(rng.randrange(8), rng.randrange(1 << 20)) if routing != "off" else ()
        request = ScheduleInput(f"req-{k}", prompt_tokens=LONG_PROMPT_TOKENS, prefix_hashes=hashes)
        start = clock()
        try:
            decision = scheduler.schedule(snapshot, request, now)
        except NoInstanceError:
            decision = None
        if decision is not None:
            scheduler.dispatched(decision, now)  # the index learns at dispatch: part of the decision's cost
        elapsed = clock() - start
        if decision is not None:
            scheduler.record(decision, now, prompt_tokens=LONG_PROMPT_TOKENS)
            pending.append(request.request_id)
        if len(pending) > 32:
            scheduler.inflight.release(pending.popleft())
        now += 0.0005
        if k >= 100:
            samples.append(elapsed / 1e3)
    return _percentiles(samples)


def long_prompt_rows(
    lp: LatencyPredictor, clock: Callable[[], int] = time.perf_counter_ns, unit: str = ""
) -> tuple[dict[str, tuple[float, float]], float]:
    """The 32k-token rows at 256 instances, ``off`` and ``approximate``, printed; the rows and the
    p50 ratio (``unit``: ``"CPU "`` when ``clock`` is the thread's CPU time)."""
    print(
        f"32k-token prompt ({LONG_PROMPT_TOKENS} tokens, {PREFIX_BLOCK}-token prefix blocks), slo, 256 instances"
    )
    rows = {}
    for routing in ("off", "approximate"):
        rows[routing] = p50, p99 = measure_long_prompt(256, lp, 1500, routing, clock=clock)
        print(
            f"    prefix-cache-routing {routing:12s} {unit}p50 {p50:8.1f} us   p99 {p99:8.1f} us   (1500 decisions)"
        )
    ratio = rows["approximate"][0] / rows["off"][0]
    print(f"    cache-aware / today's decision: {ratio:.2f}x ({unit}p50)")
    return rows, ratio


def table_build_ms(n: int) -> tuple[float, float, float]:
    """Median cost of the per-snapshot columns: a first snapshot, a new one with the same metadata
    (every status new), and an update that touches 64 instances (the others' status objects kept,
    as the CMS's memory store and the simulator hand them out)."""
    first: list[float] = []
    again: list[float] = []
    touched: list[float] = []
    for seed in range(5):
        scheduler = Scheduler(SchedulerConfig(), None, random.Random(1))
        snapshots = [fleet(n, seed=seed), fleet(n, seed=seed + 100)]
        for samples, snap in zip((first, again), snapshots, strict=True):
            start = time.perf_counter_ns()
            scheduler.views.table(snap)
            samples.append((time.perf_counter_ns() - start) / 1e6)
        rng = random.Random(seed)
        snap = snapshots[-1]
        for version in range(2, 12):
            records = list(snap.instances)
            for i in rng.sample(range(n), min(n, UPDATE_TOUCHES)):
                status = cms_pb2.InstanceStatus()
                if (old := records[i].status) is not None:
                    status.CopyFrom(old)
                status.update_id += 1
                status.num_waiting_requests += 1
                records[i] = InstanceRecord(records[i].metadata, status, 0.0)
            ages = [r.status_age_s + 0.1 for r in records]
            snap = ClusterSnapshot(
                tuple(InstanceRecord(r.metadata, r.status, a) for r, a in zip(records, ages, strict=True)),
                taken_at_s=1000.0 + version,
                version=version,
            )
            start = time.perf_counter_ns()
            scheduler.views.table(snap)
            touched.append((time.perf_counter_ns() - start) / 1e6)
    return statistics.median(first), statistics.median(again), statistics.median(touched)


#: Instances a status update touches in the incremental-refresh row.
UPDATE_TOUCHES = 64


def main() -> list[Figure]:
    lp = LatencyPredictor.from_files(PROFILE / "ttft.json", PROFILE / "tpot.json")
    print("decision latency (Scheduler.schedule, cached snapshot, realistic in-flight churn)")
    by_policy: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for n in SIZES:
        decisions = 3000 if n <= 256 else 1000
        for adaptive in (False, True):
            p50, p99 = measure(n, adaptive, lp, decisions)
            by_policy[adaptive].append((p50, p99))
            name = "slo + adaptive PD" if adaptive else "slo"
            print(
                f"  {n:5d} instances  {name:18s} p50 {p50:8.1f} us   p99 {p99:8.1f} us   ({decisions} decisions)"
            )
    long_rows, ratio = long_prompt_rows(lp)
    print("per-snapshot columns (paid once per new snapshot, not per decision)")
    refresh: dict[int, tuple[float, float, float]] = {}
    for n in SIZES:
        first, again, touched = table_build_ms(n)
        refresh[n] = (first, again, touched)
        print(
            f"  {n:5d} instances  first snapshot {first:7.2f} ms   next snapshot (same metadata) {again:7.2f} ms"
            f"   update touching {min(n, UPDATE_TOUCHES)} {touched:6.2f} ms"
        )
    sizes = " / ".join(str(n) for n in SIZES)

    def measured(rows: list[tuple[float, float]]) -> str:
        p50 = " / ".join(f"{r[0]:.0f}" for r in rows)
        p99 = " / ".join(f"{r[1]:.0f}" for r in rows)
        return f"p50 {p50} µs, p99 {p99} µs"

    return [
        Figure(
            f"scheduling decision, {sizes} instances, `slo`",
            f"{measured(by_policy[False])}; goal p99 ≤ {' / '.join(f'{g:.0f}' for g in P99_GOALS_US)} µs",
        ),
        Figure(
            "same with adaptive PD",
            f"{measured(by_policy[True])}; goal p99 ≤ {' / '.join(f'{1.5 * g:.0f}' for g in P99_GOALS_US)} µs",
        ),
        Figure(
            f"view refresh at {SIZES[-1]} instances: an update touching {UPDATE_TOUCHES} instances (in parentheses: every status new)",
            f"{refresh[SIZES[-1]][2]:.2f} ms ({refresh[SIZES[-1]][1]:.1f} ms); goal ≤ 1 ms",
        ),
        Figure(
            "32k-token prompt at 256 instances, `slo` with prefix-cache routing against without",
            f"p50 {long_rows['approximate'][0]:.0f} / {long_rows['off'][0]:.0f} µs ({ratio:.2f}x)",
        ),
    ]


def cpu_main() -> None:
    """The decision rows timed with the thread's CPU time (``--cpu``): for comparing two versions
    on a machine other work shares, where the wall-clock p99 mostly measures that work."""
    lp = LatencyPredictor.from_files(PROFILE / "ttft.json", PROFILE / "tpot.json")
    print("decision CPU time (thread CPU per Scheduler.schedule call, same loop as the wall-clock rows)")
    for n in SIZES:
        decisions = 3000 if n <= 256 else 1000
        for adaptive in (False, True):
            p50, p99 = measure(n, adaptive, lp, decisions, clock=time.thread_time_ns)
            name = "slo + adaptive PD" if adaptive else "slo"
            print(
                f"  {n:5d} instances  {name:18s} CPU p50 {p50:8.1f} us   p99 {p99:8.1f} us   ({decisions} decisions)"
            )
    long_prompt_rows(lp, clock=time.thread_time_ns, unit="CPU ")


def index_main(runs: int = 9) -> None:
    """The prefix index alone (``--index``): the 32k-token rows' dispatches and lookups, recorded from
    one run of :func:`measure_long_prompt`, replayed on a fresh index with the thread's CPU time per
    call; the minimum over ``runs`` replays of the mean past the first 356 calls (the fleet's first
    fill and the warm-up), per kind of call."""
    from router.core import prefix

    lp = LatencyPredictor.from_files(PROFILE / "ttft.json", PROFILE / "tpot.json")
    calls: list[tuple[bool, tuple[Any, ...]]] = []
    approximate: Any = prefix.ApproximatePrefixIndex
    block: Any = prefix.BlockIndex
    dispatched, cached_column = approximate.dispatched, block.cached_column

    def record_dispatch(self: Any, *args: Any) -> None:
        calls.append((True, args))
        dispatched(self, *args)

    def record_lookup(self: Any, *args: Any) -> Any:
        calls.append((False, args))
        return cached_column(self, *args)

    approximate.dispatched, block.cached_column = record_dispatch, record_lookup
    try:
        measure_long_prompt(256, lp, 1500, "approximate")
    finally:
        approximate.dispatched, block.cached_column = dispatched, cached_column
    best = {True: float("inf"), False: float("inf")}
    for _ in range(runs):
        index = prefix.ApproximatePrefixIndex(PREFIX_BLOCK)
        total = {True: 0, False: 0}
        count = {True: 0, False: 0}
        for k, (is_dispatch, args) in enumerate(calls):
            call = index.dispatched if is_dispatch else index.cached_column
            start = time.thread_time_ns()
            call(*args)
            elapsed = time.thread_time_ns() - start
            if k >= 356:
                total[is_dispatch] += elapsed
                count[is_dispatch] += 1
        for kind in best:
            best[kind] = min(best[kind], total[kind] / max(count[kind], 1) / 1e3)
    print(
        f"prefix index alone, 32k-token rows' traffic ({len(calls)} calls, CPU, min of {runs} replays): "
        f"dispatch {best[True]:.2f} us, lookup (cached-token column) {best[False]:.2f} us"
    )


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--cpu"]:
        cpu_main()
    elif sys.argv[1:] == ["--index"]:
        index_main()
    else:
        main()
