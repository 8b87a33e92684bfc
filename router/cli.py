"""The ``slo-router`` command line.

Each subcommand lives in the package it belongs to, as a module exposing
``register(subparsers)``; the module adds its parser and sets ``func`` to a
callable taking the parsed namespace and returning an exit code. Modules are
imported only when the CLI starts, so a subcommand's heavy imports stay out of
the others. Logging and uvloop are set up here, in the entry point only.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import MutableMapping, Sequence

from fleet.flags import set_command_line
from router.lifetime import die_with_parent_if_asked

#: Modules that contribute subcommands, in the order ``--help`` lists them.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "predictor.cli",
    "cms.cli",
    "cms.keys",
    "workers.cli",
    "workers.stock_agent",
    "router.server",
    "router.up",
    "router.schedule_cli",
    "router.calibrate",
    "bench.cli",
    "sim.cli",
    "sim.plan",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slo-router",
        description="SLO-aware router for disaggregated prefill/decode LLM serving fleets.",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level (default: %(default)s)",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def grpc_environment(env: MutableMapping[str, str] = os.environ) -> None:
    """gRPC core's settings for every ``slo-router`` process; they must be set before it loads.

    - ``GRPC_VERBOSITY=ERROR``: no INFO lines from the core (e.g. about fork).
    - ``GRPC_ENABLE_FORK_SUPPORT=0``: no fork handlers. With them, the core runs code in a child
      forked from a process with gRPC's threads (``--processes`` and ``up`` start their children
      from the event loop, which forks): seen here as a child that aborted before it could exec
      (``ev_epoll1_linux.cc: Check failed: next_worker->state == KICKED``), or crashed (SIGSEGV),
      about one start in ten under load, and the parent's CMS connection closed. Every child this
      software forks execs at once and never uses the parent's gRPC state, which is all that
      fork support is for.

    A value the user set is kept. ``env``: this process's environment, or a child's to be.
    """
    env.setdefault("GRPC_VERBOSITY", "ERROR")
    env.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")


def main(argv: Sequence[str] | None = None) -> int:
    die_with_parent_if_asked()  # a process `up` or `--processes` started ends with its parent
    grpc_environment()
    typed = list(argv if argv is not None else sys.argv[1:])
    set_command_line(typed)  # error messages echo flags and values as typed (fleet.flags)
    parser = build_parser()
    args = parser.parse_args(typed)
    # The command line as given (``--processes`` starts more routers with the same flags).
    args.argv = typed
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
