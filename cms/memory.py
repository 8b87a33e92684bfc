"""In-process store: the embedded default (one machine, one CMS).

Everything happens on the event loop thread with no ``await`` inside a write,
so each write is atomic. Stored messages are private copies that are never
mutated afterwards (a heartbeat stores a fresh copy), which lets snapshots
share them without copying again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from slorouter.v1 import cms_pb2

from cms.errors import AlreadyExistsError, InstanceNotFoundError, InvalidArgumentError, PermissionDeniedError
from cms.validation import (
    check_clock_skew,
    check_lease_ttl,
    endpoint_taken_message,
    kv_over_capacity_message,
    not_owner_message,
    status_age_s,
    validate_instance_id,
    validate_metadata,
    validate_status,
)
from fleet.snapshot import ClusterSnapshot, InstanceRecord


@dataclass(slots=True)
class _Entry:
    metadata: cms_pb2.InstanceMetadata
    status: cms_pb2.InstanceStatus | None
    received_at_s: float
    expires_at_s: float
    owner: str
    #: The registration epoch; ``status_epoch`` is the one the stored status was accepted in.
    epoch: int
    status_epoch: int = 0


class MemoryStore:
    """A :class:`cms.store.CmsStore` held in this process.

    ``clock`` (monotonic seconds) measures leases and the time since a status
    arrived, and stamps ``ClusterSnapshot.taken_at_s``; ``wall_clock`` (epoch
    seconds) measures the age of a status's measurement and the clock skew of
    its ``timestamp_ms``. Tests pass fake ones.
    """

    def __init__(
        self, *, clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time
    ) -> None:
        self._clock = clock
        self._wall_clock = wall_clock
        self._entries: dict[str, _Entry] = {}
        self._version = 0
        self._epochs = 0
        # One future per waiting reader, resolved on the next change. Futures
        # (unlike an Event created here) belong to whichever loop awaits them.
        self._waiters: set[asyncio.Future[None]] = set()

    @property
    def version(self) -> int:
        return self._version

    def __len__(self) -> int:
        return len(self._entries)

    def _bump(self) -> None:
        self._version += 1
        waiters, self._waiters = self._waiters, set()
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _live(self, instance_id: str, now: float) -> _Entry | None:
        entry = self._entries.get(instance_id)
        if entry is not None and entry.expires_at_s <= now:
            del self._entries[instance_id]
            self._bump()
            return None
        return entry

    def _purge_expired(self, now: float) -> None:
        dead = [k for k, e in self._entries.items() if e.expires_at_s <= now]
        for k in dead:
            del self._entries[k]
        if dead:
            self._bump()

    def _new_epoch(self) -> int:
        self._epochs += 1
        return self._epochs

    async def register(self, metadata: cms_pb2.InstanceMetadata, lease_ttl_s: float, owner: str = "") -> int:
        validate_metadata(metadata)
        check_lease_ttl(lease_ttl_s)
        now = self._clock()
        entry = self._live(metadata.instance_id, now)
        if entry is None:
            own = cms_pb2.InstanceMetadata()
            own.CopyFrom(metadata)
            entry = _Entry(own, None, now, now + lease_ttl_s, owner, self._new_epoch())
            self._entries[metadata.instance_id] = entry
            self._bump()
            return entry.epoch
        if entry.metadata.endpoint != metadata.endpoint:
            raise AlreadyExistsError(endpoint_taken_message(metadata.instance_id, entry.metadata.endpoint))
        if entry.owner != owner:
            raise PermissionDeniedError(not_owner_message(metadata.instance_id))
        entry.expires_at_s = now + lease_ttl_s
        entry.epoch = self._new_epoch()
        if entry.metadata != metadata:
            own = cms_pb2.InstanceMetadata()
            own.CopyFrom(metadata)
            entry.metadata = own
            self._bump()
        return entry.epoch

    async def report(self, status: cms_pb2.InstanceStatus, lease_ttl_s: float, owner: str = "") -> bool:
        validate_status(status)
        check_lease_ttl(lease_ttl_s)
        check_clock_skew(status, int(self._wall_clock() * 1000))
        now = self._clock()
        entry = self._live(status.instance_id, now)
        if entry is None:
            raise InstanceNotFoundError(
                f"instance {status.instance_id!r} is not registered (or its lease lapsed); register it again"
            )
        if entry.owner != owner:
            raise PermissionDeniedError(not_owner_message(status.instance_id))
        if status.epoch and status.epoch != entry.epoch:
            if status.epoch < entry.epoch:
                return False  # from an earlier registration: it neither updates nor renews
            raise InstanceNotFoundError(
                f"instance {status.instance_id!r}: epoch {status.epoch} is not its registration; register it again"
            )
        capacity = entry.metadata.kv_capacity_tokens
        if capacity and status.num_used_kv_tokens > capacity:
            raise InvalidArgumentError(kv_over_capacity_message(status.num_used_kv_tokens, capacity))
        entry.expires_at_s = now + lease_ttl_s
        stored = entry.status
        if stored is None or entry.status_epoch != entry.epoch or status.update_id > stored.update_id:
            # update ids are compared within one registration: a new one starts afresh, so a
            # restarted worker (or a poisoned id from an earlier registration) never locks it out.
            own = cms_pb2.InstanceStatus()
            own.CopyFrom(status)
            entry.status = own
            entry.status_epoch = entry.epoch
            entry.received_at_s = now
            self._bump()
            return True
        if status.timestamp_ms < stored.timestamp_ms:
            return False  # a late duplicate: lease renewed above, nothing else
        entry.received_at_s = now
        if status.timestamp_ms != stored.timestamp_ms or status.schedulable != stored.schedulable:
            fresh = cms_pb2.InstanceStatus()
            fresh.CopyFrom(stored)
            fresh.timestamp_ms = status.timestamp_ms
            fresh.schedulable = status.schedulable
            entry.status = fresh
            if status.schedulable != stored.schedulable:
                self._bump()
        return False

    async def deregister(self, instance_id: str, owner: str = "") -> bool:
        validate_instance_id(instance_id)
        entry = self._live(instance_id, self._clock())
        if entry is None:
            return False
        if entry.owner != owner:
            raise PermissionDeniedError(not_owner_message(instance_id))
        del self._entries[instance_id]
        self._bump()
        return True

    async def read_view(self) -> ClusterSnapshot:
        now = self._clock()
        wall_ms = self._wall_clock() * 1000
        self._purge_expired(now)
        records = tuple(
            InstanceRecord(
                metadata=e.metadata,
                status=e.status,
                status_age_s=status_age_s(now - e.received_at_s, wall_ms - e.status.timestamp_ms)
                if e.status is not None
                else 0.0,
            )
            for _, e in sorted(self._entries.items())
        )
        return ClusterSnapshot(instances=records, taken_at_s=now, version=self._version)

    async def wait_changed(self, after_version: int | None, timeout_s: float) -> None:
        now = self._clock()
        self._purge_expired(now)
        if after_version is None or after_version != self._version:
            return
        if self._entries:
            # Wake up for the next lease expiry too, so it is seen promptly.
            next_expiry = min(e.expires_at_s for e in self._entries.values())
            timeout_s = min(timeout_s, max(0.0, next_expiry - now) + 0.001)
        if timeout_s <= 0:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(fut)
        try:
            await asyncio.wait({fut}, timeout=timeout_s)
        finally:
            self._waiters.discard(fut)
            fut.cancel()

    async def close(self) -> None:
        """Nothing to release; wakes any waiting reader."""
        waiters, self._waiters = self._waiters, set()
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)
