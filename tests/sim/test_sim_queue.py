"""The router queue in the simulator: the same core queue in virtual time, and its figures in sweeps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.cli import main
from router.core.queue import QueueConfig
from sim.cluster import SimFleet, simulate
from sim.fleet import fleet_from_counts
from sim.sweep import queue_figures
from tests.sim.test_simulate import CHAT, make_plan, policy
from workload.report import slo_met, summarize
from workload.spec import RequestPlan, SloTarget, generate_requests, load_workload

NONE = QueueConfig(queue_policy="none")
EDF = QueueConfig(queue_policy="edf")


def burst(n: int, prompt: int = 1500, output: int = 16, slo: SloTarget = CHAT) -> list[RequestPlan]:
    """``n`` requests arriving together (1 ms apart)."""
    return [make_plan(k, 0.001 * k, prompt, output, slo) for k in range(n)]


def test_queue_none_is_the_old_instant_refusal() -> None:
    fleet = SimFleet(fleet_from_counts(prefill=1, decode=1))
    plans = burst(40)
    old = simulate(fleet, policy("slo"), plans)
    none = simulate(fleet, policy("slo"), plans, queue=NONE)
    assert old.results == none.results and old.stats == none.stats
    assert none.stats.rejected > 0 and none.stats.queued == 0


def test_a_burst_waits_in_the_queue_instead_of_being_refused() -> None:
    fleet = SimFleet(fleet_from_counts(prefill=1, decode=1))
    slo = SloTarget(ttft_ms=6000.0, tpot_ms=50.0)
    plans = burst(60, slo=slo)
    refused = simulate(fleet, policy("slo"), plans, queue=NONE)
    # (Served however late: the late allowance out of the way.)
    queued = simulate(fleet, policy("slo"), plans, queue=QueueConfig(queue_policy="edf", late_allowance=1e6))
    assert refused.stats.rejected > 0
    assert queued.stats.rejected == 0 and queued.stats.queued > 0
    assert all(r.ok and r.completion_tokens == 16 for r in queued.results)
    assert max(queued.queue_wait_ms) > 0.0
    # Whoever left the queue late is reported so, and misses its TTFT target.
    for result, late in zip(queued.results, queued.late, strict=True):
        if late:
            assert not slo_met(result)
    # With the default allowance (one more TTFT target past the deadline) the queue still serves
    # more of the burst than instant refusal, every request it serves on time is on time, and the
    # ones it refuses are refused as late (DEADLINE_EXCEEDED), not served a minute late.
    bounded = simulate(fleet, policy("slo"), plans, queue=EDF)
    assert 0 < bounded.stats.rejected < refused.stats.rejected
    assert {r.error_code for r in bounded.results if not r.ok} == {"DEADLINE_EXCEEDED"}
    assert sum(slo_met(r) for r in bounded.results) >= sum(slo_met(r) for r in queued.results)
    served_ttft = [r.ttft_ms for r in bounded.results if r.ok and r.ttft_ms is not None]
    assert max(served_ttft) <= 2 * 6000.0 + 1000.0


def test_late_policy_reject_ends_unreachable_requests() -> None:
    fleet = SimFleet(fleet_from_counts(prefill=1, decode=1))
    plans = burst(60, slo=SloTarget(ttft_ms=1000.0, tpot_ms=50.0))
    outcome = simulate(fleet, policy("slo"), plans, queue=QueueConfig(late_policy="reject"))
    codes = {r.error_code for r in outcome.results if not r.ok}
    assert codes == {"DEADLINE_EXCEEDED"} and outcome.stats.late == outcome.stats.rejected > 0


def test_edf_beats_instant_refusal_in_overload_and_is_deterministic() -> None:
    fleet = SimFleet(fleet_from_counts(prefill=2, decode=2))
    spec = load_workload("mixed").with_arrival(rate_per_s=20.0)
    plans = generate_requests(spec, rng=0, num_requests=200)
    none = simulate(fleet, policy("slo"), plans, queue=NONE)
    edf = simulate(fleet, policy("slo"), plans, queue=EDF)
    att = [summarize(o.results, o.duration_s).overall.slo_attainment for o in (none, edf)]
    assert att[1] > att[0]
    assert simulate(fleet, policy("slo"), plans, queue=EDF).results == edf.results


def test_objective_g_sheds_the_longest_requests_in_overload_for_more_g() -> None:
    """At twice this fleet's capacity: edf with objective g refuses requests (the longest, while others
    miss) and ends with a higher G than edf serving every on-time request; every request is accounted
    for, and a refusal names the objective."""
    fleet = SimFleet(fleet_from_counts(prefill=2, decode=2))
    spec = load_workload("mixed").with_arrival(rate_per_s=20.0)
    plans = generate_requests(spec, rng=0, num_requests=300)
    figures = {}
    for objective in ("attainment", "g"):
        queue = QueueConfig(queue_policy="edf", queue_objective=objective)
        outcome = simulate(fleet, policy("slo"), plans, queue=queue)
        assert len(outcome.results) == len(plans)
        figures[objective] = (queue_figures(outcome, outcome.duration_s), outcome)
    (attainment, _), (g, shed) = figures["attainment"], figures["g"]
    assert g["g"] > attainment["g"]
    refused = [r for r in shed.results if not r.ok]
    assert any("--queue-objective g" in r.error_message for r in refused)
    assert {r.error_code for r in refused} <= {"RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}
    # The refused are the long ones: their mean output is above the served requests'.
    served = [r for r in shed.results if r.ok]
    shed_out = [
        p.max_tokens
        for p, r in zip(plans, shed.results, strict=True)
        if "--queue-objective g" in r.error_message
    ]
    assert sum(shed_out) / len(shed_out) > sum(r.completion_tokens for r in served) / len(served)


def test_priority_protects_the_higher_class() -> None:
    fleet = SimFleet(fleet_from_counts(prefill=2, decode=2))
    spec = load_workload("mixed-priority").with_arrival(rate_per_s=14.0)
    plans = generate_requests(spec, rng=0, num_requests=240)
    by_policy = {}
    for name in ("edf", "priority"):
        outcome = simulate(fleet, policy("slo"), plans, queue=QueueConfig(queue_policy=name))
        by_policy[name] = queue_figures(outcome, outcome.duration_s)["by_class"]
    high = by_policy["priority"]["chat-priority"]["slo_attainment"]
    assert high >= by_policy["edf"]["chat-priority"]["slo_attainment"]
    assert high > by_policy["priority"]["chat"]["slo_attainment"]


def test_queue_figures_count_g_over_every_request() -> None:
    fleet = SimFleet(fleet_from_counts(neutral=1))
    plans = [make_plan(0, 0.0, 100, 4), make_plan(1, 0.0, 100, 4, SloTarget(ttft_ms=1.0))]
    outcome = simulate(fleet, policy("slo"), plans, queue=NONE)
    figures = queue_figures(outcome, outcome.duration_s)
    met = sum(1 for r in outcome.results if slo_met(r))
    total_s = sum(r.e2e_ms or 0.0 for r in outcome.results) / 1e3
    assert met == 1 and figures["g"] == pytest.approx(met / total_s)
    assert figures["rejected"] == 1 and figures["late"] == 0
    assert set(figures["by_class"]) == {"chat"}
    assert figures["queue_wait_ms"] == {"p50": 0.0, "p99": 0.0}


def test_cli_runs_each_policy_with_each_queue_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim.json"
    args = ["simulate", "--prefill", "1", "--decode", "1", "--workload", "mixed", "--num-requests", "30"]
    code = main(
        [
            *args,
            "--rates",
            "4",
            "--policies",
            "slo,round-robin",
            "--queue-policies",
            "none,edf",
            "--output",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0, capsys.readouterr().err
    results = json.loads(out.read_text(encoding="utf-8"))["results"]
    assert [(r["policy"], r["queue_policy"]) for r in results] == [
        ("slo", "none"),
        ("slo", "edf"),
        ("round-robin", "none"),
        ("round-robin", "edf"),
    ]
    for r in results:
        for key in ("slo_attainment", "goodput_rps", "rejected", "late", "mean_latency_ms", "g"):
            assert isinstance(r[key], (int, float)), key
        assert set(r["queue_wait_ms"]) == {"p50", "p99"}
        assert set(r["by_class"]) == {"chat", "code", "summarize"}
        assert set(r["by_class"]["chat"]) >= {"slo_attainment", "goodput_rps", "g", "late", "queue_wait_ms"}
    capsys.readouterr()
    assert main([*args, "--queue-policies", "lifo"]) == 2
    assert "--queue-policies" in capsys.readouterr().err


def test_queue_flags_reach_the_simulation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--neutral", "1", "--num-requests", "5", "--rates", "1", "--policies", "slo"]
    assert main([*args, "--max-queue-size", "0"]) == 2
    assert "--max-queue-size 0" in capsys.readouterr().err
    path = tmp_path / "sim.json"
    flags = ["--late-policy", "reject", "--max-queue-wait-ms", "1234"]
    assert main([*args, *flags, "--output", str(path), "--no-progress"]) == 0
    meta = json.loads(path.read_text(encoding="utf-8"))["meta"]
    assert meta["queue"]["max_queue_wait_ms"] == 1234.0 and meta["queue"]["late_policy"] == "reject"
