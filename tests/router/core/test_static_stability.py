"""Static stability in the core: a lost CMS freezes status ages; the in-flight account carries the load.

And the placement's use of the outlier detector: ejected instances are avoided
unless nothing else can take the request (panic).
"""

from __future__ import annotations

import dataclasses

import pytest

from router.core.errors import EmptyClusterError
from router.core.health import OutlierConfig, OutlierDetector
from router.placement import PlacementRequest, Placer

from .helpers import NOW, inst, make_request, make_scheduler, make_snapshot


def test_a_lost_source_freezes_ages_and_fresh_instances_stay_usable() -> None:
    scheduler = make_scheduler("load-balance", instance_staleness_s=5.0)
    live = make_snapshot(inst("a", age_s=0.5), inst("b", age_s=4.0), inst("old", age_s=9.0), taken_at_s=NOW)
    lost = dataclasses.replace(live, source_lost_at_s=NOW)
    later = NOW + 60.0  # a minute without the CMS
    assert lost.age_s(lost.instances[0], later) == pytest.approx(0.5)
    # Connected, a minute of silence makes everything stale: nothing to place on.
    with pytest.raises(EmptyClusterError):
        scheduler.schedule(live, make_request(), later, dry_run=True)
    # Lost, the last view stands: a and b are usable, the one that was already stale is not.
    used = {scheduler.schedule(lost, make_request(f"r{i}"), later).prefill.instance_id for i in range(20)}  # type: ignore[union-attr]
    assert used <= {"a", "b"} and used
    view = scheduler.view(lost, later)
    assert view.status_age_s.tolist() == pytest.approx([0.5, 4.0, 9.0])


def test_inflight_entries_do_not_expire_while_the_source_is_lost() -> None:
    scheduler = make_scheduler("load-balance", inflight_expiry_s=10.0)
    live = make_snapshot(inst("a"), taken_at_s=NOW)
    lost = dataclasses.replace(live, source_lost_at_s=NOW)
    decision = scheduler.schedule(lost, make_request("r1"), NOW)
    scheduler.record(decision, NOW)
    scheduler.view(lost, NOW + 100.0)  # no status can confirm it: the router's account is the truth
    assert len(scheduler.inflight) == 1
    scheduler.view(live, NOW + 100.0)  # the CMS is back: the usual expiry applies again
    assert len(scheduler.inflight) == 0


class _Source:
    def __init__(self, snapshot: object) -> None:
        self.value = snapshot

    def snapshot(self):  # type: ignore[no-untyped-def]
        return self.value


def _placement(request_id: str) -> PlacementRequest:
    return PlacementRequest(request_id, (1,) * 64, "", ttft_slo_ms=6000.0, tpot_slo_ms=50.0)


def test_placement_avoids_ejected_instances_but_panics_rather_than_fail() -> None:
    now = [NOW]
    scheduler = make_scheduler("load-balance")
    snapshot = make_snapshot(
        inst("p0", "prefill"), inst("p1", "prefill"), inst("d0", "decode"), taken_at_s=NOW
    )
    snapshot = dataclasses.replace(snapshot, source_lost_at_s=NOW)  # the CMS is down throughout
    health = OutlierDetector(OutlierConfig(base_ejection_s=10.0))
    placer = Placer(scheduler, _Source(snapshot), clock=lambda: now[0], health=health)
    health.failure("p0", NOW, "UNAVAILABLE")
    counts = placer.instance_counts()
    assert counts[("prefill", "ejected")] == 1 and counts[("prefill", "healthy")] == 1
    for i in range(10):
        route = placer.place(_placement(f"r{i}"))
        placer.release(f"r{i}")
        assert route.prefill.instance_id == "p1"
    # The only decode instance is ejected too: it is still used (panic), the request is not refused.
    health.failure("d0", NOW, "UNAVAILABLE")
    route = placer.place(_placement("r-panic"))
    assert route.prefill.instance_id == "p1" and route.decode.instance_id == "d0"
    placer.release("r-panic")
    # The ejection ends: p0 is used again.
    now[0] = NOW + 11.0
    used = set()
    for i in range(10):
        used.add(placer.place(_placement(f"s{i}")).prefill.instance_id)
        placer.release(f"s{i}")
    assert "p0" in used
