"""The Worker gRPC service over sim engines, on loopback with real servers."""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from slorouter.v1 import cms_pb2, common_pb2, worker_pb2

from engine.tokenizer import SimpleTokenizer
from workers.kv_transfer import SimKvHandle
from workers.metadata import WorkerIdentity, WorkerRole
from workers.service import SERVICE_NAME

from .conftest import StartWorker
from .helpers import PREDICTOR, Client, LoadWatcher, generate_request, prompt, read_stream


async def test_generate_streams_exactly_max_tokens(start_worker: StartWorker) -> None:
    server = await start_worker()
    async with Client(server.address) as client:
        result = await client.generate("a", prompt(64), 33)
        by_text = await read_stream(
            client.stub.Generate(generate_request("b", text="hello world", max_tokens=5))
        )
    assert len(result.tokens) == 33 and result.finish_reason == "length"
    assert result.text == SimpleTokenizer().decode(result.tokens)
    assert len(by_text.tokens) == 5


async def test_early_stop_by_eos(start_worker: StartWorker) -> None:
    server = await start_worker(eos_probability=1.0)
    async with Client(server.address) as client:
        result = await client.generate("a", prompt(8), 10)
    assert result.finish_reason == "stop" and len(result.tokens) == 1


async def test_prefill_on_one_worker_and_decode_on_another_equals_generate(start_worker: StartWorker) -> None:
    p_server = await start_worker()
    d_server = await start_worker()
    prompt_ids = prompt(300)
    sampling = common_pb2.SamplingParams(max_tokens=24, seed=11)
    async with Client(p_server.address) as p, Client(d_server.address) as d:
        reference = await read_stream(
            d.stub.Generate(
                worker_pb2.WorkerGenerateRequest(
                    request_id="ref", prompt_token_ids=prompt_ids, sampling=sampling
                )
            )
        )
        first = await p.stub.Prefill(
            worker_pb2.PrefillRequest(request_id="pd", prompt_token_ids=prompt_ids, sampling=sampling),
            timeout=10,
        )
        assert not first.finished and first.num_prompt_tokens == 300
        assert p_server.engine.load().num_used_kv_tokens >= 300  # held for the decode side
        handle = SimKvHandle.decode(first.kv_handle)
        assert handle.endpoint == p_server.address and handle.num_tokens == 300
        rest = await read_stream(
            d.stub.Decode(
                worker_pb2.DecodeRequest(
                    request_id="pd",
                    prompt_token_ids=prompt_ids,
                    sampling=sampling,
                    kv_handle=first.kv_handle,
                    generated_token_ids=[first.first_token_id],
                ),
                timeout=10,
            )
        )
        # Pulled: the prefill side freed it, so a second pull fails cleanly.
        assert p_server.engine.load().num_used_kv_tokens == 0
        with pytest.raises(grpc.aio.AioRpcError) as again:
            await read_stream(
                d.stub.Decode(
                    worker_pb2.DecodeRequest(
                        request_id="pd2",
                        prompt_token_ids=prompt_ids,
                        sampling=sampling,
                        kv_handle=first.kv_handle,
                        generated_token_ids=[first.first_token_id],
                    ),
                    timeout=10,
                )
            )
    assert [first.first_token_id, *rest.tokens] == reference.tokens
    assert first.text + rest.text == reference.text
    assert rest.finish_reason == "length"
    assert again.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no longer holds" in (again.value.details() or "")
    # The decode side prefilled nothing: its steps were decode steps only.
    decode_steps = d_server.engine.load().recent_steps[-len(rest.tokens) :]
    assert all(s.num_prefill_tokens == 0 for s in decode_steps)


async def test_abort_stops_a_stream_and_frees_its_kv(start_worker: StartWorker) -> None:
    server = await start_worker()
    watcher = LoadWatcher(server.engine)
    async with Client(server.address) as client:
        call = client.stub.Generate(generate_request("long", prompt(200), max_tokens=3000))
        reader = asyncio.create_task(read_stream(call))
        await watcher.until(
            lambda: server.engine.load().num_decode_requests == 1 and server.engine.load().num_steps > 2
        )
        assert server.engine.load().num_used_kv_tokens > 0
        response = await client.stub.Abort(worker_pb2.AbortRequest(request_id="long"), timeout=5)
        result = await reader
        missing = await client.stub.Abort(worker_pb2.AbortRequest(request_id="long"), timeout=5)
    assert response.found and not missing.found
    assert result.finish_reason == "abort" and len(result.tokens) < 3000
    assert server.engine.load().num_used_kv_tokens == 0


async def test_client_cancel_aborts_on_the_engine(start_worker: StartWorker) -> None:
    server = await start_worker()
    watcher = LoadWatcher(server.engine)
    async with Client(server.address) as client:
        call = client.stub.Generate(generate_request("c", prompt(100), max_tokens=3000))
        await call.read()
        call.cancel()
        await watcher.until(lambda: not server.engine.core.has_unfinished)
    assert server.engine.load().num_used_kv_tokens == 0


async def test_kv_exhaustion_preempts_without_losing_a_request(start_worker: StartWorker) -> None:
    server = await start_worker(
        kv_capacity_tokens=2048, max_model_len=1024, block_size=16, max_num_seqs=16, speed_factor=200.0
    )
    async with Client(server.address) as client:
        results = await asyncio.gather(*(client.generate(f"r{i}", prompt(300, i), 200) for i in range(10)))
    assert server.engine.core.num_preemptions > 0
    assert all(len(r.tokens) == 200 and r.finish_reason == "length" for r in results)
    assert server.engine.load().num_used_kv_tokens == 0


async def test_lone_request_ttft_and_tpot_match_the_profile(start_worker: StartWorker) -> None:
    speed = 2.0
    server = await start_worker(speed_factor=speed)
    async with Client(server.address) as client:
        await client.generate("warm-up", prompt(16), 2)
        start = time.perf_counter()
        result = await client.generate("lone", prompt(1024), 40)
    ttft_ms = (result.arrivals[0] - start) * 1000
    profile_ms = float(PREDICTOR.ttft_profile.grid(1024.0)) / speed
    # Never sooner than the profile; later by at most 10 % plus the loopback call and the event
    # loop's turn, which on a shared 2-core host under the whole suite took up to 8 ms more.
    assert profile_ms * 0.9 <= ttft_ms <= profile_ms * 1.1 + 10.0
    assert result.messages == 40  # a prompt reader gets one token per message
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(result.arrivals)]
    assert statistics.median(gaps) == pytest.approx(PREDICTOR.predict_tpot_ms(1, 1044) / speed, rel=0.1)


def _decode_request(rid: str, handle: bytes, ids: tuple[int, ...], **kw: object) -> worker_pb2.DecodeRequest:
    return worker_pb2.DecodeRequest(
        request_id=rid,
        prompt_token_ids=list(ids),
        sampling=common_pb2.SamplingParams(max_tokens=8),
        kv_handle=handle,
        generated_token_ids=[65],
        **kw,  # type: ignore[arg-type]
    )


async def test_bad_input_gets_clear_errors_while_others_are_served(start_worker: StartWorker) -> None:
    server = await start_worker(max_model_len=2048, kv_hold_timeout_s=0.05)
    watcher = LoadWatcher(server.engine)
    async with Client(server.address) as client:
        # Another request keeps streaming throughout.
        busy = asyncio.create_task(client.generate("busy", prompt(64), 400))
        await watcher.until(lambda: server.engine.core.is_active("busy"))

        async def code_of(call: object) -> tuple[grpc.StatusCode, str]:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await read_stream(call) if hasattr(call, "read") else await call  # type: ignore[misc]
            return info.value.code(), info.value.details() or ""

        cases = [
            (client.stub.Generate(generate_request("e1", (), 5)), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
            (
                client.stub.Generate(generate_request("e2", prompt(5), 0)),
                grpc.StatusCode.INVALID_ARGUMENT,
                "max_tokens",
            ),
            (
                client.stub.Generate(generate_request("e3", prompt(5), 4000)),
                grpc.StatusCode.INVALID_ARGUMENT,
                "max_model_len",
            ),
            (
                client.stub.Generate(generate_request("e4", prompt(5), 5, text="x")),
                grpc.StatusCode.INVALID_ARGUMENT,
                "exactly one",
            ),
            (
                client.stub.Prefill(
                    worker_pb2.PrefillRequest(
                        request_id="e5", sampling=common_pb2.SamplingParams(max_tokens=3)
                    )
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
                "prompt",
            ),
            (
                client.stub.Generate(generate_request("", prompt(5), 5)),
                grpc.StatusCode.INVALID_ARGUMENT,
                "request_id",
            ),
            (
                client.stub.Generate(generate_request("busy", prompt(5), 5)),
                grpc.StatusCode.ALREADY_EXISTS,
                "busy",
            ),
            (
                client.stub.Decode(_decode_request("e6", b"not a handle", prompt(5))),
                grpc.StatusCode.INVALID_ARGUMENT,
                "kv_handle",
            ),
        ]
        unknown = SimKvHandle(server.address, "someone-else", "ghost", "00", 5, _digest(prompt(5))).encode()
        cases.append(
            (
                client.stub.Decode(_decode_request("e7", unknown, prompt(5))),
                grpc.StatusCode.NOT_FOUND,
                "ghost",
            )
        )
        for call, code, needle in cases:
            got, details = await code_of(call)
            assert got == code, (needle, details)
            assert needle in details

        # An expired handle: the prefill's KV was freed by the hold timeout.
        first = await client.stub.Prefill(
            worker_pb2.PrefillRequest(
                request_id="exp",
                prompt_token_ids=prompt(32),
                sampling=common_pb2.SamplingParams(max_tokens=8),
            ),
            timeout=5,
        )
        await watcher.until(lambda: not server.engine.core.is_held("exp"))
        got, details = await code_of(client.stub.Decode(_decode_request("exp", first.kv_handle, prompt(32))))
        assert got == grpc.StatusCode.NOT_FOUND and "no longer held" in details

        result = await busy
    assert len(result.tokens) == 400 and result.finish_reason == "length"


def _digest(ids: tuple[int, ...]) -> str:
    from workers.sim_engine import prompt_digest

    return prompt_digest(ids).hex()


async def test_unreachable_prefill_instance_is_not_found(start_worker: StartWorker) -> None:
    p = await start_worker()
    d = await start_worker()
    async with Client(p.address) as pc, Client(d.address) as dc:
        first = await pc.stub.Prefill(
            worker_pb2.PrefillRequest(
                request_id="x", prompt_token_ids=prompt(32), sampling=common_pb2.SamplingParams(max_tokens=8)
            ),
            timeout=5,
        )
        await p.stop(0)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await read_stream(dc.stub.Decode(_decode_request("x", first.kv_handle, prompt(32)), timeout=10))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "cannot reach the prefill instance" in (info.value.details() or "")


async def test_health_reflection_and_info(start_worker: StartWorker) -> None:
    identity = WorkerIdentity(instance_id="w1", role=WorkerRole.DECODE, node_id="n1", unit_id="u1")
    server = await start_worker(server_kw={"identity": identity}, max_num_batched_tokens=1024)
    async with Client(server.address) as client:
        health = health_pb2_grpc.HealthStub(client.channel)
        for service in ("", SERVICE_NAME):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(client.channel)
        names: list[str] = []
        async for resp in refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        ):
            names.extend(s.name for s in resp.list_services_response.service)
        info = await client.stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
    assert SERVICE_NAME in names and "grpc.health.v1.Health" in names
    assert info.instance_id == "w1" and info.role == cms_pb2.INSTANCE_ROLE_DECODE
    assert info.endpoint == server.address and info.node_id == "n1" and info.unit_id == "u1"
    assert info.max_num_batched_tokens == 1024 and info.kv_capacity_tokens == 32768 and info.block_size == 16
    assert info.max_model_len == 4096 and info.model == "sim"


async def test_stop_is_graceful_and_idempotent(start_worker: StartWorker) -> None:
    server = await start_worker()
    async with Client(server.address) as client:
        await client.generate("a", prompt(8), 3)
    await asyncio.gather(server.stop(0.5), server.stop(0.5))
    await server.stop()


async def test_stream_interval_merges_steps_into_fewer_messages(start_worker: StartWorker) -> None:
    # Steps of well under a millisecond against a 100 ms interval: the 64 tokens must arrive in a
    # few messages, every token exactly once and in order (the same tokens as one message per step).
    plain = await start_worker(speed_factor=50.0)
    spaced = await start_worker(speed_factor=50.0, server_kw={"stream_interval_s": 0.1})
    async with Client(plain.address) as a, Client(spaced.address) as b:
        every_step = await read_stream(
            a.stub.Generate(generate_request("s", prompt(16), 64, ignore_eos=True))
        )
        merged = await read_stream(b.stub.Generate(generate_request("s", prompt(16), 64, ignore_eos=True)))
    assert merged.tokens == every_step.tokens and len(merged.tokens) == 64
    assert merged.text == every_step.text and merged.finish_reason == "length"
    assert merged.messages < every_step.messages / 4, (merged.messages, every_step.messages)


async def test_stream_interval_is_bounded(start_worker: StartWorker) -> None:
    for bad in (-0.001, 1.5, float("nan")):
        with pytest.raises(ValueError, match="stream_interval_s"):
            await start_worker(server_kw={"stream_interval_s": bad})


async def test_generate_reports_the_prompt_tokens_its_prefix_cache_spared(start_worker: StartWorker) -> None:
    """A sim worker caching prompt blocks says, on a Generate's first message, how much of the prompt
    its cache held (``num_cached_prompt_tokens``, as a vLLM engine reports ``num_cached_tokens``):
    what a router compares with what its prefix index predicted, request by request."""
    server = await start_worker(prefix_cache_block_tokens=32, block_size=16)
    shared = prompt(96)
    async with Client(server.address) as client:

        async def first_cached(rid: str, ids: tuple[int, ...]) -> int:
            messages = [m async for m in client.stub.Generate(generate_request(rid, ids, 4))]
            assert sum(len(m.token_ids) for m in messages) == 4
            assert all(m.num_cached_prompt_tokens == 0 for m in messages[1:])  # the first message only
            return int(messages[0].num_cached_prompt_tokens)

        cold = await first_cached("a", shared + prompt(40, 100))
        warm = await first_cached("b", shared + prompt(40, 200))
        # Three whole 32-token blocks of the 96 shared tokens; the rest differs.
        whole = await first_cached("c", shared + prompt(40, 200))
    assert (cold, warm) == (0, 96)
    assert whole == 128  # b's first 128 tokens are four whole blocks (its last 8 tokens a partial one)
    assert server.engine.load().prefix_cache_hit_tokens == 96 + 128
    assert not server.engine._prefix_hits  # nothing kept once reported
