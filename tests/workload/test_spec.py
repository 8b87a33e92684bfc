"""Workload specs: parsing, presets, and the determinism and distributions of generated plans."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.loadgen import LoadConfig
from workload.spec import (
    CLASS_PRESETS,
    WORKLOAD_PRESETS,
    ArrivalProcess,
    ArrivalSpec,
    FixedLength,
    LognormalLength,
    RequestPlan,
    SloClass,
    SloTarget,
    UniformLength,
    WorkloadError,
    WorkloadSpec,
    field_docs,
    generate_requests,
    iter_requests,
    load_workload,
    parse_length,
    parse_workload_dict,
    plan_summary,
    workload_to_dict,
)


def make_spec(*classes: SloClass, **arrival: object) -> WorkloadSpec:
    spec = WorkloadSpec(name="test", classes=classes or (SloClass(),))
    return spec.with_arrival(**arrival) if arrival else spec


# --------------------------------------------------------------------------- config docs


@pytest.mark.parametrize(
    "cls",
    [FixedLength, UniformLength, LognormalLength, SloTarget, SloClass, ArrivalSpec, WorkloadSpec, LoadConfig],
)
def test_every_config_field_has_a_doc_and_a_default(cls: type) -> None:
    docs = field_docs(cls)
    assert docs and all(docs.values()), f"fields without a doc: {[k for k, v in docs.items() if not v]}"
    cls()  # every field has a default


# --------------------------------------------------------------------------- lengths


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("fixed(128)", FixedLength(128)),
        ("uniform(32,512)", UniformLength(32, 512)),
        ("uniform(min=1, max=2)", UniformLength(1, 2)),
        ("lognormal(384,1.0,16,4096)", LognormalLength(384, 1.0, 16, 4096)),
        ("lognormal(median=384,sigma=0.5,min=16,max=4096)", LognormalLength(384, 0.5, 16, 4096)),
        ("lognormal(200)", LognormalLength(200)),
        (64, FixedLength(64)),
        ({"kind": "uniform", "min_tokens": 3, "max_tokens": 9}, UniformLength(3, 9)),
    ],
)
def test_parse_length_forms(text: object, expected: object) -> None:
    assert parse_length(text) == expected


@pytest.mark.parametrize("dist", [FixedLength(7), UniformLength(3, 9), LognormalLength(100.5, 0.3, 2, 900)])
def test_length_describe_round_trips(dist: FixedLength | UniformLength | LognormalLength) -> None:
    assert parse_length(dist.describe()) == dist


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("gauss(1,2)", "unknown length distribution 'gauss'"),
        ("uniform(10,5)", "uniform.max_tokens must be an integer >= 10"),
        ("fixed(0)", "fixed.tokens must be an integer >= 1"),
        ("lognormal(100,-1)", "lognormal.sigma must be a finite number > 0"),
        ("fixed(1,2)", "at most 1 arguments"),
        ("uniform(1.5,4)", "must be an integer"),
        ("uniform(lo=1,max=4)", "no parameter 'lo'"),
        ("512 tokens", "cannot read"),
        ({"min_tokens": 1}, "needs 'kind'"),
        (True, "expected a length distribution"),
    ],
)
def test_parse_length_errors_say_what_is_wrong(text: object, fragment: str) -> None:
    with pytest.raises(WorkloadError, match="prompt") as info:
        parse_length(text, "prompt")
    assert fragment in str(info.value)


lognormals = st.builds(
    lambda median, sigma, lo, span: LognormalLength(median, sigma, lo, lo + span),
    st.floats(1.0, 1e5),
    st.floats(0.01, 3.0),
    st.integers(1, 1000),
    st.integers(0, 100_000),
)
uniforms = st.builds(
    lambda lo, span: UniformLength(lo, lo + span), st.integers(1, 10_000), st.integers(0, 10_000)
)
fixeds = st.builds(FixedLength, st.integers(1, 100_000))


@given(dist=st.one_of(lognormals, uniforms, fixeds), seed=st.integers(0, 2**32))
@settings(max_examples=100, deadline=None)
def test_samples_stay_within_bounds(dist: FixedLength | UniformLength | LognormalLength, seed: int) -> None:
    values = dist.sample(np.random.default_rng(seed), 500)
    lo, hi = dist.bounds
    assert values.dtype == np.int64
    assert values.min() >= lo and values.max() <= hi


def test_lognormal_median_and_uniform_mean_are_as_documented() -> None:
    rng = np.random.default_rng(5)
    logn = LognormalLength(300, 0.8, 1, 10**7).sample(rng, 40_000)
    assert np.median(logn) == pytest.approx(300, rel=0.03)
    assert logn.mean() == pytest.approx(300 * math.exp(0.8**2 / 2), rel=0.03)
    uni = UniformLength(10, 20).sample(rng, 40_000)
    assert set(np.unique(uni)) == set(range(10, 21))
    assert uni.mean() == pytest.approx(15, rel=0.01)


# --------------------------------------------------------------------------- specs and parsing


def test_default_workload_is_the_mixed_preset() -> None:
    spec = load_workload()
    assert spec == load_workload("mixed") == WorkloadSpec()
    assert spec.class_names() == ("chat", "code", "summarize")
    assert spec.shares() == pytest.approx([0.6, 0.25, 0.15])
    chat, code, summarize = spec.classes
    assert chat.slo.ttft_ms is not None and chat.slo.tpot_ms is not None and chat.slo.e2e_ms is None
    assert code.slo.e2e_ms is not None and code.slo.ttft_ms is None and code.slo.tpot_ms is None
    assert summarize.slo.e2e_ms is not None
    assert spec.arrival == ArrivalSpec(process=ArrivalProcess.POISSON, rate_per_s=2.0)


@pytest.mark.parametrize("name", list(WORKLOAD_PRESETS))
def test_every_preset_loads_and_generates(name: str) -> None:
    spec = load_workload(name)
    assert spec.name == name
    plans = generate_requests(spec, rng=0, num_requests=50)
    assert len(plans) == 50 and {p.class_name for p in plans} <= set(spec.class_names())
    assert "workload" in spec.describe()


def test_mix_string_reweights_class_presets() -> None:
    spec = load_workload("chat=3, code=1")
    assert spec.class_names() == ("chat", "code")
    assert spec.shares() == pytest.approx([0.75, 0.25])
    assert spec.classes[1].slo == CLASS_PRESETS["code"].slo
    assert load_workload("chat,tiny").shares() == pytest.approx([0.375, 0.625])


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("nope", "not a preset"),
        ("chat=0.5,nope=0.5", "unknown class preset 'nope'"),
        ("chat=-1", "must be a finite number > 0"),
        ("chat=x", "is not a number"),
        ("mixed=1", "unknown class preset 'mixed'"),
    ],
)
def test_load_workload_errors(text: str, fragment: str) -> None:
    with pytest.raises(WorkloadError, match=fragment):
        load_workload(text)


def test_yaml_and_json_files(tmp_path: object) -> None:
    from pathlib import Path

    base = Path(str(tmp_path))
    yaml_path = base / "w.yaml"
    yaml_path.write_text(
        """
name: support
arrival: {process: gamma, rate_per_s: 6, burstiness: 0.5}
token_id_low: 10
token_id_high: 20
classes:
  - name: chat
    share: 0.8
    ttft_ms: 800
    tpot_ms: 40
    prompt: lognormal(384,1.0,16,4096)
    output: uniform(32,512)
  - preset: code
    share: 0.2
    e2e_ms: 3000
    priority: 2
""",
        encoding="utf-8",
    )
    spec = load_workload(str(yaml_path))
    assert spec.name == "support"
    assert spec.arrival == ArrivalSpec(process=ArrivalProcess.GAMMA, rate_per_s=6, burstiness=0.5)
    chat, code = spec.classes
    assert chat.slo == SloTarget(ttft_ms=800, tpot_ms=40)
    assert chat.output == UniformLength(32, 512)
    assert code.name == "code" and code.slo == SloTarget(e2e_ms=3000) and code.priority == 2
    assert code.prompt == CLASS_PRESETS["code"].prompt
    plan = generate_requests(spec, rng=1, num_requests=20)
    assert all(10 <= t < 20 for p in plan for t in p.prompt_token_ids())

    json_path = base / "w.json"
    json_path.write_text(json.dumps(workload_to_dict(spec)), encoding="utf-8")
    assert load_workload(str(json_path)) == spec


def test_arrival_cv_sets_the_burstiness() -> None:
    spec = parse_workload_dict({"classes": [{"name": "a"}], "arrival": {"process": "gamma", "cv": 2.0}})
    assert spec.arrival.burstiness == 0.25 and spec.arrival.cv == 2.0


def test_workload_dict_round_trip_of_every_preset() -> None:
    for name in WORKLOAD_PRESETS:
        spec = load_workload(name).with_arrival(process=ArrivalProcess.CLOSED, concurrency=3)
        assert parse_workload_dict(json.loads(json.dumps(workload_to_dict(spec)))) == spec


@pytest.mark.parametrize(
    ("doc", "fragment"),
    [
        ({"classes": []}, "'classes' must be a non-empty list"),
        ({"classes": [{"share": 1}]}, "needs a 'name'"),
        ({"classes": [{"name": "a", "colour": "red"}]}, "unknown keys ['colour']"),
        ({"classes": [{"name": "a"}, {"name": "a"}]}, "duplicate class names ['a']"),
        ({"classes": [{"name": "a", "share": 0}]}, "share must be a finite number > 0"),
        ({"classes": [{"name": "a", "ttft_ms": -5}]}, "slo.ttft_ms must be a finite number > 0"),
        ({"classes": [{"name": "a", "prompt": "fixed(0)"}]}, "classes[0]: prompt"),
        ({"classes": [{"preset": "poem"}]}, "unknown preset 'poem'"),
        ({"classes": [{"name": "a"}], "arrival": {"process": "tidal"}}, "process 'tidal' unknown"),
        ({"classes": [{"name": "a"}], "arrival": {"burstiness": 0.5}}, "needs process 'gamma'"),
        ({"classes": [{"name": "a"}], "arrival": {"rate_per_s": 0}}, "rate_per_s must be"),
        ({"classes": [{"name": "a"}], "token_id_low": 5, "token_id_high": 5}, "token_id_high"),
        ({"classes": [{"name": "a b"}]}, "class name must be"),
        (
            {"classes": [{"name": "a"}], "arrival": {"cv": 2, "burstiness": 0.25}},
            "burstiness or cv, not both",
        ),
        ({"classes": [{"name": "a"}], "arrival": {"process": "gamma", "cv": 0}}, "cv must be"),
        ([1, 2], "must be a mapping"),
    ],
)
def test_parse_workload_dict_errors(doc: object, fragment: str) -> None:
    with pytest.raises(WorkloadError) as info:
        parse_workload_dict(doc, "w.yaml")
    assert fragment in str(info.value)
    assert str(info.value).startswith("w.yaml")


# --------------------------------------------------------------------------- plans


def test_plans_are_deterministic_for_a_seed_and_differ_across_seeds() -> None:
    spec = load_workload()
    a = generate_requests(spec, rng=7, num_requests=300)
    b = generate_requests(spec, rng=np.random.default_rng(7), num_requests=300)
    c = generate_requests(spec, rng=8, num_requests=300)
    assert a == b
    assert a != c
    assert [p.prompt_token_ids() for p in a[:5]] == [p.prompt_token_ids() for p in b[:5]]
    r1 = generate_requests(spec, rng=random.Random(3), num_requests=50)
    r2 = generate_requests(spec, rng=random.Random(3), num_requests=50)
    assert r1 == r2


def test_a_short_plan_is_a_prefix_of_a_longer_one() -> None:
    spec = load_workload()
    short = generate_requests(spec, rng=11, num_requests=100)
    long = generate_requests(spec, rng=11, num_requests=3000)
    assert long[:100] == short
    by_time = generate_requests(spec, rng=11, duration_s=30.0)
    assert by_time == long[: len(by_time)]


def test_prompt_token_ids_match_length_and_range() -> None:
    spec = dataclasses.replace(load_workload("tiny"), token_id_low=100, token_id_high=104)
    for plan in generate_requests(spec, rng=2, num_requests=30):
        ids = plan.prompt_token_ids()
        assert len(ids) == plan.prompt_tokens
        assert set(ids) <= {100, 101, 102, 103}
        assert ids == plan.prompt_token_ids()


@given(
    shares=st.lists(st.floats(0.01, 10.0), min_size=1, max_size=4),
    seed=st.integers(0, 2**32),
    n=st.integers(0, 2500),
)
@settings(max_examples=40, deadline=None)
def test_plan_invariants(shares: list[float], seed: int, n: int) -> None:
    classes = tuple(
        SloClass(
            name=f"c{i}",
            share=s,
            prompt=LognormalLength(50.0 * (i + 1), 1.2, 5 + i, 300 * (i + 1)),
            output=UniformLength(1 + i, 40 + i),
        )
        for i, s in enumerate(shares)
    )
    spec = make_spec(*classes, rate_per_s=5.0)
    plans = generate_requests(spec, rng=seed, num_requests=n)
    assert [p.index for p in plans] == list(range(n))
    arrivals = [p.arrival_s for p in plans]
    assert arrivals == sorted(arrivals)
    assert not plans or arrivals[0] == 0.0
    by_name = {c.name: c for c in classes}
    for p in plans:
        cls = by_name[p.class_name]
        assert cls.prompt.bounds[0] <= p.prompt_tokens <= cls.prompt.bounds[1]
        assert cls.output.bounds[0] <= p.max_tokens <= cls.output.bounds[1]
        assert p.slo == cls.slo


def test_shares_are_respected_with_many_requests() -> None:
    spec = make_spec(SloClass(name="a", share=5), SloClass(name="b", share=3), SloClass(name="c", share=2))
    plans = generate_requests(spec, rng=123, num_requests=20_000)
    counts = plan_summary(plans)["classes"]
    for name, expected in (("a", 0.5), ("b", 0.3), ("c", 0.2)):
        assert counts[name]["requests"] / 20_000 == pytest.approx(expected, abs=0.015)


def test_poisson_mean_gap_is_one_over_the_rate() -> None:
    spec = make_spec(rate_per_s=8.0)
    plans = generate_requests(spec, rng=99, num_requests=20_000)
    gaps = np.diff([p.arrival_s for p in plans])
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_gaps_keep_the_rate_and_have_cv_one_over_sqrt_b(burstiness: float) -> None:
    spec = make_spec(process=ArrivalProcess.GAMMA, rate_per_s=4.0, burstiness=burstiness)
    plans = generate_requests(spec, rng=5, num_requests=20_000)
    gaps = np.diff([p.arrival_s for p in plans])
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(spec.arrival.cv, rel=0.08)


def test_duration_bounds_open_loop_plans() -> None:
    spec = make_spec(rate_per_s=10.0)
    plans = generate_requests(spec, rng=1, duration_s=20.0)
    assert all(p.arrival_s < 20.0 for p in plans)
    assert 150 < len(plans) < 250
    assert len(generate_requests(spec, rng=1, duration_s=20.0, num_requests=10)) == 10


def test_closed_loop_plans_need_a_count_and_arrive_at_zero() -> None:
    spec = make_spec(process=ArrivalProcess.CLOSED, concurrency=4)
    with pytest.raises(WorkloadError, match="closed-loop plan needs num_requests"):
        generate_requests(spec, rng=1, duration_s=5.0)
    plans = generate_requests(spec, rng=1, num_requests=40)
    assert len(plans) == 40 and all(p.arrival_s == 0.0 for p in plans)


def test_generate_requests_needs_a_bound() -> None:
    with pytest.raises(WorkloadError, match="num_requests or duration_s"):
        generate_requests(load_workload(), rng=1)
    with pytest.raises(WorkloadError, match="num_requests must be an integer"):
        generate_requests(load_workload(), rng=1, num_requests=-1)
    with pytest.raises(TypeError, match="rng must be"):
        generate_requests(load_workload(), rng="seed", num_requests=1)  # type: ignore[arg-type]


def test_iter_requests_is_lazy_and_bounded() -> None:
    it = iter_requests(load_workload(), 4, max_requests=3)
    assert [p.index for p in it] == [0, 1, 2]


@settings(max_examples=40, deadline=None)
@given(
    burstiness=st.floats(min_value=0.01, max_value=10.0),
    rate=st.floats(min_value=0.1, max_value=1000.0),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_arrivals_never_go_backwards_however_bursty(burstiness: float, rate: float, seed: int) -> None:
    # Shape 0.1 once produced an arrival earlier than the one before it (float rounding), which
    # the simulator refuses ("plans must be in arrival order").
    spec = make_spec().with_arrival(process=ArrivalProcess.GAMMA, rate_per_s=rate, burstiness=burstiness)
    arrivals = [p.arrival_s for p in generate_requests(spec, rng=seed, num_requests=3000)]
    assert arrivals[0] == 0.0
    assert all(b >= a for a, b in itertools.pairwise(arrivals))


def test_equal_hash_ids_give_equal_prompt_blocks() -> None:
    """Two plans sharing their first hash ids share those blocks token for token, and only those."""
    slo = SloTarget(ttft_ms=None, tpot_ms=None)
    a = RequestPlan(0, 0.0, "c", 40, 8, slo, prompt_seed=1, hash_ids=(7, 9), prefix_block_tokens=16)
    b = RequestPlan(1, 0.0, "c", 36, 8, slo, prompt_seed=2, hash_ids=(7, 3), prefix_block_tokens=16)
    ids_a, ids_b = a.prompt_token_ids(), b.prompt_token_ids()
    assert (len(ids_a), len(ids_b)) == (40, 36)
    assert ids_a[:16] == ids_b[:16]
    assert ids_a[16:32] != ids_b[16:32]
    assert a.true_output_tokens == 8
    assert RequestPlan(2, 0.0, "c", 4, 8, slo, prompt_seed=3, output_tokens=3).true_output_tokens == 3
