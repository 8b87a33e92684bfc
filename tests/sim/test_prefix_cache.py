"""The sim engine's prefix cache: hits, LRU eviction under KV pressure, and the KV events an index mirrors."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.model import KvEventKind, SimConfig, SimCore, SimRequestSpec
from fleet.prefix import id_block_hashes
from router.core.prefix import ExactPrefixIndex


class _FlatCost:
    """Every step costs 1 ms: these tests are about what is computed, not how long it takes."""

    def step_ms(self, num_prefill_tokens: int, num_decode_requests: int, num_decode_tokens: int) -> float:
        return 1.0


def _core(kv_blocks: int = 64, *, block: int = 4, prefix: int = 8, budget: int = 64) -> SimCore:
    config = SimConfig(
        max_num_batched_tokens=budget,
        kv_capacity_tokens=kv_blocks * block,
        block_size=block,
        max_model_len=min(kv_blocks * block, 256),
        max_num_seqs=8,
        prefix_cache_block_tokens=prefix,
    )
    return SimCore(config, _FlatCost())


def _spec(rid: str, ids: list[int], prompt: int, out: int = 2, block: int = 8) -> SimRequestSpec:
    return SimRequestSpec(rid, prompt, out, block_hashes=id_block_hashes(ids, prompt, block))


def _run(core: SimCore, index: ExactPrefixIndex | None = None, limit: int = 10_000) -> list[int]:
    """Step until idle; the prefill tokens each step computed."""
    computed = []
    for _ in range(limit):
        step = core.schedule()
        if step is None:
            break
        computed.append(step.num_prefill_tokens)
        core.finish_step(step)
        core.check_invariants()
        if index is not None:
            events, _ = core.drain_kv_events()
            index.apply("e", [(e.kind.value, e.block_hashes) for e in events])
    return computed


def test_a_repeated_prefix_is_computed_once_and_counted_as_a_hit() -> None:
    core = _core()
    core.add(_spec("a", [1, 2, 3], 30))  # blocks 1, 2, 3 (24 tokens) + 6 more
    assert sum(_run(core)) == 30
    assert core.cache_hit_rate == 0.0
    core.add(_spec("b", [1, 2, 9], 30))  # shares blocks 1 and 2: 16 tokens cached
    assert core.num_uncomputed_prefill_tokens == 14  # the load reports what is left to compute
    assert sum(_run(core)) == 14
    assert core.cache_hit_tokens == 16 and core.cache_query_tokens == 60
    assert core.cache_hit_rate == pytest.approx(16 / 60)
    # A fully cached prompt still computes its last token (to sample the first output).
    core.add(_spec("c", [1, 2, 3, 4], 32))
    assert sum(_run(core)) == 8  # 24 cached of 32: block 4 was never computed


def test_lru_eviction_under_kv_pressure_takes_the_least_recently_freed_tail_first() -> None:
    core = _core(kv_blocks=12)  # 48 tokens: 6 prefix blocks of 8
    core.add(_spec("a", [1, 2], 16, out=1))
    _run(core)
    core.add(_spec("b", [3, 4], 16, out=1))
    _run(core)
    assert core.cached_block_hashes() == frozenset(
        id_block_hashes([1, 2], 16, 8) + id_block_hashes([3, 4], 16, 8)
    )
    # c needs 32 tokens: 8 KV blocks > 4 empty ones, so 2 cached blocks go: a's (older), tail first.
    core.add(_spec("c", [5, 6, 7, 8], 32, out=1))
    events: list[tuple[str, tuple[int, ...]]] = []
    for _ in range(100):
        step = core.schedule()
        if step is None:
            break
        core.finish_step(step)
        drained, _ = core.drain_kv_events()
        events.extend((e.kind.value, e.block_hashes) for e in drained)
    removed = [h for kind, hs in events if kind == KvEventKind.REMOVED.value for h in hs]
    a = id_block_hashes([1, 2], 16, 8)
    assert removed[:2] == [a[1], a[0]]
    assert set(id_block_hashes([3, 4], 16, 8)) <= core.cached_block_hashes()


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    kv_blocks=st.integers(16, 48),
    n=st.integers(1, 25),
    abort_every=st.integers(0, 5),
)
def test_property_invariants_hold_and_the_exact_index_mirrors_the_engine(
    seed: int, kv_blocks: int, n: int, abort_every: int
) -> None:
    """Random prompts from a small tree of shared prefixes, under KV pressure, with aborts and
    PD holds: counters stay consistent, every prefill computes exactly its uncached part, and an
    index fed only the engine's events holds exactly the engine's cached blocks."""
    rng = random.Random(seed)
    core = _core(kv_blocks=kv_blocks, budget=16)
    index = ExactPrefixIndex(8)
    for k in range(n):
        depth = rng.randint(1, 5)
        ids = [rng.randint(0, 2) * 10 + j for j in range(depth)]  # three prefix families
        prompt = min(depth * 8 + rng.randint(0, 7), core.config.max_model_len - 4)
        spec = SimRequestSpec(
            str(k),
            prompt,
            rng.randint(1, 3),
            block_hashes=id_block_hashes(ids, prompt, 8),
            hold_kv=rng.random() < 0.2,
        )
        core.add(spec)
        core.check_invariants()
        for _ in range(rng.randint(0, 4)):
            step = core.schedule()
            if step is None:
                break
            core.finish_step(step)
            core.check_invariants()
        if abort_every and k % abort_every == 0:
            core.abort(str(rng.randint(0, k)))
            core.check_invariants()
        if rng.random() < 0.3:
            core.release_held(str(rng.randint(0, k)))
        events, _ = core.drain_kv_events()
        index.apply("e", [(e.kind.value, e.block_hashes) for e in events])
        assert index.blocks_of("e") == core.cached_block_hashes()
    _run(core, index)
    assert index.blocks_of("e") == core.cached_block_hashes()
    assert 0.0 <= core.cache_hit_rate <= 1.0
    assert core.cache_hit_tokens <= core.cache_query_tokens


def test_lost_events_resynchronise_the_reader() -> None:
    core = SimCore(
        SimConfig(
            kv_capacity_tokens=1024,
            block_size=4,
            max_model_len=256,
            max_num_batched_tokens=64,
            max_num_seqs=8,
            prefix_cache_block_tokens=8,
            max_kv_events=2,
        ),
        _FlatCost(),
    )
    index = ExactPrefixIndex(8)
    index.add("e", [12345])  # stale knowledge the resync must wipe
    for k in range(5):
        core.add(_spec(str(k), [k * 10, k * 10 + 1], 16, out=1))
        _run(core)
    events, lost = core.drain_kv_events()
    assert lost and events[0].kind is KvEventKind.CLEARED
    index.apply("e", [(e.kind.value, e.block_hashes) for e in events])
    assert index.blocks_of("e") == core.cached_block_hashes()


def test_config_names_a_bad_prefix_block() -> None:
    with pytest.raises(
        ValueError, match=r"prefix_cache_block_tokens must be 0 \(off\) or a positive multiple"
    ):
        SimConfig(block_size=16, prefix_cache_block_tokens=24)
    core = _core()
    from engine.interface import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="prefix blocks"):
        core.add(SimRequestSpec("x", 10, 1, block_hashes=(1, 2)))


def test_simulate_reports_the_fleet_hit_rate_and_cache_aware_slo_reuses_more() -> None:
    """A shared-prefix workload on a small fleet under KV pressure: every arm caches in the engines,
    only the router's knowledge differs. Knowing the caches (either source) raises the hit rate.
    The requests wait in the router queue (as ``simulate`` runs them) for KV over their life: without
    one ``slo`` refuses ~45 % of them, and the approximate index has few placements left to steer.
    With the router's calibration (the default: its TPOT counts the prompts interleaved between the
    decode steps) the hit rates are 0.31 / 0.50 / 0.48 (off / exact / approximate). Without it the
    TPOT prediction runs 40-60 % under the steps measured here, and KV is the only thing that keeps
    the instances from taking more than their TPOT allows."""
    import dataclasses

    from router.core.config import SchedulerConfig
    from router.core.queue import QueueConfig
    from sim.cluster import SimFleet, simulate
    from sim.fleet import fleet_from_counts
    from sim.sweep import _point, format_sweep_table, point_to_dict
    from workload.spec import generate_requests, load_workload

    spec = load_workload("prefix-heavy").with_arrival(rate_per_s=4.0)
    spec = dataclasses.replace(spec, classes=(dataclasses.replace(spec.classes[0], prefix_groups=24),))
    plans = generate_requests(spec, rng=3, num_requests=200)
    assert all(p.hash_ids for p in plans)
    fleet = SimFleet(fleet_from_counts(neutral=2, engine=SimConfig(kv_capacity_tokens=32768)))
    rates = {}
    for routing in ("off", "exact", "approximate"):
        config = SchedulerConfig(scheduling_policy="slo", prefix_cache_routing=routing)
        outcome = simulate(fleet, config, plans, queue=QueueConfig(queue_policy="edf"))
        assert outcome.cache_hit_rate is not None
        rates[routing] = outcome.cache_hit_rate
        point = _point("slo", 4.0, spec, outcome)
        assert point_to_dict(point)["cache_hit_rate"] == outcome.cache_hit_rate
        assert "hit rate" in format_sweep_table([point])
    assert rates["exact"] > rates["off"] + 0.05
    assert rates["approximate"] > rates["off"] + 0.05
    # Engines without prefix caching: no hit rate at all.
    plain = simulate(fleet, SchedulerConfig(scheduling_policy="slo"), plans, engine_prefix_cache=False)
    assert plain.cache_hit_rate is None


def test_exact_routing_sends_a_burst_with_one_prefix_after_the_first_before_any_event() -> None:
    """Six prompts with one 4,096-token prefix arrive 1 ms apart on an idle fleet: no
    engine has scheduled the first when the others are placed, so only the dispatched-but-not-yet-
    reported blocks (the exact index's pending ones) can tell the router where the prefix is going.
    They follow it to one instance, which computes the prefix once (without the pending blocks
    they spread over all four instances and the hit rate is 0.33)."""
    from router.core.config import SchedulerConfig
    from sim.cluster import SimFleet, simulate
    from sim.fleet import fleet_from_counts
    from workload.spec import RequestPlan, SloTarget

    shared = tuple(range(8))  # 8 blocks of 512 tokens
    plans = [
        RequestPlan(
            index=i,
            arrival_s=0.001 * i,
            class_name="burst",
            prompt_tokens=4096 + 100,
            max_tokens=256,
            slo=SloTarget(ttft_ms=5000.0, tpot_ms=200.0),
            prompt_seed=i,
            hash_ids=(*shared, 100 + i),
        )
        for i in range(6)
    ]
    fleet = SimFleet(fleet_from_counts(neutral=4, engine=SimConfig(kv_capacity_tokens=65536)))
    config = SchedulerConfig(scheduling_policy="slo", prefix_cache_routing="exact", calibration="off")
    outcome = simulate(fleet, config, plans)
    assert all(r.error_code is None for r in outcome.results)
    assert len({r.prefill_instance_id for r in outcome.results}) == 1
    assert outcome.cache_hit_rate is not None and outcome.cache_hit_rate > 0.7


def test_a_warm_up_is_left_out_of_every_figure_and_the_hit_rate_counts_only_the_rest() -> None:
    """``simulate --measure-from N``: the per-request cache lookups add up to the engines' own
    counters, and the figures over requests N.. are those of exactly those requests (their results,
    their queue waits, the prompt tokens they found cached)."""
    import dataclasses

    from router.core.config import SchedulerConfig
    from sim.cluster import SimFleet, simulate
    from sim.fleet import fleet_from_counts
    from sim.sweep import _point, measured_part
    from workload.report import summarize
    from workload.spec import generate_requests, load_workload

    spec = load_workload("prefix-heavy").with_arrival(rate_per_s=4.0)
    spec = dataclasses.replace(spec, classes=(dataclasses.replace(spec.classes[0], prefix_groups=24),))
    plans = generate_requests(spec, rng=5, num_requests=160)
    fleet = SimFleet(fleet_from_counts(neutral=2, engine=SimConfig(kv_capacity_tokens=32768)))
    config = SchedulerConfig(scheduling_policy="slo", prefix_cache_routing="exact", calibration="off")
    outcome = simulate(fleet, config, plans)  # no router queue: some are refused, before and after the cut
    assert len(outcome.cache_tokens) == len(plans)
    queried = sum(q for q, _ in outcome.cache_tokens)
    found = sum(h for _, h in outcome.cache_tokens)
    assert queried > 0 and outcome.cache_hit_rate == pytest.approx(found / queried)
    # Every request served was looked up with its whole prompt at least once.
    for result, (q, h) in zip(outcome.results, outcome.cache_tokens, strict=True):
        if result.ttft_ms is not None:
            assert q >= result.prompt_tokens and 0 <= h <= q

    assert measured_part(outcome, 0) is outcome
    first = 60
    part = measured_part(outcome, first)
    assert [r.index for r in part.results] == list(range(first, len(plans)))
    assert part.queue_wait_ms == outcome.queue_wait_ms[first:]
    assert sum(outcome.refused) == outcome.stats.rejected
    assert 0 < part.stats.rejected == sum(outcome.refused[first:]) < outcome.stats.rejected
    rest = outcome.cache_tokens[first:]
    assert part.cache_hit_rate == pytest.approx(sum(h for _, h in rest) / sum(q for q, _ in rest))
    # The early requests find the caches cold: counting them lowers the rate.
    assert part.cache_hit_rate > outcome.cache_hit_rate
    point = _point("slo", 4.0, spec, outcome, measure_from=first)
    expected = summarize(part.results, part.duration_s, class_slos=spec.class_slos())
    assert point.report.overall.requests == len(plans) - first
    assert point.report.overall.slo_attainment == expected.overall.slo_attainment
    assert point.cache_hit_rate == part.cache_hit_rate


def test_simulate_refuses_a_warm_up_as_long_as_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    from router.cli import main

    args = ["simulate", "--workload", "chat", "--num-requests", "10", "--measure-from", "10", "--rates", "1"]
    assert main(args) == 2
    assert "--measure-from" in capsys.readouterr().err


@pytest.mark.parametrize("prefix", [8, 0], ids=["prefix-cache", "no-cache"])
def test_a_preempted_request_counts_what_it_recomputes_less_its_prefix_cache_hits(prefix: int) -> None:
    # 96 tokens of KV: two 32-token prompts fit, their 40-token answers do not; b (the newest) is
    # preempted with 49 tokens of context (32 + 17 generated) and re-prefilled when a ends.
    core = _core(kv_blocks=24, prefix=prefix)
    core.add(_spec("a", [1, 2, 3, 4], 32, out=40))
    core.add(_spec("b", [5, 6, 7, 8], 32, out=40))
    computed = sum(_run(core))
    assert core.num_preemptions == 1
    # Behind the cache, 3 of its prompt's 8-token blocks were still there: 49 - 24 recomputed.
    assert core.num_preemption_recompute_tokens == (25 if prefix else 49)
    # Every prefill token beyond the two prompts' first pass is such a recompute.
    assert computed == 64 + core.num_preemption_recompute_tokens
    assert core.load().num_preemption_recompute_tokens == core.num_preemption_recompute_tokens
