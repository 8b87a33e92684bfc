"""The qlm queue policy in the simulator: eviction with generated tokens kept, the ablation, the CLI."""

from __future__ import annotations

import dataclasses

import pytest

from engine.model import SimConfig
from router.cli import main
from router.core.qlm import QlmConfig
from router.core.queue import QueueConfig
from sim.cluster import SimFleet, SimOutcome, simulate
from sim.fleet import fleet_from_counts
from tests.sim.test_simulate import policy
from workload.report import slo_met
from workload.spec import RequestPlan, SloTarget

TIGHT = SloTarget(ttft_ms=800.0, tpot_ms=100.0)
LOOSE = SloTarget(e2e_ms=600_000.0)
QLM = QueueConfig(queue_policy="qlm")


def plan(index: int, arrival: float, prompt: int, output: int, slo: SloTarget, name: str) -> RequestPlan:
    return RequestPlan(
        index=index,
        arrival_s=arrival,
        class_name=name,
        prompt_tokens=prompt,
        max_tokens=output,
        slo=slo,
        prompt_seed=index,
    )


def tight_behind_loose(n_loose: int = 8, n_tight: int = 4) -> list[RequestPlan]:
    """Long loose requests fill the instance, then a burst of tight ones arrives behind them."""
    plans = [plan(k, 0.001 * k, 512, 1500, LOOSE, "batch") for k in range(n_loose)]
    plans += [plan(n_loose + k, 5.0 + 0.001 * k, 256, 32, TIGHT, "interactive") for k in range(n_tight)]
    return plans


def run(plans: list[RequestPlan], queue: QueueConfig, qlm: QlmConfig | None = None) -> SimOutcome:
    """One instance whose engine runs at most 8 requests at once (so a full batch blocks the head)."""
    fleet = SimFleet(fleet_from_counts(neutral=1, engine=SimConfig(max_num_seqs=8)))
    return simulate(fleet, policy("slo"), plans, queue=queue, qlm=qlm)


def test_eviction_lets_the_tight_class_meet_its_deadline_and_keeps_every_token() -> None:
    plans = tight_behind_loose()
    on = run(plans, QLM)  # the batch is the engine's 8
    off = run(plans, QLM, QlmConfig(eviction="off"))
    fcfs = run(plans, QueueConfig(queue_policy="fcfs"))
    tight = [p.index for p in plans if p.class_name == "interactive"]
    assert on.stats.evicted >= len(tight)
    assert all(slo_met(on.results[i]) for i in tight)
    assert not any(slo_met(off.results[i]) for i in tight)
    assert off.stats.evicted == 0
    assert not any(slo_met(fcfs.results[i]) for i in tight)
    # Evicted requests finish with exactly max_tokens tokens and still meet their loose target.
    for result, p in zip(on.results, plans, strict=True):
        assert result.ok and result.completion_tokens == p.max_tokens
        assert slo_met(result)


def test_eviction_pays_off_under_end_to_end_deadlines_alone() -> None:
    # The paper's own model: every SLO end to end. A loose group holds all 8 sequences for ~30 s; a
    # tight group due in 15 s arrives behind it. Eviction runs it at once; without, it waits and misses.
    tight_e2e = SloTarget(e2e_ms=15_000.0)
    plans = [plan(k, 0.001 * k, 512, 1500, LOOSE, "batch") for k in range(8)]
    plans += [plan(8 + k, 5.0 + 0.001 * k, 256, 40, tight_e2e, "alerts") for k in range(4)]
    on = run(plans, QLM)
    off = run(plans, QLM, QlmConfig(eviction="off"))
    tight = range(8, 12)
    assert on.stats.evicted >= 1
    assert all(slo_met(on.results[i]) for i in tight)
    assert not any(slo_met(off.results[i]) for i in tight)
    assert all(
        slo_met(r) and r.completion_tokens == p.max_tokens for r, p in zip(on.results, plans, strict=True)
    )


def test_qlm_is_deterministic_and_serves_everything() -> None:
    plans = tight_behind_loose(12, 6)
    # An allowance the tight streams cannot outwait: their seats free only as the loose batch ends,
    # past one target beyond their deadline, where the late path would refuse them (its own test).
    queue = dataclasses.replace(QLM, late_allowance=1000.0)
    a = run(plans, queue, QlmConfig(batch=4))
    b = run(plans, queue, QlmConfig(batch=4))
    assert a.results == b.results and a.stats == b.stats
    assert all(r.ok and r.completion_tokens == p.max_tokens for r, p in zip(a.results, plans, strict=True))
    assert a.stats.plans >= 1


def test_qlm_needs_a_neutral_fleet() -> None:
    # As in the router: every request is refused UNAVAILABLE, saying qlm needs neutral instances.
    fleet = SimFleet(fleet_from_counts(prefill=1, decode=1))
    outcome = simulate(fleet, policy("slo"), tight_behind_loose(), queue=QLM)
    assert outcome.results and all(r.error_code == "UNAVAILABLE" for r in outcome.results)
    assert "neutral" in outcome.results[0].error_message


def test_cli_prints_qlm_and_its_ablation(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "simulate",
            "--neutral",
            "2",
            "--workload",
            "interactive-batch",
            "--burstiness",
            "0.25",
            "--policies",
            "slo",
            "--queue-policies",
            "edf,qlm",
            "--qlm-eviction",
            "on,off",
            "--rates",
            "4",
            "--num-requests",
            "60",
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    rows = [line.split()[2] for line in out.splitlines() if line.strip().startswith("4 ")]
    assert {"edf", "qlm", "qlm-noevict"} <= set(rows)


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--qlm-eviction", "maybe"], "--qlm-eviction"),
        (["--qlm-group-factor", "0"], "--qlm-group-factor"),
        (["--qlm-confidence", "2"], "--qlm-confidence"),
    ],
)
def test_cli_qlm_flag_errors_name_the_flag(
    flags: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "simulate",
            "--neutral",
            "1",
            "--queue-policies",
            "qlm",
            "--rates",
            "1",
            "--num-requests",
            "5",
            *flags,
        ]
    )
    assert code == 2
    assert needle in capsys.readouterr().err


def test_streams_handed_to_the_router_queue_run_beside_the_virtual_queues_e2e_work() -> None:
    # --qlm-streams edf: the TTFT-judged requests wait in the router queue (edf) and the slo policy
    # places them; the virtual queues pull the e2e work. The same plan gives the same run, no e2e
    # request is evicted for a stream (streams are not the virtual queues' heads: the router queue
    # holds them until an instance has room), every e2e request is served with all its tokens, and a
    # stream either is too or is refused by the router queue's late path (the batch holds every
    # sequence for longer than its TTFT target and its late allowance).
    plans = tight_behind_loose(12, 6)
    config = QlmConfig(streams="edf")
    a = run(plans, QLM, config)
    b = run(plans, QLM, config)
    assert a.results == b.results and a.stats == b.stats
    assert a.stats.evicted == 0
    for r, p in zip(a.results, plans, strict=True):
        if p.class_name == "batch":
            assert r.ok and r.completion_tokens == p.max_tokens and slo_met(r)
        else:
            assert (r.ok and r.completion_tokens == p.max_tokens) or r.error_code == "DEADLINE_EXCEEDED"
    assert any(not r.ok for r in a.results)  # the late path did refuse streams here
