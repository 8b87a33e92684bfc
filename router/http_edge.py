"""The router's OpenAI-compatible HTTP edge (``--http-listen``).

Requests arrive as OpenAI ``/v1/completions`` or ``/v1/chat/completions``
bodies (:mod:`openai_http`), become the same ``GenerateRequest`` a gRPC client
would send, and run through :meth:`router.service.RouterService.generate`: the
one path that validates, places, forwards, retries and accounts. Nothing
about a request is decided here but its translation.

SLO targets come from headers or from the body's ``slo`` object (an extra
field the ``openai`` client sends with ``extra_body``); a header wins over the
body field it duplicates:

==================  =====================  =========================================
header              body field             meaning
==================  =====================  =========================================
``x-slo-ttft-ms``   ``slo.ttft_ms``        TTFT target (ms); absent = router default
``x-slo-tpot-ms``   ``slo.tpot_ms``        TPOT target (ms); absent = router default
``x-slo-e2e-ms``    ``slo.e2e_ms``         end-to-end target (ms); absent = none
``x-slo-priority``  ``slo.priority``       priority (integer); ``priority`` works too
``x-slo-class``     ``slo.class``          a name the SLO metrics are labelled with
==================  =====================  =========================================

Router errors map to HTTP statuses here (and to gRPC codes in the service):
a malformed request is 400, an id already in flight 409, a target no idle
instance could meet, "no instance can take it" (``--queue-policy none``), a
full queue or a queue wait over ``--max-queue-wait-ms`` 429, a late request under ``--late-policy reject`` 504,
an empty or failing fleet 503. With the defaults (``edf``, ``--late-policy
serve``) a request no instance can meet waits and is served: a late one is a
200 with ``x-slo-router-late: true`` and ``"late": true`` in its usage object.
Responses carry the route in ``x-slo-router-*`` headers. The edge adds two metric families to
the router's registry: the targets in force per class, and per class how many
completed requests met all their targets.
"""

from __future__ import annotations

import argparse
import contextlib
import re
from collections.abc import AsyncGenerator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector
from slorouter.v1 import common_pb2, router_pb2

from fleet.snapshot import ClusterSnapshot
from openai_http.app import HttpServer, OpenAIApp, Piece
from openai_http.bounded import EdgeLimits, EdgeStats, default_max_connections
from openai_http.protocol import ApiError, ParsedRequest, Usage
from router.chat_template import ChatTemplate
from router.core.errors import (
    DuplicateRequestError,
    EmptyClusterError,
    InvalidRequestError,
    LateError,
    NoInstanceError,
    QueueFullError,
    QueueTimeoutError,
    RetriesExhaustedError,
    RouterError,
    ShuttingDownError,
    UnmeetableError,
)
from router.forward import LegError
from router.service import RouterService, ServiceConfig

#: Bounds of the SLO fields (inclusive).
MAX_TARGET_MS = 1e7
PRIORITY_RANGE = (-(1 << 31), (1 << 31) - 1)
SLO_CLASS_PATTERN = re.compile(r"[A-Za-z0-9_.\-]{1,32}")
DEFAULT_SLO_CLASS = "default"
#: Classes beyond this many distinct names are counted as "other" (metric labels stay bounded).
MAX_SLO_CLASSES = 16
_TARGET_BUCKETS_S = (0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300)


@dataclass(frozen=True)
class SloRequest:
    """The SLO fields of one HTTP request; 0 = not given."""

    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    e2e_ms: float = 0.0
    priority: int = 0
    slo_class: str = DEFAULT_SLO_CLASS


def _target(value: Any, name: str) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ApiError(
                400, f"{name}: must be a number of milliseconds, got {value!r}", param=name
            ) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError(400, f"{name}: must be a number of milliseconds", param=name)
    if not (0 < value <= MAX_TARGET_MS):
        raise ApiError(400, f"{name}: must be within (0, {MAX_TARGET_MS:g}] ms, got {value!r}", param=name)
    return float(value)


def _priority(value: Any, name: str) -> int:
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            raise ApiError(400, f"{name}: must be an integer, got {value!r}", param=name) from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name}: must be an integer", param=name)
    lo, hi = PRIORITY_RANGE
    if not lo <= value <= hi:
        raise ApiError(400, f"{name}: must be within [{lo}, {hi}], got {value}", param=name)
    return value


def _slo_class(value: Any, name: str) -> str:
    if not isinstance(value, str) or not SLO_CLASS_PATTERN.fullmatch(value):
        raise ApiError(
            400,
            f"{name}: must be 1-32 characters of letters, digits, '_', '.', '-'; got {value!r}",
            param=name,
        )
    return value


_FIELDS: tuple[tuple[str, str, Callable[[Any, str], Any]], ...] = (
    ("ttft_ms", "x-slo-ttft-ms", _target),
    ("tpot_ms", "x-slo-tpot-ms", _target),
    ("e2e_ms", "x-slo-e2e-ms", _target),
    ("priority", "x-slo-priority", _priority),
    ("class", "x-slo-class", _slo_class),
)


def parse_slo(headers: Mapping[str, str], body: Mapping[str, Any]) -> SloRequest:
    """The SLO fields of a request: headers first, then the body's ``slo`` object (and ``priority``)."""
    slo = body.get("slo")
    if slo is None:
        slo = {}
    if not isinstance(slo, dict):
        raise ApiError(400, "slo: must be an object (ttft_ms, tpot_ms, e2e_ms, priority, class)", param="slo")
    unknown = set(slo) - {name for name, _, _ in _FIELDS}
    if unknown:
        raise ApiError(400, f"slo: unknown field(s) {', '.join(sorted(unknown))}", param="slo")
    values: dict[str, Any] = {}
    for name, header, check in _FIELDS:
        if header in headers:
            values[name] = check(headers[header], header)
        elif name in slo:
            values[name] = check(slo[name], f"slo.{name}")
        elif name == "priority" and body.get("priority") is not None:
            values[name] = check(body["priority"], "priority")
    return SloRequest(
        ttft_ms=values.get("ttft_ms", 0.0),
        tpot_ms=values.get("tpot_ms", 0.0),
        e2e_ms=values.get("e2e_ms", 0.0),
        priority=values.get("priority", 0),
        slo_class=values.get("class", DEFAULT_SLO_CLASS),
    )


def http_status(exc: RouterError | LegError) -> int:
    """The one place router errors become HTTP statuses."""
    if isinstance(exc, LegError):
        if exc.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
            return 400
        if exc.code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            return 429
        return 503 if exc.retryable else 502
    if isinstance(exc, InvalidRequestError):
        return 400
    if isinstance(exc, DuplicateRequestError):
        return 409
    if isinstance(exc, (NoInstanceError, QueueFullError, QueueTimeoutError, UnmeetableError)):
        return 429
    if isinstance(exc, LateError):
        return 504
    if isinstance(exc, (EmptyClusterError, RetriesExhaustedError, ShuttingDownError)):
        return 503
    return 500


class EdgeMetrics:
    """Per-SLO-class metrics of the HTTP edge, on the router's registry."""

    def __init__(self, registry: CollectorRegistry, max_classes: int = MAX_SLO_CLASSES) -> None:
        self._classes: set[str] = set()
        self._max_classes = max_classes
        self.targets = Histogram(
            "slo_router_slo_target_seconds",
            "SLO targets in force for HTTP requests, per class and target",
            ["slo_class", "target"],
            buckets=_TARGET_BUCKETS_S,
            registry=registry,
        )
        self.results = Counter(
            "slo_router_slo_requests",
            "Completed HTTP requests per class: whether every target in force was met",
            ["slo_class", "result"],
            registry=registry,
        )

    def label(self, slo_class: str) -> str:
        if slo_class in self._classes:
            return slo_class
        if len(self._classes) < self._max_classes:
            self._classes.add(slo_class)
            return slo_class
        return "other"

    def accepted(self, label: str, targets_ms: Mapping[str, float]) -> None:
        for target, value in targets_ms.items():
            if value > 0:
                self.targets.labels(slo_class=label, target=target).observe(value / 1e3)

    def completed(self, label: str, targets_ms: Mapping[str, float], usage: router_pb2.Usage) -> None:
        measured = {"ttft": usage.ttft_ms, "tpot": usage.tpot_ms, "e2e": usage.e2e_ms}
        met = all(measured[t] <= v for t, v in targets_ms.items() if v > 0)
        self.results.labels(slo_class=label, result="met" if met else "missed").inc()


def _route_headers(route: router_pb2.RouteInfo, *, late: bool = False) -> dict[str, str]:
    headers = {
        "x-slo-router-prefill": route.prefill_instance_id,
        "x-slo-router-decode": route.decode_instance_id,
        "x-slo-router-policy": route.policy,
        "x-slo-router-predicted-ttft-ms": f"{route.predicted_ttft_ms:.3f}",
        "x-slo-router-predicted-tpot-ms": f"{route.predicted_tpot_ms:.3f}",
    }
    if late:
        # Served although its TTFT target was out of reach (--late-policy serve): a 200 that
        # already missed its SLO. The usage object of the last chunk says it again (``late``).
        headers["x-slo-router-late"] = "true"
    return headers


class RouterBackend:
    """Serves the OpenAI API through the router service."""

    owner = "slo-router"

    def __init__(
        self,
        service: RouterService,
        *,
        snapshot: Callable[[], ClusterSnapshot],
        instance_counts: Callable[[], dict[tuple[str, str], int]],
        chat_template: ChatTemplate,
        defaults: ServiceConfig,
        registry: CollectorRegistry,
    ) -> None:
        self._service = service
        self._snapshot = snapshot
        self._instance_counts = instance_counts
        self._chat = chat_template
        self._defaults = defaults
        self._registry = registry
        self._metrics = EdgeMetrics(registry)
        self._edge_stats_registered = False

    def register_edge_stats(self, stats: EdgeStats) -> None:
        """Export the connection bounds' refusals next to the edge's other metrics (once)."""
        if not self._edge_stats_registered:
            self._registry.register(EdgeCollector(stats))
            self._edge_stats_registered = True

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        try:
            return self._chat.render(messages)
        except InvalidRequestError as exc:
            raise ApiError(400, str(exc), param="messages") from exc

    def models(self) -> list[tuple[str, int]]:
        lengths: dict[str, int] = {}
        for record in self._snapshot().instances:
            meta = record.metadata
            if meta.model:
                lengths[meta.model] = max(lengths.get(meta.model, 0), meta.max_model_len)
        return sorted(lengths.items())

    def health(self) -> str | None:
        if self._service.draining:
            return "the router is shutting down (draining): send requests elsewhere"
        counts = self._instance_counts()
        if any(n for (_, health), n in counts.items() if health == "healthy"):
            return None
        return "no healthy instance in the router's view (none registered, all stale or unschedulable)"

    def metrics(self) -> tuple[bytes, str]:
        return generate_latest(self._registry), CONTENT_TYPE_LATEST

    async def generate(
        self, request: ParsedRequest, headers: Mapping[str, str]
    ) -> AsyncGenerator[Piece, None]:
        slo = parse_slo(headers, request.body)
        message = router_pb2.GenerateRequest(
            model=request.model,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            sampling=request.sampling,
            slo=common_pb2.SloTarget(ttft_ms=slo.ttft_ms, tpot_ms=slo.tpot_ms, e2e_ms=slo.e2e_ms),
            priority=slo.priority,
            slo_class=slo.slo_class,
        )
        targets = {
            "ttft": slo.ttft_ms or self._defaults.ttft_slo_ms,
            "tpot": slo.tpot_ms or self._defaults.tpot_slo_ms,
            "e2e": slo.e2e_ms,
        }
        label = self._metrics.label(slo.slo_class)
        try:
            async with contextlib.aclosing(self._service.generate(message)) as stream:
                async for out in stream:
                    piece = Piece(out.text, out.finished, out.finish_reason)
                    if out.route is not None:  # the first step
                        self._metrics.accepted(label, targets)
                        piece.headers = _route_headers(out.route, late=out.late)
                    if out.finished and out.usage is not None:
                        piece.usage = Usage(
                            out.usage.prompt_tokens,
                            out.usage.completion_tokens,
                            {"late": out.usage.late, "queue_wait_ms": round(out.usage.queue_wait_ms, 3)},
                        )
                        self._metrics.completed(label, targets, out.usage)
                    yield piece
        except (RouterError, LegError) as exc:
            raise ApiError(http_status(exc), str(exc)) from exc


def add_http_edge_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--http-*`` bounds of the HTTP edge's connections (shared by ``router`` and ``up``)."""
    defaults = EdgeLimits()
    parser.add_argument(
        "--http-max-header-bytes",
        type=int,
        default=defaults.max_header_bytes,
        help="largest HTTP request head (request line + headers) in bytes; a larger one gets 431 at "
        "once, before it is parsed (default: %(default)s)",
    )
    parser.add_argument(
        "--http-max-headers",
        type=int,
        default=defaults.max_headers,
        help="most header lines in one HTTP request; more get 431 (default: %(default)s)",
    )
    parser.add_argument(
        "--http-header-timeout-s",
        type=float,
        default=defaults.header_timeout_s,
        help="a started HTTP request head must arrive within this long, else 408 and close "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--http-idle-timeout-s",
        type=float,
        default=defaults.idle_timeout_s,
        help="an HTTP connection with no request in progress (new or kept alive) is closed after this "
        "long (default: %(default)s)",
    )
    parser.add_argument(
        "--http-max-connections",
        type=int,
        default=0,
        help="open HTTP connections at most; one more is closed when accepted. 0 = half the process's "
        f"open-file limit minus 64 (now {default_max_connections()}), so gRPC keeps descriptors "
        "(default: %(default)s)",
    )


#: ``EdgeLimits`` fields and the flags that set them.
_EDGE_FLAGS = {
    "max_header_bytes": "--http-max-header-bytes",
    "max_headers": "--http-max-headers",
    "header_timeout_s": "--http-header-timeout-s",
    "idle_timeout_s": "--http-idle-timeout-s",
    "max_connections": "--http-max-connections",
}


def edge_limits_from_args(args: argparse.Namespace) -> EdgeLimits:
    """The ``--http-*`` bounds, checked; ``ValueError`` naming the flag."""
    values = {name: getattr(args, flag[2:].replace("-", "_")) for name, flag in _EDGE_FLAGS.items()}
    try:
        return EdgeLimits(**values)
    except ValueError as exc:
        text = str(exc)
        for name, flag in _EDGE_FLAGS.items():
            if text.startswith(name):
                raise ValueError(flag + text[len(name) :]) from None
        raise


class EdgeCollector(Collector):
    """Exports the HTTP edge's connection refusals (:class:`EdgeStats`) on the router's registry."""

    def __init__(self, stats: EdgeStats) -> None:
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        refused = CounterMetricFamily(
            "slo_router_http_refused_connections",
            "HTTP connections refused by the edge's bounds, by reason",
            labels=["reason"],
        )
        for reason, count in sorted(self._stats.refused.items()):
            refused.add_metric([reason], count)
        yield refused
        yield GaugeMetricFamily(
            "slo_router_http_open_connections",
            "HTTP connections open now",
            value=self._stats.open_connections,
        )


async def start_http_edge(
    backend: RouterBackend,
    listen: str,
    *,
    max_body_bytes: int,
    limits: EdgeLimits | None = None,
    graceful_shutdown_s: float = 2.0,
) -> HttpServer:
    """Serve ``backend`` on ``listen`` (``HOST:PORT``; port 0 picks one). Raises ``OSError`` when taken.

    ``limits`` bound the connections (:mod:`openai_http.bounded`); what they refuse is
    counted on the backend's registry.
    """
    stats = EdgeStats()
    server = HttpServer(
        OpenAIApp(backend, max_body_bytes=max_body_bytes).app,
        listen,
        limits=limits,
        stats=stats,
        graceful_shutdown_s=graceful_shutdown_s,
    )
    backend.register_edge_stats(stats)
    await server.start()
    return server
