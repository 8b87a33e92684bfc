"""Packing over a request's life: resident tally, KV peak, TPOT horizon, best fit, safety valve, capacity model."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet.snapshot import ClusterSnapshot, InstanceRecord
from router.core.adaptive_pd import DecodeShare, decoder_cap
from router.core.capacity import (
    MAX_BATCH,
    LoadShape,
    decode_batch,
    estimate_instances,
    instance_rates,
    median_seq_cap,
)
from router.core.columns import ClusterView, ResidentLegs, StaticResidents
from router.core.errors import NoInstanceError
from router.core.inflight import InflightAccount
from router.core.packing import (
    expected_output_tokens,
    kv_all_alive_tokens,
    kv_peak_tokens,
    overpacked_mask,
    prefill_room_mask,
)
from router.core.registry import METRICS
from router.core.request import ScheduleInput
from router.core.scheduler import Scheduler
from tests.router.core.helpers import NOW, inst, make_predictor, make_request, make_scheduler, make_snapshot

PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CAPACITY = 20_000


# ----------------------------------------------------------------------------- resident tally


def test_resident_leg_outlives_admission_and_leaves_when_the_request_ends() -> None:
    account = InflightAccount(expiry_s=10.0, resident_expiry_s=100.0)
    account.record("r1", "p", "d", 300, NOW, final_tokens=500)
    assert account.resident("d") == (1, 500) and account.resident("p") == (0, 0)
    # The decode instance admits the request: the in-flight entry goes, the resident leg stays.
    snapshot = make_snapshot(inst("d", "decode", admitted=["r1"], decode_requests=1, decode_tokens=301))
    account.reconcile(snapshot)
    assert account.totals("d").decode_requests == 0
    assert account.resident("d") == (1, 500)
    account.record("r1", None, "d", 300, NOW, final_tokens=500)  # recording again changes nothing
    assert account.resident("d") == (1, 500)
    account.release("r1")
    assert account.resident("d") == (0, 0)
    account.release("r1")  # harmless twice
    assert account.resident("d") == (0, 0)


def test_resident_leg_moves_with_a_decode_replacement_and_expires() -> None:
    account = InflightAccount(expiry_s=10.0, resident_expiry_s=100.0)
    account.record("r1", "p", "d1", 300, NOW, final_tokens=500)
    account.release("r1", "d1")  # the decode instance failed
    account.record("r1", None, "d2", 320, NOW + 1, final_tokens=500)
    assert account.resident("d1") == (0, 0) and account.resident("d2") == (1, 500)
    account.expire(NOW + 50)
    assert account.resident("d2") == (1, 500)
    account.expire(NOW + 101)
    assert account.resident("d2") == (0, 0)


def test_resident_columns_follow_the_account() -> None:
    scheduler = make_scheduler("binpack")
    scheduler.inflight.record("r1", "p", "d", 300, NOW, final_tokens=700)
    scheduler.inflight.record("r2", "p", "d", 100, NOW, final_tokens=200)
    snapshot = make_snapshot(inst("p", "prefill"), inst("d", "decode"))
    view = scheduler.view(snapshot, NOW)
    d = view.instances.index["d"]
    assert view.inflight.resident_requests[d] == 2 and view.inflight.resident_tokens[d] == 900
    scheduler.inflight.release("r1")
    view = scheduler.view(snapshot, NOW)
    assert view.inflight.resident_requests[d] == 1 and view.inflight.resident_tokens[d] == 200


@PROPS
@given(
    st.lists(
        st.tuples(st.sampled_from(["rec", "rel", "relone", "exp"]), st.integers(0, 5), st.integers(0, 2)),
        max_size=40,
    )
)
def test_resident_totals_match_the_live_legs(ops: list[tuple[str, int, int]]) -> None:
    account = InflightAccount(expiry_s=5.0, resident_expiry_s=20.0)
    live: dict[str, tuple[str, int, float]] = {}
    now = 0.0
    for op, k, inst_k in ops:
        now += 1.0
        rid, iid = f"r{k}", f"d{inst_k}"
        if op == "rec":
            account.record(rid, None, iid, 10, now, final_tokens=100 + k)
            if rid not in live or live[rid][0] != iid:
                live[rid] = (iid, 100 + k, now)
        elif op == "rel":
            account.release(rid)
            live.pop(rid, None)
        elif op == "relone":
            account.release(rid, iid)
            if rid in live and live[rid][0] == iid:
                del live[rid]
        else:
            account.expire(now)
            live = {r: v for r, v in live.items() if v[2] > now - 20.0}
        for i in range(3):
            legs = [v for v in live.values() if v[0] == f"d{i}"]
            assert account.resident(f"d{i}") == (len(legs), sum(v[1] for v in legs))


# ----------------------------------------------------------------------------- KV over life


def _life_peak(contexts: list[int], remaining: list[int]) -> int:
    """The largest KV an instance holds while its decode requests run to their lengths (1 token per step)."""
    horizon = max(remaining, default=0)
    return max(
        (sum(c + t for c, r in zip(contexts, remaining, strict=True) if r > t) for t in range(horizon)),
        default=0,
    )


def holding(
    scheduler: Scheduler,
    name: str,
    role: str,
    residents: list[tuple[int, int, int]],
    ids: list[str],
    prefill: str | None,
) -> InstanceRecord:
    """Instance ``name`` holding ``residents`` (prompt, output, generated) as requests ``ids``, each
    recorded in ``scheduler``'s in-flight account as placed there (its prefill on ``prefill``)."""
    for rid, (prompt, out, _) in zip(ids, residents, strict=True):
        scheduler.inflight.record(rid, prefill, name, prompt, NOW - 1, final_tokens=prompt + out)
    context = sum(p + g for p, _, g in residents)
    return inst(
        name,
        role,
        meta={"kv_capacity_tokens": CAPACITY},
        decode_requests=len(residents),
        decode_tokens=context,
        used_kv_tokens=context,
        running=len(residents),
        admitted=ids,
    )


def _loaded_fleet(
    residents: list[tuple[int, int, int]], scheduler_policy: str = "binpack"
) -> tuple[ClusterSnapshot, Scheduler]:
    """One prefill instance and one decode instance holding ``residents`` (prompt, output, generated)."""
    scheduler = make_scheduler(scheduler_policy, tpot_slo_ms=1000.0)
    ids = [f"old{k}" for k in range(len(residents))]
    snapshot = make_snapshot(
        inst("p", "prefill", meta={"kv_capacity_tokens": CAPACITY}),
        holding(scheduler, "d", "decode", residents, ids, "p"),
    )
    scheduler.inflight.reconcile(snapshot)
    return snapshot, scheduler


residents_strategy = st.lists(
    st.tuples(st.integers(1, 3000), st.integers(2, 1500), st.integers(0, 1499)).map(
        lambda t: (t[0], t[1], min(t[2], t[1] - 1))
    ),
    max_size=12,
)


@PROPS
@given(residents_strategy, st.integers(1, 3000), st.integers(2, 1500))
def test_no_admitted_placement_exceeds_kv_over_the_requests_life(
    residents: list[tuple[int, int, int]], prompt: int, out: int
) -> None:
    snapshot, scheduler = _loaded_fleet(residents)
    kv = scheduler.view(snapshot, NOW)
    d = kv.instances.index["d"]
    request = make_request("new", prompt, max_tokens=out)
    ctx = scheduler.context(kv, request)
    admitted = ctx.metric("kv_peak_projected")[d] < scheduler.config.kv_packing_headroom
    contexts = [p + g for p, _, g in residents] + [prompt]
    remaining = [o - g for _, o, g in residents] + [out]
    if admitted:
        assert _life_peak(contexts, remaining) <= CAPACITY
    # The projection never under-states the life peak (it is the all-alive bound).
    assert ctx.metric("kv_peak_projected")[d] * CAPACITY >= _life_peak(contexts, remaining) - 1e-6


def _with_legs(view: ClusterView, residents: list[tuple[int, int, int]], at: str = "d") -> ClusterView:
    """``view`` with each resident's progress known (as the simulator gives it): legs on ``at``."""
    d = view.instances.index[at]
    legs = ResidentLegs(
        np.full(len(residents), d, dtype=np.intp),
        np.array([float(p + g) for p, _, g in residents]),
        np.array([float(o - g) for _, o, g in residents]),
        np.ones(len(residents), dtype=bool),
    )
    return dataclasses.replace(view, residents=StaticResidents(legs), load_memo={})


def test_the_account_keeps_each_resident_legs_context_as_it_grows() -> None:
    account = InflightAccount()
    account.record("a", "p", "d", 100, NOW, final_tokens=400)
    account.record("b", None, "e", 50, NOW, final_tokens=60)
    account.record("c", "p", "d", 70, NOW)  # no expected length: not resident
    version = account.version
    account.advance("a", 130)
    account.advance("a", 120)  # never shrinks
    account.advance("c", 999)  # not resident: ignored
    assert account.version == version  # progress is read per decision, not journalled
    legs = account.resident_legs({"p": 0, "d": 1, "e": 2}, 3)
    assert legs is not None
    assert sorted(
        zip(
            legs.instance.tolist(),
            legs.context.tolist(),
            legs.remaining.tolist(),
            legs.started.tolist(),
            strict=True,
        )
    ) == [(1, 130.0, 270.0, False), (2, 50.0, 10.0, False)]
    assert account.resident_legs_on("d") == [(130, 270, False, 0)]
    assert account.resident_legs_on("p") == []
    # Admitted by its decode instance: it decodes now.
    account.reconcile(make_snapshot(inst("d", "decode", admitted=["a"])))
    legs = account.resident_legs({"p": 0, "d": 1, "e": 2}, 3)
    assert legs is not None and sorted(zip(legs.instance.tolist(), legs.started.tolist(), strict=True)) == [
        (1, True),
        (2, False),
    ]
    assert account.resident_legs_on("d") == [(130, 270, True, 0)]
    account.release("a")
    legs = account.resident_legs({"p": 0, "d": 1, "e": 2}, 3)
    assert legs is not None and legs.instance.tolist() == [2]
    assert account.resident_legs_on("d") == []
    # Peers publish only sums: then no legs, and packing uses the sums.
    account.set_peers({"d": (1, 0, 0, 1, 10, 10, 1, 500)})
    assert account.resident_legs({"p": 0, "d": 1, "e": 2}, 3) is None
    assert account.resident_legs_on("e") is None


def _brute_peak(contexts: list[float], remaining: list[float]) -> float:
    """Step by step: k steps ahead a leg still running (remaining ≥ k) holds context + k tokens."""
    horizon = int(max(remaining, default=0))
    return max(
        sum(c + k for c, r in zip(contexts, remaining, strict=True) if r >= k) for k in range(horizon + 1)
    )


legs_strategy = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 4000), st.integers(0, 300)), max_size=25)


@PROPS
@given(legs_strategy)
def test_exact_kv_peak_equals_the_step_by_step_growth_and_stays_under_the_all_alive_bound(
    legs: list[tuple[int, int, int]],
) -> None:
    n = 4
    instance = np.array([g for g, _, _ in legs], dtype=np.intp)
    context = np.array([float(c) for _, c, _ in legs])
    remaining = np.array([float(r) for _, _, r in legs])
    peak = kv_peak_tokens(n, instance, context, remaining)
    bound = kv_all_alive_tokens(n, instance, context, remaining)
    for i in range(n):
        mine = [(c, r) for g, c, r in legs if g == i]
        brute = _brute_peak([float(c) for c, _ in mine], [float(r) for _, r in mine]) if mine else 0.0
        assert peak[i] == pytest.approx(brute)
        assert peak[i] <= bound[i] + 1e-9


@PROPS
@given(residents_strategy, st.integers(1, 3000), st.integers(2, 1500))
def test_the_exact_peak_admits_no_placement_that_exceeds_kv_over_the_requests_life(
    residents: list[tuple[int, int, int]], prompt: int, out: int
) -> None:
    snapshot, scheduler = _loaded_fleet(residents)
    sums = dataclasses.replace(scheduler.view(snapshot, NOW), residents=None, load_memo={})
    exact = _with_legs(sums, residents)
    d = sums.instances.index["d"]
    request = make_request("new", prompt, max_tokens=out)
    peak = scheduler.context(exact, request).metric("kv_peak_exact")[d]
    bound = scheduler.context(sums, request).metric("kv_peak_exact")[d]
    # Without the legs the exact peak is the sums' bound; slo's metric keeps the sums either way.
    assert bound == scheduler.context(sums, request).metric("kv_peak_projected")[d]
    assert scheduler.context(exact, request).metric("kv_peak_projected")[d] == bound
    contexts = [p + g for p, _, g in residents] + [prompt]
    remaining = [o - g for _, o, g in residents] + [out]
    assert peak <= bound + 1e-9
    assert peak * CAPACITY >= _life_peak(contexts, remaining) - 1e-6
    if peak < scheduler.config.kv_packing_headroom:
        assert _life_peak(contexts, remaining) <= CAPACITY


def test_the_exact_peak_admits_what_the_all_alive_bound_refused_and_it_fits_step_by_step() -> None:
    # 4 residents 50 tokens from the end (1950 tokens each) and 4 early in their answers (1100 each,
    # 900 to go): 12,200 tokens now. All alive at their final length they would hold 16,000, so a
    # 2500 + 800 request is refused by the bound (19,300 > 0.95 × 20,000). The old four leave after
    # 50 steps: the residents peak at 12,600 then, and with the new request at its full 3300 from
    # the start (its decoding starts after its prefill, whenever that is) at 15,900, well inside.
    residents = [(1000, 1000, 950)] * 4 + [(1000, 1000, 100)] * 4
    snapshot, scheduler = _loaded_fleet(residents)
    snapshot = make_snapshot(*snapshot.instances, inst("e", "decode", meta={"kv_capacity_tokens": CAPACITY}))
    sums = dataclasses.replace(scheduler.view(snapshot, NOW), residents=None, load_memo={})
    exact = _with_legs(sums, residents)
    d = sums.instances.index["d"]
    request = make_request("new", 2500, max_tokens=800)
    assert scheduler.context(sums, request).metric("kv_peak_exact")[d] > 0.95
    assert scheduler.context(exact, request).metric("kv_peak_exact")[d] == pytest.approx(15_900 / CAPACITY)
    assert scheduler.context(exact, request).metric("kv_peak_projected")[d] > 0.95
    contexts = [float(p + g) for p, _, g in residents]
    remaining = [float(o - g) for _, o, g in residents]

    # Step by step, whenever the new request starts decoding (a delay of 0 to 900 steps), it fits.
    def life(delay: int) -> float:
        return max(
            sum(c + k for c, r in zip(contexts, remaining, strict=True) if r >= k)
            + (2500.0 + max(k - delay, 0) if k <= delay + 800 else 0.0)
            for k in range(1801)
        )

    worst = max(life(delay) for delay in (0, 25, 50, 100, 900))
    assert worst <= 15_900 <= CAPACITY
    # Adaptive PD follows: on the sums no decoder keeps KV over life (e is held for prefill room), with
    # the legs it packs onto d. binpack holds Aladdin's (e), the footprint at every iteration: the
    # sums' bound opens the new bin e, the legs let it pack d.
    _, apd = _loaded_fleet(residents, "adaptive-pd")
    with pytest.raises(NoInstanceError) as refused:
        apd.schedule(sums, request, NOW, dry_run=True)
    assert refused.value.stage == "decode" and refused.value.drops["kv_over_life"] == 1
    packed = apd.schedule(exact, request, NOW, dry_run=True).decode
    assert packed is not None and packed.instance_id == "d"
    opened = scheduler.schedule(sums, request, NOW, dry_run=True).decode
    assert opened is not None and opened.instance_id == "e"
    binpacked = scheduler.schedule(exact, request, NOW).decode
    assert binpacked is not None and binpacked.instance_id == "d"


@PROPS
@given(
    st.lists(
        st.tuples(
            st.integers(0, 2), st.integers(0, 4000), st.integers(0, 300), st.booleans(), st.integers(0, 4000)
        ),
        max_size=20,
    )
)
def test_one_instances_kv_life_equals_its_entry_in_the_column(
    legs: list[tuple[int, int, int, bool, int]],
) -> None:
    # After a change the router updates only the instances it touched (the metric's ``at``).
    snapshot = make_snapshot(
        *(
            inst(f"d{k}", "decode", decode_requests=2, decode_tokens=900, used_kv_tokens=1200 + k)
            for k in range(3)
        )
    )
    scheduler = make_scheduler("slo", enable_adaptive_pd=True)
    known = ResidentLegs(
        np.array([g for g, *_ in legs], dtype=np.intp),
        np.array([float(c) for _, c, *_ in legs]),
        np.array([float(r) for _, _, r, *_ in legs]),
        np.array([s for _, _, _, s, _ in legs], dtype=bool),
        cached=np.array([float(min(k, c)) for _, c, _, _, k in legs]),  # (a prompt's cached part)
    )
    view = dataclasses.replace(scheduler.view(snapshot, NOW), residents=StaticResidents(known), load_memo={})
    ctx = scheduler.context(view, None)
    metric = METRICS.create("kv_life_tokens", scheduler.config)
    column = metric.compute(ctx)
    at = getattr(metric, "at")  # noqa: B009 (what DecisionContext looks up)
    assert [at(ctx, i) for i in range(3)] == pytest.approx(column.tolist())


def test_the_routers_kv_life_column_updated_after_a_change_equals_a_full_computation() -> None:
    # The view builder hands the previous column over; only the instances the change touched are
    # recomputed (from their legs alone).
    scheduler = make_scheduler("slo", enable_adaptive_pd=True)
    decoders = (inst(f"d{k}", "decode", meta={"kv_capacity_tokens": CAPACITY}) for k in range(12))
    snapshot = make_snapshot(*decoders)
    for k in range(12):
        scheduler.inflight.record(f"r{k}", None, f"d{k}", 500 + 10 * k, NOW, final_tokens=900 + 10 * k)
    scheduler.inflight.advance("r3", 531)  # the first token, from the prefill instance
    before = scheduler.context(scheduler.view(snapshot, NOW), None).metric("kv_life_tokens").copy()
    scheduler.inflight.record("late", None, "d5", 1000, NOW, final_tokens=1500)
    scheduler.inflight.release("r7")
    second = scheduler.view(snapshot, NOW)
    assert second.load_previous is not None  # the incremental path
    updated = scheduler.context(second, None).metric("kv_life_tokens")
    full = METRICS.create("kv_life_tokens", scheduler.config).compute(scheduler.context(second, None))
    assert updated.tolist() == pytest.approx(full.tolist())
    assert [k for k in range(12) if updated[k] != pytest.approx(before[k])] == [5, 7]
    # Progress alone changes no version: the column stays (a full computation on the same stale
    # statuses would subtract tokens the statuses do not hold yet, so the kept value is the cautious one).
    scheduler.inflight.advance("r4", 600)
    third = scheduler.view(snapshot, NOW)
    kept = scheduler.context(third, None).metric("kv_life_tokens")
    assert kept.tolist() == updated.tolist()
    assert np.all(
        kept >= METRICS.create("kv_life_tokens", scheduler.config).compute(scheduler.context(third, None))
    )


def test_a_leg_not_decoding_yet_counts_at_its_final_length() -> None:
    # Its prefill elsewhere may end at any moment: it may still hold its whole KV when the others peak.
    snapshot, scheduler = _loaded_fleet([(1000, 1000, 950)] * 4)
    scheduler.inflight.record("pending", "p", "d", 4000, NOW, final_tokens=7000)  # in flight: 4000 tokens
    view = scheduler.view(snapshot, NOW)
    d = view.instances.index["d"]
    legs = ResidentLegs(
        np.array([d] * 5, dtype=np.intp),
        np.array([1950.0] * 4 + [4000.0]),
        np.array([50.0] * 4 + [3000.0]),
        np.array([True] * 4 + [False]),
    )
    ctx = scheduler.context(dataclasses.replace(view, residents=StaticResidents(legs), load_memo={}), None)
    # The status holds the four (7800); the running four peak at 8000 together, the pending leg
    # adds its final 7000 whatever its delay (not the 4050 it would hold 50 steps after starting now).
    assert ctx.metric("kv_peak_exact")[d] * CAPACITY == pytest.approx(8000 + 7000)
    assert ctx.metric("kv_life_tokens")[d] == pytest.approx(8000 + 7000)


def test_a_decoding_leg_whose_kv_the_engine_has_not_allocated_yet_keeps_its_context() -> None:
    # A transferred prompt's prefill is done, but its engine admits it only when blocks are free: the
    # status's used KV holds none of it while the leg (started) carries its 1400 tokens. The four
    # running legs hold 7800 and peak with it at 50 steps: 4 x 2000 + 1450 = 9450. Subtracting every
    # leg's context from the used KV would drop those 1400 tokens (8050) and pass placements that
    # overflow a step later.
    residents = [(1000, 1000, 950)] * 4
    snapshot, scheduler = _loaded_fleet(residents)
    view = scheduler.view(snapshot, NOW)
    d = view.instances.index["d"]
    legs = ResidentLegs(
        np.array([d] * 5, dtype=np.intp),
        np.array([1950.0] * 4 + [1400.0]),
        np.array([50.0] * 4 + [100.0]),
        np.ones(5, dtype=bool),
    )
    ctx = scheduler.context(dataclasses.replace(view, residents=StaticResidents(legs), load_memo={}), None)
    assert ctx.metric("kv_life_tokens")[d] == pytest.approx(9450.0)
    metric = METRICS.create("kv_life_tokens", scheduler.config)
    assert getattr(metric, "at")(ctx, d) == pytest.approx(9450.0)  # noqa: B009 (the one-instance form)
    # Binpack's (e) refuses what would not fit over that life: 9450 + 9000 + 1000 > 0.95 x 20,000.
    request = make_request("new", 9000, max_tokens=1000)
    assert (
        scheduler.context(
            dataclasses.replace(view, residents=StaticResidents(legs), load_memo={}), request
        ).metric("kv_peak_exact")[d]
        > scheduler.config.kv_packing_headroom
    )


def test_kv_over_life_refuses_a_decoder_that_would_overflow_later_and_admits_one_that_fits() -> None:
    # 8 requests of 1000 prompt tokens, each 100 tokens into a 1000-token answer: 8800 tokens now,
    # 16000 at the end; a new 2100 + 1000 request fits now (11900) but not over life (19100 > 0.95 * 20000).
    residents = [(1000, 1000, 100)] * 8
    snapshot, scheduler = _loaded_fleet(residents)
    view = scheduler.view(snapshot, NOW)
    d = view.instances.index["d"]
    big = scheduler.context(view, make_request("big", 2100, max_tokens=1000))
    assert big.metric("kv_usage_projected")[d] < 0.6  # admission-time KV says fine
    assert big.metric("kv_peak_projected")[d] > 0.95
    small = scheduler.context(view, make_request("small", 200, max_tokens=100))
    assert small.metric("kv_peak_projected")[d] < 0.95
    # The policy follows: with an idle decoder to open, the big one goes there, the small one packs.
    snapshot2 = make_snapshot(*snapshot.instances, inst("e", "decode", meta={"kv_capacity_tokens": CAPACITY}))
    assert (
        scheduler.schedule(snapshot2, make_request("big", 2100, max_tokens=1000), NOW).decode.instance_id
        == "e"
    )
    assert (
        scheduler.schedule(snapshot2, make_request("small", 200, max_tokens=100), NOW).decode.instance_id
        == "d"
    )


def test_unknown_residents_count_with_the_default_output() -> None:
    scheduler = make_scheduler("binpack", packing_default_output_tokens=300)
    snapshot = make_snapshot(
        inst("p", "prefill"), inst("d", "decode", decode_requests=4, decode_tokens=2000, used_kv_tokens=2000)
    )
    ctx = scheduler.context(scheduler.view(snapshot, NOW), None)
    assert ctx.metric("kv_growth_tokens")[1] == 4 * 300


def test_expected_output_prefers_the_estimate_then_max_tokens_then_the_default() -> None:
    assert expected_output_tokens(make_request(expected_output_tokens=50, max_tokens=90), 7) == 50
    assert expected_output_tokens(make_request(max_tokens=90), 7) == 90
    assert expected_output_tokens(make_request(), 7) == 7
    with pytest.raises(ValueError, match="max_tokens"):
        ScheduleInput("r", 10, max_tokens=-1)


# ----------------------------------------------------------------------------- TPOT horizon and e2e pace


def test_tpot_horizon_grows_with_strictness() -> None:
    snapshot, _ = _loaded_fleet([(500, 800, 10)] * 6)
    values = []
    for gamma in (0.0, 0.5, 1.0):
        scheduler = make_scheduler("binpack", tpot_slo_ms=1000.0, tpot_packing_strictness=gamma)
        for k in range(6):
            scheduler.inflight.record(f"old{k}", "p", "d", 500, NOW - 1, final_tokens=1300)
        ctx = scheduler.context(scheduler.view(snapshot, NOW), make_request("n", 100, max_tokens=400))
        values.append(float(ctx.metric("predicted_tpot_horizon")[1]))
    assert values[0] < values[1] < values[2]


def test_an_e2e_only_request_is_packed_to_the_pace_its_deadline_needs() -> None:
    # A decoder at about 27 ms per step: fine for the 50 ms TPOT default, too slow for 150 tokens in
    # 4 s (3 s after the TTFT allowance: 20 ms per token, 17 ms with the bin-packing threshold).
    decoder = inst("d", "decode", decode_requests=16, decode_tokens=16 * 900, used_kv_tokens=16 * 900)
    snapshot = make_snapshot(inst("p", "prefill"), decoder, inst("e", "decode"))
    scheduler = make_scheduler("binpack", tpot_slo_ms=50.0)
    paced = make_request("paced", 100, max_tokens=150, e2e_slo_ms=4000.0)
    loose = make_request("loose", 100, max_tokens=150)
    assert scheduler.schedule(snapshot, loose, NOW).decode.instance_id == "d"
    assert scheduler.schedule(snapshot, paced, NOW).decode.instance_id == "e"


# ----------------------------------------------------------------------------- best fit


def test_binpack_picks_the_fullest_instance_that_meets_every_constraint() -> None:
    snapshot = make_snapshot(
        inst("p", "prefill"),
        inst("light", "decode", decode_requests=2, decode_tokens=400, used_kv_tokens=400),
        inst("heavy", "decode", decode_requests=6, decode_tokens=1800, used_kv_tokens=1800),
        inst(
            "full",
            "decode",
            decode_requests=6,
            decode_tokens=1800,
            used_kv_tokens=1800,
            meta={"kv_capacity_tokens": 2500},
        ),
        inst("idle", "decode"),
    )
    scheduler = make_scheduler("binpack", tpot_slo_ms=200.0)
    decision = scheduler.schedule(snapshot, make_request("r", 100, max_tokens=100), NOW)
    assert decision.decode.instance_id == "heavy" and decision.decode.fallback_pass == 0
    # least-requests spreads instead.
    spread = make_scheduler("least-requests").schedule(snapshot, make_request("r", 100, max_tokens=100), NOW)
    assert spread.decode.instance_id == "idle"


# ----------------------------------------------------------------------------- safety valve


def _with_steps(record: InstanceRecord, *durations_ms: float) -> InstanceRecord:
    assert record.status is not None
    for ms in durations_ms:
        record.status.step_samples.add(num_decode_requests=4, num_decode_tokens=2000, duration_ms=ms)
    return record


@pytest.mark.parametrize("policy", ["binpack", "adaptive"])
def test_safety_valve_stops_decode_on_an_instance_measured_over_its_target(policy: str) -> None:
    def fleet(hot_ms: float) -> ClusterSnapshot:
        return make_snapshot(
            inst("p", "prefill"),
            _with_steps(
                inst("hot", "decode", decode_requests=4, decode_tokens=2000, used_kv_tokens=2000),
                hot_ms,
                hot_ms,
            ),
            inst("cool", "decode", decode_requests=1, decode_tokens=300, used_kv_tokens=300),
        )

    extra = {"enable_adaptive_pd": True} if policy == "adaptive" else {}
    scheduler = make_scheduler("slo" if policy == "adaptive" else "binpack", tpot_slo_ms=60.0, **extra)
    request = make_request("r", 100, max_tokens=50)
    assert (
        scheduler.schedule(fleet(20.0), request, NOW, dry_run=True).decode.instance_id == "hot"
    )  # packs when healthy
    assert scheduler.schedule(fleet(75.0), request, NOW, dry_run=True).decode.instance_id == "cool"  # valve


def test_safety_valve_reads_kv_saturation_when_no_preemptions_are_reported() -> None:
    snapshot = make_snapshot(
        inst("a", "decode", used_kv_tokens=99_500),
        inst("b", "decode", used_kv_tokens=50_000),
        _with_steps(inst("c", "decode", used_kv_tokens=10), 80.0),
    )
    table = make_scheduler("binpack").view(snapshot, NOW).instances
    assert overpacked_mask(table, 50.0, 1.0).tolist() == [1.0, 0.0, 1.0]
    table = dataclasses.replace(table, preempting=np.array([0.0, 1.0, 0.0]))
    assert overpacked_mask(table, 50.0, 1.0).tolist() == [0.0, 1.0, 1.0]


@PROPS
@given(
    st.lists(st.tuples(st.integers(0, 12), st.sampled_from([0.0, 10.0, 30.0, 80.0])), min_size=1, max_size=6)
)
def test_the_valve_never_lets_a_packed_decision_land_on_an_overpacked_instance(
    decoders: list[tuple[int, float]],
) -> None:
    records = [inst("p", "prefill")]
    for k, (batch, step_ms) in enumerate(decoders):
        record = inst(
            f"d{k}", "decode", decode_requests=batch, decode_tokens=batch * 300, used_kv_tokens=batch * 300
        )
        records.append(_with_steps(record, step_ms) if step_ms else record)
    snapshot = make_snapshot(*records)
    scheduler = make_scheduler("binpack", tpot_slo_ms=50.0)
    decision = scheduler.schedule(snapshot, make_request("r", 200, max_tokens=100), NOW, dry_run=True)
    chosen = decision.decode
    batch, step_ms = decoders[int(chosen.instance_id[1:])]
    if chosen.fallback_pass < 2:
        assert step_ms <= 50.0
    else:  # only when every decoder is over-packed
        assert all(s > 50.0 for _, s in decoders)


# ----------------------------------------------------------------------------- capacity model


def test_capacity_estimate_grows_with_the_rate_and_respects_kv() -> None:
    lp = make_predictor()
    shapes = [LoadShape(rate, 500.0, 200.0) for rate in (1.0, 4.0, 16.0)]
    counts = [estimate_instances(lp, s, tpot_target_ms=30.0) for s in shapes]
    for a, b in itertools.pairwise(counts):
        assert b.prefill >= a.prefill and b.decode >= a.decode and b.neutral >= a.neutral
    assert counts[-1].decode > counts[0].decode
    batch, _ = decode_batch(lp, shapes[0], tpot_target_ms=1e9, kv_capacity_tokens=7000.0, kv_headroom=1.0)
    assert batch == 10  # 10 x 700 tokens fill 7000
    assert estimate_instances(lp, LoadShape(0.0, 1.0, 1.0), tpot_target_ms=30.0).decode == 0


def test_a_deadline_no_instance_can_keep_does_not_tighten_packing() -> None:
    # 150 tokens in 1.5 s leaves under 10 ms per token: faster than even an idle instance (13 ms here), so
    # the request keeps the TPOT default and packs like any other rather than opening an instance.
    decoder = inst("d", "decode", decode_requests=16, decode_tokens=16 * 900, used_kv_tokens=16 * 900)
    snapshot = make_snapshot(inst("p", "prefill"), decoder, inst("e", "decode"))
    scheduler = make_scheduler("binpack", tpot_slo_ms=50.0)
    lost = make_request("lost", 100, max_tokens=150, e2e_slo_ms=1500.0)
    assert scheduler.schedule(snapshot, lost, NOW).decode.instance_id == "d"


# ----------------------------------------------------------------------------- adaptive PD's prefill room


def _room(snapshot: ClusterSnapshot, scheduler: Scheduler | None = None) -> dict[str, bool]:
    scheduler = scheduler or make_scheduler("slo", enable_adaptive_pd=True)
    # The guard alone (a decision may refuse outright when no instance can prefill in time).
    ctx = scheduler.context(scheduler.view(snapshot, NOW), make_request("r", 100, max_tokens=50), NOW)
    for hook in scheduler.policy.hooks:
        hook.prepare(ctx)
    return dict(zip(ctx.view.instances.ids, prefill_room_mask(ctx).tolist(), strict=True))


def test_prefill_room_opens_a_decoder_only_while_two_other_idle_instances_can_prefill() -> None:
    decoders = [inst(f"d{k}", decode_requests=k + 1, decode_tokens=500) for k in range(2)]
    idle = [inst(f"i{k}") for k in range(3)]
    room = _room(make_snapshot(*decoders, *idle))  # opening one leaves two: allowed
    assert all(room[f"i{k}"] for k in range(3)) and room["d0"] and room["d1"]
    room = _room(make_snapshot(*decoders, *idle[:2]))  # opening one would leave one: refused
    assert not any(room[f"i{k}"] for k in range(2))
    assert room["d0"] and room["d1"]


def test_prefill_room_drains_the_lightest_decoder_when_no_idle_instance_can_prefill_in_time() -> None:
    decoders = [
        inst("heavy", decode_requests=9, decode_tokens=900),
        inst("light", decode_requests=2, decode_tokens=200),
    ]
    backlogged = [inst(f"i{k}", prefill_tokens=60_000) for k in range(3)]
    room = _room(make_snapshot(*decoders, *backlogged, inst("spare", decode_requests=5, decode_tokens=500)))
    assert not any(room[f"i{k}"] for k in range(3))
    assert room["heavy"] and room["spare"] and not room["light"]


def test_prefill_room_opens_a_decoder_past_the_margin_when_every_decoder_runs_its_cap() -> None:
    # Three instances: one decodes, two are decode-idle. Opening one leaves one to prefill, under
    # the margin, so with free slots the decoder keeps the decode work; once it runs its engine's
    # sequence cap a leg waits for a slot whatever prefill room is kept, and (the placed demand
    # calling for two decoders) an idle instance may open.
    def fleet(running: int) -> ClusterSnapshot:
        decoder = inst(
            "d0", meta={"max_num_seqs": 4}, running=running, decode_requests=running, decode_tokens=500
        )
        return make_snapshot(decoder, *[inst(f"i{k}", meta={"max_num_seqs": 4}) for k in range(2)])

    scheduler = _sized(prompt=200, output=400, rate=4.0)
    room = _room(fleet(running=2), scheduler)
    assert room["d0"] and not room["i0"] and not room["i1"]
    room = _room(fleet(running=4), _sized(prompt=200, output=400, rate=4.0))
    assert room["d0"] and room["i0"] and room["i1"]
    # A demand one decoder serves keeps the margin, full or not.
    room = _room(fleet(running=4), _sized(prompt=2000, output=2, rate=0.5))
    assert not room["i0"] and not room["i1"]


def test_the_decode_batch_is_bounded_by_the_engines_sequence_cap() -> None:
    lp = make_predictor()
    shape = LoadShape(4.0, 200.0, 100.0)
    free, _ = decode_batch(lp, shape, tpot_target_ms=1e9, kv_capacity_tokens=1e9)
    capped, _ = decode_batch(lp, shape, tpot_target_ms=1e9, kv_capacity_tokens=1e9, max_batch=6)
    assert free > 6 and capped == 6
    rates = instance_rates(lp, mean_prompt_tokens=200.0, mean_output_tokens=100.0, tpot_target_ms=1e9)
    rates6 = instance_rates(
        lp, mean_prompt_tokens=200.0, mean_output_tokens=100.0, tpot_target_ms=1e9, max_batch=6
    )
    assert rates6.decode_batch == 6 < rates.decode_batch
    assert rates6.decode_tokens_per_s < rates.decode_tokens_per_s
    # The fleet's typical cap: the median of those stated (0, inf and NaN state none).
    assert median_seq_cap([0, math.inf, 8, 4, 6, math.nan]) == 6
    assert median_seq_cap([0, math.inf]) == median_seq_cap([]) == MAX_BATCH


def test_decoder_cap_splits_the_fleet_in_proportion_to_the_demands() -> None:
    assert decoder_cap(8, 3.5, 3.7) == 4  # overloaded: the decode share, rounded
    assert decoder_cap(8, 4.4, 4.1) == 4
    assert decoder_cap(8, 6.0, 3.0) == 3
    assert decoder_cap(8, 1.0, 1.1) == 4  # light load: the share is more than decode needs
    assert decoder_cap(8, 5.0, 1.2) == 2  # ... and at least its whole demand while prefill fits beside it
    assert decoder_cap(2, 2.0, 0.01) == 1  # never below one
    assert decoder_cap(3, 0.0, 5.0) == 3  # never above the fleet
    assert decoder_cap(4, 0.0, 0.0) == 4  # nothing measured: no bound
    assert decoder_cap(0, 1.0, 1.0) == 0


def _sized(prompt: int, output: int, rate: float = 2.0) -> Scheduler:
    """An adaptive PD scheduler whose decode-share hook has seen a minute of ``prompt``/``output`` load."""
    scheduler = make_scheduler("slo", enable_adaptive_pd=True)
    (share,) = [h for h in scheduler.policy.hooks if isinstance(h, DecodeShare)]
    for k in range(int(60 * rate)):
        share.load.observe(NOW - 60.0 + k / rate, prompt, output)
    return scheduler


def test_the_decode_share_counts_dispatched_placements_not_decisions() -> None:
    # The router queue re-offers a late request whose placement came from a fallback pass and keeps
    # it waiting: that decision is committed but never dispatched, and must not count as load.
    scheduler = make_scheduler("slo", enable_adaptive_pd=True)
    (share,) = [h for h in scheduler.policy.hooks if isinstance(h, DecodeShare)]
    snapshot = make_snapshot(inst("a"), inst("b"), inst("c"))
    request = make_request("r", 500, max_tokens=100)
    for _ in range(5):
        scheduler.schedule(snapshot, request, NOW)
    assert len(share.load) == 0
    decision = scheduler.schedule(snapshot, request, NOW)
    scheduler.record(decision, NOW)
    assert len(share.load) == 1
    scheduler.record(decision, NOW, prompt_tokens=540)  # a decode re-placement: no new load
    assert len(share.load) == 1
    scheduler.dispatched(decision, NOW + 1.0)  # a caller with its own in-flight account (the simulator)
    shape = share.load.shape(NOW + 1.0)
    assert len(share.load) == 2 and shape.mean_prompt_tokens == 500 and shape.mean_output_tokens == 100


def test_the_decode_set_grows_no_further_than_the_demand_it_serves_calls_for() -> None:
    # Long prompts, short answers: the demand is nearly all prefill, so one decoder is the decode
    # share of six instances. Two already decode: the lightest drains, and no decode-idle instance
    # is opened although the prefill side has room (the old guard looked at the room only).
    decoders = [
        inst("d0", decode_requests=6, decode_tokens=600),
        inst("d1", decode_requests=2, decode_tokens=200),
    ]
    idle = [inst(f"i{k}") for k in range(4)]
    snapshot = make_snapshot(*decoders, *idle)
    room = _room(snapshot, _sized(prompt=1000, output=2))
    assert not any(room[f"i{k}"] for k in range(4))
    assert [room["d0"], room["d1"]].count(True) == 1  # the reserved decode stays, the other drains
    # Long answers: the decode share is larger than two, so an idle instance may open as before.
    room = _room(snapshot, _sized(prompt=100, output=1000))
    assert all(room[f"i{k}"] for k in range(4)) and room["d0"] and room["d1"]


def test_decode_waits_rather_than_open_a_decoder_the_prefill_side_cannot_spare() -> None:
    # No decoder keeps the TPOT target and the prefill side has one instance free: the
    # last fallback pass used to convert one of them anyway (a decoder opened in overload, prefill
    # capacity lost); the prefill-room guard now holds in every pass and the request waits.
    scheduler = make_scheduler("slo", enable_adaptive_pd=True, tpot_slo_ms=30.0)
    snapshot = make_snapshot(
        inst("d0", decode_requests=40, decode_tokens=40_000),
        inst("d1", decode_requests=30, decode_tokens=30_000),
        inst("i0"),  # takes the prefill
        *[inst(f"i{k}", prefill_tokens=60_000) for k in (1, 2)],
    )
    with pytest.raises(NoInstanceError) as info:
        scheduler.schedule(snapshot, make_request("r", 100, max_tokens=50), NOW)
    assert info.value.stage == "decode" and "prefill_room" in str(info.value)


def test_packing_flags_are_checked_and_named() -> None:
    from router.core.config import SchedulerConfig
    from router.core.errors import ConfigError

    for field, value in (
        ("tpot_packing_strictness", 1.5),
        ("tpot_binpack_threshold", 0.0),
        ("kv_packing_headroom", 1.2),
        ("packing_default_output_tokens", 0),
        ("binpack_max_batch", 0),
        ("overpacked_tpot_factor", float("nan")),
    ):
        with pytest.raises(ConfigError, match=field):
            SchedulerConfig(**{field: value})


# ----------------------------------------------------------------------------- residents of a colocated instance


def _colocated(scheduler: Scheduler) -> ClusterSnapshot:
    """Two neutral instances: "near-done" holds 4 decodes with 5 tokens left each (the router placed
    them), "long" holds 12 decodes of unknown length (the default output left each)."""
    for k in range(4):
        scheduler.inflight.record(f"old{k}", None, "near-done", 95, NOW, final_tokens=105)
    return make_snapshot(
        inst("near-done", decode_requests=4, decode_tokens=400, admitted=[f"old{k}" for k in range(4)]),
        inst("long", decode_requests=12, decode_tokens=1200),
    )


def test_slo_keeps_a_prompt_off_an_instance_whose_residents_it_would_push_over_their_tpot() -> None:
    # The prompt's own TPOT fits both instances, and "near-done" predicts the lower TTFT (smaller
    # batch); but its 180 ms prefill, spread over the 5 tokens its residents have left, takes them
    # from about 15 ms to about 51 ms per token, over the 40 ms target. On "long" the same stall is
    # spread over 256 tokens.
    scheduler = make_scheduler("slo", tpot_slo_ms=40.0)
    snapshot = _colocated(scheduler)
    request = make_request(prompt_tokens=1024, max_tokens=64)
    view = scheduler.view(snapshot, NOW)
    ctx = scheduler.context(view, request, NOW)
    near, long_ = view.instances.index["near-done"], view.instances.index["long"]
    ttft, tpot = ctx.metric("predicted_ttft"), ctx.metric("predicted_tpot")
    residents = ctx.metric("predicted_tpot_residents")
    assert ttft[near] < ttft[long_] and tpot[near] < 40.0 and tpot[long_] < 40.0
    assert residents[near] > 40.0 > residents[long_]
    decision = scheduler.schedule(snapshot, request, NOW)
    assert decision.instance_ids == ("long",)
    assert {e.instance_id: e.dropped_by for e in decision.trace}["near-done"] == "tpot_residents"


def test_residents_tpot_counts_the_backlog_and_the_prompt_and_nothing_without_residents() -> None:
    scheduler = make_scheduler("slo")
    snapshot = make_snapshot(
        inst("idle"),
        inst("busy", decode_requests=8, decode_tokens=800),
        inst("queued", decode_requests=8, decode_tokens=800, prefill_tokens=1024),
    )
    view = scheduler.view(snapshot, NOW)
    small = scheduler.context(view, make_request(prompt_tokens=128), NOW).metric("predicted_tpot_residents")
    large = scheduler.context(view, make_request(prompt_tokens=1024), NOW).metric("predicted_tpot_residents")
    i = view.instances.index
    assert small[i["idle"]] == 0.0 == large[i["idle"]]  # nobody there to slow down
    assert large[i["busy"]] > small[i["busy"]]  # a longer prompt stalls the residents longer
    assert small[i["queued"]] > small[i["busy"]]  # and so do the chunks queued ahead of it


@PROPS
@given(
    st.lists(
        st.tuples(st.integers(0, 40), st.integers(0, 60_000), st.integers(0, 40), st.integers(0, 90_000)),
        min_size=1,
        max_size=8,
    ),
    st.lists(st.tuples(st.integers(0, 7), st.integers(1, 5000), st.integers(0, 3000)), max_size=12),
)
def test_one_instances_kv_growth_equals_its_entry_in_the_column_exactly(
    statuses: list[tuple[int, int, int, int]], legs: list[tuple[int, int, int]]
) -> None:
    # The load-scoped update recomputes only the touched instances with ``at``: it must give the
    # column's very values (decisions compare them), not values within a tolerance.
    snapshot = make_snapshot(
        *(
            inst(f"d{k}", "decode", decode_requests=b, decode_tokens=t, used_kv_tokens=min(u, 90_000))
            for k, (b, t, _, u) in enumerate(statuses)
        )
    )
    scheduler = make_scheduler("slo")
    for j, (k, tokens, output) in enumerate(legs):
        if k < len(statuses):
            scheduler.inflight.record(f"r{j}", None, f"d{k}", tokens, NOW, final_tokens=tokens + output)
    ctx = scheduler.context(scheduler.view(snapshot, NOW), None)
    metric = METRICS.create("kv_growth_tokens", scheduler.config)
    column = metric.compute(ctx)
    at = getattr(metric, "at")  # noqa: B009 (what DecisionContext looks up)
    assert [at(ctx, i) for i in range(len(statuses))] == column.tolist()
