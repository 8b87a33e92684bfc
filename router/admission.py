"""The router's asyncio driver: it carries out what the dispatcher decides (:mod:`router.core.dispatch`).

:class:`Admission` owns one :class:`~router.core.dispatch.Dispatcher` (built by
name from ``--queue-policy``) and never asks which one it is. ``place``
hands the dispatcher an :class:`~router.core.dispatch.Arrival` and waits on a
future until an action answers it: ``DISPATCH`` (the decision is recorded in
the in-flight account and the route returned), ``REFUSE`` (its error raised),
or, for a request the dispatcher stopped while it streamed (``EVICT``), a new
placement that :meth:`resume` waits for. The dispatcher is asked again only
when something changed that could let an instance take a request — a new
cluster view (the reader's listener), a request ending at the router, a
cancel — plus one timer at the moment it asks to be woken. There is no
per-request polling loop: a pass is one synchronous call, coalesced with
``call_soon``.

A dispatcher that never waits (``none``) answers an arrival at once: no
future, no queue.

A placement may carry a cap (``slice``): the service counts the tokens the leg
relays, and a leg that reaches the cap with output left calls
:meth:`Admission.pause` (the lifecycle's pause and requeue), which hands the
dispatcher a :class:`~router.core.dispatch.Paused` event; a placement that
:attr:`Admitted.continues` lets the leg run on where it is, any other stops it
and waits (:meth:`placed`) for the placement of the rest, as :meth:`resume`
does after an eviction.

What is router-only (the simulator's driver, :mod:`sim.cluster`, has no
clients): a running request is stopped through the :class:`RunHandle` the
service lends (:meth:`attach`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from fleet.snapshot import ClusterSnapshot
from router.core.columns import ClusterView
from router.core.decision import Decision
from router.core.dispatch import (
    Action,
    Arrival,
    Cancel,
    Completion,
    Dispatcher,
    DispatchSetup,
    Event,
    Outcome,
    Paused,
    Served,
    Timer,
    ViewChanged,
    make_dispatcher,
    waiting_delta,
)
from router.core.errors import RouterError
from router.core.plugins import Policy
from router.core.qlm import QlmConfig
from router.core.queue import QueueConfig, RouterQueue, slo_met
from router.core.request import ScheduleInput, Targets
from router.core.scheduler import Scheduler
from router.core.slicing import SliceConfig
from router.placement import PlacementRequest, Placer
from router.route import Route
from router.telemetry import RequestObserver

logger = logging.getLogger(__name__)

#: How long after the last arrival a new cluster view is still prepared for the next one while nothing
#: waits (:meth:`Admission._warm_soon`): the per-view work of a lone request's decision (the instance
#: table, the arrival check's drain, about 0.4 ms of the event loop's CPU on a one-engine fleet) is then
#: done when the view arrives rather than on the request's path (docs/vllm-grpc.md).
WARM_AFTER_ARRIVAL_S = 10.0


@dataclass(frozen=True)
class Admitted:
    """A placed request: its route, how long it waited in the router, and whether it left the queue late."""

    route: Route
    waited_s: float = 0.0
    late: bool = False
    #: The most new tokens this placement may generate (0: to the end); see :meth:`Admission.paused`.
    cap: int = 0
    #: The paused leg goes on where it runs (:attr:`~router.core.dispatch.Action.continues`).
    continues: bool = False


@dataclass
class RunHandle:
    """What the service lends the driver for one streaming request, so a dispatcher can stop it."""

    #: Tokens the client has received so far.
    tokens: Callable[[], int]
    #: Stop the worker leg (fire-and-forget ``Abort``).
    stop: Callable[[], None]
    #: Set by an eviction; cleared when the request resumes.
    evicted: bool = False
    resumed: asyncio.Future[Admitted] | None = field(default=None, repr=False)


class _RouterFleet:
    """The :class:`~router.core.dispatch.Fleet` the router lends its dispatcher: the placer's view and decisions."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._placer = admission.placer
        self._observer = admission.observer
        #: Placement decisions made for the dispatcher (each a full pass of the filters and selectors).
        self.decisions = 0

    @property
    def scheduler(self) -> Scheduler:
        return self._placer.scheduler

    def view(self) -> ClusterView | ClusterSnapshot:
        return self._placer.snapshot()

    def snapshot(self) -> ClusterSnapshot:
        return self._placer.snapshot()

    def decide(
        self,
        view: ClusterView | ClusterSnapshot,
        request: ScheduleInput,
        now: float,
        *,
        targets: Targets | None = None,
        policy: Policy | None = None,
    ) -> Decision:
        started = time.perf_counter()
        self.decisions += 1
        try:
            return self._placer.decide(view, request, now, targets=targets, policy=policy)
        finally:
            self._observer.scheduled(time.perf_counter() - started)

    def evict(self, request_id: str) -> int | None:
        return self._admission._evict(request_id)

    def produced(self, request_id: str) -> int | None:
        handle = self._admission._handles.get(request_id)
        return None if handle is None else handle.tokens()


class Admission:
    """Places requests through a dispatcher (see the module doc)."""

    def __init__(
        self,
        placer: Placer,
        config: QueueConfig,
        qlm: QlmConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        observer: RequestObserver | None = None,
        dispatcher: Dispatcher | None = None,
    ) -> None:
        self.placer = placer
        self.config = config
        sched = placer.scheduler.config
        # (Not ``dispatcher or ...``: a dispatcher with nothing waiting has length 0.)
        self.dispatcher = (
            dispatcher
            if dispatcher is not None
            else make_dispatcher(
                DispatchSetup(config, sched.ttft_slo_ms, sched.tpot_slo_ms, qlm or QlmConfig())
            )
        )
        self._clock = clock
        self.observer = observer or RequestObserver()
        self.fleet = _RouterFleet(self)
        #: Requests waiting for a placement (first or resumed): their futures, by request id.
        self._waiting: dict[str, asyncio.Future[Admitted]] = {}
        self._handles: dict[str, RunHandle] = {}
        self._pump_pending = False
        self._warm_pending = False
        self._last_arrival = float("-inf")
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def enabled(self) -> bool:
        """Whether requests may wait (the dispatcher is not ``none``)."""
        return self.dispatcher.waits

    @property
    def queue(self) -> RouterQueue | None:
        """The router queue of the dispatcher, when it has one (tests and the dry run read it)."""
        return self.dispatcher.dry_run_queue()

    # ------------------------------------------------------------------ the request side

    async def place(self, req: PlacementRequest, *, exclude: frozenset[str] = frozenset()) -> Admitted:
        """A route for ``req``: at once, after waiting, or a :class:`~router.core.errors.SchedulingError`."""
        now = self._clock()
        self._last_arrival = now
        request = self.placer.schedule_input(req, exclude=exclude)
        dispatcher = self.dispatcher
        if not dispatcher.waits:
            # Answered at once: one action for this arrival, no future.
            (action,) = dispatcher.handle(Arrival(request), now, self.fleet)
            if action.decision is None:
                assert action.error is not None
                raise action.error
            return Admitted(self.placer.commit(action.decision, now))
        loop = asyncio.get_running_loop()
        self._loop = loop
        rid = req.request_id
        future: asyncio.Future[Admitted] = loop.create_future()
        self._waiting[rid] = future
        try:
            self._carry(dispatcher.handle(Arrival(request, future), now, self.fleet), now)
        except Exception as exc:
            # This request is answered here; a bug must not leave the others waiting either.
            self._waiting.pop(rid, None)
            if isinstance(exc, RouterError) and not future.done():
                raise
            logger.exception("dispatcher failed on an arrival; refusing the waiting request(s)")
            failure = RouterError(f"router queue failure: {exc}")
            self._carry(dispatcher.refuse_all(failure), now)
            raise failure from exc
        self._arm_timer(now)
        if dispatcher.coalesce_arrivals:
            self.notify()  # a burst arriving in one loop iteration is offered in one pass
        return await self._wait(rid, future)

    async def _wait(self, request_id: str, future: asyncio.Future[Admitted]) -> Admitted:
        try:
            return await future
        except asyncio.CancelledError:
            if self._waiting.get(request_id) is future:
                del self._waiting[request_id]
            self._run(Cancel(request_id), self._clock())
            self.notify()
            raise

    def attach(
        self, request_id: str, tokens: Callable[[], int], stop: Callable[[], None]
    ) -> RunHandle | None:
        """The service's handle on a streaming request, for a dispatcher that stops running ones."""
        if not self.dispatcher.waits:
            return None
        handle = RunHandle(tokens, stop)
        self._handles[request_id] = handle
        return handle

    async def resume(self, request_id: str) -> Admitted:
        """After an eviction: wait until the dispatcher places ``request_id`` again; its new route."""
        handle = self._handles[request_id]
        if handle.resumed is None:
            raise RouterError(f"request {request_id!r} was not evicted")
        admitted = await self._wait(request_id, handle.resumed)
        handle.evicted = False
        handle.resumed = None
        return admitted

    async def paused(self, request_id: str, tokens: int) -> Admitted:
        """A leg ended at its placement's cap with output left; wait for the placement of the rest.

        The lifecycle's pause and requeue (the caller has moved the request's phase): the
        placement's in-flight entries go, the dispatcher hears :class:`~router.core.dispatch.Paused`
        with the ``tokens`` produced so far, and the request resumes after them where it is placed.
        """
        return await self.placed(request_id, self.pause(request_id, tokens))

    def pause(self, request_id: str, tokens: int) -> asyncio.Future[Admitted]:
        """:meth:`paused` up to the dispatcher's answer: the placement of the rest, done when the
        dispatcher placed it at once (then the caller may keep a leg that
        :attr:`Admitted.continues` running); await it with :meth:`placed`."""
        self.placer.release(request_id)
        loop = asyncio.get_running_loop()
        self._loop = loop
        future: asyncio.Future[Admitted] = loop.create_future()
        self._waiting[request_id] = future
        self._run(Paused(request_id, tokens), self._clock())
        return future

    async def placed(self, request_id: str, future: asyncio.Future[Admitted]) -> Admitted:
        """The placement :meth:`pause` asked for (a cancel while it waits leaves the queue)."""
        return await self._wait(request_id, future)

    def dry_run_queue(self) -> RouterQueue | None:
        """The queue the ``Schedule`` dry run reports a position in (None: nothing waits)."""
        return self.dispatcher.dry_run_queue()

    def release(self, request_id: str, output_tokens: int | None = None) -> None:
        """``request_id`` ended at the router: its load leaves, which may let a waiting request go."""
        self.placer.release(request_id)
        if not self.dispatcher.waits:
            return
        self._handles.pop(request_id, None)
        future = self._waiting.pop(request_id, None)
        if future is not None and not future.done():
            future.cancel()
        self._run(Completion(request_id, output_tokens), self._clock())
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
        """How ``req`` ended (``finished``: every token was streamed; times measured at the router)."""
        now = self._clock()
        dispatcher = self.dispatcher
        if dispatcher.shed_limit_ms(now) is None:
            return  # nothing steers by it
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
        self._run(Served(req.request_id, met, None if tpot_s is None else tpot_s * 1e3), now)
        limit = dispatcher.shed_limit_ms(now)
        if limit is not None:
            self.observer.shed_limit(limit * 1e-3)

    def notify(self) -> None:
        """Something changed (view, in-flight load, queue): ask the dispatcher once, soon."""
        if not len(self.dispatcher):
            self._warm_soon()
            return
        if self._pump_pending:
            return
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        self._pump_pending = True
        loop.call_soon(self._pump)

    def refuse_queued(self, error: RouterError) -> None:
        """Fail every waiting request with ``error`` now (shutdown); arrivals after this are the caller's."""
        self._carry(self.dispatcher.refuse_all(error), self._clock())

    def close(self) -> None:
        """Cancel the timer (the server is stopping)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # ------------------------------------------------------------------ carrying out

    def _warm_soon(self) -> None:
        """Nothing waits: have the dispatcher build, once this loop pass is done, what the next
        arrival reads of the new view (``warm``, where the dispatcher has one), off that arrival's
        path. Only while requests come (one arrived within :data:`WARM_AFTER_ARRIVAL_S`): an idle
        router does not rebuild for every status push what no request reads."""
        loop = self._loop
        if self._warm_pending or loop is None or loop.is_closed():
            return
        if self._clock() - self._last_arrival > WARM_AFTER_ARRIVAL_S:
            return
        warm = getattr(self.dispatcher, "warm", None)
        if warm is None:
            return
        self._warm_pending = True
        loop.call_soon(self._warm, warm)

    def _warm(self, warm: Callable[[float, _RouterFleet], None]) -> None:
        self._warm_pending = False
        if len(self.dispatcher) or self._clock() - self._last_arrival > WARM_AFTER_ARRIVAL_S:
            return
        try:
            warm(self._clock(), self.fleet)
        except Exception:  # a cache left cold is built by the next arrival, as without warming
            logger.debug("warming the dispatcher's view failed", exc_info=True)

    def _pump(self) -> None:
        self._pump_pending = False
        if len(self.dispatcher):
            self._run(ViewChanged(), self._clock())

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = float("inf")
        if len(self.dispatcher):
            self._run(Timer(), self._clock())

    def _run(self, event: Event, now: float) -> None:
        """Hand ``event`` to the dispatcher and carry out its actions; a failing pass refuses what waits."""
        try:
            self._carry(self.dispatcher.handle(event, now, self.fleet), now)
        except Exception as exc:  # a bug must not leave clients waiting forever
            logger.exception(
                "dispatcher pass failed; refusing the %d waiting request(s)", len(self.dispatcher)
            )
            self._carry(self.dispatcher.refuse_all(RouterError(f"router queue failure: {exc}")), now)
        self._arm_timer(now)

    def _carry(self, actions: Iterable[Action], now: float) -> None:
        """Carry out each action before taking the next (a dispatch is recorded before the next decision)."""
        observer = self.observer
        # A request queued and answered in the same call (an arrival placed at once: the common
        # case) leaves the queue gauge where it was; its +1 is held here and dropped with its -1
        # (two labelled gauge updates less per request). What is held is applied however the
        # call ends, so the gauge never misses an entry that stays queued.
        entered: dict[str, ScheduleInput] = {}
        try:
            for action in actions:
                delta = waiting_delta(action)
                if delta > 0 and action.outcome is Outcome.QUEUED:
                    entered[action.request_id] = action.request
                elif delta < 0 and entered.pop(action.request_id, None) is not None:
                    pass
                elif delta:
                    observer.queue_changed(action.request, delta)
                self._act(action, now)
        finally:
            for request in entered.values():
                observer.queue_changed(request, +1)

    def _act(self, action: Action, now: float) -> None:
        """Carry out one action (the queue gauge is :meth:`_carry`'s)."""
        observer = self.observer
        outcome = action.outcome
        if outcome is Outcome.DISPATCH:
            self._dispatched(action, now)
        elif outcome is Outcome.REFUSE:
            if action.event:
                observer.queue_event(action.event)
            future = self._waiting.pop(action.request_id, None)
            if future is not None and not future.done() and action.error is not None:
                future.set_exception(action.error)
        elif outcome is Outcome.LATE:
            observer.queue_event(action.event)
        elif outcome is Outcome.EVICT:
            observer.queue_event(action.event)
            handle = self._handles.get(action.request_id)
            if handle is not None and handle.resumed is not None:
                self._waiting[action.request_id] = handle.resumed

    def _dispatched(self, action: Action, now: float) -> None:
        rid = action.request_id
        future = self._waiting.pop(rid, None)
        decision = action.decision
        assert decision is not None
        if future is None or future.done():  # cancelled meanwhile: nothing may stay recorded for it
            for _ in self.dispatcher.handle(Completion(rid), now, self.fleet):
                pass
            return
        route = self.placer.commit(decision, now)
        self.observer.queue_waited(action.waited_s)
        future.set_result(Admitted(route, action.waited_s, action.late, action.cap, action.continues))

    def _evict(self, request_id: str) -> int | None:
        """The dispatcher stops ``request_id`` (see :meth:`Fleet.evict`); the tokens its client has."""
        handle = self._handles.get(request_id)
        loop = self._loop
        if handle is None or handle.evicted or loop is None:
            return None  # not streaming yet (or already being evicted): nothing to keep, leave it
        tokens = handle.tokens()
        if tokens <= 0:
            return None
        handle.evicted = True
        handle.resumed = loop.create_future()
        handle.stop()
        self.placer.release(request_id)
        logger.info("%s: evicted %s after %d tokens", self.dispatcher.name, request_id, tokens)
        return tokens

    def _arm_timer(self, now: float) -> None:
        """Wake at the moment the dispatcher asked for, if no other event comes first."""
        wake = self.dispatcher.wake_s()
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


def make_admission(
    placer: Placer,
    config: QueueConfig,
    qlm: QlmConfig | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
    observer: RequestObserver | None = None,
    slicing: SliceConfig | None = None,
    dispatch_mode: str = "",
) -> Admission:
    """The router's driver over the dispatcher ``config.queue_policy`` names, or, when ``slicing``
    is given, over ``dispatch_mode`` (``--dispatch-mode``: ``slice`` by default, or ``auto``)."""
    if slicing is None:
        return Admission(placer, config, qlm, clock=clock, observer=observer)
    sched = placer.scheduler.config
    setup = DispatchSetup(
        config,
        sched.ttft_slo_ms,
        sched.tpot_slo_ms,
        qlm or QlmConfig(),
        slicing=slicing,
        dispatcher=dispatch_mode or "slice",
    )
    return Admission(placer, config, qlm, clock=clock, observer=observer, dispatcher=make_dispatcher(setup))
