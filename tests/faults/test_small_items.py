"""The smaller items: a dead --processes child is started again, a killed up's secrets directory is
removed by the next up, and refusals show in the metrics."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.faults.fleet import Fleet
from tests.faults.up_cluster import small_request, up_cluster, wait_serving


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
    first = tmp_path / "first"
    first.mkdir()
    with up_cluster(first) as cluster:
        secrets = cluster.read_token_file.parent
        assert secrets.parent == tmp and secrets.is_dir()
        cluster.popen.kill()  # kill -9: no cleanup
        cluster.popen.wait(10)
    assert secrets.is_dir()
    second = tmp_path / "second"
    second.mkdir()
    with up_cluster(second) as cluster:
        assert not secrets.exists(), "the dead up's secrets directory is still there"
        assert cluster.read_token_file.parent.is_dir()
        wait_serving(cluster.router)


def test_refusals_are_counted_in_the_metrics(tmp_path: Path) -> None:
    import grpc
    from slorouter.v1 import router_pb2_grpc

    with up_cluster(tmp_path, "--http-max-headers", "10") as cluster:
        wait_serving(cluster.router)
        with grpc.insecure_channel(cluster.router) as channel, pytest.raises(grpc.RpcError):
            for _ in router_pb2_grpc.RouterStub(channel).Generate(
                small_request("nope", tpot_ms=1.0), timeout=10
            ):
                pass
        headers = {f"x-h{i}": "1" for i in range(20)}
        req = urllib.request.Request(f"http://{cluster.http}/v1/models", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=5)
        assert info.value.code == 431
        assert "error" in json.loads(info.value.read())
        with urllib.request.urlopen(f"http://{cluster.http}/metrics", timeout=5) as response:
            text = response.read().decode()
        assert re.search(r'slo_router_requests_total\{outcome="unmeetable"\} 1\.0', text), text[:3000]
        assert re.search(r'slo_router_http_refused_connections_total\{reason="too_many_headers"\} 1\.0', text)


def test_a_burst_of_4000_calls_is_answered_by_the_router_not_cancelled_by_grpc_core(tmp_path: Path) -> None:
    import asyncio
    from collections import Counter

    import grpc
    from slorouter.v1 import router_pb2_grpc

    with up_cluster(tmp_path) as cluster:
        wait_serving(cluster.router)

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
        assert codes["CANCELLED"] == 0, codes
        with urllib.request.urlopen(f"http://{cluster.http}/metrics", timeout=5) as response:
            text = response.read().decode()
        counted = sum(
            float(m.group(2))
            for m in re.finditer(r'slo_router_requests_total\{outcome="([a-z_]+)"\} ([0-9.e+]+)', text)
            if m.group(1) != "ok"
        )
        assert counted == sum(n for code, n in codes.items() if code != "OK"), (codes, counted)
