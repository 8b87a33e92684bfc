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

from cms.server import DEFAULT_LISTEN, start_cms_server
from cms.store import DEFAULT_LEASE_TTL_S, open_store

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
the view. With a token (--auth-token or --auth-token-file), RegisterInstance,
ReportStatus and DeregisterInstance need 'authorization: Bearer <token>' metadata;
reads never do. The default address is loopback only.
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
    token.add_argument("--auth-token", metavar="T", help="require this bearer token on write RPCs")
    token.add_argument(
        "--auth-token-file",
        type=Path,
        metavar="F",
        help="read the write token from this file (surrounding whitespace is ignored)",
    )
    parser.add_argument(
        "--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (0 = off)"
    )
    parser.add_argument(
        "--metrics-host", default="127.0.0.1", help="address of the metrics endpoint (default: %(default)s)"
    )
    parser.set_defaults(func=run)


def _token(args: argparse.Namespace) -> str | None:
    if args.auth_token_file is not None:
        text: str = args.auth_token_file.read_text().strip()
        if not text:
            raise ValueError(f"--auth-token-file {args.auth_token_file} is empty")
        return text
    if args.auth_token is not None and not args.auth_token.strip():
        raise ValueError("--auth-token is empty")
    token: str | None = args.auth_token
    return token


def _is_loopback(listen: str) -> bool:
    host = listen.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def _serve(args: argparse.Namespace, token: str | None) -> int:
    try:
        store = open_store(args.store, cluster_name=args.cluster_name)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        try:
            server = await start_cms_server(
                store, args.listen, auth_token=token, lease_ttl_s=args.lease_ttl_s
            )
        except OSError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if token is None and not _is_loopback(args.listen):
            logger.warning(
                "serving on %s without an auth token: anyone who can reach it can write", args.listen
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
        token = _token(args)
        if not (math.isfinite(args.lease_ttl_s) and args.lease_ttl_s > 0):
            raise ValueError(f"--lease-ttl-s must be a finite number > 0, got {args.lease_ttl_s}")
        host, sep, port = args.listen.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(
                f"--listen {args.listen!r}: expected HOST:PORT with a port 0-65535 (0 picks one)"
            )
        if not 0 <= args.metrics_port <= 65535:
            raise ValueError(f"--metrics-port {args.metrics_port}: must be a port 0-65535 (0 = off)")
        if args.store != "memory" and not args.store.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--store {args.store!r}: expected memory or redis://HOST:PORT/DB")
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import uvloop  # the event loop policy is the entry point's business

    return uvloop.run(_serve(args, token))
