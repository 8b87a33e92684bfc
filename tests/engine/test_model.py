"""The clockless engine model, stepped by hand (no event loop, no clock)."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.interface import DuplicateRequestError, EngineOverloadedError, InvalidRequestError
from engine.model import ProfileCostModel, SimConfig, SimCore, SimRequestSpec, StepResult
from tests.workers.helpers import PREDICTOR


def make_core(**overrides: object) -> SimCore:
    config = SimConfig(**{"max_model_len": 4096, "kv_capacity_tokens": 32768, **overrides})  # type: ignore[arg-type]
    return SimCore(config, ProfileCostModel(PREDICTOR, speed_factor=config.speed_factor))


def spec(rid: str, context: int, new: int, **kw: object) -> SimRequestSpec:
    return SimRequestSpec(request_id=rid, num_context_tokens=context, max_new_tokens=new, **kw)  # type: ignore[arg-type]


def step(core: SimCore) -> StepResult:
    scheduled = core.schedule()
    assert scheduled is not None
    result = core.finish_step(scheduled)
    core.check_invariants()
    return result


def run_to_completion(core: SimCore, max_steps: int = 100_000) -> dict[str, list[int]]:
    """Step until idle; the token positions each request produced."""
    produced: dict[str, list[int]] = {}
    for _ in range(max_steps):
        scheduled = core.schedule()
        if scheduled is None:
            return produced
        for out in core.finish_step(scheduled).outputs:
            produced.setdefault(out.request_id, []).append(out.position)
        core.check_invariants()
    raise AssertionError("the core did not go idle")


def test_every_config_field_has_a_doc() -> None:
    missing = [f.name for f in dataclasses.fields(SimConfig) if not f.metadata.get("doc")]
    assert not missing


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("block_size", 0, "block_size"),
        ("speed_factor", 0.0, "speed_factor"),
        ("eos_probability", 1.5, "eos_probability"),
        ("max_model_len", 100_000, "max_model_len"),
        ("max_num_seqs", 4096, "max_num_seqs"),
    ],
)
def test_bad_config_names_the_field(field: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SimConfig(**{field: value})  # type: ignore[arg-type]


def test_chunked_prefill_splits_a_long_prompt_by_the_budget() -> None:
    core = make_core(max_num_batched_tokens=2048)
    core.add(spec("a", 5000, 3))
    assert core.num_uncomputed_prefill_tokens == 5000
    chunks = []
    for _ in range(3):
        scheduled = core.schedule()
        assert scheduled is not None
        chunks.append(scheduled.num_prefill_tokens)
        result = core.finish_step(scheduled)
    assert chunks == [2048, 2048, 904]
    assert [o.position for o in result.outputs] == [0]  # the first token comes with the last chunk
    assert core.num_uncomputed_prefill_tokens == 0
    assert core.num_decode_requests == 1 and core.num_decode_tokens == 5001


def test_decodes_go_first_and_prefill_fills_the_rest_fcfs() -> None:
    core = make_core(max_num_batched_tokens=512, max_num_seqs=64)
    core.add(spec("d1", 10, 50))
    core.add(spec("d2", 10, 50))
    step(core)  # both prompts in one step
    core.add(spec("p1", 400, 5))
    core.add(spec("p2", 400, 5))
    scheduled = core.schedule()
    assert scheduled is not None
    assert scheduled.num_decode_requests == 2
    assert scheduled.num_decode_tokens == 22
    assert scheduled.num_prefill_tokens == 510  # 400 for p1, then what is left for p2
    assert scheduled.request_ids == ("d1", "d2", "p1", "p2")
    core.finish_step(scheduled)
    core.check_invariants()
    assert core.num_uncomputed_prefill_tokens == 290


def test_step_time_is_ttft_of_the_prefill_plus_tpot_of_the_decode_batch() -> None:
    core = make_core(speed_factor=2.0)
    core.add(spec("a", 100, 10))
    first = core.schedule()
    assert first is not None
    assert first.duration_ms == pytest.approx(float(PREDICTOR.ttft_profile.grid(100.0)) / 2)
    core.finish_step(first)
    core.add(spec("b", 300, 10))
    mixed = core.schedule()
    assert mixed is not None
    expected = float(PREDICTOR.ttft_profile.grid(300.0)) + PREDICTOR.predict_tpot_ms(1, 101)
    assert mixed.duration_ms == pytest.approx(expected / 2)


def test_noise_is_seeded() -> None:
    def durations(seed: int) -> list[float]:
        cost = ProfileCostModel(PREDICTOR, noise=0.2, rng=random.Random(seed))
        return [cost.step_ms(128, 4, 512) for _ in range(5)]

    assert durations(1) == durations(1)
    assert durations(1) != durations(2)
    assert len(set(durations(1))) > 1


def test_max_new_tokens_is_honoured_exactly() -> None:
    core = make_core()
    core.add(spec("a", 50, 7))
    core.add(spec("b", 3000, 1))
    produced = run_to_completion(core)
    assert produced == {"a": list(range(7)), "b": [0]}
    assert core.num_used_kv_tokens == 0


def test_kv_exhaustion_preempts_the_newest_and_loses_nothing() -> None:
    # 4 requests of up to 400 tokens each cannot all fit 1024 tokens of KV at once.
    core = make_core(kv_capacity_tokens=1024, max_model_len=1024, block_size=16, max_num_seqs=8)
    for i in range(4):
        core.add(spec(f"r{i}", 200, 200))
    produced = run_to_completion(core)
    assert core.num_preemptions > 0
    assert produced == {f"r{i}": list(range(200)) for i in range(4)}
    assert core.num_used_kv_tokens == 0 and not core.has_unfinished


def test_a_request_the_cache_can_never_hold_is_refused() -> None:
    core = make_core(kv_capacity_tokens=1024, max_model_len=1024)
    with pytest.raises(InvalidRequestError, match="KV"):
        core.add(spec("a", 1000, 100))


def test_duplicates_and_a_full_queue_are_refused() -> None:
    core = make_core(max_waiting_requests=2)
    core.add(spec("a", 10, 1))
    with pytest.raises(DuplicateRequestError):
        core.add(spec("a", 10, 1))
    core.add(spec("b", 10, 1))
    with pytest.raises(EngineOverloadedError):
        core.add(spec("c", 10, 1))


def test_held_kv_stays_until_released() -> None:
    core = make_core(block_size=16)
    core.add(spec("p", 100, 1, hold_kv=True, counts_as_decode=False))
    result = step(core)
    assert result.outputs[0].finished and result.outputs[0].held
    assert core.is_held("p") and not core.has_unfinished
    assert core.num_used_kv_tokens == 112  # 7 blocks of 16
    assert core.load().num_decode_requests == 0
    assert core.release_held("p") == 100
    assert core.num_used_kv_tokens == 0
    assert core.release_held("p") is None


def test_a_request_with_cached_kv_starts_in_decode() -> None:
    core = make_core()
    core.add(spec("d", 101, 5, num_cached_tokens=100))
    assert core.num_uncomputed_prefill_tokens == 0
    scheduled = core.schedule()
    assert scheduled is not None
    assert scheduled.num_prefill_tokens == 0 and scheduled.num_decode_requests == 1
    core.finish_step(scheduled)
    assert run_to_completion(core) == {"d": [1, 2, 3, 4]}


def test_abort_frees_everything_and_skips_the_step_in_flight() -> None:
    core = make_core()
    core.add(spec("a", 500, 10))
    scheduled = core.schedule()
    assert scheduled is not None and core.num_used_kv_tokens > 0
    assert core.abort("a")
    assert core.finish_step(scheduled).outputs == ()
    core.check_invariants()
    assert core.num_used_kv_tokens == 0
    assert not core.abort("a")


def test_admitted_ids_and_step_samples_are_bounded() -> None:
    core = make_core(
        max_recent_admitted_ids=5, max_recent_steps=3, max_num_batched_tokens=32, max_num_seqs=32
    )
    for i in range(20):
        core.add(spec(f"r{i}", 10, 2))
    run_to_completion(core)
    load = core.load()
    assert load.recent_admitted_request_ids == tuple(f"r{i}" for i in range(15, 20))
    assert len(load.recent_steps) == 3
    assert load.num_steps == core.num_steps > 3


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.integers(1, 600), st.integers(1, 60), st.booleans(), st.integers(0, 30)),
        min_size=1,
        max_size=25,
    ),
    budget=st.sampled_from([64, 256, 2048]),
    capacity_blocks=st.integers(45, 200),
)
def test_random_workloads_finish_exactly_with_consistent_counters(
    requests: list[tuple[int, int, bool, int]], budget: int, capacity_blocks: int
) -> None:
    """Arrivals between steps, some aborted: every other request yields exactly its tokens."""
    core = make_core(
        max_num_batched_tokens=budget,
        max_num_seqs=min(budget, 16),
        block_size=16,
        kv_capacity_tokens=capacity_blocks * 16,
        max_model_len=700,
    )
    produced: dict[str, list[int]] = {}
    aborted: set[str] = set()
    pending = list(enumerate(requests))
    abort_at: dict[int, str] = {}
    steps = 0
    while pending or core.has_unfinished:
        if pending:
            i, (context, new, abort, delay) = pending.pop(0)
            core.add(spec(f"r{i}", context, new))
            if abort:
                abort_at[steps + delay] = f"r{i}"
        if steps in abort_at and core.abort(abort_at[steps]):
            aborted.add(abort_at[steps])
        scheduled = core.schedule()
        if scheduled is not None:
            for out in core.finish_step(scheduled).outputs:
                produced.setdefault(out.request_id, []).append(out.position)
        core.check_invariants()
        steps += 1
        assert steps < 50_000
    for i, (_, new, _, _) in enumerate(requests):
        rid = f"r{i}"
        if rid not in aborted:
            assert produced.get(rid) == list(range(new)), rid
    assert core.num_used_kv_tokens == 0
    assert core.num_decode_requests == 0 and core.num_uncomputed_prefill_tokens == 0


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 900), st.integers(1, 60), st.integers(0, 3)), min_size=1, max_size=12)
)
def test_ends_only_reports_first_and_last_tokens_and_steps_the_same(
    requests: list[tuple[int, int, int]],
) -> None:
    """``finish_step(ends_only=True)`` reports the first and the last token of each request, and
    leaves the engine exactly as a full report does (the simulator's stepping relies on both)."""
    full, ends = make_core(kv_capacity_tokens=8192), make_core(kv_capacity_tokens=8192)
    pending = list(enumerate(requests))
    for _ in range(10_000):
        for k, (context, new, at) in list(pending):
            if at <= 0:
                for core in (full, ends):
                    core.add(spec(f"r{k}", context, new))
                pending.remove((k, (context, new, at)))
        pending = [(k, (c, n, at - 1)) for k, (c, n, at) in pending]
        a, b = full.schedule(), ends.schedule()
        assert a == b
        if a is None or b is None:
            if not pending:
                break
            continue
        got_full = full.finish_step(a).outputs
        got_ends = ends.finish_step(b, ends_only=True).outputs
        assert got_ends == tuple(o for o in got_full if o.position == 0 or o.finished)
        assert (full.num_decode_tokens, full.num_used_kv_tokens, full.num_running) == (
            ends.num_decode_tokens,
            ends.num_used_kv_tokens,
            ends.num_running,
        )
    assert not full.has_unfinished and not ends.has_unfinished


# ---------------------------------------------------------------- a budget raised in place (SimCore.extend)


def test_a_paused_request_keeps_its_kv_and_goes_on_decoding_when_its_budget_is_raised() -> None:
    """``pause_at_end`` stops a request at its last token without leaving the batch; ``extend`` lets it
    go on at the very next step as a decode: no prefill, its blocks kept, positions counting on."""
    core = make_core(block_size=16)
    core.add(spec("a", 100, 5, pause_at_end=True))
    produced = run_until_paused(core, "a")
    assert produced == [0, 1, 2, 3, 4]
    assert core.is_paused("a") and core.is_active("a") and core.num_running == 1
    assert core.has_paused()
    assert core.num_used_kv_tokens == 112  # 104 tokens computed: 7 blocks, none freed
    assert core.num_decode_requests == 1 and core.num_decode_tokens == 105
    with pytest.raises(RuntimeError, match="paused"):
        core.schedule()
    assert core.extend("a", 12, pause_at_end=False)
    assert not core.is_paused("a") and not core.has_paused()
    assert core.decode_progress("a") == (105, 7, True)
    scheduled = core.schedule()
    assert scheduled is not None
    assert scheduled.num_prefill_tokens == 0 and scheduled.num_decode_requests == 1
    first = core.finish_step(scheduled, ends_only=True).outputs
    assert first == (("a", 5, False, False),)  # the first token past the old budget is reported
    core.check_invariants()
    assert run_to_completion(core) == {"a": [6, 7, 8, 9, 10, 11]}
    assert core.num_used_kv_tokens == 0 and core.num_decode_tokens == 0 and not core.has_unfinished


def run_until_paused(core: SimCore, rid: str, max_steps: int = 10_000) -> list[int]:
    """Step until ``rid`` pauses at its last token; the positions it produced."""
    produced: list[int] = []
    for _ in range(max_steps):
        scheduled = core.schedule()
        assert scheduled is not None
        for out in core.finish_step(scheduled).outputs:
            if out.request_id == rid:
                produced.append(out.position)
        core.check_invariants()
        if core.is_paused(rid):
            return produced
    raise AssertionError(f"{rid} never paused")


def test_a_raised_budget_does_not_wait_behind_the_queue_where_a_re_admitted_run_does() -> None:
    """What re-admitting a continued run cost (the simulator's way before ``extend``): the run ended at
    its cap freed its blocks and came back through the waiting queue with its context cached, behind
    a head that then took the room; a run whose budget is raised decodes at the next step, blocks kept."""
    for raised in (True, False):
        core = make_core(block_size=16, kv_capacity_tokens=1024, max_model_len=1024, max_num_seqs=8)
        core.add(spec("a", 300, 4, pause_at_end=raised))
        run_until_finished_or_paused(core, "a")
        core.add(spec("head", 800, 2))  # 50 blocks: they fit in the 64 only while a holds none
        if raised:
            assert core.extend("a", 8, pause_at_end=False)
        else:
            core.add(spec("a", 304, 4, num_cached_tokens=304))
        scheduled = core.schedule()
        assert scheduled is not None
        assert scheduled.request_ids == (("a",) if raised else ("head",))
        if raised:
            assert scheduled.num_prefill_tokens == 0 and scheduled.num_decode_requests == 1
        core.finish_step(scheduled)
        core.check_invariants()


def run_until_finished_or_paused(core: SimCore, rid: str) -> None:
    for _ in range(10_000):
        scheduled = core.schedule()
        assert scheduled is not None
        outs = core.finish_step(scheduled).outputs
        if any(o.request_id == rid and o.finished for o in outs):
            return
    raise AssertionError(f"{rid} never finished")


def test_a_request_whose_budget_was_raised_is_still_preempted_and_loses_nothing() -> None:
    """Raised in place, a request keeps its place in the batch: as the newest it is the one a full KV
    preempts, it is recomputed, and it still yields exactly its raised budget."""
    core = make_core(kv_capacity_tokens=1024, max_model_len=1024, block_size=16, max_num_seqs=8)
    core.add(spec("x", 200, 400))
    core.add(spec("a", 200, 10, pause_at_end=True))
    produced = {"a": run_until_paused(core, "a")}
    assert core.extend("a", 400, pause_at_end=False)
    for rid, positions in run_to_completion(core).items():
        produced.setdefault(rid, []).extend(positions)
    assert core.num_preemptions > 0
    assert produced["a"] == list(range(400))
    assert produced["x"][-1] == 399 and not core.has_unfinished and core.num_used_kv_tokens == 0


def test_extend_refuses_a_budget_it_cannot_raise_to_and_ignores_unknown_ids() -> None:
    core = make_core(kv_capacity_tokens=1024, max_model_len=1024, block_size=16)
    core.add(spec("a", 100, 5, pause_at_end=True))
    run_until_paused(core, "a")
    with pytest.raises(InvalidRequestError, match="max_new_tokens 4"):
        core.extend("a", 4)
    with pytest.raises(InvalidRequestError, match="KV"):
        core.extend("a", 2000)
    assert not core.extend("nobody", 10)
    assert core.abort("a") and not core.is_paused("a")
    core.check_invariants()
    assert core.num_used_kv_tokens == 0
    with pytest.raises(InvalidRequestError, match="pause_at_end"):
        core.add(spec("p", 10, 1, hold_kv=True, pause_at_end=True))


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(
        st.tuples(
            st.integers(1, 400),
            st.integers(1, 40),
            st.lists(st.integers(1, 80), max_size=3),
            st.booleans(),
        ),
        min_size=1,
        max_size=16,
    ),
    capacity_blocks=st.integers(45, 160),
    ends_only=st.booleans(),
)
def test_budgets_raised_in_place_yield_exactly_their_tokens_with_consistent_kv(
    requests: list[tuple[int, int, list[int], bool]], capacity_blocks: int, ends_only: bool
) -> None:
    """Requests paused at their budget, then raised (``extend``) a few times or ended (``abort``)
    there, beside others; under KV pressure (preemptions happen): a raised request is decoding at
    once (nothing to prefill), every counter and block count stays right, and each yields exactly
    its final budget, positions counting on across raises."""
    core = make_core(
        max_num_batched_tokens=256,
        max_num_seqs=16,
        block_size=16,
        kv_capacity_tokens=capacity_blocks * 16,
        max_model_len=700,
    )
    raises = {f"r{i}": list(more) for i, (_, _, more, _) in enumerate(requests)}
    by_abort = {f"r{i}": end for i, (_, _, _, end) in enumerate(requests)}
    final: dict[str, int] = {}
    produced: dict[str, list[int]] = {}
    for i, (context, new, more, end_by_abort) in enumerate(requests):
        rid = f"r{i}"
        total = new + sum(more)
        if context + total > 700:
            raises[rid] = []
            total = new
        final[rid] = total
        core.add(spec(rid, context, new, pause_at_end=bool(raises[rid]) or end_by_abort))
    steps = 0
    while core.has_unfinished:
        scheduled = core.schedule()
        assert scheduled is not None
        for out in core.finish_step(scheduled, ends_only=ends_only).outputs:
            produced.setdefault(out.request_id, []).append(out.position)
            if not core.is_paused(out.request_id):
                continue
            rid = out.request_id
            if raises[rid]:
                budget = out.position + 1 + raises[rid].pop(0)
                uncomputed = core.num_uncomputed_prefill_tokens
                assert core.extend(rid, budget, pause_at_end=bool(raises[rid]) or by_abort[rid])
                assert core.num_uncomputed_prefill_tokens == uncomputed
                progress = core.decode_progress(rid)
                assert progress is not None and progress[1] == budget - out.position - 1 and progress[2]
            else:
                assert core.abort(rid)  # paused at its final budget: its driver ends it
        core.check_invariants()
        steps += 1
        assert steps < 50_000
    for rid, total in final.items():
        got = produced[rid]
        if ends_only:
            assert got[0] == 0 and got[-1] == total - 1 and got == sorted(set(got)), rid
        else:
            assert got == list(range(total)), rid
    assert core.num_used_kv_tokens == 0
    assert core.num_decode_requests == 0 and core.num_uncomputed_prefill_tokens == 0
