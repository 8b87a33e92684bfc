"""Report figures on hand-made results: attainment, goodput, percentiles, errors, JSON, text, PNG."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from workload.report import (
    BAD_STREAM,
    PlotUnavailableError,
    RequestResult,
    format_table,
    latency_stats,
    plot_report,
    report_to_dict,
    slo_met,
    summarize,
    write_json,
)
from workload.spec import SloTarget

CHAT = SloTarget(ttft_ms=100.0, tpot_ms=10.0)
CODE = SloTarget(e2e_ms=1000.0)


def make_result(
    index: int,
    class_name: str = "chat",
    slo: SloTarget = CHAT,
    *,
    ttft: float | None = 50.0,
    tpot: float | None = 5.0,
    e2e: float | None = 500.0,
    tokens: int = 10,
    error: str | None = None,
) -> RequestResult:
    return RequestResult(
        index=index,
        class_name=class_name,
        slo=slo,
        prompt_tokens=100,
        max_tokens=10,
        completion_tokens=tokens,
        ttft_ms=ttft,
        tpot_ms=tpot,
        e2e_ms=e2e,
        error_code=error,
    )


def hand_made() -> list[RequestResult]:
    return [
        # chat: 0 and 3 meet; 1 misses TTFT; 2 misses TPOT; 4 errored (fast, still a miss);
        # 5 has a single token (no TPOT) and meets.
        make_result(0, ttft=50.0, tpot=5.0, e2e=100.0),
        make_result(1, ttft=150.0, tpot=5.0, e2e=200.0),
        make_result(2, ttft=80.0, tpot=12.0, e2e=300.0),
        make_result(3, ttft=100.0, tpot=10.0, e2e=400.0),
        make_result(4, ttft=10.0, tpot=1.0, e2e=20.0, tokens=3, error="UNAVAILABLE"),
        make_result(5, ttft=20.0, tpot=None, e2e=500.0, tokens=1),
        # code: e2e only; 6 meets, 7 misses, 8 never got a token, 9 broke the stream.
        make_result(6, "code", CODE, ttft=900.0, tpot=90.0, e2e=1000.0, tokens=20),
        make_result(7, "code", CODE, e2e=1500.0, tokens=20),
        make_result(8, "code", CODE, ttft=None, tpot=None, e2e=30.0, tokens=0, error="RESOURCE_EXHAUSTED"),
        make_result(9, "code", CODE, e2e=600.0, tokens=19, error=BAD_STREAM),
    ]


def test_slo_met_rules() -> None:
    met = [slo_met(r) for r in hand_made()]
    assert met == [True, False, False, True, False, True, True, False, False, False]
    assert slo_met(make_result(0, slo=SloTarget(), ttft=None, tpot=None, e2e=None))  # no targets
    assert not slo_met(make_result(0, slo=SloTarget(ttft_ms=100.0), ttft=None))  # no token, no TTFT


def test_latency_stats_use_linear_interpolation() -> None:
    stats = latency_stats([50.0, 10.0, 40.0, 20.0, 30.0])
    assert (stats.count, stats.mean_ms, stats.max_ms) == (5, 30.0, 50.0)
    assert (stats.p50_ms, stats.p90_ms, stats.p99_ms) == pytest.approx((30.0, 46.0, 49.6))
    assert latency_stats([]).p50_ms is None and latency_stats([]).count == 0
    one = latency_stats([7.0])
    assert one.p50_ms == one.p99_ms == 7.0


def test_summary_per_class_and_overall() -> None:
    report = summarize(
        hand_made(),
        2.0,
        class_slos={"code": CODE, "chat": CHAT, "idle": SloTarget(e2e_ms=5.0)},
        meta={"seed": 1},
    )
    assert [c.name for c in report.classes] == ["code", "chat", "idle"]
    chat, code, idle = report.by_class()["chat"], report.by_class()["code"], report.by_class()["idle"]

    assert (chat.requests, chat.completed, chat.errors, chat.slo_met) == (6, 5, 1, 3)
    assert chat.slo_attainment == pytest.approx(3 / 6)
    assert chat.ttft_attainment == pytest.approx(4 / 6)  # 1 is too slow, 4 errored
    assert chat.tpot_attainment == pytest.approx(4 / 6)  # 2 is too slow, 4 errored; 5 has no TPOT
    assert chat.e2e_attainment is None
    assert chat.goodput_rps == pytest.approx(3 / 2.0)
    assert chat.goodput_tokens_per_s == pytest.approx((10 + 10 + 1) / 2.0)
    assert chat.throughput_rps == pytest.approx(5 / 2.0)
    assert chat.output_tokens_per_s == pytest.approx((10 * 4 + 1) / 2.0)
    assert chat.completion_tokens == 10 * 4 + 3 + 1
    # Latencies over the five requests that completed (the errored one is left out).
    assert chat.ttft.count == 5 and chat.ttft.p50_ms == 80.0 and chat.ttft.max_ms == 150.0
    assert chat.ttft.p90_ms == pytest.approx(130.0) and chat.ttft.p99_ms == pytest.approx(148.0)
    assert chat.tpot.count == 4 and chat.tpot.p50_ms == pytest.approx(7.5)
    assert chat.e2e.p50_ms == 300.0
    assert chat.errors_by_code == {"UNAVAILABLE": 1}

    assert (code.requests, code.completed, code.errors, code.slo_met) == (4, 2, 2, 1)
    assert code.slo_attainment == 0.25 and code.e2e_attainment == 0.25
    assert code.ttft_attainment is None and code.tpot_attainment is None
    assert code.errors_by_code == {"RESOURCE_EXHAUSTED": 1, BAD_STREAM: 1}
    assert code.e2e.count == 2 and code.e2e.p50_ms == pytest.approx(1250.0)

    assert (idle.requests, idle.slo_attainment, idle.goodput_rps, idle.ttft.p50_ms) == (0, 0.0, 0.0, None)

    overall = report.overall
    assert overall.name == "overall" and overall.slo is None
    assert (overall.requests, overall.slo_met, overall.errors) == (10, 4, 3)
    assert overall.slo_attainment == pytest.approx(0.4)
    assert overall.goodput_rps == pytest.approx(2.0)
    assert overall.ttft_attainment == pytest.approx(4 / 6)
    assert overall.e2e_attainment == pytest.approx(0.25)
    assert overall.errors_by_code == {"UNAVAILABLE": 1, "RESOURCE_EXHAUSTED": 1, BAD_STREAM: 1}
    assert report.meta == {"seed": 1}


def test_zero_window_and_no_results() -> None:
    report = summarize([], 0.0)
    assert report.classes == () and report.overall.requests == 0 and report.overall.goodput_rps == 0.0
    with pytest.raises(ValueError, match="duration_s"):
        summarize([], -1.0)
    assert "0 requests" in format_table(report)


def test_json_has_every_figure(tmp_path: Path) -> None:
    results = hand_made()
    report = summarize(results, 2.0, meta={"title": "t"})
    doc = report_to_dict(report, results)
    chat = doc["classes"]["chat"]
    for key in (
        "slo_attainment",
        "ttft_attainment",
        "tpot_attainment",
        "e2e_attainment",
        "goodput_rps",
        "goodput_tokens_per_s",
        "throughput_rps",
        "output_tokens_per_s",
        "errors",
        "errors_by_code",
        "ttft_slo_ms",
        "tpot_slo_ms",
        "e2e_slo_ms",
    ):
        assert key in chat
    for metric in ("ttft", "tpot", "e2e"):
        for stat in ("mean", "p50", "p90", "p99", "max"):
            assert f"{metric}_{stat}_ms" in chat
    assert chat["ttft_p50_ms"] == 80.0 and chat["slo_attainment"] == 0.5 and chat["ttft_slo_ms"] == 100.0
    assert doc["overall"]["errors_by_code"] == {BAD_STREAM: 1, "RESOURCE_EXHAUSTED": 1, "UNAVAILABLE": 1}
    assert len(doc["requests"]) == 10 and doc["requests"][1]["ttft_met"] is False
    assert doc["requests"][8]["error_code"] == "RESOURCE_EXHAUSTED"

    path = tmp_path / "out.json"
    write_json(path, report, results)
    assert json.loads(path.read_text(encoding="utf-8")) == json.loads(json.dumps(doc))
    assert "requests" not in report_to_dict(report)


def test_text_table() -> None:
    report = summarize(hand_made(), 2.0, meta={"title": "my run"})
    text = format_table(report)
    lines = text.splitlines()
    assert lines[0] == "my run"
    assert lines[1] == "10 requests in 2.0 s, 7 completed, 3 errors"
    chat_row = next(line for line in lines if line.startswith("chat ") and "ttft<=100ms" in line)
    assert "50.0%" in chat_row and "66.7%" in chat_row
    assert any(line.startswith("overall") and "40.0%" in line for line in lines)
    first = lines.index("errors by code, with the first message of each:")
    assert [line.split(":")[0].strip() for line in lines[first + 1 :]] == [
        "BAD_STREAM 1",
        "RESOURCE_EXHAUSTED 1",
        "UNAVAILABLE 1",
    ]
    assert all(line.split(": ", 1)[1] for line in lines[first + 1 :])


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    results = hand_made()
    path = tmp_path / "plot.png"
    plot_report(path, summarize(results, 2.0), results)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(PlotUnavailableError, match=r"pip install 'slo-router\[plot\]'"):
        plot_report(tmp_path / "x.png", summarize(hand_made(), 2.0), hand_made())
    assert not (tmp_path / "x.png").exists()
