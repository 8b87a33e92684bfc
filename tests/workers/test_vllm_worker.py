"""Real vLLM workers (``slo-router worker --engine vllm``) on a tiny model, checked through the Worker service.

Two workers share the module: a prefill instance (``kv_producer``, at most 2
running requests so a burst must wait) and a decode instance
(``kv_consumer``), both with ``ExampleConnector`` on one shared directory and
both reporting to an in-memory CMS. vLLM comes from ``.venv-vllm``; starting
both engines takes most of this module's time.

How the tests know KV was transferred rather than recomputed: the prefill
leaves one folder of per-layer KV files in the shared directory (whole
128-token blocks only), and overwriting those files with zeros changes what
the decode instance generates — it can only change if the decode read them.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from slorouter.v1 import cms_pb2, common_pb2, worker_pb2

from predictor import LatencyPredictor
from router.core.qlm import InstanceModel, QlmConfig, QlmQueue, QlmRequest
from router.core.request import ScheduleInput
from workers.vllm_process import VllmWorkerProcess, stop_workers

from .helpers import Client, StreamResult, generate_request, read_stream
from .vllm_support import (
    CPU_BLOCK_SIZE,
    MAIN_SLO_ROUTER,
    CmsThread,
    build_tiny_model,
    instance_state,
    kv_folders,
    kv_token_counts,
    random_prompt,
    require_vllm_env,
    start_workers,
    zero_kv_files,
)

pytestmark = pytest.mark.vllm

MAX_MODEL_LEN = 1024
PREFILL_MAX_NUM_SEQS = 2


@dataclass
class Cluster:
    model_dir: Path
    shared_dir: Path
    cms: CmsThread
    prefill: VllmWorkerProcess
    decode: VllmWorkerProcess


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    require_vllm_env()
    root = tmp_path_factory.mktemp("vllm")
    model_dir = build_tiny_model(root / "model")
    shared_dir = root / "kv"
    shared_dir.mkdir()
    cms = CmsThread()
    common = [
        "--cms", cms.address, "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-connector", "ExampleConnector", "--kv-shared-dir", str(shared_dir),
    ]  # fmt: skip
    try:
        prefill, decode = start_workers(
            [
                (model_dir, root / "prefill.log", [*common, "--role", "prefill", "--instance-id", "p0",
                                                   "--max-num-seqs", str(PREFILL_MAX_NUM_SEQS)]),
                (model_dir, root / "decode.log", [*common, "--role", "decode", "--instance-id", "d0",
                                                  "--max-num-seqs", "16"]),
            ]
        )  # fmt: skip
    except BaseException:
        cms.stop()
        raise
    yield Cluster(model_dir, shared_dir, cms, prefill, decode)
    codes = stop_workers([prefill, decode])
    cms.stop()
    assert codes == [0, 0], f"workers exited with {codes}:\n{prefill.log_tail(20)}\n{decode.log_tail(20)}"


async def generate(address: str, rid: str, prompt: list[int], max_tokens: int, **kw: object) -> StreamResult:
    async with Client(address) as client:
        return await client.generate(rid, prompt, max_tokens, ignore_eos=True, **kw)


async def prefill_then_decode(cluster: Cluster, rid: str, prompt: list[int], max_tokens: int) -> list[int]:
    """The whole output of a request served in PD mode: first token from Prefill, the rest from Decode."""
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    async with Client(cluster.prefill.address) as p:
        first = await p.stub.Prefill(
            worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling), timeout=30
        )
    assert not first.finished
    assert first.kv_handle
    async with Client(cluster.decode.address) as d:
        rest = await read_stream(
            d.stub.Decode(
                worker_pb2.DecodeRequest(
                    request_id=rid,
                    prompt_token_ids=prompt,
                    sampling=sampling,
                    kv_handle=first.kv_handle,
                    generated_token_ids=[first.first_token_id],
                ),
                timeout=30,
            )
        )
    assert rest.finish_reason == "length"
    return [first.first_token_id, *rest.tokens]


async def test_workers_register_what_vllm_resolved(cluster: Cluster) -> None:
    async with Client(cluster.prefill.address) as client:
        info = await client.stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
    assert info.role == cms_pb2.INSTANCE_ROLE_PREFILL
    assert info.model == str(cluster.model_dir)
    assert info.max_model_len == MAX_MODEL_LEN
    assert info.block_size == CPU_BLOCK_SIZE
    assert info.max_num_batched_tokens > 0
    # VLLM_CPU_KVCACHE_SPACE=1 (GiB) / 2 KiB of KV per token of this model.
    assert info.kv_capacity_tokens == 2**30 // (2 * 2 * 2 * 64 * 4)
    # The worker prints its address before its agent's first registration lands (a few ms).
    state = await instance_state(cluster.cms.address, cluster.decode.address)
    for _ in range(100):
        if state is not None:
            break
        await asyncio.sleep(0.05)
        state = await instance_state(cluster.cms.address, cluster.decode.address)
    assert state is not None
    assert state.metadata.instance_id == "d0"
    assert state.metadata.role == cms_pb2.INSTANCE_ROLE_DECODE
    assert state.metadata.block_size == CPU_BLOCK_SIZE


def test_workers_and_their_engines_run_in_their_own_process_group_within_the_callers_session(
    cluster: Cluster,
) -> None:
    # Its own group: stop() can SIGKILL vLLM's engine processes with it. The caller's session:
    # a session of its own would be a separate scheduler autogroup (see VllmWorkerProcess).
    for worker in (cluster.prefill, cluster.decode):
        pid = worker.proc.pid
        assert os.getpgid(pid) == pid
        assert os.getsid(pid) == os.getsid(0)
        assert len(_members_of_group(pid)) >= 2  # the worker and at least vLLM's engine core


def _members_of_group(pgid: int) -> list[int]:
    """Processes whose process group is ``pgid`` (Linux ``/proc``)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # ended since the listing
                continue
            if int(fields[2]) == pgid:
                members.append(int(entry.name))
    return members


async def test_generate_streams_exactly_max_tokens(cluster: Cluster) -> None:
    prompt = random_prompt(40, seed=1)
    result = await generate(cluster.decode.address, "gen-1", prompt, 12)
    assert len(result.tokens) == 12
    assert result.finish_reason == "length"
    assert result.messages >= 2  # streamed, not one final message
    # Every token of the word-level vocabulary decodes to a word.
    assert len(result.text.split()) == 12
    again = await generate(cluster.prefill.address, "gen-2", prompt, 12)
    assert again.tokens == result.tokens  # greedy: same model, same tokens on either instance
    async with Client(cluster.decode.address) as client:
        by_text = await read_stream(
            client.stub.Generate(generate_request("gen-3", text=result.text, max_tokens=3))
        )
    assert len(by_text.tokens) == 3
    # The engine's steps feed the load (see the status test) without a log line each.
    assert "Iteration(" not in cluster.decode.log_path.read_text(errors="replace")


async def test_streams_serves_many_legs_on_one_call_with_the_same_tokens(cluster: Cluster) -> None:
    prompts = [random_prompt(30 + 5 * i, seed=40 + i) for i in range(4)]
    async with Client(cluster.decode.address) as client:
        call = client.stub.Streams()
        hello = await call.read()
        assert len(hello.updates) == 0
        for i, prompt in enumerate(prompts):
            request = generate_request(f"mux-{i}", prompt, 10, ignore_eos=True)
            await call.write(worker_pb2.StreamCommand(stream_id=i + 1, generate=request))
        tokens: dict[int, list[int]] = {i + 1: [] for i in range(4)}
        finished: set[int] = set()
        for _ in range(200):  # bounded: 4 legs x 10 tokens at most
            if len(finished) == 4:
                break
            batch = await asyncio.wait_for(call.read(), 60)
            for update in batch.updates:
                assert update.error_code == 0, update.error_details
                tokens[update.stream_id].extend(update.token_ids)
                if update.finished:
                    finished.add(update.stream_id)
        call.cancel()
    assert len(finished) == 4
    for i, prompt in enumerate(prompts):
        reference = await generate(cluster.decode.address, f"mux-ref-{i}", prompt, 10)
        assert tokens[i + 1] == reference.tokens


async def test_prefill_on_one_instance_and_decode_on_another_transfer_kv(cluster: Cluster) -> None:
    prompt = random_prompt(300, seed=2)
    before = kv_folders(cluster.shared_dir)
    pd = await prefill_then_decode(cluster, "pd-1", prompt, 10)
    # The prefill exported the prompt's whole blocks (2 x 128 of 300 tokens), one file per layer.
    new = kv_folders(cluster.shared_dir) - before
    assert len(new) == 1
    assert kv_token_counts(cluster.shared_dir / new.pop()) == {
        "model.layers.0.self_attn.attn.safetensors": 256,
        "model.layers.1.self_attn.attn.safetensors": 256,
    }
    reference = await generate(cluster.prefill.address, "pd-1-ref", prompt, 10)
    assert pd == reference.tokens


async def test_decode_reads_the_transferred_kv_instead_of_recomputing(cluster: Cluster) -> None:
    prompt = random_prompt(300, seed=3)
    before = kv_folders(cluster.shared_dir)
    reference = await generate(cluster.prefill.address, "kv-ref", prompt, 10)
    (folder,) = kv_folders(cluster.shared_dir) - before
    sampling = common_pb2.SamplingParams(max_tokens=10, ignore_eos=True)
    async with Client(cluster.prefill.address) as p:
        first = await p.stub.Prefill(
            worker_pb2.PrefillRequest(request_id="kv-1", prompt_token_ids=prompt, sampling=sampling),
            timeout=30,
        )
    assert first.first_token_id == reference.tokens[0]
    # Garbage in the transferred KV must show in the decode's output.
    assert zero_kv_files(cluster.shared_dir / folder) == 2
    async with Client(cluster.decode.address) as d:
        rest = await read_stream(
            d.stub.Decode(
                worker_pb2.DecodeRequest(
                    request_id="kv-1",
                    prompt_token_ids=prompt,
                    sampling=sampling,
                    kv_handle=first.kv_handle,
                    generated_token_ids=[first.first_token_id],
                ),
                timeout=30,
            )
        )
    assert len(rest.tokens) == 9
    assert rest.tokens != reference.tokens[1:]


async def test_pd_with_a_prompt_of_whole_blocks_recomputes_instead_of_crashing(cluster: Cluster) -> None:
    # vLLM 0.32's ExampleConnector would look for KV files it never wrote here (see workers.vllm_connector).
    prompt = random_prompt(2 * CPU_BLOCK_SIZE, seed=4)
    pd = await prefill_then_decode(cluster, "blocks-1", prompt, 6)
    reference = await generate(cluster.prefill.address, "blocks-ref", prompt, 6)
    assert pd == reference.tokens
    assert len((await generate(cluster.decode.address, "blocks-after", prompt, 2)).tokens) == 2


async def test_abort_and_client_cancel_stop_the_request(cluster: Cluster) -> None:
    address = cluster.decode.address
    prompt = random_prompt(20, seed=5)
    async with Client(address) as client:
        call = client.stub.Generate(generate_request("ab-1", prompt, 900, ignore_eos=True), timeout=60)
        tokens: list[int] = []
        reason = ""
        async for msg in call:
            tokens.extend(msg.token_ids)
            if len(tokens) >= 3 and not reason:
                assert (await client.stub.Abort(worker_pb2.AbortRequest(request_id="ab-1"), timeout=5)).found
                reason = "asked"
            if msg.finished:
                reason = msg.finish_reason
        assert reason == "abort"
        assert len(tokens) < 900
        assert not (await client.stub.Abort(worker_pb2.AbortRequest(request_id="ab-1"), timeout=5)).found
        assert not (
            await client.stub.Abort(worker_pb2.AbortRequest(request_id="never-sent"), timeout=5)
        ).found

        # A client that goes away aborts its request on the engine.
        call = client.stub.Generate(generate_request("ab-2", prompt, 900, ignore_eos=True), timeout=60)
        async for _ in call:
            break
        call.cancel()
        deadline = time.monotonic() + 10
        while True:
            state = await instance_state(cluster.cms.address, address)
            assert state is not None
            if state.status.num_decode_requests == 0 and state.status.num_running_requests == 0:
                break
            assert time.monotonic() < deadline, (
                f"the cancelled request is still on the engine: {state.status}"
            )
            await asyncio.sleep(0.05)
        # The id is free again, so the engine no longer holds it.
        assert len((await generate(address, "ab-2", prompt, 2)).tokens) == 2


async def test_bad_requests_get_clear_errors_and_the_worker_keeps_serving(cluster: Cluster) -> None:
    address = cluster.decode.address
    prompt = random_prompt(20, seed=6)
    async with Client(address) as client:
        stub = client.stub

        async def code_of(call: object) -> grpc.StatusCode:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await read_stream(call)
            return info.value.code()

        assert (
            await code_of(stub.Generate(generate_request("bad-1", prompt, 0)))
            == grpc.StatusCode.INVALID_ARGUMENT
        )
        too_long = stub.Generate(generate_request("bad-2", prompt, MAX_MODEL_LEN))
        assert await code_of(too_long) == grpc.StatusCode.INVALID_ARGUMENT
        assert (
            await code_of(stub.Generate(generate_request("bad-3", [], 4))) == grpc.StatusCode.INVALID_ARGUMENT
        )
        out_of_vocab = stub.Generate(generate_request("bad-4", [5, 6, 50_000], 4))
        assert await code_of(out_of_vocab) == grpc.StatusCode.INVALID_ARGUMENT
        sampling = common_pb2.SamplingParams(max_tokens=4, ignore_eos=True)
        foreign = stub.Decode(
            worker_pb2.DecodeRequest(
                request_id="bad-5",
                prompt_token_ids=prompt,
                sampling=sampling,
                kv_handle=b"x",
                generated_token_ids=[7],
            )
        )
        assert await code_of(foreign) == grpc.StatusCode.INVALID_ARGUMENT
        async with Client(cluster.prefill.address) as p:
            first = await p.stub.Prefill(
                worker_pb2.PrefillRequest(request_id="bad-6", prompt_token_ids=prompt, sampling=sampling),
                timeout=30,
            )
        other_prompt = stub.Decode(
            worker_pb2.DecodeRequest(
                request_id="bad-6",
                prompt_token_ids=random_prompt(20, seed=7),
                sampling=sampling,
                kv_handle=first.kv_handle,
                generated_token_ids=[first.first_token_id],
            )
        )
        assert await code_of(other_prompt) == grpc.StatusCode.INVALID_ARGUMENT

        running = stub.Generate(generate_request("dup-1", prompt, 500, ignore_eos=True), timeout=60)
        async for _ in running:
            break
        assert (
            await code_of(stub.Generate(generate_request("dup-1", prompt, 4)))
            == grpc.StatusCode.ALREADY_EXISTS
        )
        running.cancel()
    assert len((await generate(address, "after-bad", prompt, 5)).tokens) == 5


async def test_status_in_the_cms_follows_the_engines_real_load(cluster: Cluster) -> None:
    address = cluster.prefill.address
    n = 3 * PREFILL_MAX_NUM_SEQS
    ids = [f"load-{i}" for i in range(n)]
    tasks = [
        asyncio.create_task(generate(address, rid, random_prompt(64, seed=100 + i), 120))
        for i, rid in enumerate(ids)
    ]
    seen: list[cms_pb2.InstanceStatus] = []
    admitted: set[str] = set()
    samples: list[cms_pb2.StepSample] = []
    try:
        while not all(t.done() for t in tasks):
            state = await instance_state(cluster.cms.address, address)
            assert state is not None and state.has_status
            seen.append(state.status)
            admitted.update(state.status.admitted_request_ids)
            samples.extend(state.status.step_samples)
            await asyncio.sleep(0.02)
        results = await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
    assert all(len(r.tokens) == 120 for r in results)
    # vLLM runs at most max_num_seqs requests; the rest visibly wait, with their prompts as backlog.
    assert max(s.num_running_requests for s in seen) == PREFILL_MAX_NUM_SEQS
    assert max(s.num_waiting_requests for s in seen) >= 2
    assert any(s.num_waiting_requests > 0 and s.num_uncomputed_prefill_tokens >= 64 for s in seen)
    assert max(s.num_decode_requests for s in seen) <= PREFILL_MAX_NUM_SEQS
    assert any(s.num_decode_tokens >= 64 and s.num_used_kv_tokens > 0 for s in seen)
    assert set(ids) <= admitted
    assert samples and max(s.num_decode_requests for s in samples) == PREFILL_MAX_NUM_SEQS
    assert all(s.duration_ms > 0 for s in samples)
    # And it all goes away once the requests are done.
    deadline = time.monotonic() + 5
    while True:
        state = await instance_state(cluster.cms.address, address)
        assert state is not None
        s = state.status
        idle = (
            s.num_running_requests,
            s.num_waiting_requests,
            s.num_decode_requests,
            s.num_uncomputed_prefill_tokens,
        )
        if idle == (0, 0, 0, 0):
            break
        assert time.monotonic() < deadline, f"status did not return to idle: {s}"
        await asyncio.sleep(0.02)


def test_profile_of_a_real_worker_loads_into_the_predictor(cluster: Cluster, tmp_path: Path) -> None:
    out = tmp_path / "profile"
    proc = subprocess.run(
        [
            str(MAIN_SLO_ROUTER), "profile", "--target", cluster.prefill.address, "--out", str(out),
            "--tokens", "64,128,256", "--batch-sizes", "1,2", "--tokens-per-request", "64,128",
            "--repeats", "2", "--decode-tokens", "8",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    predictor = LatencyPredictor.from_files(out / "ttft.json", out / "tpot.json")
    assert predictor.predict_ttft_ms(128, 0, 0, 2048) > 0
    assert predictor.predict_tpot_ms(2, 256) > 0


async def test_router_in_front_of_real_vllm_workers_streams_and_transfers_kv(cluster: Cluster) -> None:
    """Issue 5's PD check end to end: frontend -> router -> vLLM prefill -> KV transfer -> vLLM decode."""
    import random as _random

    from slorouter.v1 import router_pb2, router_pb2_grpc

    from cms.reader import open_reader
    from predictor import LatencyPredictor
    from router.core.config import SchedulerConfig
    from router.core.scheduler import Scheduler
    from router.server import DEFAULT_PROFILE_DIR, start_router_server

    predictor = LatencyPredictor.from_files(
        DEFAULT_PROFILE_DIR / "ttft.json", DEFAULT_PROFILE_DIR / "tpot.json"
    )
    scheduler = Scheduler(SchedulerConfig(scheduling_policy="slo"), predictor, _random.Random(0))
    router = await start_router_server(
        open_reader(f"grpc://{cluster.cms.address}"), scheduler, listen="127.0.0.1:0"
    )
    try:
        assert await router.reader.wait_for_version(1, 10.0)
        prompt = random_prompt(300, seed=11)
        before = kv_folders(cluster.shared_dir)
        async with grpc.aio.insecure_channel(router.address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            request = router_pb2.GenerateRequest(
                request_id="routed-pd",
                prompt_token_ids=prompt,
                sampling=common_pb2.SamplingParams(max_tokens=12, ignore_eos=True),
            )
            messages = [m async for m in stub.Generate(request, timeout=60)]
        tokens = [t for m in messages for t in m.token_ids]
        assert messages[0].route.prefill_instance_id == "p0"
        assert messages[0].route.decode_instance_id == "d0"
        assert len(messages) >= 2 and len(tokens) == 12
        assert messages[-1].finished and messages[-1].finish_reason == "length"
        # The prefill exported the prompt's two whole blocks ...
        assert len(kv_folders(cluster.shared_dir) - before) == 1
        # ... and vLLM on the decode side reports them as not computed there: loaded, not recomputed.
        assert messages[-1].usage.cached_prompt_tokens >= 256
        reference = await generate(cluster.prefill.address, "routed-pd-ref", prompt, 12)
        assert tokens == reference.tokens
    finally:
        await router.stop(grace=0)


#: Nearly the whole context (MAX_MODEL_LEN 1024, a 30-token prompt): the abort, sent after the 4th
#: token and a queue pass, must land mid-stream even when this process is slowed by a loaded machine.
LOOSE_TOKENS = 960


async def test_qlm_eviction_on_vllm_requeues_with_the_generated_tokens(cluster: Cluster) -> None:
    """The qlm queue evicts a loose request running on a real vLLM engine for a tight one, then resumes it.

    One instance with a batch of 1: the loose request runs, a tight one arrives,
    the queue's eviction aborts the loose one on the worker after the tokens the
    client has received; the tight one runs; the loose one is pulled again and
    continues with its generated tokens appended to the prompt (``Decode`` with
    ``generated_token_ids`` and no KV handle: the engine recomputes). Greedy
    decoding makes the whole output checkable against an uninterrupted run.
    """
    address = cluster.decode.address
    prompt = random_prompt(30, seed=21)
    reference = await generate(address, "ev-ref", prompt, LOOSE_TOKENS)
    # The estimator sees a slow instance (1 s per token): the tight request would wait ~20 s behind it.
    queue = QlmQueue(QlmConfig(batch=1), [InstanceModel(1, 1.0, lambda n: 0.01)], 6000.0, 50.0)
    # Its deadline leaves it on time re-run behind the tight one (a stream evicts only such victims).
    queue.push(
        ScheduleInput(
            "ev-loose",
            len(prompt),
            e2e_slo_ms=6_000_000.0,
            max_tokens=LOOSE_TOKENS,
            slo_class="batch",
            arrival_s=0.0,
        ),
        0.0,
    )
    (first,) = queue.pump(0.0)
    assert first.request.request_id == "ev-loose"
    received: list[int] = []
    async with Client(address) as client:
        call = client.stub.Generate(
            generate_request("ev-loose", prompt, LOOSE_TOKENS, ignore_eos=True), timeout=60
        )
        # Read without leaving an `async for`: closing the iterator cancels the call, and the
        # worker would then end the request itself before the eviction's Abort reaches it.
        while len(received) < 4:
            msg = await call.read()
            assert msg is not grpc.aio.EOF, "the stream ended before the eviction"
            received.extend(msg.token_ids)
        # The abort goes out at once: the engine keeps generating meanwhile (a token a millisecond or
        # two on this model), and a queue pass in between could let the whole request finish first on a
        # fast machine (it did once in CI). The queue's bookkeeping below does not touch the worker, so
        # its place before or after the call changes nothing it checks.
        assert (await client.stub.Abort(worker_pb2.AbortRequest(request_id="ev-loose"), timeout=5)).found
        call.cancel()
        tight_prompt = random_prompt(10, seed=22)
        queue.push(
            ScheduleInput(
                "ev-tight",
                10,
                ttft_slo_ms=500.0,
                tpot_slo_ms=50.0,
                max_tokens=4,
                slo_class="chat",
                arrival_s=1.0,
            ),
            1.0,
        )
        evicted: list[str] = []

        def evict(r: QlmRequest, instance: int) -> int:
            evicted.append(r.request_id)
            return len(received)  # what the client has: tokens still in flight are dropped and regenerated

        dispatched = queue.pump(1.0, evict)
        assert evicted == ["ev-loose"]
        assert [d.request.request_id for d in dispatched] == ["ev-tight"]
        tight = await generate(address, "ev-tight", tight_prompt, 4)
        assert len(tight.tokens) == 4
        queue.finished("ev-tight", len(tight.tokens), 2.0)
        (resumed,) = queue.pump(2.0)
        r = resumed.request
        assert r.request_id == "ev-loose" and r.generated == len(received)
        assert r.prompt_tokens == len(prompt) + len(received) and r.max_tokens == LOOSE_TOKENS - len(received)
        rest = await read_stream(
            client.stub.Decode(
                worker_pb2.DecodeRequest(
                    request_id="ev-loose",
                    prompt_token_ids=prompt,
                    sampling=common_pb2.SamplingParams(max_tokens=LOOSE_TOKENS, ignore_eos=True),
                    generated_token_ids=received,
                ),
                timeout=60,
            )
        )
    # Nothing lost, nothing repeated: exactly max_tokens tokens, the same as the uninterrupted run.
    assert len(received) + len(rest.tokens) == LOOSE_TOKENS
    assert received + rest.tokens == reference.tokens
    assert rest.finish_reason == "length"
