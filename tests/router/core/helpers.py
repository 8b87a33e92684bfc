"""Small builders for fabricated cluster snapshots and schedulers (no network)."""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from slorouter.v1 import cms_pb2

from fleet.prefix import token_block_hashes
from fleet.snapshot import ClusterSnapshot, InstanceRecord
from predictor import Grid1D, Grid2D, LatencyPredictor, TpotProfile, TtftProfile
from router.core.columns import ResidentLegs
from router.core.config import SchedulerConfig
from router.core.predictors import PredictorSet
from router.core.request import ScheduleInput
from router.core.scheduler import Scheduler

ROLES = {
    "neutral": cms_pb2.INSTANCE_ROLE_NEUTRAL,
    "prefill": cms_pb2.INSTANCE_ROLE_PREFILL,
    "decode": cms_pb2.INSTANCE_ROLE_DECODE,
    "unspecified": cms_pb2.INSTANCE_ROLE_UNSPECIFIED,
}

# The anchor's worked-example profiles (llumnix-behavior.md §3.4).
WORKED_TTFT = {128: 40.0, 256: 60.0, 512: 100.0, 1024: 180.0}
WORKED_BATCHES = (1.0, 8.0, 16.0)
WORKED_TPRS = (8.0, 128.0, 1024.0)


def worked_tpot(batch: float, tpr: float) -> float:
    return 10 + 0.5 * batch + 0.01 * tpr


def make_predictor(scale: float = 1.0) -> LatencyPredictor:
    """The worked-example profiles, every latency multiplied by ``scale``."""
    xs = np.array(sorted(WORKED_TTFT), dtype=float)
    ttft = Grid1D(xs, np.array([WORKED_TTFT[int(x)] * scale for x in xs]))
    zs = np.array([[worked_tpot(b, t) * scale for t in WORKED_TPRS] for b in WORKED_BATCHES])
    tpot = Grid2D(np.array(WORKED_BATCHES), np.array(WORKED_TPRS), zs)
    return LatencyPredictor(TtftProfile(ttft, "worked-ttft"), TpotProfile(tpot, "worked-tpot"))


def make_metadata(
    instance_id: str,
    role: str = "neutral",
    *,
    endpoint: str | None = None,
    model: str = "",
    node_id: str = "",
    unit_id: str = "",
    max_num_batched_tokens: int = 8192,
    kv_capacity_tokens: int = 100_000,
    max_num_seqs: int = 0,
    labels: Mapping[str, str] | None = None,
) -> cms_pb2.InstanceMetadata:
    return cms_pb2.InstanceMetadata(
        instance_id=instance_id,
        endpoint=endpoint or f"{instance_id}.local:50051",
        role=ROLES[role],
        model=model,
        node_id=node_id,
        unit_id=unit_id,
        max_num_batched_tokens=max_num_batched_tokens,
        kv_capacity_tokens=kv_capacity_tokens,
        max_num_seqs=max_num_seqs,
        labels=dict(labels or {}),
    )


def make_status(
    instance_id: str,
    *,
    schedulable: bool = True,
    waiting: int = 0,
    running: int = 0,
    prefill_tokens: int = 0,
    decode_requests: int = 0,
    decode_tokens: int = 0,
    used_kv_tokens: int = 0,
    admitted: Iterable[str] = (),
    update_id: int = 1,
    timestamp_ms: int = 0,
) -> cms_pb2.InstanceStatus:
    return cms_pb2.InstanceStatus(
        instance_id=instance_id,
        update_id=update_id,
        timestamp_ms=timestamp_ms,
        schedulable=schedulable,
        num_waiting_requests=waiting,
        num_running_requests=running,
        num_uncomputed_prefill_tokens=prefill_tokens,
        num_decode_requests=decode_requests,
        num_decode_tokens=decode_tokens,
        num_used_kv_tokens=used_kv_tokens,
        admitted_request_ids=list(admitted),
    )


def inst(
    instance_id: str,
    role: str = "neutral",
    *,
    age_s: float = 0.0,
    status: bool = True,
    meta: Mapping[str, Any] | None = None,
    **status_fields: Any,
) -> InstanceRecord:
    """One record: metadata from ``role``/``meta``, a status from ``status_fields`` (none if ``status=False``)."""
    md = make_metadata(instance_id, role, **dict(meta or {}))
    st = make_status(instance_id, **status_fields) if status else None
    return InstanceRecord(metadata=md, status=st, status_age_s=age_s if status else 0.0)


def decoding(instance_id: str, requests: int, tokens_each: int) -> InstanceRecord:
    """A neutral instance decoding ``requests`` requests of ``tokens_each`` tokens of context each."""
    return inst(
        instance_id,
        "neutral",
        running=requests,
        decode_requests=requests,
        decode_tokens=tokens_each * requests,
        used_kv_tokens=tokens_each * requests,
    )


def make_snapshot(*records: InstanceRecord, taken_at_s: float = 100.0, version: int = 1) -> ClusterSnapshot:
    return ClusterSnapshot(instances=tuple(records), taken_at_s=taken_at_s, version=version)


def make_config(**overrides: Any) -> SchedulerConfig:
    return SchedulerConfig(**overrides)


def make_scheduler(
    policy: str = "slo",
    *,
    seed: int = 0,
    predictors: LatencyPredictor | PredictorSet | str | None = "worked",
    **overrides: Any,
) -> Scheduler:
    config = make_config(scheduling_policy=policy, **overrides)
    lp = make_predictor() if predictors == "worked" else predictors
    assert not isinstance(lp, str)
    return Scheduler(config, lp, random.Random(seed))


def make_request(request_id: str = "r1", prompt_tokens: int = 256, **kw: Any) -> ScheduleInput:
    return ScheduleInput(request_id=request_id, prompt_tokens=prompt_tokens, **kw)


NOW = 100.0


def binpack_with_cached_holder(routing: str) -> tuple[Scheduler, ScheduleInput]:
    """A ``binpack`` scheduler under ``--prefix-cache-routing routing`` whose prefix index (where it has
    one) records a 1,000-token prompt's blocks (256 tokens each) sent to instance "holder", and a
    request for that prompt: "holder" has 768 of its tokens cached, every other instance none."""
    hashes = token_block_hashes(list(range(1000)), 256)
    scheduler = make_scheduler("binpack", prefix_cache_routing=routing, prefix_block_tokens=256)
    if scheduler.prefix is not None:
        scheduler.prefix.dispatched("holder", hashes, 100_000)
    request = make_request(
        "p", prompt_tokens=1000, prefix_hashes=hashes, max_tokens=64, ttft_slo_ms=5_000.0, tpot_slo_ms=200.0
    )
    return scheduler, request


def busy_paced_leg(*, need_ms: float, spent_s: float, paced: bool = True) -> ResidentLegs:
    """One resident leg on view index 0, started: 900 tokens of context, 100 produced and 50 more
    expected, a recorded TPOT need of ``need_ms`` (a pace over θ when ``paced``, over a cautious
    length of 150 tokens), its first token ``spent_s`` before :data:`NOW`."""
    return ResidentLegs(
        np.zeros(1, dtype=np.intp),
        np.array([900.0]),
        np.array([50.0]),
        np.ones(1, dtype=bool),
        np.array([100.0]),
        np.array([need_ms]),
        np.array([paced]),
        np.array([NOW - spent_s]),
        np.array([150.0 if paced else np.nan]),
    )
