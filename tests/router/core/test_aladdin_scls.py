"""The steps of seeds 001 (Aladdin: binpack, plan) and 002 (SCLS: slice dispatch), one test (or property) each."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.core.errors import NoInstanceError
from router.core.slicing import (
    MemoryFit,
    MemoryModel,
    ServingFit,
    ServingTimeModel,
    SliceConfig,
    SliceRequest,
    SliceScheduler,
    slice_length,
)
from router.core.worker_count import Heartbeat, WorkerCountModel, samples_from_spans
from tests.router.core.helpers import NOW, inst, make_predictor, make_request, make_scheduler, make_snapshot

PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ----------------------------------------------------------------------------- Aladdin (001)


@PROPS
@given(
    loads=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 60_000)), min_size=1, max_size=5),
    prompt=st.integers(16, 4000),
    out=st.integers(8, 2000),
)
def test_binpack_never_places_past_kv_over_life_on_a_loaded_instance(
    loads: list[tuple[int, int]], prompt: int, out: int
) -> None:
    """Constraint (e) holds as a constraint: a loaded instance whose KV over life would pass the
    headroom never gets the request; only an empty one (a new bin) may take what fits nowhere."""
    capacity = 65536
    records = [inst("p", "prefill")]
    for k, (batch, tokens) in enumerate(loads):
        tokens = tokens if batch else 0
        records.append(
            inst(f"d{k}", "decode", decode_requests=batch, decode_tokens=tokens, used_kv_tokens=tokens)
        )
    scheduler = make_scheduler("binpack")
    request = make_request("r", prompt, max_tokens=out)
    snapshot = make_snapshot(*records)
    try:
        decision = scheduler.schedule(snapshot, request, NOW, dry_run=True)
    except NoInstanceError as refused:
        assert refused.stage in ("decode", "prefill")
        return
    assert decision.decode is not None
    chosen = int(decision.decode.instance_id[1:])
    batch, tokens = loads[chosen]
    if batch:
        # Every resident at its final length (the sums' bound) plus this request stays in the headroom.
        assert tokens + prompt + out <= 0.95 * capacity + batch * 256 + tokens


def test_binpack_waits_instead_of_overpacking_when_every_bin_is_full() -> None:
    """(b)/(e) refuse every loaded decoder: the request gets no placement (it waits in the router
    queue); with an empty decoder it opens that bin instead."""
    full = [
        inst(f"d{k}", "decode", decode_requests=60, decode_tokens=60_000, used_kv_tokens=60_000)
        for k in range(2)
    ]
    scheduler = make_scheduler("binpack")
    request = make_request("r", 1000, max_tokens=500)
    with pytest.raises(NoInstanceError) as refused:
        scheduler.schedule(make_snapshot(inst("p", "prefill"), *full), request, NOW, dry_run=True)
    assert refused.value.stage == "decode"
    opened = scheduler.schedule(
        make_snapshot(inst("p", "prefill"), *full, inst("fresh", "decode")), request, NOW, dry_run=True
    )
    assert opened.decode is not None and opened.decode.instance_id == "fresh"


def test_worker_count_model_fits_eq7_and_leaves_out_unrepresentative_heartbeats() -> None:
    model = WorkerCountModel(max_relative_sem=0.1, min_samples=3)
    for rate in (4.0, 6.0, 8.0, 10.0, 12.0):
        assert model.observe(Heartbeat(rate, 0.5 * rate + 1.0, requests=400, length_cv=1.0))
    # 4 requests with a cv of 1: SEM is half the mean, left out.
    assert not model.observe(Heartbeat(1.0, 9.0, requests=4, length_cv=1.0))
    k5, c5 = model.coefficients() or (math.nan, math.nan)
    assert k5 == pytest.approx(0.5) and c5 == pytest.approx(1.0)
    assert model.predict(20.0) == 11
    assert model.predict(3.0) is None  # below R, the lowest representative rate seen


def test_heartbeats_count_the_instances_holding_work() -> None:
    arrivals = [0.5 * k for k in range(40)]  # 2 req/s over 20 s
    spans = [("a", t, t + 0.4) for t in arrivals[:20]] + [("b", t, t + 0.4) for t in arrivals[20:]]
    beats = samples_from_spans(arrivals, [100.0] * 40, spans, heartbeat_s=5.0)
    assert [round(b.rate, 3) for b in beats] == [2.0, 2.0, 2.0]
    assert all(0 < b.workers <= 1.0 for b in beats)


# ----------------------------------------------------------------------------- SCLS (002)


def _models(kv: int = 20_000, speed: float = 1.0) -> tuple[ServingTimeModel, MemoryModel]:
    serving = ServingTimeModel(make_predictor(scale=speed), max_num_batched_tokens=512)
    return serving, MemoryModel(kv_capacity_tokens=kv)


@PROPS
@given(
    contexts=st.lists(st.integers(10, 3000), min_size=1, max_size=25),
    order=st.permutations(["a", "b", "c", "d"]),
)
def test_offloading_does_not_depend_on_the_order_the_fleet_is_listed_in(
    contexts: list[int], order: list[str]
) -> None:
    from router.core.slicing import InstanceModels

    def run(ids: list[str]) -> list[tuple[tuple[int, ...], str]]:
        slow, fast = _models(speed=1.0), _models(kv=40_000, speed=0.5)
        sched = SliceScheduler(SliceConfig(), slow[0], slow[1], ids)
        sched.set_models({i: InstanceModels(*(slow if i in ("a", "b") else fast)) for i in ids})
        for k, c in enumerate(contexts):
            sched.add(SliceRequest(k, c, 128))
        return sorted((tuple(int(r.key) for r in b.requests), i) for b, i in sched.schedule())  # type: ignore[call-overload]

    assert run(list(order)) == run(["a", "b", "c", "d"])


def test_a_resumed_slice_is_placed_at_once_even_on_a_full_instance() -> None:
    serving, memory = _models(kv=4000)
    sched = SliceScheduler(SliceConfig(), serving, memory, ["x", "y"])
    for k in range(6):
        sched.add(SliceRequest(k, 500, 128))
    sched.schedule()
    running = {i: sched.admit(i, 0.0) for i in ("x", "y")}
    instance, (key, batch) = next((i, b[0]) for i, b in running.items() if b)
    first = batch.requests[0]
    target, new_key, placed = sched.resume(instance, key, first, SliceRequest(first.key, 628, 128), now=100.0)
    assert placed.requests[0].context_tokens == 628
    assert new_key in sched._running[target]  # admitted, not queued behind anything


def test_serving_fit_learns_the_instance_scale_and_memory_fit_shrinks_on_preemption() -> None:
    fit = ServingFit()
    for _ in range(200):
        fit.observe(busy_ms=300.0, estimated_ms=200.0)
    assert fit.scale == pytest.approx(1.5, rel=1e-6)
    mem = MemoryFit()
    mem.preempted()
    assert mem.zeta == pytest.approx(0.8)
    for _ in range(100):
        mem.clean_batch()
    assert mem.zeta == 1.0


@PROPS
@given(context=st.integers(1, 30_000), remaining=st.integers(1, 5000))
def test_slice_length_bounds(context: int, remaining: int) -> None:
    serving, _ = _models()
    config = SliceConfig(slice_tokens=64)
    length = slice_length(context, remaining, serving, config)
    assert 1 <= length <= remaining
    assert length == remaining or 64 <= length <= 8 * 64
    # Longer contexts never get shorter slices.
    assert slice_length(context * 2, remaining, serving, config) >= length
    fixed = SliceConfig(slice_tokens=64, recompute_share=None)
    assert slice_length(context, remaining, serving, fixed) == min(64, remaining)


@PROPS
@given(context=st.integers(1, 30_000), remaining=st.integers(1, 5000), generated=st.integers(0, 5000))
def test_a_resumed_slice_grows_with_the_answer_so_far(context: int, remaining: int, generated: int) -> None:
    # Slice length (paper §5.5: batch size against reschedules): an answer that has run long gets a
    # slice at least as long as what it has produced, up to 8 S, so it crosses O(log) boundaries.
    serving, _ = _models()
    config = SliceConfig(slice_tokens=64)
    length = slice_length(context, remaining, serving, config, generated)
    assert 1 <= length <= remaining
    assert length == remaining or 64 <= length <= 8 * 64
    assert length >= min(generated, 8 * 64, remaining)
    assert length >= slice_length(context, remaining, serving, config)
    assert slice_length(context, remaining, serving, config, generated + 64) >= length
    off = SliceConfig(slice_tokens=64, recompute_share=None, grow_with_answer=False)
    assert slice_length(context, remaining, serving, off, generated) == min(64, remaining)


def test_slices_of_a_long_answer_double() -> None:
    serving, _ = _models()
    config = SliceConfig(slice_tokens=128, recompute_share=None)
    lengths, generated = [], 0
    while generated < 2000:
        n = slice_length(600 + generated, 2000 - generated, serving, config, generated)
        lengths.append(n)
        generated += n
    assert lengths == [128, 128, 256, 512, 976]


@PROPS
@given(
    legs=st.lists(
        st.tuples(st.integers(16, 2000), st.integers(0, 800), st.integers(1, 800)), min_size=1, max_size=10
    ),
    prompt=st.integers(16, 8000),
)
def test_constraint_d_is_the_least_whole_life_atgt_slack_of_the_residents(
    legs: list[tuple[int, int, int]], prompt: int
) -> None:
    """(d): the prefill this prompt puts on a colocated instance over the least slack any resident
    has (saved so far at the current step, plus still to save at the step with this request over the
    remainder it is sure to produce), checked leg by leg; a resident whose slack it would exceed is
    the one that keeps the request off."""
    import dataclasses

    import numpy as np

    from router.core.columns import ResidentLegs, StaticResidents

    tokens = sum(p + g for p, g, _ in legs)
    scheduler = make_scheduler("binpack", tpot_slo_ms=60.0, ttft_slo_ms=60_000.0)
    snapshot = make_snapshot(
        inst("n", "neutral", decode_requests=len(legs), decode_tokens=tokens, used_kv_tokens=tokens),
        inst("m", "neutral"),
    )
    view = scheduler.view(snapshot, NOW)
    n = view.instances.index["n"]
    known = ResidentLegs(
        np.full(len(legs), n, dtype=np.intp),
        np.array([float(p + g) for p, g, _ in legs]),
        np.array([float(r) for _, _, r in legs]),
        np.ones(len(legs), dtype=bool),
        np.array([float(g) for _, g, _ in legs]),
    )
    view = dataclasses.replace(view, residents=StaticResidents(known), load_memo={})
    ctx = scheduler.context(view, make_request("new", prompt, max_tokens=64))
    ratio = float(ctx.metric("prefill_over_atgt_slack")[n])
    step_now = float(ctx.metric("decode_step_ms")[n])
    step_new = float(ctx.metric("predicted_tpot")[n])
    from router.core.packing import SURE_REMAINING_SHARE, prefill_stall_ms

    stall = float(prefill_stall_ms(ctx)[n])
    # A TPOT-judged leg (no need recorded: the default target) saves over the remainder it is sure
    # to reach.
    slacks = [
        g * (60.0 - step_now) + max(max(r, 1) * SURE_REMAINING_SHARE, 1.0) * (60.0 - step_new)
        for _, g, r in legs
    ]
    least = min(slacks)
    if least > 0:
        assert ratio == pytest.approx(stall / least, rel=1e-9)
    else:
        assert ratio == math.inf
    assert float(ctx.metric("prefill_over_atgt_slack")[view.instances.index["m"]]) == 0.0  # nothing decodes


def test_constraint_d_credits_a_tpot_judged_resident_only_the_saving_of_the_answer_it_surely_gives() -> None:
    """A chat answer that has just started is expected to run 250 more tokens, but many run 30: a
    stall now stays in its mean TPOT, and the time it would save over the 220 tokens it may never
    produce cannot pay for it. (d) counts a TPOT-judged resident's future saving over the remainder
    it reaches nine times in ten (``SURE_REMAINING_SHARE`` of the expected one, memoryless lengths);
    credited with the whole expected remainder (before), a 6,000-token prompt passed (d) on an
    instance whose fresh chat legs then missed their TPOT (4 neutral instances, chat, 12 req/s:
    55 TPOT misses, 91.8 % against `slo`'s 93.8 %). A deadline-paced resident keeps its expected
    remainder: a shorter answer only leaves it more time."""
    import dataclasses

    from router.core.columns import ResidentLegs, StaticResidents
    from router.core.packing import SURE_REMAINING_SHARE, prefill_stall_ms

    scheduler = make_scheduler("binpack", tpot_slo_ms=50.0, ttft_slo_ms=60_000.0)
    snapshot = make_snapshot(
        inst("n", "neutral", decode_requests=4, decode_tokens=4 * 400, used_kv_tokens=4 * 400),
        inst("m", "neutral", decode_requests=1, decode_tokens=8000, used_kv_tokens=8000),
    )
    view = scheduler.view(snapshot, NOW)
    n = view.instances.index["n"]

    def ratio(need_ms: float) -> tuple[float, float, float]:
        legs = ResidentLegs(
            np.full(4, n, dtype=np.intp),
            np.full(4, 400.0),
            np.full(4, 250.0),
            np.ones(4, dtype=bool),
            np.zeros(4),  # nothing produced yet: no saved time
            np.full(4, need_ms),
        )
        v = dataclasses.replace(view, residents=StaticResidents(legs), load_memo={})
        ctx = scheduler.context(v, make_request("new", 6000, max_tokens=64))
        stall = float(prefill_stall_ms(ctx)[n])
        spare = 50.0 - float(ctx.metric("predicted_tpot")[n])
        return float(ctx.metric("prefill_over_atgt_slack")[n]), stall, spare

    chat, stall, spare = ratio(50.0)
    assert spare > 0 and stall > 0
    assert chat == pytest.approx(stall / (max(250.0 * SURE_REMAINING_SHARE, 1.0) * spare))
    theta = scheduler.config.binpack_theta
    assert chat > theta  # refused: the sure remainder cannot absorb the chunk
    assert stall / (250.0 * spare) < theta  # the whole expected remainder would have let it in
    # The same legs paced by a deadline (a need below the default target) keep their expected
    # remainder, counted against the pace (need x theta) at the step (b) holds them to.
    paced, stall, _ = ratio(40.0)
    legs = ResidentLegs(
        np.full(4, n, dtype=np.intp),
        np.full(4, 400.0),
        np.full(4, 250.0),
        np.ones(4, dtype=bool),
        np.zeros(4),
        np.full(4, 40.0),
    )
    v = dataclasses.replace(view, residents=StaticResidents(legs), load_memo={})
    horizon = float(
        scheduler.context(v, make_request("new", 6000, max_tokens=64)).metric("predicted_tpot_horizon")[n]
    )
    slack = 250.0 * (40.0 * theta - horizon)
    # Behind its pace before the prompt (no slack left), a resident sets no bound (ratio 0).
    assert paced == (pytest.approx(stall / slack) if slack > 0 else 0.0)


# ----------------------------------------------------------------------------- Aladdin (001): each request's own need


def _ctx_with_legs(scheduler, snapshot, request, legs_of):  # type: ignore[no-untyped-def]
    """A decision context of ``request`` whose view carries the resident legs ``legs_of(view)``."""
    import dataclasses

    from router.core.columns import StaticResidents

    view = scheduler.view(snapshot, NOW)
    known = legs_of(view)
    if known is not None:
        view = dataclasses.replace(view, residents=StaticResidents(known), load_memo={})
    return scheduler.context(view, request)


def test_an_e2e_request_is_paced_by_its_length_bound_when_an_instance_can_keep_that_pace() -> None:
    """Paced by the mean, every answer longer than the mean misses; the bound (the predictor's high
    quantile) sets the pace when an idle instance can keep it, the mean when it cannot, and the
    time already spent in the router queue comes off the deadline."""
    from router.core.packing import packing_tpot_target_ms

    scheduler = make_scheduler("binpack", tpot_slo_ms=50.0)
    snapshot = make_snapshot(inst("n", "neutral"))

    def target(**kw):  # type: ignore[no-untyped-def]
        request = make_request("r", 256, e2e_slo_ms=4000.0, expected_output_tokens=64, **kw)
        ctx = _ctx_with_legs(scheduler, snapshot, request, lambda view: None)
        ttft = float(np.nanmin(ctx.metric("predicted_ttft")))
        return packing_tpot_target_ms(ctx, 256, 0.7), ttft

    value, ttft = target(output_tokens_bound=200)
    assert value == pytest.approx((4000.0 - ttft) / 199 / 0.7)
    # A bound whose pace no instance keeps (batch 1 of the worked profile: ~15 ms): the mean's pace,
    # here looser than 0.7 x 50 ms, so the TPOT target itself.
    value, _ = target(output_tokens_bound=400)
    assert value == 50.0
    # Two seconds in the queue: half the deadline left, the bound's pace is out of reach, the mean's is not.
    value, ttft = target(output_tokens_bound=200, arrival_s=NOW - 2.0)
    assert value == pytest.approx((2000.0 - ttft) / 63 / 0.7)


def test_a_tail_pace_no_instance_keeps_now_gives_way_to_the_expected_lengths_pace() -> None:
    """The bound's pace an idle instance keeps, but every instance of the fleet is too busy for it
    now: waiting only shortens the deadline, so the request is paced by its expected length (the
    pace it can still keep) and (b) admits it where that pace holds, instead of refusing it."""
    from router.core.packing import packing_tpot_target_ms

    scheduler = make_scheduler("binpack", tpot_slo_ms=50.0)
    busy = make_snapshot(
        inst("a", "neutral", decode_requests=40, decode_tokens=40_000, used_kv_tokens=40_000),
        inst("b", "neutral", decode_requests=40, decode_tokens=40_000, used_kv_tokens=40_000),
    )
    request = make_request("r", 256, e2e_slo_ms=4000.0, expected_output_tokens=64, output_tokens_bound=200)
    ctx = _ctx_with_legs(scheduler, busy, request, lambda view: None)
    ttft = float(np.nanmin(ctx.metric("predicted_ttft")))
    horizon = float(np.min(ctx.metric("predicted_tpot_horizon")))
    tail, typical = (4000.0 - ttft) / 199, (4000.0 - ttft) / 63
    assert tail < horizon < typical, (tail, horizon, typical)  # the scenario: only the mean's pace holds
    assert packing_tpot_target_ms(ctx, 256, 0.7) == pytest.approx(min(typical, 0.7 * 50.0) / 0.7)
    # (b) now reads the horizon against that need, not against the tail's pace (which refused all).
    need = min(typical, 0.7 * 50.0) / 0.7
    assert float(np.min(ctx.metric("tpot_horizon_over_need"))) == pytest.approx(horizon / need)


def test_binpack_keeps_a_residents_tighter_need_when_placing_a_looser_request() -> None:
    """(b) holds for every request the instance holds: a chat request whose own target the fullest
    decoder meets goes elsewhere when a resident there must keep a faster pace."""
    from router.core.columns import ResidentLegs

    scheduler = make_scheduler("binpack", tpot_slo_ms=50.0)
    snapshot = make_snapshot(
        inst("p", "prefill"),
        inst("full", "decode", decode_requests=8, decode_tokens=4000, used_kv_tokens=4000),
        inst("light", "decode", decode_requests=2, decode_tokens=1000, used_kv_tokens=1000),
    )
    request = make_request("chat", 256, expected_output_tokens=100)

    def legs(need: float):  # type: ignore[no-untyped-def]
        def of(view):  # type: ignore[no-untyped-def]
            at = view.instances.index["full"]
            return ResidentLegs(
                np.full(8, at, dtype=np.intp),
                np.full(8, 500.0),
                np.full(8, 100.0),
                np.ones(8, dtype=bool),
                np.zeros(8),
                np.full(8, need),
            )

        return of

    loose = _ctx_with_legs(scheduler, snapshot, request, legs(math.inf))
    tight = _ctx_with_legs(scheduler, snapshot, request, legs(20.0))
    full = loose.view.instances.index["full"]
    horizon = float(loose.metric("predicted_tpot_horizon")[full])
    assert float(loose.metric("tpot_horizon_over_need")[full]) == pytest.approx(horizon / 50.0)
    assert float(tight.metric("tpot_horizon_over_need")[full]) == pytest.approx(horizon / 20.0)
    picked = scheduler.schedule(loose.view, request, NOW, dry_run=True).decode
    assert picked is not None and picked.instance_id == "full"  # best fit: the fullest that meets (b)
    picked = scheduler.schedule(tight.view, request, NOW, dry_run=True).decode
    assert picked is not None and picked.instance_id == "light"


@PROPS
@given(
    legs=st.lists(
        st.tuples(st.integers(0, 2), st.integers(16, 3000), st.integers(1, 500), st.floats(5.0, 200.0)),
        max_size=12,
    ),
    own_tpot=st.sampled_from([0.0, 30.0, 80.0]),
)
def test_the_horizon_is_held_to_the_least_need_of_everyone_on_the_instance(
    legs: list[tuple[int, int, int, float]], own_tpot: float
) -> None:
    """Property of (b): per instance, the ratio is the largest of the γ-horizon TPOT over this
    request's need and, for each resident, the mean step over its remainder (the step without the
    request, plus the request's part of it for the share of the remainder the request's 120 tokens
    cover) over its recorded need; never above the γ-horizon TPOT over the least need, equal to it
    where the request outlasts every resident; residents never loosen it; binpack places only where
    it is below θ (or on an empty instance)."""
    from router.core.columns import ResidentLegs
    from router.core.packing import resident_tpot_need_ms

    scheduler = make_scheduler("binpack", tpot_slo_ms=50.0)
    records = [inst("p", "prefill")]
    for k in range(3):
        mine = [(c, r) for i, c, r, _ in legs if i == k]
        tokens = sum(c for c, _ in mine)
        records.append(
            inst(f"d{k}", "decode", decode_requests=len(mine), decode_tokens=tokens, used_kv_tokens=tokens)
        )
    snapshot = make_snapshot(*records)
    request = make_request("r", 300, tpot_slo_ms=own_tpot, expected_output_tokens=120)

    def of(view):  # type: ignore[no-untyped-def]
        index = view.instances.index
        return ResidentLegs(
            np.array([index[f"d{i}"] for i, _, _, _ in legs], dtype=np.intp),
            np.array([float(c) for _, c, _, _ in legs]),
            np.array([float(r) for _, _, r, _ in legs]),
            np.ones(len(legs), dtype=bool),
            np.zeros(len(legs)),
            np.array([need for _, _, _, need in legs]),
        )

    ctx = _ctx_with_legs(scheduler, snapshot, request, of)
    bare = _ctx_with_legs(scheduler, snapshot, request, lambda view: None)
    own = resident_tpot_need_ms(ctx, scheduler.config)
    ratio = ctx.metric("tpot_horizon_over_need")
    horizon = ctx.metric("predicted_tpot_horizon")
    assert ctx.predictors is not None
    without = ctx.predictors.decode_step_ms(
        ctx.view.instances, ctx.metric("decode_batch_size"), ctx.metric("decode_tokens_horizon")
    )
    for k in range(3):
        i = ctx.view.instances.index[f"d{k}"]
        mine = [(r, need) for j, _, r, need in legs if j == k]
        base = min(without[i], horizon[i])
        each = [(base + (horizon[i] - base) * min(1.0, 120 / max(r, 1.0))) / need for r, need in mine]
        assert ratio[i] == pytest.approx(max([horizon[i] / own, *each]), rel=1e-9)
        assert ratio[i] <= horizon[i] / min([own, *(need for _, need in mine)]) * (1 + 1e-9)
        if all(r <= 120 for r, _ in mine):
            assert ratio[i] == pytest.approx(horizon[i] / min([own, *(need for _, need in mine)]), rel=1e-9)
        assert ratio[i] >= float(bare.metric("tpot_horizon_over_need")[i]) - 1e-12
    try:
        decision = scheduler.schedule(ctx.view, request, NOW, dry_run=True)
    except NoInstanceError:
        return  # every decoder refused by some constraint: the request waits
    assert decision.decode is not None
    i = ctx.view.instances.index[decision.decode.instance_id]
    empty = not any(j == int(decision.decode.instance_id[1:]) for j, _, _, _ in legs)
    assert ratio[i] < scheduler.config.binpack_theta or empty


def test_the_inflight_account_keeps_each_resident_legs_need_until_it_ends() -> None:
    from router.core.inflight import InflightAccount

    account = InflightAccount()
    account.record("a", "p", "d", 100, NOW, final_tokens=300, tpot_need_ms=21.5)
    account.record("b", "p", "d", 100, NOW, final_tokens=300)
    legs = account.resident_legs({"p": 0, "d": 1}, 2)
    assert legs is not None and legs.tpot_need_ms is not None
    assert sorted(legs.tpot_need_ms.tolist()) == [21.5, math.inf]
    account.release("a")
    legs = account.resident_legs({"p": 0, "d": 1}, 2)
    assert legs is not None and legs.tpot_need_ms is not None and legs.tpot_need_ms.tolist() == [math.inf]
    with pytest.raises(ValueError, match="tpot_need_ms"):
        account.record("c", "p", "d", 100, NOW, final_tokens=300, tpot_need_ms=-1.0)


def test_constraint_d_takes_each_residents_own_need() -> None:
    """(d) with recorded needs: a resident paced tighter than the TPOT target has less slack."""
    from router.core.columns import ResidentLegs

    scheduler = make_scheduler("binpack", tpot_slo_ms=60.0, ttft_slo_ms=60_000.0)
    snapshot = make_snapshot(inst("n", "neutral", decode_requests=1, decode_tokens=600, used_kv_tokens=600))

    def with_need(need: float):  # type: ignore[no-untyped-def]
        def of(view):  # type: ignore[no-untyped-def]
            return ResidentLegs(
                np.zeros(1, dtype=np.intp),
                np.array([600.0]),
                np.array([200.0]),
                np.ones(1, dtype=bool),
                np.array([100.0]),
                np.array([need]),
            )

        return of

    request = make_request("new", 2000, max_tokens=64)
    loose = _ctx_with_legs(scheduler, snapshot, request, with_need(math.inf))
    tight = _ctx_with_legs(scheduler, snapshot, request, with_need(30.0))
    step_now = float(loose.metric("decode_step_ms")[0])
    step_new = float(loose.metric("predicted_tpot")[0])
    from router.core.packing import SURE_REMAINING_SHARE, atgt_slack_ms

    # TPOT-judged (no need recorded): its future saving over the remainder it is sure to reach; a
    # deadline-paced one (below) over its expected remainder.
    assert float(atgt_slack_ms(loose, 60.0)[0]) == pytest.approx(
        100 * (60 - step_now) + 200 * SURE_REMAINING_SHARE * (60 - step_new)
    )
    # A deadline-paced one saves at the γ-horizon step (b) holds within its pace.
    horizon = float(tight.metric("predicted_tpot_horizon")[0])
    unscaled = 100 * (30 - step_now) + 200 * (30 - horizon)
    assert float(atgt_slack_ms(tight, 60.0)[0]) == (pytest.approx(unscaled) if unscaled > 0 else math.inf)
    # A need below the default target is a deadline's pace over θ: (d) counts the slack against the
    # pace itself (need × θ), the time the deadline leaves, which is what the policy's metric does.
    theta = scheduler.config.binpack_theta
    paced = float(atgt_slack_ms(tight, 60.0, theta)[0])
    expected = 100 * (30 * theta - step_now) + 200 * (30 * theta - horizon)
    from router.core.packing import prefill_stall_ms

    stall = float(prefill_stall_ms(tight)[0])
    if expected > 0:
        assert paced == pytest.approx(expected)
        assert float(tight.metric("prefill_over_atgt_slack")[0]) == pytest.approx(stall / paced)
        assert float(tight.metric("prefill_over_atgt_slack")[0]) > float(
            loose.metric("prefill_over_atgt_slack")[0]
        )
    else:
        # Behind its pace before this prompt: it misses whatever is placed, and sets no bound.
        assert paced == math.inf
        assert float(tight.metric("prefill_over_atgt_slack")[0]) == 0.0


# ----------------------------------------------------------------------------- SCLS (002): admission on a continuous-batching engine


def _one_batch_queued(split: bool) -> tuple[SliceScheduler, list[int]]:
    """One instance of 10,000 KV tokens (budget 9,000) running a 4,000-token slice, and a queued batch of
    four 2,000-token slices (8,000 KV tokens: it does not fit whole, two of its slices do)."""
    serving, memory = _models(kv=10_000)
    sched = SliceScheduler(SliceConfig(split_batches=split), serving, memory, ["x"])
    sched.add(SliceRequest("big", 3_872, 128))
    sched.schedule()
    ((key, _),) = sched.admit("x", 0.0)
    for k in range(4):
        sched.add(SliceRequest(k, 1_872, 128))
    sched.schedule()
    return sched, [key]


def test_a_queued_batch_starts_slice_by_slice_as_kv_frees_on_a_continuous_batching_engine() -> None:
    """The slices of a queued batch that fit the instance's planned KV start at once (the engine merges
    them into its running batch); the rest stays at the queue's head with its share of the estimate."""
    sched, _ = _one_batch_queued(split=True)
    load = sched.load_ms("x")
    admitted = sched.admit("x", 1.0)
    assert sum(len(b.requests) for b in sched._queues["x"]) + 2 == 4
    assert [len(b.requests) for _, b in admitted] == [2]
    assert sched.planned_kv("x") == 4_000 + 2 * 2_000
    assert sched.planned_kv("x") <= sched.models("x").budget_tokens
    assert sched.load_ms("x") == pytest.approx(load)  # the parts' estimates sum to the batch's
    whole, _ = _one_batch_queued(split=False)
    assert whole.admit("x", 1.0) == []  # the batch waits whole: the engine runs one slice meanwhile


@PROPS
@given(
    running=st.integers(0, 8_000),
    slices=st.lists(st.integers(16, 3_000), min_size=1, max_size=12),
)
def test_admission_never_plans_past_the_budget_while_something_runs(running: int, slices: list[int]) -> None:
    """Packing invariant of admission: with slices running, what is admitted keeps the planned KV
    within the instance's budget; the estimate the ledger holds is never lost by splitting."""
    serving, memory = _models(kv=10_000)
    sched = SliceScheduler(SliceConfig(), serving, memory, ["x"])
    if running:
        sched.add(SliceRequest("run", running, 64))
        sched.schedule()
        sched.admit("x", 0.0)
    for k, context in enumerate(slices):
        sched.add(SliceRequest(k, context, 128))
    sched.schedule()
    before = sched.load_ms("x")
    was_running = bool(running)
    admitted = sched.admit("x", 1.0)
    if was_running:
        assert sched.planned_kv("x") <= sched.models("x").budget_tokens
    assert sched.load_ms("x") == pytest.approx(before)
    started = sum(len(b.requests) for _, b in admitted)
    queued = sum(len(b.requests) for b in sched._queues["x"])
    assert started + queued == len(slices)


def test_slices_pay_from_about_one_preemption_per_ten_requests() -> None:
    """auto's rule: slices where request dispatch preempts once per ten requests or more (with batches
    admitted slice by slice, slices kept >= 0.95x the throughput there on every measured fleet)."""
    from router.core.slicing import slices_pay

    assert slices_pay(10, 100)
    assert slices_pay(250, 100)
    assert not slices_pay(9, 100)
    assert not slices_pay(0, 0)


def test_a_residents_recorded_need_is_its_own_target_not_the_queues_margin() -> None:
    """The router queue places late work under 0.8 of its TPOT target on a neutral instance (a margin of
    that placement); what the resident leg records, and later placements keep, is its own target."""
    from router.core.packing import packing_tpot_target_ms, resident_tpot_need_ms
    from router.core.request import resolve_targets

    scheduler = make_scheduler("binpack", tpot_slo_ms=50.0)
    view = scheduler.view(make_snapshot(inst("n", "neutral")), NOW)
    request = make_request("late", 256, expected_output_tokens=100)
    targets = resolve_targets(request, 1000.0, 50.0)
    margin = type(targets)(targets.ttft_ms, 40.0, targets.e2e_ms, targets.full_ttft_ms)
    ctx = scheduler.context(view, request, NOW, margin)
    assert packing_tpot_target_ms(ctx, 256, 0.7) == 40.0
    assert resident_tpot_need_ms(ctx, scheduler.config) == 50.0


@PROPS
@given(ratios=st.lists(st.floats(0.0, 5.0), min_size=1, max_size=600), start=st.floats(0.05, 2.0))
def test_learned_theta_stays_within_its_bounds_and_moves_by_bounded_steps(
    ratios: list[float], start: float
) -> None:
    from router.core import theta

    fit = theta.ThetaFit(start)
    previous = fit.theta
    assert theta.THETA_MIN <= previous <= theta.THETA_MAX
    for ratio in ratios:
        fit.observe(ratio * 50.0, 50.0)
        assert theta.THETA_MIN <= fit.theta <= theta.THETA_MAX
        if fit.theta != previous:
            step = fit.theta / previous
            assert theta.THETA_STEP_DOWN - 1e-9 <= step <= theta.THETA_STEP_UP + 1e-9
        previous = fit.theta
    assert fit.updates <= len(ratios) // theta.THETA_EVERY


def test_learned_theta_falls_when_requests_miss_their_tpot_and_rises_when_they_have_room() -> None:
    """Aladdin's θ adapts to the prediction error: realized TPOT over target above 1 at the high
    quantile tightens the constraint, well below 1 loosens it; e2e-judged requests (no TPOT target)
    teach nothing."""
    from router.core.theta import THETA_EVERY, ThetaFit

    fit = ThetaFit(0.7)
    for _ in range(THETA_EVERY * 4):
        fit.observe(30.0, 50.0)
    assert fit.updates == 4 and fit.theta > 0.7 * 1.04**4  # room: loosened
    loosened = fit.theta
    for _ in range(THETA_EVERY * 2):
        fit.observe(60.0, 50.0)  # 1.2 × the target
    assert fit.theta < loosened * 0.9**1.5  # misses: tightened at once (the high quantile)
    for _ in range(THETA_EVERY * 20):
        fit.observe(60.0, 50.0)
    assert fit.theta == 0.7  # never below the configured θ (misses it does not cause)
    judged_end_to_end = ThetaFit(0.7)
    for _ in range(THETA_EVERY * 4):
        judged_end_to_end.observe(300.0, 0.0)
    assert judged_end_to_end.updates == 0 and judged_end_to_end.theta == 0.7
    # In closed loop (the TPOT requests get grows with θ) it settles where the target is just met: a
    # horizon 10 % optimistic settles at 1 / 1.1, one 20 % pessimistic at 1 / 0.8 (capped at 1.25).
    for bias, want in ((1.1, 1 / 1.1), (0.8, 1.25)):
        loop = ThetaFit(0.5)
        for _ in range(THETA_EVERY * 40):
            loop.observe(bias * loop.theta * 50.0, 50.0)
        assert loop.theta == pytest.approx(want, rel=0.02)


def test_learned_theta_reads_each_class_tail_on_its_own() -> None:
    """A tight class missing its TPOT target tightens θ even when a looser class, more numerous,
    has room: pooled, the loose class's ratios would dilute the tight class's tail and θ would rise."""
    from router.core.theta import THETA_EVERY, ThetaFit

    fit = ThetaFit(0.7)
    for _ in range(THETA_EVERY * 2):
        for _ in range(99):
            fit.observe(30.0, 60.0, "chat")  # half the target: room
        fit.observe(46.0, 40.0, "complete")  # 1.15 × the target: 1 % of the reports, each a miss
    assert fit.updates > 0 and fit.theta == 0.7  # held at the configured θ, not loosened
    pooled = ThetaFit(0.7)
    for _ in range(THETA_EVERY * 2):
        for _ in range(99):
            pooled.observe(30.0, 60.0)
        pooled.observe(46.0, 40.0)
    assert pooled.theta > 0.7  # one class (""): the 98th percentile falls among the roomy ratios
    # With room in every class it loosens as before.
    roomy = ThetaFit(0.7)
    for _ in range(THETA_EVERY * 4):
        roomy.observe(30.0, 60.0, "chat")
        roomy.observe(25.0, 40.0, "complete")
    assert roomy.theta > 0.7


def test_learned_theta_reads_old_reports_at_the_theta_in_force() -> None:
    """Reports made under an earlier θ count per unit of θ: a loop whose requests report one move
    late (TPOT 1.1 × θ × target, θ of the move before) settles near 1 / 1.1 and does not fall back to
    the configured θ once it got there (raw, the misses kept in the window would pull it down)."""
    from router.core.theta import THETA_EVERY, ThetaFit

    fit = ThetaFit(0.5)
    placed = fit.theta
    seen = []
    for _ in range(THETA_EVERY * 60):
        before = fit.theta
        fit.observe(1.1 * placed * 50.0, 50.0, "complete")
        if fit.theta != before:
            placed = before
        seen.append(fit.theta)
    assert fit.theta == pytest.approx(1 / 1.1, rel=0.05)
    settled = seen[len(seen) // 2 :]
    assert min(settled) > 0.8


def test_binpack_holds_the_horizon_to_the_learned_theta() -> None:
    """With a learned θ on the predictor set, (b) keeps the horizon within that θ of the need (the
    ratio is scaled so the --binpack-theta limit stands for it); without one, --binpack-theta."""
    from router.core.theta import ThetaFit

    scheduler = make_scheduler("binpack", tpot_slo_ms=50.0)
    snapshot = make_snapshot(
        inst("p", "prefill"), inst("d", "decode", decode_requests=6, decode_tokens=3000, used_kv_tokens=3000)
    )
    request = make_request("chat", 256, expected_output_tokens=100)
    fixed = scheduler.context(scheduler.view(snapshot, NOW), request)
    d = fixed.view.instances.index["d"]
    ratio = float(fixed.metric("tpot_horizon_over_need")[d])
    assert scheduler.predictors is not None
    scheduler.predictors.theta = ThetaFit(1.0)
    learned = scheduler.context(scheduler.view(snapshot, NOW), request)
    theta = scheduler.config.binpack_theta
    assert float(learned.metric("tpot_horizon_over_need")[d]) == pytest.approx(ratio * theta / 1.0)


def test_a_fleet_of_colocated_instances_keeps_the_configured_theta() -> None:
    """On neutral instances (b) and (d) share the residents' TPOT need: a learned θ above the
    configured one would let (b) pack the decode step up to the need and leave (d) no slack for any
    prompt. There (b) holds the horizon to --binpack-theta whatever the fit says, and so does the
    need a deadline-paced request records."""
    from router.core.packing import live_theta
    from router.core.theta import ThetaFit

    scheduler = make_scheduler("binpack", tpot_slo_ms=50.0)
    snapshot = make_snapshot(
        inst("a", "neutral", decode_requests=6, decode_tokens=3000, used_kv_tokens=3000), inst("b", "neutral")
    )
    request = make_request("chat", 256, expected_output_tokens=100)
    fixed = scheduler.context(scheduler.view(snapshot, NOW), request)
    a = fixed.view.instances.index["a"]
    ratio = float(fixed.metric("tpot_horizon_over_need")[a])
    assert scheduler.predictors is not None
    scheduler.predictors.theta = ThetaFit(1.0)
    learned = scheduler.context(scheduler.view(snapshot, NOW), request)
    assert live_theta(learned, scheduler.config) == scheduler.config.binpack_theta
    assert float(learned.metric("tpot_horizon_over_need")[a]) == pytest.approx(ratio)
    # The same fit on a fleet with a decoder is in force.
    pd = make_snapshot(inst("p", "prefill"), inst("d", "decode"))
    assert live_theta(scheduler.context(scheduler.view(pd, NOW), request), scheduler.config) == 1.0


@PROPS
@given(st.lists(st.tuples(st.integers(0, 3_000), st.integers(0, 300)), max_size=12))
def test_the_slices_kv_peak_is_the_step_by_step_peak(held: list[tuple[int, int]]) -> None:
    """kv_peak_of: each slice adds a token a step and leaves at its end; the peak of the sum over
    every step equals the closed form (checked step by step)."""
    from router.core.slicing import kv_peak_of

    brute = max(
        (sum(t + k for t, s in held if s >= k) for k in range(max((s for _, s in held), default=0) + 1)),
        default=0,
    )
    assert kv_peak_of([(float(t), float(s)) for t, s in held]) == pytest.approx(brute)


def test_a_running_slice_is_booked_from_its_progress_so_another_fits_beside_it() -> None:
    """Booked whole from their start (static batching's memory model), slices a (3,000 + 1,000) and
    b (2,000 + 1,000) leave 1,992 of a 9,000 budget, too little for a 2,300 + 128 slice. With a 100
    steps from its end and b just started, their KV peaks at a's end, 4,000 + 2,100 (+ b's block
    rounding): the slice starts. With a 900 steps from its end the peak is 4,000 + 2,900 and it waits;
    without the driver's progress nothing changes."""
    serving, memory = _models(kv=10_000)
    for at, starts in ((None, False), ({"a": 3_900, "b": 2_000}, True), ({"a": 3_100, "b": 2_000}, False)):
        sched = SliceScheduler(SliceConfig(), serving, memory, ["x"])
        sched.add(SliceRequest("a", 3_000, 1_000))
        sched.add(SliceRequest("b", 2_000, 1_000))
        sched.schedule()
        assert sum(len(b.requests) for _, b in sched.admit("x", 0.0)) == 2
        if at is not None:
            sched.progress = lambda key, at=at: at.get(str(key))
        assert sched.committed_kv("x") <= sched.planned_kv("x")
        sched.add(SliceRequest("next", 2_300, 128))
        sched.schedule()
        assert bool(sched.admit("x", 1.0)) is starts, at


def test_learned_theta_keeps_a_bounded_number_of_class_windows() -> None:
    # Class labels are the client's: any number of them must not grow the fit without bound.
    from router.core.theta import THETA_MAX_CLASSES, ThetaFit

    fit = ThetaFit(0.7)
    for k in range(THETA_MAX_CLASSES * 4):
        fit.observe(20.0, 40.0, f"label-{k}")
    assert len(fit._classes) == THETA_MAX_CLASSES + 1
    assert 0.7 <= fit.theta <= 1.25
