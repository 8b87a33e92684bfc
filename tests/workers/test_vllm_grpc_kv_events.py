"""A real stock vLLM engine's KV events in the router's exact prefix index.

One unmodified vLLM gRPC engine (the CPU build, the tiny model) started with
``--kv-events-config`` (vLLM's ZMQ publisher; smg-grpc-servicer relays it on ``SubscribeKvEvents``);
the router's feed (:class:`router.kv_events.KvEventFeed`) follows it and re-hashes vLLM's blocks
into the router's chain hashes (:class:`router.vllm_grpc.KvEventTranslator`). After prompts run on
the engine, the index holds exactly their full 128-token blocks under the names the router gives a
prompt (:func:`fleet.prefix.token_block_hashes`), and a lookup of a prompt that extends one of them
finds the engine holding its prefix.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator

import pytest
from slorouter.v1 import cms_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_pb2_grpc

from fleet.prefix import token_block_hashes
from fleet.snapshot import ClusterSnapshot, InstanceRecord
from router.core.prefix import ExactPrefixIndex
from router.kv_events import KvEventFeed
from router.pool import ChannelPool
from workers.vllm_process import StockEngineProcess, free_port

from .helpers import wait_for
from .vllm_support import Entries, build_tiny_model, random_prompt, require_vllm_env

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

#: vLLM's KV block on CPU (``GetServerInfo.block_size``).
BLOCK = 128


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StockEngineProcess]:
    require_vllm_env()
    root = tmp_path_factory.mktemp("stock-kv")
    model = build_tiny_model(root / "model")
    # vLLM's ZMQ publisher binds the endpoint; the servicer's relay connects to it.
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{free_port()}"}
    proc = StockEngineProcess(
        model,
        root / "engine.log",
        [
            "--dtype",
            "float32",
            "--max-model-len",
            "1024",
            "--enforce-eager",
            "--kv-events-config",
            json.dumps(events),
        ],
        env={"SMG_VLLM_SERVICER_KV_EVENTS": "1"},
    )
    try:
        proc.wait_ready(600)
        yield proc
    finally:
        proc.stop(15)


async def _follow(address: str, log_tail: Callable[[], str]) -> None:
    entries = Entries()
    index = ExactPrefixIndex(BLOCK)
    feed = KvEventFeed(index, ChannelPool(), vllm=entries)
    meta = cms_pb2.InstanceMetadata(instance_id="v0", endpoint=address, worker_protocol="vllm-grpc")
    snapshot = ClusterSnapshot(
        instances=(InstanceRecord(metadata=meta, status=None, status_age_s=0.0),),
        taken_at_s=time.monotonic(),
        version=1,
    )
    prompts = [random_prompt(300, seed) for seed in (1, 2)]
    expected = frozenset(h for p in prompts for h in token_block_hashes(p, BLOCK))
    assert len(expected) == 4  # two full blocks each
    try:
        feed.on_snapshot(snapshot)
        stub = vllm_pb2_grpc.VllmEngineStub(entries.entry("vllm-grpc://" + address)[0])
        await asyncio.sleep(2.0)  # the relay's ZMQ subscription joins (the first events could be missed)
        for k, prompt in enumerate(prompts):
            request = vllm_pb2.GenerateRequest(
                request_id=f"kv-{k}",
                tokenized=vllm_pb2.TokenizedInput(input_ids=prompt),
                sampling_params=vllm_pb2.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                stream=True,
            )
            async for _ in stub.Generate(request, timeout=300):
                pass
        try:
            await wait_for(lambda: expected <= index.blocks_of("v0"), 60, 0.02)
        except AssertionError:
            raise AssertionError(
                f"index {sorted(index.blocks_of('v0'))} lacks {sorted(expected - index.blocks_of('v0'))}; "
                f"feed {feed.counters}; engine log tail: {log_tail()}"
            ) from None
        assert "v0" in feed.live
        # The engine caches nothing else here (outputs are 2 tokens: no further full block).
        assert index.blocks_of("v0") == expected
        longer = [*prompts[1][:256], *random_prompt(200, 9)]
        assert index.matched_blocks(token_block_hashes(longer, BLOCK)) == {"v0": 2}
    finally:
        await feed.stop()
        await entries.close()


def test_a_stock_engines_kv_events_fill_the_exact_index_in_the_routers_hashes(
    engine: StockEngineProcess,
) -> None:
    asyncio.run(_follow(engine.address, lambda: engine.log_tail(20)))
