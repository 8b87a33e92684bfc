"""The ``sim`` engine's kv handle and how a decode instance pulls the KV it names.

A kv handle is opaque to the router. The sim engine's handle is compact JSON
(UTF-8) describing where the KV lives::

    {"format": "slo-router.sim-kv.v1", "endpoint": "127.0.0.1:50051",
     "engine_id": "<hex>", "request_id": "r1", "nonce": "<hex>",
     "num_tokens": 812, "prompt_digest": "<hex>"}

``endpoint`` is the prefill instance's Worker service, ``engine_id`` the
incarnation of its engine (a restarted instance never honours an old handle's
nonce, and a decode on the same engine takes the KV without a transfer),
``num_tokens`` the tokens of KV held and ``prompt_digest`` a digest of the
prompt it was computed for, so a handle cannot be applied to another prompt.

The decode side simulates the transfer time and then tells the prefill
instance that the KV was pulled by calling ``Abort(request_id)`` on it (the
Worker service has no private RPC): ``found`` means the KV was still held and
is now freed; not found means it expired or was never there.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Protocol

import grpc
from slorouter.v1 import worker_pb2, worker_pb2_grpc

from cms import limits
from cms.transport import ClientTls, message_size_options, open_channel
from engine.interface import InvalidRequestError, KvHandleError

logger = logging.getLogger(__name__)

KV_HANDLE_FORMAT = "slo-router.sim-kv.v1"
#: Bound on a handle's size; anything larger is not one of ours.
MAX_KV_HANDLE_BYTES = 4096


@dataclass(frozen=True)
class SimKvHandle:
    """What a sim decode instance needs to pull a prefill's KV."""

    endpoint: str
    engine_id: str
    request_id: str
    nonce: str
    num_tokens: int
    prompt_digest: str

    def encode(self) -> bytes:
        doc = {"format": KV_HANDLE_FORMAT, **asdict(self)}
        return json.dumps(doc, separators=(",", ":")).encode("utf-8")

    @classmethod
    def decode(cls, data: bytes) -> SimKvHandle:
        """Parse a handle; :class:`InvalidRequestError` naming ``kv_handle`` if it is not a sim handle."""
        if len(data) > MAX_KV_HANDLE_BYTES:
            raise InvalidRequestError(f"kv_handle: {len(data)} bytes is too long for a sim kv handle")
        try:
            doc = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise InvalidRequestError(
                "kv_handle: not a sim kv handle (expected the bytes a sim worker's Prefill returned)"
            ) from None
        if not isinstance(doc, dict) or doc.get("format") != KV_HANDLE_FORMAT:
            raise InvalidRequestError(
                f"kv_handle: not a {KV_HANDLE_FORMAT} handle; pass the kv_handle a sim worker's Prefill returned"
            )
        try:
            handle = cls(
                endpoint=str(doc["endpoint"]),
                engine_id=str(doc["engine_id"]),
                request_id=str(doc["request_id"]),
                nonce=str(doc["nonce"]),
                num_tokens=int(doc["num_tokens"]),
                prompt_digest=str(doc["prompt_digest"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequestError(
                f"kv_handle: malformed sim kv handle ({exc!r} missing or bad)"
            ) from None
        if handle.num_tokens < 1 or not handle.request_id:
            raise InvalidRequestError("kv_handle: malformed sim kv handle (no tokens or no request id)")
        return handle


class KvPeer(Protocol):
    """How a decode instance reaches the prefill instance that holds a KV."""

    async def release(self, endpoint: str, request_id: str) -> bool:
        """Tell the instance at ``endpoint`` its KV for ``request_id`` was pulled.

        True if it still held that KV (now freed); False if it did not.
        Raises :class:`KvHandleError` when the instance cannot be reached.
        """

    async def close(self) -> None:
        """Release connections. Idempotent."""


class GrpcKvPeer:
    """:class:`KvPeer` over the prefill instance's Worker ``Abort`` RPC.

    Channels are cached per endpoint, at most ``max_channels`` (least recently
    used is closed first); every call has a deadline.
    """

    def __init__(
        self,
        *,
        timeout_s: float = 2.0,
        max_channels: int = 64,
        tls: ClientTls | None = None,
        call_token: str | None = None,
    ) -> None:
        if timeout_s <= 0 or max_channels < 1:
            raise ValueError(f"need timeout_s > 0 and max_channels >= 1, got {timeout_s}, {max_channels}")
        self._timeout_s = timeout_s
        self._max = max_channels
        self._tls = tls
        self._call_token = call_token
        self._channels: OrderedDict[str, tuple[grpc.aio.Channel, worker_pb2_grpc.WorkerAsyncStub]] = (
            OrderedDict()
        )
        self._closed = False

    def _stub(self, endpoint: str) -> worker_pb2_grpc.WorkerAsyncStub:
        entry = self._channels.get(endpoint)
        if entry is not None:
            self._channels.move_to_end(endpoint)
            return entry[1]
        channel = open_channel(
            endpoint,
            message_size_options(limits.SERVING_MAX_MESSAGE_BYTES, limits.SERVING_MAX_MESSAGE_BYTES),
            tls=self._tls,
            call_token=self._call_token,
        )
        stub = worker_pb2_grpc.WorkerStub(channel)
        self._channels[endpoint] = (channel, stub)
        return stub

    async def _evict(self) -> None:
        while len(self._channels) > self._max:
            _, (channel, _) = self._channels.popitem(last=False)
            await channel.close(None)

    async def release(self, endpoint: str, request_id: str) -> bool:
        if self._closed:
            raise KvHandleError("the KV peer is closed (the engine is shutting down)")
        stub = self._stub(endpoint)
        await self._evict()
        try:
            response = await stub.Abort(
                worker_pb2.AbortRequest(request_id=request_id), timeout=self._timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            raise KvHandleError(
                f"kv_handle: cannot reach the prefill instance at {endpoint} to pull the KV of "
                f"{request_id!r} ({exc.code().name}: {exc.details()}); re-prefill or decode with an empty kv_handle"
            ) from None
        return bool(response.found)

    async def close(self) -> None:
        self._closed = True
        channels = [channel for channel, _ in self._channels.values()]
        self._channels.clear()
        for channel in channels:
            await channel.close(None)
