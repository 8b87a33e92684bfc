"""Trace replay: each format read, the options applied, bad files named by file, line and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.cli import main
from sim.cluster import SimFleet, simulate
from sim.fleet import fleet_from_counts
from tests.sim.test_simulate import policy
from workload.spec import WorkloadError
from workload.traces import TraceOptions, load_trace, parse_class_rule, parse_window, read_trace

DATA = Path(__file__).resolve().parent.parent / "data" / "traces"
AZURE = DATA / "azure-conv-2023-head300.csv"
AZURE_RAW = DATA / "azure-raw-head50.csv"
MOONCAKE = DATA / "mooncake-conversation-head300.jsonl"


def test_each_format_is_recognised_from_its_first_line() -> None:
    fmt, azure = read_trace(AZURE)
    assert fmt == "azure" and len(azure) == 300
    assert (azure[1].arrival_s, azure[1].prompt_tokens, azure[1].output_tokens) == (4.314579, 396, 109)
    fmt, raw = read_trace(AZURE_RAW)
    assert fmt == "azure-raw" and len(raw) == 50
    # The same requests in the raw format: same lengths, same gaps.
    for a, b in zip(azure[:50], raw, strict=True):
        assert (a.prompt_tokens, a.output_tokens) == (b.prompt_tokens, b.output_tokens)
        assert b.arrival_s - raw[0].arrival_s == pytest.approx(a.arrival_s - azure[0].arrival_s, abs=1e-5)
    fmt, moon = read_trace(MOONCAKE)
    assert fmt == "mooncake" and len(moon) == 300
    first = json.loads(MOONCAKE.read_text().splitlines()[0])
    assert moon[0].prompt_tokens == first["input_length"] and moon[0].hash_ids == tuple(first["hash_ids"])


def test_plans_carry_the_trace_lengths_as_truth_and_one_cap_for_all() -> None:
    trace = load_trace(f"trace:{AZURE}")
    plans = trace.plans()
    assert len(plans) == 300 and plans[0].arrival_s == 0.0
    records = trace.records
    assert [p.true_output_tokens for p in plans] == [max(r.output_tokens, 1) for r in records]
    assert {p.max_tokens for p in plans} == {max(r.output_tokens for r in records)}
    assert [p.arrival_s for p in plans] == pytest.approx(
        [r.arrival_s - records[0].arrival_s for r in records]
    )


def test_num_requests_speed_rate_and_window() -> None:
    trace = load_trace(f"trace:{AZURE}")
    assert len(trace.plans(25)) == 25
    fast = load_trace(f"trace:{AZURE}", TraceOptions(speed=2.0)).plans(100)
    own = trace.plans(100)
    assert [p.arrival_s for p in fast] == pytest.approx([p.arrival_s / 2 for p in own])
    # A rate rescales the timing so the mean rate is that rate.
    at = trace.plans(rate=10.0)
    assert (len(at) - 1) / at[-1].arrival_s == pytest.approx(10.0)
    window = load_trace(f"trace:{AZURE}", TraceOptions(start_s=20.0, end_s=40.0))
    origin = trace.records[0].arrival_s
    expected = [r for r in trace.records if 20.0 <= r.arrival_s - origin < 40.0]
    assert window.records == tuple(expected)
    assert window.plans()[0].arrival_s == 0.0
    assert parse_window("600:") == (600.0, float("inf"))


def test_classes_by_rule() -> None:
    trace = load_trace(f"trace:{AZURE}", TraceOptions(classes="chat,1000,summarize"))
    for p in trace.plans():
        assert p.class_name == ("chat" if p.prompt_tokens < 1000 else "summarize")
    assert {c.name for c in trace.workload().classes} == {"chat", "summarize"}
    with pytest.raises(WorkloadError, match="unknown class preset 'nope'"):
        parse_class_rule("nope")
    with pytest.raises(WorkloadError, match="increasing"):
        parse_class_rule("chat,100,code,50,summarize")


def test_equal_hash_ids_give_equal_prompt_blocks_in_a_replayed_trace() -> None:
    plans = load_trace(f"trace:{MOONCAKE}").plans(10)
    a, b = plans[0], plans[1]  # both start with block 0, then differ
    assert a.hash_ids[0] == b.hash_ids[0] and a.hash_ids[1] != b.hash_ids[1]
    ids_a, ids_b = a.prompt_token_ids(), b.prompt_token_ids()
    assert ids_a[:512] == ids_b[:512] and ids_a[512:1024] != ids_b[512:1024]


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        (
            "bad.csv",
            "arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,12,3\n1.0,x,4\n",
            r"bad.csv:3: field 'num_prefill_tokens'",
        ),
        (
            "short.csv",
            "arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,12\n",
            r"short.csv:2: expected 3 fields",
        ),
        ("what.csv", "time,prompt,output\n0,1,2\n", r"what.csv:1: unknown trace format"),
        (
            "m.jsonl",
            '{"timestamp": 0, "input_length": 5, "output_length": 2}\n{"timestamp": 1, "input_length": 5}\n',
            r"m.jsonl:2: field 'output_length' is missing",
        ),
        (
            "h.jsonl",
            '{"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": [1, -2]}\n',
            r"h.jsonl:1: field 'hash_ids'",
        ),
        (
            "j.jsonl",
            '{"timestamp": 0, "input_length": 5, "output_length": 2}\n{oops\n',
            r"j.jsonl:2: not a JSON object",
        ),
        ("t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n", r"t.csv:2: field 'TIMESTAMP'"),
        ("e.csv", "", r"e.csv:1: empty trace file"),
    ],
)
def test_bad_files_name_the_file_line_and_field(tmp_path: Path, name: str, text: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(WorkloadError, match=message):
        load_trace(f"trace:{path}")


def test_a_replayed_trace_runs_in_the_simulator_with_its_true_lengths() -> None:
    plans = load_trace(f"trace:{AZURE}").plans(120)
    out = simulate(SimFleet(fleet_from_counts(neutral=2)), policy("slo"), plans, seed=0)
    assert [r.completion_tokens for r in out.results if r.ok] == [
        p.true_output_tokens for p, r in zip(plans, out.results, strict=True) if r.ok
    ]
    assert sum(r.ok for r in out.results) >= 110


def test_simulate_cli_replays_a_trace_at_its_own_timing(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "simulate",
            "--workload",
            f"trace:{AZURE}",
            "--neutral",
            "2",
            "--policies",
            "round-robin",
            "--num-requests",
            "60",
            "--trace-speed",
            "2",
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "azure trace, 300 requests" in out and "replayed at 2x" in out
    assert " 60 " in out  # the first 60 requests


def test_simulate_cli_names_a_bad_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "x.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,-3\n")
    assert main(["simulate", "--workload", f"trace:{path}", "--neutral", "1", "--no-progress"]) == 2
    assert "x.csv:2: field 'num_decode_tokens'" in capsys.readouterr().err


def test_bench_replays_the_same_trace_through_a_router(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.bench.fake_router import FakeRouter, fake_router_in_thread

    servicer = FakeRouter(token_delay_s=0.0)
    out = tmp_path / "bench.json"
    args = ["--workload", f"trace:{AZURE}", "--num-requests", "12", "--trace-speed", "1000", "--no-progress"]
    # The fake router is not a sim engine (its tokens are its own): run bench as for a real model.
    args += ["--engine", "vllm"]
    with fake_router_in_thread(servicer) as address:
        code = main(["bench", "--target", address, *args, "--output", str(out)])
    assert code == 0
    plans = load_trace(f"trace:{AZURE}", TraceOptions(speed=1000.0)).plans(12)
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert doc["overall"]["requests"] == 12 and doc["overall"]["errors"] == 0
    # Classes that ignore EOS ask a live engine for exactly the trace's answer length.
    sent = sorted((len(r.prompt_token_ids), r.sampling.max_tokens) for r in servicer.received)
    assert sent == sorted((p.prompt_tokens, p.true_output_tokens) for p in plans)


def test_slice_dispatch_replays_the_trace_itself(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--workload", f"trace:{AZURE}", "--neutral", "1", "--dispatch-modes", "slice"]
    assert main([*args, "--no-progress"]) == 0
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if line.split()[1:2] == ["slice"])
    # Every request of the trace's head is served, at the trace's own rate (not a drawn workload's).
    assert row[1:4] == ["slice", "max-min", "300"]
    assert 3.0 < float(row[0]) < 4.0
