"""Who a worker is: its role and failure domains, and the ``InstanceMetadata`` it registers."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from slorouter.v1 import cms_pb2

from engine.interface import EngineInfo


class WorkerRole(enum.Enum):
    """The stage a worker is registered for (the router may still use it for others)."""

    NEUTRAL = "neutral"
    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def proto(self) -> cms_pb2.InstanceRole.ValueType:
        return _ROLE_PROTO[self]


_ROLE_PROTO: dict[WorkerRole, cms_pb2.InstanceRole.ValueType] = {
    WorkerRole.NEUTRAL: cms_pb2.INSTANCE_ROLE_NEUTRAL,
    WorkerRole.PREFILL: cms_pb2.INSTANCE_ROLE_PREFILL,
    WorkerRole.DECODE: cms_pb2.INSTANCE_ROLE_DECODE,
}


def _doc(text: str) -> dict[str, Any]:
    return {"doc": text}


@dataclass(frozen=True)
class WorkerIdentity:
    """The slow facts about a worker that do not come from its engine."""

    instance_id: str = field(default="", metadata=_doc("unique instance id; empty = 'worker-<endpoint>'"))
    role: WorkerRole = field(default=WorkerRole.NEUTRAL, metadata=_doc("prefill, decode or neutral"))
    node_id: str = field(default="", metadata=_doc("failure domain: the host (empty = unknown)"))
    unit_id: str = field(default="", metadata=_doc("failure domain: the group of hosts (empty = unknown)"))
    model: str = field(default="", metadata=_doc("model name to register; empty = the engine's"))
    labels: tuple[tuple[str, str], ...] = field(
        default=(), metadata=_doc("free-form labels as (key, value) pairs")
    )

    def instance_id_for(self, endpoint: str) -> str:
        return self.instance_id or f"worker-{endpoint}"


def build_metadata(info: EngineInfo, identity: WorkerIdentity, endpoint: str) -> cms_pb2.InstanceMetadata:
    """The ``InstanceMetadata`` a worker serving at ``endpoint`` registers."""
    return cms_pb2.InstanceMetadata(
        instance_id=identity.instance_id_for(endpoint),
        endpoint=endpoint,
        role=identity.role.proto,
        model=identity.model or info.model,
        node_id=identity.node_id,
        unit_id=identity.unit_id,
        max_num_batched_tokens=info.max_num_batched_tokens,
        kv_capacity_tokens=info.kv_capacity_tokens,
        block_size=info.block_size,
        labels=dict(identity.labels),
        max_model_len=info.max_model_len,
        max_num_seqs=info.max_num_seqs,
    )
