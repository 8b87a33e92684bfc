"""Prometheus metrics of the router, on a registry of its own.

Names share the ``slo_router_`` prefix and carry units; labels are bounded
(outcome, stage, group, role, health, and the instance id of the per-instance
packing gauge: one series per instance in the view), never request ids. The prediction
error is observed TTFT/TPOT minus the prediction the decision was made with,
per instance group, so an operator sees when a profile no longer matches
the fleet; the same as a ratio (observed / predicted), and the online
calibration's factors and drifted instances per group.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fleet.snapshot import ClusterSnapshot
from router.core.calibration import Calibrator
from router.core.errors import (
    EmptyClusterError,
    InvalidRequestError,
    LateError,
    NoInstanceError,
    QueueFullError,
    QueueTimeoutError,
    RetriesExhaustedError,
    RouterError,
    ShedError,
    ShuttingDownError,
    UnmeetableError,
)
from router.core.lifecycle import Phase
from router.core.request import ScheduleInput
from router.route import Route

#: Distinct ``slo_class`` label values kept; later ones are counted as "other".
MAX_CLASS_LABELS = 32
#: Priorities outside +-this are labelled at the bound ("<=-10", ">=10").
PRIORITY_LABEL_BOUND = 10
_QUEUE_WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.2, 0.5, 1)
_ERROR_BUCKETS_S = (-1, -0.25, -0.1, -0.05, -0.02, -0.01, -0.005, 0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1)
_RATIO_BUCKETS = (0.25, 0.5, 0.67, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0)
_SCHEDULE_BUCKETS_S = (2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2)


def _outcome_of(exc: RouterError) -> str:
    if isinstance(exc, InvalidRequestError):
        return "invalid"
    if isinstance(exc, NoInstanceError):
        return "no_instance"
    if isinstance(exc, EmptyClusterError):
        return "unavailable"
    if isinstance(exc, RetriesExhaustedError):
        return "retries_exhausted"
    if isinstance(exc, ShedError):
        return "shed_overlong"
    if isinstance(exc, QueueFullError):
        return "shed"
    if isinstance(exc, QueueTimeoutError):
        return "queue_timeout"
    if isinstance(exc, LateError):
        return "late_rejected"
    if isinstance(exc, UnmeetableError):
        return "unmeetable"
    if isinstance(exc, ShuttingDownError):
        return "shutting_down"
    return "error"


class RequestObserver:
    """Records what happens to requests. The default instance keeps its own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "slo_router_requests", "Generate requests by outcome", ["outcome"], registry=r
        )
        self.retries = Counter(
            "slo_router_retries", "Attempts repeated on another instance", ["phase"], registry=r
        )
        self.ttft = Histogram(
            "slo_router_ttft_seconds",
            "Router-measured time to first token",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.tpot = Histogram(
            "slo_router_tpot_seconds",
            "Router-measured mean time per output token",
            buckets=_TPOT_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            "slo_router_e2e_seconds",
            "Router-measured end-to-end latency",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.ttft_error = Histogram(
            "slo_router_ttft_prediction_error_seconds",
            "Observed minus predicted TTFT, per prefill instance group",
            ["group"],
            buckets=_ERROR_BUCKETS_S,
            registry=r,
        )
        self.tpot_error = Histogram(
            "slo_router_tpot_prediction_error_seconds",
            "Observed minus predicted TPOT, per decode instance group",
            ["group"],
            buckets=_ERROR_BUCKETS_S,
            registry=r,
        )
        self.ttft_ratio = Histogram(
            "slo_router_ttft_observed_over_predicted_ratio",
            "Observed TTFT divided by the TTFT the placement predicted, per prefill instance group",
            ["group"],
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.tpot_ratio = Histogram(
            "slo_router_tpot_observed_over_predicted_ratio",
            "Observed TPOT divided by the TPOT the placement predicted, per decode instance group",
            ["group"],
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.calibration_factor = Gauge(
            "slo_router_calibration_factor_ratio",
            "Mean online-calibration factor (observed / profile step time) over a group's instances",
            ["group", "prediction"],
            registry=r,
        )
        self.calibration_drifted = Gauge(
            "slo_router_calibration_drifted_instances",
            "Instances whose observed/profile step time is beyond the calibration's drift bound",
            ["group"],
            registry=r,
        )
        self.schedule_latency = Histogram(
            "slo_router_schedule_latency_seconds",
            "Time to make one placement decision",
            buckets=_SCHEDULE_BUCKETS_S,
            registry=r,
        )
        self.instances = Gauge(
            "slo_router_instances", "Instances in the router's view", ["role", "health"], registry=r
        )
        self.inflight_entries = Gauge(
            "slo_router_inflight_entries", "Entries in the in-flight account", registry=r
        )
        self.queue_length = Gauge(
            "slo_router_queue_requests",
            "Requests waiting in the router queue, by class and priority",
            ["slo_class", "priority"],
            registry=r,
        )
        self.phases = Gauge(
            "slo_router_requests_in_phase",
            "Requests the router serves now, by the phase of their lifecycle (router.core.lifecycle)",
            ["phase"],
            registry=r,
        )
        # One child per live phase, bound once: a move costs two increments, no label lookup.
        self._phase_gauges = {p: self.phases.labels(phase=p.value) for p in Phase if not p.terminal}
        self.queue_wait = Histogram(
            "slo_router_queue_wait_seconds",
            "Time a dispatched request waited in the router queue",
            buckets=_QUEUE_WAIT_BUCKETS_S,
            registry=r,
        )
        self.queue_events = Counter(
            "slo_router_queue_events",
            "Router queue events: shed (full queue), late (TTFT target out of reach), expired, rejected, "
            "overlong (refused under --queue-objective g)",
            ["event"],
            registry=r,
        )
        self.queue_shed_limit = Gauge(
            "slo_router_queue_shed_limit_seconds",
            "--queue-objective g: requests predicted to take longer than this to finish are refused while "
            "the fleet is short (+Inf: none are)",
            registry=r,
        )
        self.queue_shed_limit.set(math.inf)
        self._classes: set[str] = set()
        self.cms_lost = Gauge(
            "slo_router_cms_lost",
            "1 while the router routes on the last view of a CMS it lost (status ages frozen)",
            registry=r,
        )

    def bind_gauges(
        self,
        instances: Callable[[], dict[tuple[str, str], int]],
        inflight: Callable[[], int],
        *,
        overpacked: Callable[[], dict[str, float]] | None = None,
        desired: Callable[[], dict[str, int]] | None = None,
        cms_lost: Callable[[], bool] | None = None,
        cache_hit_rates: Callable[[], dict[str, float]] | None = None,
        dispatch_modes: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        """Compute the gauges at scrape time from the router's live state.

        ``overpacked`` (instance id -> 0/1) and ``desired`` (role -> instances)
        feed ``slo_router_instance_overpacked{instance}`` and
        ``slo_router_desired_instances{role}``, computed at every scrape;
        ``cache_hit_rates`` (instance id -> share) feeds
        ``slo_router_instance_cache_hit_rate{instance}`` from the instances' last statuses;
        ``dispatch_modes`` (mode -> 0/1) ``slo_router_dispatch_mode{mode}``, 1 for the dispatch mode
        new arrivals get (``--dispatch-mode auto`` changes it once).
        """
        self._instance_source = instances
        self.inflight_entries.set_function(lambda: float(inflight()))
        if cms_lost is not None:
            self.cms_lost.set_function(lambda: float(cms_lost()))
        self._refresh_instances()
        if overpacked is not None or desired is not None or cache_hit_rates is not None or dispatch_modes:
            self.registry.register(_PackingCollector(overpacked, desired, cache_hit_rates, dispatch_modes))

    def _refresh_instances(self) -> None:
        source = getattr(self, "_instance_source", None)
        if source is None:
            return
        for (role, health), count in source().items():
            self.instances.labels(role=role, health=health).set(count)

    def _labels(self, request: ScheduleInput) -> tuple[str, str]:
        name = request.slo_class or "none"
        if name not in self._classes:
            if len(self._classes) < MAX_CLASS_LABELS:
                self._classes.add(name)
            else:
                name = "other"
        p, bound = request.priority, PRIORITY_LABEL_BOUND
        priority = f">={bound}" if p >= bound else f"<={-bound}" if p <= -bound else str(p)
        return name, priority

    def queue_changed(self, request: ScheduleInput, delta: int) -> None:
        """A request entered (+1) or left (-1) the router queue."""
        slo_class, priority = self._labels(request)
        self.queue_length.labels(slo_class=slo_class, priority=priority).inc(delta)

    def shed_limit(self, seconds: float) -> None:
        self.queue_shed_limit.set(seconds)

    def queue_event(self, event: str) -> None:
        self.queue_events.labels(event=event).inc()

    def queue_waited(self, seconds: float) -> None:
        self.queue_wait.observe(seconds)

    def outcome(self, name: str) -> None:
        self.requests.labels(outcome=name).inc()

    def rejected(self, exc: RouterError) -> None:
        self.outcome(_outcome_of(exc))

    def phase_changed(self, old: Phase, new: Phase) -> None:
        """A request moved ``old`` -> ``new`` (``old is new``: it was just created in ``new``)."""
        gauges = self._phase_gauges
        if old is not new and old in gauges:
            gauges[old].dec()
        if new in gauges:
            gauges[new].inc()

    def retried(self, phase: str) -> None:
        self.retries.labels(phase=phase).inc()

    def scheduled(self, seconds: float) -> None:
        self.schedule_latency.observe(seconds)

    def first_token(self, route: Route, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)
        predicted = route.prefill.predicted_ttft_ms
        if math.isfinite(predicted):
            self.ttft_error.labels(group=route.prefill_group).observe(ttft_s - predicted / 1e3)
            if predicted > 0:
                self.ttft_ratio.labels(group=route.prefill_group).observe(ttft_s * 1e3 / predicted)

    def completed(self, route: Route | None, tpot_s: float | None, e2e_s: float) -> None:
        self.outcome("ok")
        self.e2e.observe(e2e_s)
        self._refresh_instances()
        if tpot_s is None:
            return
        self.tpot.observe(tpot_s)
        if route is not None and math.isfinite(route.decode.predicted_tpot_ms):
            self.tpot_error.labels(group=route.decode_group).observe(
                tpot_s - route.decode.predicted_tpot_ms / 1e3
            )
            if route.decode.predicted_tpot_ms > 0:
                self.tpot_ratio.labels(group=route.decode_group).observe(
                    tpot_s * 1e3 / route.decode.predicted_tpot_ms
                )

    def calibration(self, calibrator: Calibrator, snapshot: ClusterSnapshot, label: str) -> None:
        """Export the calibration's factors and drift per profile group (after each new view)."""
        sums: dict[str, list[float]] = {}
        drifted = calibrator.drifted()
        for record in snapshot.instances:
            group = record.metadata.labels.get(label, "")
            ttft, tpot = calibrator.factors(record.metadata.instance_id)
            acc = sums.setdefault(group, [0.0, 0.0, 0.0, 0.0])
            acc[0] += ttft
            acc[1] += tpot
            acc[2] += 1.0
            acc[3] += record.metadata.instance_id in drifted
        for group, (ttft, tpot, n, bad) in sums.items():
            self.calibration_factor.labels(group=group, prediction="ttft").set(ttft / n)
            self.calibration_factor.labels(group=group, prediction="tpot").set(tpot / n)
            self.calibration_drifted.labels(group=group).set(bad)


class _PackingCollector(Collector):
    """Scrape-time gauges per instance and role: the safety valve, the instances the load needs,
    and each instance's prefix-cache hit rate as its engine reports it."""

    def __init__(
        self,
        overpacked: Callable[[], dict[str, float]] | None,
        desired: Callable[[], dict[str, int]] | None,
        cache_hit_rates: Callable[[], dict[str, float]] | None = None,
        dispatch_modes: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self._overpacked = overpacked
        self._desired = desired
        self._cache_hit_rates = cache_hit_rates
        self._dispatch_modes = dispatch_modes

    def describe(self) -> list[Metric]:
        return []  # families are produced at scrape time; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        families = (
            (
                "slo_router_instance_overpacked",
                "1 while the safety valve holds new decode off an instance (measured TPOT over its "
                "target, or preempting), else 0",
                "instance",
                self._overpacked,
            ),
            (
                "slo_router_desired_instances",
                "Instances per role the throughput model says the last minute's load needs "
                "(for an autoscaler)",
                "role",
                self._desired,
            ),
            (
                "slo_router_instance_cache_hit_rate",
                "Prompt tokens the instance's engine found in its prefix cache over those it looked "
                "up, since the engine started (its last status; 0 where the engine does not say)",
                "instance",
                self._cache_hit_rates,
            ),
            (
                "slo_router_dispatch_mode",
                "1 for the dispatch mode new arrivals get (request or slice; --dispatch-mode auto "
                "switches once, from request to slice), else 0",
                "mode",
                self._dispatch_modes,
            ),
        )
        for name, documentation, label, source in families:
            if source is None:
                continue
            family = GaugeMetricFamily(name, documentation, labels=[label])
            for key, value in sorted(self._safe(source).items()):
                family.add_metric([key], float(value))
            yield family

    @staticmethod
    def _safe(source: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        try:
            return source()
        except RouterError:  # e.g. no instance registered yet: nothing to report
            return {}
