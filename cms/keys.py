"""``slo-router keys``: every secret the pieces run by hand need, in one owner-only directory.

``slo-router up`` makes its own secrets; a cluster started piece by piece
(``cms``, ``worker``, ``router``) needs the same ones as files, and before this
command nothing made them. It writes, into ``DIR``:

- ``cms.tokens``: the CMS's token file (``cms --auth-token-file``), one
  ``NAME TOKEN`` line per token below;
- ``ID.token`` per worker id: that worker's CMS token (``worker
  --cms-auth-token-file``), scoped ``write:ID``: it may register and report
  for that id only, so one worker cannot write another's entry;
- ``router.token``: a ``read`` token for routers (``router
  --cms-auth-token-file``): they read the cluster view and write nothing;
- ``worker-call.token``: the worker token (``--worker-auth-token-file`` on the
  router and on every worker): workers refuse calls that start, run or abort
  work without it;
- ``kv.key``: the key every worker signs and checks kv handles with
  (``worker --kv-key-file``).

The directory is created with mode 0700 and every file with 0600 (opened
with those permissions, never widened and narrowed afterwards). An existing
file is not overwritten unless ``--force`` is given: a token another process
still reads must not change under it by accident. The command then prints
which flag takes which file, as the lines to run.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from cms.auth import new_token
from fleet.flags import error_line

#: Worker ids this command accepts: the CMS's instance-id alphabet, short enough that the
#: token's principal (``worker.ID``) fits the token file's 64-character names.
_ID = re.compile(r"[A-Za-z0-9._:-]{1,57}")
#: At most this many workers in one directory (each is one file and one line of cms.tokens).
MAX_WORKERS = 1024
#: File names this command writes besides the per-worker ones; a worker id may not collide.
_RESERVED = {"router", "cms", "kv", "worker-call"}


def worker_ids(text: str) -> list[str]:
    """The ids of ``--workers`` (comma-separated); ``ValueError`` names the bad one."""
    ids = [part.strip() for part in text.split(",")]
    if len(ids) > MAX_WORKERS:
        raise ValueError(f"at most {MAX_WORKERS} worker ids, got {len(ids)}")
    seen: set[str] = set()
    for iid in ids:
        if not _ID.fullmatch(iid) or iid in {".", ".."}:
            raise ValueError(f"worker id {iid!r}: must be 1-57 characters of A-Za-z0-9._:-")
        if iid in _RESERVED:
            raise ValueError(f"worker id {iid!r}: {iid}.token is a name this command uses for itself")
        if iid in seen:
            raise ValueError(f"worker id {iid!r} is given twice")
        seen.add(iid)
    return ids


def _write(path: Path, text: str, *, force: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    fd = os.open(path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an existing file replaced under --force keeps no wider mode
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def write_secrets(directory: Path, ids: list[str], *, force: bool = False) -> dict[str, Path]:
    """Write every secret into ``directory``; the paths by role (``cms``, ``router``, ``kv``, each id).

    ``FileExistsError`` when a file exists and ``force`` is false (nothing is written then).
    """
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    paths = {
        "cms": directory / "cms.tokens",
        "router": directory / "router.token",
        "worker-call": directory / "worker-call.token",
        "kv": directory / "kv.key",
    }
    paths.update({iid: directory / f"{iid}.token" for iid in ids})
    if not force:
        taken = [str(p) for p in paths.values() if p.exists()]
        if taken:
            raise FileExistsError(f"{', '.join(taken)} already exist (--force replaces them)")
    tokens = {iid: new_token() for iid in ids}
    router_token = new_token()
    lines = ["# slo-router cms --auth-token-file: one 'NAME TOKEN SCOPE' per line"]
    lines += [f"worker.{iid} {token} write:{iid}" for iid, token in tokens.items()]
    lines.append(f"router {router_token} read")
    _write(paths["cms"], "\n".join(lines) + "\n", force=force)
    for iid, token in tokens.items():
        _write(paths[iid], token + "\n", force=force)
    _write(paths["router"], router_token + "\n", force=force)
    _write(paths["worker-call"], new_token() + "\n", force=force)
    _write(paths["kv"], new_token() + "\n", force=force)
    return paths


def run(args: argparse.Namespace) -> int:
    try:
        ids = worker_ids(args.workers)
    except ValueError as exc:
        print(error_line(f"--workers {args.workers}: {exc}"), file=sys.stderr)
        return 2
    directory = Path(args.dir)
    if directory.exists() and not directory.is_dir():
        print(error_line(f"DIR {args.dir}: exists and is not a directory"), file=sys.stderr)
        return 2
    try:
        write_secrets(directory, ids, force=args.force)
    except FileExistsError as exc:
        print(error_line(f"DIR {args.dir}: {exc}"), file=sys.stderr)
        return 2
    except OSError as exc:
        print(error_line(f"DIR {args.dir}: {exc.strerror or exc}"), file=sys.stderr)
        return 2

    def shown(name: str) -> str:  # the path as the user will type it: DIR as given, then the file
        return os.path.join(args.dir, name)

    kv, call = shown("kv.key"), shown("worker-call.token")
    print(
        f"wrote {len(ids) + 4} secrets into {args.dir} (directory 0700, files 0600); the flags that take them:"
    )
    print(f"  slo-router cms    --auth-token-file {shown('cms.tokens')}")
    for iid in ids:
        print(
            f"  slo-router worker --instance-id {iid} --cms-auth-token-file {shown(iid + '.token')} "
            f"--kv-key-file {kv} --worker-auth-token-file {call}"
        )
    print(
        f"  slo-router router --cms-auth-token-file {shown('router.token')} --worker-auth-token-file {call}"
    )
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "keys",
        help="write the tokens and key the pieces run by hand need",
        description=(
            "Write every secret a cluster started piece by piece needs into DIR: the CMS's token "
            "file (cms.tokens), one token per worker id (ID.token, allowed to write that id only), a "
            "read-only router token (router.token), the token workers require of calls that run work "
            "(worker-call.token) and the key workers sign kv handles with (kv.key). DIR is made "
            "owner-only (0700), every file 0600. Prints which flag of which command takes which file."
        ),
    )
    parser.add_argument("dir", metavar="DIR", help="directory to write into (created if missing)")
    parser.add_argument(
        "--workers",
        required=True,
        metavar="ID,ID,...",
        help="the worker instance ids, comma-separated (each worker's --instance-id)",
    )
    parser.add_argument("--force", action="store_true", help="replace files that already exist")
    parser.set_defaults(func=run)
