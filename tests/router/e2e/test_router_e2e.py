"""The router end to end on loopback: CMS + sim workers + router, real gRPC everywhere."""

from __future__ import annotations

import asyncio
import math
import time

import grpc
import pytest
from slorouter.v1 import common_pb2, router_pb2

from router.admission import Admission
from router.core.queue import QueueConfig
from tests.router.e2e.cluster import collect, embedded_cluster, generate_request, prefix_family_request

#: The router's --worker-streams: legs on one Worker.Streams call per worker, or one call each.
STREAMS = pytest.mark.parametrize("streams", ["mux", "per-request"])


def check_stream(result, max_tokens: int) -> None:  # type: ignore[no-untyped-def]
    assert len(result.tokens) == max_tokens
    assert result.first.HasField("route")
    assert all(not m.HasField("route") for m in result.messages[1:])
    assert result.last.finished and result.last.finish_reason == "length"
    assert all(not m.finished for m in result.messages[:-1])
    usage = result.last.usage
    assert usage.completion_tokens == max_tokens
    assert usage.ttft_ms > 0 and usage.e2e_ms >= usage.ttft_ms


@pytest.mark.parametrize("policy", ["slo", "load-balance"])
@STREAMS
async def test_pd_concurrent_generate_all_complete(policy: str, streams: str) -> None:
    async with embedded_cluster(prefill=2, decode=2, policy=policy, worker_streams=streams) as cluster:
        requests = [generate_request(32 + 8 * i, 12 + i % 5, request_id=f"r{i}") for i in range(40)]
        results = await asyncio.gather(*(collect(cluster.stub, r) for r in requests))
        prefill_used, decode_used = set(), set()
        for request, result in zip(requests, results, strict=True):
            check_stream(result, request.sampling.max_tokens)
            assert result.first.request_id == request.request_id
            route = result.first.route
            assert route.prefill_instance_id.startswith("prefill-")
            assert route.decode_instance_id.startswith("decode-")
            assert route.policy == policy
            prefill_used.add(route.prefill_instance_id)
            decode_used.add(route.decode_instance_id)
        assert prefill_used == {"prefill-0", "prefill-1"}
        assert decode_used == {"decode-0", "decode-1"}
        assert len(cluster.router.scheduler.inflight) == 0
        assert cluster.router.service.active_requests == 0


@STREAMS
async def test_neutral_fleet_generates(streams: str) -> None:
    async with embedded_cluster(neutral=2, worker_streams=streams) as cluster:
        results = await asyncio.gather(*(collect(cluster.stub, generate_request(40, 20)) for _ in range(20)))
        for result in results:
            check_stream(result, 20)
            route = result.first.route
            assert route.prefill_instance_id == route.decode_instance_id
            assert route.prefill_instance_id.startswith("neutral-")


async def test_pd_tokens_match_a_neutral_generate() -> None:
    async with embedded_cluster(prefill=1, decode=1) as pd, embedded_cluster(neutral=1) as neutral:
        request = generate_request(100, 24, request_id="same")
        a = await collect(pd.stub, request)
        b = await collect(neutral.stub, request)
        assert a.tokens == b.tokens


async def test_text_prompt_is_tokenized_by_the_router() -> None:
    async with embedded_cluster(neutral=1) as cluster:
        request = router_pb2.GenerateRequest(
            prompt="hello, fleet", sampling=common_pb2.SamplingParams(max_tokens=5)
        )
        result = await collect(cluster.stub, request)
        assert result.last.usage.prompt_tokens == len(b"hello, fleet")
        assert len(result.tokens) <= 5


async def test_schedule_matches_generate_decision() -> None:
    async with embedded_cluster(prefill=2, decode=2) as cluster:
        # Load one prefill instance so the decision is not a tie.
        background = asyncio.ensure_future(collect(cluster.stub, generate_request(3000, 200)))
        await asyncio.sleep(0.05)
        request = generate_request(500, 8, request_id="probe")
        dry = await cluster.stub.Schedule(router_pb2.ScheduleRequest(request=request, explain=True))
        assert dry.mode == "pd" and dry.policy == "slo"
        # Without explain: the same decision, no trace.
        plain = await cluster.stub.Schedule(router_pb2.ScheduleRequest(request=request))
        assert not plain.trace
        # The same placement. (Not the same predictions: the statuses the background request's
        # workers report between the two calls change the load they are made from.)
        assert (plain.prefill.instance_id, plain.decode.instance_id, plain.mode, plain.policy) == (
            dry.prefill.instance_id,
            dry.decode.instance_id,
            dry.mode,
            dry.policy,
        )
        assert (plain.prefill.endpoint, plain.decode.endpoint) == (dry.prefill.endpoint, dry.decode.endpoint)
        stages = {t.stage for t in dry.trace}
        assert stages == {"prefill", "decode"}
        assert sum(t.selected for t in dry.trace) == 2
        selected = {t.stage: t.instance_id for t in dry.trace if t.selected}
        assert selected == {"prefill": dry.prefill.instance_id, "decode": dry.decode.instance_id}
        assert dry.prefill.predicted_ttft_ms > 0
        # explain_top alone asks for the trace, cut to the selected candidate of each stage.
        top = await cluster.stub.Schedule(router_pb2.ScheduleRequest(request=request, explain_top=1))
        assert [(t.stage, t.instance_id) for t in top.trace] == [
            ("prefill", dry.prefill.instance_id),
            ("decode", dry.decode.instance_id),
        ]
        assert all(t.selected for t in top.trace)
        # Nothing was recorded by the dry run.
        assert "probe" not in cluster.router.scheduler.inflight
        result = await collect(cluster.stub, request)
        assert result.first.route.prefill_instance_id == dry.prefill.instance_id
        assert result.first.route.decode_instance_id == dry.decode.instance_id
        await background


@STREAMS
async def test_killing_a_decode_worker_mid_stream_loses_and_duplicates_nothing(streams: str) -> None:
    async with embedded_cluster(
        prefill=1, decode=2, engine_overrides={"speed_factor": 5.0}, worker_streams=streams
    ) as cluster:
        request = generate_request(64, 120, request_id="survivor")
        expected = (await collect(cluster.stub, generate_request(64, 120, request_id="reference"))).tokens
        stream = cluster.stub.Generate(request, timeout=60)
        tokens: list[int] = []
        route = None
        killed = False
        async for message in stream:
            if message.HasField("route"):
                route = message.route
            tokens.extend(message.token_ids)
            if not killed and len(tokens) >= 10:
                assert route is not None
                await cluster.kill_worker(route.decode_instance_id)
                killed = True
        assert killed
        assert tokens == expected
        assert len(tokens) == 120


@STREAMS
async def test_client_cancel_aborts_on_the_workers(streams: str) -> None:
    async with embedded_cluster(
        prefill=1, decode=1, engine_overrides={"speed_factor": 2.0}, worker_streams=streams
    ) as cluster:
        call = cluster.stub.Generate(generate_request(64, 2000, request_id="to-cancel"), timeout=60)
        received = 0
        async for message in call:
            received += len(message.token_ids)
            if received >= 3:
                break
        call.cancel()
        decode_engine = cluster.engines["decode-0"]
        prefill_engine = cluster.engines["prefill-0"]
        for _ in range(500):
            if (
                decode_engine.load().num_running_requests == 0
                and decode_engine.load().num_used_kv_tokens == 0
            ):
                break
            await asyncio.sleep(0.01)
        assert decode_engine.load().num_running_requests == 0
        assert decode_engine.load().num_used_kv_tokens == 0
        assert prefill_engine.load().num_used_kv_tokens == 0
        for _ in range(200):
            if len(cluster.router.scheduler.inflight) == 0:
                break
            await asyncio.sleep(0.01)
        assert len(cluster.router.scheduler.inflight) == 0


@STREAMS
async def test_deadline_aborts_on_the_workers(streams: str) -> None:
    async with embedded_cluster(
        neutral=1, engine_overrides={"speed_factor": 2.0}, worker_streams=streams
    ) as cluster:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(cluster.stub, generate_request(64, 3000), timeout_s=0.5)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        engine = cluster.engines["neutral-0"]
        for _ in range(300):
            if engine.load().num_running_requests == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.load().num_running_requests == 0


def _bad(**kw):  # type: ignore[no-untyped-def]
    base = {"prompt_token_ids": [1, 2, 3], "sampling": common_pb2.SamplingParams(max_tokens=4)}
    base.update(kw)
    return router_pb2.GenerateRequest(**base)


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=4)), "prompt"),
        (_bad(prompt="text too"), "prompt"),
        (_bad(sampling=common_pb2.SamplingParams(max_tokens=0)), "sampling.max_tokens"),
        (_bad(slo=common_pb2.SloTarget(ttft_ms=-1)), "slo.ttft_ms"),
        (_bad(slo=common_pb2.SloTarget(tpot_ms=float("nan"))), "slo.tpot_ms"),
        (_bad(slo=common_pb2.SloTarget(e2e_ms=float("inf"))), "slo.e2e_ms"),
        (_bad(prompt_token_ids=list(range(1, 250)) * 20), "serving limit"),
        (_bad(model="no-such-model"), "model"),
    ],
)
async def test_invalid_requests_are_refused_and_the_router_keeps_serving(
    request_: router_pb2.GenerateRequest, field: str
) -> None:
    async with embedded_cluster(neutral=1) as cluster:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(cluster.stub, request_)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in (info.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await cluster.stub.Schedule(router_pb2.ScheduleRequest(request=request_))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(cluster.router.scheduler.inflight) == 0
        ok = await collect(cluster.stub, generate_request(16, 4))
        assert len(ok.tokens) == 4


async def test_duplicate_in_flight_request_id_is_refused() -> None:
    async with embedded_cluster(neutral=1, engine_overrides={"speed_factor": 2.0}) as cluster:
        first = cluster.stub.Generate(generate_request(16, 500, request_id="dup"), timeout=30)
        await first.read()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(cluster.stub, generate_request(16, 4, request_id="dup"))
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
        first.cancel()


async def test_empty_fleet_is_unavailable() -> None:
    async with embedded_cluster() as cluster:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(cluster.stub, generate_request(16, 4))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no instances" in (info.value.details() or "")


async def test_unmeetable_slo_is_resource_exhausted_without_a_queue() -> None:
    async with embedded_cluster(prefill=1, decode=1, queue=QueueConfig(queue_policy="none")) as cluster:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(cluster.stub, generate_request(2000, 4, ttft_ms=1.0))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "prefill" in (info.value.details() or "")


@pytest.mark.parametrize("late_policy", ["serve", "reject"])
async def test_an_unmeetable_slo_is_refused_at_arrival_with_the_reason(late_policy: str) -> None:
    """A 1 ms TTFT (or TPOT) target is below the best prediction on an idle instance: no queueing can
    meet it, so it is refused at once, whatever the late policy (it used to wait or be served late)."""
    async with embedded_cluster(prefill=1, decode=1, queue=QueueConfig(late_policy=late_policy)) as cluster:
        for slo in ({"ttft_ms": 1.0}, {"tpot_ms": 1.0}):
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(cluster.stub, generate_request(2000, 4, **slo))
            assert time.monotonic() - started < 1.0
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            details = info.value.details() or ""
            assert "target 1 ms is below the best prediction" in details, details


@pytest.mark.parametrize("late_policy", ["serve", "reject"])
async def test_requests_with_an_impossible_target_do_not_hold_the_next_ones_back(late_policy: str) -> None:
    """Three calls asking for a 1 ms TTFT, then an ordinary one: it is served at once (it used to wait
    out its whole 6 s deadline behind release control keeping room for the 1 ms target)."""
    async with embedded_cluster(prefill=1, decode=1, queue=QueueConfig(late_policy=late_policy)) as cluster:
        for _ in range(3):
            try:
                await collect(cluster.stub, generate_request(2000, 4, ttft_ms=1.0))
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # refused at arrival
        result = await collect(cluster.stub, generate_request(64, 4))
        assert len(result.tokens) == 4 and not result.last.usage.late
        assert result.last.usage.queue_wait_ms < 1000.0


async def test_objective_g_refuses_late_requests_and_learns_from_how_calls_end() -> None:
    """Under --queue-objective g a late request is refused even with the default late policy (serve),
    and the service tells the queue how every call ended: the misses lower the shedding limit."""
    queue = QueueConfig(queue_objective="g")
    # Engines at the profile's speed: the blocker's prefill (~0.5 s) is still running when the
    # others arrive.
    engine = {"speed_factor": 1.0}
    async with embedded_cluster(prefill=1, decode=1, queue=queue, engine_overrides=engine) as cluster:
        admission = cluster.router.admission
        assert isinstance(admission, Admission)
        assert admission.queue.shed_limit_ms(time.monotonic()) == math.inf
        scheduler = cluster.router.scheduler
        assert scheduler.predictors is not None
        budget = scheduler.config.default_max_num_batched_tokens
        idle_ms = float(scheduler.predictors.default.predict_ttft_ms(2000, 0, 0, budget))
        blocker = asyncio.ensure_future(collect(cluster.stub, generate_request(4000, 2, ttft_ms=60_000.0)))
        await asyncio.sleep(0.05)
        for _ in range(3):
            # Meetable on an idle instance, hopeless behind the blocker: late, and refused under g.
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(cluster.stub, generate_request(2000, 4, ttft_ms=1.2 * idle_ms))
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await blocker
        assert admission.queue.shed_limit_ms(time.monotonic()) < math.inf
        lowered = admission.queue.shed_limit_ms(time.monotonic())
        result = await collect(cluster.stub, generate_request(64, 4))  # meets the 6 s / 50 ms defaults
        assert len(result.tokens) == 4
        assert admission.queue.shed_limit_ms(time.monotonic()) > lowered
        assert admission.queue.decode_ms_per_token() is not None


async def test_pd_usage_reports_the_prompt_tokens_the_decode_side_pulled() -> None:
    async with embedded_cluster(prefill=1, decode=1) as cluster:
        result = await collect(cluster.stub, generate_request(200, 6))
        assert result.last.usage.cached_prompt_tokens == 200
    async with embedded_cluster(neutral=1) as cluster:
        result = await collect(cluster.stub, generate_request(200, 6))
        assert result.last.usage.cached_prompt_tokens == 0


async def test_schedule_says_when_a_request_would_wait_in_the_queue() -> None:
    async with embedded_cluster(prefill=1, decode=1) as cluster:
        ready = await cluster.stub.Schedule(router_pb2.ScheduleRequest(request=generate_request(64, 4)))
        assert not ready.queued and ready.prefill.instance_id == "prefill-0"
        assert ready.phase == "placed"
        waits = await cluster.stub.Schedule(
            router_pb2.ScheduleRequest(request=generate_request(2000, 4, ttft_ms=1.0))
        )
        assert waits.queued and waits.queue_position == 0 and waits.phase == "queued"
        assert "predicted_ttft" in waits.queue_reason and not waits.prefill.instance_id


async def test_slo_class_is_bounded() -> None:
    async with embedded_cluster(prefill=1, decode=1) as cluster:
        request = generate_request(64, 4)
        request.slo_class = "x" * 65
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(cluster.stub, request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "slo_class" in (info.value.details() or "")
        request.slo_class = "chat"
        result = await collect(cluster.stub, request)
        assert len(result.tokens) == 4 and not result.last.usage.late


async def test_prompts_sharing_a_prefix_go_where_it_is_cached() -> None:
    """Live router, approximate prefix source: it hashes each prompt, learns where it sent it, and
    sends the next prompt with the same prefix there, where the sim worker's cache serves it."""
    async with embedded_cluster(
        neutral=3,
        engine_overrides={"prefix_cache_block_tokens": 16},
        scheduler_overrides={"prefix_cache_routing": "approximate", "prefix_block_tokens": 64},
    ) as cluster:
        where: dict[int, set[str]] = {0: set(), 1: set(), 2: set()}
        for k in range(9):
            family, request = prefix_family_request(k)
            result = await collect(cluster.stub, request)
            check_stream(result, 4)
            where[family].add(result.first.route.prefill_instance_id)
        assert all(len(instances) == 1 for instances in where.values()), where
        hits = sum(e.load().prefix_cache_hit_tokens for e in cluster.engines.values())
        assert hits == 6 * 512  # every repeat found its whole 512-token prefix
