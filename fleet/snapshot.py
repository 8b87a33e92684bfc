"""The cluster view as routers see it: an immutable snapshot of every instance.

This module is the contract between the CMS readers (which build snapshots)
and the router (which turns them into columns for the scheduling core). The
protobuf messages are used as they are; they are never mutated after a
snapshot is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from slorouter.v1 import cms_pb2


@dataclass(frozen=True)
class InstanceRecord:
    """One instance in a snapshot.

    ``status`` is ``None`` until the instance's first status arrives.
    ``status_age_s`` is the age of that status (measured on the CMS side from
    when it was accepted, so worker clock skew does not matter) at the moment
    the snapshot was taken.
    """

    metadata: cms_pb2.InstanceMetadata
    status: cms_pb2.InstanceStatus | None
    status_age_s: float

    @property
    def instance_id(self) -> str:
        return self.metadata.instance_id


@dataclass(frozen=True)
class ClusterSnapshot:
    """Every live instance, taken at ``taken_at_s`` on the reader's monotonic clock.

    Ages grow while a snapshot is held: the age of a status at ``now_s`` is
    ``record.status_age_s + (now_s - taken_at_s)``.

    ``source_lost_at_s`` is set by a reader that lost its CMS (the stream
    broke, the store does not answer): the snapshot is the last view it has,
    and its ages stop growing at that moment. The CMS's silence says nothing
    about the instances, so an instance that was fresh when the source was
    lost stays usable (static stability) and the router stops using one only
    on evidence from its own calls (:mod:`router.core.health`); one that was
    already stale stays stale.
    """

    instances: tuple[InstanceRecord, ...]
    taken_at_s: float
    version: int = 0
    source_lost_at_s: float | None = None

    def elapsed_s(self, now_s: float) -> float:
        """How much the statuses aged since the snapshot was taken (frozen once the source is lost)."""
        lost = self.source_lost_at_s
        end = now_s if lost is None or lost > now_s else lost
        return max(0.0, end - self.taken_at_s)

    def age_s(self, record: InstanceRecord, now_s: float) -> float:
        """Age of ``record``'s status at ``now_s`` (monotonic seconds)."""
        return record.status_age_s + self.elapsed_s(now_s)

    def by_id(self) -> dict[str, InstanceRecord]:
        return {r.instance_id: r for r in self.instances}


EMPTY_SNAPSHOT = ClusterSnapshot(instances=(), taken_at_s=0.0, version=0)
