"""Which requests miss under ``qlm`` and meet under ``edf``, and what the queue held when they were placed.

    .venv/bin/python scripts/qlm_trace.py --workload chat --instances 4 --rate 12 --requests 500 --seed 0

Runs the plan of one seed under ``edf`` and under ``qlm`` (``sim.papers``' rows), then prints per class
the requests that met every target under ``edf`` and missed one under ``qlm``: their lengths, what
they missed (TTFT, TPOT, e2e), their router wait under each, and, from a trace of the ``qlm`` queue
taken at their dispatch, the instance, its running batch (count, KV tokens counted at their end
against the cache), the virtual queue's groups ahead of theirs, and the pulls refused (with why)
while they waited; and per class the first token and the step the queue expected at each pull
against what ran (pulled late into a slow batch, or slowed after the pull). A diagnosis tool: it
prints, it asserts nothing.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from typing import Any

import router.core.qlm as qlm_mod
from sim import papers
from workload.report import e2e_met, tpot_met, ttft_met

TRACE: dict[str, dict[str, Any]] = {}
REFUSALS: collections.Counter[str] = collections.Counter()


def _install() -> None:
    cls = qlm_mod.QlmQueue
    take, room = cls._take, cls._room

    def traced_take(self: Any, i: int, src: int, group: Any, now_s: float) -> Any:
        r = group.members[0]
        run = list(self.running[i].values())
        vq = self.vqs[src]
        ahead = vq.index(group.gid) if group.gid in vq else -1
        TRACE[r.request_id] = {
            "t": now_s,
            "inst": i,
            "src": src,
            "run": len(run),
            "kv": self._batch_kv(run, r) if run else 0.0,
            "cap": self.models[i].kv_tokens,
            "ahead": ahead,
            "groups": sum(len(v) for v in self.vqs),
            "batch": self.models[i].batch,
            "step_ms": self.models[i].decode_step_s * 1e3,
            "ineff": self.inefficiency[i],
            "reserve": self.stream_reserve(i, now_s),
            "late_plan": self.expected_missing.get(group.gid, 0),
            "evictions": r.evictions,
            # What the queue expected of the pull: its first token behind the prompts still queued in
            # the engine's prefill and its own, and the grown batch's step (profile x the learned
            # inefficiency, the estimator's e2e step).
            "ttft_pred_ms": (
                self._prefill_backlog_s(i, run, now_s) + self.models[i].prefill_s(r.prompt_tokens)
            )
            * 1e3,
            "step_pred_ms": (
                self.models[i].step_s(len(run) + 1, self._batch_kv(run, r)) * self.inefficiency[i] * 1e3
                if self.models[i].step_s is not None
                else float("nan")
            ),
        }
        return take(self, i, src, group, now_s)

    def traced_room(self: Any, i: int, r: Any, gone: Any = frozenset(), now_s: Any = None, **kw: Any) -> bool:
        ok = room(self, i, r, gone, now_s, **kw)
        if not ok and not gone:
            REFUSALS[f"{r.request.slo_class}"] += 1
        return bool(ok)

    cls._take = traced_take  # type: ignore[method-assign]
    cls._room = traced_room  # type: ignore[method-assign]


def _met(r: Any) -> bool:
    return r.ok and all(v is not False for v in (ttft_met(r), tpot_met(r), e2e_met(r)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", required=True)
    p.add_argument("--instances", type=int, default=4)
    p.add_argument("--rate", type=float, required=True)
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-tokens", type=int, default=0)
    p.add_argument("--seqs", type=int, default=0)
    p.add_argument("--show", type=int, default=15)
    p.add_argument("--wait-margin", default="each", choices=["each", "sum"], help="qlm's --qlm-wait-margin")
    p.add_argument("--streams", default="auto", choices=["auto", "qlm", "edf"], help="qlm's --qlm-streams")
    p.add_argument(
        "--set", default="", help="NAME=VALUE;... module constants of router.core.qlm (experiments)"
    )
    args = p.parse_args(argv)
    for kv in filter(None, args.set.split(";")):
        name, value = kv.split("=")
        setattr(qlm_mod, name, float(value))
    ns = argparse.Namespace(
        workload=args.workload,
        instances=args.instances,
        seqs=args.seqs,
        kv_tokens=args.kv_tokens,
        rate=args.rate,
        requests=args.requests,
        burst_class="",
        seed=args.seed,
    )
    plans = papers.plans_for(ns, args.seed)
    _install()
    out: dict[str, Any] = {}
    for label, policy, qp, extra in [
        ("edf", "slo", "edf", {}),
        ("qlm", "slo", "qlm", {"qlm": qlm_mod.QlmConfig(wait_margin=args.wait_margin, streams=args.streams)}),
    ]:
        out[label] = _run(ns, plans, policy, qp, extra)
    edf, qlm = out["edf"], out["qlm"]
    by_class: dict[str, list[int]] = collections.defaultdict(list)
    for k, (a, b) in enumerate(zip(edf.results, qlm.results, strict=True)):
        if _met(a) and not _met(b):
            by_class[a.class_name].append(k)
    for label, o in out.items():
        met = sum(_met(r) for r in o.results) / len(o.results)
        print(
            f"{label}: attainment {met * 100:.1f} %, preemptions {o.stats.preemptions}, evicted {o.stats.evicted}"
        )
    print("refused pulls by class:", dict(REFUSALS))
    for label, o in out.items():
        why: collections.Counter[str] = collections.Counter()
        for r in o.results:
            if not _met(r):
                why[
                    ",".join(
                        n
                        for n, f in (("ttft", ttft_met), ("tpot", tpot_met), ("e2e", e2e_met))
                        if f(r) is False
                    )
                    or "error"
                ] += 1
        print(f"{label} misses:", dict(why))
    for label, o in out.items():
        _wait_profile(label, o.results)
    _pace_profile(qlm.results, {k for idx in by_class.values() for k in idx})
    for cls_name, idx in by_class.items():
        print(f"\n== {cls_name}: {len(idx)} meet under edf and miss under qlm")
        why = collections.Counter()
        for k in idx:
            b = qlm.results[k]
            why[
                ",".join(
                    n for n, f in (("ttft", ttft_met), ("tpot", tpot_met), ("e2e", e2e_met)) if f(b) is False
                )
            ] += 1
        print("  missed:", dict(why))
        waits = [qlm.results[k].queue_wait_ms for k in idx]
        print(
            f"  qlm wait ms p50 {statistics.median(waits):.0f}; edf wait p50 "
            f"{statistics.median(edf.results[k].queue_wait_ms for k in idx):.0f}"
        )
        for k in idx[: args.show]:
            a, b = edf.results[k], qlm.results[k]
            t = TRACE.get(str(k), {})
            print(
                f"  #{k} arr {b.start_s:.1f} p{b.prompt_tokens} out {b.completion_tokens}/{b.max_tokens} "
                f"| edf ttft {a.ttft_ms or 0:.0f} tpot {a.tpot_ms or 0:.0f} e2e {a.e2e_ms or 0:.0f} w {a.queue_wait_ms:.0f} "
                f"| qlm ttft {b.ttft_ms or 0:.0f} tpot {b.tpot_ms or 0:.0f} e2e {b.e2e_ms or 0:.0f} w {b.queue_wait_ms:.0f} "
                f"| {_fmt(t)}"
            )
    return 0


def _wait_profile(label: str, results: Any) -> None:
    """Per class: how many met, and the misses by how long they waited in the router (refused: never ran);
    the router wait's median for the met and the missed that ran. Whether a class misses waiting for room or
    running slowly is the first question of a loss (rag + reports: 61 of its 101 report misses waited more
    than 20 s under ``qlm``, docs/papers.md)."""
    classes = sorted({r.class_name for r in results})
    for c in classes:
        rs = [r for r in results if r.class_name == c]
        met = [r for r in rs if _met(r)]
        ran = [r for r in rs if r.ok and not _met(r)]
        bins: collections.Counter[str] = collections.Counter()
        for r in rs:
            if _met(r):
                continue
            w = r.queue_wait_ms / 1e3
            bins[
                "refused" if not r.ok else "wait>20s" if w > 20 else "wait5-20s" if w > 5 else "wait<5s"
            ] += 1

        def p50(xs: list[Any]) -> str:
            return f"{statistics.median(r.queue_wait_ms for r in xs) / 1e3:.1f} s" if xs else "-"

        print(
            f"{label} {c}: met {len(met)}/{len(rs)}, misses {dict(bins)}; "
            f"router wait p50 met {p50(met)}, missed {p50(ran)}"
        )


def _pace_profile(results: Any, lost: set[int]) -> None:
    """Per class, for the requests that ran under ``qlm``: the first token after the pull and the time per
    output token the queue expected at the pull against what they measured (medians; ``lost``: those
    that met under ``edf`` and missed). Expected right but slow: pulled late into a slow batch; expected
    fast but slow: the batch slowed after the pull (the pulls after it, or a step the model misses)."""
    rows: dict[str, dict[str, list[tuple[float, ...]]]] = collections.defaultdict(
        lambda: {"all": [], "lost": []}
    )
    for k, r in enumerate(results):
        t = TRACE.get(str(k))
        if t is None or not r.ok or not r.completion_tokens or r.ttft_ms is None or r.e2e_ms is None:
            continue
        tpot = (r.e2e_ms - r.ttft_ms) / max(r.completion_tokens - 1, 1)
        row = (t["ttft_pred_ms"], r.ttft_ms - r.queue_wait_ms, t["step_pred_ms"], tpot)
        rows[r.class_name]["all"].append(row)
        if k in lost:
            rows[r.class_name]["lost"].append(row)
    for c in sorted(rows):
        for which, rs in rows[c].items():
            if not rs:
                continue
            med = [statistics.median(x[j] for x in rs) for j in range(4)]
            print(
                f"qlm {c} ({which}, {len(rs)}): first token after the pull expected {med[0]:.0f} ms, "
                f"measured {med[1]:.0f}; step expected {med[2]:.1f} ms, measured {med[3]:.1f}"
            )


def _fmt(t: dict[str, Any]) -> str:
    if not t:
        return "-"
    return (
        f"inst {t['inst']}<-vq{t['src']} run {t['run']} kv {t['kv']:.0f}/{t['cap']} ahead {t['ahead']} "
        f"groups {t['groups']} batch {t['batch']} step {t['step_ms']:.1f}ms ineff {t['ineff']:.2f} "
        f"reserve {t['reserve'][0]:.1f}/{t['reserve'][1]:.0f} late {t['late_plan']} ev {t['evictions']}"
    )


def _run(ns: Any, plans: Any, policy: str, qp: str, extra: dict[str, Any]) -> Any:
    import dataclasses

    from engine.model import SimConfig
    from router.core.config import SchedulerConfig
    from router.core.queue import QueueConfig
    from sim.cluster import SimFleet, simulate
    from sim.fleet import fleet_from_counts
    from sim.sweep import policy_overrides

    engine = SimConfig(max_num_seqs=ns.seqs) if ns.seqs else SimConfig()
    if ns.kv_tokens:
        engine = dataclasses.replace(engine, kv_capacity_tokens=ns.kv_tokens)
    fleet = SimFleet(fleet_from_counts(neutral=ns.instances, engine=engine))
    config = SchedulerConfig(**policy_overrides(policy))
    queue = QueueConfig(queue_policy=qp, max_queue_wait_ms=papers.WAIT_MS)
    return simulate(fleet, config, plans, queue=queue, qlm=extra.get("qlm"), seed=ns.seed)


if __name__ == "__main__":
    sys.exit(main())
