"""Every command checks its flags before it starts anything, and the error names the flag as typed.

The commands run in this process through ``router.cli.main``: a bad flag must
return 2 (as argparse does) with a message naming the flag, and must not have
bound a server (no "serving" log line from the CMS, router or workers).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from router.cli import main

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "profiling_data" / "qwen2.5-7b-2xv100-linear"
PREDICT = [
    "predict",
    "--ttft-profiling-data-path",
    str(PROFILE / "ttft.json"),
    "--tpot-profiling-data-path",
    str(PROFILE / "tpot.json"),
]

CASES = [
    # (argv, text the error must contain)
    (["router", "--tpot-slo", "-5"], "--tpot-slo"),
    (["router", "--ttft-slo", "nan"], "--ttft-slo"),
    (["router", "--ttft-slo-dispatch-threshold", "0"], "--ttft-slo-dispatch-threshold"),
    (["router", "--instance-staleness-seconds", "0"], "--instance-staleness-seconds"),
    (["router", "--dispatch-top-k", "0"], "--dispatch-top-k"),
    (["router", "--max-retries", "-1"], "--max-retries"),
    (["router", "--prefill-timeout-s", "0"], "--prefill-timeout-s"),
    (["router", "--max-prompt-tokens", "0"], "--max-prompt-tokens"),
    (["router", "--listen", "nowhere"], "--listen"),
    (["router", "--processes", "0"], "--processes"),
    (["router", "--worker-streams", "batched"], "--worker-streams"),
    (["up", "--worker-streams", "batched"], "--worker-streams"),
    (["router", "--processes", "2"], "--processes"),  # the embedded CMS is one process's
    (["router", "--processes", "99", "--cms", "grpc://127.0.0.1:1"], "--processes"),
    (["router", "--cms-listen", "127.0.0.1:99999"], "--cms-listen"),
    (["router", "--cms", "tcp://x"], "--cms"),
    (["router", "--metrics-port", "70000"], "--metrics-port"),
    (["router", "--profile-group", "broken"], "--profile-group"),
    (["router", "--tokenizer", "/nonexistent/tokenizer.json"], "--tokenizer"),
    (["router", "--scheduling-policy", "round-robin", "--enable-adaptive-pd"], "--scheduling-policy"),
    (["router", "--max-queue-size", "0"], "--max-queue-size"),
    (["router", "--max-queue-wait-ms", "0"], "--max-queue-wait-ms"),
    (["router", "--release-window-requests", "-1"], "--release-window-requests"),
    (["router", "--queue-policy", "sa", "--sa-iterations", "0"], "--sa-iterations"),
    (["router", "--sa-decay", "1.5"], "--sa-decay"),
    (["router", "--sa-min-temperature", "900"], "--sa-min-temperature"),
    (["up", "--sa-initial-temperature", "-1"], "--sa-initial-temperature"),
    (["up", "--queue-policy", "sa", "--sa-max-batch", "-1"], "--sa-max-batch"),
    (["up", "--sa-budget-ms", "0"], "--sa-budget-ms"),
    (["simulate", "--queue-policies", "fcfs,sa", "--sa-decay", "0"], "--sa-decay"),
    (["simulate", "--sa-iterations", "0"], "--sa-iterations"),
    (["router", "--drain-window-ms", "-1"], "--drain-window-ms"),
    (["up", "--priority-headroom", "2"], "--priority-headroom"),
    (["up", "--max-queue-size", "0"], "--max-queue-size"),
    (["up", "--tpot-slo", "-5"], "--tpot-slo"),
    (["up", "--prefill", "-1"], "--prefill"),
    (["up", "--speed-factor", "0"], "--speed-factor"),
    (["up", "--start-timeout-s", "-1"], "--start-timeout-s"),
    (["up", "--worker-stream-interval-ms", "-1"], "--worker-stream-interval-ms"),
    (["up", "--processes", "0"], "--processes"),
    (["up", "--listen", "127.0.0.1"], "--listen"),
    (["up", "--metrics-port", "-2"], "--metrics-port"),
    (["up", "--dispatch-top-k", "0"], "--dispatch-top-k"),
    (["up", "--profile", "/nonexistent-profile"], "--profile"),
    (["simulate", "--ttft-slo", "-100"], "--ttft-slo"),
    (["simulate", "--tpot-slo-dispatch-threshold", "-1"], "--tpot-slo-dispatch-threshold"),
    (["simulate", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["simulate", "--policies", "no-such-policy"], "--policies"),
    (["simulate", "--num-requests", "0"], "--num-requests"),
    (["simulate", "--queue-policies", "lifo"], "--queue-policies"),
    (["simulate", "--max-queue-wait-ms", "-1"], "--max-queue-wait-ms"),
    ([*PREDICT, "--prefill-tokens", "-5"], "--prefill-tokens"),
    ([*PREDICT, "--prefill-tokens", "10", "--decode-requests", "-1"], "--decode-requests"),
    ([*PREDICT, "--prefill-tokens", "10", "--decode-tokens", "-3"], "--decode-tokens"),
    ([*PREDICT, "--prefill-tokens", "10", "--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    (["worker", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["worker", "--speed-factor", "-1"], "--speed-factor"),
    (["worker", "--listen", "127.0.0.1:x"], "--listen"),
    (["worker", "--cms", "nowhere"], "--cms"),
    (["worker", "--shutdown-grace-s", "-1"], "--shutdown-grace-s"),
    (["worker", "--stream-interval-ms", "nan"], "--stream-interval-ms"),
    (["profile", "--target", "127.0.0.1:", "--out", "x"], "--target"),
    (["profile", "--target", "127.0.0.1:50051", "--out", "x", "--repeats", "0"], "--repeats"),
    (["bench", "--timeout-s", "-1"], "--timeout-s"),
    (["bench", "--max-in-flight", "0"], "--max-in-flight"),
    (["bench", "--duration", "-5"], "--duration"),
    (["bench", "--num-requests", "-1"], "--num-requests"),
    (["bench", "--drain-timeout-s", "-1"], "--drain-timeout-s"),
    (["bench", "--connect-timeout-s", "0"], "--connect-timeout-s"),
    (["bench", "--rate", "-1"], "--rate"),
    (["bench", "--concurrency", "0"], "--concurrency"),
    (["bench", "--target", "nowhere"], "--target"),
    (["schedule", "--target", "nowhere"], "--target"),
    (["schedule", "--prompt-tokens", "0"], "--prompt-tokens"),
    (["schedule", "--prompt", ""], "--prompt"),
    (["schedule", "--max-tokens", "0"], "--max-tokens"),
    (["schedule", "--ttft-ms", "nan"], "--ttft-ms"),
    (["schedule", "--e2e-ms", "-1"], "--e2e-ms"),
    (["schedule", "--top", "-1"], "--top"),
    (["schedule", "--timeout-s", "0"], "--timeout-s"),
    (["cms", "--metrics-port", "-3"], "--metrics-port"),
    (["cms", "--lease-ttl-s", "0"], "--lease-ttl-s"),
    (["cms", "--store", "postgres://x"], "--store"),
]


@pytest.mark.parametrize(("argv", "flag"), CASES, ids=[" ".join(a[:1] + a[-2:]) for a, _ in CASES])
def test_a_bad_flag_is_refused_by_name_before_anything_starts(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        code = main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and flag in err, err
    # The message names the flag, never the config field behind it.
    field = flag.lstrip("-").replace("-", "_")
    assert f" {field}" not in err and f"{field}=" not in err, err
    started = [
        r.getMessage()
        for r in caplog.records
        if "serving on" in r.getMessage() or "listening" in r.getMessage()
    ]
    assert started == [], started


def test_the_flag_error_keeps_the_value_and_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--ttft-slo", "-100"]) == 2
    err = capsys.readouterr().err
    assert "--ttft-slo=-100.0: must be a finite number > 0" in err
    assert "--policies" not in err  # it is not about the policies


def test_predict_accepts_an_idle_instance(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PREDICT, "--prefill-tokens", "2048", "--max-num-batched-tokens", "2048"]) == 0
    out = capsys.readouterr().out
    ttft = float(out.split("predicted_ttft_ms:")[1].split()[0])
    assert ttft > 0
