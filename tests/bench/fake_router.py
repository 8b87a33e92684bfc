"""A fake Router for load-generator tests: the real ``RouterServicer`` on loopback, scripted by priority.

Behaviour by ``GenerateRequest.priority``:

- 0: stream ``max_tokens`` tokens, one per message, the first with the route, the
  last with ``finished``, ``finish_reason="length"`` and usage;
- ``FAIL_EXHAUSTED``: abort with ``RESOURCE_EXHAUSTED`` before any token;
- ``FAIL_MIDSTREAM``: one token, then abort with ``UNAVAILABLE``;
- ``SHORT_STREAM``: one token fewer than asked, still reporting "length" (a contract break);
- ``STOP_EARLY``: two tokens, then ``finish_reason="stop"`` (fine);
- ``NO_ROUTE``: like 0 but without the route (a contract break);
- ``HANG``: never answers (until the client gives up or the server stops).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
from slorouter.v1 import router_pb2, router_pb2_grpc

FAIL_EXHAUSTED = 7
FAIL_MIDSTREAM = 8
SHORT_STREAM = 9
STOP_EARLY = 10
NO_ROUTE = 11
HANG = 12


@dataclass
class FakeRouter(router_pb2_grpc.RouterServicer):
    """Records what it received; ``token_delay_s`` is slept between tokens."""

    token_delay_s: float = 0.001
    received: list[router_pb2.GenerateRequest] = field(default_factory=list)

    async def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        self.received.append(request)
        kind = request.priority
        n = request.sampling.max_tokens
        if kind == FAIL_EXHAUSTED:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no instance can meet the SLO")
        if kind == HANG:
            await asyncio.Event().wait()
        if kind == SHORT_STREAM:
            n -= 1
        reason = "length"
        if kind == STOP_EARLY:
            n, reason = min(n, 2), "stop"
        route = router_pb2.RouteInfo(
            prefill_instance_id="p0", decode_instance_id="d0", predicted_ttft_ms=12.5, predicted_tpot_ms=3.0
        )
        for i in range(n):
            if i:
                await asyncio.sleep(self.token_delay_s)
            msg = router_pb2.GenerateResponse(request_id=request.request_id, token_ids=[65 + i % 26])
            if i == 0 and kind != NO_ROUTE:
                msg.route.CopyFrom(route)
            if kind == FAIL_MIDSTREAM:
                yield msg
                await context.abort(grpc.StatusCode.UNAVAILABLE, "decode instance lost")
            if i == n - 1:
                msg.finished = True
                msg.finish_reason = reason
                msg.usage.prompt_tokens = len(request.prompt_token_ids)
                msg.usage.completion_tokens = n
            yield msg


async def start_fake_router(servicer: FakeRouter) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@contextmanager
def fake_router_in_thread(servicer: FakeRouter | None = None) -> Iterator[str]:
    """Serve a fake router from a thread with its own event loop (for tests that call the sync CLI)."""
    ready = threading.Event()
    address: list[str] = []
    loop = asyncio.new_event_loop()
    stop: asyncio.Event | None = None

    async def serve() -> None:
        nonlocal stop
        stop = asyncio.Event()
        server, addr = await start_fake_router(servicer or FakeRouter())
        address.append(addr)
        ready.set()
        try:
            await stop.wait()
        finally:
            await server.stop(None)

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    try:
        assert ready.wait(timeout=10), "fake router did not start"
        yield address[0]
    finally:
        assert stop is not None
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=10)
        loop.close()
