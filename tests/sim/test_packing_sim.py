"""Packing in simulation: adaptive PD keeps attainment with fewer busy decoders, and the figures reported."""

from __future__ import annotations

from engine.model import SimConfig
from router.core.config import SchedulerConfig
from router.core.queue import QueueConfig
from sim.cluster import SimFleet
from sim.fleet import fleet_from_counts
from sim.sweep import (
    SLO_ADAPTIVE_PD,
    PolicyChoice,
    SweepPoint,
    open_loop,
    point_to_dict,
    policy_overrides,
    run_sweep,
)
from workload.spec import load_workload


def test_adaptive_pd_packs_decode_without_preempting_and_reports_busy_instances() -> None:
    fleet = SimFleet(fleet_from_counts(prefill=4, decode=4))
    policies = [PolicyChoice(n, SchedulerConfig(**policy_overrides(n))) for n in ("slo", SLO_ADAPTIVE_PD)]
    # With oracle output lengths: with the online estimate (the default) adaptive PD is 3 points
    # under slo here (its KV-over-life packing costs requests by the estimate).
    points = run_sweep(
        fleet,
        open_loop(load_workload("mixed")),
        policies,
        [8.0],
        num_requests=400,
        seed=0,
        oracle_lengths=True,
    )
    docs = {p.policy.removesuffix("/oracle"): point_to_dict(p) for p in points}
    for doc in docs.values():
        assert set(doc["mean_busy_instances"]) == {"prefill", "decode", "neutral"}
        assert doc["mean_busy_instances"]["neutral"] == 0.0
        assert 0.0 < doc["mean_busy_instances"]["decode"] <= 4.0 + 1e-9
        assert isinstance(doc["preemptions"], int)
    slo, apd = docs["slo"], docs[SLO_ADAPTIVE_PD]
    assert apd["preemptions"] == 0
    assert apd["mean_busy_instances"]["decode"] < slo["mean_busy_instances"]["decode"] - 0.5
    assert apd["slo_attainment"] >= slo["slo_attainment"] - 0.01


def test_busy_instances_of_a_neutral_fleet_are_neutral() -> None:
    fleet = SimFleet(fleet_from_counts(neutral=3))
    choice = PolicyChoice("binpack", SchedulerConfig(**policy_overrides("binpack")))
    (point,) = run_sweep(fleet, open_loop(load_workload("chat")), [choice], [4.0], num_requests=100, seed=0)
    busy = point_to_dict(point)["mean_busy_instances"]
    assert busy["prefill"] == busy["decode"] == 0.0
    assert 0.0 < busy["neutral"] <= 3.0


def _slo_and_adaptive_pd_at_10_per_s_on_2_plus_2(num_requests: int) -> tuple[SweepPoint, SweepPoint]:
    """slo and adaptive PD on 2 + 2 instances at 10 req/s of `mixed` (an overload), router queue edf.

    With oracle output lengths: with the online estimate (the default) adaptive PD is 1.2-1.5 points
    under slo in these overloads (its packing costs requests by the estimate).
    """
    fleet = SimFleet(fleet_from_counts(prefill=2, decode=2))
    policies = [PolicyChoice(n, SchedulerConfig(**policy_overrides(n))) for n in ("slo", SLO_ADAPTIVE_PD)]
    points = run_sweep(
        fleet,
        open_loop(load_workload("mixed")),
        policies,
        [10.0],
        num_requests=num_requests,
        seed=0,
        queues=(QueueConfig(queue_policy="edf"),),
        oracle_lengths=True,
    )
    slo, apd = (next(p for p in points if p.policy == f"{name}/oracle") for name in ("slo", SLO_ADAPTIVE_PD))
    return slo, apd


def test_adaptive_pd_in_overload_queues_instead_of_stalling_its_decoders() -> None:
    # 2 + 2 instances serve `mixed` up to about 9-10 req/s: 10 req/s overloads them. Adaptive PD used
    # to place every request at once (prefill chunks on decoders, decode past its KV over life):
    # 82 % against slo's 93.6 %, 7 preemptions, TPOT under-predicted. Its targets now hold in every
    # pass, so the router queue (edf, the simulate default) holds what the fleet cannot take yet.
    slo, apd = _slo_and_adaptive_pd_at_10_per_s_on_2_plus_2(250)
    assert apd.stats.preemptions == 0
    assert apd.stats.queued > 0  # overload reaches the router queue instead of the engines
    # Within a point of slo (2-3 requests of 250; it was 11.6 points under).
    assert apd.report.overall.slo_attainment >= slo.report.overall.slo_attainment - 0.01
    bias = apd.prediction_error["tpot"]["bias"]
    assert abs(bias) < 0.05, (
        f"TPOT prediction bias {bias:.1%}: something the predictor does not see runs on decoders"
    )


def test_adaptive_pd_in_overload_keeps_the_prefill_side_it_needs() -> None:
    # Longer than the test above, so the overload lasts: 2 + 2 instances at 10 req/s for 400
    # requests. The last fallback pass used to relax the prefill-room guard, and decoders opened
    # while the prefill side had room for a moment stayed decoders: 85.5 % against slo's 92.5 %.
    # The guard now holds in every pass and the decode set is sized by the demand placed.
    slo, apd = _slo_and_adaptive_pd_at_10_per_s_on_2_plus_2(400)
    assert apd.stats.preemptions == 0
    assert apd.report.overall.slo_attainment >= slo.report.overall.slo_attainment - 0.01
    # Never more instances holding decode work than slo's decode role has.
    assert apd.stats.mean_busy_decode <= slo.stats.mean_busy_decode + 0.05


def test_binpack_keeps_its_kv_plan_on_a_kv_limited_pd_fleet() -> None:
    # Aladdin's (e) with exact lengths: the KV peak over every future step of a decoder's requests
    # stays within the headroom, so the engines never preempt. A transferred prompt waiting in its
    # decode engine's queue for blocks (prefill done, no KV allocated yet) once dropped out of that
    # peak: 5 preemptions here before it was counted.
    engine = SimConfig(kv_capacity_tokens=16384)
    fleet = SimFleet(fleet_from_counts(prefill=1, decode=2, engine=engine))
    choice = PolicyChoice("binpack", SchedulerConfig(**policy_overrides("binpack")))
    (point,) = run_sweep(
        fleet,
        open_loop(load_workload("mixed")),
        [choice],
        [4.5],
        num_requests=200,
        seed=0,
        oracle_lengths=True,
        queues=(QueueConfig(queue_policy="edf"),),
    )
    assert point.stats.preemptions == 0
    assert point_to_dict(point)["completed"] >= 190  # served (the router queue refuses 2)
