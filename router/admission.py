"""Admission: requests no instance can take now wait in the router queue, and leave it on events.

:class:`Admission` wraps the :class:`~router.placement.Placer` with the pure
:class:`~router.core.queue.RouterQueue`. ``place`` queues the request and
offers the queue to the scheduler at once; a request that is not placed waits
on a future. The queue is offered again only when something changed that could
let an instance take a request — a new cluster view (the reader's listener), a
request ending at the router (its in-flight load leaves), a cancel, a new
arrival — plus one timer for the earliest moment an entry expires or turns late
by the clock alone. There is no per-request polling loop: a pump is one
synchronous pass, coalesced with ``call_soon``.

``queue_policy=none`` bypasses all of it (the old instant refusal).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from router.arrival import ArrivalCheck
from router.core.errors import (
    ConfigError,
    QueueFullError,
    QueueTimeoutError,
    RouterError,
    SchedulingError,
    ShedError,
)
from router.core.queue import (
    FleetDrain,
    Objective,
    QueueConfig,
    QueueEntry,
    QueuePolicy,
    RouterQueue,
    Verdict,
    offer,
    slo_met,
)
from router.core.request import ScheduleInput
from router.core.sa import SAPlanner
from router.placement import PlacementRequest, Placer
from router.route import Route
from router.telemetry import RequestObserver

logger = logging.getLogger(__name__)

#: Least time between two sweeps of the late entries for ones that cannot start before their
#: wait limit (:meth:`Admission._refuse_beyond_wait`); each sweep is one pass over the queue.
LATE_SWEEP_INTERVAL_S = 0.25


@dataclass(frozen=True)
class Admitted:
    """A placed request: its route, how long it waited in the router, and whether it left the queue late."""

    route: Route
    waited_s: float = 0.0
    late: bool = False


class Admission:
    """Places requests through the router queue (see the module doc)."""

    def __init__(
        self,
        placer: Placer,
        config: QueueConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        observer: RequestObserver | None = None,
        # Consecutive waits that end a pass: 4, as the simulator offers its queue (it was 8 here; each
        # wait is a full scheduling decision, and most passes end in waits near capacity).
        max_failures: int = 4,
    ) -> None:
        if config.policy is QueuePolicy.QLM:
            raise ConfigError(
                "--queue-policy qlm is served by router.qlm_admission.QlmAdmission (make_admission)"
            )
        self.placer = placer
        self.config = config
        sched = placer.scheduler.config
        planner = SAPlanner(config) if config.policy is QueuePolicy.SA else None
        self.queue = RouterQueue(config, sched.ttft_slo_ms, sched.tpot_slo_ms, planner)
        self._clock = clock
        self._observer = observer or RequestObserver()
        self._max_failures = max_failures
        self._pump_pending = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._arrival = ArrivalCheck(placer.scheduler, placer.snapshot)
        self._last_sweep = -float("inf")

    @property
    def enabled(self) -> bool:
        return self.queue.policy is not QueuePolicy.NONE  # (the queue keeps the enum: no lookup per call)

    # ------------------------------------------------------------------ the request side

    async def place(self, req: PlacementRequest, *, exclude: frozenset[str] = frozenset()) -> Admitted:
        """A route for ``req``: at once, after waiting in the queue, or a :class:`SchedulingError`."""
        if not self.enabled:
            return Admitted(self.placer.place(req, exclude=exclude))
        loop = asyncio.get_running_loop()
        self._loop = loop
        now = self._clock()
        request = self.placer.schedule_input(req, exclude=exclude)
        # A target no idle instance could meet is refused now, not after the wait limit.
        self._arrival.check(request, now)
        self.queue.observe_arrival(request)
        future: asyncio.Future[Admitted] = loop.create_future()
        entry, shed = self.queue.push(request, now, token=future)
        self._observer.queue_changed(request, +1)
        for victim in shed:
            self._shed(victim)
        if self.queue.planner is not None:
            # sa: a burst arriving in one loop iteration is planned in one pass, not request by request.
            self.notify()
        else:
            self._pump()
        try:
            return await future
        except asyncio.CancelledError:
            if self.queue.remove(req.request_id) is not None:
                self._observer.queue_changed(entry.request, -1)
                self.notify()
            raise

    def attach(self, request_id: str, tokens: Callable[[], int], stop: Callable[[], None]) -> None:
        """Only the qlm policy evicts running requests (:meth:`QlmAdmission.attach`)."""
        return None

    async def resume(self, request_id: str) -> Admitted:  # pragma: no cover - never evicts
        raise RouterError(f"request {request_id!r} was not evicted")

    def dry_run_queue(self) -> RouterQueue | None:
        """The queue the ``Schedule`` dry run reports a position in (None: nothing waits)."""
        return self.queue if self.enabled else None

    def release(self, request_id: str, output_tokens: int | None = None) -> None:
        """``request_id`` ended at the router: its load leaves, which may let a queued request go."""
        self.placer.release(request_id)
        self.queue.finished(request_id, output_tokens)
        if self.enabled and len(self.queue):
            self.notify()

    def outcome(
        self,
        req: PlacementRequest,
        *,
        finished: bool,
        ttft_s: float | None,
        tpot_s: float | None,
        e2e_s: float,
    ) -> None:
        """How ``req`` ended (``finished``: every token was streamed; times measured at the router): under
        ``--queue-objective g`` the queue's shedding limit follows the misses."""
        if not self.enabled or self.config.objective is not Objective.G:
            return
        sched = self.placer.scheduler.config
        met = finished and slo_met(
            req.ttft_slo_ms,
            req.tpot_slo_ms,
            req.e2e_slo_ms,
            sched.ttft_slo_ms,
            sched.tpot_slo_ms,
            ttft_ms=None if ttft_s is None else ttft_s * 1e3,
            tpot_ms=None if tpot_s is None else tpot_s * 1e3,
            e2e_ms=e2e_s * 1e3,
        )
        now = self._clock()
        self.queue.note_outcome(req.request_id, met, now, None if tpot_s is None else tpot_s * 1e3)
        self._observer.shed_limit(self.queue.shed_limit_ms(now) * 1e-3)

    def notify(self) -> None:
        """Something changed (view, in-flight load, queue): offer the queue once, soon."""
        if self._pump_pending or not len(self.queue):
            return
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        self._pump_pending = True
        loop.call_soon(self._pump)

    # ------------------------------------------------------------------ the pump

    def _shed(self, victim: QueueEntry) -> None:
        self._observer.queue_changed(victim.request, -1)
        self._observer.queue_event("shed")
        future: asyncio.Future[Admitted] = victim.token
        if not future.done():
            future.set_exception(
                QueueFullError(
                    f"the router queue is full ({self.config.max_queue_size} requests, --max-queue-size) and "
                    f"request {victim.request_id!r} (priority {victim.request.priority}) was the least valuable; "
                    "retry later or raise its priority"
                )
            )

    def _pump(self) -> None:
        self._pump_pending = False
        if not len(self.queue):
            return
        try:
            self._offer()
        except Exception as exc:  # a bug must not leave clients waiting forever: fail what is queued
            logger.exception("router queue pass failed; refusing the %d queued request(s)", len(self.queue))
            for entry in list(self.queue.entries()):
                self.queue.remove(entry.request_id)
                self._observer.queue_changed(entry.request, -1)
                if not entry.token.done():
                    entry.token.set_exception(RouterError(f"router queue failure: {exc}"))

    def _offer(self) -> None:
        now = self._clock()
        started = time.perf_counter()
        for result in offer(
            self.queue,
            self.placer.scheduler,
            self.placer.snapshot,
            now,
            max_failures=self._max_failures,
            decide=self.placer.decide,
        ):
            entry = result.entry
            future: asyncio.Future[Admitted] = entry.token
            if result.verdict in (Verdict.DISPATCH, Verdict.WAIT):
                # The time of the decision that produced this verdict (the generator ran it since the last one).
                self._observer.scheduled(time.perf_counter() - started)
            started = time.perf_counter()
            if result.verdict is Verdict.WAIT:
                continue
            if result.verdict is Verdict.LATE:
                self._observer.queue_event("late")
                continue
            self._observer.queue_changed(entry.request, -1)
            waited = now - entry.enqueued_s
            if result.verdict is Verdict.DISPATCH:
                assert result.decision is not None
                if future.done():  # cancelled meanwhile: nothing may stay recorded for it
                    self.queue.finished(entry.request_id)  # nor held as running by the sa policy
                    continue
                route = self.placer.commit(result.decision, now)
                self._observer.queue_waited(waited)
                future.set_result(Admitted(route, waited, entry.late))
                continue
            if result.verdict is Verdict.EXPIRED:
                event = "expired"
            else:
                event = "overlong" if isinstance(result.error, ShedError) else "rejected"
            self._observer.queue_event(event)
            if not future.done() and result.error is not None:
                future.set_exception(result.error)
        if len(self.queue):
            self._refuse_beyond_wait(now)
        self._arm_timer(now)

    def _refuse_beyond_wait(self, now: float) -> None:
        """Late entries whose best case starts only after their wait limit are refused now.

        Every on-time entry goes before any late one, and late ones go in the queue's order, so a
        late entry starts its prefill only once the fleet has prefilled the work queued in front
        of it now: :meth:`FleetDrain.start_ms` of those tokens (at the fleet's full prefill rate,
        or the rate the queue really drained at lately when slower) predicts its wait (later
        on-time arrivals that go first only add to it). An entry whose remaining wait
        (``--max-queue-wait-ms`` minus what it waited) is shorter would be refused at the limit
        anyway: it is refused at once, so the client learns it now (under a 4x overload most
        refusals came only after the full 60 s) and the backlog left when a burst ends is only
        what can still be served. One pass over the queue, at most every
        :data:`LATE_SWEEP_INTERVAL_S`.
        """
        if now - self._last_sweep < LATE_SWEEP_INTERVAL_S:
            return
        self._last_sweep = now
        entries = list(self.queue.entries())  # offer order: on-time entries first, then the late ones
        if not any(e.late for e in entries):
            return
        try:
            scheduler = self.placer.scheduler
            view = scheduler.view(self.placer.snapshot(), now)
            drain = FleetDrain.of(scheduler, view, now, self.queue.drain_rate(now))
        except SchedulingError:
            return
        if drain is None:
            return
        limit_ms = self.config.max_queue_wait_ms
        ahead = 0  # prompt tokens of the entries still queued in front of this one
        for entry in entries:
            if not entry.late:
                ahead += entry.request.prompt_tokens
                continue
            remaining_ms = limit_ms - (now - entry.enqueued_s) * 1e3
            start_ms = drain.start_ms(ahead)
            if start_ms <= remaining_ms or self.queue.remove(entry.request_id) is None:
                ahead += entry.request.prompt_tokens
                continue
            self._observer.queue_changed(entry.request, -1)
            self._observer.queue_event("refused_early")
            future: asyncio.Future[Admitted] = entry.token
            if not future.done():
                future.set_exception(
                    QueueTimeoutError(
                        f"request {entry.request_id!r} cannot start for at least {start_ms:.0f} ms (the "
                        f"work queued before it), past the {max(remaining_ms, 0.0):.0f} ms it may still wait "
                        f"in the router queue (--max-queue-wait-ms {limit_ms:g}): refused now rather than at "
                        "the limit; retry later or add capacity"
                    )
                )

    def _arm_timer(self, now: float) -> None:
        """Wake at the first moment an entry expires or turns late without any other event."""
        wake = self.queue.wake_s()
        when = float("inf") if wake is None else wake
        loop = self._loop
        if loop is None or when == float("inf"):
            return
        if self._timer is not None and self._timer_at <= when and not self._timer.cancelled():
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = loop.call_later(max(when - now, 0.0) + 1e-3, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = float("inf")
        self._pump()

    def position(self, request: ScheduleInput) -> int:
        """Where ``request`` would stand in the queue now."""
        return self.queue.position_of_new(request, self._clock())

    def refuse_queued(self, error: RouterError) -> None:
        """Fail every queued request with ``error`` now (shutdown); arrivals after this are the caller's."""
        for entry in list(self.queue.entries()):
            if self.queue.remove(entry.request_id) is None:
                continue
            self._observer.queue_changed(entry.request, -1)
            future: asyncio.Future[Admitted] = entry.token
            if not future.done():
                future.set_exception(error)

    def close(self) -> None:
        """Cancel the timer (the server is stopping)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
