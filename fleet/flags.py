"""Command-line checks every ``slo-router`` process shares, and the one shape of their messages.

Every mistake on a command line ends the same way: one line on stderr,
``error: --FLAG VALUE: what is wrong``, exit status 2, before anything listens
or connects. The flag and the value are shown as the user typed them
(``--attainment 150``, not the parsed ``1.5``; ``--rate 0``, not ``0.0``).

Checks raise :class:`ValueError` with the flag in front of the message, the way
the config objects already do (``--ttft-slo=-100.0: must be ...``,
``--rate 0.0: must be ...``, ``--lease-ttl-s must be ..., got 0.0``);
:func:`error_line` turns any of those shapes into the one above, taking the
value from the command line :func:`set_command_line` recorded (the entry point
records it once). Messages that name no flag pass through unchanged.

The listening checks bind each address once, the way the servers will
(``SO_REUSEADDR``, no ``SO_REUSEPORT``), and close it again, so a port held by
another process is reported with the flag that named it before the CMS, a
worker or a router starts. A process could still take the port in the gap
before the real bind; the servers' own bind errors name the flag too.

Stdlib only: every package's command line imports it.
"""

from __future__ import annotations

import errno
import ipaddress
import re
import socket
from collections.abc import Sequence
from pathlib import Path

#: The command line of this process as typed (after the program name), for :func:`typed_value`.
_COMMAND_LINE: tuple[str, ...] = ()

#: ``--flag=VALUE: reason``, ``--flag VALUE: reason``, ``--flag 'VALUE': reason``.
_WITH_VALUE = re.compile(
    r"^(?P<flag>--[A-Za-z0-9][\w-]*)(?:=| )(?P<value>'[^']*'|\"[^\"]*\"|\S+?): (?P<why>.+)$", re.S
)
#: ``--flag must be X, got VALUE`` (and ``--flag is empty``-like sentences without a value).
_GOT = re.compile(r"^(?P<flag>--[A-Za-z0-9][\w-]*) (?P<why>.+?),? got (?P<value>\S+|\[[^\]]*\])$", re.S)
#: A reason ending in the value it is about (``..., got '0'``).
_GOT_TAIL = re.compile(r",? got (\S+)$")
#: ``--flag: reason`` (a file flag whose problem is its content or absence).
_BARE = re.compile(r"^(?P<flag>--[A-Za-z0-9][\w-]*): (?P<why>.+)$", re.S)


def set_command_line(argv: Sequence[str]) -> None:
    """Record the command line as typed (the entry point calls this once, before parsing)."""
    global _COMMAND_LINE
    _COMMAND_LINE = tuple(argv)


def typed_values(flag: str, argv: Sequence[str] | None = None) -> list[tuple[str, str | None]]:
    """Every use of ``flag`` on the command line: ``(flag as typed, value as typed or None)``.

    Recognises ``--flag VALUE``, ``--flag=VALUE`` and argparse's unambiguous prefixes
    (``--att 150`` for ``--attainment``). A flag followed by another option (or nothing) has
    no value: a switch such as ``--insecure``.
    """
    words = list(_COMMAND_LINE if argv is None else argv)
    found: list[tuple[str, str | None]] = []
    for i, word in enumerate(words):
        if not word.startswith("--") or len(word) < 3:
            continue
        name, eq, value = word.partition("=")
        if not (name == flag or (len(name) > 3 and flag.startswith(name))):
            continue
        if eq:
            found.append((name, value))
        elif i + 1 < len(words) and not _is_option(words[i + 1]):
            found.append((name, words[i + 1]))
        else:
            found.append((name, None))
    return found


def _is_option(word: str) -> bool:
    if not word.startswith("-") or word == "-":
        return False
    try:
        float(word)
    except ValueError:
        return True
    return False  # a negative number is a value


def _same(shown: str, typed: str) -> bool:
    if shown == typed:
        return True
    if shown.startswith("[") and shown.endswith("]"):  # a parsed list: [5, 5] is "5,5" as typed
        return shown[1:-1].replace(" ", "").replace("'", "") == typed.replace(" ", "")
    try:
        return float(shown) == float(typed)
    except ValueError:
        return False


def _shown(value: str) -> str:
    """A value as it goes into a message: quoted only when it would not read as one word."""
    if value == "" or any(c.isspace() for c in value):
        return repr(value)
    return value


def restate(message: str, argv: Sequence[str] | None = None) -> str:
    """``message`` in the one shape, ``--FLAG VALUE: reason``, with flag and value as typed."""
    text = str(message).strip()
    for pattern in (_WITH_VALUE, _GOT, _BARE):
        match = pattern.match(text)
        if match is None:
            continue
        flag, why = match["flag"], match["why"].strip()
        shown = match.groupdict().get("value")
        if shown is not None:
            shown = shown.strip("'\"")
        uses = typed_values(flag, argv)
        got = _GOT_TAIL.search(why)
        if got is not None and uses and any(v is not None and _same(got[1].strip("'\""), v) for _, v in uses):
            why = why[: got.start()]  # the value is already in front, as typed
        # The use the message is about: the one whose value it shows (equal as typed, or as a
        # number: "-100" for "-100.0"). A message whose value matches no use keeps its own.
        pick = next(
            (u for u in reversed(uses) if shown is None or (u[1] is not None and _same(shown, u[1]))),
            None,
        )
        if pick is not None:
            name, value = pick
            return f"{name} {_shown(value)}: {why}" if value is not None else f"{name}: {why}"
        if shown is not None:
            return f"{flag} {shown}: {why}"
        return f"{flag}: {why}"
    return text


def error_line(message: object) -> str:
    """The line a command prints for a mistake: ``error: `` and the message restated."""
    return "error: " + restate(str(message))


def file_problem(exc: OSError) -> str:
    """An ``OSError`` of reading a file named by a flag, in words (the flag already names the path)."""
    if exc.errno == errno.ENOENT:
        return "no such file"
    if exc.errno == errno.EACCES:
        return "permission denied"
    if exc.errno == errno.EISDIR:
        return "is a directory, not a file"
    return exc.strerror.lower() if exc.strerror else str(exc)


def read_flag_file(flag: str, path: str | Path) -> str:
    """The text of the file ``flag`` names; ``ValueError`` ``--flag PATH: no such file`` and the like."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {file_problem(exc)}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{flag} {path}: not a text file") from None


def split_host_port(flag: str, value: str, *, allow_zero: bool = True) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) with a port 0-65535; ``ValueError`` naming ``flag``."""
    host, sep, port = value.rpartition(":")
    lowest = 0 if allow_zero else 1
    if not sep or not host or not port.isdigit() or not lowest <= int(port) <= 65535:
        example = "127.0.0.1:0 picks a free port" if allow_zero else "e.g. 127.0.0.1:50051"
        raise ValueError(f"{flag} {value}: expected HOST:PORT with a port {lowest}-65535 ({example})")
    return host.strip("[]"), int(port)


def check_bindable(flag: str, shown: str, host: str, port: int, *, where: str = "") -> None:
    """Bind ``host:port`` once and let it go; ``ValueError`` naming ``flag`` when it cannot be bound.

    Port 0 (the kernel picks one) always binds and is not tried.
    """
    if port == 0:
        return
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:  # a host name: resolve it as the server will
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise ValueError(f"{flag} {shown}: cannot resolve {host!r} ({exc.strerror})") from None
        family = infos[0][0]
        host = str(infos[0][4][0])
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ValueError(f"{flag} {shown}: {bind_problem(exc, where)}") from None


def bind_problem(exc: OSError, where: str = "") -> str:
    """Why an address could not be bound, in words a user can act on (``where``: after the first words)."""
    if exc.errno == errno.EADDRINUSE:
        return f"address already in use{where}; another process listens there (pick another port or stop it)"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"address not available on this host{where}"
    if exc.errno == errno.EACCES:
        return f"permission denied{where} (ports below 1024 need privileges)"
    return (exc.strerror.lower() if exc.strerror else str(exc)) + where


def check_listen(flag: str, value: str) -> None:
    """A listening flag (``HOST:PORT``): well formed and free to bind now."""
    host, port = split_host_port(flag, value)
    check_bindable(flag, value, host, port)


def check_port_range(flag: str, port: int) -> None:
    """A TCP port 0-65535 (0 = off); ``ValueError`` naming ``flag``."""
    if not 0 <= port <= 65535:
        raise ValueError(f"{flag} {port}: must be a port 0-65535 (0 = off)")


def check_metrics_port(flag: str, port: int, host: str) -> None:
    """``--metrics-port`` (0 = off) on ``--metrics-host``: a port, and free to bind now."""
    check_port_range(flag, port)
    if port:
        check_bindable(flag, str(port), host, port, where=f" (on {host})")


def cms_target(flag: str, value: str) -> str:
    """A CMS address in any accepted form (``HOST:PORT`` or ``grpc://HOST:PORT``) as ``grpc://HOST:PORT``."""
    bare = value.removeprefix("grpc://")
    host, sep, port = bare.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{flag} {value}: expected the CMS's HOST:PORT (grpc://HOST:PORT works too)")
    return f"grpc://{bare}"
