"""``slo-router cms``: run the cluster metadata service until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import math
import signal
import sys
from pathlib import Path
from typing import Any

from cms.auth import TokenTable
from cms.server import DEFAULT_LISTEN, DEFAULT_MAX_INSTANCES_PER_TOKEN, start_cms_server
from cms.store import DEFAULT_LEASE_TTL_S, open_store
from cms.transport import ServerTls, server_tls_from_args
from fleet.flags import check_listen, check_metrics_port, error_line, read_flag_file, split_host_port

logger = logging.getLogger(__name__)

_DESCRIPTION = """\
Run the cluster metadata service (ClusterMetadata gRPC, plus grpc.health.v1 and
server reflection). Agents beside the workers register their instance and report
its load; routers watch the cluster view.

Stores:
  memory                 in this process; registrations are lost when it exits
  redis://HOST:PORT/DB   shared by several CMS replicas and routers (which may also
                         read it directly with --cms redis://...); a CMS restart
                         loses nothing. Keys live under slorouter:{CLUSTER_NAME}:.

An instance that neither reports nor heartbeats for --lease-ttl-s disappears from
the view. With tokens (--auth-token or --auth-token-file) every call, reads
included, needs 'authorization: Bearer <token>' metadata. A token file holds one
token per line, 'TOKEN' or 'NAME TOKEN' (a token per worker keeps one worker from
writing another's entry: an instance id belongs to the token that registered it).
The default address is loopback only; on any other address the CMS refuses to
start without a token unless --insecure is given.
"""


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "cms",
        help="run the cluster metadata service (CMS)",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help="address to serve on; port 0 picks a free one (default: %(default)s)",
    )
    parser.add_argument(
        "--store",
        default="memory",
        metavar="memory|redis://HOST:PORT/DB",
        help="where the cluster state lives (default: %(default)s)",
    )
    parser.add_argument(
        "--lease-ttl-s",
        type=float,
        default=DEFAULT_LEASE_TTL_S,
        metavar="S",
        help="seconds an instance stays without a report or heartbeat (default: %(default)s)",
    )
    parser.add_argument(
        "--cluster-name",
        default="default",
        metavar="NAME",
        help="namespace of this cluster's keys in a shared Redis (default: %(default)s)",
    )
    token = parser.add_mutually_exclusive_group()
    token.add_argument("--auth-token", metavar="T", help="require this bearer token on every call")
    token.add_argument(
        "--auth-token-file",
        type=Path,
        metavar="F",
        help="the accepted tokens, one per line: TOKEN, NAME TOKEN or NAME TOKEN SCOPE; SCOPE is read "
        "(routers: read the view only), write:ID[,ID...] (a worker: write only these instance ids) or "
        "write (the default: any id it owns)",
    )
    parser.add_argument(
        "--max-instances-per-token",
        type=int,
        default=DEFAULT_MAX_INSTANCES_PER_TOKEN,
        metavar="N",
        help="live instance ids one token may have registered at once; one more is RESOURCE_EXHAUSTED "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow serving on a non-loopback address without a token (anyone who reaches it can write)",
    )
    parser.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate chain")
    parser.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    parser.add_argument(
        "--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (0 = off)"
    )
    parser.add_argument(
        "--metrics-host", default="127.0.0.1", help="address of the metrics endpoint (default: %(default)s)"
    )
    parser.set_defaults(func=run)


def _tokens(args: argparse.Namespace) -> TokenTable | None:
    if args.auth_token_file is not None:
        text = read_flag_file("--auth-token-file", args.auth_token_file)
        try:
            return TokenTable.parse(text, "")
        except ValueError as exc:
            raise ValueError(f"--auth-token-file {args.auth_token_file}: {exc}") from None
    if args.auth_token is not None:
        if not args.auth_token.strip():
            raise ValueError("--auth-token is empty")
        return TokenTable.single(args.auth_token.strip())
    return None


def is_loopback(listen: str) -> bool:
    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def _serve(args: argparse.Namespace, tokens: TokenTable | None, tls: ServerTls | None) -> int:
    try:
        store = open_store(args.store, cluster_name=args.cluster_name)
    except ValueError as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    try:
        try:
            server = await start_cms_server(
                store,
                args.listen,
                tokens=tokens,
                lease_ttl_s=args.lease_ttl_s,
                tls=tls,
                max_instances_per_token=args.max_instances_per_token,
            )
        except OSError as exc:
            print(error_line(exc), file=sys.stderr)
            return 2
        if tokens is None and not is_loopback(args.listen):
            logger.warning(
                "serving on %s without an auth token (--insecure): anyone who can reach it can write",
                args.listen,
            )
        if args.metrics_port:
            from cms.telemetry import serve_metrics

            serve_metrics(server, args.metrics_port, args.metrics_host)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        # One parseable line for scripts (and tests) that start it on port 0.
        print(f"cms listening on {server.address} store={store_label(args.store)}", flush=True)
        await stop.wait()
        logger.info("shutting down")
        await server.stop(grace=2.0)
        return 0
    finally:
        await store.close()


def store_label(spec: str) -> str:
    return "memory" if spec == "memory" else "redis"


def run(args: argparse.Namespace) -> int:
    try:
        tokens = _tokens(args)
        if not (math.isfinite(args.lease_ttl_s) and args.lease_ttl_s > 0):
            raise ValueError(f"--lease-ttl-s must be a finite number > 0, got {args.lease_ttl_s}")
        split_host_port("--listen", args.listen)
        if not 1 <= args.max_instances_per_token <= 1_000_000:
            raise ValueError(
                f"--max-instances-per-token must be within [1, 1000000], got {args.max_instances_per_token}"
            )
        if args.store != "memory" and not args.store.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--store {args.store!r}: expected memory or redis://HOST:PORT/DB")
        if tokens is None and not args.insecure and not is_loopback(args.listen):
            raise ValueError(
                f"--listen {args.listen} is not a loopback address: give --auth-token-file "
                "(or --insecure to let anyone who reaches it write)"
            )
        tls = server_tls_from_args(args.tls_cert, args.tls_key)
        # Last: the ports are free now, once every other flag is known to be good.
        check_listen("--listen", args.listen)
        check_metrics_port("--metrics-port", args.metrics_port, args.metrics_host)
    except (OSError, ValueError) as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    import uvloop  # the event loop policy is the entry point's business

    return uvloop.run(_serve(args, tokens, tls))
