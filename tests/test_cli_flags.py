"""Every command checks its flags before it starts anything, and the error names the flag as typed.

The commands run in this process through ``router.cli.main``: a bad flag must
return 2 (as argparse does) with a message naming the flag, and must not have
bound a server (no "serving" log line from the CMS, router or workers).
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
from collections.abc import Iterator
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
    (["router", "--vllm-stream-interval-ms", "-1"], "--vllm-stream-interval-ms"),
    (["router", "--vllm-stream-interval-ms", "nan"], "--vllm-stream-interval-ms"),
    (["up", "--vllm-stream-interval-ms", "1000"], "--vllm-stream-interval-ms"),
    (["router", "--vllm-stream-messages-per-s", "-5"], "--vllm-stream-messages-per-s"),
    (["up", "--vllm-stream-messages-per-s", "inf"], "--vllm-stream-messages-per-s"),
    (["router", "--vllm-transport", "http"], "--vllm-transport"),
    (["up", "--vllm-transport", "H2"], "--vllm-transport"),
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
    (["up", "--queue-policy", "qlm"], "--queue-policy qlm"),  # prefill/decode workers by default
    (["simulate", "--prefill", "1", "--decode", "1", "--queue-policies", "edf,qlm"], "--queue-policies qlm"),
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
    assert len(err.strip().splitlines()) == 1, err  # one line
    if flag in argv and argv.index(flag) + 1 < len(argv) and not argv[argv.index(flag) + 1].startswith("--"):
        # One shape: the flag and its value exactly as typed, then the reason.
        typed = argv[argv.index(flag) + 1]
        shown = repr(typed) if typed == "" else typed
        assert err.startswith(f"error: {flag} {shown}: "), err
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
    assert err == "error: --ttft-slo -100: must be a finite number > 0\n"
    assert "--policies" not in err  # it is not about the policies


def test_predict_accepts_an_idle_instance(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*PREDICT, "--prefill-tokens", "2048", "--max-num-batched-tokens", "2048"]) == 0
    out = capsys.readouterr().out
    ttft = float(out.split("predicted_ttft_ms:")[1].split()[0])
    assert ttft > 0


# --------------------------------------------------------------------------- one shape, values as typed

SHAPE_CASES = [
    # (argv, the start of the one error line: the flag and the value exactly as typed)
    (["plan", "--workload", "mixed", "--rate", "12", "--attainment", "150"], "--attainment 150: "),
    (["plan", "--workload", "mixed", "--rate", "0", "--attainment", "95"], "--rate 0: "),
    (["simulate", "--rates", "0"], "--rates 0: "),
    (["simulate", "--ttft-slo=-100"], "--ttft-slo -100: "),
    (["router", "--tpot-slo", "-5"], "--tpot-slo -5: "),
    (["router", "--cms", "tcp://x"], "--cms tcp://x: "),
    (["worker", "--cms", "nowhere"], "--cms nowhere: "),
    (["bench", "--rate", "-1"], "--rate -1: "),
    (["cms", "--lease-ttl-s", "0"], "--lease-ttl-s 0: "),
    (["keys", "unused-dir", "--workers", "p0,,d0"], "--workers p0,,d0: "),
    (["profile", "--target", "127.0.0.1:1", "--out", "unused-dir", "--tokens", "5,5"], "--tokens 5,5: "),
    (
        ["profile", "--target", "127.0.0.1:1", "--out", "unused-dir", "--decode-tokens", "2"],
        "--decode-tokens 2: ",
    ),
    (["keys", "unused-dir", "--workers", "router"], "--workers router: "),
]


@pytest.mark.parametrize(("argv", "start"), SHAPE_CASES, ids=[s.strip(": ") for _, s in SHAPE_CASES])
def test_every_mistake_has_one_shape_with_the_value_as_typed(
    argv: list[str],
    start: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: " + start) and err.count("\n") == 1, err
    assert "1.5" not in err and "got" not in err, err  # never the parsed value (150 % is not "1.5")
    assert not (tmp_path / "unused-dir").exists()


# --------------------------------------------------------------------------- listening flags


@pytest.fixture
def taken() -> Iterator[str]:
    """A loopback address another socket listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def _free_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def _listening_cases(taken: str) -> list[tuple[list[str], str, str]]:
    """(argv, flag, value as typed) for every listening flag of every serving command."""
    port = taken.rpartition(":")[2]
    free = "127.0.0.1:0"
    remote_cms = ["--cms", "127.0.0.1:1"]
    return [
        (["cms", "--listen", taken], "--listen", taken),
        (["cms", "--listen", free, "--metrics-port", port], "--metrics-port", port),
        (["worker", "--listen", taken], "--listen", taken),
        (["worker", "--listen", free, "--http-listen", taken], "--http-listen", taken),
        (["worker", "--listen", free, "--metrics-port", port], "--metrics-port", port),
        (["router", "--listen", taken, *remote_cms], "--listen", taken),
        (["router", "--listen", free, *remote_cms, "--http-listen", taken], "--http-listen", taken),
        (["router", "--listen", free, *remote_cms, "--metrics-port", port], "--metrics-port", port),
        (["router", "--listen", free, "--cms-listen", taken], "--cms-listen", taken),
        (["up", "--listen", taken, "--http-listen", ""], "--listen", taken),
        (["up", "--listen", free, "--http-listen", taken], "--http-listen", taken),
        (["up", "--listen", free, "--http-listen", "", "--metrics-port", port], "--metrics-port", port),
    ]


@pytest.mark.parametrize("case", range(12))
def test_a_listening_flag_on_a_taken_port_is_refused_by_name_before_anything_starts(
    case: int, taken: str, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    argv, flag, value = _listening_cases(taken)[case]
    with caplog.at_level(logging.INFO):
        code = main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"error: {flag} {value}: address already in use"), err
    assert err.count("\n") == 1, err
    started = [
        r.getMessage()
        for r in caplog.records
        if "serving on" in r.getMessage() or "listening" in r.getMessage()
    ]
    assert started == [], started


def test_every_serving_command_is_covered() -> None:
    cases = _listening_cases("127.0.0.1:1")
    assert {(argv[0], flag) for argv, flag, _ in cases} == {
        ("cms", "--listen"),
        ("cms", "--metrics-port"),
        ("worker", "--listen"),
        ("worker", "--http-listen"),
        ("worker", "--metrics-port"),
        ("router", "--listen"),
        ("router", "--http-listen"),
        ("router", "--metrics-port"),
        ("router", "--cms-listen"),
        ("up", "--listen"),
        ("up", "--http-listen"),
        ("up", "--metrics-port"),
    }


def test_a_taken_port_exits_2_from_the_installed_command_too(taken: str) -> None:
    # The console script, as a user runs it: status 2 and the one line, nothing else on stderr.
    proc = subprocess.run(
        [sys.executable, "-m", "router.cli", "cms", "--listen", taken],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: --listen {taken}: address already in use"), proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stdout == "", proc.stderr


# --------------------------------------------------------------------------- secret files


def _token_cases(tmp: Path) -> list[tuple[list[str], str, Path]]:
    missing = tmp / "tokens"
    garbled = tmp / "garbled"
    garbled.write_text("one two three\n", encoding="utf-8")
    empty = tmp / "empty"
    empty.write_text("# nothing\n", encoding="utf-8")
    short_key = tmp / "short.key"
    short_key.write_text("abc\n", encoding="utf-8")
    free = "127.0.0.1:0"
    return [
        (["cms", "--listen", free, "--auth-token-file", str(missing)], "--auth-token-file", missing),
        (["cms", "--listen", free, "--auth-token-file", str(garbled)], "--auth-token-file", garbled),
        (
            ["worker", "--listen", free, "--cms-auth-token-file", str(missing)],
            "--cms-auth-token-file",
            missing,
        ),
        (["worker", "--listen", free, "--cms-auth-token-file", str(empty)], "--cms-auth-token-file", empty),
        (["worker", "--listen", free, "--kv-key-file", str(missing)], "--kv-key-file", missing),
        (["worker", "--listen", free, "--kv-key-file", str(short_key)], "--kv-key-file", short_key),
        (
            ["router", "--listen", free, "--cms", "127.0.0.1:1", "--cms-auth-token-file", str(missing)],
            "--cms-auth-token-file",
            missing,
        ),
        (
            ["router", "--listen", free, "--cms-listen", free, "--cms-auth-token-file", str(garbled)],
            "--cms-auth-token-file",
            garbled,
        ),
        (
            ["worker", "--listen", free, "--worker-auth-token-file", str(missing)],
            "--worker-auth-token-file",
            missing,
        ),
        (
            ["router", "--listen", free, "--cms", "127.0.0.1:1", "--worker-auth-token-file", str(empty)],
            "--worker-auth-token-file",
            empty,
        ),
    ]


@pytest.mark.parametrize("case", range(10))
def test_a_bad_secret_file_is_one_line_naming_the_flag(
    case: int, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    argv, flag, path = _token_cases(tmp_path)[case]
    with caplog.at_level(logging.INFO):
        code = main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"error: {flag} {path}: "), err
    assert err.count("\n") == 1 and "Errno" not in err and "Traceback" not in err, err
    started = [
        r.getMessage()
        for r in caplog.records
        if "serving on" in r.getMessage() or "listening" in r.getMessage()
    ]
    assert started == [], started


def test_the_cms_flag_takes_the_same_forms_on_router_and_worker(
    taken: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # HOST:PORT and grpc://HOST:PORT both name a CMS on router and worker alike; the router's
    # bare-address form used to be refused ("expected memory, grpc://HOST:PORT or redis://...").
    from fleet.flags import cms_target

    assert cms_target("--cms", "127.0.0.1:7100") == cms_target("--cms", "grpc://127.0.0.1:7100")
    for command in ("router", "worker"):
        for form in ("127.0.0.1:7100", "grpc://127.0.0.1:7100"):
            # Only the listen address is wrong (taken): every check before it passed, --cms included.
            code = main([command, "--listen", taken, "--cms", form])
            err = capsys.readouterr().err
            assert code == 2 and err.startswith(f"error: --listen {taken}: address already in use"), err


# --------------------------------------------------------------------------- --help matches behaviour

COMMANDS = [
    "predict", "cms", "keys", "worker", "router", "up", "schedule", "calibrate",
    "bench", "simulate", "plan", "profile", "vllm-tiny-model",
]  # fmt: skip


@pytest.mark.parametrize("command", COMMANDS)
def test_help_is_for_a_terminal_and_not_about_this_checkout(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert str(ROOT) not in text  # a default shown as this machine's absolute path
    for markup in ("``", ":class:", ":mod:", ":func:", ":meth:"):
        assert markup not in text, (command, markup)


def test_help_lists_every_queue_policy_simulate_accepts(capsys: pytest.CaptureFixture[str]) -> None:
    from router.core.queue import QueuePolicy

    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    listed = text[text.index("--queue-policies Q1,Q2,... router") :][:400]
    for policy in QueuePolicy:
        assert policy.value in listed, policy


def test_the_router_and_up_default_to_the_same_policy(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("router", "up", "plan"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "(default: slo)" in text, command


def test_the_python_floor_is_the_one_the_code_needs() -> None:
    import tomllib  # 3.11: the floor below is true

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["requires-python"] == ">=3.11"


# --------------------------------------------------------------------------- fleet.flags, directly


@pytest.mark.parametrize(
    ("message", "argv", "expected"),
    [
        # Each shape the config objects and commands raise, restated with the value as typed.
        ("--ttft-slo=-100.0: must be > 0", ["router", "--ttft-slo", "-100"], "--ttft-slo -100: must be > 0"),
        ("--rate 0.0: must be > 0", ["bench", "--rate=0"], "--rate 0: must be > 0"),
        ("--lease-ttl-s must be > 0, got 0.0", ["cms", "--lease-ttl-s", "0"], "--lease-ttl-s 0: must be > 0"),
        ("--cms 'x': expected HOST:PORT", ["router", "--cms", "x"], "--cms x: expected HOST:PORT"),
        ("--tokens: bad, got '5,5'", ["profile", "--tokens", "5,5"], "--tokens 5,5: bad"),
        # argparse's prefixes: the flag as the user typed it.
        ("--attainment 150.0: out of range", ["plan", "--att", "150"], "--att 150: out of range"),
        # A value the command line does not hold keeps its own (not some other use of the flag).
        ("--profile-group a=x: bad", ["router", "--profile-group", "b=y"], "--profile-group a=x: bad"),
        # A repeated flag: the use the message is about.
        (
            "--profile-group a=x: bad",
            ["r", "--profile-group", "a=x", "--profile-group", "b=y"],
            "--profile-group a=x: bad",
        ),
        # A switch has no value; a message naming no flag passes through.
        ("--insecure: not with TLS", ["cms", "--insecure", "--listen", "x"], "--insecure: not with TLS"),
        (
            "need --neutral K, or a --prefill and a --decode",
            ["up"],
            "need --neutral K, or a --prefill and a --decode",
        ),
    ],
)
def test_restate_gives_one_shape(message: str, argv: list[str], expected: str) -> None:
    from fleet.flags import restate

    assert restate(message, argv) == expected


def test_check_listen_binds_only_what_it_must(taken: str) -> None:
    from fleet.flags import check_listen, check_metrics_port

    check_listen("--listen", "127.0.0.1:0")  # the kernel picks: always free
    check_listen("--listen", _free_address())
    with pytest.raises(ValueError, match=rf"^--listen {taken}: address already in use"):
        check_listen("--listen", taken)
    with pytest.raises(ValueError, match=r"^--listen 127\.0\.0\.1: expected HOST:PORT"):
        check_listen("--listen", "127.0.0.1")
    port = int(taken.rpartition(":")[2])
    check_metrics_port("--metrics-port", 0, "127.0.0.1")  # off
    with pytest.raises(
        ValueError, match=rf"^--metrics-port {port}: address already in use \(on 127\.0\.0\.1\)"
    ):
        check_metrics_port("--metrics-port", port, "127.0.0.1")
