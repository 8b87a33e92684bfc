"""The built-in dispatchers (:mod:`router.core.dispatch`), registered by name.

- ``none`` (:class:`Instant`): nothing waits; a request is placed at once or refused with
  placement's error.
- ``fcfs``, ``edf``, ``priority``, ``sa`` (:class:`Queued`): the router queue
  (:class:`router.core.queue.RouterQueue`: ordering, lateness, shedding, release control) offered
  to placement by :func:`router.core.queue.offer`; ``sa`` plugs seed 000's planner
  (:class:`router.core.sa.SAPlanner`) into it and plans a burst of arrivals in one pass.
- ``qlm`` (:class:`Qlm`): seed 004's request groups over per-instance virtual queues
  (:class:`router.core.qlm.QlmQueue`), which choose the instance themselves and evict.

These wrap the machines; the machines' own algorithms stay in their modules.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from fleet.snapshot import ClusterSnapshot
from router.core.arrival import ArrivalCheck
from router.core.calibration import Calibrator, Correction
from router.core.columns import InstanceTable
from router.core.dispatch import (
    DISPATCHERS,
    Action,
    Arrival,
    Cancel,
    Completion,
    DispatchSetup,
    Event,
    Fleet,
    Outcome,
    Preempted,
    Served,
    ViewChanged,
)
from router.core.errors import (
    ConfigError,
    EmptyClusterError,
    LateError,
    QueueFullError,
    QueueTimeoutError,
    RouterError,
    SchedulingError,
    ShedError,
    UnmeetableError,
)
from router.core.policies import health_only
from router.core.prefix import cached_tokens_column
from router.core.qlm import DEFAULT_CONTEXT, QlmQueue, QlmRequest, instance_model
from router.core.queue import (
    FleetDrain,
    LazyEpoch,
    LoadWatch,
    Objective,
    QueueEntry,
    RouterQueue,
    Verdict,
    offer,
)
from router.core.registry import Params
from router.core.request import Role, ScheduleInput, Targets
from router.core.sa import SAPlanner, modeled_evaluation_s

#: Consecutive waits that end a pass of the router queue (each wait is a full placement decision,
#: and most passes near capacity end in waits).
MAX_FAILURES = 4

#: The load columns of the cluster view whose decrease on some instance may let a waiting request go.
_LOAD_COLUMNS = (
    "uncomputed_prefill_tokens",
    "decode_requests",
    "decode_tokens",
    "used_kv_tokens",
    "waiting_requests",
    "running_requests",
)

#: Least time between two sweeps of the late entries for ones that cannot start before their
#: wait limit (:meth:`Queued._refuse_beyond_wait`); each sweep is one pass over the queue.
LATE_SWEEP_INTERVAL_S = 0.25


def _unmeetable(
    check: ArrivalCheck | None, event: Arrival, now: float, fleet: Fleet
) -> tuple[ArrivalCheck, Action | None]:
    """A waiting dispatcher's first look at an arrival: a target no idle instance could meet is
    refused now (:mod:`router.core.arrival`), not after the wait limit."""
    if check is None:
        check = ArrivalCheck(fleet.scheduler, fleet.view)
    try:
        check.check(event.request, now)
    except UnmeetableError as exc:
        return check, Action(Outcome.REFUSE, event.request, event.token, error=exc, waited=False)
    return check, None


# ---------------------------------------------------------------------- none


class Instant:
    """``none``: place at once or refuse with placement's own error."""

    name = "none"
    waits = False
    coalesce_arrivals = False

    def handle(self, event: Event, now: float, fleet: Fleet) -> Iterable[Action]:
        if not isinstance(event, Arrival):
            return []
        request = event.request
        try:
            decision = fleet.decide(fleet.view(), request, now)
        except SchedulingError as exc:
            return [Action(Outcome.REFUSE, request, event.token, error=exc, event="refused", waited=False)]
        return [Action(Outcome.DISPATCH, request, event.token, decision=decision, waited=False)]

    def wake_s(self) -> float | None:
        return None

    def __len__(self) -> int:
        return 0

    def refuse_all(self, error: RouterError) -> list[Action]:
        return []

    def shed_limit_ms(self, now: float) -> float | None:
        return None

    def dry_run_queue(self) -> RouterQueue | None:
        return None

    def counters(self) -> dict[str, int]:
        return {}


@DISPATCHERS.register("none")
def _none(setup: DispatchSetup, params: Params) -> Instant:
    return Instant()


# ---------------------------------------------------------------------- the router queue


class Queued:
    """``fcfs`` / ``edf`` / ``priority`` / ``sa``: the router queue, offered to placement on every event."""

    waits = True

    def __init__(self, setup: DispatchSetup) -> None:
        config = setup.queue
        self.name = config.queue_policy
        planner = None
        if self.name == "sa":
            planner = (
                SAPlanner(
                    config, seed=setup.seed, modeled_evaluation_s=modeled_evaluation_s, search=setup.sa_search
                )
                if setup.modeled_clock
                else SAPlanner(config, seed=setup.seed, search=setup.sa_search)
            )
        #: The sa planner plans a burst together; the other orders offer each arrival at once.
        self.coalesce_arrivals = planner is not None
        self.queue = RouterQueue(config, setup.default_ttft_ms, setup.default_tpot_ms, planner)
        self._last_sweep = -float("inf")
        self._check: ArrivalCheck | None = None
        #: The fleet's load when a pass last placed nothing (instance ids, load columns), or None.
        self._blocked: tuple[tuple[str, ...], npt.NDArray[np.float64]] | None = None
        #: The instance table :meth:`_load` last read, and its load.
        self._last_load: tuple[InstanceTable, tuple[tuple[str, ...], npt.NDArray[np.float64]]] | None = None
        #: Passes run and passes skipped because nothing could have changed (see :meth:`_worth_a_pass`).
        self.passes = self.skipped = 0
        #: Incremental dispatch (:class:`~router.core.queue.LoadWatch`): an entry refused on the fleet
        #: as it is now is not offered to placement again until some instance got lighter or its bound
        #: looser. None: every pass offers every entry it reaches (the full pass, for comparison).
        self.watch: LoadWatch | None = None
        if setup.incremental == "on":
            self.watch = LoadWatch()
        elif setup.incremental == "exact":
            self.watch = LoadWatch(calibration_epoch_s=0.0, measured_tolerance=0.0)
        elif setup.incremental != "off":
            raise ConfigError(f"incremental dispatch must be on, exact or off, got {setup.incremental!r}")

    def __len__(self) -> int:
        return len(self.queue)

    def wake_s(self) -> float | None:
        return self.queue.wake_s()

    def dry_run_queue(self) -> RouterQueue | None:
        return self.queue

    def shed_limit_ms(self, now: float) -> float | None:
        if self.queue.config.objective is not Objective.G:
            return None
        return self.queue.shed_limit_ms(now)

    def handle(self, event: Event, now: float, fleet: Fleet) -> Iterable[Action]:
        queue = self.queue
        if isinstance(event, Arrival):
            self._check, refused = _unmeetable(self._check, event, now, fleet)
            if refused is not None:
                return [refused]
            request = event.request
            queue.observe_arrival(request)
            _, shed = queue.push(request, now, token=event.token)
            out = [Action(Outcome.QUEUED, request, event.token)]
            out.extend(self._shed(victim) for victim in shed)
            if self.coalesce_arrivals or request.request_id not in queue:
                return out
            return itertools.chain(out, self._pass(now, fleet))
        if isinstance(event, Cancel):
            left = queue.remove(event.request_id)
            if left is None:
                return []
            self._blocked = None  # the entries behind it move up: the next view is worth a pass
            return [Action(Outcome.LEFT, left.request, left.token)]
        if isinstance(event, Completion):
            queue.finished(event.request_id, event.output_tokens)
            self._blocked = None  # its load leaves (the next view may not show it yet)
            if self.watch is not None:
                # Nor may the watch see it (a fleet whose room is not all in the view's columns):
                # every waiting request is worth one more try.
                self.watch.invalidate()
            return []
        if isinstance(event, Preempted):
            return []
        if isinstance(event, Served):
            if queue.config.objective is Objective.G:
                queue.note_outcome(event.request_id, event.met, now, event.tpot_ms)
            return []
        if not len(queue):
            return []
        # (Trying only the head on such a view cut decisions by a further third but cost 1-3 points
        # of attainment in the simulator: the requests behind a blocked head do go on those views.)
        if isinstance(event, ViewChanged) and not self._worth_a_pass(now, fleet):
            self.skipped += 1
            return []
        return self._pass(now, fleet)

    def warm(self, now: float, fleet: Fleet) -> None:
        """Build what an arrival on the fleet's newest view reads first (the arrival check's drain: the
        view's instance table, the drain's load-free parts), so the next arrival finds them built."""
        if self._check is None:
            self._check = ArrivalCheck(fleet.scheduler, fleet.view)
        self._check.warm(now)

    def counters(self) -> dict[str, int]:
        out = {"passes": self.passes, "skipped_passes": self.skipped, "held_refusals": self.queue.held}
        if self.watch is not None:
            out["load_epochs"] = self.watch.epoch
        return out

    def _epoch(self, fleet: Fleet, now: float) -> int | None:
        """The :class:`LoadWatch` epoch of the fleet now (None: incremental dispatch is off, or no fleet)."""
        watch = self.watch
        if watch is None:
            return None
        try:
            source = fleet.view()
            view = fleet.scheduler.view(source, now) if isinstance(source, ClusterSnapshot) else source
        except SchedulingError:
            watch.invalidate()
            return None
        return watch.observe(fleet.scheduler, view, now)

    def _load(self, fleet: Fleet, now: float) -> tuple[tuple[str, ...], npt.NDArray[np.float64]]:
        source = fleet.view()
        view = fleet.scheduler.view(source, now) if isinstance(source, ClusterSnapshot) else source
        t = view.instances
        last = self._last_load
        if last is not None and last[0] is t:
            # Every column read here is the instance table's (the statuses), none the in-flight
            # account's: one table (one snapshot; its columns are read-only) is one load. A pass's
            # check and every arrival of a burst on that snapshot read it once.
            return last[1]
        columns = [getattr(t, name) for name in _LOAD_COLUMNS]
        # An instance turning schedulable (or reporting at last) is more room, like a load going down.
        columns.append(-t.schedulable.astype(np.float64))
        columns.append(-t.has_status.astype(np.float64))
        load = (t.ids, np.vstack(columns))
        self._last_load = (t, load)
        return load

    def _worth_a_pass(self, now: float, fleet: Fleet) -> bool:
        """Whether a new view can let a waiting request go, after a pass that placed nothing.

        Incremental dispatch: every decision of that pass failed on load (or on targets that only
        tighten as time passes), so a new view can change its outcome only where some instance's
        load went down (a prefill progressed, a request left, KV freed, an instance came back).
        One whose loads only grew (a decode step added tokens, a dispatch landed) is skipped.
        Events other than a view (an arrival, a completion, a timer, a cancel) always pass, and so
        does a view when the queue's periodic hopeless scan is due, so lateness is judged as often
        as before.
        """
        blocked = self._blocked
        if blocked is None or self.queue.scan_due(now):
            return True
        try:
            ids, load = self._load(fleet, now)
        except SchedulingError:
            return True
        if ids != blocked[0] or load.shape != blocked[1].shape:
            return True
        return bool((load < blocked[1]).any())

    def refuse_all(self, error: RouterError) -> list[Action]:
        out = []
        for entry in list(self.queue.entries()):
            if self.queue.remove(entry.request_id) is not None:
                out.append(Action(Outcome.REFUSE, entry.request, entry.token, error=error, event="rejected"))
        return out

    def _shed(self, victim: QueueEntry) -> Action:
        config = self.queue.config
        error = QueueFullError(
            f"the router queue is full ({config.max_queue_size} requests, --max-queue-size) and "
            f"request {victim.request_id!r} (priority {victim.request.priority}) was the least valuable; "
            "retry later or raise its priority"
        )
        return Action(Outcome.REFUSE, victim.request, victim.token, error=error, event="shed")

    def _pass(self, now: float, fleet: Fleet) -> Iterator[Action]:
        """One offer pass, yielded as it goes: the driver records each dispatch before the next
        decision is made (so that decision sees its load), as :func:`offer` requires."""
        self.passes += 1
        try:
            before = self._load(fleet, now)
        except SchedulingError:
            before = None
        placed = False
        queue = self.queue
        epoch: int | LazyEpoch | None
        if self.watch is not None and len(queue) == 1 and next(queue.entries()).refusal is None:
            # Its one entry holds no refusal (a request that arrived at an empty queue): the epoch
            # is taken only if it is refused (see LazyEpoch for what the watch's base loses).
            epoch = LazyEpoch(lambda: self._epoch(fleet, now))
        else:
            epoch = self._epoch(fleet, now)
        for result in offer(
            self.queue,
            fleet.scheduler,
            fleet.view,
            now,
            max_failures=MAX_FAILURES,
            decide=fleet.decide,
            epoch=epoch,
        ):
            entry = result.entry
            verdict = result.verdict
            if verdict is Verdict.WAIT:
                continue
            if verdict is Verdict.LATE:
                yield Action(Outcome.LATE, entry.request, entry.token, event="late")
                continue
            waited = now - entry.enqueued_s
            if verdict is Verdict.DISPATCH:
                assert result.decision is not None
                placed = True
                yield (
                    Action(
                        Outcome.DISPATCH,
                        entry.request,
                        entry.token,
                        decision=result.decision,
                        waited_s=waited,
                        late=entry.late,
                    )
                )
                continue
            if verdict is Verdict.EXPIRED:
                event = "expired"
            else:
                event = "overlong" if isinstance(result.error, ShedError) else "rejected"
            yield Action(
                Outcome.REFUSE, entry.request, entry.token, error=result.error, event=event, waited_s=waited
            )
        if placed and len(self.queue):
            # The pass's own dispatches made the fleet heavier: the entries it refused after them are
            # judged against the fleet as it is now.
            self._epoch(fleet, now)
        if len(self.queue):
            yield from self._refuse_beyond_wait(now, fleet)
        self._blocked = None if placed or not len(self.queue) else before

    def _refuse_beyond_wait(self, now: float, fleet: Fleet) -> list[Action]:
        """Late entries whose best case starts only after their wait limit are refused now.

        Every on-time entry goes before any late one, and late ones go in the queue's order, so a
        late entry starts its prefill only once the fleet has prefilled the work queued in front
        of it now: :meth:`FleetDrain.start_ms` of those tokens and entries (at the fleet's full
        prefill rate, or the rate the queue really drained at lately when slower, in tokens or in
        requests, whichever is sooner, as the queue's own hopeless test counts) predicts its wait (later
        on-time arrivals that go first only add to it). An entry whose remaining wait
        (``--max-queue-wait-ms`` minus what it waited) is shorter would be refused at the limit
        anyway: it is refused at once, so the client learns it now (under a 4x overload most
        refusals came only after the full 60 s) and the backlog left when a burst ends is only
        what can still be served. One pass over the queue, at most every
        :data:`LATE_SWEEP_INTERVAL_S`.
        """
        if now - self._last_sweep < LATE_SWEEP_INTERVAL_S:
            return []
        self._last_sweep = now
        queue = self.queue
        entries = list(queue.entries())  # offer order: on-time entries first, then the late ones
        if not any(e.late for e in entries):
            return []
        scheduler = fleet.scheduler
        try:
            source = fleet.view()
            view = scheduler.view(source, now) if isinstance(source, ClusterSnapshot) else source
            drain = FleetDrain.of(scheduler, view, now, queue.drain_rate(now), queue.drain_request_rate(now))
        except SchedulingError:
            return []
        if drain is None:
            return []
        limit_ms = queue.config.max_queue_wait_ms
        ahead = 0  # prompt tokens of the entries still queued in front of this one
        ahead_n = 0  # ... and those entries (the queue drains in tokens or in requests: the sooner)
        out: list[Action] = []
        for entry in entries:
            if not entry.late:
                ahead += queue.work_tokens(entry)
                ahead_n += 1
                continue
            remaining_ms = limit_ms - (now - entry.enqueued_s) * 1e3
            start_ms = drain.start_ms(ahead, ahead_n)
            if start_ms <= remaining_ms or queue.remove(entry.request_id) is None:
                ahead += queue.work_tokens(entry)
                ahead_n += 1
                continue
            error = QueueTimeoutError(
                f"request {entry.request_id!r} cannot start for at least {start_ms:.0f} ms (the "
                f"work queued before it), past the {max(remaining_ms, 0.0):.0f} ms it may still wait "
                f"in the router queue (--max-queue-wait-ms {limit_ms:g}): refused now rather than at "
                "the limit; retry later or add capacity"
            )
            out.append(Action(Outcome.REFUSE, entry.request, entry.token, error=error, event="refused_early"))
        return out


for _name in ("fcfs", "edf", "priority", "sa"):

    @DISPATCHERS.register(_name)
    def _queued(setup: DispatchSetup, params: Params) -> Queued:
        return Queued(setup)


# ---------------------------------------------------------------------- qlm

#: Targets a qlm dispatch is checked against: the plan already chose the instance, nothing may refuse it.
_ANY = Targets(ttft_ms=1e12, tpot_ms=1e12, e2e_ms=0.0, full_ttft_ms=1e12)


class Qlm:
    """``qlm``: the queue pulls requests to the instances it planned them for, and evicts.

    The instances are the fleet's neutral ones when the first request arrives (a set fixed for the
    queue's life), each modelled from the router's predictor of its profile group and its
    metadata (batch budget, KV capacity, ``max_num_seqs``) with the constant context
    :data:`~router.core.qlm.DEFAULT_CONTEXT` that the queue then refines from what it sees — the
    same online rule in the router and the simulator (no figure from the run's future).
    """

    name = "qlm"
    waits = True
    coalesce_arrivals = False

    def __init__(self, setup: DispatchSetup) -> None:
        self.setup = setup
        self.qlm: QlmQueue | None = None
        self.ids: tuple[str, ...] = ()
        self._policy: Any = None
        self._check: ArrivalCheck | None = None
        #: ``--qlm-streams edf``: the TTFT-judged requests wait in the router queue in deadline order and
        #: are placed by the ``slo`` policy, as under the default ``edf`` queue (the paper's virtual
        #: queues and estimator are for end-to-end deadlines, Def. 2.2); the virtual queues hold the
        #: e2e-judged groups and count the streams running beside them (:meth:`QlmQueue.started`).
        #: ``--qlm-streams auto`` (the default): the same while no e2e-judged request arrived lately, the
        #: virtual queues for a stream otherwise (:meth:`_handle_split`).
        self.streams: Queued | None = None
        if setup.qlm.streams in ("edf", "auto"):
            self.streams = Queued(
                dataclasses.replace(setup, queue=dataclasses.replace(setup.queue, queue_policy="edf"))
            )

    def __len__(self) -> int:
        return (0 if self.qlm is None else len(self.qlm)) + (0 if self.streams is None else len(self.streams))

    def wake_s(self) -> float | None:
        return None if self.streams is None else self.streams.wake_s()

    def dry_run_queue(self) -> RouterQueue | None:
        return None

    def counters(self) -> dict[str, int]:
        qlm = self.qlm
        out = {} if qlm is None else {"plans": qlm.plans, "evictions": qlm.evictions}
        if self.streams is not None:
            out.update({f"streams_{k}": v for k, v in self.streams.counters().items()})
        return out

    def shed_limit_ms(self, now: float) -> float | None:
        return None

    def _queue(self, fleet: Fleet) -> QlmQueue:
        if self.qlm is not None:
            return self.qlm
        scheduler = fleet.scheduler
        predictors = scheduler.predictors
        if predictors is None:
            raise EmptyClusterError(
                "--queue-policy qlm needs latency profiles (the estimator predicts with them)"
            )
        config = scheduler.config
        records = sorted(
            (r for r in fleet.snapshot().instances if int(r.metadata.role) == int(Role.NEUTRAL)),
            key=lambda r: r.metadata.instance_id,
        )
        if not records:
            raise EmptyClusterError("--queue-policy qlm places whole requests and needs neutral instances")
        models = []
        for record in records:
            meta = record.metadata
            lp = predictors.for_group(meta.labels.get(config.profile_label, ""))
            models.append(
                instance_model(
                    lp,
                    self.setup.qlm,
                    config.tpot_slo_ms,
                    DEFAULT_CONTEXT,
                    meta.max_num_seqs or 256,
                    meta.max_num_batched_tokens or config.default_max_num_batched_tokens,
                    int(meta.kv_capacity_tokens),
                )
            )
        self.ids = tuple(r.metadata.instance_id for r in records)
        self._policy = health_only(config, "qlm-dispatch")
        # With a prefix source the engines cache prefixes (the router's premise for predicting from it):
        # a prompt's blocks that running requests already hold take no new KV there.
        prefix = scheduler.prefix
        self.qlm = QlmQueue(
            self.setup.qlm,
            models,
            self.setup.default_ttft_ms,
            self.setup.default_tpot_ms,
            max_queue_size=self.setup.queue.max_queue_size,
            prefix_block_tokens=0 if prefix is None else prefix.block_tokens,
        )
        calibrator = predictors.calibration
        if calibrator is not None:
            self.qlm.calibration = _CalibratedSteps(calibrator, self.ids)
        if prefix is not None:
            ids, index = self.ids, {instance_id: k for k, instance_id in enumerate(self.ids)}

            def cached(request: ScheduleInput) -> list[float] | None:
                # Read at each call: the router may swap its approximate index for the exact one.
                source = scheduler.prefix
                if source is None:
                    return None
                column = cached_tokens_column(
                    source, ids, index, request.prefix_hashes, request.prompt_tokens
                )
                values: list[float] = column.tolist()
                return values

            self.qlm.cached_prompt = cached
        return self.qlm

    def _is_stream(self, request: ScheduleInput) -> bool:
        """Whether ``request`` is TTFT-judged (not e2e-only): the router queue's under ``--qlm-streams edf``."""
        return not (request.e2e_slo_ms > 0 and request.ttft_slo_ms == 0 and request.tpot_slo_ms == 0)

    def _placed(self, actions: Iterable[Action], now: float) -> Iterator[Action]:
        """The streams queue's actions, each dispatch told to the virtual queues as it goes (the e2e pulls
        after it count it running where it was placed)."""
        qlm = self.qlm
        for action in actions:
            if action.outcome is Outcome.DISPATCH and qlm is not None and action.decision is not None:
                choice = action.decision.decode or action.decision.prefill
                if choice is not None and choice.instance_id in self.ids:
                    qlm.started(action.request, self.ids.index(choice.instance_id), now, action.token)
            yield action

    def handle(self, event: Event, now: float, fleet: Fleet) -> Iterable[Action]:
        if self.streams is not None:
            return self._handle_split(event, now, fleet)
        return self._handle(event, now, fleet)

    def _handle_split(self, event: Event, now: float, fleet: Fleet) -> Iterable[Action]:
        """``--qlm-streams edf``: streams to the router queue, e2e requests to the virtual queues; every
        pass offers the streams first (their deadlines are seconds away), then pulls e2e work.

        ``--qlm-streams auto``: a stream goes to the virtual queues while an e2e-judged request arrived in
        the last :data:`~router.core.qlm.STREAM_MEMORY_S` (the virtual queues weigh it against that work),
        to the router queue otherwise: with no e2e work there is nothing for the paper's plan to order,
        and the router queue's placement is the one the streams' targets are judged by (chat alone: 95.0 %
        against the virtual queues' 92.4, docs/papers.md)."""
        streams = self.streams
        assert streams is not None
        qlm = self._queue(fleet) if isinstance(event, Arrival) or self.qlm is not None else None
        if qlm is None:
            return []
        if isinstance(event, Arrival):
            if not self._is_stream(event.request):
                return self._handle(event, now, fleet)
            if self.setup.qlm.streams == "auto" and qlm.takes_stream(event.request, now):
                return self._handle(event, now, fleet)
            qlm.observe_stream(event.request, now)
            return itertools.chain(
                self._placed(streams.handle(event, now, fleet), now), self._pass_if(now, fleet)
            )
        if isinstance(event, Cancel):
            if event.request_id in streams.queue:
                return streams.handle(event, now, fleet)
            return self._handle(event, now, fleet)
        if isinstance(event, Completion):
            streams.handle(event, now, fleet)
            return self._handle(event, now, fleet)
        if isinstance(event, (Served, Preempted)):
            return streams.handle(event, now, fleet)
        return itertools.chain(
            self._placed(streams.handle(event, now, fleet), now), self._pass_if(now, fleet)
        )

    def _pass_if(self, now: float, fleet: Fleet) -> Iterator[Action]:
        if self.qlm is not None and len(self.qlm):
            yield from self._pass(now, fleet)

    def _handle(self, event: Event, now: float, fleet: Fleet) -> Iterable[Action]:
        if isinstance(event, Arrival):
            qlm = self._queue(fleet)
            self._check, refused = _unmeetable(self._check, event, now, fleet)
            if refused is not None:
                return [refused]
            if qlm.push(event.request, now, token=event.token) is None:
                error = QueueFullError(
                    f"the router queue is full ({self.setup.queue.max_queue_size} requests, --max-queue-size); "
                    "retry later"
                )
                return [
                    Action(
                        Outcome.REFUSE, event.request, event.token, error=error, event="shed", waited=False
                    )
                ]
            return [Action(Outcome.QUEUED, event.request, event.token), *self._pass(now, fleet)]
        if self.qlm is None:
            return []
        qlm = self.qlm
        if isinstance(event, Cancel):
            left = qlm.remove(event.request_id)
            return [] if left is None else [Action(Outcome.LEFT, left.request, left.token)]
        if isinstance(event, Completion):
            out: list[Action] = []
            if qlm.finished(event.request_id, event.output_tokens, now) is None:
                # Not running: it ended while waiting again after an eviction.
                left = qlm.remove(event.request_id)
                if left is not None:
                    out.append(Action(Outcome.LEFT, left.request, left.token))
            return out
        if isinstance(event, (Served, Preempted)):
            return []
        return self._pass(now, fleet) if len(qlm) else []

    def refuse_all(self, error: RouterError) -> list[Action]:
        qlm = self.qlm
        out = [] if self.streams is None else self.streams.refuse_all(error)
        if qlm is None:
            return out
        for r in list(qlm.requests()):
            qlm.remove(r.request_id)
            out.append(Action(Outcome.REFUSE, r.request, r.token, error=error, event="rejected"))
        return out

    def _pass(self, now: float, fleet: Fleet) -> list[Action]:
        qlm = self.qlm
        assert qlm is not None
        out: list[Action] = []

        def evict(r: QlmRequest, instance: int) -> int | None:
            tokens = fleet.evict(r.request_id)
            if tokens is not None:
                out.append(Action(Outcome.EVICT, r.request, r.token, event="evicted", tokens=tokens))
            return tokens

        for r in qlm.lapsed(now, self._late_allowance()):
            out.append(self._lapse(r))
        for dispatch in qlm.pump(now, evict):
            out.append(self._dispatch(dispatch.request, dispatch.instance, now, fleet))
        return out

    def _late_allowance(self) -> float:
        """How many of its targets past its deadline a late request may still be served (the router queue's
        ``--late-allowance``; none under ``--late-policy reject``)."""
        queue = self.setup.queue
        return queue.late_allowance if queue.late_policy == "serve" else 0.0

    def _lapse(self, r: QlmRequest) -> Action:
        """Refuse queued ``r``, which can no longer be served within its late allowance (:meth:`QlmQueue.lapsed`)."""
        kind = "e2e" if r.e2e_only else "TTFT"
        target_ms = (r.deadline_s - r.arrival_s) * 1e3
        error = LateError(
            f"request {r.request_id!r} cannot meet its {kind} target of {target_ms:.0f} ms: started now, its "
            f"{'completion' if r.e2e_only else 'first token'} would come more than {self._late_allowance():g}x "
            "that target past its deadline (--late-allowance); "
            "relax the target, retry later or add capacity"
        )
        return Action(Outcome.REFUSE, r.request, r.token, error=error, event="rejected")

    def _dispatch(self, r: QlmRequest, instance: int, now: float, fleet: Fleet) -> Action:
        """The placement on the instance the plan chose (a decision like any other, so it is recorded)."""
        target = self.ids[instance]
        others = frozenset(rec.metadata.instance_id for rec in fleet.snapshot().instances) - {target}
        request = dataclasses.replace(
            r.request,
            exclude_instance_ids=others,
            prompt_tokens=r.prompt_tokens,
            max_tokens=r.max_tokens,
            # A resumed run recomputes prompt + generated tokens: its prefix is no longer the prompt's.
            prefix_hashes=r.request.prefix_hashes if not r.resumed else (),
        )
        waited = now - r.arrival_s if r.evictions == 0 else 0.0
        try:
            decision = fleet.decide(fleet.view(), request, now, targets=_ANY, policy=self._policy)
        except SchedulingError as exc:
            assert self.qlm is not None
            self.qlm.finished(r.request_id)
            return Action(Outcome.REFUSE, r.request, r.token, error=exc, event="rejected")
        return Action(
            Outcome.DISPATCH, r.request, r.token, decision=decision, waited_s=waited, tokens=r.generated
        )


class _CalibratedSteps:
    """The scheduler's calibration of the queue's instances (rows in the queue's order), for the stream-side
    checks of :class:`~router.core.qlm.QlmQueue`: the correction the ``slo`` policy predicts a stream's TPOT
    with (``predicted_tpot``), rebuilt only when the calibration changed (its version). The router feeds
    the calibrator from the agents' status pushes, the simulator from its engines' finished steps: one
    path for both.

    No profile groups are passed: the calibrator knows each instance's group from its step samples, and
    a group named here would be the one an instance it has not seen yet keeps for every caller (the
    ``slo`` policy's too).
    """

    def __init__(self, calibrator: Calibrator, ids: tuple[str, ...]) -> None:
        self.calibrator, self.ids = calibrator, ids
        self._memo: tuple[int, Correction | None] | None = None

    def __call__(self) -> Correction | None:
        version = self.calibrator.version
        memo = self._memo
        if memo is None or memo[0] != version:
            memo = self._memo = (version, self.calibrator.correction(self.ids))
        return memo[1]


@DISPATCHERS.register("qlm")
def _qlm(setup: DispatchSetup, params: Params) -> Qlm:
    return Qlm(setup)


def reads_qlm_config(name: str) -> bool:
    """Whether the dispatcher registered as ``name`` is configured by :class:`QlmConfig` (a sweep runs
    it once per such configuration)."""
    return name == Qlm.name
