"""The app on a real uvicorn server: the streamed wire format, errors mid-stream, client disconnects.

The backend is a fake implementing :class:`openai_http.app.Backend` (its pieces are scripted);
the HTTP server, the routes and the client are the real ones.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence

import httpx2 as httpx
import pytest

from openai_http.app import HttpServer, OpenAIApp, Piece
from openai_http.protocol import ApiError, Kind, ParsedRequest, Usage, chunk_body, sse, usage_chunk_body


class ScriptedBackend:
    """Yields ``pieces`` (then raises ``fail_with`` if set); ``hold`` keeps the stream open after them."""

    owner = "test"

    def __init__(
        self, pieces: Sequence[Piece], *, fail_with: ApiError | None = None, hold: bool = False
    ) -> None:
        self._pieces = pieces
        self._fail_with = fail_with
        self._hold = hold
        self.closed = asyncio.Event()

    async def generate(
        self, request: ParsedRequest, headers: Mapping[str, str]
    ) -> AsyncGenerator[Piece, None]:
        try:
            for piece in self._pieces:
                yield piece
                await asyncio.sleep(0)
            if self._fail_with is not None:
                raise self._fail_with
            if self._hold:
                await asyncio.sleep(60)
        finally:
            self.closed.set()

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        return " ".join(m["content"] for m in messages)

    def models(self) -> Sequence[tuple[str, int]]:
        return [("m", 0)]

    def health(self) -> str | None:
        return None

    def metrics(self) -> tuple[bytes, str]:
        return b"", "text/plain"


async def _serve(backend: ScriptedBackend) -> AsyncIterator[str]:
    server = HttpServer(OpenAIApp(backend).app, "127.0.0.1:0")
    await server.start()
    try:
        yield f"http://{server.address}"
    finally:
        await server.stop()


_PIECES = (
    Piece("Hello", headers={"x-route": "a"}),
    Piece(""),
    Piece(", wor"),
    Piece('ld "\u00e9"\n', finished=True, finish_reason="length", usage=Usage(3, 4)),
)


@pytest.mark.parametrize("kind", list(Kind))
@pytest.mark.parametrize("include_usage", [False, True])
async def test_a_stream_is_the_generic_encoding_of_each_piece(kind: Kind, include_usage: bool) -> None:
    backend = ScriptedBackend(_PIECES)
    body: dict[str, object] = {"model": "m", "max_tokens": 4, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    if kind is Kind.CHAT:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": "hi"}]
    else:
        path, body["prompt"] = "/v1/completions", "hi"
    async for base in _serve(backend):
        async with httpx.AsyncClient(timeout=10) as http:
            response = await http.post(base + path, json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-route"] == "a"
    raw = response.content
    first = json.loads(raw.split(b"\n\n")[0][len(b"data: ") :])
    rid, created = first["id"], first["created"]

    def chunk(piece: Piece, is_first: bool) -> bytes:
        reason = piece.finish_reason if piece.finished else None
        fields = chunk_body(
            kind, rid, created, "m", piece.text, reason, first=is_first, include_usage=include_usage
        )
        return sse(fields)

    # The empty, unfinished piece sends nothing; the rest one chunk each, in order.
    expected = chunk(_PIECES[0], True) + chunk(_PIECES[2], False) + chunk(_PIECES[3], False)
    if include_usage:
        expected += sse(usage_chunk_body(kind, rid, created, "m", Usage(3, 4)))
    expected += sse("[DONE]")
    assert raw == expected
    assert backend.closed.is_set()


async def test_an_error_after_the_first_piece_is_an_error_event_then_done() -> None:
    backend = ScriptedBackend(_PIECES[:1], fail_with=ApiError(503, "the worker went away"))
    async for base in _serve(backend):
        async with httpx.AsyncClient(timeout=10) as http:
            response = await http.post(
                base + "/v1/completions", json={"model": "m", "prompt": "hi", "stream": True}
            )
    assert response.status_code == 200
    events = [e for e in response.content.split(b"\n\n") if e]
    assert json.loads(events[-2][len(b"data: ") :])["error"]["message"] == "the worker went away"
    assert events[-1] == b"data: [DONE]"


async def test_a_client_that_goes_away_mid_stream_closes_the_backend() -> None:
    backend = ScriptedBackend(_PIECES[:1], hold=True)
    async for base in _serve(backend):
        async with (
            httpx.AsyncClient(timeout=10) as http,
            http.stream(
                "POST", base + "/v1/completions", json={"model": "m", "prompt": "hi", "stream": True}
            ) as response,
        ):
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break  # the first chunk arrived: leave while the backend still streams
        await asyncio.wait_for(backend.closed.wait(), 10)


async def test_other_methods_on_the_completion_routes_get_an_openai_error() -> None:
    async for base in _serve(ScriptedBackend(_PIECES)):
        async with httpx.AsyncClient(timeout=10) as http:
            response = await http.get(base + "/v1/completions")
            models = await http.get(base + "/v1/models")
    assert response.status_code == 405
    assert response.json()["error"]["code"] == 405
    assert models.json()["data"][0]["id"] == "m"
