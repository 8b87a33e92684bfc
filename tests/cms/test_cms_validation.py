"""Every INVALID_ARGUMENT case, through gRPC, against both stores: the field is named, nothing is stored."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc
import pytest
from slorouter.v1 import cms_pb2, cms_pb2_grpc

from cms.errors import InvalidArgumentError
from cms.store import CmsStore
from cms.validation import (
    MAX_ADMITTED_REQUEST_IDS,
    MAX_INSTANCE_ID_CHARS,
    MAX_STEP_SAMPLES,
    parse_endpoint,
    validate_metadata,
    validate_status,
)
from tests.cms.helpers import make_metadata, make_status

if TYPE_CHECKING:
    Stub = cms_pb2_grpc.ClusterMetadataAsyncStub


def _samples(n: int, duration_ms: float = 10.0) -> list[cms_pb2.StepSample]:
    return [cms_pb2.StepSample(num_prefill_tokens=8, duration_ms=duration_ms) for _ in range(n)]


BAD_METADATA: dict[str, tuple[Callable[[], cms_pb2.InstanceMetadata], str]] = {
    "empty instance_id": (lambda: make_metadata(""), "metadata.instance_id"),
    "no metadata at all": (cms_pb2.InstanceMetadata, "metadata.instance_id"),
    "instance_id too long": (
        lambda: make_metadata("x" * (MAX_INSTANCE_ID_CHARS + 1)),
        "metadata.instance_id",
    ),
    "empty endpoint": (lambda: make_metadata("p9", endpoint=""), "metadata.endpoint"),
    "endpoint without port": (lambda: make_metadata("p9", endpoint="localhost"), "metadata.endpoint"),
    "endpoint port not a number": (lambda: make_metadata("p9", endpoint="host:http"), "metadata.endpoint"),
    "endpoint port out of range": (lambda: make_metadata("p9", endpoint="host:70000"), "metadata.endpoint"),
    "endpoint port zero": (lambda: make_metadata("p9", endpoint="host:0"), "metadata.endpoint"),
    "endpoint without host": (lambda: make_metadata("p9", endpoint=":9000"), "metadata.endpoint"),
    "endpoint is a URL": (lambda: make_metadata("p9", endpoint="http://host:9000"), "metadata.endpoint"),
    "endpoint unbracketed IPv6": (lambda: make_metadata("p9", endpoint="::1:9000"), "metadata.endpoint"),
    "unknown role value": (lambda: make_metadata("p9", role=42), "metadata.role"),
    "unspecified role": (
        lambda: make_metadata("p9", role=cms_pb2.INSTANCE_ROLE_UNSPECIFIED),
        "metadata.role",
    ),
}

BAD_STATUS: dict[str, tuple[Callable[[], cms_pb2.InstanceStatus], str]] = {
    "empty instance_id": (lambda: make_status("", 9), "status.instance_id"),
    "no status at all": (cms_pb2.InstanceStatus, "status.instance_id"),
    "too many admitted ids": (
        lambda: make_status(
            "p0", 9, admitted_request_ids=[f"r{i}" for i in range(MAX_ADMITTED_REQUEST_IDS + 1)]
        ),
        "status.admitted_request_ids",
    ),
    "too many step samples": (
        lambda: make_status("p0", 9, step_samples=_samples(MAX_STEP_SAMPLES + 1)),
        "status.step_samples",
    ),
    "NaN step duration": (
        lambda: make_status("p0", 9, step_samples=_samples(1, math.nan)),
        "status.step_samples[0].duration_ms",
    ),
    "negative step duration": (
        lambda: make_status("p0", 9, step_samples=[*_samples(2), *_samples(1, -1.0)]),
        "status.step_samples[2].duration_ms",
    ),
    "cache hit rate above 1": (
        lambda: make_status("p0", 9, cache_hit_rate=1.5),
        "status.cache_hit_rate",
    ),
    "NaN cache hit rate": (
        lambda: make_status("p0", 9, cache_hit_rate=math.nan),
        "status.cache_hit_rate",
    ),
    "kv use above capacity": (
        lambda: make_status("p0", 9, num_used_kv_tokens=4097),
        "status.num_used_kv_tokens",
    ),
}


async def _seed(stub: Stub) -> cms_pb2.ClusterView:
    """One registered instance with a status; returns the view to compare against afterwards."""
    await stub.RegisterInstance(
        cms_pb2.RegisterInstanceRequest(metadata=make_metadata("p0", kv_capacity_tokens=4096))
    )
    await stub.ReportStatus(cms_pb2.ReportStatusRequest(status=make_status("p0", 1, num_used_kv_tokens=10)))
    return await stub.GetClusterView(cms_pb2.GetClusterViewRequest())


def _content(view: cms_pb2.ClusterView) -> list[tuple[bytes, bytes]]:
    return [
        (s.metadata.SerializeToString(deterministic=True), s.status.SerializeToString(deterministic=True))
        for s in view.instances
    ]


async def _assert_unchanged(stub: Stub, before: cms_pb2.ClusterView) -> None:
    after = await stub.GetClusterView(cms_pb2.GetClusterViewRequest())
    assert after.version == before.version
    assert _content(after) == _content(before)


@pytest.mark.parametrize("case", list(BAD_METADATA))
async def test_register_rejects_bad_metadata(stub: Stub, case: str) -> None:
    before = await _seed(stub)
    build, field = BAD_METADATA[case]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.RegisterInstance(cms_pb2.RegisterInstanceRequest(metadata=build()))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (info.value.details() or "")
    await _assert_unchanged(stub, before)


async def test_reregister_with_bad_metadata_keeps_the_old_one(stub: Stub) -> None:
    before = await _seed(stub)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.RegisterInstance(
            cms_pb2.RegisterInstanceRequest(metadata=make_metadata("p0", endpoint=""))
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await _assert_unchanged(stub, before)


@pytest.mark.parametrize("case", list(BAD_STATUS))
async def test_report_rejects_bad_status(stub: Stub, case: str) -> None:
    before = await _seed(stub)
    build, field = BAD_STATUS[case]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.ReportStatus(cms_pb2.ReportStatusRequest(status=build()))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (info.value.details() or "")
    await _assert_unchanged(stub, before)


async def test_deregister_rejects_empty_id(stub: Stub) -> None:
    before = await _seed(stub)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.DeregisterInstance(cms_pb2.DeregisterInstanceRequest(instance_id=""))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "instance_id" in (info.value.details() or "")
    await _assert_unchanged(stub, before)


async def test_bounds_are_inclusive(stub: Stub, store: CmsStore) -> None:
    await _seed(stub)
    full = make_status(
        "p0",
        2,
        admitted_request_ids=[f"r{i}" for i in range(MAX_ADMITTED_REQUEST_IDS)],
        step_samples=_samples(MAX_STEP_SAMPLES, 0.0),
        num_used_kv_tokens=4096,
    )
    response = await stub.ReportStatus(cms_pb2.ReportStatusRequest(status=full))
    assert response.accepted
    status = (await store.read_view()).instances[0].status
    assert status is not None and len(status.admitted_request_ids) == MAX_ADMITTED_REQUEST_IDS


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("127.0.0.1:9000", ("127.0.0.1", 9000)),
        ("worker-3.pod.svc:50051", ("worker-3.pod.svc", 50051)),
        ("[::1]:7", ("[::1]", 7)),
        ("localhost:65535", ("localhost", 65535)),
    ],
)
def test_parse_endpoint_accepts(endpoint: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(endpoint) == expected


@pytest.mark.parametrize("endpoint", ["", "host", "host:", "[::1:80", "[]:80", "a b:80", "h:-1", "h:1.5"])
def test_parse_endpoint_rejects(endpoint: str) -> None:
    with pytest.raises(ValueError):
        parse_endpoint(endpoint)


@pytest.mark.parametrize(
    ("check", "value"),
    [
        (validate_metadata, make_metadata("p0", role=7)),
        (validate_status, make_status("p0", step_samples=_samples(1, math.inf))),
    ],
)
def test_validators_raise_the_cms_error(check: Callable[[Any], None], value: Any) -> None:
    with pytest.raises(InvalidArgumentError):
        check(value)
