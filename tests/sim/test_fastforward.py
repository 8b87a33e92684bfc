"""A fast-forwarded decode run leaves a SimCore exactly where stepping it would."""

from __future__ import annotations

from pathlib import Path

from hypothesis import event, given, settings
from hypothesis import strategies as st

from engine.model import SimConfig, SimCore, SimRequestSpec
from predictor import LatencyPredictor
from sim.fastforward import MIN_RUN_STEPS, DecodeRun, DecodeStepTimes

PROFILE = Path(__file__).resolve().parents[2] / "profiling_data" / "qwen2.5-7b-2xv100-linear"
PREDICTOR = LatencyPredictor.from_files(PROFILE / "ttft.json", PROFILE / "tpot.json")


def make_core(
    requests: list[tuple[int, int]], *, block_size: int = 16, kv_blocks: int = 4096, speed_factor: float = 1.0
) -> tuple[SimCore, DecodeStepTimes]:
    """A core holding ``requests`` (prompt tokens, output tokens), and its step times."""
    config = SimConfig(
        block_size=block_size,
        kv_capacity_tokens=kv_blocks * block_size,
        max_model_len=min(8192, kv_blocks * block_size),
        speed_factor=speed_factor,
    )
    times = DecodeStepTimes(PREDICTOR, speed_factor)
    core = SimCore(config, times.cost)
    for k, (prompt, output) in enumerate(requests):
        core.add(SimRequestSpec(f"r{k}", prompt, output))
    return core, times


def step(core: SimCore) -> tuple[float, tuple[object, ...]]:
    scheduled = core.schedule()
    assert scheduled is not None
    return scheduled.duration_ms, core.finish_step(scheduled).outputs


def stepped_twins(
    requests: list[tuple[int, int]], **kwargs: object
) -> tuple[SimCore, SimCore, DecodeStepTimes, DecodeRun] | None:
    """Two identical cores stepped until a decode run can be planned (None if never)."""
    a, times = make_core(requests, **kwargs)  # type: ignore[arg-type]
    b, _ = make_core(requests, **kwargs)  # type: ignore[arg-type]
    for _ in range(500):
        run = DecodeRun.plan(b, times, 0.0)
        if run is not None:
            return a, b, times, run
        if not a.has_unfinished:
            return None
        step(a)
        step(b)
    return None


def test_a_run_is_planned_only_for_pure_decode() -> None:
    core, times = make_core([(300, 50), (40, 30)])
    assert DecodeRun.plan(core, times, 0.0) is None  # both waiting
    step(core)  # both prompts prefilled in one step; each has its first token
    run = DecodeRun.plan(core, times, 0.0)
    assert run is not None
    assert run.max_steps == 30 - 1 - 1  # ends one step before the shorter request's last token
    core.add(SimRequestSpec("late", 10, 5))
    assert DecodeRun.plan(core, times, 0.0) is None  # something waits


def test_a_run_stops_short_of_the_last_token_and_of_missing_kv() -> None:
    core, times = make_core([(100, MIN_RUN_STEPS + 1)])
    step(core)
    assert DecodeRun.plan(core, times, 0.0) is None  # too short to be worth planning
    # Two 31-token prompts in 4-token blocks hold 16 of 20 blocks after their prefill; from
    # there each needs a new block in steps 1, 5, 9, ...: the 4 free blocks last 9 steps.
    tight, tight_times = make_core([(31, 40), (31, 40)], block_size=4, kv_blocks=20)
    step(tight)
    run = DecodeRun.plan(tight, tight_times, 0.0)
    assert run is not None
    assert run.max_steps == 9
    assert run.used_kv_tokens_at(run.max_steps - 1) == 20 * 4


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(1, 600), st.integers(2, 120)), min_size=1, max_size=8),
    block_size=st.sampled_from([1, 4, 16]),
    kv_blocks=st.integers(200, 800),
    speed_factor=st.sampled_from([1.0, 0.25, 3.0]),
    cut=st.floats(0.0, 1.0),
)
def test_applying_a_run_equals_stepping(
    requests: list[tuple[int, int]], block_size: int, kv_blocks: int, speed_factor: float, cut: float
) -> None:
    requests = [(min(p, kv_blocks * block_size - o), o) for p, o in requests]  # each fits the cache alone
    twins = stepped_twins(requests, block_size=block_size, kv_blocks=kv_blocks, speed_factor=speed_factor)
    event("planned a run" if twins is not None else "no run")
    if twins is None:
        return
    stepped, forwarded, _, run = twins
    while not run.complete:
        run.extend()
    s = round(cut * len(run.ends))
    t = 0.0
    for k in range(s):
        duration_ms, outputs = step(stepped)
        t = t + duration_ms * 1e-3
        assert t == run.ends[k]  # the same step ends, to the bit
        assert all(not out.finished and out.position > 0 for out in outputs)  # type: ignore[attr-defined]
    in_progress = stepped.schedule()
    assert in_progress is not None
    if s < len(run.ends):
        # What the router sees while step s runs.
        assert run.decode_tokens_at(s) == stepped.num_decode_tokens
        assert run.used_kv_tokens_at(s) == stepped.num_used_kv_tokens
        assert run.step_start(s) == (run.ends[s - 1] if s else 0.0)
    stepped.finish_step(in_progress)
    run.apply(s)
    resumed = forwarded.schedule()
    assert resumed is not None
    assert resumed.duration_ms == in_progress.duration_ms
    forwarded.finish_step(resumed)
    assert forwarded.load() == stepped.load()
    forwarded.check_invariants()
    # And they stay together to the end.
    while stepped.has_unfinished:
        assert step(forwarded) == step(stepped)
    assert not forwarded.has_unfinished
    assert forwarded.load() == stepped.load()


LLAMA = PROFILE.parent / "llama3-70b-4xh100-roofline"
PREDICTORS = (PREDICTOR, LatencyPredictor.from_files(LLAMA / "ttft.json", LLAMA / "tpot.json"))


@settings(max_examples=60, deadline=None)
@given(
    which=st.sampled_from([0, 1]),
    speed_factor=st.sampled_from([1.0, 0.3, 2.5]),
    batch=st.integers(1, 512),
    tokens=st.integers(1, 2_000_000),
)
def test_vectorised_step_times_equal_the_cost_model(
    which: int, speed_factor: float, batch: int, tokens: int
) -> None:
    times = DecodeStepTimes(PREDICTORS[which], speed_factor)
    expected = [times.cost.step_ms(0, batch, tokens + k * batch) for k in range(40)]
    assert times.step_ms(batch, tokens, 40) == expected
    assert times.vectorised
