"""Fixtures for the worker tests: sim worker servers on loopback, stopped at teardown, and a task-leak check."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from workers.service import WorkerServer, start_worker_server

from .helpers import make_engine

StartWorker = Callable[..., Awaitable[WorkerServer]]


@pytest.fixture
async def start_worker() -> AsyncIterator[StartWorker]:
    """``await start_worker(**sim_config_overrides, listen=..., identity=..., cms=...)`` -> a running server."""
    servers: list[WorkerServer] = []

    async def start(
        *, listen: str = "127.0.0.1:0", server_kw: dict[str, Any] | None = None, **overrides: Any
    ) -> WorkerServer:
        engine = make_engine(**overrides)
        server = await start_worker_server(engine, listen, **(server_kw or {}))
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop(0)


@pytest.fixture(autouse=True)
async def no_leaked_tasks() -> AsyncIterator[None]:
    """Every task a test started must be finished when it ends (servers and engines stopped)."""
    before = asyncio.all_tasks()
    yield
    current = asyncio.current_task()
    # gRPC finishes some internal work on the next loop turns after a server stops.
    for _ in range(50):
        leaked = [t for t in asyncio.all_tasks() - before if t is not current and not t.done()]
        if not leaked:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"tasks left running after the test: {leaked}")
