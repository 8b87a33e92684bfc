"""Small builders for the worker tests: sim engines, servers, clients, and waiting on conditions."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from slorouter.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from engine.interface import Sampling, TokenDelta
from engine.model import SimConfig
from predictor import LatencyPredictor
from workers.sim_engine import DEFAULT_PROFILE_DIR, SimEngine

PREDICTOR = LatencyPredictor.from_files(DEFAULT_PROFILE_DIR / "ttft.json", DEFAULT_PROFILE_DIR / "tpot.json")


def make_config(**overrides: Any) -> SimConfig:
    """A small, fast engine: 20x faster than the bundled profile unless told otherwise."""
    values: dict[str, Any] = {"speed_factor": 20.0, "max_model_len": 4096, "kv_capacity_tokens": 32768}
    values.update(overrides)
    return SimConfig(**values)


def make_engine(**overrides: Any) -> SimEngine:
    return SimEngine(make_config(**overrides), PREDICTOR)


def prompt(n: int, start: int = 1) -> tuple[int, ...]:
    return tuple((start + i) % 250 + 1 for i in range(n))


def sampling(max_tokens: int, **kw: Any) -> Sampling:
    return Sampling(max_tokens=max_tokens, **kw)


async def drain(stream: AsyncIterator[TokenDelta]) -> tuple[list[int], str, str, int]:
    """(token ids, text, finish reason, number of deltas) of a whole engine stream."""
    tokens: list[int] = []
    text: list[str] = []
    reason = ""
    count = 0
    async for delta in stream:
        count += 1
        tokens.extend(delta.token_ids)
        text.append(delta.text)
        if delta.finished:
            reason = delta.finish_reason
    return tokens, "".join(text), reason, count


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0, interval_s: float = 0.002) -> None:
    """Wait until ``predicate()`` holds; fail after ``timeout_s`` (a bounded loop, not a fixed sleep)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(interval_s)


class LoadWatcher:
    """Wakes waiters when an engine reports a load change (event-driven waiting)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._changed = asyncio.Event()
        engine.add_load_listener(self._changed.set)

    async def until(self, predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
        async def loop() -> None:
            while not predicate():
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(loop(), timeout_s)


@dataclass
class StreamResult:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    messages: int = 0
    arrivals: list[float] = field(default_factory=list)


async def read_stream(call: Any) -> StreamResult:
    result = StreamResult()
    async for msg in call:
        result.messages += 1
        result.arrivals.append(time.perf_counter())
        result.tokens.extend(msg.token_ids)
        result.text += msg.text
        if msg.finished:
            result.finish_reason = msg.finish_reason
    return result


def generate_request(
    rid: str, prompt_ids: Sequence[int] = (), max_tokens: int = 8, text: str = "", **kw: Any
) -> worker_pb2.WorkerGenerateRequest:
    return worker_pb2.WorkerGenerateRequest(
        request_id=rid,
        prompt_token_ids=list(prompt_ids),
        prompt=text,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, **kw),
    )


class Client:
    """A channel + Worker stub to one server; close it (``async with``)."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.stub: worker_pb2_grpc.WorkerAsyncStub = worker_pb2_grpc.WorkerStub(self.channel)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.channel.close(None)

    async def generate(self, rid: str, prompt_ids: Sequence[int], max_tokens: int, **kw: Any) -> StreamResult:
        return await read_stream(
            self.stub.Generate(generate_request(rid, prompt_ids, max_tokens, **kw), timeout=30)
        )
