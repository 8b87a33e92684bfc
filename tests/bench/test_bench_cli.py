"""``slo-router bench`` end to end against a fake router served from a thread."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.cli import main
from tests.bench.fake_router import FAIL_EXHAUSTED, FAIL_MIDSTREAM, FakeRouter, fake_router_in_thread
from workload.spec import load_workload


def test_bench_command_prints_the_table_and_writes_json_and_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    servicer = FakeRouter(token_delay_s=0.0)
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    with fake_router_in_thread(servicer) as address:
        code = main(
            [
                "bench",
                "--target",
                address,
                "--workload",
                "tiny",
                "--rate",
                "500",
                "--burstiness",
                "0.5",
                "--num-requests",
                "40",
                "--seed",
                "3",
                "--output",
                str(out),
                "--plot",
                str(png),
            ]
        )
    assert code == 0
    captured = capsys.readouterr()
    assert "tiny" in captured.out and "overall" in captured.out and "TTFT p99" in captured.out
    assert "gamma, 500 req/s, burstiness 0.5" in captured.err and "40/40 done" in captured.err
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert doc["overall"]["requests"] == 40 and doc["overall"]["errors"] == 0
    assert doc["meta"]["seed"] == 3 and doc["meta"]["workload"]["arrival"]["process"] == "gamma"
    assert len(doc["requests"]) == 40 and all(r["completion_tokens"] == 16 for r in doc["requests"])
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert len(servicer.received) == 40
    # The fake router predicts TTFT 12.5 ms and TPOT 3 ms in every route: each request has a pair.
    error = doc["meta"]["prediction_error"]
    assert error["ttft"]["count"] == 40 and error["tpot"]["count"] == 40
    ttft = error["ttft"]
    assert f"TTFT error median {100 * ttft['median']:.1f}% p90 {100 * ttft['p90']:.1f}%" in captured.out


def test_closed_loop_with_a_duration(capsys: pytest.CaptureFixture[str]) -> None:
    with fake_router_in_thread(FakeRouter(token_delay_s=0.001)) as address:
        code = main(
            [
                "bench",
                "--target",
                address,
                "--workload",
                "tiny",
                "--concurrency",
                "3",
                "--duration",
                "0.3",
                "--no-progress",
            ]
        )
    assert code == 0
    captured = capsys.readouterr()
    assert "closed loop, concurrency 3" in captured.err
    assert "the duration cap stopped the run" in captured.out


def test_print_workload_and_bad_arguments(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["bench", "--workload", "chat=0.7,code=0.3", "--rate", "5", "--print-workload"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [c["name"] for c in doc["classes"]] == ["chat", "code"] and doc["arrival"]["rate_per_s"] == 5
    path = tmp_path / "w.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    assert main(["bench", "--workload", str(path), "--print-workload"]) == 0
    assert json.loads(capsys.readouterr().out) == doc

    assert main(["bench", "--workload", "nope"]) == 2
    assert "not a preset" in capsys.readouterr().err
    assert main(["bench", "--concurrency", "2", "--burstiness", "0.5"]) == 2
    assert "cannot be used with --concurrency" in capsys.readouterr().err
    assert main(["bench", "--rate", "-1"]) == 2
    assert "error: --rate -1: must be a finite number > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--rate", "1", "--concurrency", "2"])


def test_unreachable_target_and_missing_matplotlib(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert (
        main(["bench", "--target", "127.0.0.1:1", "--connect-timeout-s", "0.2", "--num-requests", "2"]) == 1
    )
    assert "cannot reach a router at 127.0.0.1:1" in capsys.readouterr().err

    import bench.cli

    monkeypatch.setattr(bench.cli.importlib.util, "find_spec", lambda name: None)
    assert main(["bench", "--plot", "x.png"]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_help_documents_the_workload_spec(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    for fragment in (
        "workload spec",
        "chat=0.7,code=0.3",
        "lognormal(384,1,16,4096)",
        "burstiness",
        "goodput",
        "answer lengths (--engine)",
        "a real model's output cannot be steered",
    ):
        assert fragment in text


def test_the_workload_file_example_in_the_help_is_valid(tmp_path: Path) -> None:
    from bench.cli import EPILOG

    lines = EPILOG.split("workload file (YAML shown; JSON has the same keys):\n", 1)[1].split("\n\n", 1)[0]
    path = tmp_path / "example.yaml"
    path.write_text("\n".join(line[2:] for line in lines.splitlines()), encoding="utf-8")
    spec = load_workload(str(path))
    assert spec.name == "support-bot" and spec.class_names() == ("chat", "code")
    assert spec.arrival.burstiness == 0.5


def test_the_summary_names_the_cause_of_each_error_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Two classes the fake router fails differently: the summary must say why, not only how many.
    workload = {
        "name": "failing",
        "classes": [
            {"preset": "tiny", "name": "exhausted", "share": 1, "priority": FAIL_EXHAUSTED},
            {"preset": "tiny", "name": "lost", "share": 1, "priority": FAIL_MIDSTREAM},
        ],
    }
    path = tmp_path / "failing.json"
    path.write_text(json.dumps(workload), encoding="utf-8")
    out = tmp_path / "out.json"
    with fake_router_in_thread(FakeRouter(token_delay_s=0.0)) as address:
        argv = ["bench", "--target", address, "--workload", str(path), "--rate", "200"]
        code = main([*argv, "--num-requests", "12", "--seed", "1", "--no-progress", "--output", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    header = lines.index("errors by code, with the first message of each:")
    causes = dict(line.strip().split(": ", 1) for line in lines[header + 1 :])
    doc = json.loads(out.read_text(encoding="utf-8"))
    counts = doc["overall"]["errors_by_code"]
    assert set(counts) == {"RESOURCE_EXHAUSTED", "UNAVAILABLE"} and sum(counts.values()) == 12
    assert causes == {
        f"RESOURCE_EXHAUSTED {counts['RESOURCE_EXHAUSTED']}": "no instance can meet the SLO",
        f"UNAVAILABLE {counts['UNAVAILABLE']}": "decode instance lost",
    }
    assert doc["overall"]["first_error_by_code"] == {
        "RESOURCE_EXHAUSTED": "no instance can meet the SLO",
        "UNAVAILABLE": "decode instance lost",
    }
    assert "goodput/s: requests per second of the run that met their SLO" in text
