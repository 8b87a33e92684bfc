"""Worked examples and exact rules of the predictor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from predictor import LatencyPredictor
from tests.predictor.helpers import (
    WORKED_BATCHES,
    WORKED_TPRS,
    WORKED_TTFT,
    tpot_doc,
    ttft_doc,
    worked_files,
    worked_tpot,
    write_json,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def lp(tmp_path: Path) -> LatencyPredictor:
    return LatencyPredictor.from_files(*worked_files(tmp_path))


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((300, 0, 0, 8192), 66.875),
        ((1280, 0, 0, 1024), 240.0),
        ((76, 0, 0, 8192), 31.875),
        ((300, 4, 400, 8192), 79.875),
    ],
)
def test_worked_ttft_examples(lp: LatencyPredictor, args: tuple[int, int, int, int], expected: float) -> None:
    assert lp.predict_ttft_ms(*args) == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize(
    ("args", "expected"),
    [((4, 400), 13.0), ((4, 8), 12.08), ((32, 3200), 27.0)],
)
def test_worked_tpot_examples(lp: LatencyPredictor, args: tuple[int, int], expected: float) -> None:
    assert lp.predict_tpot_ms(*args) == pytest.approx(expected, abs=1e-9)


def test_scalar_calls_return_python_floats(lp: LatencyPredictor) -> None:
    assert type(lp.predict_ttft_ms(300, 4, 400, 8192)) is float
    assert type(lp.predict_tpot_ms(4, 400)) is float


def test_exact_at_sample_points(lp: LatencyPredictor) -> None:
    for tokens, p50 in WORKED_TTFT.items():
        assert lp.predict_ttft_ms(tokens, 0, 0, 8192) == p50
    for b in WORKED_BATCHES:
        for t in WORKED_TPRS:
            assert lp.predict_tpot_ms(b, b * t) == worked_tpot(b, t)


def test_tpot_zero_without_decode_work(lp: LatencyPredictor) -> None:
    assert lp.predict_tpot_ms(0, 100) == 0.0
    assert lp.predict_tpot_ms(3, 0) == 0.0
    assert lp.predict_tpot_ms(-1, 100) == 0.0
    np.testing.assert_array_equal(
        lp.predict_tpot_ms(np.array([0, 2, 3]), np.array([5, 0, 300])), [0, 0, 13.0 - 0.5 * 1 + 0.0]
    )


def test_tpot_uses_at_least_eight_tokens_per_request(lp: LatencyPredictor) -> None:
    # T / D = 1 < 8, so the lookup is at 8 tokens per request.
    assert lp.predict_tpot_ms(8, 8) == pytest.approx(worked_tpot(8, 8))


def test_ttft_zero_for_empty_backlog(lp: LatencyPredictor) -> None:
    assert lp.predict_ttft_ms(0, 4, 400, 8192) == 0.0
    assert lp.predict_ttft_ms(-5, 4, 400, 8192) == 0.0


@pytest.mark.parametrize("budget", [0, -1])
def test_ttft_rejects_non_positive_budget(lp: LatencyPredictor, budget: int) -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        lp.predict_ttft_ms(100, 0, 0, budget)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        lp.predict_ttft_ms(np.array([100, 100]), 0, 0, np.array([512, budget]))


def test_ttft_chunking_adds_decode_step_per_chunk(lp: LatencyPredictor) -> None:
    d = lp.predict_tpot_ms(4, 400)
    # 1100 tokens at M = 512: two full chunks and a 76-token tail, each with a decode step.
    expected = 2 * (100.0 + d) + (31.875 + d)
    assert lp.predict_ttft_ms(1100, 4, 400, 512) == pytest.approx(expected)
    # An exact multiple has no tail.
    assert lp.predict_ttft_ms(1024, 4, 400, 512) == pytest.approx(2 * (100.0 + d))


def test_extrapolation_beyond_largest_samples(lp: LatencyPredictor) -> None:
    # TTFT: slope of the last cell (512 -> 1024) is 80 / 512 per token.
    assert lp.predict_ttft_ms(2048, 0, 0, 4096) == pytest.approx(180 + 1024 * 80 / 512)
    # TPOT: beyond the largest tokens_per_request along the linear model.
    assert lp.predict_tpot_ms(2, 2 * 4096) == pytest.approx(worked_tpot(2, 4096))


def test_extrapolation_is_clamped_at_zero(tmp_path: Path) -> None:
    ttft = write_json(tmp_path / "t.json", ttft_doc({100: 10.0, 200: 110.0}))
    tpot = write_json(tmp_path / "p.json", tpot_doc([(1, 8, 5.0)]))
    lp = LatencyPredictor.from_files(ttft, tpot)
    # Line through (100, 10) and (200, 110) crosses 0 at 90 tokens.
    assert lp.predict_ttft_ms(50, 0, 0, 8192) == 0.0
    assert lp.predict_ttft_ms(95, 0, 0, 8192) == pytest.approx(5.0)


def test_single_sample_axes_are_constant(tmp_path: Path) -> None:
    ttft = write_json(tmp_path / "t.json", ttft_doc({256: 42.0}))
    tpot = write_json(tmp_path / "p.json", tpot_doc([(1, 8, 5.0), (1, 64, 9.0)]))
    lp = LatencyPredictor.from_files(ttft, tpot)
    assert lp.predict_ttft_ms(10, 0, 0, 8192) == 42.0
    assert lp.predict_ttft_ms(5000, 0, 0, 8192) == 42.0
    # Batch axis has one sample: constant along batch, linear along tokens per request.
    assert lp.predict_tpot_ms(1, 36) == pytest.approx(7.0)
    assert lp.predict_tpot_ms(50, 50 * 36) == pytest.approx(7.0)


def test_arrays_broadcast(lp: LatencyPredictor) -> None:
    prefill = np.array([300, 1280, 76])
    out = lp.predict_ttft_ms(prefill, 0, 0, np.array([8192, 1024, 8192]))
    assert isinstance(out, np.ndarray)
    np.testing.assert_allclose(out, [66.875, 240.0, 31.875])
    tpot = lp.predict_tpot_ms(np.array([[4], [32]]), np.array([400, 3200]))
    assert tpot.shape == (2, 2)


@pytest.mark.parametrize(
    "name", ["qwen2.5-7b-2xv100-linear", "llama3-70b-4xh100-roofline", "qwen2.5-7b-2xv100-linear-x4"]
)
def test_bundled_profiles_load(name: str) -> None:
    directory = REPO / "profiling_data" / name
    lp = LatencyPredictor.from_files(directory / "ttft.json", directory / "tpot.json")
    assert lp.predict_ttft_ms(8192, 0, 0, 8192) > lp.predict_ttft_ms(128, 0, 0, 8192) > 0
    assert lp.predict_tpot_ms(256, 256 * 8192) > lp.predict_tpot_ms(1, 8) > 0
    assert "generate.py" in str(lp.ttft_profile.metadata.get("description", ""))


def test_bundled_linear_profile_matches_table_2() -> None:
    directory = REPO / "profiling_data" / "qwen2.5-7b-2xv100-linear"
    lp = LatencyPredictor.from_files(directory / "ttft.json", directory / "tpot.json")
    # Prefill with b = 1: 0.1*l + 5.7 + 0.01*l + 43.67; decode: 0.0002*b*l + 0.275*b + 0.00088*l + 15.85.
    assert lp.predict_ttft_ms(1000, 0, 0, 8192) == pytest.approx(0.11 * 1000 + 49.37)
    assert lp.predict_tpot_ms(10, 10 * 300) == pytest.approx(
        0.0002 * 10 * 300 + 2.75 + 0.00088 * 300 + 15.85, rel=1e-5
    )
