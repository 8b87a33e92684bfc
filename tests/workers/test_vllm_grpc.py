"""A stock vLLM fleet behind the router: vLLM's own gRPC server, ``slo-router agent``, CMS, router.

Three unmodified engines (``python -m vllm.entrypoints.launchers.grpc_server``, the server
``vllm serve --grpc`` runs) on the tiny model, all with vLLM's ExampleConnector on one shared
directory (it keys KV by the prompt's tokens, so it moves KV between engines on CPU). They are
registered twice, by ``slo-router agent`` processes, in two CMSes: as prefill A + decode B and C
(PD), and as neutral B and C. Routers run in the test. Engines start once for the module (about
30-60 s on two cores); the test that kills an engine runs last.

The routers read vLLM's streams with ``--vllm-transport h2`` (the default); run the module again
with ``SLO_ROUTER_TEST_VLLM_TRANSPORT=grpc`` for the ``grpc.aio`` reader.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import grpc
import httpx2 as httpx
import pytest
from slorouter.v1 import common_pb2, router_pb2, router_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_pb2_grpc

from cms.reader import open_reader
from predictor import LatencyPredictor
from router.core.config import SchedulerConfig
from router.core.scheduler import Scheduler
from router.server import RouterServer, start_router_server
from router.service import ServiceConfig
from router.tokenize import load_tokenizer
from router.vllm_grpc import VLLM_TRANSPORTS
from workers.sim_engine import DEFAULT_PROFILE_DIR
from workers.vllm_process import StockEngineProcess, start_stock_engines

from .vllm_support import CmsThread, build_tiny_model, random_prompt, require_vllm_env

# The fixture starts three engines at once: about 30-60 s on an idle 2-core host, minutes on a busy one.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PREDICTOR = LatencyPredictor.from_files(DEFAULT_PROFILE_DIR / "ttft.json", DEFAULT_PROFILE_DIR / "tpot.json")
SLO_ROUTER = Path(sys.executable).parent / "slo-router"
#: The router's default --instance-staleness-seconds: the bound a hung engine must leave placement in.
STALENESS_S = SchedulerConfig().instance_staleness_s
#: ``--vllm-transport`` of the routers under test (see the module docstring).
TRANSPORT = os.environ.get("SLO_ROUTER_TEST_VLLM_TRANSPORT", VLLM_TRANSPORTS[0])
if TRANSPORT not in VLLM_TRANSPORTS:
    raise ValueError(
        f"SLO_ROUTER_TEST_VLLM_TRANSPORT={TRANSPORT!r}: expected one of {', '.join(VLLM_TRANSPORTS)}"
    )


@dataclass
class StockFleet:
    model: Path
    kv_dir: Path
    engines: dict[str, StockEngineProcess]  # "a", "b", "c"
    cms_pd: CmsThread
    cms_neutral: CmsThread
    agents: list[subprocess.Popen[bytes]]


def _engine_args(kv_dir: Path) -> list[str]:
    connector = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(kv_dir)},
    }
    return [
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "1024",
        "--kv-transfer-config",
        json.dumps(connector),
    ]


def _agent(
    engine: StockEngineProcess, cms: CmsThread, instance_id: str, role: str, log: Path
) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            [
                str(SLO_ROUTER),
                "agent",
                "--engine",
                engine.address,
                "--cms",
                cms.address,
                "--instance-id",
                instance_id,
                "--role",
                role,
                "--poll-interval-s",
                "0.1",
                "--probe-timeout-s",
                "0.5",
                "--heartbeat-interval-s",
                "0.2",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StockFleet]:
    require_vllm_env()
    root = tmp_path_factory.mktemp("stock")
    model = build_tiny_model(root / "model")
    kv_dir = root / "kv"
    kv_dir.mkdir()
    names = ("a", "b", "c")
    engines = dict(
        zip(
            names,
            start_stock_engines(
                [(model, root / f"engine-{n}.log", _engine_args(kv_dir)) for n in names], timeout_s=600
            ),
            strict=True,
        )
    )
    cms_pd, cms_neutral = CmsThread(), CmsThread()
    agents = [
        _agent(engines["a"], cms_pd, "p-a", "prefill", root / "agent-pa.log"),
        _agent(engines["b"], cms_pd, "d-b", "decode", root / "agent-db.log"),
        _agent(engines["c"], cms_pd, "d-c", "decode", root / "agent-dc.log"),
        _agent(engines["b"], cms_neutral, "n-b", "neutral", root / "agent-nb.log"),
        _agent(engines["c"], cms_neutral, "n-c", "neutral", root / "agent-nc.log"),
    ]
    try:
        yield StockFleet(model, kv_dir, engines, cms_pd, cms_neutral, agents)
    finally:
        for agent in agents:
            agent.terminate()
        for agent in agents:
            try:
                agent.wait(10)
            except subprocess.TimeoutExpired:
                agent.kill()
        for engine in engines.values():
            engine.stop(15)
        cms_pd.stop()
        cms_neutral.stop()


@asynccontextmanager
async def router_on(fleet: StockFleet, cms: CmsThread, n: int) -> AsyncIterator[RouterServer]:
    """A router over ``cms``'s view (load-balance), once it sees ``n`` schedulable instances."""
    router = await start_router_server(
        open_reader(f"grpc://{cms.address}"),
        Scheduler(SchedulerConfig(scheduling_policy="load-balance"), PREDICTOR, random.Random(0)),
        listen="127.0.0.1:0",
        service_config=ServiceConfig(max_retries=2, prefill_timeout_s=30, stream_timeout_s=60),
        tokenizer=load_tokenizer(fleet.model),
        http_listen="127.0.0.1:0",
        vllm_transport=TRANSPORT,
    )
    try:
        await wait_for(lambda: _schedulable(router) >= n, 60, f"{n} schedulable instances in the view")
        yield router
    finally:
        await router.stop(grace=0)


def _schedulable(router: RouterServer) -> int:
    return sum(1 for r in router.reader.snapshot().instances if r.status is not None and r.status.schedulable)


async def wait_for(condition: object, timeout_s: float, what: str) -> float:
    """Poll ``condition()`` until true; the seconds it took. AssertionError after ``timeout_s``."""
    started = time.monotonic()
    while not condition():  # type: ignore[operator]
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.05)
    return time.monotonic() - started


async def direct(engine: StockEngineProcess, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """The engine's own greedy output for ``prompt``, asked directly over its gRPC service."""
    async with grpc.aio.insecure_channel(engine.address) as channel:
        stub = vllm_pb2_grpc.VllmEngineStub(channel)
        tokens: list[int] = []
        request = vllm_pb2.GenerateRequest(
            request_id=f"direct-{time.monotonic_ns()}",
            tokenized=vllm_pb2.TokenizedInput(input_ids=prompt),
            sampling_params=vllm_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            stream=True,
        )
        async for response in stub.Generate(request, timeout=60):
            if response.HasField("chunk"):
                tokens.extend(response.chunk.token_ids)
        return tokens


async def running(engine: StockEngineProcess) -> int:
    async with grpc.aio.insecure_channel(engine.address) as channel:
        loads = await vllm_pb2_grpc.VllmEngineStub(channel).GetLoads(vllm_pb2.GetLoadsRequest(), timeout=5)
        return sum(load.num_running_reqs for load in loads.loads)


def request(prompt: Sequence[int], max_tokens: int) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


async def generate(
    router: RouterServer, req: router_pb2.GenerateRequest
) -> list[router_pb2.GenerateResponse]:
    async with grpc.aio.insecure_channel(router.address) as channel:
        return [m async for m in router_pb2_grpc.RouterStub(channel).Generate(req, timeout=120)]


def tokens_of(messages: Sequence[router_pb2.GenerateResponse]) -> list[int]:
    out: list[int] = []
    for m in messages:
        assert m.first_token_index == len(out), "a token was lost or repeated"
        out.extend(m.token_ids)
    return out


async def test_neutral_grpc_and_http_equal_the_engines_own_output(fleet: StockFleet) -> None:
    prompt = random_prompt(150, seed=1)
    expected = await direct(fleet.engines["b"], prompt, 24)
    assert len(expected) == 24
    tokenizer = load_tokenizer(fleet.model)
    async with router_on(fleet, fleet.cms_neutral, 2) as router:
        messages = await generate(router, request(prompt, 24))
        assert tokens_of(messages) == expected
        assert messages[0].route.decode_instance_id in {"n-b", "n-c"}
        assert messages[-1].finished and messages[-1].finish_reason == "length"
        # The text the router writes from token ids is the tokenizer's text of the continuation.
        want_text = tokenizer.decode([*prompt, *expected])[len(tokenizer.decode(list(prompt))) :]
        assert "".join(m.text for m in messages) == want_text

        assert router.http is not None
        async with httpx.AsyncClient(base_url=f"http://{router.http.address}", timeout=60) as client:
            body = {
                "model": str(fleet.model),
                "prompt": prompt,
                "max_tokens": 24,
                "temperature": 0,
                "ignore_eos": True,
            }
            reply = (await client.post("/v1/completions", json=body)).json()
            assert "choices" in reply, reply
            assert reply["choices"][0]["text"] == want_text
            assert reply["usage"]["completion_tokens"] == 24
            # Streamed: the pieces add up to the same text.
            pieces: list[str] = []
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
                async for line in stream.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        pieces.extend(c["text"] for c in json.loads(line[6:])["choices"])
            assert "".join(pieces) == want_text


async def test_pd_through_the_kv_connector_equals_the_engines_own_output(fleet: StockFleet) -> None:
    prompt = random_prompt(300, seed=2)  # two whole 128-token blocks to transfer
    before = {p.name for p in fleet.kv_dir.iterdir()}
    async with router_on(fleet, fleet.cms_pd, 3) as router:
        messages = await generate(router, request(prompt, 32))
    route = messages[0].route
    assert route.prefill_instance_id == "p-a"
    assert route.decode_instance_id in {"d-b", "d-c"}
    # The prefill engine stored the prompt's KV; the decode engine loaded it rather than computing it.
    assert {p.name for p in fleet.kv_dir.iterdir()} - before
    assert messages[-1].usage.cached_prompt_tokens >= 256
    assert tokens_of(messages) == await direct(fleet.engines["b"], prompt, 32)


async def test_client_cancel_aborts_the_engines_request(fleet: StockFleet) -> None:
    prompt = random_prompt(40, seed=3)
    async with (
        router_on(fleet, fleet.cms_neutral, 2) as router,
        grpc.aio.insecure_channel(router.address) as ch,
    ):
        call = router_pb2_grpc.RouterStub(ch).Generate(request(prompt, 900), timeout=120)
        first = cast(router_pb2.GenerateResponse, await call.read())
        engine = fleet.engines[first.route.decode_instance_id.removeprefix("n-")]
        for _ in range(3):
            await call.read()
        assert await running(engine) == 1
        call.cancel()
        for _ in range(100):
            if await running(engine) == 0:
                break
            await asyncio.sleep(0.1)
        assert await running(engine) == 0, "the engine kept running the cancelled request"


async def test_an_engine_that_stops_answering_health_checks_stops_receiving_requests(
    fleet: StockFleet,
) -> None:
    async with router_on(fleet, fleet.cms_neutral, 2) as router:
        c = fleet.engines["c"]
        c.pause()
        try:
            took = await wait_for(lambda: _schedulable(router) == 1, STALENESS_S, "n-c leaves placement")
            print(f"hung engine left placement {took:.2f} s after it stopped answering")
            for i in range(4):
                messages = await generate(router, request(random_prompt(20, seed=10 + i), 4))
                assert messages[0].route.decode_instance_id == "n-b"
        finally:
            c.resume()
        await wait_for(lambda: _schedulable(router) == 2, 30, "n-c back in placement")


async def test_killing_the_decode_engine_mid_stream_resumes_without_losing_a_token(fleet: StockFleet) -> None:
    # Runs last: it kills an engine for good.
    prompt = random_prompt(200, seed=4)
    expected = await direct(fleet.engines["b"], prompt, 160)
    async with router_on(fleet, fleet.cms_pd, 3) as router, grpc.aio.insecure_channel(router.address) as ch:
        call = router_pb2_grpc.RouterStub(ch).Generate(request(prompt, 160), timeout=120)
        messages = [cast(router_pb2.GenerateResponse, await call.read())]
        while len(tokens_of(messages)) < 8:  # the prefill's token, then some of the decode engine's
            messages.append(cast(router_pb2.GenerateResponse, await call.read()))
        decode_id = messages[0].route.decode_instance_id
        fleet.engines[decode_id.removeprefix("d-")].kill()
        while (message := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
            messages.append(cast(router_pb2.GenerateResponse, message))
    got = tokens_of(messages)
    assert messages[-1].finished
    assert got == expected
