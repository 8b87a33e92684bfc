"""How the processes reach each other: message size limits, TLS, and channels.

Every server and every channel of the project sets its message limits
explicitly (:func:`message_size_options`; the bounds are in :mod:`cms.limits`).
A server given a certificate and key (``--tls-cert``/``--tls-key``) speaks TLS
only; a client given a CA bundle (``--tls-ca``) opens a TLS channel that
checks the server against it. Without them traffic is plaintext, which is
meant for loopback and trusted networks (see docs/security-and-failures.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc


def message_size_options(max_receive_bytes: int, max_send_bytes: int) -> list[tuple[str, int]]:
    """gRPC options for explicit message size limits (both must be > 0)."""
    if max_receive_bytes < 1 or max_send_bytes < 1:
        raise ValueError(f"message limits must be >= 1 byte, got {max_receive_bytes}, {max_send_bytes}")
    return [
        ("grpc.max_receive_message_length", max_receive_bytes),
        ("grpc.max_send_message_length", max_send_bytes),
    ]


@dataclass(frozen=True)
class ServerTls:
    """A server's certificate chain and private key (PEM bytes)."""

    cert_chain: bytes
    private_key: bytes

    @classmethod
    def from_files(cls, cert: Path | str, key: Path | str) -> ServerTls:
        return cls(Path(cert).read_bytes(), Path(key).read_bytes())

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.private_key, self.cert_chain)])


@dataclass(frozen=True)
class ClientTls:
    """The CA bundle (PEM bytes) a client checks servers against."""

    root_certificates: bytes

    @classmethod
    def from_file(cls, ca: Path | str) -> ClientTls:
        return cls(Path(ca).read_bytes())

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.root_certificates)


def server_tls_from_args(cert: str | None, key: str | None) -> ServerTls | None:
    """``--tls-cert``/``--tls-key`` as typed: both or neither; raises ``ValueError`` naming the flag."""
    if (cert is None) != (key is None):
        raise ValueError("--tls-cert and --tls-key go together: give both or neither")
    if cert is None or key is None:
        return None
    try:
        return ServerTls.from_files(cert, key)
    except OSError as exc:
        raise ValueError(f"--tls-cert/--tls-key: {exc}") from None


def target_error(target: str, whose: str) -> str | None:
    """What is wrong with a ``--target`` flag as typed (``HOST:PORT`` of ``whose`` server), or None."""
    host, sep, port = target.removeprefix("grpc://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        return f"--target {target!r}: expected the {whose}'s HOST:PORT"
    return None


def client_tls_from_arg(ca: str | None) -> ClientTls | None:
    if ca is None:
        return None
    try:
        return ClientTls.from_file(ca)
    except OSError as exc:
        raise ValueError(f"--tls-ca: {exc}") from None


def open_channel(
    target: str,
    options: Sequence[tuple[str, Any]] = (),
    *,
    tls: ClientTls | None = None,
    call_token: str | None = None,
) -> grpc.aio.Channel:
    """An ``aio`` channel to ``target`` (``host:port``), over TLS when ``tls`` is given.

    ``call_token``: every call carries ``authorization: Bearer <token>`` (:mod:`cms.call_auth`).
    """
    interceptors: Any = None
    if call_token:
        from cms.call_auth import send_token

        interceptors = send_token(call_token)
    if tls is None:
        return grpc.aio.insecure_channel(target, options=list(options), interceptors=interceptors)
    return grpc.aio.secure_channel(
        target, tls.credentials(), options=list(options), interceptors=interceptors
    )
