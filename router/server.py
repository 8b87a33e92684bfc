"""Assembling and running the router: reader + scheduler + service on a gRPC server.

:func:`start_router_server` is what tests and the embedded cluster call;
``slo-router router`` (:func:`register`) is the command-line entry.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import math
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from slorouter.v1 import router_pb2, router_pb2_grpc

from cms import limits
from cms.auth import read_client_token, read_client_token_text
from cms.call_auth import read_worker_token
from cms.reader import ClusterReader, open_reader
from cms.serving import add_health_and_reflection, bind_server
from cms.transport import ClientTls, ServerTls, client_tls_from_arg, server_tls_from_args
from fleet.flags import (
    check_listen,
    check_metrics_port,
    check_port_range,
    cms_target,
    error_line,
    read_flag_file,
    split_host_port,
)
from openai_http.app import DEFAULT_MAX_BODY_BYTES, HttpServer
from openai_http.bounded import EdgeLimits
from predictor import LatencyPredictor
from router.admission import Admission, make_admission
from router.chat_template import ChatTemplate, FallbackChatTemplate, load_chat_template
from router.core.config import SchedulerConfig, name_flags
from router.core.health import OutlierConfig, OutlierDetector
from router.core.predictors import PredictorSet
from router.core.prefix import AutoPrefixIndex, ExactPrefixIndex, PrefixRouting
from router.core.qlm import QlmConfig
from router.core.queue import QueueConfig
from router.core.rng import PeekableRandom
from router.core.scheduler import Scheduler
from router.core.slicing import SliceConfig
from router.forward import WORKER_STREAMS, WorkerClient
from router.h2_server import H2Server, HealthState, router_methods
from router.http_edge import RouterBackend, add_http_edge_arguments, edge_limits_from_args, start_http_edge
from router.kv_events import KvEventFeed
from router.legs import MAX_RELAY_HOLD_S
from router.placement import Placer
from router.pool import (
    DEFAULT_KEEPALIVE_S,
    DEFAULT_KEEPALIVE_TIMEOUT_S,
    ChannelPool,
    add_keepalive_arguments,
    keepalive_from_args,
)
from router.service import RouterService, ServiceConfig
from router.slicing import add_arguments as add_slice_arguments
from router.slicing import dispatcher_from_args, slice_config_from_args
from router.telemetry import RequestObserver
from router.tokenize import Tokenizer, load_tokenizer
from router.vllm_grpc import (
    DEFAULT_STREAM_INTERVAL_S,
    DEFAULT_STREAM_MESSAGES_PER_S,
    VLLM_TRANSPORTS,
    VllmGrpcClient,
)

logger = logging.getLogger(__name__)

SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
#: Calls gRPC core may hold for the router before the service has picked them up. Its defaults
#: (1,000, hard limit 3,000) answered ~1,300 of a burst of 4,000 simultaneous calls with a bare
#: CANCELLED that the router never saw, let alone counted. Above the router's own bounds
#: (``--max-queue-size``, 4,096 by default, plus what runs), overload is refused by the router,
#: with a reason and a metric, not by the core.
MAX_PENDING_CALLS = 1 << 16
ROUTER_SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
)
DEFAULT_LISTEN = "127.0.0.1:50051"
#: What serves the Router service (``--grpc-server``); the first is the default: ``h2``, or
#: ``grpcio`` when the service is served over TLS (:func:`resolve_grpc_server`).
GRPC_SERVERS = ("auto", "grpcio", "h2")
DEFAULT_PROFILE_DIR = Path(__file__).resolve().parent.parent / "profiling_data" / "qwen2.5-7b-2xv100-linear"


@dataclass
class RouterServer:
    """A running router. ``address`` is ``host:port`` with the port actually bound."""

    #: The Router service's server: ``grpc.aio``'s, or the router's own (``--grpc-server h2``).
    server: grpc.aio.Server | H2Server
    service: RouterService
    scheduler: Scheduler
    admission: Admission
    reader: ClusterReader
    pool: ChannelPool
    workers: WorkerClient
    observer: RequestObserver
    health: Any
    address: str
    owned: list[Any] = field(default_factory=list)
    readiness: asyncio.Task[None] | None = None
    #: The OpenAI-compatible HTTP edge, when ``http_listen`` was given.
    http: HttpServer | None = None
    #: The workers' prefix-cache event subscriptions (``--prefix-cache-routing exact|auto``).
    kv_feed: KvEventFeed | None = None
    _stopped: bool = False

    @property
    def ready(self) -> bool:
        """True once the first cluster view arrived (health ``SERVING``)."""
        task = self.readiness
        return task is not None and task.done() and not task.cancelled() and task.exception() is None

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    async def drain(self, timeout_s: float, force: asyncio.Event | None = None) -> None:
        """Shut down gracefully, in this order (SIGTERM):

        1. health goes ``NOT_SERVING`` (gRPC health and the HTTP ``/health``), so a load balancer
           stops sending;
        2. every queued request, and every new one, is refused at once with ``UNAVAILABLE``
           (HTTP 503): retryable, the client goes to another replica;
        3. running requests finish, for up to ``timeout_s`` (``--drain-timeout-s``; ``force``, set
           by a second signal, cuts it short);
        4. what still runs then ends with an error at its next message: ``UNAVAILABLE`` on gRPC, an
           OpenAI-shaped error event and ``[DONE]`` on an HTTP stream, closed cleanly.
        """
        if self.readiness is not None:
            self.readiness.cancel()
            await asyncio.gather(self.readiness, return_exceptions=True)
        await self.health.enter_graceful_shutdown()
        self.service.begin_drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(timeout_s, 0.0)
        if self.service.active_requests:
            logger.info(
                "draining: %d running request(s) may finish within %.0f s (--drain-timeout-s)",
                self.service.active_requests,
                timeout_s,
            )
        if await self.service.wait_idle(deadline - loop.time(), force):
            return
        logger.warning("drain time over: ending %d running request(s)", self.service.active_requests)
        self.service.abandon()
        await self.service.wait_idle(ABANDON_WAIT_S)

    async def stop(
        self,
        grace: float | None = 2.0,
        *,
        drain_timeout_s: float | None = None,
        force: asyncio.Event | None = None,
    ) -> None:
        """Drain (:meth:`drain`, up to ``drain_timeout_s``; default ``grace``), stop the servers within
        ``grace`` seconds, release everything."""
        if self._stopped:
            return
        self._stopped = True
        await self.drain(drain_timeout_s if drain_timeout_s is not None else (grace or 0.0), force)
        if self.http is not None:
            await self.http.stop()
        await self.server.stop(grace)
        self.admission.close()
        await self.workers.drain()
        if self.kv_feed is not None:
            await self.kv_feed.stop()
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
    source: str = "",
    slice_config: SliceConfig | None = None,
    http_listen: str = "",
    chat_template: ChatTemplate | None = None,
    queue_config: QueueConfig | None = None,
    qlm_config: QlmConfig | None = None,
    worker_connect_timeout_s: float = 2.0,
    worker_first_message_timeout_s: float = 30.0,
    outlier: OutlierConfig | None = None,
    tls: ServerTls | None = None,
    worker_tls: ClientTls | None = None,
    reuse_port: bool = False,
    worker_streams: str = "mux",
    vllm_stream_interval_s: float = DEFAULT_STREAM_INTERVAL_S,
    vllm_stream_messages_per_s: float = DEFAULT_STREAM_MESSAGES_PER_S,
    vllm_transport: str = VLLM_TRANSPORTS[0],
    http_limits: EdgeLimits | None = None,
    worker_token: str | None = None,
    worker_keepalive: tuple[float, float] = (DEFAULT_KEEPALIVE_S, DEFAULT_KEEPALIVE_TIMEOUT_S),
    grpc_server: str = GRPC_SERVERS[0],
    dispatch_mode: str = "",
) -> RouterServer:
    """Serve the Router service on ``listen`` over ``reader``'s view; starts the reader too.

    gRPC health reports ``NOT_SERVING`` until the reader delivers its first
    cluster view (``source`` names where it comes from, for the log), then
    ``SERVING``. With ``http_listen`` (``HOST:PORT``), the OpenAI-compatible
    HTTP edge is served there as well, over the same service.
    ``queue_config`` defaults to :class:`QueueConfig`'s defaults (the ``edf``
    router queue; ``qlm_config`` tunes ``--queue-policy qlm``). ``worker_*_timeout_s`` bound every worker call's connection
    and first message; ``outlier`` says when failing instances are ejected from
    placement (:mod:`router.core.health`). ``tls`` makes the Router service
    TLS only; ``worker_tls`` makes the calls to workers TLS (checked against
    its CA). ``worker_streams`` (``mux``, ``per-request``) says how decode/generate legs reach
    the workers (:data:`router.forward.WORKER_STREAMS`); ``vllm_stream_interval_s`` and
    ``vllm_stream_messages_per_s`` pace the relay of a stock vLLM engine's tokens
    (:class:`router.legs.RelayPacer`); ``vllm_transport`` says how their streams are read
    (:data:`router.vllm_grpc.VLLM_TRANSPORTS`). ``grpc_server`` says what serves the Router
    service (:data:`GRPC_SERVERS`: ``h2``, :mod:`router.h2_server`, cleartext only; ``grpcio``;
    ``auto``, either as :func:`resolve_grpc_server` says). Raises ``OSError`` when an address cannot be bound.
    """
    check_grpc_server(grpc_server, tls is not None)
    grpc_server = resolve_grpc_server(grpc_server, tls is not None)
    observer = observer or RequestObserver()
    # With worker_token every call to a worker carries it (cms.call_auth; workers refuse without it).
    pool = ChannelPool(
        max_channels=max_channels,
        tls=worker_tls,
        call_token=worker_token,
        keepalive_s=worker_keepalive[0],
        keepalive_timeout_s=worker_keepalive[1],
    )
    health = OutlierDetector(outlier)
    workers = WorkerClient(
        pool,
        connect_timeout_s=worker_connect_timeout_s,
        first_message_timeout_s=worker_first_message_timeout_s,
        health=health,
        streams=worker_streams,
    )
    tokenizer = tokenizer or load_tokenizer(None)
    # vLLM's gRPC service returns token ids only: its legs' text comes from the router's tokenizer.
    workers.vllm.set_decoder(tokenizer.decode)
    workers.vllm.set_pacing(vllm_stream_interval_s, vllm_stream_messages_per_s)
    workers.vllm.set_transport(vllm_transport)
    placer = Placer(scheduler, reader, observer=observer, health=health)
    service_config = service_config or ServiceConfig()
    if slice_config is not None and scheduler.predictors is None:
        raise ValueError(
            f"--dispatch-mode {dispatch_mode or 'slice'} needs latency profiles (--profile) to estimate slice times"
        )
    kv_feed = _kv_event_feed(scheduler, reader, pool, workers.vllm)
    # --dispatch-mode slice: the slice dispatcher (router.core.slice_dispatch) instead of the queue
    # policy's; auto: router.core.auto_dispatch, over both.
    admission = make_admission(
        placer,
        queue_config or QueueConfig(),
        qlm_config,
        observer=observer,
        slicing=slice_config,
        dispatch_mode=dispatch_mode,
    )
    reader.add_listener(admission.notify)
    service = RouterService(
        placer,
        workers,
        tokenizer,
        service_config,
        observer=observer,
        admission=admission,
    )
    server: grpc.aio.Server | H2Server
    health_servicer: Any
    if grpc_server == "h2":
        health_servicer = HealthState()
        for name in (SERVICE_NAME, ""):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        server = H2Server(
            router_methods(service, health_servicer, SERVICE_NAME),
            max_message_bytes=limits.SERVING_MAX_MESSAGE_BYTES,
        )
        port = await server.start(listen, reuse_port=reuse_port)
        await reader.start()
    else:
        server, port = await bind_server(
            listen,
            ROUTER_SERVER_OPTIONS,
            max_receive_bytes=limits.SERVING_MAX_MESSAGE_BYTES,
            max_send_bytes=limits.SERVING_MAX_MESSAGE_BYTES,
            tls=tls,
            reuse_port=reuse_port,
        )
        router_pb2_grpc.add_RouterServicer_to_server(service, server)
        health_servicer = add_health_and_reflection(server, SERVICE_NAME)
        for name in (SERVICE_NAME, ""):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await reader.start()
        await server.start()
    observer.bind_gauges(
        placer.instance_counts,
        lambda: len(scheduler.inflight),
        cms_lost=lambda: reader.source_lost,
        overpacked=placer.overpacked,
        desired=placer.desired_instances,
        cache_hit_rates=lambda: {
            r.instance_id: r.status.cache_hit_rate
            for r in placer.snapshot().instances
            if r.status is not None
        },
        dispatch_modes=lambda: _dispatch_modes(admission, "request" if slice_config is None else "slice"),
    )
    host = listen.rsplit(":", 1)[0]
    readiness = asyncio.get_running_loop().create_task(
        _ready_on_first_view(reader, health_servicer, source or type(reader).__name__),
        name="router-readiness",
    )
    owned: list[Any] = []
    router = RouterServer(
        server=server,
        service=service,
        scheduler=scheduler,
        admission=admission,
        reader=reader,
        pool=pool,
        workers=workers,
        observer=observer,
        health=health_servicer,
        address=f"{host}:{port}",
        readiness=readiness,
        owned=owned,
        kv_feed=kv_feed,
    )
    if http_listen:
        backend = RouterBackend(
            service,
            snapshot=reader.snapshot,
            instance_counts=placer.instance_counts,
            chat_template=chat_template or FallbackChatTemplate(),
            defaults=service_config,
            registry=observer.registry,
        )
        try:
            router.http = await start_http_edge(
                backend, http_listen, max_body_bytes=DEFAULT_MAX_BODY_BYTES, limits=http_limits
            )
        except BaseException:
            await router.stop(grace=0)
            raise
    return router


def _kv_event_feed(
    scheduler: Scheduler, reader: ClusterReader, pool: ChannelPool, vllm: VllmGrpcClient
) -> KvEventFeed | None:
    """Subscribe to the workers' prefix-cache events when the routing wants them: ``exact`` feeds its
    index; ``auto`` becomes exact for the instances that publish, approximate for the rest."""
    mode = PrefixRouting(scheduler.config.prefix_cache_routing)
    if mode is PrefixRouting.AUTO and not isinstance(scheduler.prefix, AutoPrefixIndex):
        scheduler.use_auto_prefix_index()
    prefix = scheduler.prefix
    if not isinstance(prefix, (ExactPrefixIndex, AutoPrefixIndex)):
        return None
    feed = KvEventFeed(prefix, pool, stale_s=max(scheduler.config.instance_staleness_s, 1.0), vllm=vllm)
    reader.add_snapshot_listener(feed.on_snapshot)
    return feed


#: After the drain time, how long the abandoned streams get to send their error and close (s).
ABANDON_WAIT_S = 5.0
#: Default ``--drain-timeout-s``.
DEFAULT_DRAIN_TIMEOUT_S = 30.0


def add_grpc_server_argument(parser: argparse.ArgumentParser) -> None:
    """``--grpc-server`` (``router`` and ``up``)."""
    parser.add_argument(
        "--grpc-server",
        metavar="{" + ",".join(GRPC_SERVERS) + "}",
        default=GRPC_SERVERS[0],
        help="what serves the Router gRPC service on --listen: h2, the router's own HTTP/2 server "
        "(cleartext only; Generate, Schedule, health and reflection as with grpcio), which writes "
        "every stream's messages of one event-loop pass in one system call and takes in every call "
        "of a network read at once: 15-40%% less router CPU per relayed token than grpcio at 16-64 "
        "streams and a shorter intake of bursts, with the whole router test suite passing on it "
        "(docs/vllm-grpc.md); grpcio, gRPC's own grpc.aio server (TLS); auto: h2, or grpcio with "
        "--tls-cert (default: %(default)s)",
    )


def resolve_grpc_server(value: str, tls: bool) -> str:
    """The server ``--grpc-server`` names: ``auto`` is ``h2``, or ``grpcio`` when serving TLS."""
    if value == "auto":
        return "grpcio" if tls else "h2"
    return value


def check_grpc_server(value: str, tls: bool) -> None:
    """``--grpc-server`` names a server, and h2 is not asked for TLS (``ValueError`` naming the flags)."""
    if value not in GRPC_SERVERS:
        raise ValueError(f"--grpc-server {value!r}: must be one of {', '.join(GRPC_SERVERS)}")
    if value == "h2" and tls:
        raise ValueError(
            "--grpc-server h2 serves cleartext HTTP/2 only: drop --tls-cert/--tls-key, or use "
            "--grpc-server grpcio for TLS"
        )


def add_drain_argument(parser: argparse.ArgumentParser) -> None:
    """``--drain-timeout-s`` (``router`` and ``up``)."""
    parser.add_argument(
        "--drain-timeout-s",
        type=float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        help="on SIGTERM/SIGINT: health goes NOT_SERVING, queued and new requests are refused "
        "(UNAVAILABLE / 503), and running ones may finish for this long; then they end with an "
        "error (an error event on HTTP streams). A second signal ends the wait (default: %(default)s)",
    )


def check_drain_timeout(args: argparse.Namespace) -> float:
    """``--drain-timeout-s`` within [0, 3600] (``ValueError`` naming the flag)."""
    value = args.drain_timeout_s
    if not (math.isfinite(value) and 0 <= value <= 3600):
        raise ValueError(f"--drain-timeout-s {value}: must be a number of seconds within [0, 3600]")
    return float(value)


async def wait_for_signals() -> asyncio.Event:
    """Wait for SIGINT or SIGTERM; the returned event is set by the next one (to cut a drain short)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    force = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, force.set)
    return force


#: How often the router repeats what it is waiting for while it has no cluster view.
WAITING_LOG_INTERVAL_S = 10.0


async def _ready_on_first_view(reader: ClusterReader, health: Any, source: str) -> None:
    """Turn health to ``SERVING`` once the first cluster view arrives; until then say what is awaited.

    Before the first view every request would fail (no instance is known), so
    a load balancer or ``up`` must not send traffic yet. Later outages keep
    ``SERVING``: the router then works from its last view (see cms.reader).
    """
    logger.info("waiting for the first cluster view from %s (health: NOT_SERVING until it arrives)", source)
    waited = 0.0
    while not await reader.wait_for_version(1, WAITING_LOG_INTERVAL_S):
        waited += WAITING_LOG_INTERVAL_S
        logger.warning(
            "still no cluster view from %s after %.0f s: is the CMS running and reachable? "
            "(health stays NOT_SERVING)",
            source,
            waited,
        )
    snapshot = reader.snapshot()
    reporting = sum(1 for r in snapshot.instances if r.status is not None)
    for name in (SERVICE_NAME, ""):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    logger.info(
        "first cluster view from %s: %d instances (%d reporting status); health: SERVING",
        source,
        len(snapshot.instances),
        reporting,
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
    ttft, tpot = args.ttft_profiling_data_path, args.tpot_profiling_data_path
    profile = getattr(args, "profile", None)
    if profile:  # --profile DIR, the form `up` and `plan` take: both files of one directory
        if ttft or tpot:
            raise ValueError(
                f"--profile {profile}: give either --profile or --ttft-/--tpot-profiling-data-path, not both"
            )
        if not Path(profile).is_dir():
            raise ValueError(f"--profile {profile}: not a directory (it needs ttft.json and tpot.json)")
        ttft, tpot = Path(profile) / "ttft.json", Path(profile) / "tpot.json"
    default = LatencyPredictor.from_files(
        ttft or DEFAULT_PROFILE_DIR / "ttft.json", tpot or DEFAULT_PROFILE_DIR / "tpot.json"
    )
    return PredictorSet(default, _profile_groups(args.profile_group))


#: The bound of ``--vllm-stream-interval-ms``: beyond it the pacing would be a TPOT of its own.
MAX_VLLM_STREAM_INTERVAL_MS = 100.0
#: The bound of ``--vllm-stream-messages-per-s`` (a budget that large never stretches the interval).
MAX_VLLM_STREAM_MESSAGES_PER_S = 1e6


def add_worker_streams_argument(parser: argparse.ArgumentParser) -> None:
    """``--worker-streams`` (shared by ``router`` and ``up``)."""
    parser.add_argument(
        "--worker-streams",
        metavar="{" + ",".join(WORKER_STREAMS) + "}",
        default="mux",
        help="mux: every request to a worker runs on one Worker.Streams call per connection, the "
        "worker sending one message per engine step for all of them (a worker without that RPC is "
        "served per request); per-request: one Generate/Decode call per request (default: %(default)s)",
    )
    parser.add_argument(
        "--vllm-stream-interval-ms",
        type=float,
        default=DEFAULT_STREAM_INTERVAL_S * 1e3,
        metavar="MS",
        help="stock vLLM engines (vllm-grpc instances) send one message per token: the router relays "
        "a stream's tokens in at most one message per MS milliseconds (each token at most MS late; "
        "the first token at once), which cuts the router's CPU per token; 0 relays each message as "
        f"it comes (0-{MAX_VLLM_STREAM_INTERVAL_MS:g}, default: %(default)g)",
    )
    parser.add_argument(
        "--vllm-stream-messages-per-s",
        type=float,
        default=DEFAULT_STREAM_MESSAGES_PER_S,
        metavar="N",
        help="with many stock-vLLM streams, stretch --vllm-stream-interval-ms so that all of them "
        "together get about N messages per second from this router process (each token at most "
        f"{MAX_RELAY_HOLD_S * 1e3:g} ms late, or --vllm-stream-interval-ms if longer): the router's CPU "
        "then stays flat as streams are added "
        f"instead of taking the engines' cores; 0 keeps the interval fixed (0-{MAX_VLLM_STREAM_MESSAGES_PER_S:g}, "
        "default: %(default)g)",
    )
    parser.add_argument(
        "--vllm-transport",
        metavar="{" + ",".join(VLLM_TRANSPORTS) + "}",
        default=VLLM_TRANSPORTS[0],
        help="how the streams of stock vLLM engines are read: h2, the router's own HTTP/2 reader (every "
        "token that one network read carries, for all streams, in one event-loop wake-up), or grpc "
        "(grpc.aio, a wake-up per token); TLS engines always use grpc (default: %(default)s)",
    )


def check_worker_streams(args: argparse.Namespace) -> None:
    """``--worker-streams`` names a mode (``ValueError`` naming the flag)."""
    if args.worker_streams not in WORKER_STREAMS:
        raise ValueError(
            f"--worker-streams {args.worker_streams!r}: must be one of {', '.join(WORKER_STREAMS)}"
        )
    interval = args.vllm_stream_interval_ms
    if not (math.isfinite(interval) and 0 <= interval <= MAX_VLLM_STREAM_INTERVAL_MS):
        raise ValueError(
            f"--vllm-stream-interval-ms {interval:g}: must be 0-{MAX_VLLM_STREAM_INTERVAL_MS:g} milliseconds"
        )
    if args.vllm_transport not in VLLM_TRANSPORTS:
        raise ValueError(
            f"--vllm-transport {args.vllm_transport!r}: must be one of {', '.join(VLLM_TRANSPORTS)}"
        )
    budget = args.vllm_stream_messages_per_s
    if not (math.isfinite(budget) and 0 <= budget <= MAX_VLLM_STREAM_MESSAGES_PER_S):
        raise ValueError(
            f"--vllm-stream-messages-per-s {budget:g}: must be 0-{MAX_VLLM_STREAM_MESSAGES_PER_S:g} messages per second"
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--listen", default=DEFAULT_LISTEN, help="HOST:PORT of the Router service (default: %(default)s)"
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="router processes accepting on --listen (SO_REUSEPORT; the kernel spreads connections "
        "over them), sharing their in-flight account through shared memory; needs an external CMS "
        "(--cms grpc://... or redis://...); the HTTP edge and --metrics-port stay on the first "
        "(default: %(default)s)",
    )
    # Internal: set by the first process on the ones it starts (NAME:SLOT:PROCESSES of the segment).
    parser.add_argument("--shared-inflight", default="", help=argparse.SUPPRESS)
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
    parser.add_argument(
        "--http-listen",
        default="",
        metavar="HOST:PORT",
        help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics) here; off by default",
    )
    add_http_edge_arguments(parser)
    parser.add_argument("--cluster-name", default="default", help="Redis key namespace with --cms redis://")
    parser.add_argument(
        "--cms-auth-token-file",
        default=None,
        help="file holding the token to read a grpc:// CMS with (needed once the CMS has tokens); "
        "with --cms memory, the tokens the embedded CMS accepts (one per line: TOKEN or NAME TOKEN)",
    )
    parser.add_argument(
        "--worker-auth-token-file",
        default=None,
        help="file holding the cluster's worker token: every call to a worker carries it (workers "
        "given the same file refuse Prefill/Generate/Decode/Streams/Abort without it)",
    )
    parser.add_argument(
        "--tls-cert", default=None, help="serve the Router service over TLS with this PEM chain"
    )
    parser.add_argument("--tls-key", default=None, help="the private key (PEM) of --tls-cert")
    parser.add_argument(
        "--tls-ca",
        default=None,
        help="CA bundle (PEM): reach workers and a grpc:// CMS over TLS, checking them against it",
    )
    parser.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="profile directory (ttft.json + tpot.json, e.g. from `slo-router profile`) to predict every "
        "instance with (default: the bundled Qwen2.5-7B profile)",
    )
    parser.add_argument(
        "--ttft-profiling-data-path",
        default=None,
        help="TTFT profile JSON, instead of --profile (default: the bundled Qwen2.5-7B profile's)",
    )
    parser.add_argument(
        "--tpot-profiling-data-path",
        default=None,
        help="TPOT profile JSON, instead of --profile (default: the bundled Qwen2.5-7B profile's)",
    )
    parser.add_argument(
        "--profile-group",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="a profile for instances whose metadata label (--profile-label) is NAME; repeatable",
    )
    SchedulerConfig.add_arguments(parser)
    add_slice_arguments(parser)
    QueueConfig.add_arguments(parser)
    QlmConfig.add_arguments(parser)
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
        "--worker-connect-timeout-s",
        type=float,
        default=2.0,
        help="a worker's channel must connect within this long, else the attempt fails and the "
        "instance is ejected for a while; an endpoint that accepts but never answers costs at most "
        "this per attempt (default: %(default)s)",
    )
    add_worker_streams_argument(parser)
    add_keepalive_arguments(parser)
    add_drain_argument(parser)
    add_grpc_server_argument(parser)
    parser.add_argument(
        "--worker-first-message-timeout-s",
        type=float,
        default=30.0,
        help="a worker call (Prefill, Decode, Generate) must produce its first message within this "
        "long, else the attempt fails and the instance is ejected for a while (default: %(default)s)",
    )
    parser.add_argument(
        "--outlier-consecutive-failures",
        type=int,
        default=OutlierConfig.consecutive_failures,
        help="failed calls in a row (no connection, no first message, broken stream) that eject an "
        "instance from placement (default: %(default)s)",
    )
    parser.add_argument(
        "--outlier-base-ejection-s",
        type=float,
        default=OutlierConfig.base_ejection_s,
        help="first ejection time; it doubles each time the instance fails again on probation "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--outlier-max-ejection-s",
        type=float,
        default=OutlierConfig.max_ejection_s,
        help="longest ejection (default: %(default)s)",
    )
    parser.add_argument(
        "--cms-rewarm-s",
        type=float,
        default=10.0,
        help="after the CMS comes back, instances of the last view it does not list yet are kept "
        "this long, so a restarted CMS does not empty the fleet (default: %(default)s)",
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
    # slo, as `up`, `plan` and `make run` use: a router started by hand behaves as the one `up` starts.
    parser.set_defaults(func=run, scheduling_policy="slo")


#: ServiceConfig fields set by the router's own flags (the SLO defaults come from SchedulerConfig's).
SERVICE_FLAGS: dict[str, str] = {
    "max_retries": "--max-retries",
    "prefill_timeout_s": "--prefill-timeout-s",
    "stream_timeout_s": "--stream-timeout-s",
    "max_prompt_tokens": "--max-prompt-tokens",
}


def scheduler_config(args: argparse.Namespace, **overrides: Any) -> SchedulerConfig:
    """The scheduler's config from the flags; errors name the flag (``--ttft-slo``), not the field."""
    try:
        return SchedulerConfig.from_namespace(args, **overrides)
    except ValueError as exc:
        raise ValueError(name_flags(str(exc), SchedulerConfig.flags())) from exc


def queue_config(args: argparse.Namespace) -> QueueConfig:
    """The router queue's config from the flags; errors name the flag (``--max-queue-size``)."""
    try:
        config = QueueConfig.from_namespace(args)
    except ValueError as exc:
        raise ValueError(name_flags(str(exc), QueueConfig.flags())) from exc
    return config


def qlm_config(args: argparse.Namespace) -> QlmConfig:
    """The qlm queue policy's config from the ``--qlm-*`` flags; errors name the flag."""
    try:
        return QlmConfig.from_namespace(args)
    except ValueError as exc:
        raise ValueError(name_flags(str(exc), QlmConfig.flags())) from exc


def outlier_config(args: argparse.Namespace) -> OutlierConfig:
    """The outlier detection the ``--outlier-*`` flags describe (errors name the flag)."""
    try:
        return OutlierConfig(
            consecutive_failures=args.outlier_consecutive_failures,
            base_ejection_s=args.outlier_base_ejection_s,
            max_ejection_s=args.outlier_max_ejection_s,
        )
    except ValueError as exc:
        flag = str(exc).split(" ", 1)[0].replace("_", "-")
        raise ValueError(f"--outlier-{flag}: {exc}") from None


def _check_availability_flags(args: argparse.Namespace) -> None:
    for flag in ("worker_connect_timeout_s", "worker_first_message_timeout_s"):
        value = getattr(args, flag)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"--{flag.replace('_', '-')} must be a finite number > 0, got {value!r}")
    if not (math.isfinite(args.cms_rewarm_s) and args.cms_rewarm_s >= 0):
        raise ValueError(f"--cms-rewarm-s must be a finite number >= 0, got {args.cms_rewarm_s!r}")


def _dispatch_modes(admission: Admission, fixed: str) -> dict[str, int]:
    """``slo_router_dispatch_mode``: 1 for the mode new arrivals get (``auto``'s choice, read from its
    ``mode``; else the one ``--dispatch-mode`` fixed)."""
    mode = getattr(admission.dispatcher, "mode", fixed)
    return {m: int(m == mode) for m in ("request", "slice")}


@dataclass
class RouterPlan:
    """Everything the router's flags describe, checked, with nothing started yet."""

    config: SchedulerConfig
    predictors: PredictorSet
    service_config: ServiceConfig
    tokenizer: Tokenizer
    #: ``--dispatch-mode slice``: the slice configuration (None: request dispatch).
    slice_config: SliceConfig | None = None
    queue: QueueConfig = field(default_factory=QueueConfig)
    #: ``--qlm-*``: the qlm queue policy's knobs (used with ``--queue-policy qlm``).
    qlm: QlmConfig = field(default_factory=QlmConfig)
    #: ``--outlier-*``: when failing instances are ejected from placement.
    outlier: OutlierConfig = field(default_factory=OutlierConfig)
    #: ``--http-*``: the HTTP edge's connection bounds.
    http_limits: EdgeLimits = field(default_factory=EdgeLimits)
    #: ``--dispatch-mode``: the dispatcher it names instead of the queue policy's ("": request).
    dispatch_mode: str = ""


def plan_from_args(args: argparse.Namespace) -> RouterPlan:
    """Check every flag and load every file the flags name; ``ValueError`` naming the flag.

    Runs before anything listens or connects, so a bad flag never starts (and
    stops) a half cluster.
    """
    config = scheduler_config(args)
    try:
        service_config = ServiceConfig(
            ttft_slo_ms=config.ttft_slo_ms,
            tpot_slo_ms=config.tpot_slo_ms,
            max_retries=args.max_retries,
            prefill_timeout_s=args.prefill_timeout_s,
            stream_timeout_s=args.stream_timeout_s,
            max_prompt_tokens=args.max_prompt_tokens,
        )
    except ValueError as exc:
        raise ValueError(name_flags(str(exc), {**SERVICE_FLAGS, **SchedulerConfig.flags()})) from exc
    check_processes(args)
    split_host_port("--listen", args.listen)
    if args.cms == "memory":
        split_host_port("--cms-listen", args.cms_listen)
    elif not args.cms.startswith(("redis://", "rediss://", "unix://")):
        try:
            args.cms = cms_target("--cms", args.cms)  # HOST:PORT and grpc://HOST:PORT alike
        except ValueError:
            raise ValueError(
                f"--cms {args.cms}: expected memory, HOST:PORT (grpc://HOST:PORT) or redis://HOST:PORT/DB"
            ) from None
    if args.http_listen:
        split_host_port("--http-listen", args.http_listen)
    check_port_range("--metrics-port", args.metrics_port)
    check_cms_token_file(args)
    if not args.cluster_name:
        raise ValueError("--cluster-name must not be empty")
    _check_availability_flags(args)
    keepalive_from_args(args)
    check_drain_timeout(args)
    check_worker_streams(args)
    check_grpc_server(args.grpc_server, bool(args.tls_cert))
    outlier = outlier_config(args)
    slice_config = slice_config_from_args(args)
    predictors = build_predictors(args)
    tokenizer = load_tokenizer(args.tokenizer)
    queue, qlm = queue_config(args), qlm_config(args)
    edge = edge_limits_from_args(args)
    check_addresses_free(args)
    return RouterPlan(
        config,
        predictors,
        service_config,
        tokenizer,
        slice_config,
        queue,
        qlm,
        outlier,
        edge,
        dispatch_mode=dispatcher_from_args(args),
    )


def check_addresses_free(args: argparse.Namespace) -> None:
    """Every address this router will listen on can be bound now; ``ValueError`` naming the flag.

    Last of the checks, so a mistaken flag is reported as itself even when a port is also taken.
    """
    if not args.shared_inflight:  # a process --processes started: the first one already listens there
        check_listen("--listen", args.listen)
    if args.cms == "memory":
        check_listen("--cms-listen", args.cms_listen)
    if args.http_listen:
        check_listen("--http-listen", args.http_listen)
    check_metrics_port("--metrics-port", args.metrics_port, args.metrics_host)


def check_cms_token_file(args: argparse.Namespace) -> None:
    """``--cms-auth-token-file`` can be read and holds what its use needs; ``ValueError`` naming it.

    With ``--cms memory`` it is the embedded CMS's token file (``NAME TOKEN`` lines), else the
    token this router reads a CMS with.
    """
    from cms.auth import TokenTable

    path = args.cms_auth_token_file
    if not path:
        return
    text = read_flag_file("--cms-auth-token-file", path)
    try:
        if args.cms == "memory":
            TokenTable.parse(text, "")
        else:
            read_client_token_text(text, "")
    except ValueError as exc:
        raise ValueError(f"--cms-auth-token-file {path}: {exc}") from None


def check_processes(args: argparse.Namespace) -> None:
    """``--processes`` and the internal ``--shared-inflight``; ``ValueError`` naming the flag."""
    from router.shared_inflight import MAX_PROCESSES

    if not 1 <= args.processes <= MAX_PROCESSES:
        raise ValueError(f"--processes {args.processes}: must be within [1, {MAX_PROCESSES}]")
    if args.processes > 1 and args.cms == "memory":
        raise ValueError(
            f"--processes {args.processes}: every router needs the same cluster view, and an embedded "
            "CMS (--cms memory) lives in one of them: give --cms grpc://HOST:PORT or redis://..."
        )
    if args.shared_inflight:
        name, _, rest = args.shared_inflight.partition(":")
        slot, _, processes = rest.partition(":")
        if not (name and slot.isdigit() and processes.isdigit() and 0 < int(slot) < int(processes)):
            raise ValueError(f"--shared-inflight {args.shared_inflight!r}: expected NAME:SLOT:PROCESSES")


async def start_from_args(args: argparse.Namespace, plan: RouterPlan | None = None) -> RouterServer:
    """Build everything the flags describe and start serving."""
    plan = plan or plan_from_args(args)
    scheduler = Scheduler(plan.config, plan.predictors, PeekableRandom(args.seed))
    tls = server_tls_from_args(args.tls_cert, args.tls_key)
    client_tls = client_tls_from_arg(args.tls_ca)
    worker_token = read_worker_token(args.worker_auth_token_file)
    cms_token = None
    if args.cms_auth_token_file:
        try:
            cms_token = read_client_token(Path(args.cms_auth_token_file))
        except OSError as exc:
            raise ValueError(f"--cms-auth-token-file: {exc}") from None
    owned: list[Any] = []
    if args.cms == "memory":
        from cms.auth import TokenTable
        from cms.cli import is_loopback
        from cms.memory import MemoryStore
        from cms.server import start_cms_server

        tokens = TokenTable.from_file(Path(args.cms_auth_token_file)) if args.cms_auth_token_file else None
        if tokens is None and not is_loopback(args.cms_listen):
            raise ValueError(
                f"--cms-listen {args.cms_listen} is not a loopback address: give --cms-auth-token-file "
                "(the tokens the embedded CMS accepts)"
            )
        store = MemoryStore()
        cms = await start_cms_server(store, args.cms_listen, tokens=tokens, tls=tls)
        owned.append(cms)
        logger.info("embedded CMS listening on %s", cms.address)
        reader = open_reader("memory", store=store, rewarm_s=args.cms_rewarm_s)
        source = f"the embedded CMS on {cms.address}"
    else:
        reader = open_reader(
            args.cms,
            cluster_name=args.cluster_name,
            auth_token=cms_token,
            tls=client_tls,
            rewarm_s=args.cms_rewarm_s,
        )
        source = args.cms
    observer = RequestObserver()
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.metrics_host, registry=observer.registry)
    try:
        server = await start_router_server(
            reader,
            scheduler,
            listen=args.listen,
            service_config=plan.service_config,
            tokenizer=plan.tokenizer,
            observer=observer,
            source=source,
            worker_connect_timeout_s=args.worker_connect_timeout_s,
            worker_first_message_timeout_s=args.worker_first_message_timeout_s,
            outlier=plan.outlier,
            slice_config=plan.slice_config,
            dispatch_mode=plan.dispatch_mode,
            http_listen=args.http_listen,
            chat_template=load_chat_template(args.tokenizer),
            queue_config=plan.queue,
            qlm_config=plan.qlm,
            tls=tls,
            worker_tls=client_tls,
            reuse_port=args.processes > 1 or bool(args.shared_inflight),
            worker_streams=args.worker_streams,
            vllm_stream_interval_s=args.vllm_stream_interval_ms / 1e3,
            vllm_stream_messages_per_s=args.vllm_stream_messages_per_s,
            vllm_transport=args.vllm_transport,
            http_limits=plan.http_limits,
            worker_token=worker_token,
            worker_keepalive=keepalive_from_args(args),
            grpc_server=args.grpc_server,
        )
    except BaseException:
        for resource in reversed(owned):
            await resource.stop()
        raise
    server.owned.extend(owned)
    # What start-up built (profiles, tables, modules) lives as long as the process: out of the
    # collector's way, so that the collections the token path's garbage triggers only walk what
    # was made since (the collector was a few per cent of the router's CPU on the token path).
    gc.freeze()
    logger.info(
        "router: policy %s%s, default SLO TTFT %.0f ms / TPOT %.0f ms",
        plan.config.scheduling_policy
        if plan.config.policy_config_path is None
        else plan.config.policy_config_path,
        " + adaptive PD" if plan.config.enable_adaptive_pd else "",
        plan.config.ttft_slo_ms,
        plan.config.tpot_slo_ms,
    )
    return server


async def _serve(args: argparse.Namespace, plan: RouterPlan) -> int:
    from router.processes import RouterProcesses

    server = await start_from_args(args, plan)
    try:
        group = await RouterProcesses.start(args, server.address, server.service, server.scheduler.inflight)
    except BaseException:
        await server.stop(grace=0)
        raise
    print(f"router listening on {server.address}", flush=True)
    if server.http is not None:
        print(f"OpenAI-compatible HTTP API on http://{server.http.address}/v1", flush=True)
    force = await wait_for_signals()
    logger.info("shutting down (draining for up to %.0f s)", args.drain_timeout_s)
    # The other processes drain as this one does, at the same time (each got SIGTERM).
    await asyncio.gather(
        group.stop(timeout_s=args.drain_timeout_s + ABANDON_WAIT_S + 10.0),
        server.stop(grace=5.0, drain_timeout_s=args.drain_timeout_s, force=force),
    )
    await group.close()
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        plan = plan_from_args(args)
    except ValueError as exc:  # ProfileError included: it names the file and the entry
        print(error_line(exc), file=sys.stderr)
        return 2
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency; run without it if absent
        pass
    try:
        return asyncio.run(_serve(args, plan))
    except (ValueError, OSError) as exc:  # an address that cannot be bound: say which
        print(error_line(exc), file=sys.stderr)
        return 2
