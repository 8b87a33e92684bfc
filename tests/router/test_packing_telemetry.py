"""The router's packing gauges: the safety valve per instance and the instances the load needs."""

from __future__ import annotations

from prometheus_client import generate_latest

from fleet.snapshot import ClusterSnapshot
from router.core.capacity import LoadTracker
from router.placement import PlacementRequest, Placer
from router.telemetry import RequestObserver
from tests.router.core.helpers import NOW, inst, make_scheduler, make_snapshot


class _Source:
    def __init__(self, snapshot: ClusterSnapshot) -> None:
        self.current = snapshot

    def snapshot(self) -> ClusterSnapshot:
        return self.current


def _sample(text: str, prefix: str) -> float:
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {prefix!r} in:\n{text}")


def test_overpacked_and_desired_instances_gauges_follow_the_fleet_and_the_load() -> None:
    hot = inst("d-hot", "decode", decode_requests=4, decode_tokens=2000, used_kv_tokens=2000)
    assert hot.status is not None
    hot.status.step_samples.add(num_decode_requests=4, num_decode_tokens=2000, duration_ms=90.0)
    snapshot = make_snapshot(inst("p", "prefill"), hot, inst("d-cool", "decode"))
    clock = [NOW]
    placer = Placer(
        make_scheduler("slo", tpot_slo_ms=50.0, instance_staleness_s=float("inf")),
        _Source(snapshot),
        clock=lambda: clock[0],
    )
    observer = RequestObserver()
    observer.bind_gauges(
        placer.instance_counts, lambda: 0, overpacked=placer.overpacked, desired=placer.desired_instances
    )
    text = generate_latest(observer.registry).decode()
    assert _sample(text, 'slo_router_instance_overpacked{instance="d-hot"}') == 1
    assert _sample(text, 'slo_router_instance_overpacked{instance="d-cool"}') == 0
    assert _sample(text, 'slo_router_desired_instances{role="decode"}') == 0  # no load yet

    for k in range(120):  # two requests per second for a minute
        clock[0] = NOW + k / 2
        placer.place(PlacementRequest(f"r{k}", tuple(range(500)), "", 0.0, 0.0))
        placer.release(f"r{k}")
    text = generate_latest(observer.registry).decode()
    low = _sample(text, 'slo_router_desired_instances{role="prefill"}')
    assert low >= 1 and _sample(text, 'slo_router_desired_instances{role="neutral"}') == 0
    for k in range(1200):  # then twenty per second
        clock[0] = NOW + 60 + k / 20
        placer.place(PlacementRequest(f"s{k}", tuple(range(500)), "", 0.0, 0.0))
        placer.release(f"s{k}")
    text = generate_latest(observer.registry).decode()
    assert _sample(text, 'slo_router_desired_instances{role="prefill"}') > low


def test_load_tracker_reports_the_rate_and_means_of_its_window() -> None:
    tracker = LoadTracker(window_s=10.0)
    for k in range(20):
        tracker.observe(float(k), 100 + k, 50)
    shape = tracker.shape(19.0)
    assert shape.rate == 1.0  # 10 requests in the last 10 s
    assert shape.mean_prompt_tokens == sum(100 + k for k in range(10, 20)) / 10
    assert tracker.shape(100.0).rate == 0.0


def test_the_router_learns_binpacks_theta_and_decisions_read_it() -> None:
    """The live router keeps one θ fit per scheduler for binpack (--binpack-theta-adapt, on by
    default), on the predictor set its decisions read; other policies and the flag off keep none."""
    from router.core.packing import live_theta
    from router.core.theta import THETA_EVERY

    snapshot = make_snapshot(inst("p", "prefill"), inst("d", "decode"))
    scheduler = make_scheduler("binpack", tpot_slo_ms=50.0, instance_staleness_s=float("inf"))
    placer = Placer(scheduler, _Source(snapshot), clock=lambda: NOW)
    assert placer.theta is not None and scheduler.predictors is not None
    assert scheduler.predictors.theta is placer.theta
    for _ in range(THETA_EVERY * 3):
        placer.theta.observe(25.0, 50.0)  # answers well inside their TPOT target
    ctx = scheduler.context(scheduler.view(snapshot, NOW), None)  # type: ignore[arg-type]
    assert live_theta(ctx, scheduler.config) == placer.theta.theta > scheduler.config.binpack_theta
    fixed = make_scheduler(
        "binpack", tpot_slo_ms=50.0, instance_staleness_s=float("inf"), binpack_theta_adapt=False
    )
    assert Placer(fixed, _Source(snapshot), clock=lambda: NOW).theta is None
    slo = make_scheduler("slo", tpot_slo_ms=50.0, instance_staleness_s=float("inf"))
    assert Placer(slo, _Source(snapshot), clock=lambda: NOW).theta is None


def test_cache_hit_rate_gauge_reads_each_instances_last_status() -> None:
    warm, cold = inst("n-warm", "neutral"), inst("n-cold", "neutral")
    assert warm.status is not None
    warm.status.cache_hit_rate = 0.625
    snapshot = make_snapshot(warm, cold)
    observer = RequestObserver()
    observer.bind_gauges(
        lambda: {},
        lambda: 0,
        cache_hit_rates=lambda: {
            r.instance_id: r.status.cache_hit_rate for r in snapshot.instances if r.status is not None
        },
    )
    text = generate_latest(observer.registry).decode()
    assert _sample(text, 'slo_router_instance_cache_hit_rate{instance="n-warm"}') == 0.625
    assert _sample(text, 'slo_router_instance_cache_hit_rate{instance="n-cold"}') == 0
