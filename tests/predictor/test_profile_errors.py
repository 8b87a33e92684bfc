"""Every ProfileError case names the file and the entry."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from predictor import LatencyPredictor, ProfileError, load_tpot_profile, load_ttft_profile
from tests.predictor.helpers import tpot_doc, ttft_doc, worked_files, write_json


def _ttft_error(tmp_path: Path, doc: Any) -> str:
    path = write_json(tmp_path / "bad_ttft.json", doc)
    with pytest.raises(ProfileError) as info:
        load_ttft_profile(path)
    assert str(path) in str(info.value)
    return str(info.value)


def _tpot_error(tmp_path: Path, doc: Any) -> str:
    path = write_json(tmp_path / "bad_tpot.json", doc)
    with pytest.raises(ProfileError) as info:
        load_tpot_profile(path)
    assert str(path) in str(info.value)
    return str(info.value)


def test_profile_error_is_a_value_error() -> None:
    assert issubclass(ProfileError, ValueError)


def test_unreadable_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(ProfileError, match="cannot read") as info:
        load_ttft_profile(missing)
    assert str(missing) in str(info.value)


def test_invalid_json(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text("{not json", encoding="utf-8")
    with pytest.raises(ProfileError, match="invalid JSON") as info:
        load_tpot_profile(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("doc", [{}, {"metadata": {}}, [], {"results": {"a": 1}}])
def test_missing_results(tmp_path: Path, doc: Any) -> None:
    assert "results" in _ttft_error(tmp_path, doc)


def test_empty_results(tmp_path: Path) -> None:
    assert "empty" in _ttft_error(tmp_path, {"results": []})
    assert "empty" in _tpot_error(tmp_path, {"results": []})


@pytest.mark.parametrize("key", ["tokens_num", "p50"])
def test_ttft_missing_key(tmp_path: Path, key: str) -> None:
    doc = ttft_doc({128: 40.0, 256: 60.0})
    del doc["results"][1][key]
    message = _ttft_error(tmp_path, doc)
    assert "results[1]" in message and key in message


@pytest.mark.parametrize("key", ["batch_size", "tokens_per_request", "p50"])
def test_tpot_missing_key(tmp_path: Path, key: str) -> None:
    doc = tpot_doc([(1, 8, 5.0), (2, 8, 6.0)])
    del doc["results"][0][key]
    message = _tpot_error(tmp_path, doc)
    assert "results[0]" in message and key in message


def test_entry_not_an_object(tmp_path: Path) -> None:
    assert "results[0]" in _ttft_error(tmp_path, {"results": [5]})


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_p50(tmp_path: Path, value: str) -> None:
    path = tmp_path / "nan.json"
    path.write_text(f'{{"results": [{{"tokens_num": 128, "p50": {value}}}]}}', encoding="utf-8")
    with pytest.raises(ProfileError, match=r"results\[0\].*p50.*finite"):
        load_ttft_profile(path)


def test_negative_p50(tmp_path: Path) -> None:
    message = _tpot_error(tmp_path, tpot_doc([(1, 8, -0.5)]))
    assert "results[0]" in message and "p50" in message


def test_non_numeric_value(tmp_path: Path) -> None:
    assert "must be a number" in _ttft_error(tmp_path, {"results": [{"tokens_num": "128", "p50": 1}]})
    assert "must be a number" in _ttft_error(tmp_path, {"results": [{"tokens_num": True, "p50": 1}]})


@pytest.mark.parametrize("tokens", [0, -128])
def test_non_positive_tokens_num(tmp_path: Path, tokens: int) -> None:
    message = _ttft_error(tmp_path, ttft_doc({128: 40.0, tokens: 1.0}))
    assert "results[1]" in message and "tokens_num" in message and "> 0" in message


@pytest.mark.parametrize(("batch", "tpr", "key"), [(0, 8, "batch_size"), (1, -8, "tokens_per_request")])
def test_non_positive_tpot_axes(tmp_path: Path, batch: int, tpr: int, key: str) -> None:
    message = _tpot_error(tmp_path, tpot_doc([(1, 8, 5.0), (batch, tpr, 6.0)]))
    assert "results[1]" in message and key in message


def test_duplicated_ttft_point(tmp_path: Path) -> None:
    doc = ttft_doc({128: 40.0, 256: 60.0})
    doc["results"].append({"tokens_num": 128.0, "p50": 41.0})
    message = _ttft_error(tmp_path, doc)
    assert "results[2]" in message and "duplicated" in message


def test_duplicated_tpot_point(tmp_path: Path) -> None:
    message = _tpot_error(tmp_path, tpot_doc([(1, 8, 5.0), (2, 8, 6.0), (1, 8, 5.5)]))
    assert "results[2]" in message and "duplicated" in message and "batch_size=1" in message


def test_tpot_grid_not_rectangular_lists_missing_pairs(tmp_path: Path) -> None:
    doc = tpot_doc([(1, 8, 5.0), (1, 64, 6.0), (4, 8, 7.0), (16, 64, 9.0)])
    message = _tpot_error(tmp_path, doc)
    assert "not rectangular" in message
    assert "(4, 64)" in message and "(16, 8)" in message
    assert "(1, 8)" not in message


def test_from_files_reports_the_bad_file(tmp_path: Path) -> None:
    ttft, _ = worked_files(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"results": []}), encoding="utf-8")
    with pytest.raises(ProfileError, match=r"bad\.json"):
        LatencyPredictor.from_files(ttft, bad)
