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
    ``record.status_age_s + (now_s - taken_at_s)``. A reader that lost its
    CMS keeps handing out its last snapshot, so ages keep growing and the
    router's staleness filter decides what is still usable.
    """

    instances: tuple[InstanceRecord, ...]
    taken_at_s: float
    version: int = 0

    def age_s(self, record: InstanceRecord, now_s: float) -> float:
        """Age of ``record``'s status at ``now_s`` (monotonic seconds)."""
        return record.status_age_s + max(0.0, now_s - self.taken_at_s)

    def by_id(self) -> dict[str, InstanceRecord]:
        return {r.instance_id: r for r in self.instances}


EMPTY_SNAPSHOT = ClusterSnapshot(instances=(), taken_at_s=0.0, version=0)
