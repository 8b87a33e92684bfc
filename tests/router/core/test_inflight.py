"""The in-flight account: legs, reconciliation per instance, release, expiry, no double counting."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.inflight import InflightAccount, InflightTotals
from tests.router.core.helpers import inst, make_snapshot


def totals(acc: InflightAccount, instance_id: str) -> tuple[int, ...]:
    t = acc.totals(instance_id)
    return (t.requests, t.prefill_requests, t.prefill_tokens, t.decode_requests, t.decode_tokens, t.tokens)


def test_pd_dispatch_adds_a_leg_on_each_instance() -> None:
    acc = InflightAccount()
    acc.record("r1", "P", "D", 100, now_s=1.0)
    assert totals(acc, "P") == (1, 1, 100, 0, 0, 100)
    assert totals(acc, "D") == (1, 0, 0, 1, 100, 100)
    assert "r1" in acc and len(acc) == 1
    assert [(e.instance_id, e.prefill, e.decode) for e in acc.entries("r1")] == [
        ("P", True, False),
        ("D", False, True),
    ]


def test_neutral_dispatch_is_one_request_with_both_legs() -> None:
    acc = InflightAccount()
    acc.record("r1", "N", "N", 100, now_s=1.0)
    # Counted once as a request and once in KV tokens (the anchor counted neutral requests twice).
    assert totals(acc, "N") == (1, 1, 100, 1, 100, 100)


def test_decode_only_re_placement_records_only_the_decode_leg() -> None:
    acc = InflightAccount()
    acc.record("r1", None, "D2", 150, now_s=1.0)
    assert totals(acc, "D2") == (1, 0, 0, 1, 150, 150)


def test_record_is_idempotent_and_a_second_leg_on_the_same_instance_adds_only_that_leg() -> None:
    acc = InflightAccount()
    acc.record("r1", "A", None, 100, now_s=1.0)
    version = acc.version
    acc.record("r1", "A", None, 100, now_s=2.0)
    assert acc.version == version
    assert totals(acc, "A") == (1, 1, 100, 0, 0, 100)
    acc.record("r1", None, "A", 100, now_s=2.0)
    assert totals(acc, "A") == (1, 1, 100, 1, 100, 100)
    (entry,) = acc.entries("r1")
    assert entry.recorded_at_s == 1.0


def test_negative_prompt_tokens_are_rejected() -> None:
    with pytest.raises(ValueError, match="prompt_tokens"):
        InflightAccount().record("r1", "A", "B", -1, now_s=0.0)


def test_release_removes_every_leg_and_twice_is_harmless() -> None:
    acc = InflightAccount()
    acc.record("r1", "P", "D", 100, now_s=1.0)
    acc.record("r2", "P", "D", 50, now_s=1.0)
    assert acc.release("r1") == 2
    assert acc.release("r1") == 0
    assert totals(acc, "P") == (1, 1, 50, 0, 0, 50)
    assert totals(acc, "D") == (1, 0, 0, 1, 50, 50)
    acc.release("r2")
    assert acc.is_empty() and len(acc) == 0
    assert acc.totals("P") == InflightTotals()


def test_release_of_one_instance_keeps_the_other_leg() -> None:
    acc = InflightAccount()
    acc.record("r1", "P", "D", 100, now_s=1.0)
    assert acc.release("r1", "D") == 1
    assert totals(acc, "D") == (0, 0, 0, 0, 0, 0)
    assert totals(acc, "P") == (1, 1, 100, 0, 0, 100)
    assert "r1" in acc


def test_reconcile_removes_each_leg_when_its_own_instance_admits_the_request() -> None:
    acc = InflightAccount()
    acc.record("r1", "P", "D", 100, now_s=1.0)
    # The prefill instance admitted it; the decode instance has not yet.
    snap = make_snapshot(inst("P", "prefill", admitted=["r1"]), inst("D", "decode"))
    assert acc.reconcile(snap) == 1
    assert totals(acc, "P") == (0, 0, 0, 0, 0, 0)
    assert totals(acc, "D") == (1, 0, 0, 1, 100, 100)
    # The same snapshot again changes nothing.
    assert acc.reconcile(snap) == 0
    # Later the decode instance admits it too.
    assert (
        acc.reconcile(
            make_snapshot(inst("P", "prefill", admitted=["r1"]), inst("D", "decode", admitted=["r1"]))
        )
        == 1
    )
    assert acc.is_empty()


def test_a_confirmed_entry_leaves_at_the_first_status_measured_after_the_confirmation() -> None:
    # A stock vLLM engine lists no admitted ids: the router confirms it saw the request running.
    acc = InflightAccount()
    acc.record("r1", "P", "D", 100, now_s=1.0)
    acc.confirm("r1", "D", at_ms=5_000)
    acc.confirm("r1", "D", at_ms=9_000)  # twice: the first time holds
    acc.confirm("nope", "D", at_ms=1)  # no such entry: nothing
    older = make_snapshot(inst("P", "prefill", timestamp_ms=6_000), inst("D", "decode", timestamp_ms=4_999))
    assert acc.reconcile(older) == 0
    assert totals(acc, "D") == (1, 0, 0, 1, 100, 100)
    newer = make_snapshot(inst("P", "prefill", timestamp_ms=6_000), inst("D", "decode", timestamp_ms=5_000))
    assert acc.reconcile(newer) == 1
    assert totals(acc, "D") == (0, 0, 0, 0, 0, 0)
    # The unconfirmed prefill entry stays until its own admission, release or expiry.
    assert totals(acc, "P") == (1, 1, 100, 0, 0, 100)
    assert acc.release("r1") == 1 and acc.is_empty()


def test_release_of_a_confirmed_entry_forgets_the_confirmation() -> None:
    acc = InflightAccount()
    acc.record("r1", "A", "A", 10, now_s=1.0)
    acc.confirm("r1", "A", at_ms=5_000)
    acc.release("r1")
    acc.record("r1", "A", "A", 10, now_s=2.0)  # the id again (a new request): not confirmed
    assert acc.reconcile(make_snapshot(inst("A", timestamp_ms=9_000))) == 0
    assert totals(acc, "A") == (1, 1, 10, 1, 10, 10)


def test_a_leg_is_not_recorded_on_an_instance_that_already_reports_the_request() -> None:
    acc = InflightAccount()
    acc.reconcile(make_snapshot(inst("A", admitted=["r1"]), inst("B")))
    acc.record("r1", "A", "B", 100, now_s=1.0)
    assert totals(acc, "A") == (0, 0, 0, 0, 0, 0)
    assert totals(acc, "B") == (1, 0, 0, 1, 100, 100)


def test_reconcile_ignores_instances_missing_from_the_snapshot_and_those_without_status() -> None:
    acc = InflightAccount()
    acc.record("r1", "gone", "nostatus", 10, now_s=1.0)
    assert acc.reconcile(make_snapshot(inst("nostatus", status=False))) == 0
    assert len(acc.entries()) == 2


def test_expire_removes_entries_once_they_are_expiry_old() -> None:
    acc = InflightAccount(expiry_s=10.0)
    acc.record("old", "A", "B", 10, now_s=0.0)
    acc.record("young", "A", "B", 20, now_s=5.0)
    assert acc.expire(9.99) == 0
    assert acc.expire(10.0) == 2
    assert "old" not in acc and "young" in acc
    assert totals(acc, "A") == (1, 1, 20, 0, 0, 20)
    assert acc.expire(10.0) == 0
    assert acc.expire(15.0) == 2
    assert acc.is_empty()


def test_expire_walk_stops_at_a_young_entry_when_the_clock_went_backwards() -> None:
    acc = InflightAccount(expiry_s=1.0)
    acc.record("late", "A", None, 1, now_s=10.0)
    acc.record("early", "B", None, 1, now_s=5.0)
    assert acc.expire(7.0) == 0  # "early" waits behind "late": never removed early, only late
    assert acc.expire(11.0) == 2


def test_expiry_must_be_positive() -> None:
    with pytest.raises(ValueError, match="expiry_s"):
        InflightAccount(expiry_s=0)


def test_release_after_reconcile_does_not_subtract_twice() -> None:
    acc = InflightAccount()
    acc.record("r1", "P", "D", 100, now_s=1.0)
    acc.record("r2", "P", "D", 30, now_s=1.0)
    acc.reconcile(make_snapshot(inst("P", "prefill", admitted=["r1"]), inst("D", "decode", admitted=["r1"])))
    acc.release("r1")  # the anchor decremented a second time here and went negative
    assert totals(acc, "P") == (1, 1, 30, 0, 0, 30)
    assert totals(acc, "D") == (1, 0, 0, 1, 30, 30)


def test_columns_follow_view_order_and_skip_unknown_instances() -> None:
    acc = InflightAccount()
    acc.record("r1", "B", "C", 7, now_s=0.0)
    acc.record("r2", "X", "X", 9, now_s=0.0)
    cols = acc.columns({"A": 0, "B": 1, "C": 2}, 3)
    assert cols.requests.tolist() == [0, 1, 1]
    assert cols.prefill_tokens.tolist() == [0, 7, 0]
    assert cols.decode_tokens.tolist() == [0, 0, 7]
    assert cols.instances_with_entries == 2


def test_changed_since_names_the_instances_touched() -> None:
    acc = InflightAccount()
    v0 = acc.version
    acc.record("r1", "A", "B", 1, now_s=0.0)
    v1 = acc.version
    acc.release("r1", "A")
    assert acc.changed_since(v0) == {"A", "B"}
    assert acc.changed_since(v1) == {"A"}
    assert acc.changed_since(acc.version) == set()
    assert acc.changed_since(acc.version + 1) is None


# ----------------------------------------------------------------------------- properties

_ids = st.sampled_from(["r1", "r2", "r3", "r4"])
_instances = st.sampled_from(["A", "B", "C"])
_ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("record"), _ids, st.none() | _instances, st.none() | _instances, st.integers(0, 500)
        ),
        st.tuples(st.just("release"), _ids, st.none() | _instances),
        st.tuples(st.just("expire"), st.floats(0, 30)),
        st.tuples(st.just("reconcile"), st.dictionaries(_instances, st.lists(_ids, max_size=3), max_size=3)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(_ops)
def test_totals_always_equal_the_sum_of_entries_and_never_go_negative(ops: list[tuple]) -> None:
    acc = InflightAccount(expiry_s=5.0)
    now = 0.0
    for op in ops:
        now += 0.5
        if op[0] == "record":
            acc.record(op[1], op[2], op[3], op[4], now_s=now)
        elif op[0] == "release":
            acc.release(op[1], op[2])
        elif op[0] == "expire":
            acc.expire(op[1])
        else:
            acc.reconcile(make_snapshot(*(inst(i, admitted=ids) for i, ids in op[1].items())))
        for instance_id in ("A", "B", "C"):
            entries = [e for e in acc.entries() if e.instance_id == instance_id]
            expected = (
                len(entries),
                sum(e.prefill for e in entries),
                sum(e.prompt_tokens for e in entries if e.prefill),
                sum(e.decode for e in entries),
                sum(e.prompt_tokens for e in entries if e.decode),
                sum(e.prompt_tokens for e in entries),
            )
            assert totals(acc, instance_id) == expected
            assert min(expected) >= 0
        # One entry per (request, instance): a request is never counted twice on one instance.
        keys = [(e.request_id, e.instance_id) for e in acc.entries()]
        assert len(keys) == len(set(keys))


def test_resident_finals_are_replaced_per_leg_and_the_instance_sum_follows() -> None:
    account = InflightAccount()
    account.record("a", "i0", "i0", 100, 0.0, final_tokens=120)
    account.record("b", "i0", "i0", 50, 0.0, final_tokens=60)
    account.record("c", "i1", "i1", 10, 0.0, final_tokens=20)
    account.advance("a", 130)  # "a" outlived its estimate
    assert account.resident_progress("i0") == [("a", 130, False), ("b", 50, False)]
    version = account.version
    # "c" lives on i1: ignored here; "b" unchanged.
    assert account.set_resident_finals("i0", {"a": 200, "b": 60, "c": 999})
    assert account.resident("i0") == (2, 260)
    assert account.resident("i1") == (1, 20)
    assert account.changed_since(version) == {"i0"}
    # Nothing changed: no new version, so cached views stay valid.
    version = account.version
    assert not account.set_resident_finals("i0", {"a": 200})
    assert account.version == version
    # A release subtracts the re-estimated final, not the first one.
    account.release("a")
    assert account.resident("i0") == (1, 60)
    assert account.resident_count() == 2 and not account.is_resident("a")
    with pytest.raises(ValueError, match="final tokens"):
        account.set_resident_finals("i0", {"b": -1})


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcd"), st.integers(0, 500)), max_size=30))
def test_resident_sums_equal_the_legs_finals_after_any_re_estimates(changes: list[tuple[str, int]]) -> None:
    account = InflightAccount()
    for k, r in enumerate("abcd"):
        account.record(r, f"i{k % 2}", f"i{k % 2}", 10, 0.0, final_tokens=40)
    expected = dict.fromkeys("abcd", 40)
    for r, final in changes:
        instance = f"i{'abcd'.index(r) % 2}"
        account.set_resident_finals(instance, {r: final})
        expected[r] = final
    for k in range(2):
        legs = [r for i, r in enumerate("abcd") if i % 2 == k]
        assert account.resident(f"i{k}") == (len(legs), sum(expected[r] for r in legs))
