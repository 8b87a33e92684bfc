"""The TPOT thresholds judge the holder of the longest cached prefix at its load over the request's life."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.prefix import token_block_hashes
from fleet.snapshot import ClusterSnapshot
from router.core import chain
from router.core.columns import ResidentLegs, StaticResidents
from router.core.filters import holder_life_tpot_ms, holder_rows, life_share
from router.core.packing import prefill_stall_ms
from router.core.request import ScheduleInput
from router.core.scheduler import Scheduler
from tests.router.core.helpers import NOW, inst, make_request, make_scheduler, make_snapshot

HASHES = token_block_hashes(list(range(1000)), 256)


@settings(max_examples=200, deadline=None)
@given(
    r=st.floats(min_value=1.0, max_value=1e5),
    o=st.floats(min_value=1e-3, max_value=1e5),
    k=st.floats(min_value=1.0, max_value=100.0),
)
def test_life_share_is_a_share_that_falls_with_the_horizon(r: float, o: float, k: float) -> None:
    share = life_share(r, o)
    assert 0.0 < share <= 1.0
    assert life_share(r, o * k) <= share + 1e-12  # a longer life sees fewer of today's residents
    assert share >= min(1.0, r / o) * (1.0 - math.exp(-1.0)) - 1e-12


def test_life_share_limits() -> None:
    assert life_share(100.0, 1e-6) == pytest.approx(1.0)
    assert life_share(10.0, 10_000.0) == pytest.approx(10.0 / 10_000.0)
    assert life_share(50.0, 50.0) == pytest.approx(1.0 - math.exp(-1.0))


def _scheduler(tpot_slo_ms: float = 10_000.0) -> Scheduler:
    s = make_scheduler(
        "slo",
        calibration="off",
        prefix_cache_routing="approximate",
        prefix_block_tokens=256,
        tpot_slo_ms=tpot_slo_ms,
        ttft_slo_ms=60_000.0,
    )
    return s


def _snapshot(heavy: str = "a") -> ClusterSnapshot:
    # One instance decodes 40 requests, the three others 4 each: the fleet's mean batch is 13.
    return make_snapshot(
        *(
            inst(i, decode_requests=40 if i == heavy else 4, decode_tokens=40_000 if i == heavy else 4_000)
            for i in ("a", "b", "c", "d")
        )
    )


def _request() -> ScheduleInput:
    return make_request(prompt_tokens=1000, prefix_hashes=HASHES, max_tokens=512)


def _life_and_plain(holder: str) -> tuple[float, float, float]:
    """(max of the holder's two life values, its plain predicted TPOT, its plain residents' TPOT)."""
    s = _scheduler()
    assert s.prefix is not None
    s.prefix.dispatched(holder, HASHES, 100_000)
    ctx = s.schedule(_snapshot(), _request(), NOW, dry_run=True).context
    i = ctx.view.instances.index[holder]
    assert holder_rows(ctx) == [i]
    life = max(holder_life_tpot_ms(ctx, i, residents=False), holder_life_tpot_ms(ctx, i, residents=True))
    return life, ctx.metric("predicted_tpot").item(i), ctx.metric("predicted_tpot_residents").item(i)


@pytest.mark.parametrize("fused", [True, False])
def test_a_busy_holder_within_its_target_over_the_requests_life_keeps_the_prompt(
    fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The busy holder ``a`` predicts a TPOT over the target at today's batch of 40, but under it at
    the batch it converges to (the fleet's mean of 13) as its residents finish: the TPOT thresholds
    keep it and the prompt goes where it is cached. Without the rule the plain threshold drops it
    and an idle instance computes the whole prompt. The fused stage and the composed chain agree."""
    monkeypatch.setattr(chain, "FUSED", fused)
    life, plain, plain_residents = _life_and_plain("a")
    assert life < plain <= plain_residents
    target = (life + plain) / 2.0
    s = _scheduler(target)
    assert s.prefix is not None
    s.prefix.dispatched("a", HASHES, 100_000)
    decision = s.schedule(_snapshot(), _request(), NOW)
    assert decision.prefill is not None and decision.prefill.instance_id == "a"
    ctx = decision.context
    assert ctx.metric("predicted_tpot").item(0) >= target  # the plain threshold alone would drop it


def test_the_rule_keeps_only_the_holder_and_only_with_prefix_knowledge() -> None:
    life, plain, _ = _life_and_plain("a")
    target = (life + plain) / 2.0
    # The same busy instance without the prefix: dropped, another one takes the prompt.
    s = _scheduler(target)
    assert s.prefix is not None
    s.prefix.dispatched("b", HASHES, 100_000)  # an idle instance holds it
    decision = s.schedule(_snapshot("a"), _request(), NOW)
    assert decision.prefill is not None and decision.prefill.instance_id == "b"
    # Prefix routing off: today's thresholds, the busy instance dropped.
    off = make_scheduler(
        "slo", calibration="off", prefix_cache_routing="off", tpot_slo_ms=target, ttft_slo_ms=60_000.0
    )
    decision = off.schedule(_snapshot(), _request(), NOW)
    assert decision.prefill is not None and decision.prefill.instance_id != "a"


@settings(max_examples=60, deadline=None)
@given(
    batches=st.lists(st.integers(min_value=0, max_value=64), min_size=2, max_size=6),
    context=st.integers(min_value=100, max_value=4000),
    holder=st.integers(min_value=0, max_value=5),
    max_tokens=st.integers(min_value=1, max_value=4096),
)
def test_the_life_values_never_exceed_the_thresholds_own(
    batches: list[int], context: int, holder: int, max_tokens: int
) -> None:
    """The rule only ever keeps an instance the plain threshold drops: never the other way."""
    ids = [f"i{k}" for k in range(len(batches))]
    snap = make_snapshot(
        *(inst(i, decode_requests=b, decode_tokens=b * context) for i, b in zip(ids, batches, strict=True))
    )
    s = _scheduler()
    assert s.prefix is not None
    s.prefix.dispatched(ids[holder % len(ids)], HASHES, 100_000)
    request = make_request(prompt_tokens=1000, prefix_hashes=HASHES, max_tokens=max_tokens)
    ctx = s.schedule(snap, request, NOW, dry_run=True).context
    for i in range(len(ids)):
        for residents, metric in ((False, "predicted_tpot"), (True, "predicted_tpot_residents")):
            assert holder_life_tpot_ms(ctx, i, residents=residents) <= ctx.metric(metric).item(i)


def test_the_residents_stall_is_spread_over_their_whole_output_hand_computed() -> None:
    """Two residents on the holder, each 300 tokens into a 400-token answer: the prefill that this
    prompt and the queued backlog put between their steps adds stall / 400 to the TPOT each measures
    over its whole output, not stall / (their remaining output). The two instances decode as many
    requests (the fleet's mean batch), so the decode step is today's."""
    s = _scheduler()
    assert s.prefix is not None
    s.prefix.dispatched("a", HASHES, 100_000)
    snap = make_snapshot(
        inst("a", decode_requests=2, decode_tokens=2_000, prefill_tokens=4_000),
        inst("b", decode_requests=2, decode_tokens=2_000),
    )
    view = s.view(snap, NOW)
    a = view.instances.index["a"]
    legs = ResidentLegs(
        np.full(2, a, dtype=np.intp),
        np.array([1300.0, 1300.0]),
        np.array([100.0, 100.0]),
        np.ones(2, dtype=bool),
    )
    view = dataclasses.replace(
        view, residents=StaticResidents(legs._replace(generated=np.array([300.0, 300.0])))
    )
    ctx = s.context(view, _request(), NOW)
    step = ctx.metric("predicted_tpot").item(a)
    stall = prefill_stall_ms(ctx).item(a)
    assert stall > 0.0
    life = holder_life_tpot_ms(ctx, a, residents=True)
    assert life == pytest.approx(step + stall / 400.0)
    assert life < ctx.metric("predicted_tpot_residents").item(a)
    # Without their progress the stall is spread over their remaining output, as the metric does.
    plain = s.context(s.view(snap, NOW), _request(), NOW)
    assert holder_life_tpot_ms(plain, a, residents=True) == pytest.approx(
        plain.metric("predicted_tpot_residents").item(a)
    )
