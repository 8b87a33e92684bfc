"""Selectors: lexicographic order, explicit tie-breaks, top-k, baselines."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from router.core.config import SchedulerConfig
from router.core.errors import ConfigError
from router.core.plugins import DecisionContext
from router.core.registry import SELECTORS, Params
from router.core.selectors import RoundRobin
from tests.router.core.helpers import NOW, inst, make_request, make_scheduler, make_snapshot


def context(snap, seed: int = 0) -> DecisionContext:  # type: ignore[no-untyped-def]
    s = make_scheduler("slo", seed=seed)
    return s.context(s.view(snap, NOW), make_request())


def select(name: str, ctx: DecisionContext, survivors=None, fallback_pass: int = 0, **params) -> str:  # type: ignore[no-untyped-def]
    selector = SELECTORS.create(name, SchedulerConfig(), Params(name, params))
    idx = np.arange(ctx.view.n) if survivors is None else np.asarray(survivors)
    chosen = selector.select(ctx, idx, fallback_pass)
    assert chosen in idx
    return ctx.view.instances.ids[chosen]


FLEET = make_snapshot(
    inst("a", waiting=2, running=1),
    inst("b", waiting=1, running=5),
    inst("c", waiting=1, running=2),
    inst("d", waiting=3, running=0),
)


def test_lowest_compares_metrics_in_order() -> None:
    ctx = context(FLEET)
    assert select("lowest", ctx, metrics=["num_waiting_requests", "num_requests"]) == "c"
    assert select("lowest", ctx, metrics=["num_requests"]) in {"a", "c", "d"}  # tied at 3: the RNG decides
    assert select("lowest", ctx, metrics=["-num_waiting_requests"]) == "d"
    assert select("lowest", ctx, survivors=[0, 1], metrics=["num_waiting_requests"]) == "b"


def test_ties_are_broken_by_the_injected_rng_and_reproducibly() -> None:
    picks = Counter(select("lowest", context(FLEET, seed), metrics=["num_requests"]) for seed in range(60))
    assert set(picks) == {"a", "c", "d"}  # all three tied at 3 requests
    assert all(
        select("lowest", context(FLEET, seed), metrics=["num_requests"])
        == select("lowest", context(FLEET, seed), metrics=["num_requests"])
        for seed in range(10)
    )


def test_nan_ranks_last() -> None:
    s = make_scheduler("load-balance", predictors=None)
    ctx = s.context(s.view(FLEET, NOW), make_request())
    assert select("lowest", ctx, metrics=["predicted_ttft", "num_waiting_requests"]) in {"b", "c"}


def test_top_k_is_uniform_among_the_k_best() -> None:
    snap = make_snapshot(*(inst(f"i{k}", waiting=k) for k in range(6)))
    counts = Counter(
        select("lowest", context(snap, seed), metrics=["num_waiting_requests"], top_k=3)
        for seed in range(600)
    )
    assert set(counts) == {"i0", "i1", "i2"}
    assert min(counts.values()) > 150


def test_top_k_samples_ties_at_the_boundary() -> None:
    # Scores 0, 1, 1, 1: with K = 2 the best always qualifies and one of the three tied ones joins it.
    snap = make_snapshot(inst("best"), inst("t1", waiting=1), inst("t2", waiting=1), inst("t3", waiting=1))
    counts = Counter(
        select("lowest", context(snap, seed), metrics=["num_waiting_requests"], top_k=2)
        for seed in range(1200)
    )
    assert counts["best"] == pytest.approx(600, abs=90)
    for tied in ("t1", "t2", "t3"):
        assert counts[tied] == pytest.approx(200, abs=70)


def test_top_k_larger_than_the_survivors_is_uniform_over_all() -> None:
    snap = make_snapshot(inst("a"), inst("b", waiting=9))
    counts = Counter(
        select("lowest", context(snap, seed), metrics=["num_waiting_requests"], top_k=8)
        for seed in range(200)
    )
    assert set(counts) == {"a", "b"}


def test_random_is_uniform_and_seeded() -> None:
    counts = Counter(select("random", context(FLEET, seed)) for seed in range(400))
    assert set(counts) == {"a", "b", "c", "d"}
    assert select("random", context(FLEET, 5)) == select("random", context(FLEET, 5))


def test_round_robin_rotates_in_id_order_and_survives_membership_changes() -> None:
    rr = RoundRobin()
    s = make_scheduler("round-robin")
    snap = make_snapshot(inst("c"), inst("a"), inst("b"))
    order = []
    for _ in range(4):
        ctx = s.context(s.view(snap, NOW), make_request())
        order.append(ctx.view.instances.ids[rr.select(ctx, np.arange(3), 0)])
        ctx.commit()
    assert order == ["a", "b", "c", "a"]
    # "b" disappears: after "a" comes "c".
    smaller = make_snapshot(inst("c"), inst("a"))
    ctx = s.context(s.view(smaller, NOW), make_request())
    assert ctx.view.instances.ids[rr.select(ctx, np.arange(2), 0)] == "c"


def test_round_robin_without_commit_does_not_advance() -> None:
    rr = RoundRobin()
    ctx = context(FLEET)
    first = rr.select(ctx, np.arange(4), 0)
    assert rr.select(ctx, np.arange(4), 0) == first
    assert rr.last_id is None


def test_power_of_two_picks_the_less_loaded_of_two_random_survivors() -> None:
    counts = Counter(
        select("power_of_two", context(FLEET, seed), metric="num_waiting_requests") for seed in range(300)
    )
    # d (3 waiting) never beats another instance; b and c (1 waiting) win most draws.
    assert counts["d"] == 0
    assert counts["b"] + counts["c"] > counts["a"]
    assert select("power_of_two", context(FLEET), survivors=[2]) == "c"


def test_unknown_metric_in_a_selector_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown metric 'nope'"):
        SELECTORS.create("lowest", SchedulerConfig(), Params("x", {"metrics": ["nope"]}))
    with pytest.raises(ConfigError, match="top_k"):
        SELECTORS.create("lowest", SchedulerConfig(), Params("x", {"metrics": ["num_requests"], "top_k": 0}))
    with pytest.raises(ConfigError, match="needs 'metrics'"):
        SELECTORS.create("lowest", SchedulerConfig(), Params("x", {}))


def test_dispatch_top_k_is_the_default_k() -> None:
    sel = SELECTORS.create(
        "lowest", SchedulerConfig(dispatch_top_k=3), Params("x", {"metrics": ["num_requests"]})
    )
    assert sel.top_k == 3  # type: ignore[attr-defined]


def test_adaptive_decode_bin_packs_then_converts_then_spreads() -> None:
    snap = make_snapshot(
        inst("light", decode_requests=1, decode_tokens=100),
        inst("heavy", decode_requests=12, decode_tokens=1200),
        inst("idle-busy-prefill", prefill_tokens=4000),
        inst("idle", prefill_tokens=100),
    )
    ctx = context(snap)
    # Normal pass: the highest predicted TPOT (bin-packing).
    assert select("adaptive_decode", ctx) == "heavy"
    # Fallback pass: the decode-idle survivor with the lowest predicted TTFT becomes a decoder.
    assert select("adaptive_decode", ctx, fallback_pass=1) == "idle"
    # Fallback without decode-idle survivors: the lowest predicted TPOT.
    assert select("adaptive_decode", ctx, survivors=[0, 1], fallback_pass=1) == "light"


def test_adaptive_decode_ties_go_to_the_reserved_decode() -> None:
    from router.core.plugins import Reserves

    snap = make_snapshot(inst("a"), inst("b"), inst("c"))
    for seed in range(10):
        ctx = context(snap, seed)
        ctx.reserves = Reserves(prefill=0, decode=2)
        assert select("adaptive_decode", ctx) == "c"
        assert select("adaptive_decode", ctx, fallback_pass=1) == "c"
        assert select("lowest", ctx, metrics=["predicted_ttft", "-reserved_prefill"]) == "a"


def test_rng_is_the_only_randomness() -> None:
    # Same seed, same sequence of tie-breaks across many decisions.
    def run(seed: int) -> list[str]:
        ctx = context(FLEET, seed)
        return [select("lowest", ctx, metrics=["num_requests"]) for _ in range(20)]

    assert run(1) == run(1)
    assert random.Random(1).random() == random.Random(1).random()
