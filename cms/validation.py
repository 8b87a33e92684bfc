"""Input checks every store applies before it stores anything.

The bounds keep one status message (and so one Redis value, one view entry)
small no matter what a worker sends. A violation raises
:class:`~cms.errors.InvalidArgumentError` whose message names the field.

The check that needs stored state (``num_used_kv_tokens`` above the
registered ``kv_capacity_tokens``) is done by the stores themselves, with
:func:`kv_over_capacity_message` for the wording.
"""

from __future__ import annotations

import math

from slorouter.v1 import cms_pb2

from cms.errors import InvalidArgumentError

#: Longest accepted ``instance_id`` (it is part of Redis keys).
MAX_INSTANCE_ID_CHARS = 256
#: Most ``admitted_request_ids`` accepted in one status.
MAX_ADMITTED_REQUEST_IDS = 1024
#: Most ``step_samples`` accepted in one status.
MAX_STEP_SAMPLES = 256

_ROLES = {
    cms_pb2.INSTANCE_ROLE_NEUTRAL: "NEUTRAL",
    cms_pb2.INSTANCE_ROLE_PREFILL: "PREFILL",
    cms_pb2.INSTANCE_ROLE_DECODE: "DECODE",
}


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Split ``host:port`` (IPv6 as ``[addr]:port``); raise ``ValueError`` if it is not one."""
    host, sep, port_text = endpoint.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{endpoint!r} is not host:port")
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            raise ValueError(f"{endpoint!r} has a malformed [IPv6] host")
    elif ":" in host:
        raise ValueError(f"{endpoint!r}: write an IPv6 host in brackets, [addr]:port")
    if any(c.isspace() or c == "/" for c in host):
        raise ValueError(f"{endpoint!r} has a malformed host")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"{endpoint!r} has no port in 1..65535")
    return host, int(port_text)


def _check_instance_id(instance_id: str, field: str) -> None:
    if not instance_id:
        raise InvalidArgumentError(f"{field} must not be empty")
    if len(instance_id) > MAX_INSTANCE_ID_CHARS:
        raise InvalidArgumentError(
            f"{field} is {len(instance_id)} characters long; the limit is {MAX_INSTANCE_ID_CHARS}"
        )


def validate_metadata(metadata: cms_pb2.InstanceMetadata) -> None:
    """Raise :class:`InvalidArgumentError` unless ``metadata`` can be registered."""
    _check_instance_id(metadata.instance_id, "metadata.instance_id")
    if not metadata.endpoint:
        raise InvalidArgumentError("metadata.endpoint must not be empty; give the worker's host:port")
    try:
        parse_endpoint(metadata.endpoint)
    except ValueError as exc:
        raise InvalidArgumentError(f"metadata.endpoint is not a usable host:port: {exc}") from None
    if metadata.role not in _ROLES:
        raise InvalidArgumentError(
            f"metadata.role {int(metadata.role)} is not one of "
            + ", ".join(f"{v}={k}" for k, v in _ROLES.items())
        )


def validate_instance_id(instance_id: str, field: str = "instance_id") -> None:
    """Raise :class:`InvalidArgumentError` for an empty or oversized id."""
    _check_instance_id(instance_id, field)


def validate_status(status: cms_pb2.InstanceStatus) -> None:
    """Raise :class:`InvalidArgumentError` unless ``status`` is well formed on its own."""
    _check_instance_id(status.instance_id, "status.instance_id")
    if len(status.admitted_request_ids) > MAX_ADMITTED_REQUEST_IDS:
        raise InvalidArgumentError(
            f"status.admitted_request_ids has {len(status.admitted_request_ids)} entries; "
            f"send at most {MAX_ADMITTED_REQUEST_IDS} (the most recent ones)"
        )
    if len(status.step_samples) > MAX_STEP_SAMPLES:
        raise InvalidArgumentError(
            f"status.step_samples has {len(status.step_samples)} entries; "
            f"send at most {MAX_STEP_SAMPLES} per status"
        )
    for i, sample in enumerate(status.step_samples):
        if not math.isfinite(sample.duration_ms) or sample.duration_ms < 0:
            raise InvalidArgumentError(
                f"status.step_samples[{i}].duration_ms is {sample.duration_ms}; it must be finite and >= 0"
            )


def kv_over_capacity_message(used: int, capacity: int) -> str:
    return f"status.num_used_kv_tokens {used} exceeds the registered metadata.kv_capacity_tokens {capacity}"


def check_lease_ttl(lease_ttl_s: float) -> None:
    """Raise ``ValueError`` for a lease that is not a positive number of seconds."""
    if not (math.isfinite(lease_ttl_s) and lease_ttl_s > 0):
        raise ValueError(f"lease_ttl_s must be a positive number of seconds, got {lease_ttl_s}")
