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

from cms import limits
from cms.errors import ClockSkewError, InvalidArgumentError
from cms.limits import MAX_ADMITTED_REQUEST_IDS, MAX_STEP_SAMPLES, FieldLimitError

__all__ = ["MAX_ADMITTED_REQUEST_IDS", "MAX_INSTANCE_ID_CHARS", "MAX_STEP_SAMPLES"]

#: Longest accepted ``instance_id`` (it is part of Redis keys).
MAX_INSTANCE_ID_CHARS = limits.MAX_ID_BYTES
#: How far in the future a status's ``timestamp_ms`` may be (worker clock ahead of the CMS).
MAX_CLOCK_SKEW_MS = 2000

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
    try:
        limits.check_id(instance_id, field)
    except FieldLimitError as exc:
        raise InvalidArgumentError(str(exc)) from None


def validate_metadata(metadata: cms_pb2.InstanceMetadata) -> None:
    """Raise :class:`InvalidArgumentError` unless ``metadata`` can be registered."""
    try:
        limits.check_metadata(metadata)
    except FieldLimitError as exc:
        raise InvalidArgumentError(str(exc)) from None
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
    try:
        limits.check_status(status)
    except FieldLimitError as exc:
        raise InvalidArgumentError(str(exc)) from None


def check_clock_skew(
    status: cms_pb2.InstanceStatus, now_ms: int, max_skew_ms: int = MAX_CLOCK_SKEW_MS
) -> int:
    """The status's skew (``timestamp_ms - now_ms``); raise if it is too far in the future.

    A timestamp ahead of the CMS's clock would make the status look fresher
    than it is (and, in the past, made every later report look late).
    """
    skew = status.timestamp_ms - now_ms
    if skew > max_skew_ms:
        raise ClockSkewError(
            f"status.timestamp_ms is {skew} ms ahead of this CMS's clock (the limit is {max_skew_ms} ms); "
            "fix the worker's clock (NTP) rather than the timestamp"
        )
    return skew


def kv_over_capacity_message(used: int, capacity: int) -> str:
    return f"status.num_used_kv_tokens {used} exceeds the registered metadata.kv_capacity_tokens {capacity}"


def check_lease_ttl(lease_ttl_s: float) -> None:
    """Raise ``ValueError`` for a lease that is not a positive number of seconds."""
    if not (math.isfinite(lease_ttl_s) and lease_ttl_s > 0):
        raise ValueError(f"lease_ttl_s must be a positive number of seconds, got {lease_ttl_s}")


def status_age_s(since_received_s: float, measurement_age_ms: float) -> float:
    """The age of a status: that of its measurement, never less than the time since it arrived.

    A report that repeats an old measurement therefore stays as old as the
    measurement, and a worker clock that runs behind makes its statuses look
    older (visible as skew), never fresher.
    """
    return max(0.0, since_received_s, measurement_age_ms / 1000.0)


def endpoint_taken_message(instance_id: str, endpoint: str) -> str:
    return (
        f"instance {instance_id!r} is registered at {endpoint} and its lease is live; "
        "deregister it first, wait for its lease to lapse, or use another instance id"
    )


def not_owner_message(instance_id: str) -> str:
    return (
        f"instance {instance_id!r} was registered with another credential; "
        "only that credential may write it (use the worker's own token)"
    )
