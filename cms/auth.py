"""Who may talk to a CMS: bearer tokens and the principal each one names.

A CMS with tokens needs ``authorization: Bearer <token>`` on every RPC,
reads included. Each token names a *principal*; the CMS records the
principal that registered an instance id as its owner, and only that
principal may report for it, re-register it or deregister it. One token for
the whole cluster gives one principal (``cluster``); a token per worker gives
each worker its own, so one worker cannot write another's entry.

Token file (``slo-router cms --auth-token-file``): one token per line,
``TOKEN`` (principal ``cluster``), ``NAME TOKEN`` or ``NAME TOKEN SCOPE``;
blank lines and lines starting with ``#`` are skipped. Client token files
(``--cms-auth-token-file``) hold the token alone; a ``NAME TOKEN [SCOPE]`` line
works too (the name and scope are dropped).

The scope says what the token may do:

- ``read``: read the view (``GetClusterView``, ``WatchClusterView``) and
  nothing else; every write is ``PERMISSION_DENIED``. Give routers this.
- ``write:ID[,ID...]``: read, and register, report for and deregister the
  instance ids listed, no other. Give each worker this for its own id.
- ``write`` (the default, for files written before scopes existed): read, and
  write any instance id it owns; the CMS caps how many ids one such token may
  hold at once (``--max-instances-per-token``).
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
#: Scope names (see the module docstring).
READ, WRITE = "read", "write"


@dataclass(frozen=True)
class Grant:
    """What one token may do: its principal, whether it may write, and which instance ids."""

    principal: str
    scope: str = WRITE
    #: ``write:ID,...``: the only ids it may write; None: any id it owns.
    instances: frozenset[str] | None = None

    @property
    def can_write(self) -> bool:
        return self.scope == WRITE

    def may_write(self, instance_id: str) -> bool:
        return self.can_write and (self.instances is None or instance_id in self.instances)

    def text(self) -> str:
        """The scope as a token file spells it."""
        if self.instances is None:
            return self.scope
        return f"{WRITE}:{','.join(sorted(self.instances))}"


def parse_scope(text: str, where: str) -> tuple[str, frozenset[str] | None]:
    """``read``, ``write`` or ``write:ID[,ID...]``; ``ValueError`` naming ``where``."""
    if text in (READ, WRITE):
        return text, None
    head, sep, ids = text.partition(":")
    if head == WRITE and sep:
        names = frozenset(i for i in ids.split(",") if i)
        if names and all(_NAME.fullmatch(i) for i in names):
            return WRITE, names
    raise ValueError(
        f"{where}: the scope must be 'read', 'write' or 'write:ID[,ID...]' (instance ids of "
        f"A-Za-z0-9._:-), got {text!r}"
    )


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def _parse_line(line: str, where: str) -> tuple[str, str, str] | None:
    text = line.strip()
    if not text or text.startswith("#"):
        return None
    parts = text.split()
    scope = WRITE
    if len(parts) == 1:
        name, token = CLUSTER_PRINCIPAL, parts[0]
    elif len(parts) == 2:
        name, token = parts
    elif len(parts) == 3:
        name, token, scope = parts
        parse_scope(scope, where)
    else:
        raise ValueError(
            f"{where}: expected 'TOKEN', 'NAME TOKEN' or 'NAME TOKEN SCOPE', got {len(parts)} words"
        )
    if not _NAME.fullmatch(name):
        raise ValueError(f"{where}: the name must be 1-64 characters of A-Za-z0-9._:-")
    if not _TOKEN.fullmatch(token):
        raise ValueError(
            f"{where}: a token must be {MIN_TOKEN_CHARS}-512 printable ASCII characters without spaces"
        )
    return name, token, scope


@dataclass(frozen=True)
class TokenTable:
    """The tokens a CMS accepts and the grant of each."""

    entries: tuple[tuple[bytes, Grant], ...]

    @classmethod
    def of(cls, pairs: Iterable[tuple[str, str] | tuple[str, str, str]]) -> TokenTable:
        """From ``(principal, token)`` or ``(principal, token, scope)``; a token may appear once."""
        seen: set[str] = set()
        entries = []
        for item in pairs:
            name, token = item[0], item[1]
            scope, instances = parse_scope(item[2], f"scope of {name!r}") if len(item) > 2 else (WRITE, None)
            if token in seen:
                raise ValueError(f"token of {name!r} is given twice")
            seen.add(token)
            entries.append((f"Bearer {token}".encode(), Grant(name, scope, instances)))
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

    def grant(self, header: str | bytes) -> Grant | None:
        """The grant of the token ``header`` (``Bearer <token>``) carries, or None.

        Compares against every entry in constant time per entry, so the time
        taken does not tell how much of a token was right.
        """
        given = header.encode() if isinstance(header, str) else bytes(header)
        found: Grant | None = None
        for expected, grant in self.entries:
            if hmac.compare_digest(given, expected):
                found = grant
        return found

    def principal(self, header: str | bytes) -> str | None:
        """The principal whose token ``header`` carries, or None."""
        grant = self.grant(header)
        return None if grant is None else grant.principal


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
