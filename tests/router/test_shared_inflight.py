"""The in-flight account shared through shared memory by the processes of ``--processes N``."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from router.core.columns import INFLIGHT_ROWS
from router.core.inflight import InflightAccount
from router.shared_inflight import InflightSharing, SharedInflight


@pytest.fixture
def segment() -> Iterator[tuple[SharedInflight, SharedInflight, SharedInflight]]:
    first = SharedInflight(None, 3, 0, create=True)
    others = (SharedInflight(first.name, 3, 1), SharedInflight(first.name, 3, 2))
    yield first, *others
    for shared in (*others, first):
        shared.close()


def test_each_process_sees_what_the_others_dispatched_and_released(
    segment: tuple[SharedInflight, SharedInflight, SharedInflight],
) -> None:
    accounts = [InflightAccount(expiry_s=60.0) for _ in segment]
    sharing = [InflightSharing(shared, account) for shared, account in zip(segment, accounts, strict=True)]
    accounts[0].record("a", "w0", "w0", 100, 0.0)
    accounts[1].record("b", "w0", "w1", 50, 0.0)
    for s in sharing:
        s.sync()
    for s in sharing:  # a second round: everyone has read everyone's latest
        s.sync()
    # Every process sees the whole fleet's in-flight load: its own plus the others'.
    for account in accounts:
        assert account.totals("w0").requests == 2
        assert account.totals("w0").prefill_tokens == 150
        assert account.totals("w1").decode_requests == 1
    # What a process publishes is its own only: no peer load echoes back as its own.
    assert accounts[2].own_row("w0") == (0,) * INFLIGHT_ROWS
    assert accounts[0].own_row("w0")[0] == 1
    # The view's columns carry the sum too.
    cols = accounts[2].columns({"w0": 0, "w1": 1}, 2)
    assert isinstance(cols.matrix, np.ndarray)
    assert cols.matrix[0, 0] == 2 and cols.matrix[0, 1] == 1
    accounts[0].release("a")
    for _ in range(2):  # a process that synced before the releasing one sees it in the next round
        for s in sharing:
            s.sync()
    assert [a.totals("w0").requests for a in accounts] == [1, 1, 1]
    accounts[1].release("b")
    for _ in range(2):
        for s in sharing:
            s.sync()
    assert all(a.totals("w0").requests == 0 and a.totals("w1").requests == 0 for a in accounts)


def test_peer_changes_reach_the_view_journal(
    segment: tuple[SharedInflight, SharedInflight, SharedInflight],
) -> None:
    mine, theirs = InflightAccount(), InflightAccount()
    sharing_mine, sharing_theirs = InflightSharing(segment[0], mine), InflightSharing(segment[1], theirs)
    before = mine.version
    theirs.record("x", "w3", "w3", 10, 0.0)
    sharing_theirs.sync()
    sharing_mine.sync()
    changes = mine.changes_since(before)
    assert changes is not None and "w3" in changes


def test_a_cleared_slot_stops_counting(
    segment: tuple[SharedInflight, SharedInflight, SharedInflight],
) -> None:
    mine, theirs = InflightAccount(), InflightAccount()
    theirs.record("x", "w3", "w3", 10, 0.0)
    InflightSharing(segment[1], theirs).sync()
    sharing = InflightSharing(segment[0], mine)
    sharing.sync()
    assert mine.totals("w3").requests == 1
    segment[0].clear(1)  # its process exited
    sharing.sync()
    assert mine.totals("w3").requests == 0


def test_bounds() -> None:
    with pytest.raises(ValueError, match="--processes"):
        SharedInflight(None, 0, 0, create=True)
    with pytest.raises(ValueError, match="slot"):
        SharedInflight(None, 2, 2, create=True)
    with pytest.raises(ValueError, match="values"):
        InflightAccount().set_peers({"w": (1, 2)})
