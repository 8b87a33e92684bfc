"""How much G a burst schedule could reach, with exact answer lengths and with class means only.

    .venv/bin/python scripts/sa_ceiling.py --workload docs/scenarios/sa-tickets-assistant.json \
        --seeds 3 --instances 2 --seqs 2 --burst 10 --gap-ms 0 --bursts 10 --period-s 60

Runs the ``sa`` row of ``python -m sim.papers sa`` with the same flags (``sa`` holds every request in
the router until a slot frees, so each request's measured run time is its own, not an engine queue's),
then schedules every burst again on a model of the fleet: ``instances x seqs`` slots, a request
starting on the slot that frees first and holding it for its measured run time. The best order is
found by local search (swaps, restarts) maximizing G over the run (Dinkelbach's iteration on
``met - G * summed latency``):

* ``exact``: ordered with the measured run times (an oracle that knows every answer's length);
* ``class means``: ordered with each request's prefill and its class's mean answer length, then
  scored with the measured run times (what a static plan that knows its lengths only per task
  type can reach).

The ``sa`` row's own order, scored the same way, checks the model against the simulator.
"""

from __future__ import annotations

import random
import statistics
import sys
from collections.abc import Sequence
from typing import Any

import sim.papers as papers
from sim.cluster import simulate

Row = dict[str, float]


def _met(r: Row, start: float) -> int:
    if r["e2e_slo"] and start + r["exe"] - r["arr"] > r["e2e_slo"]:
        return 0
    if r["ttft_slo"] and start + r["pre"] - r["arr"] > r["ttft_slo"]:
        return 0
    return 0 if r["tpot_slo"] and r["tpot"] > r["tpot_slo"] else 1


def _run(order: Sequence[int], reqs: Sequence[Row], slots: int) -> tuple[int, float]:
    free = [0.0] * slots
    met, total = 0, 0.0
    for k in order:
        r = reqs[k]
        j = min(range(slots), key=free.__getitem__)
        start = max(free[j], r["arr"])
        free[j] = start + r["exe"]
        met += _met(r, start)
        total += start + r["exe"] - r["arr"]
    return met, total


def _best(plan: Sequence[Row], slots: int, lam: float, rng: random.Random) -> list[int]:
    def key(v: tuple[int, float]) -> float:
        return v[0] - lam * v[1] * 1e-3

    best: list[int] = []
    best_v = (0, float("inf"))
    for _ in range(6):
        order = list(range(len(plan)))
        rng.shuffle(order)
        v = _run(order, plan, slots)
        improved = True
        while improved:
            improved = False
            for i in range(len(order)):
                for j in range(i + 1, len(order)):
                    order[i], order[j] = order[j], order[i]
                    w = _run(order, plan, slots)
                    if key(w) > key(v):
                        v, improved = w, True
                    else:
                        order[i], order[j] = order[j], order[i]
        if not best or key(v) > key(best_v):
            best, best_v = order[:], v
    return best


def main(argv: Sequence[str]) -> int:
    runs: list[list[Row]] = []
    args_seen: list[Any] = []
    original = papers.run_one

    def recording(
        args: Any, plans: Any, label: str, policy: str, queue_policy: str, extra: dict[str, Any]
    ) -> Row:
        from engine.model import SimConfig
        from router.core.config import SchedulerConfig
        from router.core.queue import QueueConfig
        from sim.cluster import SimFleet
        from sim.fleet import fleet_from_counts
        from sim.sweep import policy_overrides

        engine = SimConfig(max_num_seqs=args.seqs) if args.seqs else SimConfig()
        fleet = SimFleet(fleet_from_counts(neutral=args.instances, engine=engine))
        queue = QueueConfig(
            queue_policy=queue_policy, max_queue_wait_ms=papers.WAIT_MS, **extra.get("queue", {})
        )
        out = simulate(fleet, SchedulerConfig(**policy_overrides(policy)), plans, queue=queue, seed=args.seed)
        rows = []
        plans_classes = {p.class_name for p in plans}
        for r, p, w in zip(out.results, plans, out.queue_wait_ms, strict=True):
            rows.append(
                {
                    "b": float(r.index // args.burst),
                    "arr": p.arrival_s * 1e3,
                    "wait": w,
                    "pre": (r.ttft_ms or 0.0) - w,
                    "exe": (r.e2e_ms or 0.0) - w,
                    "tpot": r.tpot_ms or 0.0,
                    "e2e_slo": r.slo.e2e_ms or 0.0,
                    "ttft_slo": r.slo.ttft_ms or 0.0,
                    "tpot_slo": r.slo.tpot_ms or 0.0,
                    "stream": 0.0 if (r.slo.e2e_ms and not r.slo.ttft_ms) else 1.0,
                    "cls": float(sorted(plans_classes).index(r.class_name)),
                }
            )
        runs.append(rows)
        args_seen.append(args)
        return original(args, plans, label, policy, queue_policy, extra)

    papers.run_one = recording
    papers.main(["sa", *argv, "--only", "sa"])
    args = args_seen[0]
    slots = args.seqs * args.instances
    every = [r for rows in runs for r in rows]
    tpot = statistics.fmean(r["tpot"] for r in every if r["tpot"])
    mean_out = {
        c: statistics.fmean((r["exe"] - r["pre"]) / tpot + 1 for r in every if r["cls"] == c)
        for c in {r["cls"] for r in every}
    }
    bursts: list[list[Row]] = []
    for rows in runs:
        by: dict[float, list[Row]] = {}
        for r in rows:
            by.setdefault(r["b"], []).append(r)
        for reqs in by.values():
            a0 = min(r["arr"] for r in reqs)
            bursts.append([{**r, "arr": r["arr"] - a0} for r in reqs])
    rng = random.Random(0)

    def score(orders: Sequence[Sequence[int]]) -> tuple[float, int]:
        met = total = 0.0
        for reqs, order in zip(bursts, orders, strict=True):
            m, t = _run(order, reqs, slots)
            met, total = met + m, total + t
        return met * 1e3 / total, int(met)

    own = score([sorted(range(len(b)), key=lambda k, b=b: b[k]["wait"]) for b in bursts])  # type: ignore[misc]
    print(f"sa's own order on the model: G {own[0]:.4f}, {own[1]} met")
    for name, plan_of in (
        ("exact", lambda b: b),
        (
            "class means",
            lambda b: [{**r, "exe": r["pre"] + (mean_out[r["cls"]] - 1) * tpot} for r in b],
        ),
    ):
        lam = 0.0
        for _ in range(3):
            orders = [_best(plan_of(b), slots, lam, rng) for b in bursts]
            lam, met = score(orders)
        print(f"best static order, {name}: G {lam:.4f}, {met} met of {len(every)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
