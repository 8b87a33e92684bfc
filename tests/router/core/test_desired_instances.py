"""The autoscaling signal's model: Aladdin's Eq. 7 per role, fitted online over heartbeats of placed load."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.capacity import InstanceRates, LoadShape, decode_staffing, fluid_demand, instance_rates
from router.core.worker_count import (
    DesiredInstances,
    Heartbeat,
    WorkerCountModel,
    least_slack,
    second_moment_ratio,
)
from tests.router.core.helpers import make_predictor

#: An instance computes 10,000 prompt tokens and generates 1,000 output tokens a second.
RATES = InstanceRates(
    prefill_tokens_per_s=10_000.0, decode_tokens_per_s=1_000.0, decode_batch=50, decode_step_ms=50.0
)


def _fixed(load: LoadShape, tpot_ms: float) -> InstanceRates:
    return RATES


def _feed(
    model: DesiredInstances, rate: float, seconds: float, *, start: float = 0.0, learned: bool = True
) -> float:
    """``rate`` requests/s of 1,000-token prompts and 100-token answers (alternating 50 / 150)."""
    n = int(rate * seconds)
    for k in range(n):
        model.observe(start + k / rate, 1000, 50.0 if k % 2 else 150.0, learned=learned)
    return start + n / rate


def test_the_fit_is_the_fluid_demand_of_the_load_and_answers_at_the_current_rate() -> None:
    model = DesiredInstances(_fixed, heartbeat_s=10.0)
    # 30 req/s: 3 prefill instances (30k tokens/s); 3 decoders for the mean, 150 requests decoding
    # at once, staffed for its Poisson spread: (150 + 1.645·√150) / 50 = 3.40 decoders.
    end = _feed(model, 30.0, 120.0)
    want = model.desired(end, LoadShape(30.0, 1000.0, 100.0))
    assert want.fitted and want.heartbeats >= 10
    assert (want.prefill, want.decode, want.neutral) == (3, 4, 7)
    # The same fit read at a higher rate: Eq. 7 extrapolates the line through the samples (all at
    # one rate: proportional, 0.1 prefill and 0.113 decoders per req/s).
    high = model.desired(end, LoadShape(55.0, 1000.0, 100.0))
    assert (high.prefill, high.decode, high.neutral) == (6, 7, 12)
    assert model.desired(end, LoadShape(0.0, 0.0, 0.0)).prefill == 0  # no load, nothing wanted


def test_heartbeats_before_lengths_are_learned_are_left_out() -> None:
    model = DesiredInstances(_fixed, heartbeat_s=10.0)
    end = _feed(model, 30.0, 60.0, learned=False)  # the prior (max_tokens) would be charged as load
    want = model.desired(end, LoadShape(30.0, 1000.0, 100.0))
    assert not want.fitted and want.heartbeats == 0 and want.left_out >= 5
    # Unfitted, it answers with the last window's fluid demand (decoders staffed), rounded up.
    assert (want.prefill, want.decode) == (3, 4)


def test_rates_too_close_for_a_slope_give_a_proportional_fit() -> None:
    model = WorkerCountModel(min_samples=3, min_rate_spread=0.25)
    for rate, workers in ((10.0, 2.2), (10.5, 1.9), (9.5, 2.1), (10.2, 1.8)):
        model.observe(Heartbeat(rate, workers, 400, 0.5))
    k5, c5 = model.coefficients() or (math.nan, math.nan)
    # Noise alone would fit a negative slope here; the proportional line goes through the mean.
    assert c5 == 0.0 and k5 == pytest.approx(8.0 / 40.2, rel=1e-3)  # (decayed weights)


def test_instance_rates_decode_batch_meets_the_target_and_fits_the_kv() -> None:
    predictor = make_predictor()
    for target in (30.0, 50.0, 80.0):
        r = instance_rates(
            predictor,
            mean_prompt_tokens=500,
            mean_output_tokens=200,
            tpot_target_ms=target,
            kv_capacity_tokens=65536,
        )
        assert r.decode_batch == 1 or r.decode_step_ms <= target
        assert r.decode_batch * 600 <= 0.95 * 65536 or r.decode_batch == 1
        assert r.decode_tokens_per_s == pytest.approx(1000.0 * r.decode_batch / r.decode_step_ms)
    loose = instance_rates(predictor, mean_prompt_tokens=500, mean_output_tokens=200, tpot_target_ms=80.0)
    tight = instance_rates(predictor, mean_prompt_tokens=500, mean_output_tokens=200, tpot_target_ms=30.0)
    assert loose.decode_tokens_per_s >= tight.decode_tokens_per_s


@settings(max_examples=60, deadline=None)
@given(
    rate=st.floats(0.5, 200.0),
    prompt=st.floats(1.0, 8000.0),
    output=st.floats(1.0, 2000.0),
    scale=st.floats(1.0, 4.0),
)
def test_fluid_demand_is_linear_in_the_rate_and_never_negative(
    rate: float, prompt: float, output: float, scale: float
) -> None:
    base = fluid_demand(LoadShape(rate, prompt, output), RATES)
    more = fluid_demand(LoadShape(rate * scale, prompt, output), RATES)
    assert min(base) >= 0
    assert more[0] == pytest.approx(base[0] * scale) and more[1] == pytest.approx(base[1] * scale)


@settings(max_examples=60, deadline=None)
@given(fluid=st.floats(0.0, 500.0), batch=st.integers(1, 1024))
def test_decoders_are_staffed_above_the_mean_by_a_share_that_shrinks_with_the_load(
    fluid: float, batch: int
) -> None:
    staffed = decode_staffing(fluid, batch)
    assert staffed >= fluid
    # The margin is z·√m / B decoders: its share of the load falls as the load grows.
    if fluid > 0:
        bigger = decode_staffing(4 * fluid, batch)
        assert bigger / (4 * fluid) <= staffed / fluid + 1e-12
        assert staffed - fluid == pytest.approx(1.645 * math.sqrt(fluid * batch) / batch)


@settings(max_examples=60, deadline=None)
@given(
    fluid=st.floats(0.1, 500.0),
    batch=st.integers(1, 1024),
    slack=st.floats(0.0, 2.0),
    more=st.floats(0.0, 2.0),
)
def test_slack_against_the_pace_lowers_the_margin_and_never_below_the_mean(
    fluid: float, batch: int, slack: float, more: float
) -> None:
    none = decode_staffing(fluid, batch)
    some = decode_staffing(fluid, batch, slacks=[slack])
    larger = decode_staffing(fluid, batch, slacks=[slack + more])
    assert fluid <= larger <= some + 1e-9 <= none + 2e-9
    # A request with no slack (its pace is the step) keeps the whole margin.
    assert decode_staffing(fluid, batch, slacks=[0.0]) == pytest.approx(none)


def test_a_kv_bound_decoder_with_time_to_spare_needs_a_smaller_margin() -> None:
    # 88 requests decoding at once on decoders of 48 (the Azure trace at 8 req/s): 1.83 for the mean.
    fluid, batch = 88.0 / 48.0, 48
    assert math.ceil(decode_staffing(fluid, batch)) == 3  # every moment over 96 counted as a miss
    # Stepping 42.5 ms against a 50 ms target, a request can wait 18 % of its life for a slot.
    assert math.ceil(decode_staffing(fluid, batch, slacks=[50.0 / 42.5 - 1.0])) == 2


def test_the_margin_protects_the_kind_of_request_with_the_least_time_to_spare() -> None:
    rates = InstanceRates(10_000.0, 1000.0, 48, 40.0)  # a decoder stepping 40 ms
    chat = {(50.0, 0.0): (60, 60 * 500.0, 60 * 200.0)}  # 50 ms TPOT: a quarter of its life to spare
    assert least_slack(chat, rates, 50.0) == pytest.approx(0.25)
    # A 4 s deadline paced over 160-token answers after a 100 ms prefill: 23.6 ms a token, under
    # the step: no time to spare, and the few such requests set the margin for all.
    code = {(0.0, 4000.0): (5, 5 * 1000.0, 5 * 160.0)}
    assert least_slack({**chat, **code}, rates, 50.0) == 0.0
    # A loose deadline (60 s over 640 tokens) does not.
    batch = {(0.0, 60_000.0): (30, 30 * 500.0, 30 * 640.0)}
    assert least_slack({**chat, **batch}, rates, 50.0) == pytest.approx(0.25)
    # Neither target: the default TPOT target.
    assert least_slack({(0.0, 0.0): (3, 300.0, 300.0)}, rates, 40.0) == 0.0


def test_a_deadline_paced_by_its_length_tail_keeps_the_whole_margin() -> None:
    # 28 req/s of 100-token answers on decoders of 50 stepping 40 ms against a 50 ms target: 2.8
    # decoders for the mean, 140 requests decoding at once; a quarter judged by a 5 s deadline.
    def rates(load: LoadShape, tpot_ms: float) -> InstanceRates:
        return InstanceRates(10_000.0, 1000.0, 50, 40.0)

    def run(paced: float) -> DesiredInstances:
        model = DesiredInstances(rates, heartbeat_s=10.0)
        for k in range(28 * 120):
            t = k / 28.0
            if k % 4:
                model.observe(t, 1000, 100.0, tpot_ms=50.0)
            else:
                model.observe(t, 1000, 100.0, e2e_ms=5000.0, paced_tokens=paced)
        return model

    shape = LoadShape(28.0, 1000.0, 100.0)
    # Paced at the mean length (100 tokens) the deadline leaves 49.5 ms a token after a 100 ms
    # prefill, chat's 25 % slack is the least, and the margin shrinks: (140 + 0.55·√140) / 50 =
    # 2.93. Paced at 200 tokens it leaves 24.6 ms, under the step: (140 + 1.645·√140) / 50 = 3.19.
    loose = run(0.0).desired(120.0, shape).decode
    tight = run(200.0).desired(120.0, shape).decode
    assert (loose, tight) == (3, 4)


def test_erlang_c_matches_the_closed_forms() -> None:
    from router.core.capacity import erlang_c

    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: an arrival waits with probability ρ
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)  # (a²/2 · 2/(2 − a)) / (1 + a + that)
    assert erlang_c(3, 3.0) == 1.0 and erlang_c(3, 0.0) == 0.0


#: A prefill instance of the bundled profile: 2,048-token chunks in 274.65 ms, 80 % of that rate.
PREFILL_RATES = InstanceRates(
    prefill_tokens_per_s=0.8 * 2048 / 0.27465,
    decode_tokens_per_s=1_000.0,
    decode_batch=46,
    decode_step_ms=42.0,
)


def test_few_prefill_instances_are_staffed_for_the_ttft_target_not_a_utilisation_cap() -> None:
    """The Azure conversation trace's last minute at 12 req/s: 9.7 req/s of 1,212-token prompts. At
    80 % of their full rate that is 1.97 prefill instances, so 2; but on two instances a prompt waits
    past the 1 s TTFT target about 8 % of the time (Erlang's C, 0.70, times exp(−(c − a)·t/s) with
    a = 1.58, s = 0.16 s, t = 0.84 s), and ``plan`` needs three there (2 + 3 met 92.8 %)."""
    from router.core.capacity import prefill_staffing

    load = LoadShape(9.7, 1212.0, 265.0)
    fluid, _ = fluid_demand(load, PREFILL_RATES)
    assert math.ceil(fluid) == 2
    assert math.ceil(prefill_staffing(load, PREFILL_RATES, 1000.0)) == 3
    # At 8 req/s two keep the tail (1.2 %): fractional between the offered load and 2, so a
    # heartbeat a little busier does not read as a whole instance more.
    eight = LoadShape(8.0, 1212.0, 265.0)
    assert 1.5 < prefill_staffing(eight, PREFILL_RATES, 1000.0) <= 2.0
    # Without a TTFT target, or one a prompt alone cannot keep, the fluid demand stands.
    assert prefill_staffing(load, PREFILL_RATES, 0.0) == fluid
    assert prefill_staffing(load, PREFILL_RATES, 100.0) == fluid
    # Many instances share the queue: it keeps the tail closer to full use than the utilisation cap
    # (60 req/s: 9.5 instances' worth of prompts, 11 of them keep 5 %), never below the offered load.
    big = LoadShape(60.0, 1212.0, 265.0)
    offered = 0.8 * fluid_demand(big, PREFILL_RATES)[0]
    assert offered < prefill_staffing(big, PREFILL_RATES, 1000.0) <= math.ceil(offered) + 1


def test_the_queue_replaces_the_utilisation_cap_where_a_ttft_target_is_known() -> None:
    """The Azure trace's last minute at 16 req/s: 14.2 req/s of 1,264-token prompts, 2.41 instances'
    worth. At the 80 % cap that is 3.02 instances, so 4; but three keep the 1 s TTFT target for all
    but 3.7 % of the prompts (Erlang's C, 0.65, times exp(−0.59 · 0.83 / 0.17)), and ``plan`` on
    those requests (``scripts/desired_vs_plan.py --window``, ``slo`` placement) is 3 + 4 at 98.5 %.
    The signal asks 3."""
    from router.core.capacity import erlang_c, prefill_staffing

    load = LoadShape(14.2, 1264.0, 250.0)
    fluid, _ = fluid_demand(load, PREFILL_RATES)
    assert math.ceil(fluid) == 4  # the cap alone
    full = PREFILL_RATES.prefill_tokens_per_s / PREFILL_RATES.prefill_utilisation
    service, offered = 1264.0 / full, 14.2 * 1264.0 / full
    assert erlang_c(3, offered) * math.exp(-(3 - offered) * (1.0 - service) / service) < 0.05
    assert math.ceil(prefill_staffing(load, PREFILL_RATES, 1000.0)) == 3

    def rates(load: LoadShape, tpot_ms: float) -> InstanceRates:
        return PREFILL_RATES

    model = DesiredInstances(rates, heartbeat_s=10.0)
    n = int(14.2 * 120)
    for k in range(n):
        model.observe(k / 14.2, 1264, 250.0, tpot_ms=50.0, ttft_ms=1000.0)
    got = model.desired(n / 14.2, load)
    assert got.fitted and got.prefill == 3, got


def test_the_signal_is_eq7s_line_not_the_last_windows_staffing_rounded_up() -> None:
    """Two prefill instances at 80 % of their full rate sit at the queue model's step. Fed a minute
    of heartbeats at 9.3 req/s of 1,190-token prompts (staffed 1.97 each), Eq. 7's line says 2 at
    that rate. The last window's own load, a little longer prompts (1,219 tokens), is staffed 2.02:
    as a floor under the line (before) its ceiling asked 3, where ``plan`` with the router queue on
    the Azure trace's last minute (9.8 req/s of 1,219-token prompts) needs 2 + 3 (96.2 %)."""
    from router.core.capacity import prefill_staffing

    def rates(load: LoadShape, tpot_ms: float) -> InstanceRates:
        return PREFILL_RATES

    window = LoadShape(9.3, 1219.0, 265.0)
    assert math.ceil(prefill_staffing(window, PREFILL_RATES, 1000.0)) == 3
    model = DesiredInstances(rates, heartbeat_s=10.0)
    n = int(9.3 * 120)
    for k in range(n):
        model.observe(k / 9.3, 1190, 265.0, tpot_ms=50.0, ttft_ms=1000.0)
    line = model.models["prefill"].predict(window.rate)
    got = model.desired(n / 9.3, window)
    assert got.fitted and line == 2 and got.prefill == 2, got
    assert got.neutral == model.models["neutral"].predict(window.rate)


@settings(max_examples=60, deadline=None)
@given(
    rate=st.floats(0.1, 200.0),
    prompt=st.floats(16.0, 8192.0),
    ttft=st.floats(0.0, 10_000.0),
)
def test_prefill_staffing_is_above_the_offered_load_and_keeps_the_wait_tail(
    rate: float, prompt: float, ttft: float
) -> None:
    from router.core.capacity import PREFILL_WAIT_TAIL, erlang_c, prefill_staffing

    load = LoadShape(rate, prompt, 100.0)
    fluid, _ = fluid_demand(load, PREFILL_RATES)
    staffed = prefill_staffing(load, PREFILL_RATES, ttft)
    full = PREFILL_RATES.prefill_tokens_per_s / PREFILL_RATES.prefill_utilisation
    service, offered = prompt / full, rate * prompt / full
    wait = ttft / 1000.0 - service
    if wait <= 0 or ttft <= 0:  # no target a queue can keep: the utilisation cap
        assert staffed == fluid
    else:  # the queue: more than the offered load (it would grow without end), and the tail kept
        assert staffed > offered
        c = math.ceil(staffed)
        assert erlang_c(c, offered) * math.exp(-(c - offered) * wait / service) <= PREFILL_WAIT_TAIL
        if c - 1 > offered:  # the least such count
            tail = erlang_c(c - 1, offered) * math.exp(-(c - 1 - offered) * wait / service)
            assert tail > PREFILL_WAIT_TAIL


def test_the_signal_staffs_the_prefill_side_for_the_least_ttft_target_it_saw() -> None:
    """Fed 9.7 req/s of 1,212-token prompts with a 1 s TTFT target, the signal asks 3 prefill
    instances; the same load with no TTFT target, the fluid demand's 2."""

    def rates(load: LoadShape, tpot_ms: float) -> InstanceRates:
        return PREFILL_RATES

    for ttft, want in ((1000.0, 3), (0.0, 2)):
        model = DesiredInstances(rates, heartbeat_s=10.0)
        n = int(9.7 * 120)
        for k in range(n):
            model.observe(k / 9.7, 1212, 265.0, tpot_ms=50.0, ttft_ms=ttft)
        got = model.desired(n / 9.7, LoadShape(9.7, 1212.0, 265.0))
        assert got.fitted and got.prefill == want, (ttft, got)


def _mixed_minute(model: DesiredInstances, rate: float, seconds: float) -> float:
    """``mixed``'s kinds of TTFT need at ``rate``: of every 20 requests 12 chat (640-token prompts,
    1 s TTFT), 5 code (1,230-token prompts, a 4 s deadline: 1 s to its first token) and 3 summaries
    (3,300-token prompts, a 15 s deadline: 3.75 s)."""
    kinds = [(640, 1000.0, 0.0)] * 12 + [(1230, 0.0, 4000.0)] * 5 + [(3300, 0.0, 15000.0)] * 3
    n = int(rate * seconds)
    for k in range(n):
        prompt, ttft, e2e = kinds[(k * 7) % 20]
        model.observe(k / rate, prompt, 200.0, ttft_ms=ttft, e2e_ms=e2e, tpot_ms=50.0 if ttft else 0.0)
    return n / rate


def test_prefill_is_staffed_for_the_router_queues_deadline_order_not_one_queue_at_the_least_need() -> None:
    """The router serves its queue by deadline: a summary whose first token may come in 3.75 s waits
    behind chat and code, whose need is 1 s, and they do not wait behind it. Priced as one FCFS queue
    at the least need (before), ``mixed`` at 16 req/s (its last minute: 16.3 req/s, a = 2.67) was
    staffed with 4 prefill instances; ``plan`` with the router queue on those requests needs 3
    (3 + 5: 95.4 %, ``scripts/desired_vs_plan.py 3000 --window mixed:16``)."""
    from router.core.capacity import prefill_staffing

    def rates(load: LoadShape, tpot_ms: float) -> InstanceRates:
        return PREFILL_RATES

    load = LoadShape(16.3, 1190.0, 200.0)
    kinds = [(12.0, 640.0, 1000.0), (5.0, 1230.0, 1000.0), (3.0, 3300.0, 3750.0)]
    single = prefill_staffing(load, PREFILL_RATES, 1000.0)
    ordered = prefill_staffing(load, PREFILL_RATES, 1000.0, kinds)
    assert math.ceil(single) == 4 and math.ceil(ordered) == 3
    # One kind (or none): the single queue.
    assert prefill_staffing(load, PREFILL_RATES, 1000.0, [(1.0, 1190.0, 1000.0)]) == single
    model = DesiredInstances(rates, heartbeat_s=10.0)
    end = _mixed_minute(model, 16.3, 120.0)
    got = model.desired(end, load)
    assert got.fitted and got.prefill == 3, got


@settings(max_examples=60, deadline=None)
@given(
    rate=st.floats(0.5, 100.0),
    prompt=st.floats(16.0, 6000.0),
    kinds=st.lists(
        st.tuples(st.floats(0.1, 10.0), st.floats(16.0, 6000.0), st.floats(200.0, 20_000.0)),
        min_size=1,
        max_size=5,
    ),
)
def test_deadline_ordered_prefill_staffing_never_exceeds_one_queue_at_the_least_need(
    rate: float, prompt: float, kinds: list[tuple[float, float, float]]
) -> None:
    """With every kind's prompts alike, each kind waits behind at most the whole load and has at
    least the least budget, so the share that misses is at most the single queue's tail at the
    least need: never more instances. Whatever the prompts, the queue stays stable: above the
    offered load, whatever share the most patient kind has (it waits behind everyone)."""
    from router.core.capacity import prefill_staffing

    least = min(need for _, _, need in kinds)
    alike = [(share, prompt, need) for share, _, need in kinds]
    load = LoadShape(rate, prompt, 200.0)
    assert (
        prefill_staffing(load, PREFILL_RATES, least, alike)
        <= prefill_staffing(load, PREFILL_RATES, least) + 1e-9
    )
    total = sum(share for share, _, _ in kinds)
    mean = sum(share * p for share, p, _ in kinds) / total
    mixed = LoadShape(rate, mean, 200.0)
    ordered = prefill_staffing(mixed, PREFILL_RATES, least, kinds)
    full = PREFILL_RATES.prefill_tokens_per_s / PREFILL_RATES.prefill_utilisation
    if least / 1000.0 > mean / full:  # a budget the queue can price
        assert ordered > rate * mean / full - 1e-9
    else:
        assert ordered == fluid_demand(mixed, PREFILL_RATES)[0]


#: The normal score of the router's length bound (``LengthConfig.quantile``, 0.9).
Z90 = 1.2815515655446004


@pytest.mark.parametrize("sigma", [0.2, 0.5, 0.8, 1.0])
def test_the_length_bound_gives_the_second_moment_of_a_lognormal_answer(sigma: float) -> None:
    mean = 250.0
    bound = mean * math.exp(Z90 * sigma - sigma * sigma / 2)  # the 0.9 quantile of that lognormal
    assert second_moment_ratio(mean, bound, Z90) == pytest.approx(math.exp(sigma * sigma), rel=1e-9)
    # No spread known (a prior, exact lengths, a bound at the mean): the mean alone.
    assert second_moment_ratio(mean, mean, Z90) == 1.0
    assert second_moment_ratio(mean, 0.0, Z90) == 1.0


@settings(max_examples=80, deadline=None)
@given(mean=st.floats(1.0, 4096.0), ratio=st.floats(1.0, 50.0), wider=st.floats(1.0, 3.0))
def test_a_wider_length_bound_never_means_a_smaller_second_moment(
    mean: float, ratio: float, wider: float
) -> None:
    narrow = second_moment_ratio(mean, mean * ratio, Z90)
    assert 1.0 <= narrow <= math.exp(Z90 * Z90) + 1e-9
    assert second_moment_ratio(mean, mean * ratio * wider, Z90) >= narrow - 1e-12


def test_decoders_are_priced_at_the_context_their_residents_hold_not_the_mean_request() -> None:
    """A request decodes for as long as its answer, so the long answers are over-represented in a
    batch: the residents' mean context is ``Σ o·(p + o/2) / Σ o``. Chat's answers (lognormal, σ 0.8:
    the length bound at 2.0× the mean) of 630-token prompts and 250-token answers hold 630 +
    250·e^0.64/2 = 867 tokens each on average, not 755: the batch a decoder keeps at the TPOT target
    is smaller (62 against 64 on the worked profile), and at 28 req/s the signal asks 7 decoders, not
    6. (In the simulator, chat at 32 req/s: the plan is 3 + 6, and priced at the mean request the
    signal asked 3 + 5.)"""
    predictor = make_predictor()
    seen: list[LoadShape] = []

    def rates(load: LoadShape, tpot_ms: float) -> InstanceRates:
        seen.append(load)
        return instance_rates(
            predictor,
            mean_prompt_tokens=load.mean_prompt_tokens,
            mean_output_tokens=load.mean_output_tokens,
            tpot_target_ms=tpot_ms,
        )

    sigma = 0.8
    bound = 250.0 * math.exp(Z90 * sigma - sigma * sigma / 2)

    def run(paced: float) -> int:
        model = DesiredInstances(rates, heartbeat_s=10.0)
        for k in range(28 * 120):
            model.observe(k / 28.0, 630, 250.0, tpot_ms=50.0, ttft_ms=1000.0, paced_tokens=paced)
        return model.desired(120.0, LoadShape(28.0, 630.0, 250.0)).decode

    spread = run(bound)
    held = seen[-1]
    assert held.mean_prompt_tokens + held.mean_output_tokens / 2 == pytest.approx(
        630 + 250 * math.exp(0.64) / 2
    )
    # Answers all of one length: the mean request is the resident.
    alike = run(250.0)
    assert spread > alike, (spread, alike)
    assert seen[-1].mean_prompt_tokens == pytest.approx(630.0)


# --------------------------------------------------------------------------- the deadline's step


def _linear_rates(load: LoadShape, tpot_ms: float) -> InstanceRates:
    """A decoder stepping ``15 + 0.6·B`` ms at batch ``B`` (at most 60): the largest batch whose
    step keeps ``tpot_ms`` (batch 1 below that), as ``capacity.instance_rates`` picks it."""
    batch = max(1, min(60, int((tpot_ms - 15.0) / 0.6 + 1e-9)))
    step = 15.0 + 0.6 * batch
    return InstanceRates(10_000.0, 1000.0 * batch / step, batch, step)


#: 25 code-like requests judged by a 4 s deadline (1,000-token prompts; answers of mean 80 tokens,
#: 150 at their 90th percentile), beside 75 chat-like ones on a 50 ms TPOT target.
CODE = {(0.0, 4000.0): (25.0, 25 * 1000.0, 25 * 150.0, 25 * 80.0, 25 * 1000.0)}
CHAT = {(50.0, 0.0): (75.0, 75 * 500.0, 75 * 200.0, 75 * 200.0, 75 * 1000.0)}


@given(
    st.floats(min_value=10.0, max_value=80.0),
    st.floats(min_value=0.5, max_value=30.0),
    st.floats(min_value=0.0, max_value=2000.0),
)
@settings(max_examples=60, deadline=None)
def test_a_slower_step_or_a_later_first_token_never_means_fewer_deadline_misses(
    step: float, slower: float, first: float
) -> None:
    from router.core.worker_count import deadline_miss_share

    z = 1.2815515655446004
    kinds = {**CODE, **CHAT}

    def at(ms: float) -> list[float]:
        return [ms]

    base = deadline_miss_share(kinds, 100.0, step, z, lambda p, n: at(first))
    assert 0.0 <= base <= 0.25  # only the code kind can miss by its length: a quarter at most
    assert deadline_miss_share(kinds, 100.0, step + slower, z, lambda p, n: at(first)) >= base - 1e-12
    assert deadline_miss_share(kinds, 100.0, step, z, lambda p, n: at(first + 100.0)) >= base - 1e-12
    # Requests on a TPOT target alone never miss by their length here (their target is the step's).
    assert deadline_miss_share(CHAT, 75.0, step, z) == 0.0


def test_deadline_judged_answers_are_given_decoders_stepping_as_fast_as_their_deadlines_need() -> None:
    from router.core.worker_count import deadline_decoders, deadline_miss_share

    z = 1.2815515655446004
    load = LoadShape(12.0, 650.0, 170.0)
    kinds = {**CODE, **CHAT}

    def rates(step: float) -> InstanceRates:
        return _linear_rates(load, step)

    # At the TPOT target's batch (58, stepping 49.8 ms) 53 % of the code answers are longer than the
    # 61 tokens their deadline leaves after a 1 s first token: 13 % of the requests, over the 5 % kept.
    assert deadline_miss_share(kinds, 100.0, rates(50.0).decode_step_ms, z) == pytest.approx(0.132, abs=0.003)
    fluid_at_target = fluid_demand(load, rates(50.0))[1]
    need = deadline_decoders(kinds, 100.0, load, rates, 50.0, z)
    assert need > fluid_at_target * 1.2
    # ... the decoders' batch then steps where the misses are within 5 %, and no slower.
    batch = round(load.rate * load.mean_output_tokens / need / 1000.0 * rates(50.0).decode_step_ms)
    assert batch < rates(50.0).decode_batch
    # No deadline-judged request, or a deadline even an idle decoder cannot keep: nothing added.
    assert deadline_decoders(CHAT, 75.0, load, rates, 50.0, z) == 0.0
    hopeless = {(0.0, 1100.0): CODE[(0.0, 4000.0)]}
    assert deadline_decoders({**hopeless, **CHAT}, 100.0, load, rates, 50.0, z) == 0.0


def test_a_first_token_is_its_prefill_and_its_wait_in_the_queue_up_to_its_need() -> None:
    from router.core.worker_count import first_token_points

    rates = InstanceRates(8000.0, 1000.0, 48, 40.0, prefill_utilisation=0.8)  # 10,000 tokens a second
    kinds = [(30.0, 1000.0, 1000.0), (10.0, 3000.0, 3750.0)]
    quiet = first_token_points(
        1000.0, 1000.0, load=LoadShape(0.1, 1500.0, 100.0), rates=rates, servers=4, ttft_kinds=kinds
    )
    assert quiet == [pytest.approx(100.0)] * len(quiet)  # no wait: its own 100 ms prefill
    busy = first_token_points(
        1000.0, 1000.0, load=LoadShape(10.0, 1500.0, 100.0), rates=rates, servers=2, ttft_kinds=kinds
    )
    assert busy == sorted(busy) and busy[0] == pytest.approx(100.0) and busy[-1] > 300.0
    assert max(busy) <= 1000.0  # a prompt waiting past its need is the prefill side's miss, not the decoders'
    over = first_token_points(
        1000.0, 1000.0, load=LoadShape(20.0, 1500.0, 100.0), rates=rates, servers=2, ttft_kinds=kinds
    )
    assert over == [1000.0] * len(over)


def test_decoders_are_sized_for_the_step_the_deadline_judged_answers_need() -> None:
    # 10 req/s: three quarters chat-like (50 ms TPOT), a quarter code-like (a 3 s deadline, answers
    # of mean 80 and 90th percentile 150 tokens). Priced at the TPOT target's batch alone, the
    # decoders step 49.8 ms, where most code answers cannot finish in time; with a fifth of them
    # let miss (5 % of the requests), they need to step at about 26 ms: batches of 18, not 58.
    def run(e2e: float) -> tuple[int, float]:
        model = DesiredInstances(_linear_rates, heartbeat_s=10.0, default_ttft_ms=1000.0)
        for k in range(10 * 120):
            t = k / 10.0
            if k % 4:
                model.observe(t, 500, 200.0, tpot_ms=50.0, paced_tokens=200.0)
            elif e2e:
                model.observe(t, 1000, 80.0, e2e_ms=e2e, paced_tokens=150.0)
            else:
                model.observe(t, 1000, 80.0, tpot_ms=50.0, paced_tokens=150.0)
        fit = model.models["decode"].coefficients()
        assert fit is not None
        return model.desired(120.0, LoadShape(10.0, 625.0, 170.0)).decode, fit[0]

    tpot_only, tpot_slope = run(0.0)
    deadline, deadline_slope = run(3000.0)
    assert (tpot_only, deadline) == (2, 3)
    assert deadline_slope > 1.4 * tpot_slope


def test_below_r_the_windows_heartbeats_pooled_staff_each_kind_for_its_own_need() -> None:
    """At 5 req/s of ``mixed``'s kinds a 5 s heartbeat holds 25 requests, too few for the SEM rule
    (their lengths vary with cv 0.67: 44 are needed), so Eq. 7 is never fitted. Before, the signal
    then staffed the last window's load as fluid demand against the default TTFT target and asked
    1 prefill instance (99 % used) where chat's and code's 1 s first tokens need a second. Pooled,
    the last six heartbeats are 150 requests: their staffing answers, 2."""
    from router.core.capacity import prefill_staffing

    def rates(load: LoadShape, tpot_ms: float) -> InstanceRates:
        return PREFILL_RATES

    window = LoadShape(5.0, 1186.5, 200.0)
    assert math.ceil(prefill_staffing(window, PREFILL_RATES, 0.0)) == 1  # the answer before
    model = DesiredInstances(rates, heartbeat_s=5.0)
    end = _mixed_minute(model, 5.0, 120.0)
    got = model.desired(end, window)
    assert not got.fitted and got.left_out >= 6 and model.pooled(window.rate) is not None, got
    assert got.prefill == 2 and got.prefill + got.decode - 1 <= got.neutral <= got.prefill + got.decode, got
    # Heartbeats of two requests each, 100 and 5,000 tokens long: even six together are too few.
    sparse = DesiredInstances(rates, heartbeat_s=10.0)
    for k in range(24):
        sparse.observe(5.0 * k, 4800 if k % 2 else 16, 200.0 if k % 2 else 84.0, tpot_ms=50.0, ttft_ms=1000.0)
    thin = sparse.desired(120.0, LoadShape(0.2, 2408.0, 142.0))
    assert not thin.fitted and sparse.pooled(0.2) is None, thin
    # Fewer heartbeats than Eq. 7 is fitted on (three): not pooled either, whatever they hold.
    short = DesiredInstances(rates, heartbeat_s=5.0)
    end = _mixed_minute(short, 5.0, 15.0)
    assert short.pooled(5.0) is None and not short.desired(end, window).fitted


def test_a_tight_kind_waits_for_servers_busy_with_every_kind_not_only_its_own() -> None:
    """An engine finishes a prefill it started before admitting the next prompt, so a summary placed
    a moment before a code prompt holds the instance whatever their deadlines. ``mixed`` at 5 req/s
    on one prefill instance: chat and code (a 1 s need, 58 % of the prompt tokens) alone use 0.46
    of it, every kind 0.80. Priced with the summaries left out of the servers (before), 0.92
    instances; with them, more than one (``plan`` on ``mixed`` at 5 req/s, seed 21: 2 + 2). At 16
    and 24 req/s the staffing stays the 3 and 4 that ``plan`` with the router queue needs there."""
    from router.core.capacity import prefill_staffing

    def kinds(rate: float) -> list[tuple[float, float, float]]:
        return [
            (12.0 * rate / 20, 640.0, 1000.0),
            (5.0 * rate / 20, 1230.0, 1000.0),
            (3.0 * rate / 20, 3300.0, 3750.0),
        ]

    def staffed(rate: float) -> float:
        return prefill_staffing(LoadShape(rate, 1186.5, 200.0), PREFILL_RATES, 1000.0, kinds(rate))

    assert 1.0 < staffed(5.0) < 2.0
    assert math.ceil(staffed(16.0)) == 3 and math.ceil(staffed(24.0)) == 4
    # The same load with every prompt as patient as the summaries: the tight kinds' wait is gone.
    relaxed = [(share, prompt, 3750.0) for share, prompt, _ in kinds(5.0)]
    assert prefill_staffing(LoadShape(5.0, 1186.5, 200.0), PREFILL_RATES, 3750.0, relaxed) < staffed(5.0)
