"""The smaller items: a dead --processes child is started again, a killed up's secrets directory is
removed by the next up, and refusals show in the metrics."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import grpc
import pytest
from slorouter.v1 import router_pb2_grpc

from tests.faults.fleet import Fleet
from tests.faults.up_cluster import UpCluster, small_request, up_cluster


def test_a_dead_processes_child_is_started_again(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    try:
        cms = fleet.cms()
        worker = fleet.worker("neutral-0", "neutral", cms.address)
        fleet.wait_listening(worker)
        router = fleet.router(f"grpc://{cms.address}", "--processes", "2")
        out = tmp_path / "router.out"
        deadline = time.monotonic() + 60
        pid = 0
        while time.monotonic() < deadline and not pid:
            found = re.search(r"router process 1 \(pid (\d+)\)", out.read_text())
            pid = int(found.group(1)) if found else 0
            time.sleep(0.1)
        assert pid, out.read_text()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        restarted = None
        while time.monotonic() < deadline and restarted is None:
            restarted = re.search(r"router process 1 started again \(pid (\d+)\)", router.log.read_text())
            time.sleep(0.1)
        assert restarted is not None, router.tail()
        new_pid = int(restarted.group(1))
        assert new_pid != pid
        os.kill(new_pid, 0)  # alive
        assert router.popen.poll() is None
    finally:
        fleet.close()


def test_up_removes_the_secrets_directory_a_killed_up_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    # What a kill -9 of up leaves: its directory, naming an owner that is gone.
    dead = subprocess.Popen(["true"])
    dead.wait(10)
    stale = tmp / "slo-router-up-stale"
    stale.mkdir(mode=0o700)
    (stale / "owner.pid").write_text(f"{dead.pid}\n")
    (stale / "kv.key").write_text("secret\n")
    # A directory whose owner lives is left alone.
    alive = tmp / "slo-router-up-alive"
    alive.mkdir(mode=0o700)
    (alive / "owner.pid").write_text(f"{os.getpid()}\n")
    with up_cluster(tmp_path) as cluster:
        assert not stale.exists(), "the dead up's secrets directory is still there"
        assert alive.is_dir()
        mine = cluster.read_token_file.parent
        assert mine.parent == tmp and (mine / "owner.pid").read_text().strip() == str(cluster.popen.pid)
    assert not mine.exists() or cluster.popen.returncode != 0


def _metric(http: str, pattern: str) -> float:
    with urllib.request.urlopen(f"http://{http}/metrics", timeout=5) as response:
        found = re.search(pattern + r" ([0-9.e+]+)", response.read().decode())
    return float(found.group(1)) if found else 0.0


_UNMEETABLE = r'slo_router_requests_total\{outcome="unmeetable"\}'
_TOO_MANY_HEADERS = r'slo_router_http_refused_connections_total\{reason="too_many_headers"\}'


def test_refusals_are_counted_in_the_metrics(shared_up: UpCluster) -> None:
    cluster = shared_up
    before = (_metric(cluster.http, _UNMEETABLE), _metric(cluster.http, _TOO_MANY_HEADERS))
    with grpc.insecure_channel(cluster.router) as channel, pytest.raises(grpc.RpcError):
        for _ in router_pb2_grpc.RouterStub(channel).Generate(small_request("nope", tpot_ms=1.0), timeout=10):
            pass
    headers = {f"x-h{i}": "1" for i in range(120)}  # more than --http-max-headers (100)
    req = urllib.request.Request(f"http://{cluster.http}/v1/models", headers=headers)
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=5)
    assert info.value.code == 431
    assert "error" in json.loads(info.value.read())
    after = (_metric(cluster.http, _UNMEETABLE), _metric(cluster.http, _TOO_MANY_HEADERS))
    assert after[0] == before[0] + 1 and after[1] == before[1] + 1, (before, after)


def test_a_burst_of_4000_calls_is_answered_by_the_router_not_cancelled_by_grpc_core(
    shared_up: UpCluster,
) -> None:
    cluster = shared_up

    async def burst() -> Counter[str]:
        codes: Counter[str] = Counter()
        async with grpc.aio.insecure_channel(cluster.router) as channel:
            stub = router_pb2_grpc.RouterStub(channel)

            async def one(i: int) -> None:
                try:
                    async for _ in stub.Generate(small_request(f"burst-{i}"), timeout=60):
                        pass
                    codes["OK"] += 1
                except grpc.aio.AioRpcError as exc:
                    codes[exc.code().name] += 1

            await asyncio.gather(*(one(i) for i in range(4000)))
        return codes

    codes = asyncio.run(burst())
    print(f"4,000 simultaneous calls: {dict(codes)}")
    assert codes["CANCELLED"] == 0, codes
    # Whatever the router refused, it said why (a router code, never a bare one from gRPC core).
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED", "UNAVAILABLE"}, codes
