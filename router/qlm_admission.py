"""The ``qlm`` queue policy in the router: :class:`router.core.qlm.QlmQueue` driven by events, with live eviction.

The same pure queue the simulator runs (:mod:`sim.cluster`). ``place`` puts a
request in its group and pumps; the request's future resolves when an
instance pulls it (it runs fewer than the batch of ours, or more e2e-only ones
within its KV cache, see :meth:`QlmQueue._room`). The pump runs on
arrivals and on requests ending at the router, as :class:`router.admission.Admission`'s does.

Eviction: once a request streams, the service lends the queue a
:class:`RunHandle` (how many tokens the client has, and how to stop the worker
leg). When the queue evicts it, the handle stops the leg (``Abort`` on the
worker), the service stops relaying that leg's tokens and waits in
:meth:`QlmAdmission.resume` until the queue pulls the request again; it then
continues with ``Decode(generated_token_ids=<the tokens the client has>)`` on
the new instance, which recomputes prompt + generated tokens, so the client's
stream goes on at ``first_token_index`` = the tokens it received: none lost,
none repeated. A request is evicted only after its first token (before that
there is nothing to keep, and its leg is still being set up).

Instances: the neutral instances of the cluster view when the first request
arrives, each modelled from the router's predictor of its profile group. The
set is fixed for the life of the queue (a new instance is not used by qlm; a
request whose instance left fails with the scheduling error).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from slorouter.v1 import cms_pb2

from fleet.snapshot import ClusterSnapshot
from router.admission import Admission, Admitted
from router.arrival import ArrivalCheck
from router.core.errors import EmptyClusterError, QueueFullError, RouterError, SchedulingError
from router.core.policies import health_only
from router.core.qlm import Dispatch, QlmConfig, QlmQueue, QlmRequest, instance_model
from router.core.queue import QueueConfig, QueuePolicy
from router.core.request import ScheduleInput, Targets
from router.placement import PlacementRequest, Placer
from router.route import Route
from router.telemetry import RequestObserver

logger = logging.getLogger(__name__)

#: Targets a dispatch is checked against: the plan already chose the instance, nothing may refuse it.
_ANY = Targets(ttft_ms=1e12, tpot_ms=1e12, e2e_ms=0.0, full_ttft_ms=1e12)


@dataclass
class RunHandle:
    """What the service lends the queue for one streaming request."""

    #: Tokens the client has received so far.
    tokens: Callable[[], int]
    #: Stop the worker leg (fire-and-forget ``Abort``).
    stop: Callable[[], None]
    #: Set by an eviction; the service clears it when it resumes.
    evicted: bool = False
    resumed: asyncio.Future[Admitted] | None = field(default=None, repr=False)


class QlmAdmission:
    """Places requests through a :class:`QlmQueue` (see the module doc); :class:`Admission`'s interface."""

    enabled = True

    def __init__(
        self,
        placer: Placer,
        config: QueueConfig,
        qlm: QlmConfig,
        *,
        clock: Callable[[], float],
        observer: RequestObserver | None = None,
    ) -> None:
        self.placer = placer
        self.config = config
        self.qlm_config = qlm
        self.qlm: QlmQueue | None = None
        self.ids: tuple[str, ...] = ()
        self._clock = clock
        self._observer = observer or RequestObserver()
        self._futures: dict[str, asyncio.Future[Admitted]] = {}
        self._requests: dict[str, PlacementRequest] = {}
        self._handles: dict[str, RunHandle] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pump_pending = False
        # The plan chose the instance: its dispatch checks only that the instance can take work.
        # (The scheduler's own policy would also apply thresholds no target relaxes, such as the
        # TPOT of the requests already there, and refuse a request the plan had placed.)
        self._dispatch_policy = health_only(placer.scheduler.config, "qlm-dispatch")
        self._arrival = ArrivalCheck(placer.scheduler, placer.snapshot)

    # ------------------------------------------------------------------ set-up

    def _queue(self, snapshot: ClusterSnapshot) -> QlmQueue:
        if self.qlm is not None:
            return self.qlm
        sched = self.placer.scheduler
        predictors = sched.predictors
        if predictors is None:
            raise EmptyClusterError(
                "--queue-policy qlm needs latency profiles (the estimator predicts with them)"
            )
        label = sched.config.profile_label
        records = sorted(
            (r for r in snapshot.instances if r.metadata.role == cms_pb2.INSTANCE_ROLE_NEUTRAL),
            key=lambda r: r.metadata.instance_id,
        )
        if not records:
            raise EmptyClusterError("--queue-policy qlm places whole requests and needs neutral instances")
        models = []
        for record in records:
            lp = predictors.for_group(record.metadata.labels.get(label, ""))
            budget = record.metadata.max_num_batched_tokens or sched.config.default_max_num_batched_tokens
            kv = int(record.metadata.kv_capacity_tokens)
            models.append(
                instance_model(lp, self.qlm_config, sched.config.tpot_slo_ms, budget=budget, kv_tokens=kv)
            )
        self.ids = tuple(r.metadata.instance_id for r in records)
        self.qlm = QlmQueue(
            self.qlm_config,
            models,
            sched.config.ttft_slo_ms,
            sched.config.tpot_slo_ms,
            max_queue_size=self.config.max_queue_size,
        )
        logger.info(
            "qlm: %d neutral instances, batch %s", len(self.ids), ",".join(str(m.batch) for m in models)
        )
        return self.qlm

    # ------------------------------------------------------------------ the request side

    async def place(self, req: PlacementRequest, *, exclude: frozenset[str] = frozenset()) -> Admitted:
        """Queue ``req`` and wait until its instance pulls it."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        now = self._clock()
        qlm = self._queue(self.placer.snapshot())
        request = self.placer.schedule_input(req, exclude=exclude)
        # A target no idle instance could meet is refused now (router.arrival), not after waiting.
        self._arrival.check(request, now)
        future: asyncio.Future[Admitted] = loop.create_future()
        if qlm.push(request, now, token=future) is None:
            self._observer.queue_event("shed")
            raise QueueFullError(
                f"the router queue is full ({self.config.max_queue_size} requests, --max-queue-size); retry later"
            )
        self._observer.queue_changed(request, +1)
        self._futures[req.request_id] = future
        self._requests[req.request_id] = req
        self._pump()
        return await self._wait(req.request_id, future)

    async def _wait(self, request_id: str, future: asyncio.Future[Admitted]) -> Admitted:
        try:
            return await future
        except asyncio.CancelledError:
            qlm = self.qlm
            if qlm is not None and (r := qlm.remove(request_id)) is not None:
                self._observer.queue_changed(r.request, -1)
            self._forget(request_id)
            raise

    def attach(self, request_id: str, tokens: Callable[[], int], stop: Callable[[], None]) -> RunHandle:
        """The service's handle on a streaming request (see the module doc)."""
        handle = RunHandle(tokens, stop)
        self._handles[request_id] = handle
        return handle

    async def resume(self, request_id: str) -> Admitted:
        """After an eviction: wait until the queue pulls ``request_id`` again; its new route."""
        handle = self._handles[request_id]
        assert handle.resumed is not None
        admitted = await self._wait(request_id, handle.resumed)
        handle.evicted = False
        handle.resumed = None
        return admitted

    def outcome(
        self,
        req: PlacementRequest,
        *,
        finished: bool,
        ttft_s: float | None,
        tpot_s: float | None,
        e2e_s: float,
    ) -> None:
        """The qlm policy has no queue objective: nothing to learn from how a request ended."""
        return None

    def release(self, request_id: str, output_tokens: int | None = None) -> None:
        """``request_id`` ended at the router (``output_tokens``: its whole output when it completed)."""
        self.placer.release(request_id)
        qlm = self.qlm
        if (
            qlm is not None
            and qlm.finished(request_id, output_tokens, self._clock()) is None
            and (r := qlm.remove(request_id))
        ):
            self._observer.queue_changed(r.request, -1)
        self._forget(request_id)
        self.notify()

    def _forget(self, request_id: str) -> None:
        self._handles.pop(request_id, None)
        self._requests.pop(request_id, None)
        future = self._futures.pop(request_id, None)
        if future is not None and not future.done():
            future.cancel()

    def notify(self) -> None:
        if self._pump_pending or self.qlm is None or not len(self.qlm):
            return
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        self._pump_pending = True
        loop.call_soon(self._pump)

    def dry_run_queue(self) -> None:
        """The ``Schedule`` dry run answers without the qlm queue's order."""
        return None

    def refuse_queued(self, error: RouterError) -> None:
        """Fail every request waiting for a placement (queued or evicted) with ``error`` (shutdown)."""
        for request_id, future in list(self._futures.items()):
            if not future.done():
                qlm = self.qlm
                if qlm is not None and (r := qlm.remove(request_id)) is not None:
                    self._observer.queue_changed(r.request, -1)
                self._futures.pop(request_id, None)
                future.set_exception(error)

    def close(self) -> None:
        return None

    # ------------------------------------------------------------------ the pump

    def _pump(self) -> None:
        self._pump_pending = False
        qlm = self.qlm
        if qlm is None:
            return
        now = self._clock()
        try:
            dispatches = qlm.pump(now, self._evict)
        except Exception as exc:  # a bug must not leave clients waiting forever
            logger.exception("qlm queue pass failed; refusing the %d queued request(s)", len(qlm))
            for r in list(qlm.requests()):
                qlm.remove(r.request_id)
                future = self._futures.pop(r.request_id, None)
                if future is not None and not future.done():
                    future.set_exception(RouterError(f"router queue failure: {exc}"))
            return
        for dispatch in dispatches:
            self._dispatch(dispatch, now)

    def _dispatch(self, dispatch: Dispatch, now: float) -> None:
        r = dispatch.request
        rid = r.request_id
        qlm = self.qlm
        assert qlm is not None
        self._observer.queue_changed(r.request, -1)
        future = self._futures.pop(rid, None)
        req = self._requests.get(rid)
        if future is None or future.done() or req is None:  # cancelled meanwhile
            qlm.finished(rid)
            return
        try:
            route = self._route(req, r, dispatch.instance, now)
        except SchedulingError as exc:
            qlm.finished(rid)
            future.set_exception(exc)
            return
        waited = now - r.arrival_s if r.evictions == 0 else 0.0
        self._observer.queue_waited(waited)
        future.set_result(Admitted(route, waited, False))

    def _route(self, req: PlacementRequest, r: QlmRequest, instance: int, now: float) -> Route:
        """The route to the instance the queue chose (recorded as a dispatch, like any placement)."""
        snapshot = self.placer.snapshot()
        target = self.ids[instance]
        others = frozenset(rec.metadata.instance_id for rec in snapshot.instances) - {target}
        request: ScheduleInput = self.placer.schedule_input(
            req, exclude=others, prompt_tokens=r.prompt_tokens
        )
        decision = self.placer.decide(snapshot, request, now, targets=_ANY, policy=self._dispatch_policy)
        return self.placer.commit(decision, now)

    def _evict(self, r: QlmRequest, instance: int) -> int | None:
        handle = self._handles.get(r.request_id)
        if handle is None or handle.evicted:
            return None  # not streaming yet (or already being evicted): nothing to keep, leave it
        tokens = handle.tokens()
        if tokens <= 0 or self._loop is None:
            return None
        handle.evicted = True
        future: asyncio.Future[Admitted] = self._loop.create_future()
        handle.resumed = future
        self._futures[r.request_id] = future
        handle.stop()
        self.placer.release(r.request_id)
        self._observer.queue_event("evicted")
        logger.info("qlm: evicted %s from %s after %d tokens", r.request_id, self.ids[instance], tokens)
        self._observer.queue_changed(r.request, +1)
        return tokens


def make_admission(
    placer: Placer,
    config: QueueConfig,
    qlm: QlmConfig | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
    observer: RequestObserver | None = None,
) -> Admission | QlmAdmission:
    """The admission ``config`` asks for: the router queue, or the qlm queue (``queue_policy`` qlm)."""
    if config.policy is QueuePolicy.QLM:
        return QlmAdmission(placer, config, qlm or QlmConfig(), clock=clock, observer=observer)
    return Admission(placer, config, clock=clock, observer=observer)
