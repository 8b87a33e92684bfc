"""``auto``: request dispatch until a pilot shows that slices pay, then slice dispatch (seed 002).

On continuous-batching engines slice dispatch beats request dispatch where the
KV does not hold the load: there request dispatch makes the engines preempt
(and recompute whole requests), while slices keep a KV plan that holds
(:func:`router.core.slicing.slices_pay`, measured in ``docs/papers.md``).
Whether a fleet is on that side is seen only by running it, so :class:`Auto`
composes two dispatchers behind the one contract:

- It starts with *request dispatch*: the dispatcher the queue policy names
  (``--queue-policy``), exactly as ``--dispatch-mode request`` runs it.
- Its *pilot* is the first :data:`AUTO_PILOT_REQUESTS` requests it dispatched.
  At the first arrival (before any dispatch) it reads each instance's
  cumulative preemption count from the view (the instance status's
  ``num_preemptions``, :attr:`router.core.columns.InstanceTable.preemptions`);
  when the pilot's requests have all ended, or :data:`AUTO_PILOT_TIMEOUT_S`
  after the pilot began, it reads them again and applies ``slices_pay`` to the
  preemptions in between (or ``slices_pay_recomputed``, below) and the requests dispatched in between (the pilot's and
  any dispatched after it while it ran).
- Where every instance that counts preemptions also says what they cost
  (``num_preemption_recompute_tokens``,
  :attr:`router.core.columns.InstanceTable.preemption_recompute_tokens`: the
  tokens its engine computed again for the requests it preempted, less its
  prefix-cache hits), the pilot judges the work wasted instead of the count:
  those tokens against the prompt tokens dispatched (the requests judged
  times the mean prompt of those that arrived while it ran;
  :func:`router.core.slicing.slices_pay_recomputed`). Behind a cached prefix a
  preemption recomputes only the part past it and weighs little; a long
  request preempted weighs more than one. Elsewhere the raw count decides.
- If slices pay, every later arrival goes to the ``slice`` dispatcher
  (:mod:`router.core.slice_dispatch`). Requests already placed or waiting with
  request dispatch stay with it and finish where they are: every event about a
  request goes to the dispatcher that took its arrival; view changes and timers
  go to both.
- After the switch the instances are shared: the slice plan counts the
  requests request dispatch placed there and that still run (each its prompt
  and tokens so far, growing to its expected output, or ``max_tokens`` once
  past it) beside its own slices
  (:attr:`router.core.slicing.SliceScheduler.residents`), so its first batches
  fit beside them instead of over-filling their KV; a preemption on an
  instance they still share is theirs and leaves the plan's preemption cap
  alone; each one's end lets the slices queued on its instance start.
- SCLS runs every request in slices: after the switch, when an engine
  preempts on an instance still shared with those requests, the newest of
  them there (the one a vLLM engine takes back first) is handed to the slice
  plan: stopped (:meth:`Fleet.evict`, the driver's pause → requeue) and
  resumed after its tokens as a slice from the slice pool
  (:meth:`router.core.slice_dispatch.Sliced.adopt`). Its KV is then the
  plan's to book, and the whole requests stop preempting one another.
- If no instance reports a preemption count (an engine that does not count
  them, e.g. vLLM's own gRPC server behind ``slo-router agent``), it stays on
  request dispatch and logs once why.

The choice is made once per router and kept (:attr:`Auto.mode`); the router
exports it as ``slo_router_dispatch_mode{mode}``. Only neutral instances take
slices, as with ``--dispatch-mode slice``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Iterable, Iterator

import numpy as np

from fleet.snapshot import ClusterSnapshot
from router.core.dispatch import (
    DISPATCHERS,
    Action,
    Arrival,
    Cancel,
    Completion,
    Dispatcher,
    DispatchSetup,
    Event,
    Fleet,
    Outcome,
    Paused,
    Preempted,
    Timer,
    ViewChanged,
    make_dispatcher,
)
from router.core.errors import RouterError, SchedulingError
from router.core.queue import RouterQueue
from router.core.registry import Params
from router.core.request import ScheduleInput
from router.core.slice_dispatch import Sliced
from router.core.slicing import leading_blocks, slices_pay, slices_pay_recomputed

logger = logging.getLogger(__name__)

#: Share of the pilot's prompt tokens behind a prefix an earlier arrival led with, from which the
#: preemption count decides instead of the tokens recomputed (:meth:`Auto._prompts_share_prefixes`).
SHARED_PREFIX_SHARE = 0.5
#: Most prefix block hashes the pilot remembers (its memory stays bounded whatever the prompts).
MAX_PILOT_PREFIX_BLOCKS = 1 << 16

#: Requests of the pilot ``auto`` decides from (the first it dispatched).
AUTO_PILOT_REQUESTS = 100
#: Longest a pilot runs (s) before ``auto`` decides from what it counted so far.
AUTO_PILOT_TIMEOUT_S = 120.0

REQUEST = "request"
SLICE = "slice"


class Auto:
    """``auto`` (see the module doc)."""

    name = "auto"
    waits = True

    def __init__(
        self,
        setup: DispatchSetup,
        *,
        pilot_requests: int = AUTO_PILOT_REQUESTS,
        pilot_timeout_s: float = AUTO_PILOT_TIMEOUT_S,
    ) -> None:
        if pilot_requests < 1:
            raise ValueError(f"pilot_requests: must be >= 1, got {pilot_requests}")
        if not (math.isfinite(pilot_timeout_s) and pilot_timeout_s > 0):
            raise ValueError(f"pilot_timeout_s: must be a finite number > 0, got {pilot_timeout_s}")
        self.request = make_dispatcher(dataclasses.replace(setup, dispatcher=""))
        sliced = make_dispatcher(dataclasses.replace(setup, dispatcher=SLICE))
        assert isinstance(sliced, Sliced)
        self.slice = sliced
        #: As the dispatcher that takes the arrivals (the driver reads it per arrival).
        self.coalesce_arrivals = self.request.coalesce_arrivals
        self.pilot_requests = pilot_requests
        self.pilot_timeout_s = pilot_timeout_s
        #: The dispatch mode new arrivals get: ``request`` until the pilot decides, then the choice.
        self.mode = REQUEST
        #: Whether the pilot has decided (the mode is then kept).
        self.decided = False
        #: Why the pilot decided as it did (for the log and reports).
        self.reason = ""
        #: The dispatcher that took each request's arrival (every event about it goes there).
        self._owner: dict[str, Dispatcher] = {}
        #: The pilot: its start (s), the preemption counts then (instance id -> count), its requests
        #: still running, and the requests dispatched since it began.
        self._pilot_start: float | None = None
        self._baseline: dict[str, float] = {}
        #: The recompute counts then (instance id -> tokens; only instances that report them).
        self._baseline_tokens: dict[str, float] = {}
        #: Prompt tokens and requests that arrived while the pilot ran (the mean prompt a whole
        #: request's recompute is counted in).
        self._arrived_prompt_tokens = 0
        self._arrived = 0
        #: Of those prompt tokens, the ones behind prefix blocks an earlier arrival of the pilot led with
        #: (the prompts' ``prefix_hashes``), and those blocks (at most :data:`MAX_PILOT_PREFIX_BLOCKS`).
        self._arrived_shared_tokens = 0
        self._prefixes_seen: set[int] = set()
        self._pilot: set[str] = set()
        self._pilot_dispatched = 0
        #: While the pilot runs: the requests dispatched since it began (a resumed one counts once).
        self._seen: set[str] = set()
        #: Counted by the pilot, for reports: preemptions and requests it judged.
        self.pilot_preemptions = 0
        self.pilot_judged = 0
        #: The tokens the engines recomputed for the requests they preempted (where they say).
        self.pilot_recomputed_tokens = 0
        #: Where request dispatch placed each request still running (instance id, its request), and
        #: those requests per instance: after a switch the slice plan counts them beside its slices
        #: (:meth:`_residents`), read per instance at every pass.
        self._placed: dict[str, tuple[str, ScheduleInput]] = {}
        self._placed_on: dict[str, dict[str, ScheduleInput]] = {}
        #: The driver's token of each of those requests, and (after the switch) those to hand to the
        #: slice plan at the end of the current event (:meth:`_hand_over`).
        self._token_of: dict[str, object] = {}
        self._handing: set[str] = set()
        #: Requests handed to the slice plan after the switch, for reports.
        self.handed_over = 0
        self._fleet: Fleet | None = None
        self.slice.residents = self._residents

    # ------------------------------------------------------------------ the contract

    def __len__(self) -> int:
        return len(self.request) + len(self.slice)

    def wake_s(self) -> float | None:
        wakes = [w for w in (self.request.wake_s(), self.slice.wake_s()) if w is not None]
        return min(wakes) if wakes else None

    def refuse_all(self, error: RouterError) -> list[Action]:
        out = self.request.refuse_all(error) + self.slice.refuse_all(error)
        for action in out:
            self._owner.pop(action.request_id, None)
        return out

    def shed_limit_ms(self, now: float) -> float | None:
        return self.request.shed_limit_ms(now)

    def dry_run_queue(self) -> RouterQueue | None:
        return self.request.dry_run_queue()

    def counters(self) -> dict[str, int]:
        out = dict(self.request.counters())
        out.update(self.slice.counters())
        out["auto_slice"] = int(self.mode == SLICE)
        out["auto_pilot_preemptions"] = self.pilot_preemptions
        out["auto_pilot_requests"] = self.pilot_judged
        out["auto_handed_over"] = self.handed_over
        return out

    def warm(self, now: float, fleet: Fleet) -> None:
        """The request dispatcher's warm-up, while it takes the arrivals (see :class:`router.admission.Admission`)."""
        warm = getattr(self.request, "warm", None)
        if warm is not None and self.mode == REQUEST:
            warm(now, fleet)

    def handle(self, event: Event, now: float, fleet: Fleet) -> Iterable[Action]:
        out = self._handle(event, now, fleet)
        if self._handing:
            return itertools.chain(out, self._watch(self._hand_over(now, fleet)))
        return out

    def _hand_over(self, now: float, fleet: Fleet) -> Iterator[Action]:
        """Stop the requests request dispatch placed that are due to go to the slice plan, and hand
        each to it, which resumes it after its tokens (see the module doc)."""
        if not self.slice.planning:
            return  # no slice planned yet: the first arrival after the switch sets the plan up
        handing, self._handing = self._handing, set()
        for rid in sorted(handing):
            placed = self._placed.get(rid)
            if placed is None:
                continue
            instance, request = placed
            tokens = fleet.evict(rid)
            if tokens is None:
                continue
            token = self._token_of.get(rid)
            self._unplace(rid)
            # Request dispatch forgets it (its load left the instance); every later event goes to slices.
            for _ in self.request.handle(Completion(rid), now, fleet):
                pass
            self._owner[rid] = self.slice
            self.handed_over += 1
            yield Action(Outcome.EVICT, request, token, event="evicted", tokens=tokens)
            self.slice.adopt(request, token, tokens, now)
            self.slice.freed(instance)

    def _handle(self, event: Event, now: float, fleet: Fleet) -> Iterable[Action]:
        self._fleet = fleet
        if isinstance(event, Arrival):
            if self._pilot_start is None:
                self._begin_pilot(now, fleet)
            elif not self.decided:
                self._judge(now, fleet, ended=now - self._pilot_start >= self.pilot_timeout_s)
            if not self.decided:
                self._arrived_prompt_tokens += event.request.prompt_tokens
                self._arrived += 1
                self._count_shared(event.request.prefix_hashes, event.request.prompt_tokens, fleet)
            dispatcher = self._current()
            self._owner[event.request.request_id] = dispatcher
            return self._watch(dispatcher.handle(event, now, fleet))
        if isinstance(event, Timer):
            # Only to a dispatcher that asked for this moment (a schedule point of an idle slice
            # dispatcher would read the fleet for nothing).
            due = [d for d in (self.request, self.slice) if (w := d.wake_s()) is not None and w <= now]
            return self._watch(itertools.chain.from_iterable(d.handle(event, now, fleet) for d in due))
        if isinstance(event, Preempted) and self.mode == SLICE and self._shared(event.instance_id):
            # The slice plan counts request dispatch's requests there (_residents): a preemption
            # beside them is theirs (whole requests over-filling the KV among themselves, the engine
            # taking back its newest request), not the plan's, whose preemption cap it would shrink.
            # The newest whole request there (the one the engine takes back first) goes to slices.
            self._handing.add(next(reversed(self._placed_on[event.instance_id])))
            return self._watch(self.request.handle(event, now, fleet))
        if isinstance(event, (ViewChanged, Preempted)):
            return self._watch(
                itertools.chain(self.request.handle(event, now, fleet), self.slice.handle(event, now, fleet))
            )
        if isinstance(event, Completion):
            owner = self._owner.pop(event.request_id, None)
            placed = self._unplace(event.request_id)
            if placed is not None and self.mode == SLICE:
                self.slice.freed(placed)
            out = owner.handle(event, now, fleet) if owner is not None else []
            if not self.decided and self._pilot_start is not None:
                self._pilot.discard(event.request_id)
                ended = not self._pilot and self._pilot_dispatched >= self.pilot_requests
                self._judge(now, fleet, ended=ended or now - self._pilot_start >= self.pilot_timeout_s)
            return self._watch(out)
        if isinstance(event, (Paused, Cancel)):
            owner = self._owner.get(event.request_id)
            return self._watch(owner.handle(event, now, fleet)) if owner is not None else []
        # Served: to the dispatcher that took the request (or request dispatch's, which sheds by it).
        return self._watch(self._owner.get(event.request_id, self.request).handle(event, now, fleet))

    def _shared(self, instance: str) -> bool:
        """Whether ``instance`` still runs requests request dispatch placed there."""
        return bool(self._placed_on.get(instance))

    def _residents(self, instance: str) -> list[tuple[float, float]]:
        """The requests request dispatch placed on ``instance`` that still run there, as the slice plan
        counts them (:attr:`router.core.slicing.SliceScheduler.residents`): the tokens each holds now
        (its prompt and every token it has produced) and the steps to its expected end (its expected
        output, or its ``max_tokens`` where that is unknown or passed, less what it produced)."""
        fleet = self._fleet
        out: list[tuple[float, float]] = []
        if fleet is None:
            return out
        for request in self._placed_on.get(instance, {}).values():
            produced = fleet.produced(request.request_id) or 0
            expected = request.expected_output_tokens
            limit = request.max_tokens
            if expected > produced:
                left = expected - produced
            elif limit > produced:
                left = limit - produced
            else:
                left = 1
            out.append((float(request.prompt_tokens + produced), float(left)))
        return out

    def _unplace(self, request_id: str) -> str | None:
        """Forget where request dispatch placed ``request_id``; the instance it was on (None: none)."""
        placed = self._placed.pop(request_id, None)
        self._token_of.pop(request_id, None)
        self._handing.discard(request_id)
        if placed is None:
            return None
        where = placed[0]
        on = self._placed_on[where]
        del on[request_id]
        if not on:
            del self._placed_on[where]
        return where

    # ------------------------------------------------------------------ the pilot

    def _current(self) -> Dispatcher:
        return self.slice if self.mode == SLICE else self.request

    def _watch(self, actions: Iterable[Action]) -> Iterable[Action]:
        """Pass ``actions`` on as they come, noting the pilot's dispatches and the requests that left."""
        for action in actions:
            outcome = action.outcome
            rid = action.request_id
            if outcome is Outcome.DISPATCH:
                decision = action.decision
                choice = None if decision is None else (decision.decode or decision.prefill)
                if choice is not None and self._owner.get(rid) is self.request:
                    self._unplace(rid)
                    self._placed[rid] = (choice.instance_id, action.request)
                    self._placed_on.setdefault(choice.instance_id, {})[rid] = action.request
                    self._token_of[rid] = action.token
                if not self.decided and rid not in self._seen:
                    self._seen.add(rid)
                    if self._pilot_dispatched < self.pilot_requests:
                        self._pilot_dispatched += 1
                        self._pilot.add(rid)
            elif outcome in (Outcome.REFUSE, Outcome.LEFT):
                self._owner.pop(rid, None)
                self._unplace(rid)
                self._pilot.discard(rid)
            yield action

    def _begin_pilot(self, now: float, fleet: Fleet) -> None:
        self._pilot_start = now
        counts = self._counts(now, fleet)
        self._baseline, self._baseline_tokens = counts or ({}, {})

    def _counts(self, now: float, fleet: Fleet) -> tuple[dict[str, float], dict[str, float]] | None:
        """Each instance's cumulative preemption count as its status reports it (None: none reports
        one), and the recompute tokens of those that report them too."""
        try:
            source = fleet.view()
            view = fleet.scheduler.view(source, now) if isinstance(source, ClusterSnapshot) else source
        except SchedulingError:
            return None
        table = view.instances
        column = table.preemptions
        if column is None:
            return None
        reported = np.flatnonzero(np.isfinite(column)).tolist()
        if not reported:
            return None
        tokens = table.preemption_recompute_tokens
        return (
            {table.ids[k]: float(column[k]) for k in reported},
            {}
            if tokens is None
            else {table.ids[k]: float(tokens[k]) for k in reported if math.isfinite(tokens[k])},
        )

    def _judge(self, now: float, fleet: Fleet, *, ended: bool) -> None:
        """Switch to slices as soon as the preemptions since the pilot began pay for them; once the
        pilot ``ended`` (its requests all ended, or its time ran out), decide either way."""
        counts = self._counts(now, fleet)
        requests = max(self.pilot_requests, len(self._seen))
        if counts is None:
            if ended:
                self._decide(REQUEST, 0, len(self._seen))
                self.reason = (
                    "no instance reports a preemption count (its engine does not count them): "
                    "staying on request dispatch"
                )
                logger.warning("--dispatch-mode auto: %s", self.reason)
            return
        preemptions, tokens = counts
        preempted = _since(preemptions, self._baseline)
        weighed = ""
        if len(tokens) == len(preemptions) and self._arrived and not self._prompts_share_prefixes():
            # Every instance that counts preemptions says what they cost: judge by the work wasted.
            prompt_tokens = self._arrived_prompt_tokens / self._arrived * requests
            recomputed = _since(tokens, self._baseline_tokens)
            pays = slices_pay_recomputed(recomputed, prompt_tokens)
            weighed = (
                f", recomputing {recomputed:.0f} tokens ({recomputed / prompt_tokens:.2f} per prompt token)"
            )
            self.pilot_recomputed_tokens = int(recomputed)
        else:
            pays = slices_pay(int(preempted), requests)
        if not (pays or ended):
            return
        self._decide(SLICE if pays else REQUEST, int(preempted), len(self._seen))
        self.reason = (
            f"the engines preempted {self.pilot_preemptions} times{weighed} while {self.pilot_judged} requests "
            f"were dispatched ({'at least' if pays else 'under'} one per ten of at least {self.pilot_requests} "
            f"requests): {self.mode} dispatch from now on"
        )
        logger.info("--dispatch-mode auto: %s", self.reason)

    def _count_shared(self, hashes: tuple[int, ...], prompt_tokens: int, fleet: Fleet) -> None:
        """Count the tokens of an arrival's leading prefix blocks that an earlier arrival led with too."""
        if not hashes:
            return
        seen = self._prefixes_seen
        k = leading_blocks(hashes, seen)
        self._arrived_shared_tokens += min(k * fleet.scheduler.config.prefix_block_tokens, prompt_tokens)
        if len(seen) < MAX_PILOT_PREFIX_BLOCKS:
            seen.update(hashes[:MAX_PILOT_PREFIX_BLOCKS])

    def _prompts_share_prefixes(self) -> bool:
        """Whether most prompt tokens of the pilot's arrivals sit behind a prefix an earlier one had.

        There the recomputed tokens understate what slices save: a preemption re-prefills only the part
        past a cached prefix, yet the slice plan, which holds each shared prefix once per instance
        (:func:`router.core.slicing.kv_need`) and places batches where their prefix is, did 1.01-1.48x
        request dispatch's work on the five shared-prefix rows of docs/papers.md (seed 002, 3 Dec), where
        the tokens kept the pilot on request dispatch. The count decides there, as it did before.
        """
        return self._arrived_shared_tokens >= SHARED_PREFIX_SHARE * self._arrived_prompt_tokens > 0

    def _decide(self, mode: str, preemptions: int, requests: int) -> None:
        self.decided = True
        self.mode = mode
        self.coalesce_arrivals = self._current().coalesce_arrivals
        self.pilot_preemptions = preemptions
        self.pilot_judged = requests
        self._seen = set()
        self._pilot = set()


def _since(counts: dict[str, float], baseline: dict[str, float]) -> float:
    """What cumulative per-instance ``counts`` grew by since ``baseline``."""
    total = 0.0
    for instance, count in counts.items():
        before = baseline.get(instance, 0.0)
        # A count below the one the pilot began with: the engine restarted (its count began again).
        total += count - before if count >= before else count
    return total


@DISPATCHERS.register("auto")
def _auto(setup: DispatchSetup, params: Params) -> Auto:
    return Auto(setup)
