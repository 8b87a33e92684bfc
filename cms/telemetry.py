"""Prometheus metrics of a CMS, read from the running server when scraped."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from slorouter.v1 import cms_pb2

from cms.server import CmsServer

_ROLES = {
    cms_pb2.INSTANCE_ROLE_NEUTRAL: "neutral",
    cms_pb2.INSTANCE_ROLE_PREFILL: "prefill",
    cms_pb2.INSTANCE_ROLE_DECODE: "decode",
}


class CmsCollector(Collector):
    """Instances in the view by role and health, watchers, and whether the store answers."""

    def __init__(self, server: CmsServer) -> None:
        self._server = server

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        snapshot = self._server.pump.latest
        instances = GaugeMetricFamily(
            "slo_router_cms_instances", "Instances in the cluster view", labels=["role", "health"]
        )
        counts: dict[tuple[str, str], int] = {
            (role, health): 0
            for role in _ROLES.values()
            for health in ("schedulable", "unschedulable", "no_status")
        }
        for record in snapshot.instances if snapshot is not None else ():
            role = _ROLES.get(record.metadata.role, "neutral")
            if record.status is None:
                health = "no_status"
            else:
                health = "schedulable" if record.status.schedulable else "unschedulable"
            counts[(role, health)] += 1
        for (role, health), count in sorted(counts.items()):
            instances.add_metric([role, health], float(count))
        yield instances
        watchers = GaugeMetricFamily("slo_router_cms_watchers", "Open WatchClusterView streams")
        watchers.add_metric([], float(self._server.service.watchers))
        yield watchers
        skew = self._server.service.skew
        ahead_ms, behind_ms = skew.take()
        skew_gauge = GaugeMetricFamily(
            "slo_router_cms_status_clock_skew_seconds",
            "Largest skew of status timestamps against the CMS clock since the last scrape",
            labels=["direction"],
        )
        skew_gauge.add_metric(["ahead"], ahead_ms / 1000.0)
        skew_gauge.add_metric(["behind"], behind_ms / 1000.0)
        yield skew_gauge
        refused = CounterMetricFamily(
            "slo_router_cms_status_skew_refused", "Statuses refused because their timestamp was in the future"
        )
        refused.add_metric([], float(skew.refused))
        yield refused
        up = GaugeMetricFamily("slo_router_cms_store_up", "1 when the last read of the store succeeded")
        up.add_metric([], 1.0 if snapshot is not None and self._server.pump.error is None else 0.0)
        yield up


def serve_metrics(server: CmsServer, port: int, host: str = "127.0.0.1") -> CollectorRegistry:
    """Serve the CMS's metrics over HTTP on ``host:port``; returns the registry."""
    from prometheus_client import start_http_server

    registry = CollectorRegistry()
    registry.register(CmsCollector(server))
    start_http_server(port, addr=host, registry=registry)
    return registry
