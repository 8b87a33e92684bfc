"""The simulator gives no policy an answer's length: engines stop at the true length, policies estimate it."""

from __future__ import annotations

import dataclasses

import pytest

from engine.model import SimConfig
from sim.cluster import SimFleet, simulate
from sim.fleet import fleet_from_counts
from sim.sweep import SLO_ADAPTIVE_PD
from tests.sim.test_simulate import policy
from workload.spec import generate_requests, load_workload, parse_workload_dict


def _chat(n: int, rate: float = 6.0, seed: int = 3) -> list:  # type: ignore[type-arg]
    return generate_requests(load_workload("chat").with_arrival(rate_per_s=rate), rng=seed, num_requests=n)


def test_engines_stop_at_the_true_length_not_at_max_tokens() -> None:
    plans = _chat(80)
    # The plan carries a cap and, apart, the answer's length (drawn from the class's output).
    assert all(p.max_tokens == 1024 for p in plans)
    assert sum(p.true_output_tokens for p in plans) < 0.5 * sum(p.max_tokens for p in plans)
    out = simulate(SimFleet(fleet_from_counts(prefill=2, decode=2)), policy("slo"), plans, seed=1)
    assert [r.completion_tokens for r in out.results] == [p.true_output_tokens for p in plans]


@pytest.mark.parametrize("name", ["binpack", "slo", SLO_ADAPTIVE_PD])
def test_a_requests_true_length_never_reaches_the_policy(name: str) -> None:
    # Change only the last request's answer length: nothing the router decides or predicts for it may
    # move. With --oracle-lengths it does (the policies cost it by the truth): the check can fail.
    fleet = SimFleet(fleet_from_counts(prefill=2, decode=2))
    plans = _chat(60)
    longer = [*plans[:-1], dataclasses.replace(plans[-1], output_tokens=plans[-1].max_tokens)]

    def last(ps: list, oracle: bool) -> tuple:  # type: ignore[type-arg]
        r = simulate(fleet, policy(name), ps, seed=1, oracle_lengths=oracle).results[-1]
        return (r.prefill_instance_id, r.decode_instance_id, r.predicted_ttft_ms, r.predicted_tpot_ms)

    assert last(plans, False) == last(longer, False)
    assert last(plans, True) != last(longer, True)


def test_eos_probability_of_a_fleet_ends_answers_early() -> None:
    # A class that does not ignore EOS stops at the engine's EOS draw (the sim worker's geometric
    # draw); a class with ignore_eos keeps its drawn length, as the sim worker does.
    doc = {"classes": [{"name": "c", "output": "fixed(200)", "ignore_eos": False, "ttft_ms": 2000}]}
    plans = generate_requests(parse_workload_dict(doc).with_arrival(rate_per_s=2.0), rng=1, num_requests=40)
    cfg = policy("slo")

    def tokens(eos: float, ps: list) -> int:  # type: ignore[type-arg]
        fleet = SimFleet(fleet_from_counts(neutral=2, engine=SimConfig(eos_probability=eos)))
        return sum(r.completion_tokens for r in simulate(fleet, cfg, ps, seed=0).results)

    assert tokens(0.0, plans) == 40 * 200
    early = tokens(0.02, plans)
    assert early < 0.75 * 40 * 200
    ignoring = [dataclasses.replace(p, ignore_eos=True) for p in plans]
    assert tokens(0.02, ignoring) == 40 * 200


def test_the_predictor_learns_the_lengths_it_is_shown() -> None:
    # After a warm-up the estimate a request is costed by is the class's typical answer, not the cap.
    from router.core.lengths import LengthPredictor

    plans = _chat(400)
    lp = LengthPredictor()
    for p in plans:
        lp.observe(p.class_name, p.prompt_tokens, p.true_output_tokens)
    est = lp.estimate("chat", 384, 1024)
    true_mean = sum(p.true_output_tokens for p in plans) / len(plans)
    assert est.source == "class+bucket"
    assert 0.6 * true_mean < est.mean < 1.5 * true_mean
