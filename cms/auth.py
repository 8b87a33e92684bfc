"""Who may talk to a CMS: bearer tokens and the principal each one names.

A CMS with tokens needs ``authorization: Bearer <token>`` on every RPC,
reads included. Each token names a *principal*; the CMS records the
principal that registered an instance id as its owner, and only that
principal may report for it, re-register it or deregister it. One token for
the whole cluster gives one principal (``cluster``); a token per worker gives
each worker its own, so one worker cannot write another's entry.

Token file (``slo-router cms --auth-token-file``): one token per line, either
``TOKEN`` (principal ``cluster``) or ``NAME TOKEN``; blank lines and lines
starting with ``#`` are skipped. Client token files (``--cms-auth-token-file``)
hold the token alone; a ``NAME TOKEN`` line works too (the name is dropped).
"""

from __future__ import annotations

import hmac
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

#: Principal of a token given without a name.
CLUSTER_PRINCIPAL = "cluster"
#: Shortest token accepted in a file (`slo-router up` makes 43-character ones).
MIN_TOKEN_CHARS = 1
_NAME = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_TOKEN = re.compile(rf"[!-~]{{{MIN_TOKEN_CHARS},512}}")


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def _parse_line(line: str, where: str) -> tuple[str, str] | None:
    text = line.strip()
    if not text or text.startswith("#"):
        return None
    parts = text.split()
    if len(parts) == 1:
        name, token = CLUSTER_PRINCIPAL, parts[0]
    elif len(parts) == 2:
        name, token = parts
    else:
        raise ValueError(f"{where}: expected 'TOKEN' or 'NAME TOKEN', got {len(parts)} words")
    if not _NAME.fullmatch(name):
        raise ValueError(f"{where}: the name must be 1-64 characters of A-Za-z0-9._:-")
    if not _TOKEN.fullmatch(token):
        raise ValueError(
            f"{where}: a token must be {MIN_TOKEN_CHARS}-512 printable ASCII characters without spaces"
        )
    return name, token


@dataclass(frozen=True)
class TokenTable:
    """The tokens a CMS accepts and the principal of each."""

    entries: tuple[tuple[bytes, str], ...]

    @classmethod
    def of(cls, pairs: Iterable[tuple[str, str]]) -> TokenTable:
        """From ``(principal, token)`` pairs; a token may appear once."""
        seen: set[str] = set()
        entries = []
        for name, token in pairs:
            if token in seen:
                raise ValueError(f"token of {name!r} is given twice")
            seen.add(token)
            entries.append((f"Bearer {token}".encode(), name))
        if not entries:
            raise ValueError("no tokens given")
        return cls(tuple(entries))

    @classmethod
    def single(cls, token: str) -> TokenTable:
        return cls.of([(CLUSTER_PRINCIPAL, token)])

    @classmethod
    def parse(cls, text: str, source: str = "token file") -> TokenTable:
        pairs = []
        for number, line in enumerate(text.splitlines(), 1):
            parsed = _parse_line(line, f"{source} line {number}".strip())
            if parsed is not None:
                pairs.append(parsed)
        if not pairs:
            raise ValueError(f"{source} holds no token".strip())
        return cls.of(pairs)

    @classmethod
    def from_file(cls, path: Path) -> TokenTable:
        return cls.parse(path.read_text(encoding="utf-8"), str(path))

    def principal(self, header: str | bytes) -> str | None:
        """The principal whose token ``header`` (``Bearer <token>``) carries, or None.

        Compares against every entry in constant time per entry, so the time
        taken does not tell how much of a token was right.
        """
        given = header.encode() if isinstance(header, str) else bytes(header)
        found: str | None = None
        for expected, name in self.entries:
            if hmac.compare_digest(given, expected):
                found = name
        return found


def read_client_token(path: Path) -> str:
    """The token in a client token file (``TOKEN`` or ``NAME TOKEN`` on its first token line)."""
    return read_client_token_text(path.read_text(encoding="utf-8"), str(path))


def read_client_token_text(text: str, source: str) -> str:
    """The token of a client token file's text; ``ValueError`` naming ``source`` and the line."""
    for number, line in enumerate(text.splitlines(), 1):
        parsed = _parse_line(line, f"{source} line {number}".strip())
        if parsed is not None:
            return parsed[1]
    raise ValueError(f"{source} holds no token".strip())


def bearer(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """Call metadata carrying ``token`` (None when there is none)."""
    return (("authorization", f"Bearer {token}"),) if token else None
