"""``slice``: slice-level dispatch (seed 002, SCLS) behind the dispatcher contract.

Every placement of a request is capped at a *slice* of new tokens: the
``DISPATCH`` action carries the cap (:attr:`~router.core.dispatch.Action.cap`)
and the driver starts the leg with it. A slice that ends at its cap with output
left is the lifecycle's pause: the driver pauses the request (keeping every
token), requeues it and hands the dispatcher a
:class:`~router.core.dispatch.Paused` event; the dispatcher answers with the
next ``DISPATCH`` (the tokens so far in :attr:`~router.core.dispatch.Action.tokens`,
the next cap), and the driver resumes the request after those tokens. That is
the same pause → requeue → resume that decode failover and qlm's eviction use.

The algorithms are :mod:`router.core.slicing`'s (:class:`SliceScheduler`: the
pool, the serving-time batcher, max-min offload into per-instance local
queues, admission as the planned KV leaves room, and the resume of a slice at
once). This module only turns events into calls on it and its answers into
actions:

- :class:`~router.core.dispatch.Arrival`: the first slice joins the pool; the
  dispatcher asks to be woken (:meth:`Sliced.wake_s`) at the next schedule point.
- :class:`~router.core.dispatch.Timer`: a schedule point: the fleet's neutral
  instances are read, the pool batched and offloaded, and every instance admits
  what its KV plan has room for (one ``DISPATCH`` per slice).
- :class:`~router.core.dispatch.Paused`: the slice ended at its cap; the next one
  is placed at once (``resume_at_once``) or goes back to the pool. Placed at once
  on the instance it ran on, it continues its run there
  (:attr:`~router.core.dispatch.Action.continues`, ``continue_in_place``): the
  engine never sees that boundary, and a boundary costs a re-prefill only
  where the slice moves.
- :class:`~router.core.dispatch.Completion`: the request ended (done, failed or
  cancelled while running): its slice's planned KV and estimate leave.
- :class:`~router.core.dispatch.ViewChanged`: the instances that a pause or a
  completion freed admit their queued batches (one admission per freed
  instance, after every end of the moment: the driver coalesces them).
- :class:`~router.core.dispatch.Cancel`: a waiting request leaves (its queued
  slice is dropped when its batch is admitted).

The placement of a slice is a decision like any other (recorded by the driver,
so the in-flight account and the route come from it): the instance the offloader
chose, checked only for health (:func:`~router.core.policies.health_only`), as
qlm's dispatches are. Only neutral instances take slices (a slice is a prefill
and its decode on one instance).

The running slices' progress (the KV they hold now) is read through
:meth:`~router.core.dispatch.Fleet.produced`, the tokens each running request
has produced: the router counts the tokens it relays, the simulator its engines'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from fleet.snapshot import ClusterSnapshot, InstanceRecord
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
    Paused,
    Preempted,
    Timer,
    ViewChanged,
)
from router.core.errors import EmptyClusterError, QueueFullError, RouterError, SchedulingError
from router.core.policies import health_only
from router.core.queue import RouterQueue
from router.core.registry import Params
from router.core.request import Role, ScheduleInput, Targets
from router.core.slicing import (
    InstanceShape,
    ModelBook,
    SliceConfig,
    SliceRequest,
    SliceScheduler,
    slice_length,
)

#: Targets a slice's placement is checked against: the offloader chose the instance.
_ANY = Targets(ttft_ms=1e12, tpot_ms=1e12, e2e_ms=0.0, full_ttft_ms=1e12)

#: Placements of one request's slices that may fail in a row (its instance gone from the fleet, each
#: time back to the pool for the next schedule point, which reads the fleet again) before it is refused.
MAX_PLACEMENT_FAILURES = 3


@dataclass
class _Slice:
    """One request's current slice: where it waits or runs."""

    request: ScheduleInput
    token: Any
    arrival_s: float
    #: Tokens produced before this slice (the slice resumes after them).
    tokens: int = 0
    #: The slice as the scheduler knows it; where it runs and its batch key once placed.
    part: SliceRequest | None = None
    instance: str = ""
    key: int = -1
    waiting: bool = True
    #: Placements of its slices that failed in a row (the chosen instance left the fleet).
    failures: int = 0


class Sliced:
    """``slice`` (see the module doc)."""

    name = "slice"
    waits = True
    coalesce_arrivals = False

    def __init__(self, setup: DispatchSetup) -> None:
        self.setup = setup
        self.config: SliceConfig = setup.slicing
        #: Most slices waiting for a placement (in the pool or a local queue); beyond it arrivals are refused.
        self._bound = min(self.config.max_waiting_slices, setup.queue.max_queue_size)
        self.sched: SliceScheduler | None = None
        self._book: ModelBook | None = None
        self._slices: dict[str, _Slice] = {}
        self._waiting = 0
        self._fleet: Fleet | None = None
        self._policy: Any = None
        #: The next schedule point (s) and whether one is asked for.
        self._next_tick = 0.0
        self._wake: float | None = None
        #: Instances a pause or a completion freed since the last admission.
        self._freed: list[str] = []
        #: Slices placed (first and resumed), for reports.
        self.slices = 0
        #: Tokens per block of the requests' prefix hashes (the router's prefix index's block).
        self._prefix_block_tokens = 0
        #: What each instance holds for requests another dispatcher placed there (``auto``: request
        #: dispatch's before the switch), as :attr:`SliceScheduler.residents` reads it; None: none.
        self.residents: Callable[[str], list[tuple[float, float]]] | None = None

    # ------------------------------------------------------------------ the contract

    def __len__(self) -> int:
        return self._waiting

    def wake_s(self) -> float | None:
        return self._wake

    def dry_run_queue(self) -> RouterQueue | None:
        return None

    def shed_limit_ms(self, now: float) -> float | None:
        return None

    def counters(self) -> dict[str, int]:
        sched = self.sched
        if sched is None:
            return {"slices": self.slices}
        return {
            "slices": self.slices,
            "batches": sched.batches,
            "schedule_points": sched.schedule_points,
            "resumed": sched.resumed,
            "moved": sched.moved,
            "shortened": sched.shortened,
            "waited": sched.waited,
        }

    def refuse_all(self, error: RouterError) -> list[Action]:
        out = []
        for s in list(self._slices.values()):
            if s.waiting:
                out.append(self._leave(s, Outcome.REFUSE, error=error, event="rejected"))
        return out

    def handle(self, event: Event, now: float, fleet: Fleet) -> Iterable[Action]:
        self._fleet = fleet
        if isinstance(event, Arrival):
            return self._arrive(event, now, fleet)
        if isinstance(event, Paused):
            return self._paused(event, now, fleet)
        if isinstance(event, Completion):
            return self._completed(event, now)
        if isinstance(event, Cancel):
            s = self._slices.get(event.request_id)
            if s is None or not s.waiting:
                return []
            return [self._leave(s, Outcome.LEFT)]
        if isinstance(event, Timer):
            return self._schedule_point(now, fleet)
        if isinstance(event, Preempted):
            if self.sched is not None:
                self.sched.preempted(event.instance_id)
            return []
        if isinstance(event, ViewChanged) and self._freed:
            freed, self._freed = self._freed, []
            out: list[Action] = []
            # By id, not in the order the frees came: instances freed at the same moment compete for
            # the same waiting slices (_take_held_back), and the order events tie in follows the order
            # the fleet is listed in.
            for instance in sorted(set(freed)):
                out.extend(self._admit(instance, now, fleet))
            return out
        return []

    @property
    def planning(self) -> bool:
        """Whether the slice plan is set up (its instances read: the first arrival does it)."""
        return self.sched is not None and bool(self.sched.instances)

    def adopt(self, request: ScheduleInput, token: Any, tokens: int, now: float) -> None:
        """Take over ``request``, which another dispatcher placed and which was stopped after ``tokens``
        (the driver holds it as waiting again): its next slice resumes after them, from the pool."""
        s = _Slice(request, token, now, tokens=tokens)
        self._slices[request.request_id] = s
        self._to_pool(s, now)

    def freed(self, instance: str) -> None:
        """A request another dispatcher placed on ``instance`` ended: its queued slices may start
        there at the next :class:`~router.core.dispatch.ViewChanged`."""
        self._freed.append(instance)

    # ------------------------------------------------------------------ the scheduler

    def _neutral(self, fleet: Fleet, now: float) -> list[InstanceRecord]:
        """The fleet's neutral instances that take work now (a fresh, schedulable status), as the view
        says (the router's from the CMS snapshot, the simulator's from its engines), with their metadata."""
        scheduler = fleet.scheduler
        try:
            source = fleet.view()
            view = scheduler.view(source, now) if isinstance(source, ClusterSnapshot) else source
        except SchedulingError:
            return []
        t = view.instances
        usable = (
            (t.roles == int(Role.NEUTRAL))
            & t.has_status
            & t.schedulable
            & (view.status_age_s <= scheduler.config.instance_staleness_s)
        )
        ids = {t.ids[k] for k in np.flatnonzero(usable).tolist()}
        return [r for r in fleet.snapshot().instances if r.metadata.instance_id in ids]

    def _scheduler(self, records: list[InstanceRecord], fleet: Fleet) -> SliceScheduler:
        """The slice scheduler over ``records``, each instance with its own estimators (kept while
        its shape holds: :class:`ModelBook`)."""
        scheduler = fleet.scheduler
        if self._book is None:
            predictors = scheduler.predictors
            if predictors is None:
                raise EmptyClusterError(
                    "--dispatch-mode slice needs latency profiles (--profile) to estimate slice times"
                )
            self._book = ModelBook(predictors.for_group, self.config)
            self._policy = health_only(scheduler.config, "slice")
        label = scheduler.config.profile_label
        shapes = {}
        for r in records:
            meta = r.metadata
            shapes[meta.instance_id] = InstanceShape(
                meta.labels.get(label, ""),
                max_num_batched_tokens=meta.max_num_batched_tokens or 2048,
                kv_capacity_tokens=meta.kv_capacity_tokens or 65536,
                block_size=meta.block_size or 16,
                max_model_len=meta.max_model_len or 8192,
                max_num_seqs=meta.max_num_seqs or 256,
            )
        models = self._book.models(shapes)
        ids = list(shapes)
        if self.sched is None:
            first = models[ids[0]]
            self.sched = SliceScheduler(self.config, first.serving, first.memory, ids)
            self.sched.progress = self._context_now
            self.sched.residents = self.residents
            index = scheduler.prefix
            # The requests' prefix hashes are the index's blocks (no index: the router hashes none).
            if index is not None:
                self.sched.cached = index.matched_blocks
                self._prefix_block_tokens = index.block_tokens
        self.sched.set_models(models)
        self.sched.set_instances(ids)
        return self.sched

    def _context_now(self, key: Hashable) -> int | None:
        """A running slice's context now: the prompt and every token its request has produced."""
        s = self._slices.get(str(key))
        fleet = self._fleet
        if s is None or fleet is None:
            return None
        produced = fleet.produced(s.request.request_id)
        if produced is None:
            # Not producing yet (placed, not started; the driver has no count of it): it holds
            # its context, the prompt and the tokens its slice resumes after.
            produced = s.tokens
        return s.request.prompt_tokens + produced

    def _part(self, s: _Slice) -> SliceRequest:
        """The request's next slice: its context now and the tokens it may generate."""
        sched = self.sched
        assert sched is not None
        context = s.request.prompt_tokens + s.tokens
        remaining = s.request.max_tokens - s.tokens
        serving = sched.models(min(sched.instances)).serving
        length = slice_length(context, remaining, serving, self.config, s.tokens)
        # The prompt's shared prefix blocks lead every slice's context (the tokens produced follow them).
        hashes = s.request.prefix_hashes
        block = self._prefix_block_tokens if hashes else 0
        return SliceRequest(s.request.request_id, context, length, hashes if block else (), block)

    # ------------------------------------------------------------------ events

    def _arrive(self, event: Arrival, now: float, fleet: Fleet) -> list[Action]:
        request = event.request
        sched = self.sched
        if sched is None or not sched.instances:
            records = self._neutral(fleet, now)
            if not records:
                return [Action(Outcome.REFUSE, request, event.token, error=_no_neutral(), waited=False)]
            sched = self._scheduler(records, fleet)
        if self._waiting >= self._bound:
            error = QueueFullError(
                f"{self._waiting} slices already wait for a placement (the slice pool's bound, "
                f"{self._bound}: --max-queue-size); retry later or add neutral instances"
            )
            return [Action(Outcome.REFUSE, request, event.token, error=error, event="shed", waited=False)]
        s = _Slice(request, event.token, now)
        self._slices[request.request_id] = s
        self._to_pool(s, now)
        return [Action(Outcome.QUEUED, request, event.token)]

    def _to_pool(self, s: _Slice, now: float) -> None:
        sched = self.sched
        assert sched is not None
        s.part = self._part(s)
        s.waiting = True
        self._waiting += 1
        sched.add(s.part)
        if self._wake is None:
            self._wake = max(now, self._next_tick)

    def _schedule_point(self, now: float, fleet: Fleet) -> list[Action]:
        # The points keep their cadence from the moment asked for, not the moment the driver's timer
        # fired (a timer fires a little late: the router's by a millisecond, the simulator's by a
        # microsecond), so the lateness does not add up over the points.
        asked = self._wake if self._wake is not None and self._wake <= now else now
        self._wake = None
        records = self._neutral(fleet, now)
        if not records:
            self._next_tick = now + self.config.min_interval_ms * 1e-3
            # The slices in the pool fail (those queued on an instance are still admitted there).
            pool = {id(r) for r in self.sched.pool} if self.sched is not None else None
            error = _no_neutral()
            refused = [
                self._leave(s, Outcome.REFUSE, error=error, event="rejected")
                for s in list(self._slices.values())
                if s.waiting and (pool is None or id(s.part) in pool)
            ]
            if self.sched is not None:
                self.sched.pool = []
            return refused
        sched = self._scheduler(records, fleet)
        # Slices that left while in the pool are dropped from it here.
        sched.pool = [r for r in sched.pool if self._is_waiting(r)]
        sched.schedule()
        self._next_tick = asked + sched.interval_ms() * 1e-3
        if sched.pool:  # more than one point batches (max_batching_slices): come back for the rest
            self._wake = self._next_tick
        out: list[Action] = []
        # By id, not in listing order: the first to admit takes the slices waiting for room anywhere
        # (SliceScheduler._take_held_back), so listing order would decide which instance gets them.
        for instance in sorted(sched.instances):
            out.extend(self._admit(instance, now, fleet))
        return out

    def _is_waiting(self, part: SliceRequest) -> bool:
        """Whether ``part`` is the slice its request waits with (the scheduler may have shortened it:
        the same context, fewer tokens)."""
        s = self._slices.get(str(part.key))
        if s is None or not s.waiting or s.part is None:
            return False
        return s.part is part or (
            s.part.context_tokens == part.context_tokens and part.slice_tokens <= s.part.slice_tokens
        )

    def _admit(self, instance: str, now: float, fleet: Fleet) -> list[Action]:
        sched = self.sched
        if sched is None or instance not in sched.instances:
            return []
        out = []
        for key, batch in sched.admit(instance, now * 1000.0):
            for part in batch.requests:
                if not self._is_waiting(part):
                    sched.finish(instance, key, part)  # left while queued: its slice ends unstarted
                    continue
                s = self._slices[str(part.key)]
                s.part = part
                action = self._dispatch(s, instance, key, now, fleet)
                if action is not None:
                    out.append(action)
        return out

    def _dispatch(
        self, s: _Slice, instance: str, key: int, now: float, fleet: Fleet, continues: bool = False
    ) -> Action | None:
        """The slice's placement on ``instance`` (a decision like any other, so the driver records it).

        ``continues``: the placement keeps the paused leg running there (:attr:`Action.continues`).
        None when placement refuses the instance (it left the fleet, or failed and is ejected since
        the last schedule point): the slice goes back to the pool and still waits."""
        part = s.part
        assert part is not None
        s.waiting = False
        self._waiting -= 1
        s.instance, s.key = instance, key
        others = frozenset(r.metadata.instance_id for r in fleet.snapshot().instances) - {instance}
        request = dataclasses.replace(
            s.request,
            exclude_instance_ids=others,
            prompt_tokens=part.context_tokens,
            max_tokens=s.tokens + part.slice_tokens,
            # A resumed slice recomputes prompt + generated tokens, which still start with the prompt's
            # prefix blocks: where another instance caches them, it finds them there.
            prefix_hashes=s.request.prefix_hashes,
        )
        waited = now - s.arrival_s if not s.tokens else 0.0
        try:
            decision = fleet.decide(fleet.view(), request, now, targets=_ANY, policy=self._policy)
        except SchedulingError as exc:
            sched = self.sched
            assert sched is not None
            sched.finish(instance, key, part)
            s.failures += 1
            if s.failures > MAX_PLACEMENT_FAILURES:
                self._slices.pop(s.request.request_id, None)
                return Action(Outcome.REFUSE, s.request, s.token, error=exc, event="rejected")
            s.waiting = True
            self._waiting += 1
            sched.add(part)
            if self._wake is None:
                self._wake = max(now, self._next_tick)
            return None
        s.failures = 0
        self.slices += 1
        return Action(
            Outcome.DISPATCH,
            s.request,
            s.token,
            decision=decision,
            waited_s=waited,
            tokens=s.tokens,
            cap=part.slice_tokens,
            continues=continues,
            waited=True,
        )

    def _paused(self, event: Paused, now: float, fleet: Fleet) -> list[Action]:
        """The slice ended at its cap with output left: place the next one (pause → requeue → resume)."""
        s = self._slices.get(event.request_id)
        sched = self.sched
        if s is None or s.waiting or sched is None or s.part is None:
            return []
        part, instance, key = s.part, s.instance, s.key
        produced = event.tokens - s.tokens
        s.tokens = event.tokens
        self._freed.append(instance)
        if not self.config.resume_at_once or not sched.instances:
            # The paper's way: back to the pool for the next schedule point.
            self._to_pool(s, now)
            sched.finish(instance, key, part, now * 1000.0, produced)
            return [Action(Outcome.QUEUED, s.request, s.token)]
        following = self._part(s)
        placed_at = sched.resume(instance, key, part, following, now * 1000.0, produced)
        s.part = following
        s.waiting = True
        self._waiting += 1
        if placed_at is None:
            # No room for it anywhere now: it waits at its instance's queue head; the leg stops.
            return [Action(Outcome.QUEUED, s.request, s.token)]
        target, new_key, batch = placed_at
        s.part = batch.requests[0]  # its slice, maybe shortened to the room where it runs
        # Staying where it ran, the slice continues its run there: the engine never sees the boundary.
        continues = self.config.continue_in_place and target == instance
        placed = self._dispatch(s, target, new_key, now, fleet, continues)
        queued = Action(Outcome.QUEUED, s.request, s.token)
        return [queued] if placed is None else [queued, placed]

    def _completed(self, event: Completion, now: float) -> list[Action]:
        s = self._slices.get(event.request_id)
        if s is None:
            return []
        if s.waiting:
            return [self._leave(s, Outcome.LEFT)]
        del self._slices[event.request_id]
        sched = self.sched
        if sched is not None and s.part is not None and s.key >= 0:
            produced = None if event.output_tokens is None else event.output_tokens - s.tokens
            sched.finish(s.instance, s.key, s.part, now * 1000.0, produced)
            self._freed.append(s.instance)
        return []

    def _leave(
        self, s: _Slice, outcome: Outcome, *, error: RouterError | None = None, event: str = ""
    ) -> Action:
        """A waiting slice leaves (refused or cancelled); a queued one is dropped when its batch is admitted."""
        self._slices.pop(s.request.request_id, None)
        s.waiting = False
        self._waiting -= 1
        return Action(outcome, s.request, s.token, error=error, event=event)


def _no_neutral() -> EmptyClusterError:
    return EmptyClusterError(
        "slice dispatch found no schedulable neutral instance; start neutral workers "
        "(slices run prefill and decode on one instance) or use --dispatch-mode request"
    )


@DISPATCHERS.register("slice")
def _slice(setup: DispatchSetup, params: Params) -> Sliced:
    return Sliced(setup)
