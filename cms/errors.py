"""The CMS exception tree, and the one place it is mapped to gRPC status codes.

::

    CmsError                      root; never raised itself
    ├── InvalidArgumentError      malformed input; nothing was stored   → INVALID_ARGUMENT
    │   └── ClockSkewError        a status timestamp too far in the future
    ├── AlreadyExistsError        a live instance id registered again at
    │                             another endpoint                      → ALREADY_EXISTS
    ├── PermissionDeniedError     a write to an instance another
    │                             credential owns                       → PERMISSION_DENIED
    ├── InstanceNotFoundError     a status or deregistration for an
    │                             instance that is not registered (or
    │                             whose lease lapsed): re-register      → NOT_FOUND
    ├── UnauthenticatedError      a write without the configured token  → UNAUTHENTICATED
    ├── QuotaExceededError        a token already holds as many instance
    │                             ids as the CMS allows one token       → RESOURCE_EXHAUSTED
    └── StoreUnavailableError     the backing store (Redis) failed or
                                  timed out; the write may be retried   → UNAVAILABLE

Stores and the servicer raise these; only :func:`grpc_code` turns them into
status codes. Messages say what to fix.
"""

from __future__ import annotations

import grpc


class CmsError(Exception):
    """Root of every error the CMS raises on purpose."""


class InvalidArgumentError(CmsError):
    """A request field is malformed; the message names the field."""


class ClockSkewError(InvalidArgumentError):
    """A status whose ``timestamp_ms`` is further in the future than the CMS allows."""


class AlreadyExistsError(CmsError):
    """The instance id is live at another endpoint; it is free once its lease lapses or it deregisters."""


class PermissionDeniedError(CmsError):
    """The instance id belongs to another credential."""


class InstanceNotFoundError(CmsError):
    """The instance is not registered (never was, deregistered, or its lease lapsed)."""


class UnauthenticatedError(CmsError):
    """A write RPC arrived without ``authorization: Bearer <token>`` or with a wrong token."""


class QuotaExceededError(CmsError):
    """The token already holds ``--max-instances-per-token`` live instance ids."""


class StoreUnavailableError(CmsError):
    """The store could not be reached or did not answer in time."""


_CODES: dict[type[CmsError], grpc.StatusCode] = {
    InvalidArgumentError: grpc.StatusCode.INVALID_ARGUMENT,
    InstanceNotFoundError: grpc.StatusCode.NOT_FOUND,
    AlreadyExistsError: grpc.StatusCode.ALREADY_EXISTS,
    PermissionDeniedError: grpc.StatusCode.PERMISSION_DENIED,
    UnauthenticatedError: grpc.StatusCode.UNAUTHENTICATED,
    QuotaExceededError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    StoreUnavailableError: grpc.StatusCode.UNAVAILABLE,
}


def grpc_code(exc: CmsError) -> grpc.StatusCode:
    """The gRPC status code for ``exc`` (``INTERNAL`` for an unmapped subclass)."""
    for cls in type(exc).__mro__:
        code = _CODES.get(cls)
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL
