"""Small builders and a bounded poller for the CMS tests."""

from __future__ import annotations

import asyncio
import inspect
import time
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


#: Status timestamps of a test are offsets from this "now" (reset before every test by the
#: ``fresh_status_clock`` fixture), so ages stay small (a status's age is the age of its
#: measurement) and offsets between statuses stay exact.
T0_MS = int(time.time() * 1000)


def reset_status_clock() -> None:
    global T0_MS
    T0_MS = int(time.time() * 1000)


def now_offset_ms() -> int:
    """The ``make_status`` timestamp offset that means "now"."""
    return 1_000 + int(time.time() * 1000) - T0_MS


def make_status(
    instance_id: str = "p0", update_id: int = 1, *, timestamp_ms: int = 1_000, **fields: Any
) -> cms_pb2.InstanceStatus:
    """A status; ``timestamp_ms`` is an offset from ``T0_MS`` (the suite's "now")."""
    timestamp_ms = T0_MS + timestamp_ms - 1_000  # read at call time: the fixture moves it
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
