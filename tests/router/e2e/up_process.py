"""`slo-router up` as a child process for end-to-end tests: loopback ports only, bounded waits."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def start_up(*args: str) -> subprocess.Popen[str]:
    """``python -m router.cli up`` with the gRPC and HTTP listeners on port 0 (``args`` may override).

    Output (stdout and stderr) is a text pipe: read it with :func:`wait_for_line`.
    """
    return subprocess.Popen(
        [sys.executable, "-m", "router.cli", "up",
         "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
    )  # fmt: skip


def wait_for_line(up: subprocess.Popen[str], prefix: str, timeout_s: float = 90.0) -> str:
    """The last word of the first output line starting with ``prefix`` (an address or URL).

    Fails with everything ``up`` printed when it exits first or no such line comes in time.
    """
    assert up.stdout is not None
    output: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = up.stdout.readline()
        if not line:
            break
        output.append(line)
        if line.startswith(prefix):
            return line.split()[-1]
    raise AssertionError(f"slo-router up printed no {prefix!r} line:\n" + "".join(output))


def reap(up: subprocess.Popen[str]) -> None:
    """Kill ``up`` if it still runs and close its pipe (for ``finally`` blocks)."""
    if up.poll() is None:
        up.kill()
        up.wait()
    if up.stdout is not None:
        up.stdout.close()
