"""`slo-router up` as a user runs it: a subprocess, driven by a client built from the .proto files only."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.router.e2e.up_process import REPO, reap, start_up, wait_for_line

CLIENT = Path(__file__).with_name("proto_only_client.py")


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            found.add(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _generate_stubs(out: Path) -> None:
    out.mkdir(parents=True)
    protos = sorted((REPO / "proto" / "slorouter" / "v1").glob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{REPO / 'proto'}", f"--python_out={out}",
         f"--grpc_python_out={out}", *map(str, protos)],
        check=True,
    )  # fmt: skip
    for package in (out / "slorouter", out / "slorouter" / "v1"):
        (package / "__init__.py").touch()


@pytest.mark.timeout(240)
def test_up_serves_hundreds_of_streams_and_leaves_nothing_running(tmp_path: Path) -> None:
    _generate_stubs(tmp_path / "gen")
    up = start_up("--prefill", "2", "--decode", "2", "--speed-factor", "20")
    try:
        address = wait_for_line(up, "router listening on ")
        children = _children(up.pid)
        assert len(children) == 4, children

        client = subprocess.run(
            [sys.executable, str(CLIENT), str(tmp_path / "gen"), address, "300", "32"],
            capture_output=True, text=True, timeout=180, check=False,
        )  # fmt: skip
        assert client.returncode == 0, client.stderr
        summary = json.loads(client.stdout.strip().splitlines()[-1])
        assert summary["total"] == 300
        assert summary["ok"] == 300, summary["problems"]

        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=30) == 0
    finally:
        reap(up)
    for pid in children:
        assert not _alive(pid), f"worker process {pid} outlived slo-router up"
    host, port = address.rsplit(":", 1)
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, int(port)))  # the router's port was released
