"""A bounded pool of gRPC channels to workers, keyed by endpoint."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
from collections import OrderedDict

import grpc
from slorouter.v1 import worker_pb2_grpc

from cms import limits
from cms.serving import MIN_CLIENT_KEEPALIVE_S
from cms.transport import ClientTls, message_size_options, open_channel

logger = logging.getLogger(__name__)

#: Keepalive toward workers (``--worker-keepalive-s``, ``--worker-keepalive-timeout-s``): a ping
#: after this long without a byte from the worker, and the connection is closed when it goes
#: unanswered this long. A worker that freezes (SIGSTOP, a hung host) is therefore found within
#: interval + timeout, and every stream on it fails over (resumed elsewhere, token-exact).
DEFAULT_KEEPALIVE_S = 10.0
DEFAULT_KEEPALIVE_TIMEOUT_S = 5.0


def keepalive_options(interval_s: float, timeout_s: float) -> tuple[tuple[str, int], ...]:
    """Channel options for a keepalive ping every ``interval_s`` answered within ``timeout_s``."""
    return (
        ("grpc.keepalive_time_ms", round(interval_s * 1000)),
        ("grpc.keepalive_timeout_ms", round(timeout_s * 1000)),
        # Any ping's acknowledgement (gRPC core's default for pings other than keepalive is a
        # minute, and it governed here: a frozen worker was found after ~60 s whatever the above).
        ("grpc.http2.ping_timeout_ms", round(timeout_s * 1000)),
        # Pings also while no call is open (an idle channel to a frozen worker is found too),
        # and any number of them between data frames; our servers accept them (cms.serving).
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    )


def add_keepalive_arguments(parser: argparse.ArgumentParser) -> None:
    """``--worker-keepalive-s`` and ``--worker-keepalive-timeout-s`` (``router`` and ``up``)."""
    parser.add_argument(
        "--worker-keepalive-s",
        type=float,
        default=DEFAULT_KEEPALIVE_S,
        help="ping a worker's connection after this long without a byte from it (default: %(default)s)",
    )
    parser.add_argument(
        "--worker-keepalive-timeout-s",
        type=float,
        default=DEFAULT_KEEPALIVE_TIMEOUT_S,
        help="close a worker's connection when a ping goes unanswered this long; its streams resume "
        "elsewhere. A frozen worker is found within --worker-keepalive-s + this (default: %(default)s)",
    )


def keepalive_from_args(args: argparse.Namespace) -> tuple[float, float]:
    """The two keepalive flags, checked; ``ValueError`` naming the flag."""
    for flag, value in (
        ("--worker-keepalive-s", args.worker_keepalive_s),
        ("--worker-keepalive-timeout-s", args.worker_keepalive_timeout_s),
    ):
        if not (math.isfinite(value) and MIN_CLIENT_KEEPALIVE_S <= value <= 3600):
            raise ValueError(f"{flag} {value}: must be within [{MIN_CLIENT_KEEPALIVE_S:g}, 3600] seconds")
    return args.worker_keepalive_s, args.worker_keepalive_timeout_s


_CHANNEL_OPTIONS = (
    *message_size_options(limits.SERVING_MAX_MESSAGE_BYTES, limits.SERVING_MAX_MESSAGE_BYTES),
    # A worker that restarts on the same endpoint is reached again within a second or two
    # (gRPC's default backoff grows to two minutes); a call never waits on it: the worker
    # client fails fast while a channel is in TRANSIENT_FAILURE. (grpc.min_reconnect_backoff_ms
    # is left alone: gRPC also takes it as the time one connection attempt may last.)
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
)

#: Channels to engines this project does not serve (vLLM's own gRPC server): keepalive only
#: while calls are open, since a stock server's default ping policy answers pings on an idle
#: connection with GOAWAY ``too_many_pings``.
CHANNEL_OPTIONS = (
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    *_CHANNEL_OPTIONS,
)


class ChannelPool:
    """One channel per worker endpoint, at most ``max_channels`` open (least recently used goes first).

    Channels are multiplexed: every request to a worker shares its channel.
    An evicted channel is closed after a grace period so calls still running
    on it can finish.
    """

    def __init__(
        self,
        max_channels: int = 1024,
        close_grace_s: float = 30.0,
        *,
        tls: ClientTls | None = None,
        call_token: str | None = None,
        keepalive_s: float = DEFAULT_KEEPALIVE_S,
        keepalive_timeout_s: float = DEFAULT_KEEPALIVE_TIMEOUT_S,
    ) -> None:
        if max_channels < 1:
            raise ValueError(f"max_channels must be >= 1, got {max_channels}")
        self._max = max_channels
        self._tls = tls
        #: The worker token every call carries (``--worker-auth-token-file``; cms.call_auth).
        self._call_token = call_token
        self._options = (*keepalive_options(keepalive_s, keepalive_timeout_s), *_CHANNEL_OPTIONS)
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
        channel = open_channel(endpoint, self._options, tls=self._tls, call_token=self._call_token)
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
