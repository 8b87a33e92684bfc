"""Oversized inputs are refused at the edge, and cannot degrade anybody else's traffic.

The 1 MB ``request_id`` attack that once grew status reports and the view
past the CMS's message limit now gets ``INVALID_ARGUMENT`` before anything is
dispatched; ``Schedule`` and ``Generate`` share one validation (a property
test), and every bounded field is refused naming itself and its limit.
"""

from __future__ import annotations

import concurrent.futures
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from slorouter.v1 import (
    cms_pb2,
    cms_pb2_grpc,
    common_pb2,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

from cms import limits
from tests.faults.secure_fleet import Fleet, auth, generate_ok, request

MB = 1 << 20


def _code_and_details(call: object) -> tuple[grpc.StatusCode, str]:
    try:
        result = call()  # type: ignore[operator]
        if hasattr(result, "__iter__") and not isinstance(result, (bytes, str)):
            for _ in result:
                pass
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""  # type: ignore[attr-defined]
    return grpc.StatusCode.OK, ""


@pytest.mark.timeout(180)
def test_megabyte_request_ids_do_not_degrade_normal_traffic(fleet: Fleet) -> None:
    with (
        grpc.insecure_channel(fleet.router.address) as channel,
        grpc.insecure_channel(fleet.cms.address) as cch,
    ):
        stub = router_pb2_grpc.RouterStub(channel)
        cms = cms_pb2_grpc.ClusterMetadataStub(cch)

        def attack(i: int) -> tuple[grpc.StatusCode, str]:
            huge = f"{i}-" + "a" * MB
            return _code_and_details(lambda: stub.Generate(request(huge), timeout=30))

        def normal(i: int) -> int:
            return len(generate_ok(stub, f"normal-{i}"))

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            attacks = [pool.submit(attack, i) for i in range(8)]
            normals = [pool.submit(normal, i) for i in range(20)]
            for future in attacks:
                code, details = future.result(60)
                assert code == grpc.StatusCode.INVALID_ARGUMENT
                assert "request_id" in details and str(limits.MAX_ID_BYTES) in details
            assert [f.result(60) for f in normals] == [4] * 20
        # Nothing of the attack reached a status report or the view.
        view = cms.GetClusterView(cms_pb2.GetClusterViewRequest(), metadata=auth("router"), timeout=5)
        assert view.ByteSize() < 64 * 1024
        assert {s.metadata.instance_id for s in view.instances} >= {"p0", "d0"}
        # Normal traffic goes on afterwards too.
        for i in range(10):
            assert len(generate_ok(stub, f"after-{i}")) == 4


def _bad_requests() -> dict[str, tuple[router_pb2.GenerateRequest, str]]:
    def req(**fields: object) -> router_pb2.GenerateRequest:
        return request("bound-test", **fields)

    too_many_stops = req()
    too_many_stops.sampling.stop.extend(["s"] * (limits.MAX_STOP_STRINGS + 1))
    long_stop = req()
    long_stop.sampling.stop.append("s" * (limits.MAX_STOP_BYTES + 1))
    empty_stop = req()
    empty_stop.sampling.stop.append("")
    text = router_pb2.GenerateRequest(
        prompt="x" * (limits.MAX_PROMPT_TEXT_BYTES + 1), sampling=common_pb2.SamplingParams(max_tokens=1)
    )
    ids = router_pb2.GenerateRequest(
        prompt_token_ids=[1] * (limits.MAX_TOKEN_IDS + 1), sampling=common_pb2.SamplingParams(max_tokens=1)
    )
    return {
        "request_id too long": (request("r" * (limits.MAX_ID_BYTES + 1)), "request_id"),
        "request_id characters": (request("white space"), "request_id"),
        "request_id non-ascii": (request("é"), "request_id"),
        "model too long": (req(model="m" * (limits.MAX_NAME_BYTES + 1)), "model"),
        "too many stop strings": (too_many_stops, "sampling.stop"),
        "stop string too long": (long_stop, "sampling.stop[0]"),
        "empty stop string": (empty_stop, "sampling.stop[0]"),
        "max_tokens over the limit": (
            request(max_tokens=limits.MAX_OUTPUT_TOKENS + 1),
            "sampling.max_tokens",
        ),
        "prompt text too long": (text, "prompt"),
        "too many prompt token ids": (ids, "prompt_token_ids"),
        "prompt over the serving limit": (
            router_pb2.GenerateRequest(
                prompt_token_ids=[1] * 5000, sampling=common_pb2.SamplingParams(max_tokens=1)
            ),
            "4096",
        ),
    }


@pytest.mark.parametrize("case", list(_bad_requests()))
def test_every_router_bound_names_its_field_in_schedule_and_generate(fleet: Fleet, case: str) -> None:
    bad, field = _bad_requests()[case]
    with grpc.insecure_channel(fleet.router.address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for call in (
            lambda: stub.Schedule(router_pb2.ScheduleRequest(request=bad), timeout=10),
            lambda: stub.Generate(bad, timeout=10),
        ):
            code, details = _code_and_details(call)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, details
            assert field in details


def test_worker_and_cms_bounds_name_their_field(fleet: Fleet) -> None:
    with (
        grpc.insecure_channel(fleet.workers["p0"].address) as wch,
        grpc.insecure_channel(fleet.cms.address) as cch,
    ):
        worker = worker_pb2_grpc.WorkerStub(wch)
        cms = cms_pb2_grpc.ClusterMetadataStub(cch)
        sampling = common_pb2.SamplingParams(max_tokens=2)
        cases = {
            "request_id": lambda: worker.Prefill(
                worker_pb2.PrefillRequest(request_id="x" * 300, prompt_token_ids=[1], sampling=sampling), timeout=5
            ),
            "kv_handle": lambda: worker.Decode(
                worker_pb2.DecodeRequest(
                    request_id="a", prompt_token_ids=[1], sampling=sampling,
                    kv_handle=b"k" * (limits.MAX_KV_HANDLE_BYTES + 1),
                ),
                timeout=5,
            ),
            "sampling.stop": lambda: worker.Generate(
                worker_pb2.WorkerGenerateRequest(
                    request_id="a", prompt_token_ids=[1],
                    sampling=common_pb2.SamplingParams(max_tokens=1, stop=["s"] * 17),
                ),
                timeout=5,
            ),
            "metadata.labels": lambda: cms.RegisterInstance(
                cms_pb2.RegisterInstanceRequest(
                    metadata=cms_pb2.InstanceMetadata(
                        instance_id="lbl", endpoint="127.0.0.1:2", role=cms_pb2.INSTANCE_ROLE_DECODE,
                        labels={f"k{i}": "v" for i in range(limits.MAX_LABELS + 1)},
                    )
                ),
                metadata=auth("fuzz"), timeout=5,
            ),
            "status.admitted_request_ids[0]": lambda: cms.ReportStatus(
                cms_pb2.ReportStatusRequest(
                    status=cms_pb2.InstanceStatus(instance_id="p0", update_id=1, admitted_request_ids=["r" * 300])
                ),
                metadata=auth("worker.p0"), timeout=5,
            ),
            "model": lambda: cms.GetClusterView(
                cms_pb2.GetClusterViewRequest(model="m" * 300), metadata=auth("router"), timeout=5
            ),
        }  # fmt: skip
        for field, call in cases.items():
            code, details = _code_and_details(call)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (field, details)
            assert field in details, (field, details)


_ids = st.one_of(
    st.just(""),
    st.text(alphabet="abcXYZ019._:-", min_size=1, max_size=20),
    st.text(min_size=1, max_size=8),  # any characters, most of them refused
    st.integers(limits.MAX_ID_BYTES - 1, limits.MAX_ID_BYTES + 2).map(lambda n: "r" * n),
)


@st.composite
def _requests(draw: st.DrawFn) -> router_pb2.GenerateRequest:
    # Each field is valid most of the time, so that a good share of examples is valid as a whole.
    req = router_pb2.GenerateRequest(request_id=draw(_ids))
    kind = draw(st.sampled_from(["ids", "ids", "text", "both", "neither"]))
    if kind in ("ids", "both"):
        req.prompt_token_ids.extend(draw(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40)))
    if kind in ("text", "both"):
        req.prompt = draw(st.text(min_size=1, max_size=40))
    req.model = draw(st.sampled_from(["", "", "sim", "other", "m" * 257]))
    req.sampling.max_tokens = draw(st.sampled_from([1, 3, 3, 3, 0, 5000, limits.MAX_OUTPUT_TOKENS + 1]))
    req.sampling.temperature = draw(st.sampled_from([0.0, 0.0, 0.7, -1.0, float("nan")]))
    req.sampling.top_p = draw(st.sampled_from([0.0, 0.0, 0.9, 1.5]))
    req.sampling.top_k = draw(st.sampled_from([0, 0, 5, -1]))
    req.sampling.stop.extend(draw(st.lists(st.sampled_from(["", "a", "a", "a", "s" * 300]), max_size=2)))
    req.slo.ttft_ms = draw(st.sampled_from([0.0, 60_000.0, 60_000.0, -1.0, float("inf")]))
    req.slo.tpot_ms = 60_000.0
    return req


_OUTCOMES: list[grpc.StatusCode] = []


# derandomize: the guard below counts what this property drew, so the draw must not change from run to
# run (with a random seed it sometimes drew fewer than 5 valid requests in 150 and failed).
@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(req=_requests())
def test_schedule_and_generate_agree_on_what_is_invalid(
    fleet: Fleet, req: router_pb2.GenerateRequest
) -> None:
    if req.request_id:
        req.request_id = f"{req.request_id[:200]}"  # keep it unique per example below
    with grpc.insecure_channel(fleet.router.address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        scheduled, s_details = _code_and_details(
            lambda: stub.Schedule(router_pb2.ScheduleRequest(request=req), timeout=10)
        )
        if req.request_id and scheduled == grpc.StatusCode.OK:
            req.request_id = f"{req.request_id[:60]}-{time.monotonic_ns()}"
        generated, g_details = _code_and_details(lambda: stub.Generate(req, timeout=30))
    _OUTCOMES.append(scheduled)
    if scheduled == grpc.StatusCode.INVALID_ARGUMENT:
        assert (generated, g_details) == (scheduled, s_details)
    else:
        assert generated != grpc.StatusCode.INVALID_ARGUMENT, g_details
        assert generated in (grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED), g_details


def test_the_property_saw_both_valid_and_invalid_requests() -> None:
    """Guards the property above against a strategy that only ever draws one kind."""
    assert _OUTCOMES.count(grpc.StatusCode.INVALID_ARGUMENT) >= 10
    assert sum(1 for code in _OUTCOMES if code != grpc.StatusCode.INVALID_ARGUMENT) >= 5
