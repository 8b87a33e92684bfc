"""The waiting dispatchers' late sweep (``Queued._refuse_beyond_wait``) predicts a late entry's start
as the queue's own hopeless test does: tokens or entries in front, whichever the queue drains sooner."""

from __future__ import annotations

from typing import Any

from fleet.snapshot import ClusterSnapshot
from router.core.columns import ClusterView
from router.core.decision import Decision
from router.core.dispatch import DispatchSetup, Outcome, make_dispatcher
from router.core.dispatchers import Queued
from router.core.queue import QueueConfig
from router.core.request import ScheduleInput
from router.core.scheduler import Scheduler
from tests.router.core.helpers import NOW, inst, make_request, make_scheduler, make_snapshot


class _Fleet:
    """The world as the sweep reads it: a scheduler and one fixed snapshot."""

    def __init__(self, snapshot: ClusterSnapshot) -> None:
        self._snapshot = snapshot
        self.scheduler: Scheduler = make_scheduler()

    def view(self) -> ClusterView | ClusterSnapshot:
        return self._snapshot

    def decide(self, view: Any, request: ScheduleInput, now: float, **kw: Any) -> Decision:
        return self.scheduler.schedule(view, request, now, **kw)

    def snapshot(self) -> ClusterSnapshot:
        return self._snapshot


def test_a_late_entry_behind_one_cold_prompt_is_not_refused_by_a_token_rate_of_cached_ones() -> None:
    """The queue drained five 200-token (mostly cached) prompts in 500 ms of fleet-limited time: 2
    tokens per ms, one entry per 100 ms. A late entry behind one cold 4,000-token prompt, with 1.5 s
    of its wait limit left, starts in about 100 ms counted in entries (the unit the queue's hopeless
    test also takes when sooner); by tokens alone it was 2,000 ms, past its limit, and it was refused."""
    dispatcher = make_dispatcher(
        DispatchSetup(
            QueueConfig(queue_policy="fcfs", max_queue_wait_ms=1500.0, drain_window_ms=1000.0), 6000.0, 50.0
        )
    )
    assert isinstance(dispatcher, Queued)
    queue = dispatcher.queue
    now = NOW + 0.5
    queue.push(make_request("cold", prompt_tokens=4000, ttft_slo_ms=60_000.0, arrival_s=now), now)
    queue.push(make_request("late", prompt_tokens=256, ttft_slo_ms=1000.0, arrival_s=now), now)
    queue.mark_late("late")
    queue.note_pass(NOW, fleet_limited=True)
    queue.note_backlog(now)
    for _ in range(5):
        queue.note_dispatch(now, 200)
    assert queue.drain_rate(now) is not None and queue.drain_request_rate(now) is not None
    fleet = _Fleet(make_snapshot(inst("p0", "prefill"), inst("p1", "prefill"), inst("d0", "decode")))
    refused = [a for a in dispatcher._refuse_beyond_wait(now, fleet) if a.outcome is Outcome.REFUSE]
    assert refused == []
    assert "late" in queue
    # Two seconds' worth of queued work ahead in both units (20 entries): it cannot start in time.
    for k in range(20):
        queue.push(make_request(f"c{k}", prompt_tokens=4000, ttft_slo_ms=60_000.0, arrival_s=now), now)
    dispatcher._last_sweep = -float("inf")
    refused = [a for a in dispatcher._refuse_beyond_wait(now, fleet) if a.outcome is Outcome.REFUSE]
    assert [a.request.request_id for a in refused] == ["late"]
