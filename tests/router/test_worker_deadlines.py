"""Worker calls have connect and first-message deadlines, and their failures feed the outlier detector.

A real gRPC Worker server on loopback whose handlers hold every call without
answering (a hung worker), and a listening socket nobody serves (an endpoint
that accepts and never answers).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from slorouter.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from router.core.health import OutlierConfig, OutlierDetector
from router.forward import LegError, WorkerClient
from router.legs import LegLedger
from router.pool import ChannelPool
from router.server import add_arguments, start_from_args


@dataclass(frozen=True)
class _Target:
    instance_id: str
    endpoint: str


class HungWorker(worker_pb2_grpc.WorkerServicer):
    """Accepts every call and never answers until released."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.calls = 0

    async def Prefill(self, request: Any, context: Any) -> worker_pb2.PrefillResponse:
        self.calls += 1
        await self.release.wait()
        return worker_pb2.PrefillResponse(first_token_id=1)

    async def Decode(self, request: Any, context: Any) -> AsyncIterator[worker_pb2.WorkerTokens]:
        self.calls += 1
        await self.release.wait()
        yield worker_pb2.WorkerTokens(token_ids=[1], finished=True)


async def test_a_hung_worker_costs_one_first_message_deadline_and_is_ejected() -> None:
    servicer = HungWorker()
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    pool = ChannelPool()
    health = OutlierDetector(OutlierConfig(base_ejection_s=30.0))
    client = WorkerClient(pool, first_message_timeout_s=0.3, health=health)
    target = _Target("w", f"127.0.0.1:{port}")
    try:
        with pytest.raises(LegError) as info:
            await client.prefill(
                target, "r1", (1, 2), common_pb2.SamplingParams(max_tokens=2), 60.0, LegLedger()
            )
        assert info.value.code is grpc.StatusCode.DEADLINE_EXCEEDED and info.value.retryable
        assert "--worker-first-message-timeout-s" in info.value.details
        assert health.is_ejected("w", asyncio.get_running_loop().time())

        stream = client.stream(target, worker_pb2.DecodeRequest(request_id="r2"), 60.0, LegLedger())
        with pytest.raises(LegError) as info:
            async for _ in stream:
                pass
        assert info.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
        assert servicer.calls == 2
    finally:
        servicer.release.set()
        await pool.close()
        await server.stop(0)


async def test_an_endpoint_that_never_answers_costs_one_connect_deadline() -> None:
    hole = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)
    pool = ChannelPool()
    health = OutlierDetector()
    client = WorkerClient(pool, connect_timeout_s=0.3, health=health)
    try:
        with pytest.raises(LegError) as info:
            await client.prefill(
                _Target("hole", f"127.0.0.1:{hole.getsockname()[1]}"),
                "r1",
                (1, 2),
                common_pb2.SamplingParams(max_tokens=2),
                60.0,
                LegLedger(),
            )
        assert info.value.code is grpc.StatusCode.UNAVAILABLE and info.value.retryable
        assert "--worker-connect-timeout-s" in info.value.details
        assert health.ejections_total == 1
    finally:
        await pool.close()
        hole.close()


async def test_a_refused_connection_fails_fast_and_counts_as_evidence() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    pool = ChannelPool()
    health = OutlierDetector()
    client = WorkerClient(pool, connect_timeout_s=30.0, health=health)
    try:
        with pytest.raises(LegError) as info:
            await asyncio.wait_for(
                client.prefill(
                    _Target("gone", f"127.0.0.1:{port}"),
                    "r1",
                    (1, 2),
                    common_pb2.SamplingParams(max_tokens=2),
                    60.0,
                    LegLedger(),
                ),
                timeout=20.0,  # a refused connection must not wait out the 30 s connect deadline
            )
        assert info.value.code is grpc.StatusCode.UNAVAILABLE
        assert health.ejections_total == 1
    finally:
        await pool.close()


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--worker-connect-timeout-s", "0"),
        ("--worker-first-message-timeout-s", "nan"),
        ("--outlier-consecutive-failures", "0"),
        ("--outlier-base-ejection-s", "-1"),
        ("--outlier-max-ejection-s", "0.5"),
        ("--cms-rewarm-s", "-1"),
    ],
)
async def test_bad_flags_are_refused_naming_the_flag(flag: str, value: str) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--cms", "grpc://127.0.0.1:1", "--listen", "127.0.0.1:0", flag, value])
    with pytest.raises(ValueError, match=flag):
        await start_from_args(args)


def test_every_new_flag_has_help() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    by_flag = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    for flag in (
        "--worker-connect-timeout-s",
        "--worker-first-message-timeout-s",
        "--outlier-consecutive-failures",
        "--outlier-base-ejection-s",
        "--outlier-max-ejection-s",
        "--cms-rewarm-s",
    ):
        assert by_flag[flag].help and "default" in by_flag[flag].help
