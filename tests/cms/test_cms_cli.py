"""``slo-router cms``: help, argument errors, and a real process serving, refusing and shutting down."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from slorouter.v1 import cms_pb2, cms_pb2_grpc

from cms.redis_store import RedisStore
from cms.testing import RedisServer
from router.cli import main
from tests.cms.helpers import make_metadata, make_status

ROOT = Path(__file__).resolve().parents[2]


def test_help_explains_the_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["cms", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for option in (
        "--listen",
        "--store",
        "--lease-ttl-s",
        "--auth-token-file",
        "--auth-token",
        "--cluster-name",
    ):
        assert option in out
    assert "127.0.0.1:7100" in out and "redis://" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["cms", "--store", "postgres://x"], "memory"),
        (["cms", "--lease-ttl-s", "0"], "--lease-ttl-s"),
        (["cms", "--auth-token", " "], "--auth-token"),
        (["cms", "--store", "redis://127.0.0.1:1/0", "--cluster-name", "a b"], "cluster_name"),
    ],
)
def test_bad_arguments_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_token_options_are_exclusive(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t\n")
    with pytest.raises(SystemExit) as info:
        main(["cms", "--auth-token", "t", "--auth-token-file", str(token)])
    assert info.value.code == 2


def _start(args: list[str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "router.cli",
            "--log-level",
            "WARNING",
            "cms",
            "--listen",
            "127.0.0.1:0",
            *args,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    with selectors.DefaultSelector() as selector:  # wait for the first line, boundedly
        selector.register(proc.stdout, selectors.EVENT_READ)
        ready = selector.select(timeout=30)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith("cms listening on "):
        proc.kill()
        _, err = proc.communicate(timeout=10)
        raise AssertionError(f"the CMS did not start: {line!r} {err}")
    return proc, line.split()[3]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_process_serves_enforces_token_and_stops_cleanly(
    redis_server: RedisServer, tmp_path: Path, sig: signal.Signals
) -> None:
    token = tmp_path / "token"
    token.write_text("  tok  \n")
    proc, address = _start(["--store", redis_server, "--auth-token-file", str(token), "--lease-ttl-s", "2"])
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = cms_pb2_grpc.ClusterMetadataStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.RegisterInstance(
                    cms_pb2.RegisterInstanceRequest(metadata=make_metadata("p0")), timeout=5
                )
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            auth = (("authorization", "Bearer tok"),)
            response = await stub.RegisterInstance(
                cms_pb2.RegisterInstanceRequest(metadata=make_metadata("p0")), metadata=auth, timeout=5
            )
            assert response.lease_ttl_ms == 2000
            await stub.ReportStatus(
                cms_pb2.ReportStatusRequest(status=make_status("p0", 1)), metadata=auth, timeout=5
            )
            view = await stub.GetClusterView(cms_pb2.GetClusterViewRequest(), metadata=auth, timeout=5)
            assert [s.metadata.instance_id for s in view.instances] == ["p0"]
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=15)
        assert proc.returncode == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    # The registration outlives the process: it is in Redis.
    store = RedisStore(redis_server)
    try:
        view = await store.read_view()
        assert [r.instance_id for r in view.instances] == ["p0"]
    finally:
        await store.close()


def test_busy_port_is_an_error() -> None:
    proc, address = _start([])
    try:
        second = subprocess.run(
            [sys.executable, "-m", "router.cli", "cms", "--listen", address],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert second.returncode == 2
        assert second.stderr == (
            f"error: --listen {address}: address already in use; another process listens there "
            "(pick another port or stop it)\n"
        )
    finally:
        proc.terminate()
        proc.communicate(timeout=15)
