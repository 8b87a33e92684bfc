"""The store interface: a writer side for agents, a reader side for routers.

Two backends implement :class:`CmsStore`: :class:`cms.memory.MemoryStore`
(in-process, the embedded default) and :class:`cms.redis_store.RedisStore`
(shared by several CMS replicas and routers, survives a CMS restart).

Rules every store follows (the conformance suite in ``tests/cms`` checks them):

- Metadata and status are stored separately. Registering an id that exists
  replaces its metadata and keeps its last status.
- An id is owned by the ``owner`` (the credential's principal) that
  registered it: a register, report or deregister by another owner raises
  :class:`~cms.errors.PermissionDeniedError`. Registering a live id at another
  endpoint raises :class:`~cms.errors.AlreadyExistsError` (the id is free once
  its lease lapses or it is deregistered).
- Every registration starts a new epoch (returned; a store-wide counter, so
  it never repeats). ``update_id`` is compared within one epoch: the first
  status of an epoch is accepted whatever its id. A status stamped with an
  older ``epoch`` is dropped (``False``, lease not renewed); 0 means "the
  current one".
- A status whose ``timestamp_ms`` is more than ``MAX_CLOCK_SKEW_MS`` ahead of
  the store's wall clock raises :class:`~cms.errors.ClockSkewError`.
- A status for an id that is not registered raises
  :class:`~cms.errors.InstanceNotFoundError`. A status whose ``update_id`` is
  newer than the stored one replaces it (``True`` is returned); otherwise it
  is a heartbeat that refreshes only ``timestamp_ms`` and ``schedulable``
  (``False``) — unless its ``timestamp_ms`` is older than the stored one, in
  which case it only renews the lease, so a late duplicate cannot roll
  ``schedulable`` back.
- Every register and report renews the instance's lease for ``lease_ttl_s``;
  an instance whose lease lapses disappears; a deregistered one at once.
- A status's age is the age of its measurement (store wall clock minus
  ``timestamp_ms``), and never less than the time since the store received
  it (heartbeats included).
- The view ``version`` grows on every change of membership, metadata,
  accepted status or ``schedulable``. A heartbeat that only refreshes the
  timestamp does not bump it: watchers get fresh ages from the periodic push.
- Malformed input raises :class:`~cms.errors.InvalidArgumentError` and stores
  nothing; a backend failure raises :class:`~cms.errors.StoreUnavailableError`.
"""

from __future__ import annotations

from typing import Protocol

from slorouter.v1 import cms_pb2

from fleet.snapshot import ClusterSnapshot

#: Lease given to an instance when the server is not told otherwise.
DEFAULT_LEASE_TTL_S = 5.0


class StoreWriter(Protocol):
    """The agent side. Called by the servicer once per write RPC."""

    async def register(self, metadata: cms_pb2.InstanceMetadata, lease_ttl_s: float, owner: str = "") -> int:
        """Register or re-register ``metadata.instance_id``, renew its lease; the new epoch."""
        ...

    async def report(self, status: cms_pb2.InstanceStatus, lease_ttl_s: float, owner: str = "") -> bool:
        """Store a status (``True``) or apply it as a heartbeat (``False``); renew the lease."""
        ...

    async def deregister(self, instance_id: str, owner: str = "") -> bool:
        """Remove an instance at once; ``False`` if it was not registered."""
        ...


class StoreReader(Protocol):
    """The router side. Called by view pumps and ``GetClusterView``."""

    async def read_view(self) -> ClusterSnapshot:
        """Every live instance now; ``taken_at_s`` is ``time.monotonic()`` of the read.

        ``version`` is the store's change counter (see the module rules).
        """
        ...

    async def wait_changed(self, after_version: int | None, timeout_s: float) -> None:
        """Return once the version may differ from ``after_version``, or after ``timeout_s``.

        Never raises for a backend failure (it waits out the timeout instead),
        so a caller can loop on it without spinning.
        """
        ...


class CmsStore(StoreWriter, StoreReader, Protocol):
    """A complete backend."""

    async def close(self) -> None:
        """Release connections. Idempotent."""
        ...


def open_store(spec: str, *, cluster_name: str = "default") -> CmsStore:
    """Build a store from ``memory`` or ``redis://host:port/db``."""
    if spec == "memory":
        from cms.memory import MemoryStore

        return MemoryStore()
    if spec.startswith(("redis://", "rediss://", "unix://")):
        from cms.redis_store import RedisStore

        return RedisStore(spec, cluster_name=cluster_name)
    raise ValueError(f"store {spec!r} is neither 'memory' nor a redis://host:port/db URL")
