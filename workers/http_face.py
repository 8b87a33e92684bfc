"""A worker's OpenAI-compatible HTTP face (``slo-router worker --http-listen``).

It lets HTTP routers (vLLM's and SGLang's) route the very fleet this
project's router routes over gRPC. Requests run through
:meth:`workers.service.WorkerServicer.open_generate`, the path the gRPC
``Generate`` takes; text prompts and chat messages are tokenized by the
worker's tokenizer (the chat fallback of :mod:`openai_http.protocol` users
see documented there: one ``<role>: <content>`` line per message, then
``assistant:``).

Besides the OpenAI routes it serves what those routers poll for load:

* ``/metrics`` with vLLM's gauge names: ``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (a fraction
  0..1, as vLLM reports it) and its older name ``vllm:gpu_cache_usage_perc``,
  labelled ``model_name``;
* ``/get_load`` (``{"load": running + waiting}``, vllm-router's
  ``power_of_two``), and ``/server_info``, ``/get_server_info`` and
  ``/model_info`` (probed by sglang-router at start-up).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import Protocol

from slorouter.v1 import cms_pb2, common_pb2
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.interface import (
    DuplicateRequestError,
    Engine,
    EngineError,
    EngineOverloadedError,
    EngineShuttingDownError,
    InvalidRequestError,
    TokenDelta,
)
from openai_http.app import HttpServer, OpenAIApp, Piece
from openai_http.protocol import ApiError, ParsedRequest, Usage

_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class GenerateOpener(Protocol):
    """What starts a generate request (:class:`workers.service.WorkerServicer`)."""

    def open_generate(
        self, request_id: str, token_ids: Sequence[int], text: str, sampling: common_pb2.SamplingParams
    ) -> tuple[int, AsyncIterator[TokenDelta]]: ...


def http_status(exc: EngineError) -> int:
    """The one place engine errors become HTTP statuses."""
    if isinstance(exc, InvalidRequestError):
        return 400
    if isinstance(exc, DuplicateRequestError):
        return 409
    if isinstance(exc, EngineShuttingDownError):
        return 503
    if isinstance(exc, EngineOverloadedError):
        return 429
    return 500


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class WorkerBackend:
    """Serves the OpenAI API from one engine."""

    owner = "slo-router-worker"

    def __init__(self, servicer: GenerateOpener, engine: Engine, metadata: cms_pb2.InstanceMetadata) -> None:
        self._servicer = servicer
        self._engine = engine
        self._metadata = metadata

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        lines.append("assistant:")
        return "\n".join(lines)

    def models(self) -> list[tuple[str, int]]:
        return [(self._metadata.model or "default", self._metadata.max_model_len)]

    def health(self) -> str | None:
        return None if self._engine.load().schedulable else "the engine is not taking requests"

    def load(self) -> tuple[int, int, float]:
        """(running, waiting, KV cache usage as a fraction)."""
        load = self._engine.load()
        capacity = self._metadata.kv_capacity_tokens
        usage = min(1.0, load.num_used_kv_tokens / capacity) if capacity > 0 else 0.0
        return load.num_running_requests, load.num_waiting_requests, usage

    def metrics(self) -> tuple[bytes, str]:
        running, waiting, usage = self.load()
        label = f'{{model_name="{_label(self._metadata.model or "default")}"}}'
        lines = []
        for name, help_text, value in (
            ("vllm:num_requests_running", "Requests in the running batch.", float(running)),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", float(waiting)),
            ("vllm:kv_cache_usage_perc", "KV cache usage (1 = full).", usage),
            ("vllm:gpu_cache_usage_perc", "KV cache usage (1 = full); the older name.", usage),
        ):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name}{label} {value!r}"]
        load = self._engine.load()
        for name, help_text, count in (
            (
                "vllm:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                load.prefix_cache_query_tokens,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prompt tokens found in the prefix cache.",
                load.prefix_cache_hit_tokens,
            ),
        ):
            lines += [
                f"# HELP {name}_total {help_text}",
                f"# TYPE {name}_total counter",
                f"{name}_total{label} {float(count)!r}",
            ]
        return ("\n".join(lines) + "\n").encode(), _CONTENT_TYPE

    async def get_load(self, request: Request) -> Response:
        running, waiting, usage = self.load()
        return JSONResponse({"load": running + waiting, "running": running, "waiting": waiting, "kv": usage})

    async def server_info(self, request: Request) -> Response:
        meta = self._metadata
        return JSONResponse(
            {
                "model_path": meta.model,
                "served_model_name": meta.model,
                "max_model_len": meta.max_model_len,
                "max_num_batched_tokens": meta.max_num_batched_tokens,
                "instance_id": meta.instance_id,
                "disaggregation_mode": "null",
            }
        )

    async def model_info(self, request: Request) -> Response:
        return JSONResponse({"model_path": self._metadata.model, "is_generation": True})

    async def generate(
        self, request: ParsedRequest, headers: Mapping[str, str]
    ) -> AsyncGenerator[Piece, None]:
        request_id = "http-" + uuid.uuid4().hex
        try:
            num_prompt, stream = self._servicer.open_generate(
                request_id, request.prompt_token_ids, request.prompt, request.sampling
            )
        except EngineError as exc:
            raise ApiError(http_status(exc), str(exc)) from exc
        finished = False
        completion = 0
        try:
            async for delta in stream:
                completion += len(delta.token_ids)
                finished = delta.finished
                yield Piece(
                    text=delta.text,
                    finished=finished,
                    finish_reason=delta.finish_reason,
                    usage=Usage(num_prompt, completion) if finished else None,
                )
                if finished:
                    break
        except EngineError as exc:
            raise ApiError(http_status(exc), str(exc)) from exc
        finally:
            if not finished:  # the client went away or the stream failed: nothing may keep running
                await self._engine.abort(request_id)
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()


async def start_http_face(
    servicer: GenerateOpener, engine: Engine, metadata: cms_pb2.InstanceMetadata, listen: str
) -> HttpServer:
    """Serve the engine over OpenAI's HTTP API on ``listen``; raises ``OSError`` when taken."""
    backend = WorkerBackend(servicer, engine, metadata)
    extra = [
        Route("/get_load", backend.get_load, methods=["GET"]),
        Route("/server_info", backend.server_info, methods=["GET"]),
        Route("/get_server_info", backend.server_info, methods=["GET"]),
        Route("/model_info", backend.model_info, methods=["GET"]),
    ]
    server = HttpServer(OpenAIApp(backend, extra_routes=extra).app, listen)
    await server.start()
    return server
