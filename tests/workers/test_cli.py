"""`slo-router worker` / `slo-router profile` and the backend registry."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from router.cli import build_parser, main
from workers.backends import BACKENDS, BackendError, BackendRegistry, BackendSpec, default_registry
from workers.cli import _engine_choice
from workers.sim_engine import SimEngine

from .helpers import Client, prompt


def test_registry_loads_backends_by_name_and_refuses_duplicates() -> None:
    assert BACKENDS.names() == ("sim", "vllm")
    backend = BACKENDS.load("sim")
    assert callable(backend.add_arguments) and callable(backend.build_engine)
    registry = default_registry()
    with pytest.raises(ValueError, match="already registered"):
        registry.register(BackendSpec("sim", "workers.sim_engine", "again"))
    with pytest.raises(BackendError, match="unknown engine 'nope'"):
        registry.load("nope")
    broken = BackendRegistry()
    broken.register(BackendSpec("ghost", "workers.no_such_module", "missing", install_hint="install ghost"))
    with pytest.raises(BackendError, match="install ghost"):
        broken.load("ghost")
    lacking = BackendRegistry()
    lacking.register(BackendSpec("tok", "engine.tokenizer", "not a backend"))
    with pytest.raises(BackendError, match="lacks add_arguments, build_engine"):
        lacking.load("tok")


def test_engine_choice_is_read_before_parsing() -> None:
    assert _engine_choice(["--role", "decode"], "sim") == "sim"
    assert _engine_choice(["--engine", "vllm", "--model", "m"], "sim") == "vllm"
    assert _engine_choice(["--engine=vllm"], "sim") == "vllm"
    assert _engine_choice(["--", "--engine", "vllm"], "sim") == "sim"


def test_worker_flags_build_a_sim_engine() -> None:
    args = build_parser().parse_args(
        [
            "worker",
            "--role",
            "prefill",
            "--speed-factor",
            "3",
            "--max-num-batched-tokens",
            "512",
            "--max-num-seqs",
            "64",
            "--kv-capacity-tokens",
            "8192",
            "--max-model-len",
            "4096",
            "--model",
            "m7",
        ]
    )
    assert args.engine == "sim" and args.role == "prefill"
    engine = BACKENDS.load(args.engine).build_engine(args)
    assert isinstance(engine, SimEngine)
    assert engine.config.speed_factor == 3.0 and engine.info.max_num_batched_tokens == 512
    assert engine.info.model == "m7"


def test_bad_engine_and_bad_flags_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--engine", "nope"])
    assert "invalid choice 'nope'" in capsys.readouterr().err
    args = build_parser().parse_args(["worker", "--block-size", "0"])
    assert args.func(args) == 2
    assert "error: --block-size 0: must be an integer > 0" in capsys.readouterr().err
    args = build_parser().parse_args(["worker", "--stream-interval-ms", "2000"])
    assert args.func(args) == 2
    assert "--stream-interval-ms 2000.0: must be" in capsys.readouterr().err


async def test_worker_command_serves_and_shuts_down_on_sigterm(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "router.cli",
        "worker",
        "--speed-factor",
        "50",
        "--listen",
        "127.0.0.1:0",
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        assert line.startswith("worker listening on 127.0.0.1:"), line
        address = line.split()[-1]
        async with Client(address) as client:
            result = await client.generate("cli", prompt(16), 5)
        assert len(result.tokens) == 5
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_profile_command_writes_both_files(tmp_path: Path) -> None:
    from workers.service import start_worker_server

    from .helpers import make_engine

    # At the profile's own speed the prompt-length signal (64 vs 1024 tokens: about 140 ms)
    # stays well above the timing noise of a loaded machine (at 5x it was 28 ms, and a fresh
    # clone at load 40 fitted a negative slope), and two repeats take the median of each point.
    server = await start_worker_server(make_engine(speed_factor=1.0))
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "router.cli",
            "profile",
            "--target",
            server.address,
            "--out",
            str(tmp_path),
            "--tokens",
            "64,1024",
            "--batch-sizes",
            "1,2",
            "--tokens-per-request",
            "32,64",
            "--repeats",
            "2",
            "--decode-tokens",
            "4",
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        await server.stop(0)
    assert proc.returncode == 0, err.decode()
    # stderr is a pipe, not a terminal: one short line per point, no carriage returns.
    assert b"profiling 1/13: warm-up\n" in err and b"\r" not in err and b"wrote" in out
    assert (tmp_path / "ttft.json").exists() and (tmp_path / "tpot.json").exists()
    # The seed model's coefficients are fitted and written beside the grids.
    coefficients = json.loads((tmp_path / "coefficients.json").read_text(encoding="utf-8"))
    assert set(coefficients) == {"model", "prefill", "decode"}
    assert all(math.isfinite(v) for part in ("prefill", "decode") for v in coefficients[part].values())
    assert coefficients["prefill"]["a_ms_per_token"] > 0  # longer prompts take longer


def test_vllm_tiny_model_refuses_a_file_as_its_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "a-file"
    target.write_text("x", encoding="utf-8")
    assert main(["vllm-tiny-model", str(target)]) == 2
    assert "DIR" in capsys.readouterr().err


@pytest.mark.vllm
def test_vllm_tiny_model_writes_a_model_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.workers.vllm_support import require_vllm_env

    require_vllm_env()
    out = tmp_path / "tiny"
    assert main(["vllm-tiny-model", str(out)]) == 0  # from the main environment: built in .venv-vllm
    assert f"wrote a tiny random-weight model into {out}" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert config["num_hidden_layers"] == 2 and config["vocab_size"] == 1000
    assert (out / "model.safetensors").stat().st_size > 0 and (out / "tokenizer.json").exists()


async def test_profile_sends_the_worker_token_a_secured_worker_requires(tmp_path: Path) -> None:
    # A worker started with --worker-auth-token-file (as `slo-router keys` sets fleets up) refuses
    # Generate without the token: profile must send it, and says why when it is missing.
    from workers.service import start_worker_server

    from .helpers import make_engine

    token_file = tmp_path / "worker-call.token"
    token_file.write_text("s3cret-token\n", encoding="utf-8")
    server = await start_worker_server(make_engine(speed_factor=20.0), worker_token="s3cret-token")
    small = ["--tokens", "64", "--batch-sizes", "1", "--tokens-per-request", "32", "--repeats", "1"]
    try:

        async def profile(*extra: str) -> tuple[int, str]:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "router.cli", "profile", "--target", server.address,
                "--out", str(tmp_path / "out"), *small, "--decode-tokens", "4", *extra,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )  # fmt: skip
            _, err = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode is not None
            return proc.returncode, err.decode()

        code, err = await profile()
        assert code == 1 and "UNAUTHENTICATED" in err, err
        code, err = await profile("--worker-auth-token-file", str(token_file))
        assert code == 0, err
    finally:
        await server.stop(0)
    assert (tmp_path / "out" / "ttft.json").exists()
