"""The operator guide's vLLM path works as written: tiny model, keys, CMS, vLLM worker, profile, router, one request.

The block between ``<!-- vllm-path:begin -->`` and ``<!-- vllm-path:end -->`` of
``docs/operator-guide.md`` runs command by command in an empty directory, as a
user would paste it: servers in the background, the next command once the
previous server printed its "listening" line. Only the ports (free ones) and
the model's directory (under the test's temporary directory) change.

The worker's temporary directory is the test's own, so the test also sees
that vLLM's ``ipc://`` socket files do not outlive the worker (they were left
in the temporary directory, about seven per start).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from workers.vllm_process import REPO, VLLM_PYTHON

from .vllm_support import require_vllm_env

pytestmark = pytest.mark.vllm

GUIDE = REPO / "docs" / "operator-guide.md"
BEGIN, END = "<!-- vllm-path:begin -->", "<!-- vllm-path:end -->"


def guide_commands() -> list[tuple[str, bool]]:
    """The block's commands: (command, runs in the background), continuation lines joined."""
    text = GUIDE.read_text(encoding="utf-8")
    block = text[text.index(BEGIN) + len(BEGIN) : text.index(END)].split("```")[1]
    commands: list[tuple[str, bool]] = []
    current = ""
    for line in block.strip("\n").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        current += line.removesuffix("\\").strip() + " "
        if not line.endswith("\\"):
            command = current.strip()
            commands.append((command.removesuffix("&").strip(), command.endswith("&")))
            current = ""
    return commands


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for(log: Path, text: str, proc: subprocess.Popen[bytes], limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while text not in log.read_text(encoding="utf-8", errors="replace"):
        assert proc.poll() is None, f"exited before printing {text!r}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {text!r} within {limit_s:g} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def test_the_block_has_every_piece_and_flag() -> None:
    commands = " ".join(c for c, _ in guide_commands())
    for needed in (
        "vllm-tiny-model",
        "slo-router keys vsecrets --workers v0",
        "--enforce-eager",
        "--cms-auth-token-file vsecrets/v0.token",
        "--worker-auth-token-file vsecrets/worker-call.token",
        "slo-router profile",
        "--profile tiny-profile",
        "curl",
    ):
        assert needed in commands, needed


@pytest.mark.timeout(900)
def test_the_operator_guide_vllm_path_works_as_written(tmp_path: Path) -> None:
    require_vllm_env()
    ports = {p: str(_free_port()) for p in ("7100", "7301", "50051", "8000")}
    model = tmp_path / "tiny-model"
    # The worker's own temporary directory, short: vLLM's socket paths must fit in 107 bytes.
    worker_tmp = Path(tempfile.mkdtemp(prefix="vg-", dir="/tmp"))
    if shutil.which("curl") is None:
        pytest.skip("the guide's request is a curl command, and curl is not installed")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    procs: list[tuple[subprocess.Popen[bytes], Path]] = []
    outputs: list[str] = []
    try:
        for n, (command, background) in enumerate(guide_commands()):
            command = re.sub(r"127\.0\.0\.1:(\d+)", lambda m: f"127.0.0.1:{ports[m.group(1)]}", command)
            command = command.replace("/tmp/tiny-model", str(model))
            words = shlex.split(command)
            if words[0] == ".venv-vllm/bin/slo-router":
                words = [str(VLLM_PYTHON), "-m", "router.cli", *words[1:]]
            elif words[0] == "slo-router":
                words = [sys.executable, "-m", "router.cli", *words[1:]]
            log = tmp_path / f"step{n}.log"
            if background:
                child_env = {**env, "TMPDIR": str(worker_tmp)} if "--engine" in words else env
                with log.open("wb") as out:
                    proc = subprocess.Popen(
                        words, cwd=tmp_path, env=child_env, stdout=out, stderr=subprocess.STDOUT,
                        process_group=0,
                    )  # fmt: skip
                procs.append((proc, log))
                ready = {"cms": "cms listening on", "worker": "worker listening on", "router": "HTTP API on"}
                _wait_for(log, ready[words[3]], proc, 600.0 if "--engine" in words else 120.0)
            else:
                done = subprocess.run(
                    words, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
                )
                assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
                outputs.append(done.stdout)
        answer = json.loads(outputs[-1])  # the curl's
        assert answer["object"] == "text_completion" and answer["choices"][0]["finish_reason"] in (
            "stop",
            "length",
        )
        assert answer["usage"]["completion_tokens"] >= 1 and answer["usage"]["late"] is False
    finally:
        for proc, _ in reversed(procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc, _ in reversed(procs):
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    # vLLM's socket files went with the worker (they went into its temporary directory before).
    left = [p for p in worker_tmp.rglob("*") if p.is_socket()]
    shutil.rmtree(worker_tmp, ignore_errors=True)
    assert left == [], left
