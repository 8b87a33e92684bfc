"""``slo`` keeps its KV promise: no placement past the exact KV peak over the residents' life, in any pass.

Before, its KV over life was droppable: with no instance able to hold a request's life the fallback
pass placed it anyway and the engine preempted. Now the exact peak (``kv_peak_exact``) holds in every
pass and the sums' bound (``kv_peak_projected``) is only the first pass's preference.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet.snapshot import ClusterSnapshot
from router.core import fused
from router.core.errors import NoInstanceError
from router.core.queue import QueueConfig, RouterQueue, Verdict, offer
from router.core.request import Stage
from router.core.scheduler import Scheduler
from tests.router.core.helpers import NOW, inst, make_request, make_scheduler, make_snapshot
from tests.router.core.test_packing import CAPACITY, holding

PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: (prompt, expected output, generated so far) of each resident request.
Residents = list[tuple[int, int, int]]


def _fleet(
    loaded: dict[str, Residents], role: str = "neutral", idle: tuple[str, ...] = ()
) -> tuple[ClusterSnapshot, Scheduler]:
    """Instances of ``role`` holding ``loaded`` residents (their decoding under way), plus ``idle`` ones,
    behind one prefill instance when ``role`` is decode; targets loose enough that only KV decides."""
    scheduler = make_scheduler("slo", tpot_slo_ms=1000.0, ttft_slo_ms=60_000.0)
    prefill = "p" if role == "decode" else None
    records = [inst("p", "prefill", meta={"kv_capacity_tokens": CAPACITY})] if prefill else []
    for name, residents in loaded.items():
        ids = [f"{name}-old{k}" for k in range(len(residents))]
        records.append(holding(scheduler, name, role, residents, ids, prefill))
    records += [inst(name, role, meta={"kv_capacity_tokens": CAPACITY}) for name in idle]
    snapshot = make_snapshot(*records)
    scheduler.inflight.reconcile(snapshot)
    for name, residents in loaded.items():
        for k, (prompt, _, generated) in enumerate(residents):
            scheduler.inflight.advance(f"{name}-old{k}", prompt + generated)
    return snapshot, scheduler


# Eight requests of 1000 prompt tokens, each 100 tokens into a 1000-token answer: 8800 tokens now,
# 16,000 at the end. A 2100 + 1000 request fits now (11,900) but not over their life: every resident
# still decodes as long as it does, so the exact peak is 19,100 > 0.95 x 20,000.
FULL: Residents = [(1000, 1000, 100)] * 8
BIG = {"prompt_tokens": 2100, "max_tokens": 1000}


@pytest.mark.parametrize("role", ["neutral", "decode"])
def test_a_request_no_instance_can_hold_over_life_gets_no_placement(role: str) -> None:
    snapshot, scheduler = _fleet({"a": FULL, "b": FULL}, role)
    request = make_request("big", **BIG)
    ctx = scheduler.context(scheduler.view(snapshot, NOW), request)
    assert (ctx.metric("kv_peak_exact")[ctx.view.instances.index["a"]]) > 0.95
    # (The old policy placed it in its fallback pass, on "a" or "b", and the engine preempted.)
    with pytest.raises(NoInstanceError) as refused:
        scheduler.schedule(snapshot, request, NOW, dry_run=True)
    assert refused.value.stage == role
    assert refused.value.drops["kv_over_life"] == 2
    # What fits over their life is still placed.
    small = scheduler.schedule(snapshot, make_request("small", 200, max_tokens=100), NOW, dry_run=True)
    assert small.decode is not None and small.decode.instance_id in {"a", "b"}


def test_the_router_queue_holds_the_request_until_the_kv_frees() -> None:
    snapshot, scheduler = _fleet({"a": FULL})
    queue = RouterQueue(QueueConfig(queue_policy="edf"), 60_000.0, 1000.0)
    queue.push(make_request("big", arrival_s=NOW, **BIG), NOW)
    (waited,) = offer(queue, scheduler, lambda: snapshot, NOW)
    assert waited.verdict is Verdict.WAIT and "big" in queue
    # Half the residents end: 4 x 2000 + 3100 = 11,100 over life, and the request goes.
    for k in range(4):
        scheduler.inflight.release(f"a-old{k}")
    lighter, _ = _fleet({"a": FULL[:4]})
    (went,) = offer(queue, scheduler, lambda: lighter, NOW + 1)
    assert went.verdict is Verdict.DISPATCH and went.decision is not None
    assert went.decision.decode is not None and went.decision.decode.instance_id == "a"


def test_the_exact_peak_admits_what_the_sums_refuse_and_the_sums_are_preferred() -> None:
    # Four residents nearly done and four barely started: 15,900 at the exact peak with the new
    # 2500 + 800 request, but over 0.95 of the KV were every resident at its final length at once.
    mixed: Residents = [(1000, 1000, 950)] * 4 + [(1000, 1000, 100)] * 4
    request = make_request("new", 2500, max_tokens=800)
    snapshot, scheduler = _fleet({"a": mixed})
    ctx = scheduler.context(scheduler.view(snapshot, NOW), request)
    a = ctx.view.instances.index["a"]
    assert ctx.metric("kv_peak_projected")[a] > 0.95 > ctx.metric("kv_peak_exact")[a]
    decision = scheduler.schedule(snapshot, request, NOW, dry_run=True)
    assert decision.decode is not None and decision.decode.instance_id == "a"
    assert decision.decode.fallback_pass == 1
    # An instance also within the sums' bound is preferred, in the first pass.
    snapshot, scheduler = _fleet({"a": mixed, "b": [(1000, 1000, 100)] * 2})
    decision = scheduler.schedule(snapshot, request, NOW, dry_run=True)
    assert decision.decode is not None and decision.decode.instance_id == "b"
    assert decision.decode.fallback_pass == 0


def test_a_request_over_the_headroom_goes_alone_to_an_empty_instance_and_waits_while_none_is() -> None:
    # 19,000 tokens over their life: over 0.95 of any instance's KV. An instance holding nothing takes
    # it alone (as binpack opens an empty bin); while every instance holds work, none does, naming the KV.
    alone = make_request("alone", 16_000, max_tokens=3000)
    snapshot, scheduler = _fleet({"a": [(500, 200, 10)]}, idle=("e",))
    decision = scheduler.schedule(snapshot, alone, NOW, dry_run=True)
    assert decision.decode is not None and decision.decode.instance_id == "e"
    snapshot, scheduler = _fleet({"a": [(500, 200, 10)], "b": [(300, 100, 5)]})
    with pytest.raises(NoInstanceError, match="kv_over_life 2"):
        scheduler.schedule(snapshot, alone, NOW, dry_run=True)
    # Within it, a loaded instance with the room takes it as before.
    decision = scheduler.schedule(snapshot, make_request("fits", 12_000, max_tokens=3000), NOW, dry_run=True)
    assert decision.decode is not None and decision.decode.instance_id in ("a", "b")


def test_the_fused_first_pass_still_decides_slo() -> None:
    spec = make_scheduler("slo").policy
    assert fused._fusable(spec.spec(Stage.DECODE)) is not None
    assert fused._fusable(spec.spec(Stage.NEUTRAL)) is not None


@PROPS
@given(
    st.lists(
        st.tuples(st.integers(1, 3000), st.integers(2, 1500), st.integers(0, 1499)).map(
            lambda t: (t[0], t[1], min(t[2], t[1] - 1))
        ),
        max_size=10,
    ),
    st.integers(1, 6000),
    st.integers(2, 1500),
    st.sampled_from(["neutral", "decode"]),
)
def test_no_placement_passes_the_kv_peak_over_life(
    residents: Residents, prompt: int, out: int, role: str
) -> None:
    snapshot, scheduler = _fleet({"a": residents}, role)
    request = make_request("new", prompt, max_tokens=out)
    ctx = scheduler.context(scheduler.view(snapshot, NOW), request)
    a = ctx.view.instances.index["a"]
    fits = bool(ctx.metric("kv_peak_exact")[a] < scheduler.config.kv_packing_headroom) or not residents
    try:
        decision = scheduler.schedule(snapshot, request, NOW, dry_run=True)
    except NoInstanceError as exc:
        assert not fits or exc.drops.get("kv_over_life", 0) == 0
        return
    assert decision.decode is not None and decision.decode.instance_id == "a"
    assert fits
