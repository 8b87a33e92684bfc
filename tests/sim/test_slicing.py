"""Slice-level dispatch in the simulator: every token delivered, recompute accounted, the command's JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import sim.cluster
import sim.slicing
from engine.model import ScheduledStep, SimConfig, SimCore, StepResult
from router.cli import main
from router.core.config import SchedulerConfig
from router.core.slicing import SliceConfig
from sim.cluster import SimFleet, SimOutcome
from sim.fleet import fleet_from_counts
from sim.slicing import request_figures, simulate_slices
from workload.spec import generate_requests, load_workload

ENGINE = SimConfig(kv_capacity_tokens=32768, max_num_seqs=64)
SCENARIOS = Path(__file__).resolve().parents[2] / "docs" / "scenarios"


def fleet(n: int = 2) -> SimFleet:
    return SimFleet(fleet_from_counts(neutral=n, engine=ENGINE))


def plans(rate: float = 6.0, count: int = 60) -> list:  # type: ignore[type-arg]
    spec = load_workload("codegen").with_arrival(rate_per_s=rate)
    return list(generate_requests(spec, rng=3, num_requests=count))


def test_cli_slices_a_trace_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Slice-level dispatch replays a trace like every other policy: the trace's own requests (its
    # first 40, lengths and all), gaps scaled to the rate.
    trace = Path(__file__).parents[1] / "data" / "traces" / "azure-conv-2023-head300.csv"
    out = tmp_path / "sim.json"
    code, stdout, _ = run(
        capsys, "--neutral", "2", "--workload", f"trace:{trace}", "--num-requests", "40", "--rates", "4",
        "--no-progress", "--policies", "round-robin", "--dispatch-modes", "request,slice", "--output", str(out),
    )  # fmt: skip
    assert code == 0, stdout
    doc = json.loads(out.read_text())
    assert [(r["dispatch_mode"], r["completed"]) for r in doc["results"]] == [("request", 40), ("slice", 40)]


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("slice_tokens", [16, 128])
def test_every_request_gets_all_its_tokens_and_resumes_recompute_the_context(
    overlap: bool, slice_tokens: int
) -> None:
    work = plans()
    # Fixed slice length (the adaptive one is tested apart).
    config = SliceConfig(
        slice_tokens=slice_tokens,
        overlap_batches=overlap,
        recompute_share=None,
        prefix_cache=False,
        continue_in_place=False,
        grow_with_answer=False,
    )
    outcome = simulate_slices(fleet(3), work, config, seed=1)
    assert [r.completion_tokens for r in outcome.results] == [p.true_output_tokens for p in work]
    assert all(r.ok and r.ttft_ms is not None and r.ttft_ms > 0 for r in outcome.results)
    # A request of m tokens runs ceil(m / S) slices; resumed slice k re-prefills prompt + k * S tokens.
    slices = sum(math.ceil(p.true_output_tokens / slice_tokens) for p in work)
    recomputed = sum(
        p.prompt_tokens + k * slice_tokens
        for p in work
        for k in range(1, math.ceil(p.true_output_tokens / slice_tokens))
    )
    assert outcome.figures.slices == slices
    assert outcome.figures.recomputed_tokens == recomputed
    assert sum(outcome.figures.busy_s) > 0
    assert outcome.figures.load_imbalance >= 0.0
    if recomputed:
        assert outcome.figures.resume_gap_p99_ms is not None and outcome.figures.resume_gap_p99_ms > 0


def test_a_pool_larger_than_one_point_batches_drains_over_several_points() -> None:
    work = plans(rate=50.0, count=80)
    # Every slice through the pool (resumed slices are otherwise placed without a schedule point).
    outcome = simulate_slices(fleet(), work, SliceConfig(max_batching_slices=3, resume_at_once=False))
    assert [r.completion_tokens for r in outcome.results] == [p.true_output_tokens for p in work]
    assert outcome.figures.schedule_points >= outcome.figures.slices / 3


def test_runs_are_deterministic_for_a_seed() -> None:
    work = plans(count=40)
    a = simulate_slices(fleet(), work, SliceConfig(), seed=2)
    b = simulate_slices(fleet(), work, SliceConfig(), seed=2)
    assert a.results == b.results
    assert a.figures == b.figures


def test_a_longer_slice_recomputes_less() -> None:
    work = plans(count=40)
    short = simulate_slices(fleet(), work, SliceConfig(slice_tokens=32)).figures.recomputed_tokens
    long = simulate_slices(fleet(), work, SliceConfig(slice_tokens=512)).figures.recomputed_tokens
    assert short > long


def test_slice_dispatch_needs_a_neutral_fleet() -> None:
    pd = SimFleet(fleet_from_counts(prefill=1, decode=1, engine=ENGINE))
    with pytest.raises(ValueError, match="neutral"):
        simulate_slices(pd, plans(count=5), SliceConfig())


def test_request_figures_take_the_union_of_service_intervals() -> None:
    f = fleet(2)
    from workload.report import RequestResult
    from workload.spec import SloTarget

    def result(start: float, e2e_s: float, instance: str) -> RequestResult:
        return RequestResult(
            index=0, class_name="x", slo=SloTarget(), prompt_tokens=1, max_tokens=1,
            start_s=start, e2e_ms=e2e_s * 1000.0, prefill_instance_id=instance,
        )  # fmt: skip

    a, b = f.ids
    figures = request_figures(
        f, [result(0.0, 2.0, a), result(1.0, 2.0, a), result(5.0, 1.0, a), result(0.0, 4.0, b)]
    )
    assert figures.busy_s == pytest.approx((4.0, 4.0))
    assert figures.completion_s == pytest.approx((6.0, 4.0))
    assert figures.load_imbalance == 0.0


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["simulate", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


SMALL = ("--neutral", "2", "--workload", "codegen", "--num-requests", "30", "--rates", "2,6", "--no-progress")


def test_cli_compares_dispatch_modes_in_the_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim.json"
    code, stdout, _ = run(
        capsys,
        *SMALL,
        "--policies",
        "round-robin,least-requests",
        "--dispatch-modes",
        "request,slice",
        "--slice-tokens",
        "64",
        "--output",
        str(out),
    )
    assert code == 0
    assert "max-min" in stdout and "least-requests" in stdout and "stall p99" in stdout
    doc = json.loads(out.read_text())
    rows = [(r["rate"], r["dispatch_mode"], r["policy"]) for r in doc["results"]]
    assert rows == [
        (rate, mode, policy)
        for rate in (2.0, 6.0)
        for mode, policy in (("request", "round-robin"), ("request", "least-requests"), ("slice", "max-min"))
    ]
    for r in doc["results"]:
        assert r["completed"] == 30
        assert r["throughput_rps"] > 0
        assert r["load_imbalance"] >= 0
        assert (r["recomputed_tokens"] > 0) == (r["dispatch_mode"] == "slice")
    assert doc["meta"]["slice"]["slice_tokens"] == 64


def test_cli_one_batch_at_a_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim.json"
    code, _, _ = run(
        capsys, *SMALL, "--policies", "round-robin", "--dispatch-modes", "slice", "--slice-one-batch-at-a-time",
        "--output", str(out),
    )  # fmt: skip
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["slice"]["overlap_batches"] is False
    assert [r["completed"] for r in doc["results"]] == [30, 30]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--dispatch-modes", "request,sliced"), "--dispatch-modes request,sliced: 'sliced'"),
        (("--dispatch-modes", "slice", "--slice-tokens", "0"), "--slice-tokens"),
        (("--dispatch-modes", "slice", "--slice-interval-ms", "-5"), "--slice-interval-ms"),
        # Request dispatch there runs without a router queue: a queue asked for is not dropped silently.
        (("--dispatch-modes", "request,slice", "--queue-policies", "edf"), "--queue-policies is not used"),
        (("--dispatch-modes", "request", "--calibrations", "off"), "--calibrations is not used"),
    ],
)
def test_cli_names_the_bad_flag(
    capsys: pytest.CaptureFixture[str], args: tuple[str, ...], message: str
) -> None:
    code, _, stderr = run(capsys, *SMALL, "--policies", "round-robin", *args)
    assert code == 2
    assert message in stderr


def test_cli_refuses_slices_on_a_pd_fleet(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, stderr = run(
        capsys, "--prefill", "1", "--decode", "1", "--num-requests", "5", "--policies", "round-robin",
        "--dispatch-modes", "slice",
    )  # fmt: skip
    assert code == 2
    assert "neutral" in stderr


def test_auto_moves_to_slices_where_request_dispatch_thrashes_and_stays_elsewhere() -> None:
    from router.core.config import SchedulerConfig
    from sim.slicing import simulate_auto
    from sim.sweep import PolicyChoice

    policy = PolicyChoice("least-requests", SchedulerConfig(scheduling_policy="least-requests"))
    spec = load_workload("mixed").with_arrival(rate_per_s=4.0)
    work = list(generate_requests(spec, rng=0, num_requests=160))
    tight = SimFleet(fleet_from_counts(neutral=4, engine=SimConfig(kv_capacity_tokens=8192)))
    roomy = SimFleet(fleet_from_counts(neutral=4, engine=SimConfig(kv_capacity_tokens=65536)))
    mode, sliced = simulate_auto(tight, policy, work, SliceConfig())
    assert mode == "slice"
    # The requests placed before the switch ran whole; the arrivals after it, in slices.
    assert 0 < sliced.counters["auto_pilot_requests"] < len(work)
    assert sliced.figures.slices > 0
    assert all(
        r.ok and r.completion_tokens == (p.output_tokens or p.max_tokens)
        for r, p in zip(sliced.results, work, strict=True)
    )
    mode, whole = simulate_auto(roomy, policy, work, SliceConfig())
    assert mode == "request" and whole.figures.slices == 0
    # Request dispatch throughout: the very run --dispatch-modes request makes.
    plain = sim.cluster.simulate(roomy, policy.config, work)
    assert [r.e2e_ms for r in whole.results] == [r.e2e_ms for r in plain.results]


@pytest.mark.parametrize("tight", [False, True])
def test_a_heterogeneous_fleet_is_served_the_same_whatever_order_it_is_listed_in(tight: bool) -> None:
    """``tight``: 8k of KV per instance, reports beside short answers, so heads block, later batches
    pass them and continued slices wait for room on any instance: which instance admits first at
    a moment is decided by id, never by the fleet's listing order."""
    from sim.fleet import parse_fleet

    if tight:
        engine = SimConfig(kv_capacity_tokens=8192, max_num_seqs=64)
        spec = load_workload(str(SCENARIOS / "scls-reports-qa.json")).with_arrival(rate_per_s=4.0)
        work = list(generate_requests(spec, rng=54, num_requests=300))
    else:
        engine, work = ENGINE, plans(rate=8.0, count=80)
    slow, fast = "qwen2.5-7b-2xv100-linear", "qwen2.5-7b-2xv100-linear-x4"
    runs = []
    for text in (f"neutral=2:{slow},neutral=2:{fast}", f"neutral=2:{fast},neutral=2:{slow}"):
        outcome = simulate_slices(SimFleet(parse_fleet(text, engine=engine)), work, SliceConfig(), seed=2)
        runs.append((outcome.duration_s, sorted(r.e2e_ms or 0.0 for r in outcome.results)))
        if tight:
            assert outcome.counters["waited"] > 0
    assert runs[0] == runs[1]


@pytest.mark.parametrize("workload", ["mixed", "interactive-batch"])
def test_a_slice_boundary_stalls_a_stream_well_under_the_papers_requeue(workload: str) -> None:
    # Two instances short of KV (8k each) at load: a resumed slice is placed as soon as its previous
    # slice ends, so the time between two slices of a stream is the engine's own queue (under a
    # second at the 99th percentile), where sending it back to the pool for the next schedule point
    # (the paper's loop) stalls streams for many seconds (the audit measured 17 s).
    engine = SimConfig(kv_capacity_tokens=8192)
    spec = load_workload(workload).with_arrival(rate_per_s=3.0)
    work = list(generate_requests(spec, rng=5, num_requests=120))

    def stall_p99(config: SliceConfig) -> float:
        outcome = simulate_slices(SimFleet(fleet_from_counts(neutral=2, engine=engine)), work, config, seed=2)
        assert all(r.ok for r in outcome.results)
        gap = outcome.figures.resume_gap_p99_ms
        assert gap is not None
        return gap

    built = stall_p99(SliceConfig())
    assert built < 1500.0
    assert stall_p99(SliceConfig(resume_at_once=False)) > 5 * built


def test_a_slice_continued_where_it_ran_goes_on_in_its_engines_batch_at_the_next_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One instance on 8k of KV, long answers arriving faster than it serves: every next slice stays
    (``continue_in_place``) and its run goes on in the engine's running batch (``SimCore.extend``):
    it is in the engine's very next step, whatever waits in the engine's queue, and the stream's gap
    at every boundary is measured. Re-admitted through the waiting queue, as the simulator did
    before, a continued run waited there behind prompts that took the room it had freed. (Every
    slice is kept where it ran here, ``continue_within_kv`` off: with it on, one that finds no room
    in the plan waits and is re-prefilled, which is not what this test is about.)"""
    engine = SimConfig(kv_capacity_tokens=8192, max_num_seqs=64)
    one = SimFleet(fleet_from_counts(neutral=1, engine=engine))
    spec = load_workload("interactive-batch").with_arrival(rate_per_s=3.0)
    work = list(generate_requests(spec, rng=5, num_requests=60))
    steps: list[tuple[str, ...]] = []  # the requests of each step the engine scheduled, in order
    ends: list[tuple[int, str]] = []  # (step, request) of each run's last token
    runs: list[SimOutcome] = []
    schedule, finish_step, simulate = SimCore.schedule, SimCore.finish_step, sim.cluster.simulate

    def record_schedule(core: SimCore) -> ScheduledStep | None:
        step = schedule(core)
        if step is not None:
            steps.append(step.request_ids)
        return step

    def record_finish(core: SimCore, step: ScheduledStep, **kwargs: bool) -> StepResult:
        result = finish_step(core, step, **kwargs)
        ends.extend((len(steps) - 1, out.request_id) for out in result.outputs if out.finished)
        return result

    def keep(*args: object, **kwargs: object) -> SimOutcome:
        runs.append(simulate(*args, **kwargs))  # type: ignore[arg-type]
        return runs[-1]

    monkeypatch.setattr(SimCore, "schedule", record_schedule)
    monkeypatch.setattr(SimCore, "finish_step", record_finish)
    monkeypatch.setattr(sim.slicing, "simulate", keep)
    outcome = simulate_slices(one, work, SliceConfig(continue_within_kv=False), seed=1)
    assert [r.completion_tokens for r in outcome.results] == [p.true_output_tokens for p in work]
    assert outcome.figures.recomputed_tokens == 0
    boundaries = [(k, rid) for k, rid in ends if any(rid in later for later in steps[k + 1 :])]
    assert len(boundaries) == outcome.figures.slices - len(work) > 40
    assert [rid for k, rid in boundaries if rid not in steps[k + 1]] == []
    assert len(runs[0].resume_gaps_ms) == len(boundaries)  # every boundary's first token is seen


def test_a_slice_continued_where_it_ran_recomputes_nothing_and_keeps_its_stream_going() -> None:
    """On one instance every next slice stays where its request ran: continued in place
    (``continue_in_place``) the engine's run goes on as a decode, nothing is re-prefilled and the
    stream's gap at a boundary is at most a step or two; stopped and resumed, each boundary
    re-prefills (at least the last partial block) and the fleet does less work per second."""
    work = plans(rate=3.0, count=30)
    kept = simulate_slices(fleet(1), work, SliceConfig(slice_tokens=32, grow_with_answer=False))
    stopped = simulate_slices(
        fleet(1), work, SliceConfig(slice_tokens=32, grow_with_answer=False, continue_in_place=False)
    )
    for outcome in (kept, stopped):
        assert [r.completion_tokens for r in outcome.results] == [p.true_output_tokens for p in work]
        assert outcome.figures.slices > 2 * len(work)
    assert kept.figures.recomputed_tokens == 0
    assert stopped.figures.recomputed_tokens > 0
    assert kept.duration_s < stopped.duration_s
    kept_gap, stopped_gap = kept.figures.resume_gap_p99_ms, stopped.figures.resume_gap_p99_ms
    assert kept_gap is not None and stopped_gap is not None and kept_gap < stopped_gap


def test_slices_run_on_engines_that_cache_shared_prompt_prefixes() -> None:
    # Request dispatch and `auto` are simulated on engines that cache prompt blocks by the plans' hash ids
    # (vLLM's automatic prefix caching); slices run on the same engines, so a prompt behind a cached
    # 3k-token prefix computes only its own part there and its first token comes sooner.
    spec = load_workload("prefix-heavy").with_arrival(rate_per_s=2.0)
    work = list(generate_requests(spec, rng=3, num_requests=40))
    assert all(p.hash_ids for p in work)

    def ttft_mean(cache: bool) -> float:
        outcome = simulate_slices(fleet(), work, SliceConfig(), seed=2, engine_prefix_cache=cache)
        assert all(r.ok for r in outcome.results)
        return sum(r.ttft_ms or 0.0 for r in outcome.results) / len(outcome.results)

    assert ttft_mean(True) < 0.8 * ttft_mean(False)


def test_a_resumed_slice_finds_its_prompts_shared_prefix_in_the_prefix_cache() -> None:
    # A slice's next leg prefills the prompt and the tokens so far again (here every leg: neither
    # continued in place nor kept cached), and that context still starts with the prompt's shared
    # 3k-token prefix: the engine looks it up like any new prompt, as vLLM does. Without the
    # prompt's block hashes on the resumed leg, a third of the prompt tokens were hits.
    spec = load_workload("prefix-heavy").with_arrival(rate_per_s=4.0)
    work = list(generate_requests(spec, rng=5, num_requests=60))
    config = SliceConfig(continue_in_place=False, prefix_cache=False)
    outcome = sim.cluster.simulate(
        fleet(), SchedulerConfig(calibration="off"), work, seed=2, slicing=config, resume_cache=False
    )
    assert outcome.counters["resumed"] > 40
    assert outcome.cache_hit_rate is not None and outcome.cache_hit_rate > 0.6


def test_after_autos_switch_the_whole_requests_handed_to_slices_get_all_their_tokens() -> None:
    """A whole request handed to the slice plan after ``auto``'s switch is stopped in its engine
    (beside slices paused at their caps, which the engine steps with once the pass is carried out)
    and resumed as slices: every request still gets its whole answer."""
    from sim.slicing import simulate_auto
    from sim.sweep import PolicyChoice

    policy = PolicyChoice("least-requests", SchedulerConfig(scheduling_policy="least-requests"))
    spec = load_workload("mixed").with_arrival(rate_per_s=8.0)
    work = list(generate_requests(spec, rng=0, num_requests=300))
    tight = SimFleet(fleet_from_counts(neutral=4, engine=SimConfig(kv_capacity_tokens=8192)))
    mode, run = simulate_auto(tight, policy, work, SliceConfig())
    assert mode == "slice"
    assert run.counters["auto_handed_over"] > 0
    assert all(
        r.ok and r.completion_tokens == (p.output_tokens or p.max_tokens)
        for r, p in zip(run.results, work, strict=True)
    )
