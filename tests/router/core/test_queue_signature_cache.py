"""The queue's per-snapshot caches on the per-request path give what a build from nothing gives.

The load watch (:class:`router.core.queue.LoadWatch`) keeps the status rows of its signature per
instance table, and the drain's load-free parts are found by the table's identity before its
columns are compared; the release limit keeps the tightest recent target as arrivals come. Each
is checked against the value built fresh, across snapshot changes and in-flight loads.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.core.columns import ClusterView, InflightColumns, InstanceTable
from router.core.queue import LoadWatch, QueueConfig, RouterQueue, _status_signature
from tests.router.core.helpers import NOW, inst, make_request, make_scheduler, make_snapshot

_STATUS = st.tuples(
    st.integers(0, 40),  # decode requests
    st.integers(0, 6000),  # decode tokens
    st.integers(0, 50_000),  # used KV tokens
    st.integers(0, 8),  # waiting
    st.integers(0, 8),  # running
    st.integers(0, 4000),  # uncomputed prefill tokens
    st.booleans(),  # schedulable
    st.one_of(st.none(), st.just(float("nan")), st.floats(5.0, 80.0)),  # measured decode step
)


def _table(statuses: list[tuple[object, ...]], cap: int | None) -> InstanceTable:
    """A fresh table (empty memo) of instances ``i0..`` with these statuses."""
    scheduler = make_scheduler("slo")
    records = [
        inst(
            f"i{k}",
            decode_requests=d,
            decode_tokens=t,
            used_kv_tokens=kv,
            waiting=w,
            running=r,
            prefill_tokens=p,
            schedulable=ok,
        )
        for k, (d, t, kv, w, r, p, ok, _) in enumerate(statuses)
    ]
    table = scheduler.view(make_snapshot(*records), NOW).instances
    steps = [s for *_, s in statuses]
    measured = (
        None if all(s is None for s in steps) else np.array([np.nan if s is None else s for s in steps])
    )
    seqs = None if cap is None else np.full(len(statuses), float(cap))
    return dataclasses.replace(table, measured_decode_step_ms=measured, max_num_seqs=seqs, memo={})


def _inflight(n: int, rows: list[list[int]]) -> InflightColumns:
    matrix = np.zeros((8, n))
    for k, row in enumerate(rows):
        matrix[:6, k % n] += row
    return InflightColumns.of(matrix)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    snapshots=st.lists(
        st.tuples(
            st.lists(_STATUS, min_size=2, max_size=2),
            st.lists(
                st.lists(st.lists(st.integers(0, 5), min_size=6, max_size=6), max_size=3),
                min_size=1,
                max_size=4,
            ),
        ),
        min_size=1,
        max_size=4,
    ),
    cap=st.one_of(st.none(), st.integers(2, 12)),
)
def test_the_watch_reads_one_signature_per_table_and_moves_as_on_fresh_tables(
    snapshots: list[tuple[list[tuple[object, ...]], list[list[list[int]]]]], cap: int | None
) -> None:
    """Several views per snapshot (dispatches adding in-flight load): the watch that reuses each
    table's status rows moves its epoch exactly when, and for the reason, a watch fed a fresh table
    for every view does; and the kept rows equal rows built from nothing."""
    scheduler = make_scheduler("slo")
    cached, fresh = LoadWatch(), LoadWatch()
    now = NOW
    for statuses, dispatches in snapshots:
        table = _table(statuses, cap)
        for rows in dispatches:
            now += 0.001
            inflight = _inflight(table.n, rows)
            ages = np.zeros(table.n)
            kept_view = ClusterView(table, inflight, now, ages)
            new_table = _table(statuses, cap)
            fresh_view = ClusterView(new_table, inflight, now, ages)
            assert cached.observe(scheduler, kept_view, now) == fresh.observe(scheduler, fresh_view, now)
            assert cached.moves == fresh.moves
            for at_cap in (False, True):
                kept = _status_signature(table, at_cap)
                built = _status_signature(_table(statuses, cap), at_cap)
                for a, b in zip(kept, built, strict=True):
                    np.testing.assert_array_equal(a, b)
                    assert a.dtype == b.dtype and not a.flags.writeable
                assert _status_signature(table, at_cap)[0] is kept[0]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(
                st.just("arrive"),
                st.one_of(st.sampled_from([50.0, 200.0, 1000.0]), st.floats(1.0, 5000.0, allow_nan=False)),
            ),
            st.tuples(st.just("forget"), st.integers(0, 80)),
        ),
        max_size=80,
    ),
    window=st.integers(1, 9),
)
def test_the_sliding_minimum_is_min_over_the_window_through_arrivals_and_forgets(
    ops: list[tuple[str, float]], window: int
) -> None:
    """The sliding minimum's head is ``min()`` over the window after every arrival and forget (ties
    included: equal targets are the common case), and the release limit reads it."""
    queue = RouterQueue(QueueConfig(queue_policy="edf", release_window_requests=window), 1000.0, 50.0)
    arrived = 0
    for op, value in ops:
        if op == "arrive":
            queue.observe_arrival(make_request(f"r{arrived}", ttft_slo_ms=value))
            arrived += 1
        else:
            queue.forget_arrival(f"r{int(value)}")
        targets = [target for target, _, _ in queue._recent]
        assert len(targets) <= window
        if not targets:
            assert queue.release_limit_ms(NOW) == float("inf")
            continue
        head = queue._minima[0][1]
        assert head == min(targets)
        # Targets never fall along the kept minima, and each is a target still in the window.
        kept = [target for _, target in queue._minima]
        assert kept == sorted(kept) and set(kept) <= set(targets)
        assert queue.release_limit_ms(NOW) == head
