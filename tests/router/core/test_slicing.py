"""Slice-level scheduling core: estimators against the profile, the batcher against brute force, max-min."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from predictor import LatencyPredictor
from router.core.slicing import (
    LoadLedger,
    MemoryModel,
    ServingTimeModel,
    SliceConfig,
    SliceRequest,
    SliceScheduler,
    batch_requests,
    fit_decode,
    kv_need,
    next_interval_ms,
    offload_max_min,
    total_serve_ms,
)

PROFILES = Path(__file__).resolve().parents[3] / "profiling_data"
PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def load(name: str) -> LatencyPredictor:
    return LatencyPredictor.from_files(PROFILES / name / "ttft.json", PROFILES / name / "tpot.json")


LINEAR = load("qwen2.5-7b-2xv100-linear")
ROOFLINE = load("llama3-70b-4xh100-roofline")
SERVING = ServingTimeModel(LINEAR, max_num_batched_tokens=2048)


# ----------------------------------------------------------------------------- estimators


@pytest.mark.parametrize(("predictor", "tolerance"), [(LINEAR, 0.001), (ROOFLINE, 0.03)])
@pytest.mark.parametrize(
    ("contexts", "slices"),
    [
        ([100], [128]),
        ([500] * 16, [128] * 16),
        ([1000] * 64, [128] * 64),
        ([50, 2000, 300], [128, 128, 128]),
        ([3000] * 10, [64] * 10),
    ],
)
def test_serving_estimate_matches_the_profile_summed_step_by_step(
    predictor: LatencyPredictor, tolerance: float, contexts: list[int], slices: list[int]
) -> None:
    model = ServingTimeModel(predictor, max_num_batched_tokens=2048)
    fitted = model.serve_ms(len(contexts), sum(contexts), max(slices))
    exact = model.exact_serve_ms(contexts, slices)
    assert fitted == pytest.approx(exact, rel=tolerance)


def test_linear_profile_fit_recovers_its_coefficients() -> None:
    # The bundled linear profile was generated from d = 0.0002*N*l + 0.275*N + 0.00088*l + 15.85.
    fit = fit_decode(LINEAR)
    assert fit.d1 == pytest.approx(0.0002, rel=1e-3)
    assert fit.d2 == pytest.approx(0.275, rel=1e-3)
    assert fit.d3 == pytest.approx(0.00088, rel=1e-2)
    assert fit.d4 == pytest.approx(15.85, rel=1e-3)


def test_changing_the_slice_length_needs_no_new_fit() -> None:
    # One model serves every slice length; the estimate grows with it, by one decode step per token.
    times = [SERVING.serve_ms(8, 4000, s) for s in (16, 64, 128, 512)]
    assert times == sorted(times)
    step = SERVING.serve_ms(8, 4000, 129) - SERVING.serve_ms(8, 4000, 128)
    assert step == pytest.approx(SERVING.decode.step_ms(8, 4000 / 8 + 128), rel=1e-9)


def test_prefill_is_the_engines_chunked_prefill_of_the_token_sum() -> None:
    full = float(LINEAR.prefill_step_ms(2048.0))
    tail = float(LINEAR.prefill_step_ms(100.0))
    assert SERVING.prefill_ms(2 * 2048 + 100) == pytest.approx(2 * full + tail)
    assert SERVING.prefill_ms(0) == 0.0
    # No padding: a short and a long request cost their token sum, not twice the long one.
    assert SERVING.serve_ms(2, 10 + 1000, 1) == pytest.approx(SERVING.prefill_ms(1010))


def test_memory_counts_whole_blocks_of_context_plus_slice() -> None:
    memory = MemoryModel(kv_capacity_tokens=1000, block_size=16, headroom=0.5, max_batch=3)
    assert memory.request_kv_tokens(100, 28) == 128
    assert memory.request_kv_tokens(100, 29) == 144
    assert memory.fits(3, 500)
    assert not memory.fits(3, 501)
    assert not memory.fits(4, 10)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"slice_tokens": 0}, "slice_tokens"),
        ({"interval_ms": -1.0}, "interval_ms"),
        ({"interval_load_factor": 1.0}, "interval_load_factor"),
        ({"min_interval_ms": 0.0}, "min_interval_ms"),
        ({"kv_headroom": 1.5}, "kv_headroom"),
        ({"max_waiting_slices": 0}, "max_waiting_slices"),
        ({"max_batching_slices": 0}, "max_batching_slices"),
        ({"head_wait_intervals": -1.0}, "head_wait_intervals"),
    ],
)
def test_slice_config_names_the_bad_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SliceConfig(**kwargs)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- batcher


def brute_force(requests: list[SliceRequest], memory: MemoryModel) -> float:
    """Least total serving time over every partition of the sorted requests into feasible contiguous runs."""
    ordered = sorted(requests, key=lambda r: (r.context_tokens, r.slice_tokens, repr(r.key)))
    n = len(ordered)
    best = float("inf")
    for cuts in itertools.product((False, True), repeat=n - 1):
        runs: list[list[SliceRequest]] = [[ordered[0]]]
        for cut, r in zip(cuts, ordered[1:], strict=True):
            if cut:
                runs.append([r])
            else:
                runs[-1].append(r)
        total = 0.0
        for run in runs:
            kv = sum(memory.request_kv_tokens(r.context_tokens, r.slice_tokens) for r in run)
            if len(run) > 1 and not memory.fits(len(run), kv):
                break
            total += SERVING.serve_ms(
                len(run), sum(r.context_tokens for r in run), max(r.slice_tokens for r in run)
            )
        else:
            best = min(best, total)
    return best


requests_strategy = st.lists(
    st.tuples(st.integers(1, 4000), st.integers(1, 128)), min_size=1, max_size=8
).map(lambda rows: [SliceRequest(k, c, g) for k, (c, g) in enumerate(rows)])


@PROPS
@given(
    requests=requests_strategy,
    capacity=st.integers(256, 40_000),
    max_batch=st.integers(1, 8),
)
def test_batcher_matches_brute_force_on_small_pools(
    requests: list[SliceRequest], capacity: int, max_batch: int
) -> None:
    memory = MemoryModel(kv_capacity_tokens=capacity, block_size=16, headroom=0.9, max_batch=max_batch)
    batches = batch_requests(requests, SERVING, memory)
    # Every request exactly once, batches contiguous in context order and within memory (or alone).
    flat = [r for b in batches for r in b.requests]
    assert sorted(r.key for r in flat) == sorted(r.key for r in requests)  # type: ignore[type-var]
    assert [r.context_tokens for r in flat] == sorted(r.context_tokens for r in requests)
    for b in batches:
        assert len(b.requests) == 1 or memory.fits(len(b.requests), b.kv_tokens)
        assert b.serve_ms == pytest.approx(
            SERVING.serve_ms(len(b.requests), b.context_tokens, max(r.slice_tokens for r in b.requests))
        )
    assert total_serve_ms(batches) == pytest.approx(brute_force(requests, memory), rel=1e-9)


def test_batcher_separates_a_long_prompt_when_batching_it_costs_more() -> None:
    # Fifteen short requests and one long one: with a small chunk budget the long prompt's prefill
    # would hold up fifteen decodes, so the batcher weighs both options and never does worse than either.
    serving = ServingTimeModel(LINEAR, max_num_batched_tokens=256)
    memory = MemoryModel(kv_capacity_tokens=65536)
    pool = [SliceRequest(k, 10, 128) for k in range(15)] + [SliceRequest("long", 4000, 128)]
    batches = batch_requests(pool, serving, memory)
    together = serving.serve_ms(16, 15 * 10 + 4000, 128)
    apart = serving.serve_ms(15, 150, 128) + serving.serve_ms(1, 4000, 128)
    assert total_serve_ms(batches) <= min(together, apart) + 1e-9


def test_batcher_respects_the_kv_budget_on_a_large_pool() -> None:
    memory = MemoryModel(kv_capacity_tokens=8192, block_size=16, headroom=0.9, max_batch=256)
    pool = [SliceRequest(k, 100 + 37 * k, 128) for k in range(60)]
    batches = batch_requests(pool, SERVING, memory)
    assert len(batches) > 1
    assert all(memory.fits(len(b.requests), b.kv_tokens) for b in batches)
    assert batch_requests([], SERVING, memory) == []


# ----------------------------------------------------------------------------- offloader


@PROPS
@given(
    serve=st.lists(st.floats(0.0, 1e4, allow_nan=False), max_size=20),
    loads=st.lists(st.floats(0.0, 1e4, allow_nan=False), min_size=1, max_size=6),
)
def test_offloader_is_max_min(serve: list[float], loads: list[float]) -> None:
    where, after = offload_max_min(serve, loads)
    # Replay: batches in non-increasing serving time, each onto an instance least loaded at that moment.
    current = list(loads)
    order = sorted(range(len(serve)), key=lambda k: (-serve[k], k))
    assert [serve[k] for k in order] == sorted(serve, reverse=True)
    for b in order:
        assert current[where[b]] == min(current)
        current[where[b]] += serve[b]
    assert after == pytest.approx(current)
    assert sum(after) == pytest.approx(sum(loads) + sum(serve))
    # Greedy list scheduling's bound: the most loaded instance that got a batch exceeds the least
    # loaded one by at most the longest batch.
    received = {w for w in where}
    if received:
        top = max(received, key=lambda w: after[w])
        assert after[top] - min(after) <= max(serve) + 1e-6


def test_ledger_adds_on_offload_and_subtracts_on_completion() -> None:
    ledger = LoadLedger(2)
    memory = MemoryModel(kv_capacity_tokens=65536)
    batches = batch_requests(
        [SliceRequest(0, 100, 128), SliceRequest(1, 3000, 128)],
        ServingTimeModel(LINEAR, max_num_batched_tokens=256),
        MemoryModel(kv_capacity_tokens=memory.kv_capacity_tokens, max_batch=1),
    )
    where = ledger.offload(batches)
    assert sorted(where) == [0, 1]
    longest = max(range(2), key=lambda b: batches[b].serve_ms)
    assert where[longest] == 0  # the longest batch goes first, to the (tied) lowest index
    for b, w in enumerate(where):
        ledger.done(w, batches[b].serve_ms)
    assert ledger.loads == [0.0, 0.0]


def test_interval_adapts_to_the_least_loaded_instance() -> None:
    adaptive = SliceConfig(interval_load_factor=0.5, min_interval_ms=200.0)
    assert next_interval_ms([0.0, 5000.0], adaptive) == 200.0
    assert next_interval_ms([3000.0, 5000.0], adaptive) == 1500.0
    assert next_interval_ms([], adaptive) == 200.0
    assert next_interval_ms([3000.0], SliceConfig(interval_ms=50.0)) == 50.0


# ----------------------------------------------------------------------------- the whole cycle


def make_scheduler(overlap: bool = True, instances: tuple[str, ...] = ("a", "b")) -> SliceScheduler:
    memory = MemoryModel(kv_capacity_tokens=4096, block_size=16, headroom=1.0, max_batch=4)
    return SliceScheduler(SliceConfig(overlap_batches=overlap), SERVING, memory, instances)


@PROPS
@given(
    contexts=st.lists(st.integers(1, 1500), min_size=1, max_size=30),
    overlap=st.booleans(),
    order=st.randoms(use_true_random=False),
)
def test_scheduler_never_plans_past_the_kv_budget_and_drains_to_idle(
    contexts: list[int], overlap: bool, order: random.Random
) -> None:
    sched = make_scheduler(overlap)
    for k, c in enumerate(contexts):
        sched.add(SliceRequest(k, c, 128))
    placed = sched.schedule()
    assert sorted(r.key for b, _ in placed for r in b.requests) == list(range(len(contexts)))  # type: ignore[type-var]
    running: dict[str, list[tuple[int, SliceRequest]]] = {i: [] for i in sched.instances}
    served = 0
    for _ in range(10 * len(contexts) + 10):  # bounded: every round finishes at least one slice
        for i in sched.instances:
            admitted = sched.admit(i)
            running[i].extend((key, r) for key, b in admitted for r in b.requests)
            planned = sum(
                MEMORY_CHECK.request_kv_tokens(r.context_tokens, r.slice_tokens) for _, r in running[i]
            )
            batches = {key for key, _ in running[i]}
            assert len(batches) <= 1 or (overlap and planned <= sched.memory.budget_tokens)
        live = [i for i in sched.instances if running[i]]
        if not live:
            break
        i = order.choice(live)
        key, r = running[i].pop(order.randrange(len(running[i])))
        sched.finish(i, key, r)
        served += 1
    assert served == len(contexts)
    assert [sched.load_ms(i) for i in sched.instances] == [0.0, 0.0]
    assert all(sched.queued(i) == 0 for i in sched.instances)


@PROPS
@given(
    contexts=st.lists(st.integers(1, 2500), min_size=1, max_size=30),
    wait=st.sampled_from([None, 0.0, 1.0, 3.0]),
    order=st.randoms(use_true_random=False),
)
def test_a_passed_head_never_takes_the_plan_past_the_whole_kv_and_the_fleet_drains(
    contexts: list[int], wait: float | None, order: random.Random
) -> None:
    """With the clock running (heads passed for ``head_wait_intervals`` go on within the whole KV),
    new work stays within the budget (0.7 of the KV) unless a head has waited its intervals, no
    plan ever passes the whole KV, and every slice is served."""
    memory = MemoryModel(kv_capacity_tokens=4096, block_size=16, headroom=0.7, max_batch=4)
    sched = SliceScheduler(
        SliceConfig(kv_headroom=0.7, head_wait_intervals=wait), SERVING, memory, ["a", "b"]
    )
    for k, c in enumerate(contexts):
        sched.add(SliceRequest(k, c, 128))
    sched.schedule()
    running: dict[str, list[tuple[int, SliceRequest]]] = {i: [] for i in sched.instances}
    served = 0
    now = 0.0
    for _ in range(10 * len(contexts) + 10):  # bounded: every round finishes at least one slice
        now += order.uniform(0.0, 2000.0)
        for i in sched.instances:
            admitted = sched.admit(i, now)
            running[i].extend((key, r) for key, b in admitted for r in b.requests)
            if len({key for key, _ in running[i]}) > 1:
                limit = memory.kv_capacity_tokens if wait is not None else memory.budget_tokens
                assert sched.planned_kv(i) <= limit
        live = [i for i in sched.instances if running[i]]
        if not live:
            break
        i = order.choice(live)
        key, r = running[i].pop(order.randrange(len(running[i])))
        sched.finish(i, key, r, now)
        served += 1
    assert served == len(contexts)
    assert all(sched.queued(i) == 0 for i in sched.instances)


MEMORY_CHECK = MemoryModel(kv_capacity_tokens=4096, block_size=16, headroom=1.0, max_batch=4)


def test_a_removed_instance_returns_its_queued_batches_to_the_pool() -> None:
    sched = make_scheduler(overlap=False)
    for k in range(12):
        sched.add(SliceRequest(k, 900, 128))
    placed = sched.schedule()
    on_b = [r for batch, i in placed if i == "b" for r in batch.requests]
    assert on_b and sched.admit("b")  # one batch runs on b, the rest wait in its queue
    queued = [r for batch, i in placed if i == "b" for r in batch.requests][len(placed[1][0].requests) :]
    sched.set_instances(["a", "c"])
    assert sched.instances == ("a", "c")
    assert sched.load_ms("c") == 0.0
    assert {r.key for r in sched.pool} >= {r.key for r in queued}
    # The batch still running on b ends normally.
    assert sched.interval_ms() >= sched.config.min_interval_ms


def test_a_schedule_point_batches_at_most_max_batching_slices_oldest_first() -> None:
    memory = MemoryModel(kv_capacity_tokens=65536)
    sched = SliceScheduler(SliceConfig(max_batching_slices=5), SERVING, memory, ["a"])
    for k in range(12):
        sched.add(SliceRequest(k, 100, 16))
    placed = sched.schedule()
    assert sorted(r.key for b, _ in placed for r in b.requests) == [0, 1, 2, 3, 4]  # type: ignore[type-var]
    assert [r.key for r in sched.pool] == list(range(5, 12))


@pytest.mark.parametrize("context", [1000, 1024, 1037])
def test_a_slice_resumed_where_its_blocks_are_cached_is_charged_its_tail_prefill_step(context: int) -> None:
    """Eq. 1 prices every slice with its prefill: staying on the cached instance still runs a
    prefill step over the last partial block (a whole block when the context ends on one), when
    the engine stopped the run at the slice's end (``continue_in_place`` off)."""
    memory = MemoryModel(kv_capacity_tokens=65536, block_size=16)
    sched = SliceScheduler(SliceConfig(continue_in_place=False), SERVING, memory, ["a"])
    first = SliceRequest("r", context - 128, 128)
    sched.add(first)
    sched.schedule()
    [(key, _batch)] = sched.admit("a")
    following = SliceRequest("r", context, 128)
    placed = sched.resume("a", key, first, following)
    assert placed is not None
    target, _key, batch = placed
    assert target == "a"
    tail = context % 16 or 16
    decode_only = SERVING.marginal_ms(context, 128) - SERVING.prefill_ms(context)
    assert batch.serve_ms == pytest.approx(decode_only + SERVING.prefill_ms(tail))
    assert batch.serve_ms >= decode_only + SERVING.prefill_ms(1) > decode_only


def test_a_slice_that_continues_its_run_in_place_is_charged_its_decode_only() -> None:
    """Continued where it ran (the router lets the engine's leg go on), a slice has nothing to
    prefill: the load ledger takes its share of the decode, and staying is cheaper than moving by
    the whole context's prefill."""
    memory = MemoryModel(kv_capacity_tokens=65536, block_size=16)
    sched = SliceScheduler(SliceConfig(), SERVING, memory, ["a", "b"])
    first = SliceRequest("r", 872, 128)
    sched.add(first)
    [(_batch, instance)] = sched.schedule()
    [(key, _)] = sched.admit(instance)
    following = SliceRequest("r", 1000, 128)
    placed = sched.resume(instance, key, first, following)
    assert placed is not None
    target, _key, batch = placed
    assert target == instance
    decode_only = SERVING.marginal_ms(1000, 128) - SERVING.prefill_ms(1000)
    assert batch.serve_ms == pytest.approx(decode_only)
    stopped = SliceScheduler(SliceConfig(continue_in_place=False), SERVING, memory, ["a", "b"])
    assert stopped._marginal(instance, following, cached=True) > batch.serve_ms


def _two_running(config: SliceConfig, capacity: int = 4096) -> tuple[SliceScheduler, dict[str, int], int]:
    """One instance running a long slice ``x`` (2,000 context + 1,000 tokens, just started) and a
    slice ``r`` (900 + 100) at its last token; progress read from a dict. Returns r's batch key."""
    memory = MemoryModel(kv_capacity_tokens=capacity, block_size=16, headroom=config.kv_headroom)
    sched = SliceScheduler(config, SERVING, memory, ["a"])
    now = {"x": 2000, "r": 900}
    sched.progress = now.get  # type: ignore[assignment]
    sched.add(SliceRequest("x", 2000, 1000))
    sched.schedule()
    [(_kx, _bx)] = sched.admit("a")
    sched.add(SliceRequest("r", 900, 100))
    sched.schedule()
    [(kr, _br)] = sched.admit("a")
    now["r"] = 1000
    return sched, now, kr


def test_a_slice_continued_where_it_ran_is_shortened_to_the_room_its_kv_plan_has_there() -> None:
    """The KV a continued slice already holds stays where it runs: its next slice is admitted there
    only within the whole KV (the plan's peak over every running slice's remaining steps), cut to
    the longest slice that fits; before, it was booked whole, past the KV, whatever the plan held."""
    config = SliceConfig(kv_headroom=1.0)
    sched, _now, kr = _two_running(config)
    following = SliceRequest("r", 1000, 1024)
    placed = sched.resume("a", kr, SliceRequest("r", 900, 100), following)
    assert placed is not None
    target, _key, batch = placed
    [part] = batch.requests
    assert target == "a" and part.context_tokens == 1000
    assert 16 <= part.slice_tokens < 1024
    assert sched.shortened == 1
    assert sched.committed_kv("a") <= sched.ceiling_kv("a")
    # One more block would not have fitted.
    longer = SliceRequest("r", 1000, part.slice_tokens + 16)
    kv = sched.models("a").memory.request_kv_tokens(1000, longer.slice_tokens)
    held = [h for h in (sched._held("a") or []) if h[1] != part.slice_tokens or h[0] > 1016]
    from router.core.slicing import kv_peak_of

    assert kv_peak_of([*held, (float(kv - longer.slice_tokens), float(longer.slice_tokens))]) > 4096
    # Admitted whatever the plan holds (the build before): booked whole, past the KV.
    old, _, kr_old = _two_running(SliceConfig(kv_headroom=1.0, continue_within_kv=False))
    placed_old = old.resume("a", kr_old, SliceRequest("r", 900, 100), following)
    assert placed_old is not None and placed_old[2].requests[0].slice_tokens == 1024
    assert old.committed_kv("a") > old.ceiling_kv("a")


def test_a_continued_slice_with_no_room_anywhere_waits_at_its_queue_head_and_goes_first() -> None:
    """Nowhere to fit (the plan tightened after a preemption), the slice waits at the head of its
    instance's queue, ahead of new work queued there, and starts (shortened to the room) as soon
    as room frees; the instance's plan never goes past its KV on its account."""
    config = SliceConfig(kv_headroom=1.0)
    sched, now, kr = _two_running(config)
    for _ in range(2):
        sched.preempted("a")  # the cap shrinks: the KV the plan may fill falls below what runs
    sched.add(SliceRequest("new", 400, 128))
    sched.schedule()
    assert sched.admit("a") == []
    placed = sched.resume("a", kr, SliceRequest("r", 900, 100), SliceRequest("r", 1000, 1024))
    assert placed is None
    assert sched.waited == 1 and sched.queued("a") == 2
    assert sched.admit("a") == []  # still no room: x holds it
    # x ends: r goes on first (a continuation, within the KV), then the new slice as budget allows.
    running_x = next(k for k, e in sched._running["a"].items() if e.batch.requests[0].key == "x")
    sched.finish("a", running_x, SliceRequest("x", 2000, 1000))
    del now["x"]
    started = sched.admit("a")
    assert started[0][1].requests[0].key == "r"
    assert started[0][1].requests[0].context_tokens == 1000
    assert sched.committed_kv("a") <= sched.ceiling_kv("a")


@PROPS
@given(
    contexts=st.lists(st.integers(16, 1500), min_size=3, max_size=8),
    slices=st.lists(st.integers(1, 600), min_size=3, max_size=8),
    progress=st.lists(st.floats(0.0, 1.0), min_size=3, max_size=8),
    growth=st.integers(16, 1024),
)
def test_a_continued_slice_never_takes_its_instances_plan_past_the_kv(
    contexts: list[int], slices: list[int], progress: list[float], growth: int
) -> None:
    """Whatever runs on the instance and however far each slice has got, a slice continued there
    is admitted (whole or shortened) only if the plan's peak stays within the KV, or it waits."""
    n = min(len(contexts), len(slices), len(progress))
    memory = MemoryModel(kv_capacity_tokens=8192, block_size=16, headroom=1.0)
    sched = SliceScheduler(SliceConfig(kv_headroom=1.0), SERVING, memory, ["a"])
    now: dict[object, int] = {}
    sched.progress = now.get  # type: ignore[assignment]
    keys = []
    for k in range(n):
        req = SliceRequest(k, contexts[k], slices[k])
        now[k] = contexts[k]
        sched.add(req)
    for _ in range(3):
        sched.schedule()
        for key, batch in sched.admit("a"):
            keys.extend(("a", key, r) for r in batch.requests)
    for _i, _key, r in keys:
        now[r.key] = r.context_tokens + int(progress[int(r.key)] * r.slice_tokens)  # type: ignore[call-overload]
    i, key, r = keys[0]
    now[r.key] = r.context_tokens + r.slice_tokens
    # New work takes what the plan sees free once r's slice has ended.
    for k in range(n):
        late = SliceRequest(100 + k, contexts[k], slices[k])
        now[late.key] = late.context_tokens
        sched.add(late)
    sched.schedule()
    sched.admit("a")
    following = SliceRequest(r.key, r.context_tokens + r.slice_tokens, growth)
    placed = sched.resume(i, key, r, following)
    if placed is None:
        assert sched.queued(i) >= 1
        return
    target, _k, _batch = placed
    assert target == i
    assert sched.committed_kv(i) <= sched.ceiling_kv(i) + 1e-9


def test_a_waiting_continuation_starts_on_the_first_instance_with_room_for_it() -> None:
    """A slice that waited has left its engine (its context is prefilled again wherever it starts),
    so another instance with room takes it at its next admission, ahead of new work there, rather
    than the stream stalling until its own instance frees room."""
    memory = MemoryModel(kv_capacity_tokens=4096, block_size=16, headroom=1.0)
    sched = SliceScheduler(SliceConfig(kv_headroom=1.0), SERVING, memory, ["a", "b"])
    now = {"x": 2000, "r": 2000}
    sched.progress = now.get  # type: ignore[assignment]
    keys = {}
    for key, context, tokens in (("x", 2000, 1000), ("r", 2000, 100)):
        sched.add(SliceRequest(key, context, tokens))
        [(_batch, instance)] = sched.schedule()
        [(k, _b)] = sched.admit(instance)
        keys[key] = (instance, k)
    assert keys["x"][0] == "a" and keys["r"][0] == "b"
    for i in ("a", "b"):
        for _ in range(4):
            sched.preempted(i)  # each plan may hold half its KV: r's 2,100 tokens fit nowhere
    now["r"] = 2100
    placed = sched.resume("b", keys["r"][1], SliceRequest("r", 2000, 100), SliceRequest("r", 2100, 256))
    assert placed is None and sched.waited == 1 and sched.queued("b") == 1
    # x ends on a and a's cap recovers: a's next admission starts r there.
    sched.finish("a", keys["x"][1], SliceRequest("x", 2000, 1000))
    del now["x"]
    sched.models("a").memory_fit.zeta = 1.0
    started = sched.admit("a")
    assert [b.requests[0].key for _k, b in started] == ["r"]
    assert started[0][1].requests[0].context_tokens == 2100
    assert sched.queued("b") == 0 and sched.moved == 1
    assert sched.admit("b") == []


@pytest.mark.parametrize("backfill", [True, False])
def test_a_blocked_head_lets_a_later_batch_that_fits_start_and_keeps_its_place(backfill: bool) -> None:
    """An instance runs a long slice; the head of its queue (1,500 tokens of context) does not fit
    the room left, a later batch (300) does. With backfill the later batch starts now, the head
    staying first in the queue; without, both wait. Either way the plan stays within the budget,
    and the head starts first once room frees."""
    memory = MemoryModel(kv_capacity_tokens=4096, block_size=16, headroom=1.0)
    sched = SliceScheduler(SliceConfig(kv_headroom=1.0, backfill=backfill), SERVING, memory, ["a"])
    now = {"x": 2000}
    sched.progress = now.get  # type: ignore[assignment]
    sched.add(SliceRequest("x", 2000, 1000))
    sched.schedule()
    [(kx, _b)] = sched.admit("a")
    for key, context in (("head", 1500), ("later", 300)):  # two schedule points: two batches, in order
        sched.add(SliceRequest(key, context, 128))
        now[key] = context
        sched.schedule()
    started = sched.admit("a")
    started_keys = [r.key for _k, b in started for r in b.requests]
    assert started_keys == (["later"] if backfill else [])
    assert sched.committed_kv("a") <= sched.budget_kv("a")
    assert sched.queued("a") == (1 if backfill else 2)
    sched.finish("a", kx, SliceRequest("x", 2000, 1000))
    del now["x"]
    after = [r.key for _k, b in sched.admit("a") for r in b.requests]
    assert after[0] == "head"


@pytest.mark.parametrize("wait", [1.0, 3.0, None])
def test_a_head_passed_for_its_intervals_starts_within_the_room_kept_for_running_slices(
    wait: float | None,
) -> None:
    """A running slice leaves 877 tokens of the budget (0.8 of 4,096); the head of the queue needs
    1,128 and a later small batch 428. Backfill starts the small one at once; the head, passed, still
    waits short of ``head_wait_intervals`` schedule intervals. Once it has waited them it starts
    within the whole KV (the 1,268 tokens left under the capacity), as a continued slice would;
    with None it still waits, ten intervals on. The plan never passes the whole KV."""
    memory = MemoryModel(kv_capacity_tokens=4096, block_size=16, headroom=0.8)
    config = SliceConfig(kv_headroom=0.8, head_wait_intervals=wait)
    sched = SliceScheduler(config, SERVING, memory, ["a"])
    now = {"x": 2000}
    sched.progress = now.get  # type: ignore[assignment]
    sched.add(SliceRequest("x", 2000, 400))
    sched.schedule()
    [(_kx, _b)] = sched.admit("a", 0.0)
    for key, context in (("head", 1000), ("small", 300)):  # two schedule points: two batches, in order
        sched.add(SliceRequest(key, context, 128))
        now[key] = context
        sched.schedule()
    started = [r.key for _k, b in sched.admit("a", 0.0) for r in b.requests]
    assert started == ["small"]
    interval = sched.interval_ms()
    early = 0.9 * (wait or 1.0) * interval
    assert [r.key for _k, b in sched.admit("a", early) for r in b.requests] == []
    later = [r.key for _k, b in sched.admit("a", 10.0 * interval) for r in b.requests]
    assert later == (["head"] if wait is not None else [])
    assert sched.committed_kv("a") <= memory.kv_capacity_tokens
    if wait is not None:
        assert sched.committed_kv("a") > memory.budget_tokens  # it took the room kept past the budget


def test_a_plan_sharing_its_instance_counts_the_requests_another_dispatcher_placed_there() -> None:
    """Requests another dispatcher placed (``auto``'s whole requests before its switch) hold KV on
    the instance too: the first batch waits beside them while they fill it, even with no slice of
    the plan running there, fits into the room they leave, and starts in full once they end."""
    memory = MemoryModel(kv_capacity_tokens=4096, block_size=16, headroom=1.0)
    sched = SliceScheduler(SliceConfig(), SERVING, memory, ["a"])
    now: dict[str, int] = {}
    sched.progress = now.get  # type: ignore[assignment]
    # Two whole requests: 1,500 tokens held now each, 300 more to come (3,600 at their peak).
    whole = [(1500.0, 300.0), (1500.0, 300.0)]
    sched.residents = lambda instance: list(whole) if instance == "a" else []
    sched.add(SliceRequest("s", 1000, 128))
    sched.schedule()
    assert sched.committed_kv("a") == pytest.approx(3600.0)
    assert sched.admit("a") == []  # 1,136 tokens do not fit the 496 they leave
    whole.pop()
    [(_key, batch)] = sched.admit("a")  # one left: 1,800 at its peak, room for the slice
    assert [r.key for r in batch.requests] == ["s"]
    # Alone (no residents), the same plan takes the slice at once, as before.
    alone = SliceScheduler(SliceConfig(), SERVING, memory, ["a"])
    alone.progress = now.get  # type: ignore[assignment]
    alone.add(SliceRequest("s", 1000, 128))
    alone.schedule()
    assert len(alone.admit("a")) == 1 and alone.committed_kv("a") == pytest.approx(1136.0)


# ----------------------------------------------------------------------------- shared prefixes


def _behind(key: str, own: int, prefix: tuple[int, ...], slice_tokens: int = 128) -> SliceRequest:
    """A request whose context is ``prefix`` (512-token blocks) then ``own`` tokens of its own."""
    return SliceRequest(key, len(prefix) * 512 + own, slice_tokens, prefix, 512)


def test_a_shared_prefix_is_booked_once_per_instance() -> None:
    """Engines share a cached prefix's blocks among the requests running on them, so four requests
    behind one 3k-token prefix hold it once: the plan admits all four where booking each context
    whole (the paper's sum of context + slice) fits two."""
    memory = MemoryModel(kv_capacity_tokens=8192, block_size=16, headroom=1.0)
    group = (11, 12, 13, 14, 15, 16)
    requests = [_behind(f"r{k}", 256, group) for k in range(4)]
    assert kv_need(memory, requests) == 3072 + 4 * (256 + 128)
    assert kv_need(memory, requests, held=set(group)) == 4 * (256 + 128)
    # Without the prefix hashes the same contexts book whole.
    plain = [SliceRequest(r.key, r.context_tokens, r.slice_tokens) for r in requests]
    assert kv_need(memory, plain) == 4 * (3072 + 256 + 128)

    def admitted(batch: list[SliceRequest]) -> int:
        sched = SliceScheduler(SliceConfig(), SERVING, memory, ["a"])
        sched.progress = {}.get  # type: ignore[assignment]
        for r in batch:
            sched.add(r)
        sched.schedule()
        started = [r for _key, b in sched.admit("a") for r in b.requests]
        assert sched.committed_kv("a") <= memory.budget_tokens
        return len(started)

    assert admitted(requests) == 4
    assert admitted(plain) == 2


def test_the_batcher_keeps_requests_behind_one_prefix_together() -> None:
    """Sorted by context alone, two prefix groups interleave; behind their first prefix block each
    group's requests sit together, and a batch books each of its prefixes once: the eight requests
    go in two batches where, booked whole, no more than two fit one."""
    memory = MemoryModel(kv_capacity_tokens=6000, block_size=16, headroom=1.0)
    a, b = (1, 2, 3, 4), (5, 6, 7, 8)
    requests = [_behind(f"a{k}", 100 + 2 * k, a) for k in range(4)]
    requests += [_behind(f"b{k}", 101 + 2 * k, b) for k in range(4)]
    batches = batch_requests(requests, SERVING, memory)
    assert len(batches) == 2
    for batch in batches:
        assert batch.kv_tokens == kv_need(memory, batch.requests) <= 6000
        keys = [str(r.key) for r in batch.requests]
        assert keys == sorted(keys)  # a's before b's: contiguous by prefix, then by context
    plain = [SliceRequest(r.key, r.context_tokens, r.slice_tokens) for r in requests]
    assert len(batch_requests(plain, SERVING, memory)) == 4


def test_a_batch_goes_where_its_prefix_is_cached() -> None:
    """Max-min sends a batch to the instance where it finishes first; where an engine caches the
    batch's prefix (the router's prefix index) its prefill is mostly spared there, so it goes there
    rather than to the equally idle instance listed first."""
    memory = MemoryModel(kv_capacity_tokens=65536, block_size=16, headroom=1.0)
    group = (21, 22, 23, 24, 25, 26)

    def placed(cached: dict[str, int] | None) -> str:
        sched = SliceScheduler(SliceConfig(), SERVING, memory, ["a", "b"])
        if cached is not None:
            sched.cached = lambda hashes: cached if hashes == group else {}
        for k in range(3):
            sched.add(_behind(f"r{k}", 200, group))
        [(_batch, instance)] = sched.schedule()
        return instance

    assert placed(None) == "a"
    assert placed({"b": 6}) == "b"
    assert placed({"a": 6, "b": 2}) == "a"
