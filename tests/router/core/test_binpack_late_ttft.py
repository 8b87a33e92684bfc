"""binpack's (c) at the request's own TTFT target: a request the router queue offers late (its TTFT
target already out of reach, served best-effort with a looser bound) takes no loaded instance; only an
empty one, Algorithm 1's new bin. An on-time request is placed as before."""

from __future__ import annotations

import pytest

from fleet.snapshot import InstanceRecord
from router.core.errors import NoInstanceError
from router.core.request import Targets
from router.core.scheduler import Scheduler
from tests.router.core.helpers import NOW, decoding, inst, make_request, make_scheduler, make_snapshot

TTFT_MS = 1_500.0
TPOT_MS = 80.0
#: The bound the router queue offers a late entry with (well above its own target).
LATE_BOUND_MS = 6_000.0


def _busy(instance_id: str, requests: int) -> InstanceRecord:
    return decoding(instance_id, requests, 600)


def _decide(scheduler: Scheduler, waited_s: float, *records: InstanceRecord) -> str:
    view = scheduler.view(make_snapshot(*records), NOW)
    request = make_request(
        "summary",
        2_000,
        max_tokens=150,
        ttft_slo_ms=TTFT_MS,
        tpot_slo_ms=TPOT_MS,
        arrival_s=NOW - waited_s,
    )
    # As the router queue offers it: the remaining budget on time, a looser bound once late.
    left = TTFT_MS - waited_s * 1e3
    bound = left if left > 0 else LATE_BOUND_MS
    targets = Targets(bound, TPOT_MS, 0.0, TTFT_MS)
    decision = scheduler.schedule(view, request, NOW, dry_run=True, targets=targets)
    leg = decision.prefill or decision.decode
    assert leg is not None
    return leg.instance_id


def test_an_on_time_request_is_placed_by_best_fit_as_before() -> None:
    assert _decide(make_scheduler("binpack"), 0.2, _busy("fuller", 3), _busy("lighter", 1)) == "fuller"


def test_a_late_request_takes_only_an_empty_instance() -> None:
    # Its TTFT target has passed: wherever it goes it misses, and a loaded instance would spend its
    # prefill and its residents' slack on it (before: best fit placed it on "fuller").
    chosen = _decide(make_scheduler("binpack"), 2.0, _busy("fuller", 3), inst("empty", "neutral"))
    assert chosen == "empty"


def test_a_late_request_with_no_empty_instance_waits_in_the_router_queue() -> None:
    with pytest.raises(NoInstanceError, match="ttft_own"):
        _decide(make_scheduler("binpack"), 2.0, _busy("fuller", 3), _busy("lighter", 1))
    # slo serves it best-effort, as the queue offers it (unchanged).
    chosen = _decide(make_scheduler("slo"), 2.0, _busy("fuller", 3), _busy("lighter", 1))
    assert chosen in ("fuller", "lighter")
