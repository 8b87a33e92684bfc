"""The incremental view refresh builds the table a full build would.

A new snapshot that keeps most instances' status objects (the CMS's memory
store and the simulator hand them out unchanged until a status arrives) has
only its touched rows rewritten; these properties compare every column with
a fresh builder's full build of the same snapshot, across sequences of
updates that touch some, none or all instances, drop statuses, change
metadata or the fleet's size.
"""

from __future__ import annotations

import random

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from slorouter.v1 import cms_pb2

from fleet.snapshot import ClusterSnapshot, InstanceRecord
from router.core.columns import InstanceTable
from router.core.view import ViewBuilder

PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_ARRAYS = (
    "roles",
    "node_codes",
    "unit_codes",
    "id_rank",
    "max_num_batched_tokens",
    "kv_capacity_tokens",
    "has_status",
    "schedulable",
    "status_age_s",
    "uncomputed_prefill_tokens",
    "decode_requests",
    "decode_tokens",
    "used_kv_tokens",
    "waiting_requests",
    "running_requests",
    "measured_decode_step_ms",
    "max_num_seqs",
)


def _metadata(i: int, rng: random.Random) -> cms_pb2.InstanceMetadata:
    return cms_pb2.InstanceMetadata(
        instance_id=f"i{i:03d}",
        endpoint=f"h{i}:1",
        role=rng.choice((cms_pb2.INSTANCE_ROLE_PREFILL, cms_pb2.INSTANCE_ROLE_DECODE)),
        node_id=f"n{i // 3}",
        max_num_batched_tokens=rng.choice((0, 512)),
        kv_capacity_tokens=rng.randint(1000, 9000),
    )


def _status(instance_id: str, rng: random.Random) -> cms_pb2.InstanceStatus | None:
    if rng.random() < 0.15:
        return None
    status = cms_pb2.InstanceStatus(
        instance_id=instance_id,
        schedulable=rng.random() < 0.8,
        num_waiting_requests=rng.randint(0, 5),
        num_running_requests=rng.randint(0, 9),
        num_uncomputed_prefill_tokens=rng.randint(0, 4000),
        num_decode_requests=rng.randint(0, 9),
        num_decode_tokens=rng.randint(0, 9000),
        num_used_kv_tokens=rng.randint(0, 9000),
    )
    for _ in range(rng.randint(0, 2)):
        status.step_samples.add(duration_ms=rng.uniform(1, 50), num_decode_requests=rng.randint(0, 3))
    return status


def _same(a: InstanceTable, b: InstanceTable) -> None:
    assert a.ids == b.ids and a.endpoints == b.endpoints and dict(a.index) == dict(b.index)
    for name in _ARRAYS:
        left, right = getattr(a, name), getattr(b, name)
        np.testing.assert_array_equal(left, right, err_msg=name)
        assert left.dtype == right.dtype, name
        assert not left.flags.writeable, name


# One update: how many instances it touches (fraction), whether metadata changes, whether the size does.
_updates = st.lists(
    st.tuples(st.sampled_from((0.0, 0.05, 0.2, 0.3, 1.0)), st.booleans(), st.booleans()),
    min_size=1,
    max_size=6,
)


@PROPS
@given(st.integers(1, 40), _updates, st.integers(0, 2**16))
def test_incremental_table_equals_a_full_build(n: int, updates, seed: int) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(seed)
    metas = [_metadata(i, rng) for i in range(n)]
    records = [InstanceRecord(m, _status(m.instance_id, rng), rng.uniform(0, 1)) for m in metas]
    builder = ViewBuilder()
    for version, (fraction, new_metadata, resize) in enumerate(updates):
        if resize:
            metas.append(_metadata(len(metas), rng))
            records.append(InstanceRecord(metas[-1], _status(metas[-1].instance_id, rng), 0.0))
        for i in rng.sample(range(len(records)), int(len(records) * fraction)):
            if new_metadata and rng.random() < 0.3:
                metas[i] = _metadata(i, rng)
            records[i] = InstanceRecord(metas[i], _status(metas[i].instance_id, rng), 0.0)
        # Every record is new (ages moved), most status objects are the ones of the last snapshot.
        records = [InstanceRecord(r.metadata, r.status, r.status_age_s + 0.25) for r in records]
        snapshot = ClusterSnapshot(tuple(records), taken_at_s=10.0 + version, version=version)
        _same(builder.table(snapshot), ViewBuilder().table(snapshot))


def test_a_status_replaced_in_place_of_an_equal_one_is_read_again() -> None:
    """A touched row is found by the status object, so an equal but new object is read (no stale row)."""
    md = cms_pb2.InstanceMetadata(instance_id="a", endpoint="a:1")
    builder = ViewBuilder()
    first = cms_pb2.InstanceStatus(instance_id="a", schedulable=True, num_waiting_requests=1)
    builder.table(ClusterSnapshot((InstanceRecord(md, first, 0.0),), taken_at_s=0.0))
    second = cms_pb2.InstanceStatus(instance_id="a", schedulable=True, num_waiting_requests=7)
    table = builder.table(ClusterSnapshot((InstanceRecord(md, second, 0.0),), taken_at_s=1.0))
    assert table.waiting_requests.tolist() == [7.0]
