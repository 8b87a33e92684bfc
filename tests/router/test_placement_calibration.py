"""The router feeds every view's step samples to the calibration in one call.

Each instance learns what one call per status would teach it; each profile group learns what one
call per view with all its instances' samples would (the group is refitted once per view).
"""

from __future__ import annotations

import random

import numpy as np

from fleet.snapshot import ClusterSnapshot, InstanceRecord
from router.core.calibration import CalibrationConfig, Calibrator, StepSample
from router.placement import Placer
from tests.router.core.helpers import NOW, inst, make_scheduler, make_snapshot


class _Source:
    def __init__(self, snapshot: ClusterSnapshot) -> None:
        self.current = snapshot

    def snapshot(self) -> ClusterSnapshot:
        return self.current


def _record(instance_id: str, group: str, update_id: int, samples: list[StepSample]) -> InstanceRecord:
    record = inst(instance_id, meta={"labels": {"profile": group}}, update_id=update_id)
    assert record.status is not None
    for s in samples:
        record.status.step_samples.add(
            num_prefill_tokens=s.num_prefill_tokens,
            num_decode_requests=s.num_decode_requests,
            num_decode_tokens=s.num_decode_tokens,
            duration_ms=s.duration_ms,
        )
    return record


def _samples(rng: random.Random) -> list[StepSample]:
    out = []
    for _ in range(rng.randint(0, 6)):
        prefill = rng.choice([0, 0, rng.randint(16, 4096)])
        batch = rng.randint(0 if prefill else 1, 48)
        ms = (
            rng.uniform(5.0, 120.0) if rng.random() > 0.05 else -1.0
        )  # now and then one the calibration drops
        out.append(StepSample(prefill, batch, batch * rng.randint(64, 2048), ms))
    return out


def test_one_call_per_view_learns_what_one_call_per_status_learns() -> None:
    rng = random.Random(7)
    ids = [("a", "g1"), ("b", "g1"), ("c", "g2"), ("d", "g1")]
    scheduler = make_scheduler("slo", calibration="refit", instance_staleness_s=float("inf"))
    clock = [NOW]
    source = _Source(make_snapshot())
    placer = Placer(scheduler, source, clock=lambda: clock[0])
    calibration = placer.calibration
    assert calibration is not None
    predictors = scheduler.predictors
    assert predictors is not None
    reference = Calibrator(CalibrationConfig(mode="refit"), predictors.step_predictor)
    group_reference = Calibrator(CalibrationConfig(mode="refit"), predictors.step_predictor)
    updates = dict.fromkeys((i for i, _ in ids), 0)
    for view in range(150):
        clock[0] = NOW + view * 0.02
        records = []
        by_group: dict[str, list[StepSample]] = {}
        for instance_id, group in ids:
            if rng.random() < 0.7:  # otherwise the same status again: its samples are in already
                updates[instance_id] += 1
                samples = _samples(rng)
                if samples:
                    reference.observe(instance_id, group, samples, clock[0])
                    by_group.setdefault(group, []).extend(samples)
                record = _record(instance_id, group, updates[instance_id], samples)
            else:
                record = _record(instance_id, group, updates[instance_id], [])
            records.append(record)
        for group, together in by_group.items():
            group_reference.observe(f"all-{group}", group, together, clock[0])
        source.current = make_snapshot(*records, taken_at_s=clock[0], version=view + 1)
        placer.snapshot()
    # Every instance, and one never seen that falls back to its profile group's correction.
    table_ids, groups = [*(i for i, _ in ids), "e"], [*(g for _, g in ids), "g1"]
    ours_all = calibration.correction(table_ids, groups)
    theirs_all = reference.correction(table_ids[:-1], groups[:-1])
    from_group = group_reference.correction(table_ids[-1:], groups[-1:])
    assert ours_all is not None and theirs_all is not None and from_group is not None
    for name in ("ttft_factor", "tpot_factor", "interleave_ms", "coefs", "has_fit"):
        theirs = np.concatenate([getattr(theirs_all, name), getattr(from_group, name)])
        assert np.array_equal(getattr(ours_all, name), theirs), name
    for instance_id, _ in ids:
        assert calibration.num_samples(instance_id) == reference.num_samples(instance_id) > 0
        assert calibration.factors(instance_id) == reference.factors(instance_id)
        ours, theirs = calibration.coefficients(instance_id), reference.coefficients(instance_id)
        assert (ours is None) == (theirs is None)
        if ours is not None and theirs is not None:
            assert np.array_equal(ours, theirs)
