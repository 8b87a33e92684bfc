"""The autoscaling signal agrees with ``plan``: ``slo_router_desired_instances`` read at the end of a
seeded simulated run lands within 20 % of the fleet ``slo-router plan`` finds, per role."""

from __future__ import annotations

from router.core.capacity import estimate_instances
from router.core.config import SchedulerConfig
from router.core.queue import QueueConfig
from sim.cluster import SimFleet, simulate
from sim.fleet import fleet_from_counts
from sim.plan import load_shape, plan_fleet
from sim.sweep import open_loop, policy_overrides
from workload.spec import generate_requests, load_workload

RATE = 16.0


def _within(value: int, reference: int, share: float = 0.2) -> bool:
    return abs(value - reference) <= share * reference + 1e-9


def test_desired_instances_of_a_simulated_run_match_the_plan() -> None:
    config = SchedulerConfig(**policy_overrides("slo"))
    workload = load_workload("chat")
    planned = plan_fleet(workload, RATE, 0.95, config, num_requests=600, seed=0)
    # The router's view of the same traffic, longer (its fit needs heartbeats with learned lengths).
    plans = generate_requests(open_loop(workload).with_arrival(rate_per_s=RATE), rng=1, num_requests=2000)
    fleet = SimFleet(fleet_from_counts(prefill=planned.prefill, decode=planned.decode))
    outcome = simulate(fleet, config, plans, seed=1, queue=QueueConfig(queue_policy="edf"))
    desired = outcome.desired
    assert desired is not None and desired.fitted, desired
    assert _within(desired.prefill, planned.prefill), (desired, planned.prefill, planned.decode)
    assert _within(desired.decode, planned.decode), (desired, planned.prefill, planned.decode)
    # The throughput model the signal used to export (a request's TTFT alone per prompt, the
    # packing's margins) over-provisions this load: the test tells the two apart.
    old = estimate_instances(
        fleet.predictors.default,
        load_shape(plans, RATE),
        tpot_target_ms=config.tpot_slo_ms,
        strictness=config.tpot_packing_strictness,
        threshold=config.tpot_binpack_threshold,
        kv_headroom=config.kv_packing_headroom,
    )
    assert not (_within(old.prefill, planned.prefill) and _within(old.decode, planned.decode)), old
