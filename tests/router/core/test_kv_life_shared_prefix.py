"""The exact KV peak counts a prompt's cached blocks once, however many resident legs share them.

A prefix-caching engine (vLLM's automatic prefix caching, the sim engine) keeps one copy of a block
that several running requests reference, and its status reports used KV that way. The router's KV
peak over the residents' life (``kv_life_tokens``, ``kv_peak_exact``) used to count every started
leg's whole context, so an instance whose residents share a system prompt looked full long before
it was.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.core.columns import ResidentLegs, StaticResidents
from router.core.inflight import InflightAccount
from router.core.registry import METRICS
from tests.router.core.helpers import NOW, inst, make_request, make_scheduler, make_snapshot

SHARED = 3072  # the system prompt every resident found cached where it was placed
OWN = 328  # each resident's own turn
REMAINING = (100.0, 200.0, 300.0)


def _peak_step_by_step(shared: float, own: list[float], remaining: list[float]) -> float:
    """The engine's KV k steps ahead: the shared blocks while any leg lives, each live leg's own part."""
    horizon = int(max(remaining, default=0))
    best = 0.0
    for k in range(horizon + 1):
        alive = [o + k for o, r in zip(own, remaining, strict=True) if r >= k]
        best = max(best, (shared if alive else 0.0) + sum(alive))
    return best


def _kv_life(legs: ResidentLegs, used_kv: int, kv_capacity: int = 65_536) -> tuple[float, float]:
    """``kv_life_tokens`` of instance ``n`` (the column and the one-instance form) over ``legs``."""
    snapshot = make_snapshot(
        inst(
            "n",
            decode_requests=len(legs.instance),
            decode_tokens=int(legs.context.sum()),
            used_kv_tokens=used_kv,
            meta={"kv_capacity_tokens": kv_capacity},
        )
    )
    scheduler = make_scheduler("slo")
    view = dataclasses.replace(scheduler.view(snapshot, NOW), residents=StaticResidents(legs), load_memo={})
    ctx = scheduler.context(view, None)
    metric = METRICS.create("kv_life_tokens", scheduler.config)
    column = float(metric.compute(ctx)[0])
    at = getattr(metric, "at")  # noqa: B009 (what DecisionContext looks up)
    return column, float(at(ctx, 0))


def _three_sharing(cached: float, started: bool = True) -> ResidentLegs:
    return ResidentLegs(
        np.zeros(3, dtype=np.intp),
        np.full(3, float(SHARED + OWN)),
        np.array(REMAINING),
        np.full(3, started),
        cached=np.full(3, cached),
    )


def test_residents_sharing_a_cached_prompt_count_it_once() -> None:
    used = SHARED + 3 * OWN  # what the engine reports: the shared blocks once
    column, one = _kv_life(_three_sharing(SHARED), used)
    # By hand: the shared 3,072 stay; the legs' own 328 each peak at the last finish (k = 100, all alive).
    assert column == one == pytest.approx(SHARED + 3 * (OWN + 100))
    assert column == pytest.approx(_peak_step_by_step(SHARED, [OWN] * 3, list(REMAINING)))
    # Without the cached count each leg holds the prompt on its own: three times over.
    blind, _ = _kv_life(_three_sharing(0.0), used)
    assert blind == pytest.approx(3 * (SHARED + OWN) + 3 * 100)


def test_a_leg_not_started_yet_counts_whole_at_its_final_length() -> None:
    # Its blocks may not be allocated yet: it is taken at its final length, cached part included.
    column, one = _kv_life(_three_sharing(SHARED, started=False), used_kv=0)
    assert column == one == pytest.approx(sum(SHARED + OWN + r for r in REMAINING))


def test_a_placement_next_to_residents_sharing_its_prefix_fits_where_the_blind_count_refused() -> None:
    scheduler = make_scheduler("slo")
    capacity = 12_000
    snapshot = make_snapshot(
        inst(
            "n",
            decode_requests=3,
            decode_tokens=3 * (SHARED + OWN),
            used_kv_tokens=SHARED + 3 * OWN,
            meta={"kv_capacity_tokens": capacity},
        )
    )
    request = make_request(prompt_tokens=SHARED + OWN, max_tokens=64)

    def peak(cached: float) -> float:
        view = dataclasses.replace(
            scheduler.view(snapshot, NOW), residents=StaticResidents(_three_sharing(cached)), load_memo={}
        )
        return float(scheduler.context(view, request).metric("kv_peak_exact")[0])

    # The new prompt is charged whole (its blocks may be only in the evictable cache): 4,356 + 3,400 + out.
    assert peak(SHARED) < 1.0 < peak(0.0)


def test_the_account_keeps_a_colocated_legs_cached_prompt_tokens() -> None:
    account = InflightAccount()
    account.record(
        "a", "n", "n", SHARED + OWN, NOW, final_tokens=SHARED + OWN + 100, cached_prefill_tokens=SHARED
    )
    # A PD leg's KV comes from its prefill instance: nothing of it is known cached where it decodes.
    account.record(
        "b", "p", "d", SHARED + OWN, NOW, final_tokens=SHARED + OWN + 100, cached_prefill_tokens=SHARED
    )
    # More cached than the prompt is clamped to the prompt.
    account.record("c", "n", "n", 500, NOW, final_tokens=600, cached_prefill_tokens=9_999)
    legs = account.resident_legs({"n": 0, "p": 1, "d": 2}, 3)
    assert legs is not None and legs.cached is not None
    by_instance = sorted(zip(legs.instance.tolist(), legs.cached.tolist(), strict=True))
    assert by_instance == [(0, 500.0), (0, float(SHARED)), (2, 0.0)]
    assert sorted(k for *_, k in account.resident_legs_on("n") or []) == [500, SHARED]
    account.release("a")
    assert [k for *_, k in account.resident_legs_on("n") or []] == [500]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.integers(0, 400), st.integers(0, 300)), min_size=1, max_size=8),
    st.integers(0, 4096),
)
def test_the_peak_is_never_below_the_engines_true_peak(
    own_remaining: list[tuple[int, int]], shared: int
) -> None:
    # Every leg found the same ``shared`` tokens cached and references them; the engine holds them once.
    own = [float(o) for o, _ in own_remaining]
    remaining = [float(r) for _, r in own_remaining]
    legs = ResidentLegs(
        np.zeros(len(own), dtype=np.intp),
        np.array([shared + o for o in own]),
        np.array(remaining),
        np.ones(len(own), dtype=bool),
        cached=np.full(len(own), float(shared)),
    )
    column, one = _kv_life(legs, used_kv=int(shared + sum(own)))
    assert column == pytest.approx(one)
    assert column >= _peak_step_by_step(shared, own, remaining) - 1e-6
    # ... and no more than the count that ignored the sharing.
    blind = ResidentLegs(*legs[:4])
    assert column <= _kv_life(blind, used_kv=int(shared + sum(own)))[0] + 1e-6
