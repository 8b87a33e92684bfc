"""A capped engine (max_num_seqs) is predicted as it behaves: a request waits for a running slot."""

from __future__ import annotations

from engine.interface import EngineInfo
from engine.model import SimConfig
from router.core.queue import QueueConfig
from sim.cluster import SimFleet, SimOutcome, simulate
from sim.fleet import fleet_from_counts
from tests.sim.test_simulate import policy
from workers.metadata import WorkerIdentity, build_metadata
from workload.prediction import prediction_error
from workload.spec import generate_requests, load_workload


def _run(queue_policy: str) -> SimOutcome:
    # Seed 000's code + chat mix on two engines that run at most 4 requests each, at 1.5 req/s: the
    # engines' waiting queues, not their step times, decide most first tokens.
    fleet = SimFleet(fleet_from_counts(neutral=2, engine=SimConfig(max_num_seqs=4)))
    workload = load_workload("code-chat").with_arrival(rate_per_s=1.5)
    plans = generate_requests(workload, rng=0, num_requests=100)
    return simulate(fleet, policy("slo"), plans, seed=0, queue=QueueConfig(queue_policy=queue_policy))


def test_ttft_prediction_sees_the_sequence_cap() -> None:
    # Before the slot wait was predicted: TTFT error p50 2,991 %, p90 4,676 %, bias +2,867 % (the
    # prediction assumed every request starts at once), the router queue never held a request and
    # fcfs and edf gave bit-identical runs. With completions spaced evenly (k·R/s steps for the
    # k-th of s running): bias +68 to +120 % (the k-th of s memoryless remaining lengths ends
    # after R·(H_s - H_(s-k)) steps, later than k·R/s).
    edf, fcfs = _run("edf"), _run("fcfs")
    for outcome in (edf, fcfs):
        ttft = prediction_error(outcome.results)["ttft"]
        assert ttft["p90"] < 1.5, ttft
        assert abs(ttft["bias"]) < 0.25, ttft
        assert outcome.stats.queued > 0  # a full fleet now holds requests in the router queue
    assert edf.results != fcfs.results


def test_workers_register_their_sequence_cap() -> None:
    info = EngineInfo(
        model="m",
        max_num_batched_tokens=2048,
        kv_capacity_tokens=65536,
        block_size=16,
        max_model_len=8192,
        max_num_seqs=4,
    )
    assert build_metadata(info, WorkerIdentity(), "127.0.0.1:1").max_num_seqs == 4
