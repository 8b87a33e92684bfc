"""A burst through `slo-router up --prefill 2 --decode 2` (real processes): the router queue serves all of it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.router.e2e.test_up_subprocess import CLIENT, _generate_stubs
from tests.router.e2e.up_process import reap, start_up, wait_for_line

BURST = 120
PROMPT_TOKENS = (
    1000  # 120 x 1000 tokens on two prefill instances: ~10 s of predicted TTFT, over the 6 s default
)


def _burst(gen: Path, *flags: str) -> dict[str, object]:
    up = start_up("--prefill", "2", "--decode", "2", *flags)
    try:
        address = wait_for_line(up, "router listening on ")
        client = subprocess.run(
            [sys.executable, str(CLIENT), str(gen), address, str(BURST), str(BURST), str(PROMPT_TOKENS)],
            capture_output=True, text=True, timeout=180, check=False,
        )  # fmt: skip
        assert client.returncode == 0, client.stderr
        summary: dict[str, object] = json.loads(client.stdout.strip().splitlines()[-1])
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=30) == 0
        return summary
    finally:
        reap(up)


@pytest.mark.timeout(400)
def test_a_burst_of_120_completes_with_the_default_queue_and_not_without_it(tmp_path: Path) -> None:
    _generate_stubs(tmp_path / "gen")
    # Default flags (the edf router queue): every stream completes with exactly max_tokens tokens.
    summary = _burst(tmp_path / "gen")
    assert summary["total"] == BURST
    assert summary["ok"] == BURST, summary["problems"]
    # The same burst with instant refusal (--queue-policy none) loses part of it at once.
    summary = _burst(tmp_path / "gen", "--queue-policy", "none")
    assert summary["total"] == BURST
    assert isinstance(summary["ok"], int) and summary["ok"] < BURST
    assert summary["codes"] == ["RESOURCE_EXHAUSTED"]
