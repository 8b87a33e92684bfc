"""binpack's deadline pace when the output length is not known well: the class's running answers
counted in the bound, a class with nothing learned paced at θ's margin over an idle step, and
Algorithm 2's re-prediction for a resident that outruns the length it was paced for."""

from __future__ import annotations

import dataclasses

import numpy as np

from fleet.snapshot import ClusterSnapshot
from router.core.columns import ResidentLegs, StaticResidents
from router.core.lengths import LengthPredictor
from router.core.packing import legs_need_now
from tests.router.core.helpers import NOW, inst, make_request, make_scheduler, make_snapshot


def test_the_censored_bound_counts_the_running_answers_as_lower_bounds() -> None:
    lengths = LengthPredictor()
    for _ in range(10):
        lengths.observe("bulk", 1000, 100)  # the short answers finish first
    plain = lengths.estimate("bulk", 1000, 2500).bound_tokens
    assert plain == 100
    assert lengths.censored_bound("bulk", 1000, [], 2500) == plain
    # Five of fifteen answers still run past 600 tokens: the 90 % bound is past 600, not 100.
    assert lengths.censored_bound("bulk", 1000, [600, 700, 800, 900, 1000], 2500) > 600
    assert lengths.censored_bound("bulk", 1000, [600, 700, 800, 900, 1000], 650) == 650
    # A class with no finished answer of its own, or none running, has no censored bound.
    assert lengths.censored_bound("other", 1000, [600], 2500) == 0
    # Too few finished for an estimate of its own (the pooled one answers), the class's two finished
    # answers and its three running ones together.
    lengths.observe("few", 1000, 80)
    lengths.observe("few", 1000, 90)
    assert lengths.estimate("few", 1000, 2500).source == "all"
    assert lengths.censored_bound("few", 1000, [], 2500) == 0
    assert lengths.censored_bound("few", 1000, [500, 600, 700], 2500) > 700


def _fleet() -> ClusterSnapshot:
    # "d" decodes at about 27 ms a step, "e" is idle (about 13 ms).
    decoder = inst("d", "decode", decode_requests=16, decode_tokens=16 * 900, used_kv_tokens=16 * 900)
    return make_snapshot(inst("p", "prefill"), decoder, inst("e", "decode"))


def test_a_deadline_is_paced_by_the_bound_with_the_running_answers() -> None:
    """150 tokens learned as the bound leave a 10 s deadline a 66 ms pace: the default TPOT, and
    best fit takes the busy decoder. With the class's running answers counted the bound is 400
    tokens: a 24 ms pace the busy decoder cannot keep."""
    snapshot = _fleet()
    scheduler = make_scheduler("binpack", tpot_slo_ms=50.0)
    kw = {
        "max_tokens": 2500,
        "e2e_slo_ms": 10_000.0,
        "expected_output_tokens": 100,
        "output_tokens_bound": 150,
    }
    learned = make_request("learned", 100, **kw)
    censored = make_request("censored", 100, output_tokens_bound_censored=400, **kw)
    assert scheduler.schedule(snapshot, learned, NOW).decode.instance_id == "d"
    assert scheduler.schedule(snapshot, censored, NOW).decode.instance_id == "e"
    # Other policies read no censored bound (slo paces by the learned one either way).
    slo = make_scheduler("slo", tpot_slo_ms=50.0)
    assert (
        slo.schedule(snapshot, censored, NOW).decode.instance_id
        == slo.schedule(snapshot, learned, NOW).decode.instance_id
    )


def test_a_class_with_nothing_learned_is_paced_at_thetas_margin_over_an_idle_step() -> None:
    """500 tokens in 7 s is a 14 ms pace, under an idle step (16.5 ms): before, the request fell
    back to the 50 ms default and best fit took the busy decoder (28 ms). Its length unknown, it is
    now paced as the longest answer an instance at θ of its idle step finishes in time (about 300
    tokens, 23.6 ms), which the busy decoder cannot keep."""
    snapshot = _fleet()
    scheduler = make_scheduler("binpack", tpot_slo_ms=50.0)
    prior = make_request("prior", 100, max_tokens=500, e2e_slo_ms=7_000.0, output_tokens_prior=True)
    assert scheduler.schedule(snapshot, prior, NOW).decode.instance_id == "e"
    known = make_request("known", 100, max_tokens=500, e2e_slo_ms=7_000.0)
    assert scheduler.schedule(snapshot, known, NOW).decode.instance_id == "d"


def _outrun(remaining: float) -> ResidentLegs:
    # A leg paced at 28 ms (need 40 ms over θ = 0.7) over 150 tokens, 140 out in 2.8 s: 1,372 ms of
    # its deadline left; ``remaining`` is its re-predicted remainder.
    return ResidentLegs(
        np.zeros(1, dtype=np.intp),
        np.array([1040.0]),
        np.array([remaining]),
        np.ones(1, dtype=bool),
        np.array([140.0]),
        np.array([40.0]),
        np.array([True]),
        np.array([NOW - 2.8]),
        np.array([150.0]),
    )


def _need(legs: ResidentLegs, step_ms: float) -> float:
    scheduler = make_scheduler("binpack", tpot_slo_ms=50.0)
    view = scheduler.view(make_snapshot(inst("busy", "neutral", decode_requests=1, decode_tokens=1040)), NOW)
    view = dataclasses.replace(view, residents=StaticResidents(legs), load_memo={})
    ctx = scheduler.context(view, make_request("n", 100, max_tokens=64, tpot_slo_ms=50.0))
    return float(legs_need_now(ctx, scheduler.config, legs, np.array([step_ms]))[0])


def test_a_resident_that_outruns_its_paced_length_is_held_to_its_re_predicted_pace() -> None:
    """Re-predicted at 60 more tokens (200 in all, past the 150 it was paced for), the 1,372 ms it
    has left make a 22.9 ms pace: its instance holds new arrivals to that (over θ, 32.7 ms), not to
    the 40 ms it was placed with nor (as before) the whole time left over the one token its paced
    length had left."""
    need = _need(_outrun(60.0), 15.0)
    assert abs(need - 1372.0 / 60.0 / 0.7) < 0.1
    # Within its paced length it keeps the rule before (the pace over the tokens left to 150).
    assert _need(_outrun(5.0), 15.0) >= 40.0
    # A re-predicted pace its instance's step already breaks is a lost cause: the recorded need.
    assert _need(_outrun(60.0), 25.0) == 40.0
