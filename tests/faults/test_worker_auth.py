"""Workers refuse work and aborts without the worker token; an abort the router did not ask for is
a worker failure, resumed token-exact on another instance, never a normal finish."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
from slorouter.v1 import (
    cms_pb2,
    cms_pb2_grpc,
    common_pb2,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

from cms.auth import read_client_token
from tests.faults.up_cluster import UpCluster, up_cluster, wait_serving
from workers.sim_engine import output_token, prompt_digest, request_key

PROMPT = list(range(1, 33))
SEED = 11


def _expected(max_tokens: int) -> list[int]:
    key = request_key(SEED, prompt_digest(PROMPT))
    return [output_token(key, i) for i in range(max_tokens)]


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def test_worker_calls_without_the_token_are_refused(shared_up: UpCluster) -> None:
    cluster = shared_up
    wait_serving(cluster.router)
    read = _bearer(read_client_token(cluster.read_token_file))
    with grpc.insecure_channel(cluster.cms) as channel:
        view = cms_pb2_grpc.ClusterMetadataStub(channel).GetClusterView(
            cms_pb2.GetClusterViewRequest(), metadata=read, timeout=5
        )
    endpoints = {s.metadata.instance_id: s.metadata.endpoint for s in view.instances}
    sampling = common_pb2.SamplingParams(max_tokens=4)
    for credentials in (None, read, _bearer("not-the-token")):
        with grpc.insecure_channel(endpoints["decode-0"]) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            calls = {
                "Abort": lambda m=credentials, s=stub: s.Abort(
                    worker_pb2.AbortRequest(request_id="x"), metadata=m, timeout=5
                ),
                "Prefill": lambda m=credentials, s=stub: s.Prefill(
                    worker_pb2.PrefillRequest(request_id="x", prompt_token_ids=PROMPT, sampling=sampling),
                    metadata=m,
                    timeout=5,
                ),
                "Generate": lambda m=credentials, s=stub: list(
                    s.Generate(
                        worker_pb2.WorkerGenerateRequest(
                            request_id="x", prompt_token_ids=PROMPT, sampling=sampling
                        ),
                        metadata=m,
                        timeout=5,
                    )
                ),
                "Decode": lambda m=credentials, s=stub: list(
                    s.Decode(
                        worker_pb2.DecodeRequest(request_id="x", prompt_token_ids=PROMPT, sampling=sampling),
                        metadata=m,
                        timeout=5,
                    )
                ),
                "Streams": lambda m=credentials, s=stub: list(
                    s.Streams(iter([worker_pb2.StreamCommand()]), metadata=m, timeout=5)
                ),
            }
            for name, call in calls.items():
                with pytest.raises(grpc.RpcError) as info:
                    call()
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, name  # type: ignore[attr-defined]
            # What the router needs to know about a worker stays open.
            stub.GetInfo(worker_pb2.GetInfoRequest(), metadata=credentials, timeout=5)
    wait_serving(cluster.router, timeout_s=10)


async def _stream(
    stub: router_pb2_grpc.RouterStub, request_id: str, max_tokens: int, result: dict[str, object]
) -> dict[str, object]:
    tokens: list[int] = []
    gaps = 0
    result.update({"decode": "", "finish_reason": "", "code": "OK"})
    request = router_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=PROMPT,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, seed=SEED, ignore_eos=True),
        slo=common_pb2.SloTarget(ttft_ms=60_000, tpot_ms=60_000),
    )
    try:
        async for message in stub.Generate(request, timeout=60):
            if message.HasField("route"):
                result["decode"] = message.route.decode_instance_id
            if message.first_token_index != len(tokens):
                gaps += 1
            tokens.extend(message.token_ids)
            if message.finished:
                result["finish_reason"] = message.finish_reason
    except grpc.aio.AioRpcError as exc:
        result["code"] = exc.code().name
    result["tokens"] = tokens
    result["gaps"] = gaps
    return result


def test_an_abort_the_router_did_not_ask_for_is_resumed_elsewhere(tmp_path: Path) -> None:
    max_tokens = 600
    with up_cluster(tmp_path, "--decode", "2", "--speed-factor", "4") as cluster:
        wait_serving(cluster.router)
        worker_token = _bearer(read_client_token(cluster.read_token_file.parent / "worker-call.token"))

        async def run() -> list[dict[str, object]]:
            async with grpc.aio.insecure_channel(cluster.router) as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                seen: list[dict[str, object]] = [{} for _ in range(4)]
                victims = [
                    asyncio.ensure_future(_stream(stub, f"victim-{i}", max_tokens, seen[i])) for i in range(4)
                ]
                await asyncio.sleep(1.0)  # the streams are decoding now
                # Someone holding the worker token (an operator's tool gone wrong) aborts them all,
                # each on the decode worker it runs on.
                for i, result in enumerate(seen):
                    assert result.get("decode"), "the stream has not started"
                    async with grpc.aio.insecure_channel(cluster.workers[str(result["decode"])]) as worker:
                        await worker_pb2_grpc.WorkerStub(worker).Abort(
                            worker_pb2.AbortRequest(request_id=f"victim-{i}"),
                            metadata=worker_token,
                            timeout=5,
                        )
                return await asyncio.gather(*victims)

        started = time.monotonic()
        results = asyncio.run(run())
        assert time.monotonic() - started < 60
        expected = _expected(max_tokens)
        for i, result in enumerate(results):
            assert result["code"] == "OK", (i, result["code"], cluster.tail())
            assert result["finish_reason"] == "length", (i, result["finish_reason"])
            assert result["gaps"] == 0, i
            assert result["tokens"] == expected, (
                f"victim-{i}: {len(result['tokens'])} tokens, not token-exact"
            )  # type: ignore[arg-type]
        assert "without the router asking" in cluster.tail()
