"""Children started through ``router.lifetime`` end with their parent, and no code runs before exec."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from router.lifetime import PARENT_PID_ENV, child_env

REPO = Path(__file__).resolve().parents[2]
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

#: A child that asks to die with its parent, says so, reports whether the request left its
#: environment, then sleeps (bounded) until a signal ends it.
_CHILD = textwrap.dedent(
    f"""
    import os, sys, time
    from router.lifetime import die_with_parent_if_asked
    die_with_parent_if_asked()
    print("ready", os.getpid(), {PARENT_PID_ENV!r} in os.environ, flush=True)
    time.sleep(60)
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:  # a zombie has ended: state Z
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), **extra}


def test_child_env_names_this_process_and_keeps_the_rest() -> None:
    env = child_env({"A": "1"})
    assert env == {"A": "1", PARENT_PID_ENV: str(os.getpid())}


def test_a_process_started_by_hand_is_left_alone() -> None:
    env = _env()
    env.pop(PARENT_PID_ENV, None)
    child = subprocess.Popen([sys.executable, "-c", _CHILD], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().split()[0] == "ready"
        assert child.poll() is None
    finally:
        child.kill()
        child.wait(timeout=10)
        if child.stdout is not None:
            child.stdout.close()


@linux_only
def test_a_child_whose_parent_went_before_it_asked_ends_at_once() -> None:
    # It names a parent it does not have (as when the parent died between fork and the request).
    env = _env(**{PARENT_PID_ENV: str(os.getppid())})
    child = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=60
    )
    assert child.returncode == -signal.SIGTERM, child.stderr
    assert "ready" not in child.stdout


@linux_only
def test_a_child_ends_when_its_parent_is_killed_and_its_own_children_are_not_told_to() -> None:
    # parent: starts the child through child_env, prints the child's line, then waits to be killed.
    parent_code = textwrap.dedent(
        f"""
        import subprocess, sys, time
        from router.lifetime import child_env
        child = subprocess.Popen([sys.executable, "-c", {_CHILD!r}], env=child_env(), stdout=subprocess.PIPE, text=True)
        print(child.stdout.readline().strip(), flush=True)
        time.sleep(60)
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code], env=_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        word, pid, inherited = parent.stdout.readline().split()
        assert word == "ready"
        assert inherited == "False"  # the request left the child's environment
        child_pid = int(pid)
        assert _alive(child_pid)
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 20
        while _alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child_pid)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=10)
        if parent.stdout is not None:
            parent.stdout.close()


def test_the_entry_point_turns_grpcs_fork_handlers_off_unless_the_user_set_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from router.cli import grpc_environment

    monkeypatch.delenv("GRPC_ENABLE_FORK_SUPPORT", raising=False)
    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    grpc_environment()
    assert os.environ["GRPC_ENABLE_FORK_SUPPORT"] == "0"
    assert os.environ["GRPC_VERBOSITY"] == "ERROR"
    monkeypatch.setenv("GRPC_ENABLE_FORK_SUPPORT", "1")
    grpc_environment()
    assert os.environ["GRPC_ENABLE_FORK_SUPPORT"] == "1"
