"""Router-queue decision cost with 64 and 1024 requests queued (goal: p99 under 200 us at 1024).

Two figures per queue size and policy:

- *queue decision*: what the queue itself adds to one request's life — push a
  new request (sorted insert, shedding check), compute the release limit, find
  the head in offer order and its position, and take the head out. The queue
  stays at its size (one in, one out). No scheduling decision inside.
- *offer pass*: one :func:`router.core.queue.offer` pass over the queue with a
  loaded 16-instance fleet that can take one request: the expiry and lateness
  sweep, then scheduling decisions until one dispatches (each queued request
  costs a full ``Scheduler.schedule``; a pass stops after 8 misses in a row).
- *hopeless scan* (``edf``): a pass on a fleet that takes nothing more, after
  one new arrival: with a full scan (every queued request judged against the
  work in front of it, at most every ``SCAN_INTERVAL_S``) and without (only
  the newcomer judged). Both include the pass's 8 scheduling decisions.

Each figure is printed twice: wall time (``perf_counter``) and the thread's CPU
time (``thread_time``), which leaves out the time the process was not running:
on a shared machine the wall p99 is mostly other processes.

Figures only, no assertions.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

from bench.bench_scheduler import fleet
from predictor import LatencyPredictor
from router.core.config import SchedulerConfig
from router.core.queue import SCAN_INTERVAL_S, QueueConfig, RouterQueue, offer
from router.core.request import ScheduleInput
from router.core.scheduler import Scheduler

PROFILE = Path(__file__).resolve().parent.parent / "profiling_data" / "qwen2.5-7b-2xv100-linear"
SIZES = (64, 1024)
POLICIES = ("fcfs", "edf", "priority")
ROUNDS = 4000
PASSES = 300


def _request(rng: random.Random, k: int, now: float) -> ScheduleInput:
    return ScheduleInput(
        request_id=f"q-{k}",
        prompt_tokens=rng.randint(64, 2048),
        ttft_slo_ms=rng.choice((0.0, 500.0, 1000.0, 3000.0)),
        e2e_slo_ms=rng.choice((0.0, 0.0, 4000.0, 15000.0)),
        max_tokens=rng.randint(16, 512),
        priority=rng.choice((0, 0, 0, 1, 5)),
        arrival_s=now,
    )


Figures = tuple[float, float, float, float]  # wall p50, wall p99, cpu p50, cpu p99 (s)


def _percentiles(samples: list[float]) -> tuple[float, float]:
    samples.sort()
    return statistics.median(samples), samples[int(0.99 * (len(samples) - 1))]


def _figures(wall: list[float], cpu: list[float]) -> Figures:
    return (*_percentiles(wall), *_percentiles(cpu))


def bench_bookkeeping(policy: str, size: int) -> Figures:
    rng = random.Random(size)
    queue = RouterQueue(QueueConfig(queue_policy=policy, max_queue_size=size + 1), 6000.0, 50.0)
    now = 1000.0
    for k in range(size):
        queue.push(_request(rng, k, now), now)
    samples: list[float] = []
    cpu: list[float] = []
    perf, thread = time.perf_counter, time.thread_time
    for k in range(size, size + ROUNDS):
        now += 0.001
        request = _request(rng, k, now)
        start, start_cpu = perf(), thread()
        queue.observe_arrival(request)
        queue.push(request, now)
        queue.release_limit_ms(now, request.priority)
        head = next(queue.entries())
        queue.position(head.request_id)
        queue.remove(head.request_id)
        samples.append(perf() - start)
        cpu.append(thread() - start_cpu)
    return _figures(samples, cpu)


def bench_offer(policy: str, size: int) -> Figures:
    rng = random.Random(size)
    predictor = LatencyPredictor.from_files(PROFILE / "ttft.json", PROFILE / "tpot.json")
    scheduler = Scheduler(SchedulerConfig(scheduling_policy="slo"), predictor, random.Random(0))
    snapshot = fleet(16, seed=size)
    queue = RouterQueue(QueueConfig(queue_policy=policy, max_queue_size=size + 1), 6000.0, 50.0)
    now = 1000.0
    for k in range(size):
        queue.push(_request(rng, k, now), now)
    samples: list[float] = []
    cpu: list[float] = []
    perf, thread = time.perf_counter, time.thread_time
    k = size
    for _ in range(PASSES):
        start, start_cpu = perf(), thread()
        dispatched = 0
        for result in offer(queue, scheduler, lambda: snapshot, now):
            if result.decision is not None:
                dispatched += 1
                break  # the fleet took one; the caller records it and the next event starts a new pass
        samples.append(perf() - start)
        cpu.append(thread() - start_cpu)
        # Keep the queue at its size: refill what left (dispatched, late or expired).
        while len(queue) < size:
            queue.push(_request(rng, k, now), now)
            k += 1
    return _figures(samples, cpu)


def bench_scan(size: int, full: bool) -> Figures:
    rng = random.Random(size)
    predictor = LatencyPredictor.from_files(PROFILE / "ttft.json", PROFILE / "tpot.json")
    scheduler = Scheduler(SchedulerConfig(scheduling_policy="slo"), predictor, random.Random(0))
    snapshot = fleet(16, seed=size)
    queue = RouterQueue(QueueConfig(queue_policy="edf", max_queue_size=size + PASSES + 1), 6000.0, 50.0)
    now = 1000.0

    def loose(k: int) -> ScheduleInput:  # waits: a 1 ms target among the recent arrivals caps the fleet
        return ScheduleInput(f"s-{k}", rng.randint(64, 2048), ttft_slo_ms=600_000.0, arrival_s=now)

    for k in range(size):
        queue.push(loose(k), now)
    queue.observe_arrival(ScheduleInput("tight", 64, ttft_slo_ms=1.0))
    for result in offer(queue, scheduler, lambda: snapshot, now):  # fill the fleet once
        if result.decision is not None:
            scheduler.record(result.decision, now)
    samples: list[float] = []
    cpu: list[float] = []
    perf, thread = time.perf_counter, time.thread_time
    for k in range(PASSES // 4):
        now += SCAN_INTERVAL_S * 1.01 if full else 1e-4
        queue.push(loose(size + k), now)
        start, start_cpu = perf(), thread()
        for result in offer(queue, scheduler, lambda: snapshot, now):
            if result.decision is not None:
                scheduler.record(result.decision, now)
        samples.append(perf() - start)
        cpu.append(thread() - start_cpu)
    return _figures(samples, cpu)


def _line(policy: str, size: int, f: Figures) -> str:
    wall50, wall99, cpu50, cpu99 = (x * 1e6 for x in f)
    return (
        f"  {policy:8s} {size:5d} queued: wall p50 {wall50:7.1f} us p99 {wall99:8.1f} us | "
        f"cpu p50 {cpu50:7.1f} us p99 {cpu99:8.1f} us"
    )


def main() -> None:
    print("router queue: cost of one queue decision (push, release limit, head, position, remove)")
    for policy in POLICIES:
        for size in SIZES:
            print(_line(policy, size, bench_bookkeeping(policy, size)))
    print("router queue: one offer pass (sweep + scheduling decisions until one dispatches, 16 instances)")
    for policy in POLICIES:
        for size in SIZES:
            print(_line(policy, size, bench_offer(policy, size)))
    print("router queue: one offer pass after an arrival, fleet full, with / without a full hopeless scan")
    for size in SIZES:
        print(_line("full", size, bench_scan(size, True)))
        print(_line("newcomer", size, bench_scan(size, False)))


if __name__ == "__main__":
    main()
