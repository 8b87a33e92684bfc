"""Fleet specs of ``slo-router simulate``: the compact string, files, and every error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.model import SimConfig
from router.core.request import Role
from sim.cluster import SimFleet
from sim.fleet import (
    BUNDLED_PROFILES,
    DEFAULT_PROFILE,
    FleetError,
    FleetSpec,
    fleet_from_counts,
    fleet_to_dict,
    load_fleet,
    parse_fleet,
    parse_fleet_dict,
)

LLAMA = "llama3-70b-4xh100-roofline"


def test_counts_make_a_homogeneous_fleet() -> None:
    spec = fleet_from_counts(prefill=3, decode=2, engine=SimConfig(max_num_batched_tokens=1024))
    assert [(g.name, g.role, g.count, g.profile.name) for g in spec.groups] == [
        ("prefill", Role.PREFILL, 3, DEFAULT_PROFILE),
        ("decode", Role.DECODE, 2, DEFAULT_PROFILE),
    ]
    assert spec.disaggregated and spec.num_instances == 5
    assert all(g.engine.max_num_batched_tokens == 1024 for g in spec.groups)
    assert fleet_from_counts(neutral=4).groups[0].instance_ids() == tuple(f"neutral-00{k}" for k in range(4))


def test_the_compact_string_names_groups_by_role_then_profile() -> None:
    spec = parse_fleet(f"prefill=2:{LLAMA}, decode=1, decode=3:{LLAMA}")
    assert [(g.name, g.count, g.profile.name) for g in spec.groups] == [
        ("prefill", 2, LLAMA),
        (f"decode-{DEFAULT_PROFILE}", 1, DEFAULT_PROFILE),
        (f"decode-{LLAMA}", 3, LLAMA),
    ]


def test_each_group_is_predicted_with_its_own_profile() -> None:
    fleet = SimFleet(parse_fleet(f"neutral=1:{LLAMA},neutral=1"))
    llama, qwen = fleet.instance_truths
    assert llama is not qwen
    predicted_llama = fleet.predictors.for_group(f"neutral-{LLAMA}")
    predicted_qwen = fleet.predictors.for_group(f"neutral-{DEFAULT_PROFILE}")
    assert predicted_llama is not predicted_qwen
    # The same profiles, but never the same objects: the engines' ground truth is not the predictor.
    assert predicted_llama is not llama and predicted_qwen is not qwen
    assert predicted_llama.predict_tpot_ms(8, 4096) == llama.predict_tpot_ms(8, 4096)
    assert predicted_qwen.predict_tpot_ms(8, 4096) == qwen.predict_tpot_ms(8, 4096)
    assert predicted_llama.predict_tpot_ms(8, 4096) != predicted_qwen.predict_tpot_ms(8, 4096)
    assert fleet.groups == (f"neutral-{LLAMA}", f"neutral-{DEFAULT_PROFILE}")


def test_a_yaml_file_with_engine_knobs_and_relative_profiles(tmp_path: Path) -> None:
    profiles = tmp_path / "profiles" / "mine"
    profiles.mkdir(parents=True)
    for name in ("ttft.json", "tpot.json"):
        (profiles / name).write_bytes((BUNDLED_PROFILES / DEFAULT_PROFILE / name).read_bytes())
    path = tmp_path / "fleet.yaml"
    path.write_text(
        "engine: {kv_capacity_tokens: 131072, kv_bandwidth_gbps: 400}\n"
        "groups:\n"
        "  - {role: prefill, count: 2, profile: profiles/mine, name: p-mine}\n"
        f"  - {{role: decode, count: 4, profile: {LLAMA}, engine: {{kv_bytes_per_token: 327680}}}}\n",
        encoding="utf-8",
    )
    spec = load_fleet(str(path), engine=SimConfig(block_size=32))
    prefill, decode = spec.groups
    assert (prefill.name, prefill.profile) == ("p-mine", profiles.resolve())
    assert decode.name == "decode" and decode.engine.kv_bytes_per_token == 327680
    for g in spec.groups:
        assert g.engine.block_size == 32 and g.engine.kv_capacity_tokens == 131072
        assert g.engine.kv_bandwidth_gbps == 400
    assert prefill.engine.kv_bytes_per_token == SimConfig().kv_bytes_per_token


def test_a_fleet_survives_a_round_trip_through_json(tmp_path: Path) -> None:
    spec = parse_fleet_dict(
        {
            "groups": [
                {"role": "neutral", "count": 2, "engine": {"noise": 0.1}},
                {"role": "neutral", "count": 1, "profile": LLAMA},
            ]
        }
    )
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(fleet_to_dict(spec)), encoding="utf-8")
    assert load_fleet(str(path)) == spec


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([], "must be a mapping"),
        ({"groups": []}, "non-empty list"),
        ({"groups": [{"role": "neutral", "count": 1}], "nodes": 3}, "unknown key(s) nodes"),
        ({"groups": [{"role": "neutral"}]}, "needs 'role' and 'count'"),
        ({"groups": [{"role": "neutral", "count": 0}]}, "count must be an integer >= 1"),
        ({"groups": [{"role": "neutral", "count": 1.5}]}, "count must be an integer >= 1"),
        ({"groups": [{"role": "gpu", "count": 1}]}, "role must be prefill, decode or neutral"),
        ({"groups": [{"role": "neutral", "count": 1, "gpus": 8}]}, "unknown key(s) gpus"),
        ({"groups": [{"role": "neutral", "count": 1, "profile": "nope"}]}, "bundled"),
        (
            {"groups": [{"role": "neutral", "count": 1, "engine": {"turbo": True}}]},
            "unknown engine field(s) turbo",
        ),
        ({"groups": [{"role": "neutral", "count": 1, "engine": {"block_size": 0}}]}, "block_size must be"),
        ({"groups": [{"role": "neutral", "count": 1, "name": "a b"}]}, "group name must be"),
        (
            {
                "groups": [
                    {"role": "neutral", "count": 1, "name": "x"},
                    {"role": "neutral", "count": 1, "name": "x"},
                ]
            },
            "duplicate names",
        ),
        (
            {"groups": [{"role": "neutral", "count": 1}, {"role": "decode", "count": 1}]},
            "either neutral or prefill+decode",
        ),
        ({"groups": [{"role": "decode", "count": 2}]}, "add at least one prefill group"),
    ],
)
def test_bad_fleet_documents_say_what_to_fix(doc: object, message: str) -> None:
    with pytest.raises(FleetError) as info:
        parse_fleet_dict(doc, "fleet.yaml")
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("prefill", "write ROLE=COUNT[:PROFILE]"),
        ("prefill=two,decode=1", "COUNT must be an integer"),
        ("prefill=0,decode=1", "COUNT must be an integer >= 1"),
        ("prefill=1,decode=1:/nowhere", "not a directory holding ttft.json and tpot.json"),
    ],
)
def test_bad_fleet_strings_say_what_to_fix(text: str, message: str) -> None:
    with pytest.raises(FleetError) as info:
        parse_fleet(text)
    assert message in str(info.value)


def test_unreadable_or_invalid_fleet_files(tmp_path: Path) -> None:
    with pytest.raises(FleetError, match="cannot read fleet file"):
        load_fleet(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.json"
    bad.write_text("{", encoding="utf-8")
    with pytest.raises(FleetError, match="invalid JSON"):
        load_fleet(str(bad))


def test_an_empty_fleet_is_refused() -> None:
    with pytest.raises(FleetError, match="no instance group"):
        FleetSpec(())
