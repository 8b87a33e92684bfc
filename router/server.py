"""Assembling and running the router: reader + scheduler + service on a gRPC server.

:func:`start_router_server` is what tests and the embedded cluster call;
``slo-router router`` (:func:`register`) is the command-line entry.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from slorouter.v1 import router_pb2, router_pb2_grpc

from cms.reader import ClusterReader, open_reader
from cms.serving import add_health_and_reflection, bind_server
from predictor import LatencyPredictor
from router.core.config import SchedulerConfig
from router.core.predictors import PredictorSet
from router.core.scheduler import Scheduler
from router.forward import WorkerClient
from router.placement import Placer
from router.pool import ChannelPool
from router.service import RouterService, ServiceConfig
from router.telemetry import RequestObserver
from router.tokenize import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
DEFAULT_LISTEN = "127.0.0.1:50051"
DEFAULT_PROFILE_DIR = Path(__file__).resolve().parent.parent / "profiling_data" / "qwen2.5-7b-2xv100-linear"


@dataclass
class RouterServer:
    """A running router. ``address`` is ``host:port`` with the port actually bound."""

    server: grpc.aio.Server
    service: RouterService
    scheduler: Scheduler
    reader: ClusterReader
    pool: ChannelPool
    workers: WorkerClient
    observer: RequestObserver
    health: Any
    address: str
    owned: list[Any] = field(default_factory=list)
    _stopped: bool = False

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    async def stop(self, grace: float | None = 2.0) -> None:
        """Stop taking requests, let running ones finish within ``grace`` seconds, release everything."""
        if self._stopped:
            return
        self._stopped = True
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        await self.workers.drain()
        await self.pool.close()
        await self.reader.stop()
        for resource in reversed(self.owned):
            await resource.stop()


async def start_router_server(
    reader: ClusterReader,
    scheduler: Scheduler,
    *,
    listen: str = "127.0.0.1:0",
    service_config: ServiceConfig | None = None,
    tokenizer: Tokenizer | None = None,
    observer: RequestObserver | None = None,
    max_channels: int = 1024,
) -> RouterServer:
    """Serve the Router service on ``listen`` over ``reader``'s view; starts the reader too.

    Raises ``OSError`` when the address cannot be bound.
    """
    observer = observer or RequestObserver()
    pool = ChannelPool(max_channels=max_channels)
    workers = WorkerClient(pool)
    placer = Placer(scheduler, reader, observer=observer)
    service = RouterService(
        placer,
        workers,
        tokenizer or load_tokenizer(None),
        service_config or ServiceConfig(),
        observer=observer,
    )
    server, port = await bind_server(listen)
    router_pb2_grpc.add_RouterServicer_to_server(service, server)
    health_servicer = add_health_and_reflection(server, SERVICE_NAME)
    await reader.start()
    await server.start()
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    observer.bind_gauges(placer.instance_counts, lambda: len(scheduler.inflight))
    host = listen.rsplit(":", 1)[0]
    return RouterServer(
        server=server,
        service=service,
        scheduler=scheduler,
        reader=reader,
        pool=pool,
        workers=workers,
        observer=observer,
        health=health_servicer,
        address=f"{host}:{port}",
    )


# ---------------------------------------------------------------------- command line


def _profile_groups(values: list[str]) -> dict[str, LatencyPredictor]:
    groups: dict[str, LatencyPredictor] = {}
    for value in values:
        name, sep, directory = value.partition("=")
        if not sep or not name or not directory:
            raise ValueError(
                f"--profile-group expects NAME=DIR (a directory with ttft.json and tpot.json), got {value!r}"
            )
        if name in groups:
            raise ValueError(f"--profile-group {name!r} is given twice")
        groups[name] = LatencyPredictor.from_files(
            Path(directory) / "ttft.json", Path(directory) / "tpot.json"
        )
    return groups


def build_predictors(args: argparse.Namespace) -> PredictorSet:
    """The default profile from the two paths, plus one per ``--profile-group``."""
    default = LatencyPredictor.from_files(args.ttft_profiling_data_path, args.tpot_profiling_data_path)
    return PredictorSet(default, _profile_groups(args.profile_group))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--listen", default=DEFAULT_LISTEN, help="HOST:PORT of the Router service (default: %(default)s)"
    )
    parser.add_argument(
        "--cms",
        default="memory",
        help="where the cluster view comes from: 'memory' (an embedded CMS served on --cms-listen), "
        "grpc://HOST:PORT (a CMS) or redis://HOST:PORT/DB (read Redis directly) (default: %(default)s)",
    )
    parser.add_argument(
        "--cms-listen",
        default="127.0.0.1:7100",
        help="with --cms memory: where workers reach the embedded CMS (default: %(default)s)",
    )
    parser.add_argument("--cluster-name", default="default", help="Redis key namespace with --cms redis://")
    parser.add_argument(
        "--ttft-profiling-data-path",
        default=str(DEFAULT_PROFILE_DIR / "ttft.json"),
        help="TTFT profile JSON (default: the bundled Qwen2.5-7B profile)",
    )
    parser.add_argument(
        "--tpot-profiling-data-path",
        default=str(DEFAULT_PROFILE_DIR / "tpot.json"),
        help="TPOT profile JSON (default: the bundled Qwen2.5-7B profile)",
    )
    parser.add_argument(
        "--profile-group",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="a profile for instances whose metadata label (--profile-label) is NAME; repeatable",
    )
    SchedulerConfig.add_arguments(parser)
    parser.add_argument(
        "--max-retries",
        type=int,
        default=2,
        help="attempts on other instances after a failure (default: %(default)s)",
    )
    parser.add_argument(
        "--prefill-timeout-s",
        type=float,
        default=60.0,
        help="deadline of one Prefill call (default: %(default)s)",
    )
    parser.add_argument(
        "--stream-timeout-s",
        type=float,
        default=600.0,
        help="deadline of one decode stream (default: %(default)s)",
    )
    parser.add_argument(
        "--max-prompt-tokens", type=int, default=131072, help="longest prompt accepted (default: %(default)s)"
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="a Hugging Face tokenizer.json (or its directory) for text prompts; default: the built-in byte tokenizer the sim engine uses",
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="seed of the scheduler's RNG (ties, top-k); default: random"
    )
    parser.add_argument(
        "--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (0 = off)"
    )
    parser.add_argument(
        "--metrics-host", default="127.0.0.1", help="address of the metrics endpoint (default: %(default)s)"
    )


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "router",
        help="run the SLO-aware router (Router gRPC service)",
        description=(
            "Run the Router gRPC service: place each Generate request on prefill and decode instances "
            "predicted to meet its SLO, forward it and stream the tokens back."
        ),
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


async def start_from_args(args: argparse.Namespace) -> RouterServer:
    """Build everything the flags describe and start serving."""
    config = SchedulerConfig.from_namespace(args)
    predictors = build_predictors(args)
    service_config = ServiceConfig(
        ttft_slo_ms=config.ttft_slo_ms,
        tpot_slo_ms=config.tpot_slo_ms,
        max_retries=args.max_retries,
        prefill_timeout_s=args.prefill_timeout_s,
        stream_timeout_s=args.stream_timeout_s,
        max_prompt_tokens=args.max_prompt_tokens,
    )
    scheduler = Scheduler(config, predictors, random.Random(args.seed))
    owned: list[Any] = []
    if args.cms == "memory":
        from cms.memory import MemoryStore
        from cms.server import start_cms_server

        store = MemoryStore()
        cms = await start_cms_server(store, args.cms_listen)
        owned.append(cms)
        logger.info("embedded CMS listening on %s", cms.address)
        reader = open_reader("memory", store=store)
    else:
        reader = open_reader(args.cms, cluster_name=args.cluster_name)
    observer = RequestObserver()
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.metrics_host, registry=observer.registry)
    server = await start_router_server(
        reader,
        scheduler,
        listen=args.listen,
        service_config=service_config,
        tokenizer=load_tokenizer(args.tokenizer),
        observer=observer,
    )
    server.owned.extend(owned)
    return server


async def _serve(args: argparse.Namespace) -> int:
    server = await start_from_args(args)
    print(f"router listening on {server.address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("shutting down")
    await server.stop(grace=5.0)
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency; run without it if absent
        pass
    try:
        return asyncio.run(_serve(args))
    except (ValueError, OSError) as exc:  # bad flags, profiles or addresses: say what to fix
        print(f"error: {exc}", file=sys.stderr)
        return 2
