"""A bounded pool of gRPC channels to workers, keyed by endpoint."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

import grpc
from slorouter.v1 import worker_pb2_grpc

from cms import limits
from cms.transport import ClientTls, message_size_options, open_channel

logger = logging.getLogger(__name__)

CHANNEL_OPTIONS = (
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    *message_size_options(limits.SERVING_MAX_MESSAGE_BYTES, limits.SERVING_MAX_MESSAGE_BYTES),
    # A worker that restarts on the same endpoint is reached again within a second or two
    # (gRPC's default backoff grows to two minutes); a call never waits on it: the worker
    # client fails fast while a channel is in TRANSIENT_FAILURE. (grpc.min_reconnect_backoff_ms
    # is left alone: gRPC also takes it as the time one connection attempt may last.)
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
)


class ChannelPool:
    """One channel per worker endpoint, at most ``max_channels`` open (least recently used goes first).

    Channels are multiplexed: every request to a worker shares its channel.
    An evicted channel is closed after a grace period so calls still running
    on it can finish.
    """

    def __init__(
        self, max_channels: int = 1024, close_grace_s: float = 30.0, *, tls: ClientTls | None = None
    ) -> None:
        if max_channels < 1:
            raise ValueError(f"max_channels must be >= 1, got {max_channels}")
        self._max = max_channels
        self._tls = tls
        self._grace_s = close_grace_s
        self._channels: OrderedDict[str, tuple[grpc.aio.Channel, worker_pb2_grpc.WorkerAsyncStub]] = (
            OrderedDict()
        )
        self._closing: set[asyncio.Task[None]] = set()

    @property
    def max_channels(self) -> int:
        return self._max

    @property
    def tls(self) -> ClientTls | None:
        """The TLS settings of the channels (None: plaintext)."""
        return self._tls

    def stub(self, endpoint: str) -> worker_pb2_grpc.WorkerAsyncStub:
        return self.entry(endpoint)[1]

    def entry(self, endpoint: str) -> tuple[grpc.aio.Channel, worker_pb2_grpc.WorkerAsyncStub]:
        """The channel to ``endpoint`` and its stub (opened on first use)."""
        entry = self._channels.get(endpoint)
        if entry is not None:
            self._channels.move_to_end(endpoint)
            return entry
        channel = open_channel(endpoint, CHANNEL_OPTIONS, tls=self._tls)
        stub = worker_pb2_grpc.WorkerStub(channel)
        self._channels[endpoint] = (channel, stub)
        while len(self._channels) > self._max:
            old_endpoint, (old_channel, _) = self._channels.popitem(last=False)
            logger.debug("closing channel to %s (pool full)", old_endpoint)
            task = asyncio.get_running_loop().create_task(old_channel.close(grace=self._grace_s))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        return channel, stub

    def __len__(self) -> int:
        return len(self._channels)

    async def close(self) -> None:
        """Close every channel. Idempotent."""
        channels = [c for c, _ in self._channels.values()]
        self._channels.clear()
        await asyncio.gather(*(c.close(grace=None) for c in channels), *self._closing, return_exceptions=True)
