"""Small builders and a bounded poller for the CMS tests."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from slorouter.v1 import cms_pb2

T = TypeVar("T")

PREFILL = cms_pb2.INSTANCE_ROLE_PREFILL
DECODE = cms_pb2.INSTANCE_ROLE_DECODE
NEUTRAL = cms_pb2.INSTANCE_ROLE_NEUTRAL


def make_metadata(instance_id: str = "p0", **fields: Any) -> cms_pb2.InstanceMetadata:
    values: dict[str, Any] = {
        "endpoint": "127.0.0.1:9000",
        "role": PREFILL,
        "model": "tiny",
        "max_num_batched_tokens": 2048,
    }
    values.update(fields)
    return cms_pb2.InstanceMetadata(instance_id=instance_id, **values)


def make_status(
    instance_id: str = "p0", update_id: int = 1, *, timestamp_ms: int = 1_000, **fields: Any
) -> cms_pb2.InstanceStatus:
    values: dict[str, Any] = {"schedulable": True}
    values.update(fields)
    return cms_pb2.InstanceStatus(
        instance_id=instance_id, update_id=update_id, timestamp_ms=timestamp_ms, **values
    )


async def eventually(
    check: Callable[[], T | Awaitable[T]],
    *,
    timeout_s: float = 5.0,
    interval_s: float = 0.01,
    what: str = "the condition",
) -> T:
    """Poll ``check`` until it returns something truthy; fail after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last: T | None = None
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result  # type: ignore[return-value]
        last = result  # type: ignore[assignment]
        if loop.time() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last: {last!r})")
        await asyncio.sleep(interval_s)
