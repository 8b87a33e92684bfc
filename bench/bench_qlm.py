"""Decision cost of the ``qlm`` queue policy, and its plan heuristic's gap to the MILP.

Figures (CPU time of the thread, ``thread_time``, beside wall time):

- *arrival*: one :meth:`QlmQueue.push` with 64 / 512 requests queued on 4
  instances: grouping, the estimator's violation check over every virtual
  queue and, when it predicts a new violation, the plan generator;
- *plan*: one heuristic plan over 16 / 64 groups on 4 instances, and one
  ``scipy.optimize.milp`` plan over 6 groups on 2 instances;
- *pump*: one pulling + eviction pass on 4 full instances;
- *gap*: requests on time under the heuristic's plan over the MILP's, on 200
  random one-slot cases (2-6 groups, 1-2 instances), where the MILP is exact.

Figures only, no assertions.
"""

from __future__ import annotations

import random
import statistics
import time

from bench.figures import Figure
from router.core.qlm import (
    Estimator,
    Group,
    InstanceModel,
    OutputStats,
    QlmConfig,
    QlmQueue,
    QlmRequest,
    heuristic_plan,
    milp_plan,
)
from router.core.request import ScheduleInput

ROUNDS = 400


def _model(batch: int = 32) -> InstanceModel:
    return InstanceModel(batch, 0.03, lambda n: 0.05 + n * 1e-4)


def _request(rng: random.Random, k: int, now: float) -> ScheduleInput:
    if rng.random() < 0.5:
        return ScheduleInput(
            request_id=f"r{k}",
            prompt_tokens=rng.randint(16, 1024),
            ttft_slo_ms=1000.0,
            tpot_slo_ms=50.0,
            max_tokens=rng.randint(16, 256),
            slo_class="interactive",
            arrival_s=now,
        )
    return ScheduleInput(
        request_id=f"r{k}",
        prompt_tokens=rng.randint(64, 2048),
        e2e_slo_ms=60_000.0,
        max_tokens=rng.randint(64, 2048),
        slo_class="batch",
        arrival_s=now,
    )


def _pct(samples: list[float]) -> tuple[float, float]:
    samples.sort()
    return statistics.median(samples), samples[int(0.99 * (len(samples) - 1))]


def _line(what: str, wall: list[float], cpu: list[float]) -> tuple[str, float, float]:
    w50, w99 = _pct(wall)
    c50, c99 = _pct(cpu)
    print(
        f"  {what}: wall p50 {w50 * 1e6:9.1f} us p99 {w99 * 1e6:9.1f} us | cpu p50 {c50 * 1e6:9.1f} us p99 {c99 * 1e6:9.1f} us"
    )
    return what, c50, c99


def _full_queue(size: int, rng: random.Random) -> tuple[QlmQueue, float]:
    q = QlmQueue(QlmConfig(), [_model() for _ in range(4)], 6000.0, 50.0, max_queue_size=size + ROUNDS + 1)
    now = 0.0
    for k in range(size + 4 * 32):
        now += 0.001
        q.push(_request(rng, k, now), now)
        if k < 4 * 32:
            q.pump(now)  # fill the instances first
    return q, now


def bench_arrival(size: int) -> tuple[str, float, float]:
    rng = random.Random(size)
    q, now = _full_queue(size, rng)
    wall: list[float] = []
    cpu: list[float] = []
    perf, thread = time.perf_counter, time.thread_time
    for k in range(ROUNDS):
        now += 0.001
        request = _request(rng, 10_000_000 + k, now)
        start, start_cpu = perf(), thread()
        q.push(request, now)
        wall.append(perf() - start)
        cpu.append(thread() - start_cpu)
        q.remove(next(q.requests()).request_id)  # keep the size
    return _line(f"arrival, {size} queued, 4 instances", wall, cpu)


def _groups(rng: random.Random, n: int, size_max: int = 3) -> list[Group]:
    groups = []
    for gid in range(n):
        g = Group(gid, ("m", gid), 64)
        deadline = rng.uniform(0.5, 12.0)
        for k in range(rng.randint(1, size_max)):
            s = ScheduleInput(
                request_id=f"{gid}.{k}", prompt_tokens=64, e2e_slo_ms=1.0, max_tokens=rng.randint(10, 120)
            )
            g.members.append(QlmRequest(s, 0.0, deadline, True, 64, s.max_tokens, group=gid))
        groups.append(g)
    return groups


def bench_plan(n_groups: int, n_queues: int, solver: str, rounds: int) -> tuple[str, float, float]:
    rng = random.Random(n_groups)
    est = Estimator(OutputStats(), 1.28)
    wall: list[float] = []
    cpu: list[float] = []
    perf, thread = time.perf_counter, time.thread_time
    for _ in range(rounds):
        models = [_model(1 if solver == "milp" else 8) for _ in range(n_queues)]
        groups = _groups(rng, n_groups, 3 if solver == "milp" else 16)
        running: list[list[QlmRequest]] = [[] for _ in models]
        start, start_cpu = perf(), thread()
        if solver == "milp":
            milp_plan(est, models, running, groups, 0.0)
        else:
            heuristic_plan(est, models, running, groups, 0.0)
        wall.append(perf() - start)
        cpu.append(thread() - start_cpu)
    return _line(f"{solver} plan, {n_groups} groups, {n_queues} instances", wall, cpu)


def bench_pump() -> tuple[str, float, float]:
    rng = random.Random(1)
    q, now = _full_queue(256, rng)
    wall: list[float] = []
    cpu: list[float] = []
    perf, thread = time.perf_counter, time.thread_time
    k = 20_000_000
    for _ in range(ROUNDS):
        now += 0.01
        start, start_cpu = perf(), thread()
        out = q.pump(now, lambda r, i: 1)
        wall.append(perf() - start)
        cpu.append(thread() - start_cpu)
        for d in out:  # what was pulled finishes, so the next pass has the same work
            q.finished(d.request.request_id, 10, now)
            k += 1
            q.push(_request(rng, k, now), now)
    return _line("pump (pull + eviction check), 4 full instances, 256 queued", wall, cpu)


def bench_gap(cases: int = 200) -> tuple[float, float]:
    rng = random.Random(7)
    est = Estimator(OutputStats(), 1.28)
    h_total = m_total = 0
    worst = 0.0
    for _ in range(cases):
        models = [_model(1) for _ in range(rng.randint(1, 2))]
        groups = _groups(rng, rng.randint(2, 6))
        running: list[list[QlmRequest]] = [[] for _ in models]
        h = heuristic_plan(est, models, running, groups, 0.0).meeting
        m = milp_plan(est, models, running, groups, 0.0).meeting
        h_total += h
        m_total += m
        if m:
            worst = max(worst, 1.0 - h / m)
    ratio = h_total / m_total if m_total else 1.0
    print(
        f"  plan gap on {cases} small cases: heuristic {h_total} vs MILP {m_total} requests on time "
        f"({100 * (1 - ratio):.1f} % fewer overall; worst case {100 * worst:.0f} % fewer)"
    )
    return 1 - ratio, worst


def main() -> list[Figure]:
    print("qlm queue policy: decision cost (CPU time of the thread beside wall time)")
    rows = [bench_arrival(64), bench_arrival(512)]
    rows.append(bench_plan(16, 4, "heuristic", 100))
    rows.append(bench_plan(64, 4, "heuristic", 20))
    rows.append(bench_plan(6, 2, "milp", 20))
    rows.append(bench_pump())
    gap, worst = bench_gap()
    figures = [
        Figure(f"qlm {what}", f"cpu p50 {c50 * 1e3:.2f} ms, p99 {c99 * 1e3:.2f} ms")
        for what, c50, c99 in rows
    ]
    figures.append(
        Figure(
            "qlm plan heuristic vs MILP (200 small cases)",
            f"{100 * gap:.1f} % fewer requests on time overall, worst case {100 * worst:.0f} %",
        )
    )
    return figures


if __name__ == "__main__":
    main()
