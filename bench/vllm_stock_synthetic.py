"""A synthetic engine speaking vLLM's gRPC service, for measuring the router's own cost per token.

Not a model and not a stand-in for vLLM in any test of behaviour: it exists so that
``bench.vllm_stock_ab --engine synthetic:STEP_MS`` can compare router builds on a token cadence
that does not move with the host's load. A real CPU engine on a shared 2-core host slows down
when the neighbours work, each stream's tokens then arrive further apart, the relay merges more
of them, and the router's CPU per token falls for reasons that are not the router's. Here the
engine is a loop that, every ``STEP_MS``, gives each running request one token and sends it as
its own ``GenerateResponse`` chunk — what vLLM's ``Generate`` does per engine step — and ends a
request with ``GenerateComplete`` after ``max_tokens``. A new request gets its first token at the
next step. ``GetLoads``, ``GetServerInfo``, ``GetModelInfo``, ``HealthCheck`` and ``Abort``
answer with the fields ``slo-router agent`` reads, so the agent registers it as usual.

    python -m bench.vllm_stock_synthetic --port 18650 --step-ms 8
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_pb2_grpc

KV_TOKENS = 524_288
BLOCK = 16
MAX_MODEL_LEN = 1024
VOCAB = 1000


class _Request:
    __slots__ = ("emitted", "last", "limit", "prompt", "queue")

    def __init__(self, prompt: int, limit: int, seed: int) -> None:
        self.prompt = prompt
        self.limit = limit
        self.emitted = 0
        self.last = seed
        self.queue: asyncio.Queue[int | None] = asyncio.Queue()


class SyntheticEngine(vllm_pb2_grpc.VllmEngineServicer):  # type: ignore[misc]
    """One token per running request per step (see the module docstring)."""

    def __init__(self, step_s: float, model: str) -> None:
        self.step_s = step_s
        self.model = model
        self.running: dict[str, _Request] = {}
        self.started = time.time()

    async def steps(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            next_at += self.step_s
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            for request_id, req in list(self.running.items()):
                req.last = (req.last * 31 + 7) % VOCAB + 4
                req.emitted += 1
                req.queue.put_nowait(req.last)
                if req.emitted >= req.limit:
                    del self.running[request_id]
                    req.queue.put_nowait(None)

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        prompt = len(request.tokenized.input_ids) or len(request.text.split())
        limit = max(1, request.sampling_params.max_tokens or 16)
        seed = sum(request.tokenized.input_ids[-4:]) if request.tokenized.input_ids else 1
        req = _Request(prompt, limit, seed)
        self.running[request.request_id] = req
        ids: list[int] = []
        try:
            while (token := await req.queue.get()) is not None:
                ids.append(token)
                if request.stream:
                    yield vllm_pb2.GenerateResponse(
                        chunk=vllm_pb2.GenerateStreamChunk(
                            token_ids=[token], prompt_tokens=prompt, completion_tokens=len(ids)
                        )
                    )
            yield vllm_pb2.GenerateResponse(
                complete=vllm_pb2.GenerateComplete(
                    output_ids=[] if request.stream else ids,
                    finish_reason="length",
                    prompt_tokens=prompt,
                    completion_tokens=len(ids),
                )
            )
        finally:
            self.running.pop(request.request_id, None)

    async def Abort(self, request: Any, context: Any) -> Any:
        for request_id in request.request_ids:
            req = self.running.pop(request_id, None)
            if req is not None:
                req.queue.put_nowait(None)
        return vllm_pb2.AbortResponse()

    async def HealthCheck(self, request: Any, context: Any) -> Any:
        return vllm_pb2.HealthCheckResponse(healthy=True, message="Health")

    async def GetModelInfo(self, request: Any, context: Any) -> Any:
        return vllm_pb2.GetModelInfoResponse(
            model_path=self.model,
            served_model_name=self.model,
            is_generation=True,
            max_context_length=MAX_MODEL_LEN,
            vocab_size=VOCAB,
        )

    async def GetServerInfo(self, request: Any, context: Any) -> Any:
        return vllm_pb2.GetServerInfoResponse(
            active_requests=len(self.running),
            server_type="vllm-grpc",
            block_size=BLOCK,
            uptime_seconds=time.time() - self.started,
        )

    async def GetLoads(self, request: Any, context: Any) -> Any:
        used = sum(r.prompt + r.emitted for r in self.running.values())
        load = vllm_pb2.SchedulerLoad(
            num_running_reqs=len(self.running),
            max_total_num_tokens=KV_TOKENS,
            num_used_tokens=used,
            token_usage=used / KV_TOKENS,
            gen_throughput=len(self.running) / self.step_s,
        )
        return vllm_pb2.GetLoadsResponse(timestamp=f"{time.time():.6f}", dp_rank_count=1, loads=[load])


async def serve(port: int, step_s: float, model: str) -> None:
    server = grpc.aio.server()
    engine = SyntheticEngine(step_s, model)
    vllm_pb2_grpc.add_VllmEngineServicer_to_server(engine, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(
        f"synthetic vLLM engine on 127.0.0.1:{bound}, one token per request every {step_s * 1000:g} ms",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stepper = loop.create_task(engine.steps())
    await stop.wait()
    stepper.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await stepper
    await server.stop(None)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.vllm_stock_synthetic", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--step-ms", type=float, default=8.0, help="time between tokens of a request (default: 8)"
    )
    parser.add_argument("--model", default="synthetic")
    options = parser.parse_args()
    if not 0.5 <= options.step_ms <= 10_000:
        parser.error(f"--step-ms {options.step_ms}: must be within 0.5-10000")
    asyncio.run(serve(options.port, options.step_ms / 1000, options.model))


if __name__ == "__main__":
    main()
