"""binpack on colocated instances: best fit by the KV over life, and (d)'s saving of a deadline-paced resident."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet.snapshot import ClusterSnapshot
from router.core.columns import ResidentLegs, StaticResidents
from router.core.errors import ConfigError
from router.core.packing import atgt_slack_ms
from router.core.policies import policy_from_dict
from tests.router.core.helpers import NOW, inst, make_request, make_scheduler, make_snapshot

PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Targets loose enough that every instance below meets TTFT, TPOT, (b) and (d): only best fit decides.
LOOSE_TTFT_MS, LOOSE_TPOT_MS = 600_000.0, 2_000.0


def _two_instances() -> ClusterSnapshot:
    # "queued" decodes one short request and holds a 6,000-token prompt waiting for its prefill;
    # "decoding" decodes four requests of 750 tokens and has nothing queued.
    return make_snapshot(
        inst(
            "queued", "neutral", decode_requests=1, decode_tokens=500, used_kv_tokens=500, prefill_tokens=6000
        ),
        inst("decoding", "neutral", decode_requests=4, decode_tokens=3000, used_kv_tokens=3000),
    )


def test_neutral_best_fit_counts_the_kv_of_prompts_still_waiting_for_prefill() -> None:
    """The decode context sees "decoding" as the fuller bin; the KV over life sees the prompt queued on
    "queued" too, and best fit fills that one, leaving the other's room whole."""
    scheduler = make_scheduler("binpack", ttft_slo_ms=LOOSE_TTFT_MS, tpot_slo_ms=LOOSE_TPOT_MS)
    snapshot = _two_instances()
    request = make_request("new", 300, max_tokens=64)
    ctx = scheduler.context(scheduler.view(snapshot, NOW), request)
    index = ctx.view.instances.index
    q, d = index["queued"], index["decoding"]
    decode_context = ctx.metric("capacity_norm")
    over_life = ctx.metric("capacity_norm_life")
    assert decode_context[d] > decode_context[q]
    assert over_life[q] > over_life[d]

    decision = scheduler.schedule(snapshot, request, NOW, dry_run=True)
    assert decision.prefill is not None and decision.prefill.instance_id == "queued"

    # The selector's default load (capacity_norm, as adaptive PD and binpack's decode stage use it)
    # picks the other one.
    config = scheduler.config
    stage = {"filters": ["schedulability", "staleness", "failover"], "selector": "binpack"}
    policy = policy_from_dict({"prefill": stage, "decode": stage, "neutral": stage}, config, "test")
    by_decode_context = scheduler.schedule(snapshot, request, NOW, dry_run=True, policy=policy)
    assert by_decode_context.prefill is not None and by_decode_context.prefill.instance_id == "decoding"


def test_the_binpack_selector_names_an_unknown_load_metric() -> None:
    config = make_scheduler("binpack").config
    stage = {"filters": ["failover"], "selector": {"name": "binpack", "load": "no_such_metric"}}
    with pytest.raises(ConfigError, match="'load': unknown metric 'no_such_metric'"):
        policy_from_dict({"prefill": stage, "decode": stage, "neutral": stage}, config, "test")


@PROPS
@given(
    context=st.integers(100, 6000),
    generated=st.integers(0, 400),
    remaining=st.integers(1, 600),
    need=st.floats(5.0, 49.0),
    prompt=st.integers(16, 6000),
)
def test_a_deadline_paced_resident_saves_at_the_step_b_holds_it_to(
    context: int, generated: int, remaining: int, need: float, prompt: int
) -> None:
    """(d) prices a deadline-paced resident's future at the γ-horizon step: its slack is what it saved
    so far at the current step plus its expected remainder times (pace − horizon step), the pace
    being its recorded need × θ. Where (b) admits the request (horizon within the pace), the future
    part never takes from the saved part."""
    scheduler = make_scheduler("binpack", tpot_slo_ms=50.0, ttft_slo_ms=60_000.0)
    snapshot = make_snapshot(
        inst("n", "neutral", decode_requests=1, decode_tokens=context, used_kv_tokens=context),
    )
    view = scheduler.view(snapshot, NOW)
    legs = ResidentLegs(
        np.zeros(1, dtype=np.intp),
        np.array([float(context)]),
        np.array([float(remaining)]),
        np.ones(1, dtype=bool),
        np.array([float(generated)]),
        np.array([need]),
    )
    view = dataclasses.replace(view, residents=StaticResidents(legs), load_memo={})
    ctx = scheduler.context(view, make_request("new", prompt, max_tokens=64))
    theta = scheduler.config.binpack_theta
    pace = need * theta
    horizon = float(ctx.metric("predicted_tpot_horizon")[0])
    step_now = float(ctx.metric("decode_step_ms")[0])
    saved = generated * (pace - step_now)
    slack = float(atgt_slack_ms(ctx, 50.0, theta)[0])
    expected = saved + remaining * (pace - horizon)
    if expected > 0:
        assert slack == pytest.approx(expected, rel=1e-9, abs=1e-9)
        if horizon <= pace:
            assert slack >= saved - 1e-9
        assert float(ctx.metric("prefill_over_atgt_slack")[0]) > 0
    else:
        # A resident whose slack is gone before this prompt misses whatever comes: it sets no bound.
        assert slack == math.inf
        assert float(ctx.metric("prefill_over_atgt_slack")[0]) == 0.0
