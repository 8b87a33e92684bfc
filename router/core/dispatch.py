"""The dispatcher contract: when, and in what order, waiting requests are placed.

Placement (filters, metrics, selectors: :mod:`router.core.scheduler`) decides
*where* a request runs. A *dispatcher* decides *when*: whether a request
waits, in what order waiting requests are offered to placement, which one is
refused (with the error whose class is its status code) and which running one
is stopped to make room. Every policy of that kind — ``none``, ``fcfs``,
``edf``, ``priority``, ``sa`` (seed 000), ``qlm`` (seed 004), ``slice`` (seed 002) — is
one object behind :class:`Dispatcher`, registered by name in :data:`DISPATCHERS`
(:mod:`router.core.dispatchers` holds the built-in ones, :mod:`router.core.slice_dispatch`
the slice one, :mod:`router.core.auto_dispatch` ``auto``, which runs the queue policy's and
the slice one in turn) and built from one :class:`DispatchSetup`.

A dispatcher is pure and synchronous: a driver hands it events and the time
(:meth:`Dispatcher.handle`) and carries out the :class:`Action` list it gets
back. Two drivers exist, one per clock — the router's asyncio driver
(:mod:`router.admission`) and the simulator's virtual-time one
(:mod:`sim.cluster`) — and neither knows which dispatcher it drives: nothing
outside a dispatcher's own module branches on its name.

What a dispatcher may use of the world is the :class:`Fleet` the driver lends
it on every call: the current view, placement, the fleet's metadata, and (for
dispatchers that preempt) stopping a running request.

A placement may be capped (``slice``): its ``DISPATCH`` carries :attr:`Action.cap`, the most new
tokens the leg may generate. A leg that ends at its cap with output left is paused, not finished:
the driver pauses the request (the lifecycle's pause, every token kept), requeues it and hands the
dispatcher a :class:`Paused` event; the next ``DISPATCH`` resumes it after :attr:`Action.tokens`.
A ``DISPATCH`` that :attr:`Action.continues` keeps the paused leg running instead: the next part goes
to the instance the leg runs on, and the engine never sees the boundary (the router lets its leg
run past the cap; the simulator lets the run go on as a decode, with nothing recomputed).

Actions and the queue's membership: ``QUEUED`` says a request started waiting,
``EVICT`` that a running one was stopped and waits again; ``DISPATCH``,
``REFUSE`` and ``LEFT`` say one stopped waiting. A driver's queue-length gauge
is that sum, and nothing else.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fleet.snapshot import ClusterSnapshot
from router.core.columns import ClusterView
from router.core.decision import Decision
from router.core.errors import ConfigError, RouterError
from router.core.plugins import Policy
from router.core.qlm import QlmConfig
from router.core.queue import QueueConfig, RouterQueue
from router.core.registry import Params, Registry
from router.core.request import ScheduleInput, Targets
from router.core.scheduler import Scheduler
from router.core.slicing import SliceConfig

# ---------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class Arrival:
    """A request asks to be placed; ``token`` is the driver's handle for it, returned in every action."""

    request: ScheduleInput
    token: Any = None


@dataclass(frozen=True, slots=True)
class ViewChanged:
    """The cluster view or the in-flight load changed: an instance may take a waiting request now."""


@dataclass(frozen=True, slots=True)
class Completion:
    """A dispatched request ended (``output_tokens``: its whole output; None when it failed or was cancelled)."""

    request_id: str
    output_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Paused:
    """A dispatched request stopped at its :attr:`Action.cap` with output left and waits again.

    ``tokens``: every token it has produced so far (it resumes after them). The driver has paused
    and requeued it (:meth:`router.core.lifecycle.RequestState.pause`) and released its placement.
    """

    request_id: str
    tokens: int


@dataclass(frozen=True, slots=True)
class Preempted:
    """Instance ``instance_id``'s engine preempted a request: its KV over-filled (a dispatcher that
    plans KV learns from it). Sent by a driver that sees its engines' preemptions (the simulator)."""

    instance_id: str


@dataclass(frozen=True, slots=True)
class Cancel:
    """The client gave up on a request that waits (a cancel or its deadline)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Timer:
    """The moment :meth:`Dispatcher.wake_s` asked for has come."""


@dataclass(frozen=True, slots=True)
class Served:
    """How a dispatched request ended against its targets (a dispatcher may steer its shedding by it)."""

    request_id: str
    met: bool
    tpot_ms: float | None = None


Event = Arrival | ViewChanged | Completion | Paused | Preempted | Cancel | Timer | Served


# ---------------------------------------------------------------------- actions


class Outcome(str, enum.Enum):
    """What an :class:`Action` asks the driver to do."""

    #: The request waits now (the driver's queue gauge goes up; it holds the request's handle).
    QUEUED = "queued"
    #: Place the request: ``decision`` is its placement; record it and start it.
    DISPATCH = "dispatch"
    #: Refuse the request: ``error`` (its class is the status code) says why; ``event`` names it for metrics.
    REFUSE = "refuse"
    #: Still waiting, but its TTFT target is out of reach (counted; nothing to do).
    LATE = "late"
    #: A running request was stopped (through :meth:`Fleet.evict`) with ``tokens`` so far and waits again.
    EVICT = "evict"
    #: The request stopped waiting on a cancel (nothing to answer: its client is gone).
    LEFT = "left"


@dataclass(frozen=True, slots=True)
class Action:
    """One thing a driver carries out for request ``request_id`` (see :class:`Outcome`)."""

    outcome: Outcome
    request: ScheduleInput
    token: Any = None
    decision: Decision | None = None
    error: RouterError | None = None
    #: The metrics' name of a refusal or a note: shed, expired, rejected, overlong, refused_early, late, evicted.
    event: str = ""
    #: Time the request waited before this dispatch (s), and whether it left the wait late.
    waited_s: float = 0.0
    late: bool = False
    #: ``EVICT``: the tokens the request has produced so far; ``DISPATCH``: the tokens it resumes after.
    tokens: int = 0
    #: ``DISPATCH``: the most new tokens this placement may generate (0: to the end of the answer).
    #: A leg that reaches it with output left is paused, and the driver sends :class:`Paused`.
    cap: int = 0
    #: ``DISPATCH`` after :class:`Paused`: the next part runs on the instance the paused leg ran on,
    #: and the leg goes on (its KV still there, nothing recomputed, no new leg): only the router's
    #: authorisation moved on by :attr:`cap` tokens.
    continues: bool = False
    #: False for a decision at arrival that never waited (a ``DISPATCH`` or ``REFUSE`` with no
    #: ``QUEUED`` before it): it does not change the number of waiting requests.
    waited: bool = True

    @property
    def request_id(self) -> str:
        return self.request.request_id


# ---------------------------------------------------------------------- what a driver lends


class Fleet(Protocol):
    """The world as a dispatcher may see and touch it, lent by the driver on each call."""

    @property
    def scheduler(self) -> Scheduler: ...

    def view(self) -> ClusterView | ClusterSnapshot:
        """The current view. Called once per attempt: each attempt sees the dispatches before it."""
        ...

    def decide(
        self,
        view: ClusterView | ClusterSnapshot,
        request: ScheduleInput,
        now: float,
        *,
        targets: Targets | None = None,
        policy: Policy | None = None,
    ) -> Decision:
        """One placement decision (:meth:`Scheduler.schedule`'s shape; the driver counts and times it)."""
        ...

    def snapshot(self) -> ClusterSnapshot:
        """The fleet's instances and their metadata (a dispatcher that models instances reads them here)."""
        ...

    def evict(self, request_id: str) -> int | None:
        """Stop running request ``request_id`` now; the tokens it has produced (None: it no longer runs)."""
        ...

    def produced(self, request_id: str) -> int | None:
        """The tokens running request ``request_id`` has produced so far in all (None: unknown)."""
        ...


# ---------------------------------------------------------------------- the protocol


class Dispatcher(Protocol):
    """A waiting/dispatching policy (see the module doc)."""

    #: The registered name.
    name: str
    #: Whether requests ever wait (``none``: a request no instance takes now is refused at once).
    waits: bool
    #: Arrivals at one moment are offered together (one pass per burst, not per arrival): the driver
    #: defers the pass an :class:`Arrival` asks for to the end of the moment.
    coalesce_arrivals: bool

    def handle(self, event: Event, now: float, fleet: Fleet) -> Iterable[Action]:
        """Take ``event`` at ``now`` and return what the driver must do, in order.

        The driver carries out each action before taking the next (a pass may be a generator
        that decides as it goes) and takes them all.

        :class:`Arrival` (unless ``coalesce_arrivals``), :class:`ViewChanged` and :class:`Timer`
        run a pass and may dispatch; :class:`Completion`, :class:`Cancel` and :class:`Served` only
        update the dispatcher's state (the driver follows a completion with a :class:`ViewChanged`
        once the load it frees is gone, coalescing several). A ``DISPATCH`` must be recorded by the
        driver before the next call (the next decision sees it).
        """
        ...

    def wake_s(self) -> float | None:
        """When to send a :class:`Timer` if nothing else happens (None: never)."""
        ...

    def __len__(self) -> int:
        """Requests waiting now."""
        ...

    def refuse_all(self, error: RouterError) -> list[Action]:
        """Every waiting request leaves, refused with ``error`` (shutdown, or a failed pass)."""
        ...

    def shed_limit_ms(self, now: float) -> float | None:
        """The dispatcher's current shedding limit for the metrics (None: it has none)."""
        ...

    def dry_run_queue(self) -> RouterQueue | None:
        """The queue the ``Schedule`` dry run reports a position in (None: it reports none)."""
        ...

    def counters(self) -> dict[str, int]:
        """The dispatcher's own counts for reports (e.g. qlm's plan runs); names are its own."""
        ...


# ---------------------------------------------------------------------- building one


@dataclass(frozen=True)
class DispatchSetup:
    """Everything a dispatcher factory may read."""

    queue: QueueConfig
    #: The router's default targets (ms) for requests that set none.
    default_ttft_ms: float
    default_tpot_ms: float
    qlm: QlmConfig = field(default_factory=QlmConfig)
    #: sa: the annealing's seed, search, and whether its time budget runs on a modeled clock
    #: (the simulator: deterministic) rather than the wall clock.
    seed: int = 0
    sa_search: str = "anneal"
    modeled_clock: bool = False
    #: Incremental dispatch (:class:`router.core.queue.LoadWatch`): a waiting request refused on the
    #: fleet as it is is not offered again until an instance got lighter. ``on``: with the watch's
    #: tolerances (calibration and measured-step jitter); ``exact``: without them; ``off``: the full
    #: pass (the reference the equivalence tests compare with).
    incremental: str = "on"
    #: slice: the slice length and schedule points (``--slice-tokens``, ``--slice-interval-ms``).
    slicing: SliceConfig = field(default_factory=SliceConfig)
    #: The dispatcher's name when it is not the queue policy's (``--dispatch-mode slice`` or ``auto``).
    dispatcher: str = ""


DISPATCHERS: Registry[Dispatcher] = Registry("dispatcher")


def make_dispatcher(setup: DispatchSetup) -> Dispatcher:
    """The dispatcher ``setup.dispatcher`` names, else the one ``setup.queue.queue_policy`` names."""
    name = setup.dispatcher or setup.queue.queue_policy
    flag = "--dispatch-mode" if setup.dispatcher else "--queue-policy"
    if name not in DISPATCHERS:
        raise ConfigError(
            f"{flag} {name!r} is not a registered dispatcher; known: {', '.join(DISPATCHERS.names())}"
        )
    return DISPATCHERS.create(name, setup, Params(f"{flag} {name}"))


def waiting_delta(action: Action) -> int:
    """How ``action`` changes the number of waiting requests (+1, -1 or 0): a driver's queue gauge."""
    if not action.waited:
        return 0
    return _DELTA[action.outcome]


_DELTA = {
    Outcome.QUEUED: +1,
    Outcome.EVICT: +1,
    Outcome.DISPATCH: -1,
    Outcome.REFUSE: -1,
    Outcome.LEFT: -1,
    Outcome.LATE: 0,
}
