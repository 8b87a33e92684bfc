"""Signed kv handles: a decode worker acts only on handles a prefill worker of its cluster made.

A kv handle names where a prefill's KV lives (the ``sim`` handle carries the
prefill worker's endpoint; the decode side calls ``Abort`` there once it has
pulled the KV). Left unauthenticated, anyone who can reach a decode worker
could hand it a handle that points at an endpoint of their choosing. With a
cluster key (``--kv-key-file``; ``slo-router up`` makes one), the Worker
service wraps every handle its engine returns as::

    b"srkv1" + HMAC-SHA256(key, request_id || 0x00 || handle) + handle

and a decode worker unwraps it before its engine sees it: a handle that does
not verify, or that was made for another ``request_id``, is refused with
``INVALID_ARGUMENT`` before anything is called. The router never needs the
key; the handle stays opaque to it.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from engine.interface import InvalidRequestError

_MAGIC = b"srkv1"
_MAC_BYTES = 32
#: Smallest key accepted (bytes).
MIN_KEY_BYTES = 16


class KvSigner:
    """Signs and checks kv handles with one cluster key."""

    def __init__(self, key: bytes) -> None:
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"the kv handle key must be at least {MIN_KEY_BYTES} bytes, got {len(key)}")
        self._key = key

    @classmethod
    def from_file(cls, path: Path | str) -> KvSigner:
        """The key is the file's content with surrounding whitespace removed."""
        return cls(Path(path).read_bytes().strip())

    def _mac(self, request_id: str, handle: bytes) -> bytes:
        return hmac.new(self._key, request_id.encode() + b"\0" + handle, hashlib.sha256).digest()

    def sign(self, request_id: str, handle: bytes) -> bytes:
        """The handle as it leaves this worker (an empty handle stays empty)."""
        if not handle:
            return handle
        return _MAGIC + self._mac(request_id, handle) + handle

    def open(self, request_id: str, signed: bytes) -> bytes:
        """The engine's handle inside ``signed``; :class:`InvalidRequestError` if it does not verify."""
        if not signed:
            return signed
        head = len(_MAGIC) + _MAC_BYTES
        if len(signed) <= head or not signed.startswith(_MAGIC):
            raise InvalidRequestError(
                "kv_handle: not signed by this cluster; pass the kv_handle a prefill worker returned"
            )
        mac, handle = signed[len(_MAGIC) : head], signed[head:]
        if not hmac.compare_digest(mac, self._mac(request_id, handle)):
            raise InvalidRequestError(
                "kv_handle: the signature does not verify (forged, altered, or made for another request_id)"
            )
        return handle
