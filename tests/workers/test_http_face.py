"""The sim worker's OpenAI-compatible HTTP face: the openai client, and the load endpoints HTTP routers poll."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest

from workers.service import WorkerServer

from .conftest import StartWorker

REPO = Path(__file__).resolve().parents[2]


@asynccontextmanager
async def http_worker(
    start_worker: StartWorker, **overrides: Any
) -> AsyncIterator[tuple[WorkerServer, openai.AsyncOpenAI, str]]:
    server = await start_worker(server_kw={"http_listen": "127.0.0.1:0"}, **overrides)
    assert server.http is not None
    base = f"http://{server.http.address}"
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)
    try:
        yield server, client, base
    finally:
        await client.close()


def _gauge(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing from:\n{text}"
    return float(match.group(1))


async def test_completions_and_chat(start_worker: StartWorker) -> None:
    async with http_worker(start_worker) as (_, client, _base):
        models = await client.models.list()
        assert [m.id for m in models.data] == ["sim"]
        plain = await client.completions.create(
            model="sim", prompt="hello", max_tokens=10, seed=1, extra_body={"ignore_eos": True}
        )
        assert plain.usage is not None
        assert (plain.usage.prompt_tokens, plain.usage.completion_tokens) == (5, 10)
        assert plain.choices[0].finish_reason == "length"
        stream = await client.completions.create(
            model="sim",
            prompt="hello",
            max_tokens=10,
            seed=1,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [c async for c in stream]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
        chat = await client.chat.completions.create(
            model="sim",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            extra_body={"ignore_eos": True},
        )
        assert chat.usage is not None and chat.usage.prompt_tokens == len("user: hi\nassistant:")


async def test_load_endpoints_follow_the_engine(start_worker: StartWorker) -> None:
    async with http_worker(start_worker, speed_factor=1.0) as (server, _client, base):
        async with httpx.AsyncClient(timeout=30) as http:
            idle = (await http.get(f"{base}/metrics")).text
            assert _gauge(idle, "vllm:num_requests_running") == 0
            assert _gauge(idle, "vllm:num_requests_waiting") == 0
            assert _gauge(idle, "vllm:kv_cache_usage_perc") == 0
            body = {"model": "sim", "prompt": "x" * 200, "max_tokens": 1000, "ignore_eos": True}
            request = asyncio.ensure_future(http.post(f"{base}/v1/completions", json=body))
            deadline = time.monotonic() + 10
            while True:
                busy = (await http.get(f"{base}/metrics")).text
                if _gauge(busy, "vllm:num_requests_running") == 1:
                    break
                assert time.monotonic() < deadline, "the running request never showed in /metrics"
                await asyncio.sleep(0.01)
            assert 0 < _gauge(busy, "vllm:kv_cache_usage_perc") <= 1
            assert _gauge(busy, "vllm:gpu_cache_usage_perc") == _gauge(busy, "vllm:kv_cache_usage_perc")
            load = (await http.get(f"{base}/get_load")).json()
            assert load["load"] == 1
            info = (await http.get(f"{base}/server_info")).json()
            assert info["instance_id"] == server.instance_id
            assert (await http.get(f"{base}/health")).status_code == 200
            request.cancel()  # the client goes away: the engine must drop the request
            await asyncio.gather(request, return_exceptions=True)
        deadline = time.monotonic() + 10
        while server.engine.load().num_running_requests:
            assert time.monotonic() < deadline, "the abandoned request kept running"
            await asyncio.sleep(0.01)


async def test_metrics_count_prefix_cache_hits_as_vllm_does(start_worker: StartWorker) -> None:
    worker = http_worker(start_worker, speed_factor=50.0, prefix_cache_block_tokens=32)
    async with worker as (_s, _c, base), httpx.AsyncClient(timeout=30) as http:
        shared = "s" * 128
        for tail in ("abc" * 20, "xyz" * 20):
            body = {"model": "sim", "prompt": shared + tail, "max_tokens": 2, "ignore_eos": True}
            assert (await http.post(f"{base}/v1/completions", json=body)).status_code == 200
        text = (await http.get(f"{base}/metrics")).text
    # The byte tokenizer: one token per character; the second prompt finds the 128 shared ones.
    assert _gauge(text, "vllm:prefix_cache_queries_total") == 2 * 188
    assert _gauge(text, "vllm:prefix_cache_hits_total") == 128


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"model": "sim", "prompt": "a", "max_tokens": 100_000}, 400),  # beyond max_model_len
        ({"model": "sim", "prompt": "a" * 5000, "max_tokens": 2}, 400),  # prompt beyond max_model_len
        ({"model": "sim", "messages": []}, 400),
    ],
)
async def test_engine_refusals_are_openai_errors(
    start_worker: StartWorker, body: dict[str, Any], status: int
) -> None:
    async with http_worker(start_worker) as (_, _client, base):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        async with httpx.AsyncClient(timeout=10) as http:
            response = await http.post(base + path, json=body)
        assert response.status_code == status, response.text
        assert response.json()["error"]["message"]


@pytest.mark.timeout(120)
def test_worker_cli_prints_its_http_address() -> None:
    worker = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "worker", "--engine", "sim", "--listen", "127.0.0.1:0",
         "--http-listen", "127.0.0.1:0", "--speed-factor", "20"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        assert worker.stdout is not None
        base = ""
        for _ in range(20):
            line = worker.stdout.readline()
            if line.startswith("worker HTTP API on "):
                base = line.split()[-1]
                break
        assert base.startswith("http://127.0.0.1:")
        response = httpx.post(
            f"{base}/completions", json={"model": "sim", "prompt": "hey", "max_tokens": 3}, timeout=30
        )
        assert response.status_code == 200
        assert json.loads(response.text)["usage"]["prompt_tokens"] == 3
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        if worker.stdout is not None:
            worker.stdout.close()
