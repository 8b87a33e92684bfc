"""``slo-router calibrate``: a new profile directory from step samples or from the router's metrics."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from predictor import LatencyPredictor
from router.cli import main
from sim.fleet import BUNDLED_PROFILES, DEFAULT_PROFILE

BASE = BUNDLED_PROFILES / DEFAULT_PROFILE


def write_samples(path: Path, slowdown: float, n: int = 400) -> None:
    lp = LatencyPredictor.from_files(BASE / "ttft.json", BASE / "tpot.json")
    rng = random.Random(0)
    lines = []
    for _ in range(n):
        prefill = rng.choice([0, 0, rng.randint(16, 2048)])
        batch = rng.randint(1 if prefill == 0 else 0, 48)
        tokens = batch * rng.randint(64, 2048)
        ms = (float(lp.prefill_step_ms(prefill)) if prefill else 0.0) + lp.predict_tpot_ms(batch, tokens)
        lines.append(
            json.dumps(
                {
                    "group": "g",
                    "num_prefill_tokens": prefill,
                    "num_decode_requests": batch,
                    "num_decode_tokens": tokens,
                    "duration_ms": ms * slowdown,
                }
            )
        )
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


@pytest.mark.parametrize("mode", ["scale", "refit"])
def test_samples_of_slower_hardware_give_a_slower_profile(
    tmp_path: Path, mode: str, capsys: pytest.CaptureFixture[str]
) -> None:
    samples = tmp_path / "samples.jsonl"
    write_samples(samples, 1.5)
    out = tmp_path / "new"
    assert main(["calibrate", "--from", str(samples), "--out", str(out), "--mode", mode]) == 0
    assert "TTFT x1.500, TPOT x1.500" in capsys.readouterr().out
    base = LatencyPredictor.from_files(BASE / "ttft.json", BASE / "tpot.json")
    new = LatencyPredictor.from_files(out / "ttft.json", out / "tpot.json")
    for b, t in ((1, 256), (8, 8 * 1024), (32, 32 * 512)):
        assert new.predict_tpot_ms(b, t) == pytest.approx(1.5 * base.predict_tpot_ms(b, t), rel=0.03)
    assert float(new.prefill_step_ms(1024)) == pytest.approx(
        1.5 * float(base.prefill_step_ms(1024)), rel=0.03
    )
    coefficients = json.loads((out / "coefficients.json").read_text(encoding="utf-8"))
    assert coefficients["decode"]["delta_ms"] == pytest.approx(1.5 * 15.85, rel=0.03)


def test_metrics_factors_scale_the_profile(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.txt"
    metrics.write_text(
        "# HELP slo_router_calibration_factor_ratio ...\n"
        'slo_router_calibration_factor_ratio{group="a100",prediction="ttft"} 2.0\n'
        'slo_router_calibration_factor_ratio{group="a100",prediction="tpot"} 0.5\n'
        'slo_router_calibration_factor_ratio{group="h100",prediction="tpot"} 9.0\n',
        encoding="utf-8",
    )
    out = tmp_path / "new"
    assert main(["calibrate", "--from", str(metrics), "--out", str(out), "--group", "a100"]) == 0
    base = LatencyPredictor.from_files(BASE / "ttft.json", BASE / "tpot.json")
    new = LatencyPredictor.from_files(out / "ttft.json", out / "tpot.json")
    assert new.predict_tpot_ms(4, 4096) == pytest.approx(0.5 * base.predict_tpot_ms(4, 4096), rel=1e-3)
    assert float(new.prefill_step_ms(512)) == pytest.approx(2.0 * float(base.prefill_step_ms(512)), rel=1e-3)


def test_bad_inputs_exit_2_naming_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    metrics = tmp_path / "m.txt"
    metrics.write_text(
        'slo_router_calibration_factor_ratio{group="a",prediction="ttft"} 2\n', encoding="utf-8"
    )
    assert main(["calibrate", "--from", str(metrics), "--out", str(tmp_path / "o"), "--group", "zz"]) == 2
    assert "error: --group zz: not in the metrics" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n", encoding="utf-8")
    assert main(["calibrate", "--from", str(empty), "--out", str(tmp_path / "o")]) == 2
    assert "no slo_router_calibration_factor_ratio" in capsys.readouterr().err
    few = tmp_path / "few.jsonl"
    write_samples(few, 1.0, n=3)
    assert main(["calibrate", "--from", str(few), "--out", str(tmp_path / "o")]) == 2
    assert "at least" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"num_prefill_tokens": 1}\n', encoding="utf-8")
    assert main(["calibrate", "--from", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "sample 1" in capsys.readouterr().err
