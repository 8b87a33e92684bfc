"""Malformed and random bytes at every service: no crash, no hang, every reject a clear code.

A byte-level fuzz of 5,000 cases per service (Router, Worker, ClusterMetadata)
sends random bytes, truncations and bit flips of valid messages to every
method. Each call is bounded by a deadline; afterwards the process is alive,
still serves a normal request, and its RSS growth is printed.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from slorouter.v1 import cms_pb2, common_pb2, router_pb2, worker_pb2

from tests.cms.helpers import make_metadata, make_status
from tests.faults.secure_fleet import Fleet, Proc, auth, generate_ok, request

CASES_PER_SERVICE = 5000
CONCURRENCY = 64
CALL_TIMEOUT_S = 10.0

#: What a malformed or hostile request may get back. UNKNOWN and INTERNAL (a crash in a
#: handler) are what the suite exists to rule out.
CLEAR_CODES = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}

Method = tuple[str, bool, bytes]  # path, server-streaming, a valid request to mutate


def _sampling() -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=3, stop=["x"])


def _router_methods() -> list[Method]:
    valid = request("fuzz-0").SerializeToString()
    return [
        ("/slorouter.v1.Router/Generate", True, valid),
        (
            "/slorouter.v1.Router/Schedule",
            False,
            router_pb2.ScheduleRequest(request=request()).SerializeToString(),
        ),
    ]


def _worker_methods() -> list[Method]:
    ids = list(range(1, 17))
    return [
        ("/slorouter.v1.Worker/Generate", True,
         worker_pb2.WorkerGenerateRequest(request_id="g", prompt_token_ids=ids, sampling=_sampling()).SerializeToString()),
        ("/slorouter.v1.Worker/Prefill", False,
         worker_pb2.PrefillRequest(request_id="p", prompt_token_ids=ids, sampling=_sampling()).SerializeToString()),
        ("/slorouter.v1.Worker/Decode", True,
         worker_pb2.DecodeRequest(request_id="d", prompt_token_ids=ids, sampling=_sampling(), kv_handle=b"srkv1" + bytes(40),
                                  generated_token_ids=[5]).SerializeToString()),
        ("/slorouter.v1.Worker/Abort", False, worker_pb2.AbortRequest(request_id="a").SerializeToString()),
        ("/slorouter.v1.Worker/GetInfo", False, b""),
    ]  # fmt: skip


def _cms_methods() -> list[Method]:
    return [
        ("/slorouter.v1.ClusterMetadata/RegisterInstance", False,
         cms_pb2.RegisterInstanceRequest(metadata=make_metadata("p0", labels={"a": "b"})).SerializeToString()),
        ("/slorouter.v1.ClusterMetadata/ReportStatus", False,
         cms_pb2.ReportStatusRequest(status=make_status("d0", 7, admitted_request_ids=["r1"])).SerializeToString()),
        ("/slorouter.v1.ClusterMetadata/ReportStatuses", False,
         cms_pb2.ReportStatusesRequest(statuses=[make_status("d0", 7), make_status("p0", 3)]).SerializeToString()),
        ("/slorouter.v1.ClusterMetadata/DeregisterInstance", False,
         cms_pb2.DeregisterInstanceRequest(instance_id="p0").SerializeToString()),
        ("/slorouter.v1.ClusterMetadata/GetClusterView", False, cms_pb2.GetClusterViewRequest(model="sim").SerializeToString()),
        ("/slorouter.v1.ClusterMetadata/WatchClusterView", True, b""),
    ]  # fmt: skip


def mutate(valid: bytes, rng: random.Random) -> bytes:
    """Random bytes, or a valid message truncated, bit-flipped, spliced or padded."""
    kind = rng.randrange(6)
    if kind == 0 or not valid:
        return rng.randbytes(rng.randrange(0, 512))
    data = bytearray(valid)
    if kind == 1:
        return bytes(data[: rng.randrange(len(data))])
    if kind == 2:
        for _ in range(rng.randrange(1, 8)):
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
        return bytes(data)
    if kind == 3:
        i = rng.randrange(len(data) + 1)
        return bytes(data[:i] + rng.randbytes(rng.randrange(1, 64)) + data[i:])
    if kind == 4:  # a length prefix claiming far more bytes than follow
        return bytes(data[:1]) + b"\xff\xff\xff\xff\x0f" + bytes(data[1:])
    return bytes(data) + valid[: rng.randrange(len(valid) + 1)]  # repeated fields, last-one-wins scalars


async def _call(
    channel: grpc.aio.Channel, method: Method, payload: bytes, metadata: object
) -> grpc.StatusCode:
    path, streaming, _ = method
    try:
        if streaming:
            call = channel.unary_stream(path)(payload, timeout=CALL_TIMEOUT_S, metadata=metadata)
            async for _ in call:  # one message proves it works; then hang up (the server aborts the work)
                call.cancel()
                return grpc.StatusCode.OK
            return grpc.StatusCode.OK
        await channel.unary_unary(path)(payload, timeout=CALL_TIMEOUT_S, metadata=metadata)
        return grpc.StatusCode.OK
    except asyncio.CancelledError:
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        return exc.code()


async def _fuzz(proc: Proc, methods: list[Method], metadata: object, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    codes: dict[str, int] = {}
    rss_before = proc.rss_kb()
    async with grpc.aio.insecure_channel(proc.address) as channel:
        for start in range(0, CASES_PER_SERVICE, CONCURRENCY):
            batch = []
            for _ in range(min(CONCURRENCY, CASES_PER_SERVICE - start)):
                method = rng.choice(methods)
                batch.append(_call(channel, method, mutate(method[2], rng), metadata))
            for code in await asyncio.gather(*batch):
                assert code in CLEAR_CODES, f"{proc.name}: a fuzzed request got {code.name}"
                codes[code.name] = codes.get(code.name, 0) + 1
    assert proc.alive(), f"{proc.name} died under the fuzz"
    log = proc.log.read_text()
    assert "Traceback" not in log, f"{proc.name} logged a traceback: {log[log.find('Traceback') :][:1500]}"
    assert "not a valid protobuf message" in log  # one line per undecodable request instead
    rss_after = proc.rss_kb()
    print(
        f"\n{proc.name}: {CASES_PER_SERVICE} fuzzed requests, codes {dict(sorted(codes.items()))}, "
        f"RSS {rss_before} kB -> {rss_after} kB ({rss_after - rss_before:+d} kB)"
    )
    return codes


@pytest.mark.timeout(600)
@pytest.mark.parametrize("service", ["router", "worker", "cms"])
async def test_byte_fuzz_every_service(fleet: Fleet, service: str) -> None:
    if service == "router":
        proc, methods, metadata = fleet.router, _router_methods(), None
    elif service == "worker":
        proc, methods, metadata = fleet.workers["d0"], _worker_methods(), None
    else:
        proc, methods, metadata = fleet.cms, _cms_methods(), auth("fuzz")
    codes = await _fuzz(proc, methods, metadata, seed=hash(service) & 0xFFFF)
    assert codes.get("INVALID_ARGUMENT", 0) > CASES_PER_SERVICE // 4  # most garbage is refused as such
    assert fleet.alive()
    # The fleet still serves normal traffic, end to end.
    with grpc.insecure_channel(fleet.router.address) as channel:
        from slorouter.v1 import router_pb2_grpc

        stub = router_pb2_grpc.RouterStub(channel)
        for i in range(5):
            assert len(generate_ok(stub, f"after-fuzz-{service}-{i}")) == 4
