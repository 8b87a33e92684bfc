"""Prometheus metrics of a worker, read from its engine when scraped.

The engine's load is already kept up to date for the status agent, so the
exporter reads it at scrape time instead of being updated on the hot path.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.interface import Engine

_GAUGES = (
    ("num_waiting_requests", "slo_router_worker_waiting_requests", "Requests waiting to be scheduled"),
    ("num_running_requests", "slo_router_worker_running_requests", "Requests running on the engine"),
    (
        "num_uncomputed_prefill_tokens",
        "slo_router_worker_uncomputed_prefill_tokens",
        "Prompt tokens not yet computed",
    ),
    ("num_decode_requests", "slo_router_worker_decode_requests", "Requests in or waiting for decode"),
    ("num_decode_tokens", "slo_router_worker_decode_tokens", "Context tokens of the decode batch"),
    ("num_used_kv_tokens", "slo_router_worker_kv_used_tokens", "KV cache tokens in use"),
)


class EngineCollector(Collector):
    """Engine load and step counts, labelled with the instance id."""

    def __init__(self, engine: Engine, instance_id: str) -> None:
        self._engine = engine
        self._instance_id = instance_id

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        load = self._engine.load()
        for attr, name, doc in _GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["instance"])
            family.add_metric([self._instance_id], float(getattr(load, attr)))
            yield family
        capacity = GaugeMetricFamily(
            "slo_router_worker_kv_capacity_tokens", "KV cache size in tokens", labels=["instance"]
        )
        capacity.add_metric([self._instance_id], float(self._engine.info.kv_capacity_tokens))
        yield capacity
        schedulable = GaugeMetricFamily(
            "slo_router_worker_schedulable", "1 when the engine accepts new work", labels=["instance"]
        )
        schedulable.add_metric([self._instance_id], 1.0 if load.schedulable else 0.0)
        yield schedulable
        steps = CounterMetricFamily("slo_router_worker_steps", "Engine steps run", labels=["instance"])
        steps.add_metric([self._instance_id], float(load.num_steps))
        yield steps


def serve_metrics(engine: Engine, instance_id: str, port: int, host: str = "127.0.0.1") -> CollectorRegistry:
    """Serve the engine's metrics over HTTP on ``host:port``; returns the registry."""
    from prometheus_client import start_http_server

    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, instance_id))
    start_http_server(port, addr=host, registry=registry)
    return registry
