"""The router's prefix-cache knowledge: the block index, its two sources, and TTFT from uncached tokens."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.prefix import id_block_hashes, token_block_hashes
from router.core.prefix import ApproximatePrefixIndex, BlockIndex, ExactPrefixIndex
from tests.router.core.helpers import NOW, inst, make_predictor, make_request, make_scheduler, make_snapshot


def _naive_match(contents: dict[str, set[int]], hashes: list[int]) -> dict[str, int]:
    out = {}
    for instance, held in contents.items():
        k = 0
        while k < len(hashes) and hashes[k] in held:
            k += 1
        if k:
            out[instance] = k
    return out


def test_chained_hashes_share_exactly_the_common_full_blocks() -> None:
    a = token_block_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    b = token_block_hashes([1, 2, 3, 4, 9, 9, 7], 2)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    # The same block content after a different prefix is a different block.
    assert token_block_hashes([9, 9, 3, 4], 2)[1] != a[1]
    # Ids: only the blocks the prompt fills get a hash.
    assert len(id_block_hashes([7, 8, 9], 1100, 512)) == 2
    assert id_block_hashes([7, 8], 1024, 512)[0] == id_block_hashes([7, 5], 600, 512)[0]


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "remove", "clear"]),
            st.integers(0, 5),
            st.lists(st.integers(0, 12), max_size=8),
        ),
        max_size=60,
    ),
    query=st.lists(st.integers(0, 12), min_size=1, max_size=10),
    cap=st.integers(1, 6),
    max_instances=st.integers(1, 4),
)
def test_block_index_matches_a_naive_model_and_stays_bounded(
    ops: list[tuple[str, int, list[int]]], query: list[int], cap: int, max_instances: int
) -> None:
    index = BlockIndex(16, max_blocks_per_instance=cap, max_instances=max_instances)
    for kind, who, hashes in ops:
        name = f"i{who}"
        if kind == "add":
            index.add(name, hashes)
        elif kind == "remove":
            index.remove(name, hashes)
        else:
            index.clear(name)
        # Bounded memory, whatever the traffic.
        assert len(index.instances()) <= max_instances
        assert index.num_entries <= max_instances * cap
        assert all(len(index.blocks_of(i)) <= cap for i in index.instances())
    contents = {i: set(index.blocks_of(i)) for i in index.instances()}
    assert index.matched_blocks(query) == _naive_match(contents, query)


def test_approximate_index_keeps_the_most_recent_prompts_within_the_kv_capacity() -> None:
    index = ApproximatePrefixIndex(100)
    first = [1, 2, 3]
    index.dispatched("a", first, capacity_tokens=399)  # room for 3 blocks
    assert index.matched_blocks([1, 2, 3, 9]) == {"a": 3}
    index.dispatched("a", [1, 7], capacity_tokens=399)
    # Over capacity: the least recently sent go, a prompt's tail before its head.
    assert index.blocks_of("a") == frozenset({1, 2, 7})
    assert index.matched_blocks([1, 2, 3]) == {"a": 2}
    exact = ExactPrefixIndex(100)
    exact.apply("a", [("stored", (1, 2)), ("stored", (3,)), ("removed", (2,))])
    assert exact.matched_blocks(first) == {"a": 1}
    exact.apply("a", [("cleared", ())])
    assert exact.matched_blocks(first) == {}
    with pytest.raises(ValueError, match="unknown KV event kind"):
        exact.apply("a", [("moved", (1,))])


def test_exact_index_counts_dispatched_blocks_until_the_engine_reports_them() -> None:
    exact = ExactPrefixIndex(100)
    exact.dispatched("a", [1, 2, 3], capacity_tokens=1000)
    # Sent, not yet scheduled by the engine: a second prompt with this prefix follows it to "a".
    assert exact.matched_blocks([1, 2, 3, 4]) == {"a": 3}
    assert exact.pending_of("a") == {1, 2, 3} and exact.blocks_of("a") == frozenset()
    exact.apply("a", [("stored", (1, 2))])  # reported: real, no longer pending
    assert exact.pending_of("a") == {3} and exact.blocks_of("a") == {1, 2}
    assert exact.matched_blocks([1, 2, 3]) == {"a": 3}
    exact.apply("a", [("removed", (2, 3))])  # evicted (or never to be stored): gone either way
    assert exact.matched_blocks([1, 2, 3]) == {"a": 1} and exact.pending_of("a") == frozenset()
    exact.dispatched("b", [1, 5], capacity_tokens=1000)
    exact.apply("b", [("cleared", ())])
    assert exact.matched_blocks([1, 5]) == {"a": 1}
    # A dispatch adds nothing the engine already reported.
    exact.dispatched("a", [1], capacity_tokens=1000)
    assert exact.pending_of("a") == frozenset()


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["dispatched", "stored", "removed", "cleared"]),
            st.integers(0, 3),
            st.lists(st.integers(0, 12), max_size=8),
        ),
        max_size=60,
    ),
    query=st.lists(st.integers(0, 12), min_size=1, max_size=10),
    cap_blocks=st.integers(1, 6),
)
def test_exact_index_is_reported_plus_pending_and_stays_bounded(
    ops: list[tuple[str, int, list[int]]], query: list[int], cap_blocks: int
) -> None:
    exact = ExactPrefixIndex(16, max_blocks_per_instance=64)
    reported: dict[str, set[int]] = {}
    pending: dict[str, list[int]] = {}  # least recently dispatched first
    for kind, who, hashes in ops:
        name = f"i{who}"
        held, waiting = reported.setdefault(name, set()), pending.setdefault(name, [])
        if kind == "dispatched":
            exact.dispatched(name, hashes, capacity_tokens=16 * cap_blocks)
            for h in hashes:
                if h not in held:
                    if h in waiting:
                        waiting.remove(h)
                    waiting.append(h)
            del waiting[: max(0, len(waiting) - cap_blocks)]
        elif kind == "cleared":
            exact.apply(name, [("cleared", ())])
            held.clear()
            waiting.clear()
        else:
            exact.apply(name, [(kind, hashes)])
            (held.update if kind == "stored" else held.difference_update)(hashes)
            waiting[:] = [h for h in waiting if h not in hashes]
        # Pending never outgrows the instance's KV capacity in blocks, nor the per-instance bound.
        assert all(len(exact.pending_of(i)) <= cap_blocks for i in exact.instances())
        assert exact.pending_of(name) == set(waiting)
        assert exact.blocks_of(name) == held
    contents = {i: reported.get(i, set()) | set(pending.get(i, [])) for i in exact.instances()}
    assert exact.matched_blocks(query) == _naive_match(contents, query)


def test_predicted_ttft_charges_only_the_uncached_tokens_hand_computed() -> None:
    """Worked profile: ttft(128)=40, ttft(256)=60, ttft(512)=100, ttft(1024)=180 ms, chunk 8192.

    A 1000-token prompt whose first 768 tokens (three 256-token blocks) instance a holds costs
    232 tokens there: ttft(232) = 40 + (232-128)/128 * 20 = 56.25 ms, beside a backlog of 0.
    Instance b (no cache, idle) computes all 1000: 160 + (1000-768)/... = ttft(1000) = 177 ms.
    """
    s = make_scheduler("slo", calibration="off", prefix_cache_routing="approximate", prefix_block_tokens=256)
    snap = make_snapshot(inst("a"), inst("b"))
    hashes = token_block_hashes(list(range(1000)), 256)
    assert len(hashes) == 3
    assert s.prefix is not None
    s.prefix.dispatched("a", hashes, 100_000)
    request = make_request(prompt_tokens=1000, prefix_hashes=hashes)
    decision = s.schedule(snap, request, NOW, dry_run=True)
    ctx = decision.context
    cached = ctx.metric("cached_prompt_tokens")
    ttft = ctx.metric("predicted_ttft")
    assert cached.tolist() == [768.0, 0.0]
    assert ttft[0] == pytest.approx(40 + (232 - 128) / 128 * 20)
    assert ttft[1] == pytest.approx(100 + (1000 - 512) / 512 * 80)
    lp = make_predictor()
    assert ttft[1] == lp.predict_ttft_ms(1000.0, 0.0, 0.0, 8192)
    assert decision.prefill is not None and decision.prefill.instance_id == "a"
    # The trace shows the cached tokens per candidate.
    assert {e.instance_id: e.metrics["cached_prompt_tokens"] for e in decision.trace} == {
        "a": 768.0,
        "b": 0.0,
    }
    # Off: today's prediction, the whole prompt everywhere.
    off = make_scheduler("slo", calibration="off", prefix_cache_routing="off")
    ttft_off = off.schedule(snap, request, NOW, dry_run=True).context.metric("predicted_ttft")
    assert ttft_off[0] == ttft_off[1] == ttft[1]


def test_a_hit_wins_while_it_meets_the_target_and_stops_when_the_queue_outweighs_it() -> None:
    # a holds 768 of 1000 tokens. With a 100-token backlog it computes 332 tokens (72 ms) against
    # 1000 on idle b (177 ms): a. With 2000 tokens of backlog it computes 2232 (369 ms), past the
    # 300 ms TTFT target, so the filter drops it and b takes the prompt. Within the target the hit
    # wins even when b would be faster: the prompt costs the fleet the least work there.
    hashes = token_block_hashes(list(range(1000)), 256)
    for backlog, target, winner in ((100, 300.0, "a"), (2000, 300.0, "b"), (2000, 6000.0, "a")):
        s = make_scheduler(
            "slo",
            calibration="off",
            prefix_cache_routing="approximate",
            prefix_block_tokens=256,
            ttft_slo_ms=target,
        )
        assert s.prefix is not None
        s.prefix.dispatched("a", hashes, 100_000)
        snap = make_snapshot(inst("a", prefill_tokens=backlog), inst("b"))
        decision = s.schedule(snap, make_request(prompt_tokens=1000, prefix_hashes=hashes), NOW)
        assert decision.prefill is not None and decision.prefill.instance_id == winner, (backlog, target)


def test_dispatch_teaches_the_approximate_index_and_inflight_counts_only_uncached_tokens() -> None:
    s = make_scheduler("slo", calibration="off", prefix_cache_routing="approximate", prefix_block_tokens=256)
    snap = make_snapshot(inst("a"))
    hashes = token_block_hashes(list(range(1000)), 256)
    first = s.schedule(snap, make_request("r1", prompt_tokens=1000, prefix_hashes=hashes), NOW)
    s.record(first, NOW)
    assert first.prefill is not None
    where = first.prefill.instance_id
    assert s.prefix is not None and s.prefix.matched_blocks(hashes) == {where: 3}
    second = s.schedule(snap, make_request("r2", prompt_tokens=1000, prefix_hashes=hashes), NOW)
    s.record(second, NOW)
    assert second.prefill is not None and second.prefill.instance_id == where
    totals = s.inflight.totals(where)
    # r1 charged in full (1000), r2 only its uncached 232 tokens.
    assert totals.prefill_tokens == 1000 + 232


def test_cache_affinity_policy_picks_the_longest_hit_then_the_least_loaded() -> None:
    s = make_scheduler("cache-affinity", prefix_cache_routing="approximate", prefix_block_tokens=256)
    assert s.prefix is not None
    hashes = token_block_hashes(list(range(1000)), 256)
    s.prefix.dispatched("b", hashes[:1], 100_000)
    s.prefix.dispatched("c", hashes, 100_000)
    snap = make_snapshot(inst("a"), inst("b"), inst("c", waiting=20, prefill_tokens=50_000))
    decision = s.schedule(snap, make_request(prompt_tokens=1000, prefix_hashes=hashes), NOW)
    assert decision.prefill is not None and decision.prefill.instance_id == "c"  # load ignored
    plain = s.schedule(snap, make_request(prompt_tokens=1000), NOW)
    assert plain.prefill is not None and plain.prefill.instance_id in ("a", "b")


def test_cache_affinity_ignores_a_prefix_most_instances_hold() -> None:
    # Every prompt starts with the same block (Mooncake's first block, a fleet-wide system prompt):
    # it gives no instance an edge, so the least loaded takes the prompt, not the first holder.
    s = make_scheduler("cache-affinity", prefix_cache_routing="approximate", prefix_block_tokens=256)
    assert s.prefix is not None
    hashes = token_block_hashes(list(range(1000)), 256)
    for where in ("a", "b", "c"):
        s.prefix.dispatched(where, hashes[:1], 100_000)
    s.prefix.dispatched("a", hashes[:2], 100_000)
    snap = make_snapshot(inst("a", waiting=5), inst("b", waiting=3), inst("c", waiting=1))
    decision = s.schedule(snap, make_request(prompt_tokens=1000, prefix_hashes=hashes), NOW)
    assert decision.prefill is not None and decision.prefill.instance_id == "a"  # a holds more than the rest
    other = token_block_hashes([*range(256), *range(5000, 5744)], 256)  # the common block only
    decision = s.schedule(snap, make_request(prompt_tokens=1000, prefix_hashes=other), NOW)
    assert decision.prefill is not None and decision.prefill.instance_id == "c"


def test_cache_affinity_does_not_pile_every_prompt_on_the_first_holder_of_a_common_block() -> None:
    # Prompts of distinct conversations that share only their first block arrive at an idle fleet
    # of four, each recorded as dispatched (no engine reports anything back). The first holder of
    # that block must not take them all: once its load runs away, the rest share them.
    s = make_scheduler("cache-affinity", prefix_cache_routing="approximate", prefix_block_tokens=256)
    counts = {i: 0 for i in "abcd"}
    for k in range(200):
        hashes = token_block_hashes([*range(256), *range(10_000 + 1000 * k, 10_000 + 1000 * k + 744)], 256)
        snap = make_snapshot(*(inst(i, waiting=counts[i]) for i in "abcd"))
        decision = s.schedule(snap, make_request(f"r{k}", prompt_tokens=1000, prefix_hashes=hashes), NOW)
        assert decision.prefill is not None
        s.record(decision, NOW)
        counts[decision.prefill.instance_id] += 1
    assert min(counts.values()) >= 20, counts
