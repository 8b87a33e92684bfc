"""Stopping background tasks reliably."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger(__name__)


async def cancel_and_wait(task: asyncio.Task[Any], *, poll_s: float = 0.05, limit_s: float = 5.0) -> None:
    """Cancel ``task`` and wait until it has finished.

    The request is repeated every ``poll_s``: a library that loses a
    cancellation (redis-py can, when it lands next to one of its own read
    timeouts) must not leave the task running. Gives up, logging, after
    ``limit_s``.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not task.done():
        if loop.time() > deadline:
            logger.error("task %s did not stop within %.1f s", task.get_name(), limit_s)
            return
        task.cancel()
        await asyncio.wait({task}, timeout=poll_s)


def raise_if_cancelling() -> None:
    """Re-raise a cancellation that a library call swallowed (Python >= 3.11 can tell)."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    if cancelling is not None and cancelling():
        raise asyncio.CancelledError
