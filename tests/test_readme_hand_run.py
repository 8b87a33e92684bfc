"""The README's "pieces by hand" block works as written: keys, a CMS, two workers, a router, a bench.

The block between ``<!-- hand-run:begin -->`` and ``<!-- hand-run:end -->`` is
run by bash, line for line, in an empty directory (so ``secrets/`` is made
there), with the ``slo-router`` of this environment first on ``PATH``. Only
the port numbers change: each fixed port of the block is mapped to a free one,
so the test does not depend on 7100, 50051 or 8000 being free on the machine.
The pieces authenticate with the secrets ``slo-router keys`` wrote; a
missing or wrong token would make the CMS refuse the workers and the bench
report errors.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BEGIN, END = "<!-- hand-run:begin -->", "<!-- hand-run:end -->"


def hand_run_block() -> str:
    text = README.read_text(encoding="utf-8")
    block = text[text.index(BEGIN) + len(BEGIN) : text.index(END)]
    fence = block.split("```")
    assert len(fence) == 3, "the hand-run block is one fenced code block"
    return fence[1].strip("\n")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def with_free_ports(script: str) -> str:
    ports = sorted(
        set(re.findall(r"127\.0\.0\.1:(\d+)", script)) | set(re.findall(r"--metrics-port (\d+)", script))
    )
    mapping = {port: str(free_port()) for port in ports}
    script = re.sub(r"127\.0\.0\.1:(\d+)", lambda m: f"127.0.0.1:{mapping[m.group(1)]}", script)
    return re.sub(r"--metrics-port (\d+)", lambda m: f"--metrics-port {mapping[m.group(1)]}", script)


def test_the_block_uses_keys_and_every_secret_it_writes() -> None:
    block = hand_run_block()
    assert block.splitlines()[0].startswith("slo-router keys secrets --workers p0,d0")
    for needed in (
        "--auth-token-file secrets/cms.tokens",
        "--cms-auth-token-file secrets/p0.token",
        "--cms-auth-token-file secrets/d0.token",
        "--cms-auth-token-file secrets/router.token",
        "--kv-key-file secrets/kv.key",
        "--worker-auth-token-file secrets/worker-call.token",
    ):
        assert needed in block


@pytest.mark.timeout(150)
def test_the_readme_hand_run_block_works_as_written(tmp_path: Path) -> None:
    script = with_free_ports(hand_run_block())
    # As a user pastes it: the servers in the background, the bench in front; then stop them.
    wrapper = f"set -m\n{script}\nrc=$?\nkill $(jobs -p) 2>/dev/null\nwait\nexit $rc\n"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.Popen(
        ["bash", "-c", wrapper],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out
    summary = re.search(r"(\d+) requests in [\d.]+ s, (\d+) completed, (\d+) errors", out)
    assert summary is not None, out
    sent, completed, errors = map(int, summary.groups())
    assert sent > 0 and completed == sent and errors == 0, out
    # The secrets are owner-only, as `keys` promised.
    secrets = tmp_path / "secrets"
    assert secrets.stat().st_mode & 0o777 == 0o700
    assert sorted(p.name for p in secrets.iterdir()) == [
        "cms.tokens",
        "d0.token",
        "kv.key",
        "p0.token",
        "router.token",
        "worker-call.token",
    ]
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in secrets.iterdir())
    assert (
        "registered with the CMS" in out and "PERMISSION_DENIED" not in out and "UNAUTHENTICATED" not in out
    )
