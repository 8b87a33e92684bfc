"""The simulator's ground truth is not the router's predictor: mismatched fleets, and calibration closing the gap."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from engine.model import ProfileCostModel, SimConfig, SimCore, SimRequestSpec
from router.cli import main
from router.core.config import SchedulerConfig
from sim.cluster import SimFleet, simulate
from sim.fleet import BUNDLED_PROFILES, DEFAULT_PROFILE, fleet_from_counts, parse_fleet, parse_fleet_dict
from sim.sweep import policy_overrides
from workload.prediction import prediction_error
from workload.spec import generate_requests, load_workload

LLAMA = "llama3-70b-4xh100-roofline"


def slo(calibration: str) -> SchedulerConfig:
    return SchedulerConfig(**policy_overrides("slo"), calibration=calibration)


def test_a_group_can_step_at_another_profile_than_the_one_it_is_predicted_with() -> None:
    spec = parse_fleet(f"prefill=1:{DEFAULT_PROFILE}:{LLAMA},decode=1")
    assert spec.groups[0].profile.name == DEFAULT_PROFILE
    assert spec.groups[0].truth.name == LLAMA
    assert spec.groups[0].mismatched and not spec.groups[1].mismatched
    fleet = SimFleet(spec)
    truth = fleet.instance_truths[0]
    predicted = fleet.predictors.for_group(spec.groups[0].name)
    assert truth.predict_tpot_ms(16, 16 * 512) != predicted.predict_tpot_ms(16, 16 * 512)
    doc = parse_fleet_dict(
        {"groups": [{"role": "neutral", "count": 2, "true_profile": LLAMA, "engine": {"speed_factor": 0.5}}]}
    )
    assert doc.groups[0].truth.name == LLAMA and doc.groups[0].engine.speed_factor == 0.5
    assert "true:" in doc.describe()


def test_kv_slowdown_lengthens_steps_as_the_cache_fills() -> None:
    lp = SimFleet(fleet_from_counts(neutral=1)).instance_truths[0]
    durations = {}
    for slowdown in (0.0, 1.0):
        core = SimCore(
            SimConfig(kv_capacity_tokens=8192, max_model_len=8192, kv_slowdown=slowdown), ProfileCostModel(lp)
        )
        core.add(SimRequestSpec("r", 4000, 4))
        step = core.schedule()
        assert step is not None
        durations[slowdown] = step.duration_ms
    # 2048 of 8192 tokens allocated by the first chunk: a quarter full.
    assert durations[1.0] == pytest.approx(durations[0.0] * 1.25)
    with pytest.raises(ValueError, match="kv_slowdown"):
        SimConfig(kv_slowdown=-1.0)


def test_calibration_corrects_predictions_on_slower_engines() -> None:
    engine = SimConfig(speed_factor=0.6)
    fleet = SimFleet(fleet_from_counts(prefill=2, decode=2, engine=engine))
    plans = generate_requests(load_workload("chat").with_arrival(rate_per_s=4.0), rng=3, num_requests=300)
    errors = {}
    for mode in ("off", "scale", "refit"):
        outcome = simulate(fleet, slo(mode), plans, seed=0)
        errors[mode] = prediction_error(outcome.results, skip_first=100)
    # Uncalibrated, the router predicts the profile's speed: every step is 1/0.6 slower than predicted.
    assert errors["off"]["tpot"]["bias"] > 0.5
    assert errors["off"]["ttft"]["bias"] > 0.3
    for mode in ("scale", "refit"):
        assert errors[mode]["tpot"]["median"] < 0.1
        assert errors[mode]["ttft"]["median"] < 0.15
        assert abs(errors[mode]["tpot"]["bias"]) < 0.1


def test_a_matched_fleet_is_left_alone_by_calibration() -> None:
    fleet = SimFleet(fleet_from_counts(prefill=1, decode=1))
    plans = generate_requests(load_workload("chat").with_arrival(rate_per_s=2.0), rng=5, num_requests=120)
    off = simulate(fleet, slo("off"), plans, seed=0)
    scale = simulate(fleet, slo("scale"), plans, seed=0)
    # Observed steps equal the profile's: every factor stays 1, so decisions and predictions are the same.
    assert [dataclasses.astuple(r) for r in off.results] == [dataclasses.astuple(r) for r in scale.results]


def test_cli_compares_calibrations_on_a_mismatched_fleet(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim.json"
    code = main(
        [
            "simulate",
            "--prefill", "1", "--decode", "1", "--workload", "chat", "--num-requests", "60", "--rates", "2",
            "--policies", "slo", "--calibrations", "off,scale", "--true-speed", "0.7", "--warmup-requests", "10",
            "--output", str(out), "--no-progress",
        ]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "slo [off]" in captured.out and "slo [scale]" in captured.out
    assert "TTFT err p50" in captured.out
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert [r["calibration"] for r in doc["results"]] == ["off", "scale"]
    for result in doc["results"]:
        for key in ("ttft", "tpot"):
            assert set(result["prediction_error"][key]) == {"median", "p90", "bias", "count"}
    assert doc["meta"]["fleet_spec"]["groups"][0]["engine"]["speed_factor"] == 0.7
    assert doc["meta"]["calibrations"] == ["off", "scale"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--true-speed", "0"), "--true-speed"),
        (("--true-noise", "2"), "--true-noise"),
        (("--calibrations", "off,magic"), "--calibrations"),
        (("--warmup-requests", "999"), "--warmup-requests"),
        (("--true-profile", "no/such/dir"), "no/such/dir"),
    ],
)
def test_bad_ground_truth_flags_exit_2(
    args: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["simulate", "--num-requests", "10", "--policies", "slo", *args])
    assert code == 2
    assert message in capsys.readouterr().err


def test_bundled_profiles_exist() -> None:
    assert (BUNDLED_PROFILES / LLAMA / "tpot.json").is_file()
