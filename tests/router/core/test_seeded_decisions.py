"""Seeded decisions stay what they were: a speed change must not move a single placement.

Each scenario is a seeded fleet (roles, loads, missing statuses, step samples,
prefix hashes) and a seeded stream of requests with in-flight churn and
snapshot updates that touch a few instances (the incremental view refresh)
or all of them. Every decision (mode, prefill id, decode id, or the refusal)
is folded into a digest; ``tests/data/seeded_decisions.json`` holds the
digests recorded before the decision core was made faster. A change that
moves a decision fails here; if the move is intended, say why in the commit
and regenerate the file with ``python -m tests.router.core.test_seeded_decisions``.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from collections import deque
from pathlib import Path

import pytest
from slorouter.v1 import cms_pb2

from fleet.snapshot import ClusterSnapshot, InstanceRecord
from predictor import LatencyPredictor
from router.core.config import SchedulerConfig
from router.core.errors import SchedulingError
from router.core.request import ScheduleInput
from router.core.scheduler import Scheduler

ROOT = Path(__file__).resolve().parents[3]
PROFILE = ROOT / "profiling_data" / "qwen2.5-7b-2xv100-linear"
GOLDEN = ROOT / "tests" / "data" / "seeded_decisions.json"

#: (name, policy, adaptive PD, fleet size, seed)
SCENARIOS = (
    ("slo-8", "slo", False, 8, 1),
    ("slo-16", "slo", False, 16, 2),
    ("slo-64", "slo", False, 64, 3),
    ("slo-300", "slo", False, 300, 4),
    ("apd-16", "slo", True, 16, 5),
    ("apd-64", "slo", True, 64, 6),
    ("apd-300", "slo", True, 300, 7),
    ("lb-64", "load-balance", False, 64, 8),
    ("lr-64", "least-requests", False, 64, 9),
    ("p2-64", "power-of-two", False, 64, 10),
    ("rr-16", "round-robin", False, 16, 11),
    ("bp-64", "binpack", False, 64, 12),
    ("ca-64", "cache-affinity", False, 64, 13),
)
DECISIONS = 300


def _metadata(i: int, rng: random.Random) -> cms_pb2.InstanceMetadata:
    role = rng.choice(
        (cms_pb2.INSTANCE_ROLE_PREFILL, cms_pb2.INSTANCE_ROLE_DECODE, cms_pb2.INSTANCE_ROLE_NEUTRAL)
    )
    return cms_pb2.InstanceMetadata(
        instance_id=f"inst-{i:04d}",
        endpoint=f"10.1.{i // 200}.{i % 200}:50051",
        role=role,
        node_id=f"node-{i // 4}",
        max_num_batched_tokens=rng.choice((0, 512, 2048)),
        kv_capacity_tokens=rng.choice((60_000, 200_000)),
        max_num_seqs=rng.choice((0, 64, 256)),
    )


def _status(md: cms_pb2.InstanceMetadata, rng: random.Random, update: int) -> cms_pb2.InstanceStatus | None:
    if rng.random() < 0.03:
        return None
    batch = rng.randint(0, 48)
    st = cms_pb2.InstanceStatus(
        instance_id=md.instance_id,
        update_id=update,
        schedulable=rng.random() > 0.05,
        num_waiting_requests=rng.randint(0, 4),
        num_running_requests=batch,
        num_uncomputed_prefill_tokens=rng.choice((0, 0, rng.randint(1, 6000))),
        num_decode_requests=batch,
        num_decode_tokens=batch * rng.randint(100, 1500),
        num_used_kv_tokens=rng.randint(0, 50_000),
    )
    for _ in range(rng.randint(0, 3)):
        st.step_samples.add(
            duration_ms=rng.uniform(10.0, 90.0),
            num_prefill_tokens=rng.choice((0, rng.randint(1, 2048))),
            num_decode_requests=rng.randint(0, batch),
            num_decode_tokens=rng.randint(0, 60_000),
        )
    return st


def _record(md: cms_pb2.InstanceMetadata, rng: random.Random, update: int) -> InstanceRecord:
    return InstanceRecord(metadata=md, status=_status(md, rng, update), status_age_s=rng.uniform(0.0, 0.4))


def run_scenario(policy: str, adaptive: bool, n: int, seed: int) -> tuple[str, int]:
    """The digest of the scenario's decisions and how many placed a request."""
    rng = random.Random(seed)
    lp = LatencyPredictor.from_files(PROFILE / "ttft.json", PROFILE / "tpot.json")
    config = SchedulerConfig(
        scheduling_policy=policy, enable_adaptive_pd=adaptive, ttft_slo_ms=3000, tpot_slo_ms=60
    )
    scheduler = Scheduler(config, lp, random.Random(seed + 1000))
    metas = [_metadata(i, rng) for i in range(n)]
    records = [_record(md, rng, 1) for md in metas]
    now = 1000.0
    version = 1
    snapshot = ClusterSnapshot(instances=tuple(records), taken_at_s=now, version=version)
    digest = hashlib.sha256()
    pending: deque[str] = deque()
    placed = 0
    for k in range(DECISIONS):
        if k % 25 == 24:
            # A new snapshot: usually a few instances changed, now and then every one.
            touched = range(n) if k % 100 == 99 else rng.sample(range(n), max(1, n // 16))
            version += 1
            for i in touched:
                records[i] = _record(metas[i], rng, version)
            snapshot = ClusterSnapshot(instances=tuple(records), taken_at_s=now, version=version)
        family = rng.randrange(4)
        hashes = tuple(family * 100 + j for j in range(rng.randint(0, 6)))
        request = ScheduleInput(
            f"req-{k}",
            prompt_tokens=rng.randint(16, 8000),
            prefix_hashes=hashes,
            expected_output_tokens=rng.choice((0, rng.randint(1, 800))),
        )
        try:
            decision = scheduler.schedule(snapshot, request, now, dry_run=k % 7 == 3)
        except SchedulingError as exc:
            digest.update(f"{k}:refused:{type(exc).__name__}\n".encode())
        else:
            prefill = decision.prefill.instance_id if decision.prefill is not None else "-"
            decode = decision.decode.instance_id if decision.decode is not None else "-"
            digest.update(f"{k}:{decision.mode.value}:{prefill}:{decode}\n".encode())
            if k % 7 != 3:
                scheduler.record(decision, now)
                pending.append(request.request_id)
                placed += 1
        if len(pending) > 24 or (pending and rng.random() < 0.2):
            scheduler.inflight.release(pending.popleft())
        now += rng.choice((0.0, 0.001, 0.02))
    return digest.hexdigest(), placed


@pytest.mark.parametrize(
    ("name", "policy", "adaptive", "n", "seed"), SCENARIOS, ids=[s[0] for s in SCENARIOS]
)
def test_decisions_unchanged(name: str, policy: str, adaptive: bool, n: int, seed: int) -> None:
    golden = json.loads(GOLDEN.read_text())
    digest, placed = run_scenario(policy, adaptive, n, seed)
    assert placed > DECISIONS // 4, f"{name}: the scenario places too few requests to mean anything"
    assert [digest, placed] == golden[name], f"{name}: decisions changed"


if __name__ == "__main__":  # regenerate the digests (only when a change of decisions is intended)
    out = {name: list(run_scenario(p, a, n, s)) for name, p, a, n, s in SCENARIOS}
    GOLDEN.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}", file=sys.stderr)
