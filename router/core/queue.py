"""The router queue: which waiting request goes next, which one is shed, and how much an instance may take.

Pure and synchronous: every method takes ``now_s`` from the caller (the
router's clock, or the simulator's virtual clock). The async waiting lives in
the shell (:mod:`router.admission`); the simulator drives the same object in
virtual time (:mod:`sim.cluster`).

A request that no instance can take now waits here instead of being refused
(``queue_policy`` ``none`` keeps the old instant refusal). Entries are *on
time* (their TTFT target can still be met on the best instance) or *late*
(it cannot; the caller found out by trying). On-time entries are offered to
the scheduler in policy order:

* ``fcfs`` — arrival order;
* ``edf`` — earliest deadline first: the TTFT deadline (arrival + TTFT
  target), or the completion deadline (arrival + e2e target) for a request
  with only an e2e target;
* ``priority`` — higher priority first, then the ``edf`` deadline.

Late entries come after every on-time one, oldest first (``late_policy``
``serve``), or are ended by the caller (``reject``).

Hopeless entries turn late early (:class:`FleetDrain`, :func:`hopeless`):
an offer pass judges each on-time entry, in order, by the time the fleet
needs to prefill what is queued in front of it — on top of the backlog the
engines already hold, at the fleet's full prefill rate, and no faster than the
queue actually drained over the last ``drain_window_ms`` — plus its own
prefill on an idle instance. When that misses its TTFT target (or its e2e
target, with the fastest decode step for the remaining tokens), it is late at
once instead of when its deadline passes: ``reject`` refuses it then, ``serve``
moves it behind the on-time entries at once. Every pass judges the entries it
offers and the ones queued since the last full scan (so a newcomer is judged
on arrival wherever it lands); every entry is judged at least every
:data:`SCAN_INTERVAL_S`.

Under ``priority``, release control is per priority: a request counts only
the entries and arrivals of its priority or higher, and yields to higher
priorities (at most ``priority_headroom`` × their tightest target). Under
``edf`` a request whose TTFT target is looser than the tightest recent one
yields the same way: urgency stands in for priority.

Release control (:meth:`RouterQueue.release_limit_ms`): an instance is offered
work only while its predicted TTFT for the next request stays under the
tightest TTFT budget among the on-time entries and the targets of the last
``release_window_requests`` arrivals. So once the fleet is loaded past that
budget, loose requests wait here (in deadline order) instead of in an engine's
FCFS waiting list, and a tight request arriving later still finds short engine
queues: the queue, not the engines, decides the order. The margins it keeps for
tighter traffic are measured against the predictions themselves, so they must
not stack on top of one another: a long prompt that yields takes a nearly idle
instance while another prefill instance stays within the limit (not only
while two are idle), and late or yielding work keeps its own TPOT target but
takes only placements that pass every filter (on neutral instances it keeps
clear of the target instead; see :func:`offer`).

Margin waiver (:attr:`~router.core.request.Targets.margin_waived`, which ``binpack``'s constraints
read): a request judged by its e2e deadline alone that has waited its hold, :data:`PACE_HOLD_SHARE`
of the TTFT target its deadline gives it, is offered with its own deadline's pace waived while no
request judged by a TTFT or TPOT target waits here (on time or late): such requests are the work the
room that pace held is wanted for, and one that has to wait says the fleet has none to spare. A
request judged by a TTFT target is offered without θ's margin once what its target leaves it to wait
at best (what is left of it less its prefill on an idle instance) is at most that share of it.

Shedding (:meth:`RouterQueue.push` on a full queue): the least valuable entry
goes: lowest priority, then late before on-time, then the one with the most
slack (latest deadline), then the newest. It may be the newcomer.
"""

from __future__ import annotations

import bisect
import enum
import math
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Protocol

import numpy as np

from fleet.snapshot import ClusterSnapshot
from router.core.calibration import Correction
from router.core.chain import EXCLUDED, StageFailure
from router.core.columns import BoolArray, ClusterView, FloatArray, InstanceTable, IntArray
from router.core.decision import Decision
from router.core.errors import (
    ConfigError,
    EmptyClusterError,
    LateError,
    NoInstanceError,
    QueueTimeoutError,
    SchedulingError,
    ShedError,
)
from router.core.flagged import FlagFields
from router.core.metrics import advanced_backlog
from router.core.plugins import Policy
from router.core.prefix import PrefixSource, best_cached_tokens
from router.core.request import Mode, Role, ScheduleInput, Stage, Targets, resolve_targets
from router.core.scheduler import Scheduler

#: Queue objective g: the shedding limit's range (ms of predicted remaining latency; at the ceiling
#: nothing is shed), its factor per miss, the served requests whose TPOT estimates the decode time, and
#: the most refused ids remembered.
SHED_LIMIT_CEILING_MS = 120_000.0
SHED_LIMIT_FLOOR_MS = 250.0
SHED_DOWN = 0.9
TPOT_WINDOW = 256
SHED_IDS_MAX = 1_000_000
#: Queue objective g sheds nothing once no request has missed its SLO for this long (s).
SHED_MEMORY_S = 10.0

#: How often (s) an offer pass judges every on-time entry for hopelessness, not only those it offers
#: and those queued since the last scan (a full scan costs a few microseconds per entry).
SCAN_INTERVAL_S = 0.1

#: The share of its (derived) TTFT target a request judged by its e2e deadline alone waits in the queue
#: before it is offered with its own pace waived (:attr:`~router.core.request.Targets.margin_waived`),
#: while no TPOT-judged request waits; and the share a request judged by a TTFT target may still wait
#: at best before it is offered without θ's margin: half, as an empty P/D prefill instance holds a
#: request before it opens as a new bin (``binpack_prefill_empty_bin_wait``'s default).
PACE_HOLD_SHARE = 0.5

#: The default ``late_allowance``: under ``late_policy=serve`` a late request is served only while
#: its first token can still come within this many of its targets past its deadline (TTFT; e2e for a
#: request judged by that alone); it is refused (``LateError``) once no placement is in sight by then
#: (see :func:`offer`), and at that moment at the latest. Holding it longer served nobody: it is a
#: miss either way, a queue full of late requests stayed behind every on-time one until the arrivals
#: stopped (first tokens 30-60 s late), and placing them sooner took the room of on-time ones.
LATE_ALLOWANCE = 1.0


class QueuePolicy(str, enum.Enum):
    """How waiting requests are ordered (``none``: nothing waits; a request no instance takes is refused)."""

    NONE = "none"
    FCFS = "fcfs"
    EDF = "edf"
    PRIORITY = "priority"
    #: Request groups over per-instance virtual queues, with eviction (:mod:`router.core.qlm`, driven by
    #: the `qlm` dispatcher of :mod:`router.core.dispatchers`); :class:`RouterQueue` is not used then.
    QLM = "qlm"
    #: Simulated-annealing priority mapping per instance (seed 000; :mod:`router.core.sa`).
    SA = "sa"


class LatePolicy(str, enum.Enum):
    """What happens to a queued request that can no longer meet its TTFT target on any instance."""

    SERVE = "serve"
    REJECT = "reject"


class Objective(str, enum.Enum):
    """What the queue spends an overloaded fleet on (see :func:`worth_waiting`)."""

    #: Every request that can still meet its targets waits for its turn.
    ATTAINMENT = "attainment"
    #: Seed 000's G: while requests miss their SLO, the longest ones are refused at once.
    G = "g"


def _doc(doc: str, flag: str) -> dict[str, Any]:
    return {"doc": doc, "flag": flag}


@dataclass(frozen=True)
class QueueConfig(FlagFields):
    """The router queue's knobs (flags of ``slo-router router``/``up``; ``simulate`` takes the policy per run)."""

    FLAG_CHOICES: ClassVar[dict[str, list[str]]] = {
        "queue_policy": [p.value for p in QueuePolicy],
        "late_policy": [p.value for p in LatePolicy],
        "queue_objective": [o.value for o in Objective],
    }

    queue_policy: str = field(
        default="edf",
        metadata=_doc(
            "order of requests waiting in the router: none (refuse at once), fcfs, edf, priority, qlm "
            "(seed 004: request groups and virtual queues pulled by KV room, with eviction; for e2e "
            "deadlines under overload, on neutral instances (on a KV-limited fleet edf, which keeps its KV "
            "promise, is ahead); TTFT-judged streams "
            "beside them keep their room and chat alone is even with edf; below overload, where edf already "
            "meets nearly every deadline, it gains nothing and may lose a point or three; its eviction pays where "
            "long batch jobs hold every sequence of an engine while short deadline work arrives; beside "
            "long-prompt TTFT-judged streams past capacity it trades an e2e class for the streams and stays behind edf, by 4.5 "
            "points on the Mooncake conversation trace with long prompts judged e2e and 5.0 on 4 instances (use edf "
            "there); far past capacity with prompts of 8k-100k tokens judged e2e (edf meeting about half) it serves late "
            "work edf refuses at --max-queue-wait-ms, which the virtual queues do not apply, and is 8-14 points behind "
            "edf (use edf there); --qlm-*) or sa (seed 000: waiting requests dealt by deadline to the instance with the "
            "most KV memory left and ordered per instance by simulated annealing of G, handed to an "
            "engine as its slots free; for bursts of mixed-SLO work on engines that run one or two "
            "sequences at a time; not for engines of four or more: it gains nothing at light load and loses to "
            "edf at and past capacity (use edf there); a batch it starts together goes out first-token-judged "
            "requests first, which helps a short-prompt TTFT class beside long prompts only where the engine "
            "starts its step at the first request that reaches it idle (an engine that takes the batch into one "
            "step prefills them together); --sa-*)",
            "--queue-policy",
        ),
    )
    max_queue_size: int = field(
        default=4096,
        metadata=_doc(
            "most requests waiting in the router; a full queue sheds the least valuable", "--max-queue-size"
        ),
    )
    max_queue_wait_ms: float = field(
        default=60000.0,
        metadata=_doc(
            "a request waiting longer than this (ms) is refused with RESOURCE_EXHAUSTED (qlm's virtual queues "
            "keep a request until its deadline plus --late-allowance of its target instead)",
            "--max-queue-wait-ms",
        ),
    )
    late_policy: str = field(
        default="serve",
        metadata=_doc(
            "a queued request that can no longer meet its TTFT target: serve it best-effort while its first "
            "token can still come within --late-allowance, else refuse it then (DEADLINE_EXCEEDED), or "
            "reject it at once (DEADLINE_EXCEEDED)",
            "--late-policy",
        ),
    )
    late_allowance: float = field(
        default=LATE_ALLOWANCE,
        metadata=_doc(
            "--late-policy serve (qlm's virtual queues too): a late request is served only while its first token can still come within "
            "this many of its targets past its deadline (its TTFT target; its e2e target for a request with "
            "only that); it is refused as soon as the queue's best case says it cannot, and when that time "
            "is up (ratio; a large value waits up to --max-queue-wait-ms)",
            "--late-allowance",
        ),
    )
    queue_objective: str = field(
        default="attainment",
        metadata=_doc(
            "what an overloaded fleet is spent on: attainment (every request that can still meet its targets "
            "waits its turn) or g (seed 000's G, SLO-meeting requests per second of summed latency: while more "
            "than --shed-miss-target of the requests miss their SLO, the queue refuses at once the requests "
            "with the longest predicted remaining latency, and refuses late ones)",
            "--queue-objective",
        ),
    )
    shed_miss_target: float = field(
        default=0.05,
        metadata=_doc(
            "queue objective g: the longest requests are refused while more than this fraction of the "
            "requests that were not refused that way miss their SLO (ratio)",
            "--shed-miss-target",
        ),
    )
    release_window_requests: int = field(
        default=64,
        metadata=_doc(
            "release control: the tightest TTFT target among this many latest arrivals caps what an "
            "instance is offered (requests; 0 = queued requests only)",
            "--release-window-requests",
        ),
    )

    drain_window_ms: float = field(
        default=10000.0,
        metadata=_doc(
            "hopeless requests turn late at once when the work queued in front of them, at the rate the "
            "queue drained over up to this window while it held on-time requests, already misses their "
            "target (ms; 0 = only at the fleet's full prefill rate)",
            "--drain-window-ms",
        ),
    )

    priority_headroom: float = field(
        default=0.5,
        metadata=_doc(
            "a request yielding to more important traffic (higher priority under the priority policy; "
            "any on-time request when it is late) goes only where the predicted TTFT stays under this "
            "fraction of that traffic's tightest target (ratio)",
            "--priority-headroom",
        ),
    )

    # The sa policy (router/core/sa.py): the paper's schedule (500, 100 moves per level, 0.95, 20:
    # 6300 moves) in per mille of the starting plan's G. A run that cannot afford it within the
    # budget keeps the temperatures and takes fewer moves per level (see docs/user-guide.md, the sa section).
    sa_initial_temperature: float = field(
        default=500.0,
        metadata=_doc(
            "sa: initial annealing temperature (per mille of the starting plan's G)",
            "--sa-initial-temperature",
        ),
    )
    sa_iterations: int = field(
        default=100,
        metadata=_doc("sa: moves tried per temperature level", "--sa-iterations"),
    )
    sa_decay: float = field(
        default=0.95,
        metadata=_doc("sa: the temperature is multiplied by this after each level (ratio)", "--sa-decay"),
    )
    sa_min_temperature: float = field(
        default=20.0,
        metadata=_doc("sa: annealing stops below this temperature", "--sa-min-temperature"),
    )
    sa_budget_ms: float = field(
        default=0.8,
        metadata=_doc(
            "sa: time budget of one planning run (ms); a run that cannot afford the whole schedule takes fewer moves per temperature",
            "--sa-budget-ms",
        ),
    )
    sa_pool_ms: float = field(
        default=25.0,
        metadata=_doc(
            "sa: the request pool: requests are planned once no request has joined the pool for this long "
            "(at the latest 10x this after its oldest), so a burst whose requests arrive a few ms apart is "
            "planned as one (ms; 0 = plan at once); a request arriving alone, this long after the one before, "
            "is planned at once while the fleet has a free slot besides the one it takes, unless it is judged "
            "end to end only",
            "--sa-pool-ms",
        ),
    )
    sa_max_batch: int = field(
        default=0,
        metadata=_doc(
            "sa: requests the policy keeps running on an instance at once (the paper's maximum batch size; "
            "set it to the engines' max_num_seqs): the next planned request goes as soon as one ends "
            "(0 = the engine's max_num_seqs as its instance reports it, else bounded by KV memory only); on a "
            "disaggregated fleet a prefill instance runs its share of the decoders' slots",
            "--sa-max-batch",
        ),
    )

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ConfigError:
            return ConfigError(f"{name}={getattr(self, name)!r}: {why}")

        if not 0 < self.priority_headroom <= 1:
            raise bad("priority_headroom", "must be within (0, 1]")
        if self.queue_policy not in {p.value for p in QueuePolicy}:
            raise bad("queue_policy", f"must be one of {', '.join(p.value for p in QueuePolicy)}")
        if self.late_policy not in {p.value for p in LatePolicy}:
            raise bad("late_policy", f"must be one of {', '.join(p.value for p in LatePolicy)}")
        if self.queue_objective not in {o.value for o in Objective}:
            raise bad("queue_objective", f"must be one of {', '.join(o.value for o in Objective)}")
        if self.queue_objective == Objective.G.value and self.queue_policy not in (
            QueuePolicy.FCFS.value,
            QueuePolicy.EDF.value,
            QueuePolicy.PRIORITY.value,
        ):
            raise bad(
                "queue_objective",
                "g needs a router queue that offers requests in order: fcfs, edf or priority",
            )
        if not 0.001 <= self.shed_miss_target <= 0.5:
            raise bad("shed_miss_target", "must be within 0.001..0.5")
        if not 1 <= self.max_queue_size <= 1_000_000:
            raise bad("max_queue_size", "must be within 1..1000000 requests")
        if not (self.max_queue_wait_ms > 0 and math.isfinite(self.max_queue_wait_ms)):
            raise bad("max_queue_wait_ms", "must be a finite number of ms > 0")
        if not 0 <= self.release_window_requests <= 100_000:
            raise bad("release_window_requests", "must be within 0..100000")
        if not 0 < self.sa_initial_temperature <= 1e9:
            raise bad("sa_initial_temperature", "must be within (0, 1e9]")
        if not 0 < self.sa_min_temperature <= self.sa_initial_temperature:
            raise bad("sa_min_temperature", "must be > 0 and at most sa_initial_temperature")
        if not 0 < self.sa_decay < 1:
            raise bad("sa_decay", "must be within (0, 1)")
        if not 1 <= self.sa_iterations <= 1_000_000:
            raise bad("sa_iterations", "must be within 1..1000000")
        if not 0 < self.sa_budget_ms <= 10_000:
            raise bad("sa_budget_ms", "must be within (0, 10000] ms")
        if not 0 <= self.sa_pool_ms <= 10_000:
            raise bad("sa_pool_ms", "must be within 0..10000 ms")
        if not 0 <= self.sa_max_batch <= 1024:
            raise bad("sa_max_batch", "must be within 0..1024 requests")
        if not 0 <= self.drain_window_ms <= 3_600_000:
            raise bad("drain_window_ms", "must be within 0..3600000 ms")
        if not 0 <= self.late_allowance <= 1_000_000:
            raise bad("late_allowance", "must be within 0..1000000 (a ratio of the request's target)")

    @property
    def policy(self) -> QueuePolicy:
        return QueuePolicy(self.queue_policy)

    @property
    def late(self) -> LatePolicy:
        return LatePolicy(self.late_policy)

    @property
    def objective(self) -> Objective:
        return Objective(self.queue_objective)


@dataclass(eq=False)
class QueueEntry:
    """One waiting request. ``late`` flips once the caller finds its TTFT target out of reach."""

    request: ScheduleInput
    #: Arrival order at the queue (ties and FCFS).
    seq: int
    enqueued_s: float
    #: The EDF deadline (s): TTFT deadline, or completion deadline for an e2e-only request.
    deadline_s: float
    #: Arrival + the whole TTFT target (s).
    ttft_deadline_s: float
    late: bool = False
    #: Opaque slot for the caller (the shell's future, the simulator's index).
    token: Any = None
    #: Its last failed placement attempt (see :class:`Refusal`), or None.
    refusal: Refusal | None = None
    #: The prompt tokens it must prefill at best (:meth:`RouterQueue.work_tokens`; -1: not known yet).
    work: int = -1
    #: Late under ``late_policy=serve``: the moment (s) past which it is refused rather than served
    #: (``QueueConfig.late_allowance``; inf: not late, or late without such a moment).
    late_until_s: float = math.inf

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(frozen=True, slots=True)
class Refusal:
    """A queued entry's failed placement attempt, kept so the next pass repeats it only if it could succeed.

    ``epoch`` is the :class:`LoadWatch` epoch of the fleet it failed on, ``at_ms`` when (ms on the
    caller's clock), ``bound_ms`` the TTFT bound it was offered (ms from then), ``late`` /
    ``yielding`` how it was offered (see :func:`offer`). The predicted TTFT (the best over the
    instances, NaN when the miss did not say) and the error are those of the failed decision (a
    skipped attempt reports them again).
    """

    epoch: int
    at_ms: float
    bound_ms: float
    late: bool
    yielding: bool
    predicted_ttft_ms: float = math.nan
    error: SchedulingError | None = None
    #: With prefix-aware placement: the prompt blocks each instance's cache held for it then.
    matched: Mapping[str, int] | None = None
    #: Whether the TTFT bound played no part in the failure (see :func:`bound_free`): a looser
    #: bound in the same epoch fails too, while the calibration is still at version ``calibration``.
    bound_free: bool = False
    calibration: int = -1
    #: Set when every candidate fell to the TTFT or the TPOT threshold (see :class:`ThresholdHold`).
    hold: ThresholdHold | None = None
    #: Whether it was offered without packing's margin (see :meth:`RouterQueue.margin_waived`).
    waived: bool = False

    def holds(
        self,
        epoch: int,
        now_ms: float,
        bound_ms: float,
        late: bool,
        yielding: bool,
        matched: Mapping[str, int] | None,
        calibration: int = -1,
        waived: bool = False,
    ) -> bool:
        """Whether an attempt at ``now_ms`` with TTFT bound ``bound_ms`` is certain to fail again.

        In the same load epoch every instance's predicted free moment is where it was or later
        (:class:`LoadWatch`), so a prediction of TTFT from now falls by at most the time that
        passed. The attempt fails again if its bound, as a moment, is no later than the one that
        failed (``now + bound <= at + bound then``: a release limit of fixed length is a later
        moment as time passes, and may let it through), or if the best TTFT predicted then, less
        the time since, is still over the bound now: the moment the entry could first fit is its
        own wake-up, and no pass offers it before. A failure the bound played no part in
        (:attr:`bound_free`) fails again whatever the bound now, if the calibration (``calibration``:
        its version now) did not move: that shortcut takes no tolerance (the epoch lets a
        calibration change wait :data:`CALIBRATION_EPOCH_S`, which a re-decision on a looser bound
        would otherwise catch).
        """
        if epoch != self.epoch or late != self.late or yielding != self.yielding or waived != self.waived:
            return False
        same_or_tighter = (self.bound_free and calibration == self.calibration) or (
            now_ms + bound_ms <= self.at_ms + self.bound_ms
        )
        best = self.predicted_ttft_ms
        too_slow = best == best and best - (now_ms - self.at_ms) > bound_ms
        if not (same_or_tighter or too_slow):
            return False
        if matched is None:
            return True
        # A cache that now holds more of its prompt somewhere makes that instance faster for it.
        before = self.matched or {}
        return all(n <= before.get(instance_id, 0) for instance_id, n in matched.items())


#: Time a prefill instance's predicted free moment may move earlier (ms) and still count as the
#: same load: the step model's own rounding (see :class:`LoadWatch`).
FREE_AT_TOLERANCE_MS = 1e-6


#: Relative fall of an instance's measured decode step that counts as lighter (see :class:`LoadWatch`).
MEASURED_TOLERANCE = 0.02


#: Least time between two moves of a :class:`LoadWatch` epoch for a changed calibration (s). The
#: calibration is fed on every status and moves a little each time, both ways; a refused request
#: that only a faster calibration lets through is tried again within this long. (Every change moving
#: the epoch made nearly every pass a new epoch.)
CALIBRATION_EPOCH_S = 0.25


class LoadWatch:
    """Tells when the fleet got lighter somewhere: the epoch a refused entry must see change to be tried again.

    Incremental dispatch. A placement that failed failed on load: every instance was too loaded for
    the entry's targets (its TTFT bound, its TPOT, KV), or took it only on a fallback pass that a
    late or yielding entry may not use. The decision is monotone in both: more load on any instance
    (more decode requests or tokens, more KV, more queued or in-flight work, a status gone stale)
    never lets a refused request through, and neither does a tighter target. So an entry refused at
    epoch ``e`` with bound ``b`` is certain to be refused again while the epoch is still ``e`` and its
    bound is at most ``b`` (:meth:`Refusal.holds`): the pass counts it as refused without a decision.

    What moves the epoch: any per-instance load column (the status's decode requests and tokens, KV
    used, waiting and running requests, measured decode step, preempting flag, and every in-flight
    column, residents included) lower than the heaviest seen since the last move; an instance turning
    schedulable or reporting; the instance set changing; the calibration changing, at most every
    :data:`CALIBRATION_EPOCH_S`; and a prefill instance whose *predicted free moment* (now + the time to prefill its
    backlog, advanced and in flight, at its calibrated rate: :class:`FleetDrain`) came earlier.

    Why the free moment, not the backlog's tokens: the router advances a status's backlog by the step
    model as the status ages, so the backlog in tokens falls with every step and every millisecond
    while nothing has changed. A request's predicted TTFT on an instance is (free moment - now) plus
    its own prefill, and its TTFT budget is (deadline - now): both fall by the time that passed, so a
    request that missed on an instance whose free moment did not move still misses. Targets that only
    tighten with time (the TTFT budget, an e2e deadline's pace) keep the bound at most what it was;
    what loosens a bound (the release limit rising as a tight entry leaves, a calibration moving the
    idle-prefill floor) is caught by comparing bounds or by the calibration's version.

    Prefix-aware placement adds one way to get lighter that is the request's own: a dispatch warms a
    cache, and an instance that now holds more of its prompt prefills it faster. A refusal keeps the
    blocks each instance held of the entry's prompt (:attr:`Refusal.matched`) and holds only while
    none holds more.
    """

    __slots__ = ("_base", "_calibration", "calibration_epoch_s", "epoch", "measured_tolerance", "moves")

    def __init__(
        self, calibration_epoch_s: float = CALIBRATION_EPOCH_S, measured_tolerance: float = MEASURED_TOLERANCE
    ) -> None:
        #: The two tolerances (0 and 0: every change that could let a request through moves the epoch).
        self.calibration_epoch_s = calibration_epoch_s
        self.measured_tolerance = measured_tolerance
        self.epoch = 0
        #: The calibration's version at the last move it caused, and when.
        self._calibration: tuple[int, float] = (-1, -math.inf)
        #: Moves of the epoch, by reason (for reports and tests).
        self.moves: dict[str, int] = {}
        self._base: tuple[Any, FloatArray, FloatArray, FloatArray] | None = None

    def _move(self, why: str, base: tuple[Any, FloatArray, FloatArray, FloatArray] | None) -> int:
        self.epoch += 1
        self.moves[why] = self.moves.get(why, 0) + 1
        self._base = base
        return self.epoch

    def invalidate(self) -> None:
        """Something the watch cannot see changed (a placement policy's state): every entry is tried again."""
        self._move("other", None)

    def observe(self, scheduler: Scheduler, view: ClusterView, now_s: float) -> int:
        """The epoch for the fleet of ``view`` at ``now_s`` (moved if it is lighter anywhere than before)."""
        table = view.instances
        key = table.ids
        inflight = view.inflight
        cap = table.max_num_seqs
        # Where no instance is at its sequence cap the decisions read waiting and running requests
        # only as their sum (a request moving from waiting to running is no lighter load); at the
        # cap, more of them running means shorter slot waits (metrics.slot_wait): each counts.
        at_cap = cap is not None and bool(
            (table.waiting_requests + table.running_requests + inflight.requests + 1.0 > cap).any()
        )
        status, measured = _status_signature(table, at_cap)
        load = np.concatenate((status, inflight.matrix))
        drain = FleetDrain.of(scheduler, view, now_s)
        if drain is None:
            free_at = table.uncomputed_prefill_tokens + view.inflight.prefill_tokens
        else:
            free_at = np.full(table.n, now_s * 1e3)
            free_at[drain.prefill_index] += drain.free_by_index
        # The measured decode step moves with every step; it matters only against a TPOT threshold
        # (metrics.overpacked), so only a fall by more than MEASURED_TOLERANCE counts.
        signature = (key, free_at, load, measured)
        predictors = scheduler.predictors
        calibration = None if predictors is None else predictors.calibration
        if (
            calibration is not None
            and calibration.version != self._calibration[0]
            and now_s - self._calibration[1] >= self.calibration_epoch_s
        ):
            self._calibration = (calibration.version, now_s)
            return self._move("calibration", signature)
        base = self._base
        if base is None or base[0] != key:
            return self._move("fleet", signature)
        if load.shape != base[2].shape:
            return self._move("fleet", signature)
        lighter = (load < base[2]).any(axis=1)
        if lighter.any():
            return self._move(f"load{int(np.flatnonzero(lighter)[0])}", signature)
        if (free_at < base[1] - FREE_AT_TOLERANCE_MS).any():
            return self._move("prefill", signature)
        if (measured < base[3] * (1.0 - self.measured_tolerance)).any():
            return self._move("step", signature)
        # Not lighter anywhere: compare the next view with the heaviest of the two (so small moves
        # within the tolerance cannot add up unseen).
        self._base = (
            key,
            np.maximum(base[1], free_at),
            np.maximum(base[2], load),
            np.maximum(base[3], measured),
        )
        return self.epoch


def _status_signature(table: InstanceTable, at_cap: bool) -> tuple[FloatArray, FloatArray]:
    """The rows of :meth:`LoadWatch.observe`'s load that are the statuses' (every row but the
    in-flight matrix), and the measured decode step with NaN as 0: built once per instance table.

    A table is one snapshot's (its columns are read-only), while the view it is part of is rebuilt
    after every dispatch (a new in-flight account): a burst on one snapshot, whose every arrival
    runs a pass when the queue is empty, reads the same status rows each time. Kept in the table's
    ``memo`` (bounded by the table's life; the two shapes of the request rows, at the sequence cap
    or not, are two entries), read-only.
    """
    memo_key = ("queue_load_watch_status", at_cap)
    found: tuple[FloatArray, FloatArray] | None = table.memo.get(memo_key)
    if found is not None:
        return found
    zeros = np.zeros(table.n)
    step = table.measured_decode_step_ms
    measured = zeros if step is None else np.nan_to_num(step, nan=0.0)
    total = table.waiting_requests + table.running_requests
    requests: tuple[FloatArray, ...] = (total,)
    if at_cap:
        requests = (total, table.waiting_requests, -table.running_requests)
    status = np.vstack(
        (
            table.decode_requests,
            table.decode_tokens,
            table.used_kv_tokens,
            *requests,
            zeros if table.preempting is None else table.preempting,
            -table.schedulable.astype(np.float64),
            -table.has_status.astype(np.float64),
        )
    )
    status.setflags(write=False)
    measured.setflags(write=False)
    table.memo[memo_key] = (status, measured)
    return status, measured


class _Sorted:
    """Keys kept sorted (bisect); membership by exact key."""

    __slots__ = ("keys",)

    def __init__(self) -> None:
        self.keys: list[tuple[Any, ...]] = []

    def add(self, key: tuple[Any, ...]) -> None:
        bisect.insort(self.keys, key)

    def discard(self, key: tuple[Any, ...]) -> None:
        i = bisect.bisect_left(self.keys, key)
        if i < len(self.keys) and self.keys[i] == key:
            del self.keys[i]

    def rank(self, key: tuple[Any, ...]) -> int:
        return bisect.bisect_left(self.keys, key)


class DispatchLog:
    """(time, prompt tokens) of a queue's dispatches over its drain window, with running sums.

    The drain rate asks for the tokens dispatched since a moment on every queue pass; walking the
    window's dispatches for it took a fifth of the router's CPU with short requests at a high
    rate. Times come in order (the caller's clock), so the answer is one bisect and a difference
    of running sums (integers: the same sum as the walk).
    """

    __slots__ = ("_base", "_cums", "_head", "_times", "_total")

    def __init__(self) -> None:
        self._times: list[float] = []
        self._cums: list[int] = []  # tokens of every dispatch up to and including this one
        self._head = 0  # the first entry still in the window
        self._base = 0  # the running sum before the first entry kept in the lists
        self._total = 0

    def add(self, now_s: float, tokens: int, cutoff_s: float) -> None:
        """Record a dispatch at ``now_s`` and forget those before ``cutoff_s``."""
        self._total += tokens
        times = self._times
        times.append(now_s)
        self._cums.append(self._total)
        head = self._head
        while head < len(times) and times[head] < cutoff_s:
            head += 1
        if head > 64 and 2 * head > len(times):  # drop the forgotten ones now and then (amortized O(1))
            self._base = self._cums[head - 1]
            del times[:head], self._cums[:head]
            head = 0
        self._head = head

    def tokens_since(self, start_s: float) -> int:
        """Prompt tokens of the dispatches at or after ``start_s`` still in the window."""
        i = bisect.bisect_left(self._times, start_s, self._head)
        if i == 0:
            return self._total - self._base
        return self._total - self._cums[i - 1]

    def __len__(self) -> int:
        return len(self._times) - self._head


class RouterQueue:
    """Waiting requests under one :class:`QueueConfig` (see the module doc).

    ``default_ttft_ms`` / ``default_tpot_ms`` are the scheduler's defaults
    (deadlines of requests without their own targets). Not thread-safe; every
    method is O(log n) plus a list shift, except shedding's O(log n) too.
    """

    def __init__(
        self,
        config: QueueConfig,
        default_ttft_ms: float,
        default_tpot_ms: float,
        planner: Planner | None = None,
    ) -> None:
        if config.policy is QueuePolicy.QLM:
            raise ConfigError("queue_policy='qlm' is served by router.core.qlm.QlmQueue, not RouterQueue")
        self.config = config
        self.policy = config.policy
        self.default_ttft_ms = default_ttft_ms
        self.default_tpot_ms = default_tpot_ms
        self._entries: dict[str, QueueEntry] = {}
        self._order = _Sorted()  # on-time entries, policy order
        self._late = _Sorted()  # late entries, by seq
        self._value = _Sorted()  # every entry, least valuable first
        self._budgets = _Sorted()  # on-time entries by TTFT deadline
        self._waits = _Sorted()  # every entry by enqueue time
        self._late_until = _Sorted()  # late entries with a finite late_until_s, by it
        # (full TTFT target, priority, request id) of the latest arrivals.
        self._recent: deque[tuple[float, int, str]] = deque(maxlen=max(config.release_window_requests, 1))
        #: The window's sliding minimum: (arrival number, target) of the arrivals in ``_recent`` that no
        #: later arrival's target is below, oldest first, so targets never fall along it and its head
        #: is the window's first tightest target: exactly ``min()`` over the window, kept in O(1) per
        #: arrival (every pass asks for it, and walking the window for it was a pass's largest loop;
        #: with equal targets the oldest left the window with each arrival, so the walk ran every pass).
        self._minima: deque[tuple[int, float]] = deque()
        #: Arrivals noted so far (numbers the entries of ``_minima``); ``_recent[0]`` is arrival
        #: ``_arrivals - len(_recent)``.
        self._arrivals = 0
        # Under the priority policy: on-time TTFT deadlines per priority.
        self._budgets_by_priority: dict[int, _Sorted] = {}
        self._seq = 0
        # Waiting entries (on time or late) judged by a TTFT or TPOT target, not by an e2e deadline
        # alone (see margin_waived): only whether any waits is read, so no order is kept.
        self._streams: set[str] = set()
        #: The sa policy's planner (:class:`router.core.sa.SAPlanner`; None under the other policies).
        self.planner = planner
        #: Waiting entries :func:`offer` found refused again by a :class:`ThresholdHold`, without a decision.
        self.held = 0
        #: The router's knowledge of the instances' prefix caches (None: off), set by :func:`offer`:
        #: what the work queued in front of a request costs (:meth:`work_tokens`).
        self.prefix: PrefixSource | None = None
        if self.policy is QueuePolicy.SA and planner is None:
            raise ConfigError("queue_policy='sa' needs a planner: pass router.core.sa.SAPlanner(config)")
        # The queue's own drain, measured only while the fleet limited it (see note_pass): (time,
        # prompt tokens) of the dispatches that ended such a stretch, and (time, µs) of the stretches.
        self._dispatched = DispatchLog()
        self._dispatched_entries = DispatchLog()  # the same dispatches, one "token" each
        self._limited = DispatchLog()
        # The end of the last offer pass, when the fleet alone kept on-time entries waiting then.
        self._limited_at: float | None = None
        # Whether the dispatches of the pass running now end such a stretch (they count in the rate).
        self._counting = False
        # The last full hopeless scan of the queue (see offer): the push count then and when.
        self._scanned_at = -math.inf
        # Requests queued since the last full scan (judged on their own until the next one).
        self._fresh: list[str] = []
        # Queue objective g: the shedding limit (ms of predicted remaining latency), the requests it
        # refused (their outcomes do not steer it), and the latest measured TPOTs with their sum.
        self._shed_limit_ms = SHED_LIMIT_CEILING_MS
        self._last_miss_s = -math.inf
        self._shed_ids: set[str] = set()
        self._tpots: deque[float] = deque()
        self._tpot_sum_ms = 0.0

    # ------------------------------------------------------------------ queue objective g

    def note_outcome(self, request_id: str, met: bool, now_s: float, tpot_ms: float | None = None) -> None:
        """Request ``request_id`` ended (served, refused or failed); ``met``: it met every target of its
        SLO; ``tpot_ms``: its measured time per output token, when it streamed two or more tokens.

        Under queue objective g this steers the shedding limit (:meth:`shed_limit_ms`): a miss lowers it
        by :data:`SHED_DOWN`, a met request raises it by just enough that the limit holds still when
        ``shed_miss_target`` of the outcomes miss. Requests the limit refused do not count (they would
        justify their own refusal). ``now_s``: when it ended (the limit lapses :data:`SHED_MEMORY_S`
        after the last miss). Other objectives keep nothing.
        """
        if self.config.objective is not Objective.G:
            return
        if request_id in self._shed_ids:
            self._shed_ids.discard(request_id)
            return
        if tpot_ms is not None and math.isfinite(tpot_ms) and tpot_ms >= 0:
            self._tpots.append(float(tpot_ms))
            self._tpot_sum_ms += float(tpot_ms)
            if len(self._tpots) > TPOT_WINDOW:
                self._tpot_sum_ms -= self._tpots.popleft()
        m = self.config.shed_miss_target
        if met:
            up = math.exp(m / (1.0 - m) * -math.log(SHED_DOWN))
            self._shed_limit_ms = min(SHED_LIMIT_CEILING_MS, self._shed_limit_ms * up)
        else:
            self._shed_limit_ms = max(SHED_LIMIT_FLOOR_MS, self._shed_limit_ms * SHED_DOWN)
            self._last_miss_s = max(self._last_miss_s, now_s)

    def shed_limit_ms(self, now_s: float) -> float:
        """Queue objective g: requests predicted to need longer than this (ms) to finish are refused
        (``inf``: none are; under another objective, at the ceiling, or when no request missed its SLO
        in the last :data:`SHED_MEMORY_S`, so a fleet whose overload ended sheds nothing at once)."""
        if (
            self.config.objective is not Objective.G
            or self._shed_limit_ms >= SHED_LIMIT_CEILING_MS
            or now_s - self._last_miss_s > SHED_MEMORY_S
        ):
            return math.inf
        return self._shed_limit_ms

    def lowest_priority(self) -> int:
        """The lowest priority queued or among the latest arrivals (0 when there is neither)."""
        queued = int(self._value.keys[0][0]) if self._value.keys else None
        recent = min((p for _, p, _ in self._recent), default=None)
        candidates = [p for p in (queued, recent) if p is not None]
        return min(candidates) if candidates else 0

    def note_shed(self, request_id: str) -> None:
        """``request_id`` was refused by the shedding limit (its outcome will not steer the limit)."""
        if len(self._shed_ids) >= SHED_IDS_MAX:  # outcomes never reported (a bug in the caller): forget
            self._shed_ids.clear()
        self._shed_ids.add(request_id)

    def decode_ms_per_token(self) -> float | None:
        """Mean measured TPOT of the latest :data:`TPOT_WINDOW` served requests (ms); ``None`` before any."""
        return self._tpot_sum_ms / len(self._tpots) if self._tpots else None

    def finished(self, request_id: str, output_tokens: int | None = None) -> None:
        """A dispatched request ended, having generated ``output_tokens`` (None: unknown or failed).

        The sa policy frees its slot and learns its task type's output length from it.
        """
        if self.planner is not None:
            self.planner.finished(request_id, output_tokens)

    # ------------------------------------------------------------------ keys

    def _order_key(self, e: QueueEntry) -> tuple[Any, ...]:
        if self.policy is QueuePolicy.EDF:
            return (e.deadline_s, e.seq)
        if self.policy is QueuePolicy.PRIORITY:
            return (-e.request.priority, e.deadline_s, e.seq)
        return (e.seq,)

    @staticmethod
    def _value_key(e: QueueEntry) -> tuple[Any, ...]:
        # Smallest is shed first: lowest priority, late before on time, most slack, newest.
        return (e.request.priority, not e.late, -e.deadline_s, -e.seq)

    def _index(self, e: QueueEntry) -> None:
        if not e.request.e2e_only:
            self._streams.add(e.request_id)
        self._value.add((*self._value_key(e), e.request_id))
        self._waits.add((e.enqueued_s, e.seq, e.request_id))
        if e.late:
            self._late.add((e.seq, e.request_id))
            if e.late_until_s < math.inf:
                self._late_until.add((e.late_until_s, e.seq, e.request_id))
        else:
            self._order.add((*self._order_key(e), e.request_id))
            self._budgets.add((e.ttft_deadline_s, e.seq, e.request_id))
            if self.policy is QueuePolicy.PRIORITY:
                per = self._budgets_by_priority.setdefault(e.request.priority, _Sorted())
                per.add((e.ttft_deadline_s, e.seq, e.request_id))

    def _unindex(self, e: QueueEntry) -> None:
        if not e.request.e2e_only:
            self._streams.discard(e.request_id)
        self._value.discard((*self._value_key(e), e.request_id))
        self._waits.discard((e.enqueued_s, e.seq, e.request_id))
        if e.late:
            self._late.discard((e.seq, e.request_id))
            if e.late_until_s < math.inf:
                self._late_until.discard((e.late_until_s, e.seq, e.request_id))
        else:
            self._order.discard((*self._order_key(e), e.request_id))
            self._budgets.discard((e.ttft_deadline_s, e.seq, e.request_id))
            if self.policy is QueuePolicy.PRIORITY:
                per = self._budgets_by_priority[e.request.priority]
                per.discard((e.ttft_deadline_s, e.seq, e.request_id))
                if not per.keys:
                    del self._budgets_by_priority[e.request.priority]

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def streams(self) -> int:
        """How many waiting entries (on time or late) are judged by a TTFT or TPOT target, not by an
        e2e deadline alone."""
        return len(self._streams)

    def margin_waived(
        self, entry: QueueEntry, targets: Targets, now_s: float, own_ms: float = math.nan
    ) -> bool:
        """Whether ``entry`` is offered without the margin packing holds for it
        (:attr:`~router.core.request.Targets.margin_waived`).

        Judged by its e2e deadline alone: its own deadline's pace is waived once it has waited its
        hold (:data:`PACE_HOLD_SHARE` of ``targets``' whole TTFT target) while no entry judged by a
        TTFT or TPOT target waits (on time or late). Judged by a TTFT target: θ's margin on its own
        TPOT and on the residents' slack is waived once what its TTFT target leaves it to wait at
        best (what is left of the target less ``own_ms``, its prefill on an idle instance) is at
        most that hold: from then on, waiting for a placement with the margin costs its first token
        more surely than the margin's length error costs the placement.
        """
        request = entry.request
        hold_s = PACE_HOLD_SHARE * targets.full_ttft_ms * 1e-3
        if not request.e2e_only:
            return own_ms == own_ms and (targets.ttft_ms - own_ms) * 1e-3 <= hold_s
        if self._streams:
            return False
        arrival = entry.enqueued_s if request.arrival_s is None else request.arrival_s
        return now_s - arrival >= hold_s

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def get(self, request_id: str) -> QueueEntry | None:
        return self._entries.get(request_id)

    def entries(self) -> Iterator[QueueEntry]:
        """Every entry in offer order: on-time ones in policy order, then late ones oldest first."""
        # Keys are copied (cheap: references) so callers may change the queue while iterating;
        # entries that left meanwhile are skipped.
        for keys in (self._order.keys, self._late.keys):
            for key in keys[:]:
                entry = self._entries.get(key[-1])
                if entry is not None:
                    yield entry

    def position(self, request_id: str) -> int:
        """0-based place of a queued request in offer order."""
        e = self._entries[request_id]
        if e.late:
            return len(self._order.keys) + self._late.rank((e.seq, request_id))
        return self._order.rank((*self._order_key(e), request_id))

    def position_of_new(self, request: ScheduleInput, now_s: float) -> int:
        """Where ``request`` would enter if it were queued now (for the ``Schedule`` dry run)."""
        if not self._order.keys:
            return 0  # (first whatever its key)
        probe = self._entry(request, now_s, self._seq)
        return self._order.rank((*self._order_key(probe), request.request_id))

    def deadlines(self, request: ScheduleInput, now_s: float) -> tuple[float, float]:
        """(EDF deadline, TTFT deadline) of ``request`` in seconds on the caller's clock."""
        arrival = request.arrival_s if request.arrival_s is not None else now_s
        targets = resolve_targets(request, self.default_ttft_ms, self.default_tpot_ms)
        ttft_deadline = arrival + targets.full_ttft_ms * 1e-3
        only_e2e = request.e2e_slo_ms > 0 and request.ttft_slo_ms == 0 and request.tpot_slo_ms == 0
        deadline = arrival + request.e2e_slo_ms * 1e-3 if only_e2e else ttft_deadline
        return deadline, ttft_deadline

    def _entry(self, request: ScheduleInput, now_s: float, seq: int) -> QueueEntry:
        deadline, ttft_deadline = self.deadlines(request, now_s)
        return QueueEntry(request, seq, now_s, deadline, ttft_deadline)

    def release_limit_ms(
        self, now_s: float, priority: int | None = None, target_ms: float | None = None
    ) -> float:
        """The TTFT an instance may be predicted to reach with its next request (ms; inf = no cap).

        The tightest remaining budget among on-time entries and the tightest
        target among the latest arrivals (see the module doc). Under the
        ``priority`` policy, for a request of ``priority``: only entries and
        arrivals of that priority or higher count, and every higher priority
        present caps it at ``priority_headroom`` × its tightest target, so
        lower-priority work leaves room for the higher class's next arrivals.
        Under ``edf``, a request whose own TTFT target (``target_ms``) is looser
        than the tightest recent one yields the same way: it is capped at
        ``priority_headroom`` × that tightest target, urgency standing in for priority.
        """
        if self.policy is not QueuePolicy.PRIORITY or priority is None:
            limit = math.inf
            if self._budgets.keys:
                limit = (self._budgets.keys[0][0] - now_s) * 1e3
            if self.config.release_window_requests and self._recent:
                tightest = self._minima[0][1]
                limit = min(limit, tightest)
                if self.policy is QueuePolicy.EDF and target_ms is not None and tightest < target_ms:
                    limit = min(limit, self.config.priority_headroom * tightest)
            return limit
        own = math.inf
        higher = math.inf
        for p, per in self._budgets_by_priority.items():
            if p >= priority and per.keys:
                budget = (per.keys[0][0] - now_s) * 1e3
                own = min(own, budget)
                if p > priority:
                    higher = min(higher, budget)
        if self.config.release_window_requests:
            for target, p, _ in self._recent:
                if p >= priority:
                    own = min(own, target)
                    if p > priority:
                        higher = min(higher, target)
        return min(own, self.config.priority_headroom * higher)

    def note_backlog(self, now_s: float) -> None:
        """At the start of an offer pass: the time since the last pass counts toward the drain rate
        if the fleet limited that pass (:meth:`note_pass`) and on-time entries still wait; this
        pass's dispatches then count as what the fleet drained in it."""
        since = self._limited_at
        self._limited_at = None
        self._counting = since is not None and bool(self._order.keys) and now_s >= since
        if self._counting and since is not None:
            window_s = self.config.drain_window_ms * 1e-3
            self._limited.add(now_s, round((now_s - since) * 1e6), now_s - window_s)

    def note_pass(self, now_s: float, fleet_limited: bool) -> None:
        """At the end of an offer pass: whether the fleet alone kept its on-time entries waiting.

        ``fleet_limited``: some on-time entry was refused by the fleet (no instance met its own
        budget, its TPOT target or KV) and none was held by the queue's own rules (release control
        capping its bound below a budget that would have let it through; a long prompt yielding).
        Only the time after such a pass, up to the next one, and the dispatches that next pass makes,
        measure the drain rate. Why: the rate stands for what the fleet can take off the queue; time
        the queue held requests for its own reasons (keeping room for tighter traffic, or late
        requests it serves only on nearly idle instances) measured its holds instead, so the rate
        fell as the queue held more, more requests were judged hopeless and turned late, the queue
        held still more, and a loaded fleet tipped into serving a third of the requests late.
        """
        self._counting = False
        self._limited_at = now_s if fleet_limited and self._order.keys else None

    def scan_due(self, now_s: float) -> bool:
        """Whether a full hopeless scan is due (:data:`SCAN_INTERVAL_S` since the last one)."""
        return now_s - self._scanned_at >= SCAN_INTERVAL_S

    def scanned(self, now_s: float) -> None:
        """A full hopeless scan ran at ``now_s``: every entry, fresh ones included, was judged."""
        self._scanned_at = now_s
        self._fresh.clear()

    def take_fresh(self) -> list[QueueEntry]:
        """The on-time entries queued since the last full scan or the last call, in arrival order."""
        out = [e for rid in self._fresh if (e := self._entries.get(rid)) is not None and not e.late]
        self._fresh.clear()
        return out

    def work_tokens(self, entry: QueueEntry) -> int:
        """The prompt tokens ``entry`` must prefill at best: its prompt less the longest prefix the
        router knows an instance's cache to hold (:func:`~router.core.prefix.best_cached_tokens`; the
        whole prompt without prefix knowledge). Looked up once per entry and kept.

        The hopeless test and the late sweep count the work queued in front of a request in these
        tokens: a queued prompt that is mostly cached somewhere puts only its uncached part on the
        fleet's prefill, so counting it whole judged the requests behind it hopeless (late at once,
        behind every on-time entry) when the fleet could serve them in time. Kept from the first
        lookup: a prefix cached later only makes the count a little high, as it was before.
        """
        work = entry.work
        if work < 0:
            request = entry.request
            work = entry.work = request.prompt_tokens - best_cached_tokens(
                self.prefix, request.prefix_hashes, request.prompt_tokens
            )
        return work

    def entries_before(self, entry: QueueEntry) -> int:
        """On-time entries ahead of on-time ``entry`` in offer order (O(log n))."""
        return int(self._order.rank((*self._order_key(entry), entry.request_id)))

    def tokens_before(self, entry: QueueEntry) -> int:
        """Prompt tokens (:meth:`work_tokens`) of the on-time entries ahead of on-time ``entry`` in
        offer order (O(position))."""
        rank = self._order.rank((*self._order_key(entry), entry.request_id))
        entries = self._entries
        return sum(self.work_tokens(entries[key[-1]]) for key in self._order.keys[:rank])

    def note_dispatch(self, now_s: float, prompt_tokens: int) -> None:
        """An entry was dispatched at ``now_s`` with ``prompt_tokens`` to prefill at best (its
        :meth:`work_tokens`): it counts in the drain rate when the fleet limited the time before
        this pass (:meth:`note_backlog`)."""
        if self._counting:
            cutoff = now_s - self.config.drain_window_ms * 1e-3
            self._dispatched.add(now_s, prompt_tokens, cutoff)
            self._dispatched_entries.add(now_s, 1, cutoff)

    def drain_rate(self, now_s: float) -> float | None:
        """Prompt tokens to prefill (:meth:`work_tokens`) per ms the queue dispatched while the fleet
        limited it (:meth:`note_pass`), over the last ``drain_window_ms`` (``None``: no window, such
        time under a tenth of it, or nothing dispatched in it): the unit the work in front of a
        request is counted in."""
        window_ms = self.config.drain_window_ms
        if window_ms <= 0:
            return None
        start = now_s - window_ms * 1e-3
        span_ms = self._limited.tokens_since(start) * 1e-3
        if span_ms < 0.1 * window_ms:
            return None
        tokens = self._dispatched.tokens_since(start)
        # Nothing dispatched at all says the fleet stalled (stale statuses, a restart), not how fast it
        # drains: no estimate then, rather than every waiting request judged hopeless.
        return tokens / span_ms if tokens > 0 else None

    def drain_request_rate(self, now_s: float) -> float | None:
        """Entries per ms the queue dispatched over the same time as :meth:`drain_rate` (``None`` when
        that has no estimate).

        The fleet drains the queue in prefill tokens while prefill limits it, but in requests while
        decode does (the entries wait for a decode slot that keeps their TPOT target, whatever their
        prompts): there a cold prompt in front costs the requests behind it one dispatch, not its
        tokens over a rate measured on mostly cached ones. :meth:`FleetDrain.start_ms` takes the
        sooner of the two.
        """
        if self.drain_rate(now_s) is None:
            return None
        start = now_s - self.config.drain_window_ms * 1e-3
        span_ms = self._limited.tokens_since(start) * 1e-3
        return self._dispatched_entries.tokens_since(start) / span_ms

    def oldest_enqueued_s(self) -> float | None:
        """When the longest-waiting entry was queued (for the wait bound's timer)."""
        return self._waits.keys[0][0] if self._waits.keys else None

    def wake_s(self) -> float | None:
        """The first moment a pass must run without any event: an entry expires, turns late, or the sa
        policy's request pool matures."""
        when = math.inf
        oldest = self.oldest_enqueued_s()
        if oldest is not None:
            when = oldest + self.config.max_queue_wait_ms * 1e-3
        earliest = self.earliest_ttft_deadline_s()
        if earliest is not None:
            when = min(when, earliest)
        if self._late_until.keys:
            when = min(when, self._late_until.keys[0][0])
        if self.planner is not None:
            when = min(when, self.planner.wake_s)
        return None if when == math.inf else when

    def earliest_ttft_deadline_s(self) -> float | None:
        """The earliest TTFT deadline of an on-time entry (when it turns late without any event)."""
        return self._budgets.keys[0][0] if self._budgets.keys else None

    # ------------------------------------------------------------------ changes

    def observe_arrival(self, request: ScheduleInput) -> None:
        """Note a new request's full TTFT target for release control (every arrival, queued or not)."""
        target = resolve_targets(request, self.default_ttft_ms, self.default_tpot_ms).full_ttft_ms
        recent = self._recent
        self._slide(target, len(recent) == recent.maxlen)
        recent.append((target, request.priority, request.request_id))

    def _slide(self, target: float, full: bool) -> None:
        """Add the next arrival's ``target`` to the sliding minimum (``full``: the window's oldest leaves)."""
        minima = self._minima
        if full and minima and minima[0][0] == self._arrivals - len(self._recent):
            minima.popleft()
        # Only targets strictly above the new one go: of equal ones the oldest stays the head, the
        # one ``min()`` returns.
        while minima and minima[-1][1] > target:
            minima.pop()
        minima.append((self._arrivals, target))
        self._arrivals += 1

    def forget_arrival(self, request_id: str) -> None:
        """``request_id`` turned late: its target, out of reach, no longer caps what instances are offered
        (else one request with an impossible target, say 1 ms, would hold every looser one back)."""
        if any(rid == request_id for _, _, rid in self._recent):
            kept = [r for r in self._recent if r[2] != request_id]
            self._recent.clear()
            self._minima.clear()
            self._arrivals = 0
            for target, _, _ in kept:  # (never full: one left)
                self._slide(target, False)
            self._recent.extend(kept)

    def push(
        self, request: ScheduleInput, now_s: float, token: Any = None
    ) -> tuple[QueueEntry, list[QueueEntry]]:
        """Queue ``request``; returns its entry and the entries shed to make room (possibly itself).

        A shed entry is no longer queued. Raises ``ValueError`` for a request id already queued.
        """
        if request.request_id in self._entries:
            raise ValueError(f"request {request.request_id!r} is already queued")
        entry = self._entry(request, now_s, self._seq)
        entry.token = token
        self._seq += 1
        self._fresh.append(request.request_id)
        self._entries[request.request_id] = entry
        self._index(entry)
        shed: list[QueueEntry] = []
        while len(self._entries) > self.config.max_queue_size:
            victim = self._entries[self._value.keys[0][-1]]
            self.remove(victim.request_id)
            shed.append(victim)
        return entry, shed

    def remove(self, request_id: str) -> QueueEntry | None:
        """Take ``request_id`` out (dispatched, cancelled, expired, shed); ``None`` if it is not queued."""
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            self._unindex(entry)
        return entry

    def mark_late(self, request_id: str, now_s: float | None = None) -> None:
        """``request_id`` can no longer meet its TTFT target: it moves behind every on-time entry.

        Given ``now_s`` (the moment it turned late), it is given its late allowance: it may be served
        until ``late_allowance`` of its target past its deadline (or past now, if it turned late
        before its deadline), then it is refused (:meth:`lapsed`). The target and deadline are its
        TTFT ones, or for a request judged by its e2e target alone its e2e ones (it turns late at a
        TTFT deadline derived for ordering, and may still meet its e2e target then).
        """
        entry = self._entries[request_id]
        if entry.late:
            return
        self._unindex(entry)
        entry.late = True
        if now_s is not None:
            entry.late_until_s = max(now_s, entry.deadline_s) + self._late_allowance_s(entry)
        self._index(entry)

    def _late_allowance_s(self, entry: QueueEntry) -> float:
        """How long past its deadline a late ``entry`` may still be served: ``late_allowance`` of its
        TTFT target, or of its e2e target for a request judged by that alone (see :meth:`mark_late`)."""
        request = entry.request
        only_e2e = request.e2e_slo_ms > 0 and request.ttft_slo_ms == 0 and request.tpot_slo_ms == 0
        if only_e2e:
            span_ms = request.e2e_slo_ms
        else:
            span_ms = resolve_targets(request, self.default_ttft_ms, self.default_tpot_ms).full_ttft_ms
        return self.config.late_allowance * span_ms * 1e-3

    def refusal_s(self, entry: QueueEntry) -> float:
        """When ``entry``, still waiting, is refused for lateness (s; inf: never): its late allowance's
        end (:meth:`mark_late`, from its TTFT deadline, when :func:`offer` finds it overdue), or that
        deadline itself when a late request is refused at once (``late_policy=reject``, objective g).
        The sa plan prices a request it would start after this as refused (:mod:`router.core.sa`)."""
        if entry.late:
            return entry.late_until_s
        if self.config.late is LatePolicy.REJECT or self.config.objective is Objective.G:
            return entry.ttft_deadline_s
        return max(entry.ttft_deadline_s, entry.deadline_s) + self._late_allowance_s(entry)

    def lapsed(self, now_s: float) -> list[QueueEntry]:
        """Remove and return the late entries whose late allowance ended (see :meth:`mark_late`)."""
        out: list[QueueEntry] = []
        while self._late_until.keys and self._late_until.keys[0][0] <= now_s:
            entry = self.remove(self._late_until.keys[0][-1])
            assert entry is not None
            out.append(entry)
        return out

    def expire(self, now_s: float) -> list[QueueEntry]:
        """Remove and return the entries that waited longer than ``max_queue_wait_ms``."""
        out: list[QueueEntry] = []
        limit = now_s - self.config.max_queue_wait_ms * 1e-3
        while self._waits.keys and self._waits.keys[0][0] <= limit:
            entry = self.remove(self._waits.keys[0][-1])
            assert entry is not None
            out.append(entry)
        return out

    def overdue(self, now_s: float) -> list[QueueEntry]:
        """On-time entries whose TTFT deadline has passed (late by the clock alone), earliest first."""
        out: list[QueueEntry] = []
        for key in self._budgets.keys:
            if key[0] > now_s:
                break
            out.append(self._entries[key[-1]])
        return out


# --------------------------------------------------------------------------- offering entries to the scheduler


class Verdict(enum.Enum):
    """What became of one entry offered to the scheduler."""

    #: Placed: the caller records and runs ``decision``.
    DISPATCH = "dispatch"
    #: Still waiting (no instance may take it now).
    WAIT = "wait"
    #: Its TTFT target is out of reach; with ``late_policy=serve`` it stays queued as late.
    LATE = "late"
    #: Out of the queue and refused: ``error`` says why (late with ``late_policy=reject``, or no usable fleet).
    REJECT = "reject"
    #: Out of the queue: waited longer than ``max_queue_wait_ms``.
    EXPIRED = "expired"


class Decide(Protocol):
    """What :func:`offer` decides with: :meth:`Scheduler.schedule`'s shape (``policy``: the scheduler's own
    when None; a queue policy passes another to waive a check it answers for itself)."""

    def __call__(
        self,
        view: ClusterView | ClusterSnapshot,
        request: ScheduleInput,
        now: float,
        /,
        *,
        targets: Targets | None = None,
        policy: Policy | None = None,
    ) -> Decision: ...


class Planner(Protocol):
    """A queue policy that decides releases itself (the sa policy: :class:`router.core.sa.SAPlanner`).

    :func:`offer` hands it each pass after the expiry and lateness sweep; it
    takes entries out of the queue and yields what became of them, like
    :func:`offer`. ``finished`` is told when a request it released ends.
    """

    def offer(
        self,
        queue: RouterQueue,
        scheduler: Scheduler,
        source: Callable[[], ClusterView | ClusterSnapshot],
        now_s: float,
        schedule: Decide,
    ) -> Iterator[Offer]: ...

    def finished(self, request_id: str, output_tokens: int | None = None) -> None: ...

    #: When the next pass must run without any other event (inf: none).
    wake_s: float


@dataclass(frozen=True)
class Offer:
    """The outcome of offering ``entry`` at one moment."""

    entry: QueueEntry
    verdict: Verdict
    decision: Decision | None = None
    error: SchedulingError | None = None
    #: Best predicted TTFT seen when the entry missed (ms; NaN when unknown) and its remaining budget (ms).
    predicted_ttft_ms: float = math.nan
    budget_ms: float = math.nan
    #: Set when the entry turned late early: its best case (see :class:`FleetDrain`) misses a target.
    hopeless: Hopeless | None = None


#: The ``load_memo`` key of the view's last :class:`FleetDrain` (one kept per load: bounded).
_DRAIN_MEMO = "queue_fleet_drain"


class FleetDrain:
    """How fast the fleet can work off a queue, at one moment: the best case of a queued request.

    A fluid model of the prefill side (prefill and neutral instances that are
    schedulable): instance ``i`` holds a backlog it finishes at ``free_ms[i]``
    (from now, at its full-chunk prefill rate) and then prefills ``rate[i]``
    tokens per ms. The earliest a request can start its own prefill is when the
    fleet has also prefilled every token queued in front of it, each instance
    taking work the moment it is free (:meth:`start_ms`; ``0`` tokens ahead:
    the first instance to be free). On top comes its own prefill on an idle
    instance (:meth:`idle_ms`) and, for an e2e target, its remaining tokens at
    the fastest decode step of a batch of one (:meth:`min_tpot_ms`). All of it
    is calibrated when the scheduler calibrates (its TTFT/TPOT factors and
    refit, as the metrics apply them), so a request is judged by the same
    model that places it. Built once per offer pass (:meth:`of`).

    It ignores what can only make things worse (decode batches beside the
    prefill, KV limits, later arrivals that go first), so at the full rate it
    is a best case up to the order: it counts the entries in front in the
    queue's order, which the scheduler follows unless one of them cannot be
    placed. ``queue_rate`` (measured, see :meth:`RouterQueue.drain_rate`) makes
    it an estimate instead: the work ahead takes at least as long as the queue
    took for as much work lately.
    """

    __slots__ = (
        "_breaks",
        "_cum_rate",
        "_cum_rate_free",
        "_free",
        "_idle",
        "_tpot",
        "free_by_index",
        "idle_instances",
        "prefill_index",
        "prefix",
        "queue_rate",
        "queue_request_rate",
    )

    def __init__(
        self,
        free_ms: FloatArray,
        rate: FloatArray,
        idle: Callable[[int], float],
        min_tpot: Callable[[int], float],
        queue_rate: float | None = None,
        prefill_index: IntArray | None = None,
        prefix: PrefixSource | None = None,
    ) -> None:
        #: The view indices of the prefill-capable instances, and when each is free (ms from now).
        self.prefill_index: IntArray = (
            np.arange(len(free_ms), dtype=np.intp) if prefill_index is None else prefill_index
        )
        self.free_by_index = free_ms
        #: Prompt tokens per ms the queue really drained at lately (:meth:`RouterQueue.drain_rate`), if known.
        self.queue_rate = queue_rate
        #: Entries per ms it drained at over the same time (:meth:`RouterQueue.drain_request_rate`), if known.
        self.queue_request_rate: float | None = None
        #: The router's knowledge of the instances' prefix caches (None: off), for :meth:`compute_tokens`.
        self.prefix = prefix
        order = np.argsort(free_ms, kind="stable")
        self._free = free_ms[order]
        r = rate[order]
        self._cum_rate = np.cumsum(r)
        self._cum_rate_free = np.cumsum(r * self._free)
        # Tokens the fleet has taken from the queue by the time instance k is free (k in free order).
        self._breaks = self._cum_rate * self._free - self._cum_rate_free
        self._idle = idle
        self._tpot = min_tpot
        #: Prefill instances without any backlog now.
        self.idle_instances = int(np.count_nonzero(free_ms <= 0.0))

    def free_within(self, ms: float) -> int:
        """Prefill instances whose backlog is done within ``ms`` from now."""
        return int(np.searchsorted(self._free, ms, side="right"))

    @classmethod
    def of(
        cls,
        scheduler: Scheduler,
        view: ClusterView,
        now_s: float,
        queue_rate: float | None = None,
        queue_request_rate: float | None = None,
    ) -> FleetDrain | None:
        """The drain of ``view``'s fleet, or ``None`` without predictors or a prefill-capable instance.

        Kept with the view's load (its ``load_memo``) for the moment and the calibration it was
        built for: the load watch, the offer pass and its late sweep judge the same view at the
        same moment, and build it once (only ``queue_rate`` differs, set on a copy).
        """
        predictors = scheduler.predictors
        if predictors is None:
            return None
        calibration = predictors.calibration
        version = -1 if calibration is None else calibration.version
        memo = view.load_memo
        found: tuple[float, Any, Any, int, FleetDrain | None] | None = memo.get(_DRAIN_MEMO)
        if (
            found is None
            or found[0] != now_s
            or found[1] is not predictors
            or found[2] is not scheduler.prefix
            or found[3] != version
        ):
            found = (now_s, predictors, scheduler.prefix, version, cls._build(scheduler, view, now_s))
            memo[_DRAIN_MEMO] = found
        drain = found[4]
        if drain is None or queue_rate is None:
            return drain
        copy = cls.__new__(cls)
        for name in cls.__slots__:
            setattr(copy, name, getattr(drain, name))
        copy.queue_rate = queue_rate
        copy.queue_request_rate = queue_request_rate
        return copy

    @classmethod
    def _build(cls, scheduler: Scheduler, view: ClusterView, now_s: float) -> FleetDrain | None:
        static = _drain_static(scheduler, view)
        if static is None:
            return None
        prefill, rate, idle, min_tpot = static
        ctx = scheduler.context(view, None, now_s)
        backlog = advanced_backlog(ctx)[prefill] + view.inflight.prefill_tokens[prefill]
        free = backlog / rate
        return cls(free, rate, idle, min_tpot, None, prefill, scheduler.prefix)

    def start_ms(self, tokens_ahead: float, entries_ahead: int | None = None) -> float:
        """When a request can start its prefill with ``tokens_ahead`` queued tokens (in ``entries_ahead``
        entries, if given) to go first (ms from now).

        The fleet's full prefill rate gives the earliest moment; with a measured
        ``queue_rate`` the work ahead takes at least ``tokens_ahead / queue_rate``
        (the queue has not been drained faster than that lately: release
        control, decode capacity or the engines held it back), or, when the
        entries ahead are counted and the queue's rate in entries is known,
        ``entries_ahead / queue_request_rate`` if that is sooner. Which unit the
        queue drains in depends on what held it: prefill (tokens) or decode
        slots (entries, whatever their prompts). Tokens alone over-charged a
        cold prompt queued among mostly cached ones (its tokens at a rate
        measured on dispatches of a few hundred uncached tokens each), and
        requests the fleet could serve in time were refused as out of reach.
        """
        fluid = self.fluid_start_ms(tokens_ahead)
        if self.queue_rate is None or tokens_ahead <= 0:
            return fluid
        drained = tokens_ahead / self.queue_rate
        if entries_ahead is not None and self.queue_request_rate:
            drained = min(drained, entries_ahead / self.queue_request_rate)
        return max(fluid, drained)

    def fluid_start_ms(self, tokens_ahead: float) -> float:
        """The earliest a request can start its prefill at the fleet's full prefill rate (ms from now)."""
        # Between instance k's free time and the next one's, the k + 1 first-free instances take
        # sum(rate * (t - free)) tokens by time t: solve that for ``tokens_ahead``.
        k = max(int(np.searchsorted(self._breaks, max(tokens_ahead, 0.0), side="right")), 1) - 1
        return (max(tokens_ahead, 0.0) + float(self._cum_rate_free[k])) / float(self._cum_rate[k])

    def compute_tokens(self, request: ScheduleInput) -> int:
        """The prompt tokens ``request`` must prefill at best: its prompt less the longest prefix the
        router knows an instance's cache to hold (the whole prompt without prefix knowledge)."""
        return request.prompt_tokens - best_cached_tokens(
            self.prefix, request.prefix_hashes, request.prompt_tokens
        )

    def idle_ms(self, prompt_tokens: int) -> float:
        """``prompt_tokens``' prefill on the fastest idle instance (ms)."""
        return self._idle(prompt_tokens)

    def min_tpot_ms(self, context_tokens: int) -> float:
        """The fastest decode step of a batch of one at ``context_tokens`` (ms)."""
        return self._tpot(context_tokens)


#: The last fleet's drain parts that do not depend on the load (:func:`_drain_static`): its key (the
#: predictors, the correction, the last table seen, then the columns they depend on) and value.
_DRAIN_STATIC: list[tuple[tuple[Any, ...], Any]] = []


def _drain_static(
    scheduler: Scheduler, view: ClusterView
) -> tuple[IntArray, FloatArray, Callable[[int], float], Callable[[int], float]] | None:
    """The parts of a :class:`FleetDrain` that read no load: the prefill-capable instances, their
    calibrated prefill rates and the idle-prefill and single-decode-step predictions. They depend on
    the instances (ids, roles, health, profile groups, chunk budgets), the profile and the calibration
    (its :class:`Correction`, a new object for every change), so one kept copy serves every view of
    the same fleet between two calibration changes (the load watch's, every attempt's of a pass, the
    late sweep's): a view rebuilt for a new status or dispatch reuses them (values identical)."""
    predictors = scheduler.predictors
    assert predictors is not None
    table = view.instances
    calibration = predictors.calibration
    correction = None if calibration is None else calibration.correction(table.ids, table.groups)
    if _DRAIN_STATIC:
        found_key, found = _DRAIN_STATIC[0]
        if found_key[0] is predictors and found_key[1] is correction and found_key[2] is table:
            # The same table (one snapshot: read-only columns) as last time: every view of a burst on
            # one snapshot, without comparing its columns again.
            return found  # type: ignore[no-any-return]
    key = (
        predictors,
        correction,
        table.ids,
        table.groups,
        table.schedulable.tobytes(),
        table.roles.tobytes(),
        table.max_num_batched_tokens.tobytes(),
    )
    if _DRAIN_STATIC:
        found_key, found = _DRAIN_STATIC[0]
        if found_key[0] is predictors and found_key[1] is correction and found_key[3:] == key[2:]:
            _DRAIN_STATIC[:] = [((predictors, correction, table, *key[2:]), found)]
            return found  # type: ignore[no-any-return]
    value = _drain_static_build(predictors, table, correction)
    _DRAIN_STATIC[:] = [((predictors, correction, table, *key[2:]), value)]  # (one kept: bounded)
    return value


def _drain_static_build(
    predictors: Any, table: Any, correction: Correction | None
) -> tuple[IntArray, FloatArray, Callable[[int], float], Callable[[int], float]] | None:
    prefill = np.flatnonzero(table.schedulable & (table.roles != int(Role.DECODE)))
    decode = np.flatnonzero(table.schedulable & (table.roles != int(Role.PREFILL)))
    if len(prefill) == 0 or len(decode) == 0:
        return None
    budget = table.max_num_batched_tokens
    key = ("queue_drain_parts", predictors)
    parts: list[tuple[Any, IntArray]] | None = table.memo.get(key)
    if parts is None:  # instances by profile predictor, once per table
        by: dict[int, tuple[Any, list[int]]] = {}
        for i, group in enumerate(table.groups):
            lp = predictors.for_group(group)
            by.setdefault(id(lp), (lp, []))[1].append(i)
        parts = [(lp, np.asarray(ii, dtype=np.intp)) for lp, ii in by.values()]
        table.memo[key] = parts
    owner = np.empty(table.n, dtype=np.intp)
    for k, (_, ii) in enumerate(parts):
        owner[ii] = k

    def per_instance(idx: IntArray, fn: Callable[[Any, IntArray], FloatArray]) -> FloatArray:
        out = np.empty(len(idx))
        for k, (lp, _) in enumerate(parts):
            sel = np.flatnonzero(owner[idx] == k)
            if len(sel):
                out[sel] = fn(lp, idx[sel])
        return out

    # A full chunk on each prefill instance, as the profile and as calibrated: the calibration's
    # ratio at a full chunk stands for it at any prompt (exact for the scale mode; close for
    # refit, whose remainder is linear in the chunk).
    profile = per_instance(prefill, lambda lp, ii: _full_chunk_profile_ms(lp, budget[ii]))
    chunk_ms = profile
    if correction is not None:
        zeros = np.zeros(len(prefill))
        part = _subset(correction, prefill)
        chunk_ms = part.ttft_ms(profile, budget[prefill], zeros, zeros, budget[prefill], zeros)
    ratio = np.divide(chunk_ms, profile, out=np.ones(len(prefill)), where=profile > 0)
    rate = budget[prefill] / np.maximum(chunk_ms, 1e-9)  # a profile of free steps: as good as instant
    # Per profile predictor: the largest chunk budget and the smallest calibration ratio among its
    # prefill instances (the fastest case), and whether it serves a decode instance.
    tpot_factor = 1.0 if correction is None else float(np.min(correction.tpot_factor[decode]))
    prefill_parts: list[tuple[Any, float, float]] = []
    decode_parts: list[Any] = []
    for k, (lp, _) in enumerate(parts):
        mine = owner[prefill] == k
        if mine.any():
            prefill_parts.append((lp, float(budget[prefill][mine].max()), float(ratio[mine].min())))
        if (owner[decode] == k).any():
            decode_parts.append(lp)
    idle_cache: dict[int, float] = {}
    tpot_cache: dict[int, float] = {}

    def idle(prompt: int) -> float:
        found = idle_cache.get(prompt)
        if found is None:
            if len(idle_cache) >= _PROFILE_MEMO_MAX:  # (kept as long as the fleet and calibration: bounded)
                idle_cache.clear()
            found = idle_cache[prompt] = min(
                _idle_prefill_ms(lp, prompt, m) * r for lp, m, r in prefill_parts
            )
        return found

    def min_tpot(context: int) -> float:
        found = tpot_cache.get(context)
        if found is None:
            if len(tpot_cache) >= _PROFILE_MEMO_MAX:
                tpot_cache.clear()
            found = tpot_cache[context] = tpot_factor * min(
                _single_tpot_ms(lp, context) for lp in decode_parts
            )
        return found

    return prefill, rate, idle, min_tpot


#: The profile's predictions a drain asks for, kept across offer passes (a pass builds a new drain
#: on every view, and judging the whole queue asks for every queued prompt length again). Keyed by
#: the profile predictor object, which never changes its predictions; bounded: cleared when full.
_PROFILE_MEMO: dict[tuple[Any, str, float, float], float] = {}
_PROFILE_MEMO_MAX = 1 << 16


def _idle_prefill_ms(lp: Any, prompt: int, budget: float) -> float:
    """The profile's prefill of ``prompt`` tokens on an idle instance with chunk budget ``budget`` (ms)."""
    key = (lp, "ttft", float(prompt), budget)
    found = _PROFILE_MEMO.get(key)
    if found is None:
        if len(_PROFILE_MEMO) >= _PROFILE_MEMO_MAX:
            _PROFILE_MEMO.clear()
        found = _PROFILE_MEMO[key] = float(lp.predict_ttft_ms(float(prompt), 0.0, 0.0, budget))
    return found


def _single_tpot_ms(lp: Any, context: int) -> float:
    """The profile's decode step of a batch of one at ``context`` tokens (ms)."""
    key = (lp, "tpot", float(context), 1.0)
    found = _PROFILE_MEMO.get(key)
    if found is None:
        if len(_PROFILE_MEMO) >= _PROFILE_MEMO_MAX:
            _PROFILE_MEMO.clear()
        found = _PROFILE_MEMO[key] = float(lp.predict_tpot_ms(1.0, float(context)))
    return found


_CHUNK_MEMO: dict[tuple[Any, str, bytes], FloatArray] = {}


def _full_chunk_profile_ms(lp: Any, budget: FloatArray) -> FloatArray:
    """The profile's full chunk (one chunk of ``budget`` tokens, no decode) per instance; memoized.

    The same call on the same budgets as every pass made, kept across passes (the budgets of a
    fleet rarely change). Read-only: callers copy it into their own arrays.
    """
    key = (lp, budget.dtype.str, budget.tobytes())
    found = _CHUNK_MEMO.get(key)
    if found is None:
        if len(_CHUNK_MEMO) >= 256:  # bounded: fleets whose budgets keep changing start it over
            _CHUNK_MEMO.clear()
        found = np.array(lp.predict_ttft_ms(budget, 0.0, 0.0, budget), dtype=np.float64)
        found.flags.writeable = False
        _CHUNK_MEMO[key] = found
    return found


def _only_neutral(table: InstanceTable) -> bool:
    """Whether every schedulable instance of ``table`` is neutral: once per table (its ``memo``)."""
    found: bool | None = table.memo.get("queue_only_neutral")
    if found is None:
        found = table.memo["queue_only_neutral"] = bool(
            (table.roles[table.schedulable] == int(Role.NEUTRAL)).all()
        )
    return found


def _subset(correction: Correction, idx: IntArray) -> Correction:
    return replace(
        correction,
        ttft_factor=correction.ttft_factor[idx],
        tpot_factor=correction.tpot_factor[idx],
        interleave_ms=correction.interleave_ms[idx],
        coefs=None if correction.coefs is None else correction.coefs[idx],
        has_fit=correction.has_fit[idx],
    )


@dataclass(frozen=True)
class Hopeless:
    """Why an entry cannot meet its targets even in the best case (see :class:`FleetDrain`)."""

    #: Best-case TTFT from now (ms) and the TTFT budget left (ms).
    predicted_ttft_ms: float
    budget_ms: float
    #: Best-case completion from arrival and the e2e target (ms); NaN when the TTFT is what fails.
    predicted_e2e_ms: float = math.nan
    e2e_ms: float = math.nan


def hopeless(
    drain: FleetDrain,
    request: ScheduleInput,
    targets: Targets,
    tokens_ahead: float,
    now_s: float,
    entries_ahead: int | None = None,
) -> Hopeless | None:
    """``request``'s best case with ``tokens_ahead`` queued in front of it misses its TTFT or e2e target.

    A request with only an e2e target is judged by that target alone: the TTFT target derived from it
    orders and places it, but missing it does not mean missing the SLO.
    """
    best_ttft = drain.start_ms(tokens_ahead, entries_ahead) + drain.idle_ms(drain.compute_tokens(request))
    only_e2e = request.e2e_slo_ms > 0 and request.ttft_slo_ms == 0 and request.tpot_slo_ms == 0
    if best_ttft > targets.ttft_ms and not only_e2e:
        return Hopeless(best_ttft, targets.ttft_ms)
    if targets.e2e_ms > 0 and request.arrival_s is not None:
        waited = (now_s - request.arrival_s) * 1e3
        # A length that is only the prior (the cap, before any answer of the class ended) or every
        # class's mean is no grounds to give up on a request: only its prefill is certain (as in the
        # arrival check).
        rest = 0 if request.output_tokens_guessed else max(request.output_tokens_estimate - 1, 0)
        best_e2e = waited + best_ttft + rest * drain.min_tpot_ms(request.prompt_tokens)
        if best_e2e > targets.e2e_ms:
            return Hopeless(best_ttft, targets.ttft_ms, best_e2e, targets.e2e_ms)
    return None


def slo_met(
    ttft_slo_ms: float,
    tpot_slo_ms: float,
    e2e_slo_ms: float,
    default_ttft_ms: float,
    default_tpot_ms: float,
    *,
    ttft_ms: float | None,
    tpot_ms: float | None,
    e2e_ms: float,
) -> bool:
    """Whether a completed request's measured times meet its SLO: each target it sets (0 = unset), or
    the defaults for TTFT and TPOT when it sets none. A target with nothing measured (no first token;
    TPOT of a one-token reply) is met only for TPOT."""
    if ttft_slo_ms <= 0 and tpot_slo_ms <= 0 and e2e_slo_ms <= 0:
        ttft_slo_ms, tpot_slo_ms = default_ttft_ms, default_tpot_ms
    if ttft_slo_ms > 0 and (ttft_ms is None or ttft_ms > ttft_slo_ms):
        return False
    if tpot_slo_ms > 0 and tpot_ms is not None and tpot_ms > tpot_slo_ms:
        return False
    return not (e2e_slo_ms > 0 and e2e_ms > e2e_slo_ms)


@dataclass(frozen=True)
class Overlong:
    """Why queue objective g refuses a request at once (see :func:`overlong`)."""

    #: Its best-case time from now to its last token (ms), and the shedding limit it is over (ms).
    remaining_ms: float
    limit_ms: float


def overlong(
    queue: RouterQueue,
    drain: FleetDrain,
    request: ScheduleInput,
    targets: Targets,
    tokens_ahead: float,
    now_s: float,
    entries_ahead: int | None = None,
) -> Overlong | None:
    """Under queue objective g: whether ``request``, behind ``tokens_ahead`` queued prompt tokens, is
    predicted to need longer than the shedding limit (:meth:`RouterQueue.shed_limit_ms`) to finish.
    Only requests of the lowest priority queued or among the latest arrivals are shed.

    Seed 000's G counts SLO-meeting requests per second of summed latency. When a fleet cannot serve
    every request in time, some must miss; a miss served late costs its whole latency and counts
    nothing, and a long request takes the capacity (decode slots, prefill time) of several short ones.
    So under g the queue refuses, at once, the requests that would take longest (best-case TTFT behind
    the queue plus the remaining tokens at the TPOT measured lately), as long as requests keep missing
    their SLO (the limit moves with the misses, see :meth:`RouterQueue.note_outcome`). The paper orders
    one engine's batch to raise G; a router serving a fleet past its capacity can only choose whom to
    hand back early, and this is that choice. (Dinkelbach's test of each request against the G achieved,
    the textbook rule for a ratio objective, was measured first: without a capacity term it refuses
    long requests even on a lightly loaded fleet, 23 % attainment at half capacity.)
    """
    limit = queue.shed_limit_ms(now_s)
    if not math.isfinite(limit) or request.priority > queue.lowest_priority():
        return None  # a more important request is never shed while less important traffic comes
    best_ttft = drain.start_ms(tokens_ahead, entries_ahead) + drain.idle_ms(drain.compute_tokens(request))
    tpot = queue.decode_ms_per_token()
    if tpot is None:
        tpot = targets.tpot_ms
    # A prior length (the cap, nothing of the class ended yet) or every class's mean says nothing of how
    # long it will take.
    rest = 0 if request.output_tokens_guessed else max(request.output_tokens_estimate - 1, 0)
    remaining = best_ttft + rest * tpot
    return Overlong(remaining, limit) if remaining > limit else None


#: An on-time request whose own prefill does not fit under the release limit may still go where its
#: predicted TTFT is at most this many times its prefill on an idle instance (an instance with at most
#: a quarter of that work ahead), rather than wait for its deadline to pass (it then *yields*: see
#: :func:`offer` for what it may take).
IDLE_SLACK = 1.25


#: ... but only while at least this many prefill instances finish their backlog within the release
#: limit: the one it takes, and one that stays within it for the tighter work it yields to.
SPARE_IDLE_INSTANCES = 2


#: Late and yielding work placed on a neutral instance stays under this fraction of its TPOT target
#: (see :func:`offer`; in simulation, 1.0 let it cost the on-time requests there more than it saved).
LATE_TPOT_FRACTION = 0.8


#: The metrics a TTFT threshold may hold (``binpack``'s (c) reads the prompt behind a running step).
TTFT_METRICS = frozenset({"predicted_ttft", "predicted_ttft_behind_step"})


def _relaxed(decision: Decision) -> bool:
    """Whether a placement of ``decision`` came from a fallback pass (a droppable filter relaxed)."""
    return any(p is not None and p.fallback_pass > 0 for p in (decision.prefill, decision.decode))


def _best_ttft(exc: NoInstanceError) -> float:
    if exc.stage not in (Stage.PREFILL.value, Stage.NEUTRAL.value):
        return math.nan
    for miss in exc.iter_misses():  # (the other thresholds' misses are not built)
        if miss.metric in TTFT_METRICS and miss.best == miss.best:
            return miss.best
    return math.nan


class _PassState:
    """What one offer pass learned of why its on-time entries wait (for :meth:`RouterQueue.note_pass`)."""

    __slots__ = ("fleet_waits", "own_waits")

    def __init__(self) -> None:
        #: On-time entries left waiting by the fleet, and by the queue's own rules.
        self.fleet_waits = 0
        self.own_waits = 0

    def wait(self, bound_ms: float, budget_ms: float, best_ms: float, yielding: bool) -> None:
        """An on-time entry offered TTFT bound ``bound_ms`` (its budget ``budget_ms``) was refused,
        the best predicted TTFT ``best_ms`` (NaN: the TTFT threshold refused no instance)."""
        if yielding or (bound_ms < budget_ms and best_ms == best_ms and best_ms > bound_ms):
            # Refused under a bound release control lowered below its own budget, where its budget
            # would have let it through: the queue held it, for the tighter traffic it keeps room for.
            self.own_waits += 1
        else:
            self.fleet_waits += 1

    @property
    def fleet_limited(self) -> bool:
        return self.fleet_waits > 0 and self.own_waits == 0


class LazyEpoch:
    """A :class:`LoadWatch` epoch of the fleet a pass starts on, taken only when the pass first needs
    it (``take``: the dispatcher's observation; None when incremental dispatch has no view), once.

    A pass needs the epoch only to hold an entry's earlier refusal or to keep a new one. A pass over
    a queue whose one entry has no refusal (a request that arrived at an empty queue: every request
    of a burst the fleet takes at once) needs it only if that entry is refused, and it is taken then,
    on the view the pass started on (nothing was dispatched in between, and the pass does not yield
    to the event loop before). A pass that dispatches its one entry takes none: that observation
    was about a seventh of a burst's placement CPU (``bench.bench_admission``).

    What skipping views costs the watch's base (what a later view is compared with): nothing a
    refusal relies on. Every refusal's own view is observed before the refusal is kept. After any
    observation the base's load rows are that view's exactly (a view lighter in some row moves the
    epoch and becomes the base; one that is not is at least the base in every row, so the row-wise
    maximum is the view itself), and the two rows kept with a tolerance (the prefill free moment,
    the measured decode step) hold the maximum since the last move, the refused view included. So
    a later view lighter than the refused one, in any load row or by more than the tolerance in
    the other two, moves the epoch, views skipped before the refusal or not: a refusal is never
    held on a fleet lighter than the one it was refused on. Skipping changes only what lies within
    the tolerance (those two rows' maximum taken over fewer views, or from before a move not
    made), where a later view may move the epoch a pass sooner or later; on seeded simulator runs
    no decision moved (``tests/router/core/test_incremental_dispatch.py``).
    """

    __slots__ = ("_take", "_taken", "_value")

    def __init__(self, take: Callable[[], int | None]) -> None:
        self._take = take
        self._taken = False
        self._value: int | None = None

    def __call__(self) -> int | None:
        if not self._taken:
            self._value = self._take()
            self._taken = True
        return self._value


def offer(
    queue: RouterQueue,
    scheduler: Scheduler,
    source: Callable[[], ClusterView | ClusterSnapshot],
    now_s: float,
    *,
    max_failures: int = 8,
    decide: Decide | None = None,
    epoch: int | LazyEpoch | None = None,
) -> Iterator[Offer]:
    """Offer the queue's entries to ``scheduler`` in order (see :func:`_offer`); at its end (run to the
    end or closed) the pass tells the queue whether the fleet alone kept its on-time entries waiting
    (:meth:`RouterQueue.note_pass`: the drain rate is measured over such time only)."""
    state = _PassState()
    try:
        yield from _offer(queue, scheduler, source, now_s, state, max_failures, decide, epoch)
    finally:
        queue.note_pass(now_s, state.fleet_limited)


def _offer(
    queue: RouterQueue,
    scheduler: Scheduler,
    source: Callable[[], ClusterView | ClusterSnapshot],
    now_s: float,
    state: _PassState,
    max_failures: int,
    decide: Decide | None,
    epoch: int | LazyEpoch | None,
) -> Iterator[Offer]:
    """Offer the queue's entries to ``scheduler`` in order at ``now_s``; yields what happened to each.

    First the entries past ``max_queue_wait_ms`` leave (``EXPIRED``) and the
    on-time ones past their TTFT deadline turn late. Then, in order, an on-time
    entry whose best case behind the on-time entries offered before it misses
    a target (:func:`hopeless`, on a :class:`FleetDrain` of the first view)
    turns late at once; every other one is tried with its TTFT bound =
    min(remaining budget, :meth:`RouterQueue.release_limit_ms`) and its TPOT
    target. An on-time entry whose own prefill cannot fit under that release
    limit *yields*: its bound is raised to :data:`IDLE_SLACK` × its own prefill
    on an idle instance (a nearly idle instance) while at least
    :data:`SPARE_IDLE_INSTANCES` prefill instances finish their backlog within
    the release limit, judged on the view of that attempt (one for it, one
    left for the tighter traffic). A late entry is served like the lowest
    class: its TTFT bound is ``priority_headroom`` × the release limit, but at
    least twice its own TTFT on an idle instance (so a request no instance
    could ever meet, e.g. a 1 ms target, is still served once the fleet is
    nearly idle). Late and yielding entries keep their own TPOT target, but
    take only a placement that passed every filter: one from a fallback pass
    (KV over life or the safety valve relaxed) leaves them waiting, since
    on-time work that cannot wait is what those passes are for. An entry judged
    by its e2e deadline alone is offered with its own pace waived once it has
    waited :data:`PACE_HOLD_SHARE` of its TTFT target while no entry judged by a
    TTFT or TPOT target waits, and an on-time entry judged by a TTFT target without
    packing's margin once it can wait no longer than that share of its target
    (:meth:`RouterQueue.margin_waived`). On a neutral
    instance, where its prefill runs between the decode steps of the requests
    there, such work is instead held to :data:`LATE_TPOT_FRACTION` of its TPOT
    target (fallback passes allowed, as before). A miss
    whose best predicted TTFT is already over the remaining budget makes the
    entry late. ``source()`` is called for every attempt, so the caller must
    record a ``DISPATCH`` before resuming the generator (the next attempt then
    sees that load). Stops after ``max_failures`` entries in a row stay waiting
    (a decision costs tens of microseconds; the rest face the same fleet).
    Entries leave the queue here; the caller only acts on the verdicts.
    ``decide`` replaces ``scheduler.schedule`` for the decisions (the router
    shell passes one that avoids ejected instances).

    ``epoch`` (a :class:`LoadWatch` epoch of the fleet now) turns on incremental dispatch: an entry
    whose last attempt failed in the same epoch, with a bound no looser and offered the same way
    (:meth:`Refusal.holds`), is counted as waiting again without a decision, exactly as that attempt
    would have ended (a wait, or late when its best predicted TTFT is now past its budget). A
    :class:`LazyEpoch` is taken when first needed: the caller hands one only where nothing can be
    dispatched before that (one entry, without a refusal).
    """
    schedule = scheduler.schedule if decide is None else decide
    for_g = queue.config.objective is Objective.G
    # Under objective g a late request promises nothing met for more latency: it is refused.
    late_reject = queue.config.late is LatePolicy.REJECT or for_g
    for entry in queue.expire(now_s):
        waited = (now_s - entry.enqueued_s) * 1e3
        yield Offer(
            entry,
            Verdict.EXPIRED,
            error=QueueTimeoutError(
                f"request {entry.request_id!r} waited {waited:.0f} ms in the router queue without an instance "
                f"able to take it (--max-queue-wait-ms {queue.config.max_queue_wait_ms:g}); add capacity or retry"
            ),
        )
    for entry in queue.overdue(now_s):
        budget = (entry.ttft_deadline_s - now_s) * 1e3
        yield _late(now_s, queue, entry, late_reject, math.nan, budget)
    for entry in queue.lapsed(now_s):
        yield _lapse(queue, entry, now_s)
    queue.note_backlog(now_s)
    queue.prefix = scheduler.prefix
    # Only packing reads the margin waiver; under another policy it would only change which of the
    # pass's refusal shortcuts apply (a shortcut compares it), and with them a few decisions.
    packs = scheduler.config.scheduling_policy == "binpack"
    if queue.planner is not None:
        # The sa policy decides which requests go where and when (router/core/sa.py).
        yield from queue.planner.offer(queue, scheduler, source, now_s, schedule)
        return
    failures = 0
    seen: set[str] = set()
    drain: FleetDrain | None = None
    drained = False
    # The drain of the last view a yielding entry was judged on: attempts on the same state (no
    # dispatch in between: the same table and in-flight columns, at the same ``now_s``) share it.
    last_view: ClusterView | None = None
    last_drain: FleetDrain | None = None
    # (Prompt tokens here are what each entry must prefill at best: RouterQueue.work_tokens.)
    ahead = 0.0  # prompt tokens of the on-time entries offered so far in this pass (in front of the next)
    late_ahead = 0.0  # prompt tokens of the late entries offered so far in this pass
    dispatched = 0  # prompt tokens this pass dispatched
    ahead_n = late_ahead_n = dispatched_n = 0  # the same, counted in entries
    only_neutral = False  # whether every schedulable instance is neutral (read with the first view)
    # Incremental dispatch: the attempts this pass's decisions refused (a request no easier than one
    # of them is refused too: the fleet only got heavier since, by this pass's own dispatches).
    refused_here: list[_Refused] = []
    calibration = None if scheduler.predictors is None else scheduler.predictors.calibration
    version = -1 if calibration is None else calibration.version  # (bound-free refusals keep it)
    scanning = False
    for entry in queue.entries():
        if entry.request_id in seen:  # turned late in this pass: once per pass is enough
            continue
        seen.add(entry.request_id)
        request = entry.request
        if failures >= max_failures:
            # No more decisions in this pass, but the rest of the on-time entries are still judged
            # against the work in front of them (no decision: a few array lookups each), so a new
            # request deep in the queue is found hopeless when it arrives, not when it nears the head.
            if drain is None or entry.late:  # late entries come last: every on-time one was judged
                queue.scanned(now_s)
                return
            if not scanning:
                if not queue.scan_due(now_s):
                    # Between full scans only the requests queued since are judged, each behind the
                    # tokens in front of it in the queue plus those this pass already dispatched.
                    for fresh in queue.take_fresh():
                        if fresh.request_id in seen:
                            continue
                        r = fresh.request
                        t = resolve_targets(r, queue.default_ttft_ms, queue.default_tpot_ms, now_s)
                        front = dispatched + queue.tokens_before(fresh)
                        front_n = dispatched_n + queue.entries_before(fresh)
                        why = hopeless(drain, r, t, front, now_s, front_n) if t.ttft_ms > 0 else None
                        if why is not None:
                            yield _late(
                                now_s, queue, fresh, late_reject, why.predicted_ttft_ms, why.budget_ms, why
                            )
                        elif (
                            for_g and (low := overlong(queue, drain, r, t, front, now_s, front_n)) is not None
                        ):
                            yield _shed(queue, fresh, low)
                    return
                scanning = True
            targets = resolve_targets(request, queue.default_ttft_ms, queue.default_tpot_ms, now_s)
            why = hopeless(drain, request, targets, ahead, now_s, ahead_n) if targets.ttft_ms > 0 else None
            if why is not None:
                yield _late(now_s, queue, entry, late_reject, why.predicted_ttft_ms, why.budget_ms, why)
            elif (
                for_g and (low := overlong(queue, drain, request, targets, ahead, now_s, ahead_n)) is not None
            ):
                yield _shed(queue, entry, low)
            else:
                ahead += queue.work_tokens(entry)
                ahead_n += 1
            continue
        targets = resolve_targets(request, queue.default_ttft_ms, queue.default_tpot_ms, now_s)
        if not drained:
            drained = True
            try:
                first = source()
                view = first if isinstance(first, ClusterView) else scheduler.view(first, now_s)
                drain = FleetDrain.of(
                    scheduler, view, now_s, queue.drain_rate(now_s), queue.drain_request_rate(now_s)
                )
                table = view.instances
                only_neutral = _only_neutral(table)
            except SchedulingError:  # no fleet to judge by: the decision below reports it
                drain = None
        in_front, in_front_n = ahead, ahead_n  # prompt tokens (entries) in front of this entry
        if not entry.late and drain is not None and targets.ttft_ms > 0:
            why = hopeless(drain, request, targets, ahead, now_s, ahead_n)
            if why is not None:  # late now rather than at its deadline
                yield _late(now_s, queue, entry, late_reject, why.predicted_ttft_ms, why.budget_ms, why)
                continue
            ahead += queue.work_tokens(entry)
            ahead_n += 1
        if for_g and not entry.late and drain is not None:
            low = overlong(queue, drain, request, targets, in_front, now_s, in_front_n)
            if low is not None:  # requests keep missing: the longest go first, even if placeable now
                yield _shed(queue, entry, low)
                continue
        limit = queue.release_limit_ms(now_s, request.priority, targets.full_ttft_ms)
        yielding = False
        seen_view: ClusterView | None = None  # the view this attempt decides on, once fetched
        if entry.late and drain is not None and entry.late_until_s < math.inf:
            # Served late only while a placement is in sight: behind every on-time entry and the
            # late ones before it, at the fleet's rate, its first token must still come by the end
            # of its late allowance; otherwise it is refused now, not when the allowance runs out.
            own_ms = drain.idle_ms(drain.compute_tokens(request))
            start_ms = drain.start_ms(ahead + late_ahead, ahead_n + late_ahead_n) + own_ms
            if now_s + start_ms * 1e-3 > entry.late_until_s:
                queue.remove(entry.request_id)
                parts = _InSight(drain, ahead + late_ahead, ahead_n + late_ahead_n, own_ms)
                yield _lapse(queue, entry, now_s, start_ms, parts)
                continue
            late_ahead += queue.work_tokens(entry)
            late_ahead_n += 1
        if entry.late:
            own_ms = math.nan  # best-effort work: its margin is not waived
            floor = _idle_floor_ms(scheduler, request, drain)
            if not math.isfinite(floor):  # no predictor: no TTFT threshold to bound
                bound = targets.full_ttft_ms
            elif math.isfinite(limit):
                bound = max(queue.config.priority_headroom * limit, floor)
            else:  # no on-time traffic to yield to
                bound = max(targets.full_ttft_ms, floor)
        else:
            # Its prefill on an idle instance: the release floor's base, and (binpack) how long it can
            # still wait at best (RouterQueue.margin_waived).
            own_ms = drain.idle_ms(drain.compute_tokens(request)) if drain is not None else math.nan
            floor = IDLE_SLACK * own_ms if drain is not None else 0.0
            # A request whose own prefill cannot fit under the release limit (a long prompt yielding
            # to tighter traffic) may still take a nearly idle instance while another one stays idle
            # for the tight arrivals release control keeps room for, as late work does: otherwise it
            # would wait out its whole deadline on a fleet with room to spare.
            yielding = drain is not None and limit < floor and limit < targets.ttft_ms
            if yielding:
                # Judged on the fleet as this attempt sees it (dispatches earlier in the pass count).
                current = source()
                seen_view = current if isinstance(current, ClusterView) else scheduler.view(current, now_s)
                if (
                    last_view is None
                    or last_view.instances is not seen_view.instances
                    or last_view.inflight is not seen_view.inflight
                ):
                    last_view, last_drain = seen_view, FleetDrain.of(scheduler, seen_view, now_s)
                now_drain = last_drain
                yielding = now_drain is not None and now_drain.free_within(limit) >= SPARE_IDLE_INSTANCES
            if yielding:
                limit = floor
            bound = min(targets.ttft_ms, limit)
            if targets.ttft_ms <= 0:
                yield _late(now_s, queue, entry, late_reject, math.nan, targets.ttft_ms)
                continue
        waived = packs and queue.margin_waived(entry, targets, now_s, math.nan if yielding else own_ms)
        memo = entry.refusal
        if memo is not None and isinstance(epoch, LazyEpoch):
            epoch = epoch()
        matched: Mapping[str, int] | None = None
        if epoch is not None and scheduler.prefix is not None and request.prefix_hashes:
            matched = scheduler.prefix.matched_blocks(request.prefix_hashes)
        if (
            memo is not None
            and isinstance(epoch, int)
            and memo.holds(epoch, now_s * 1e3, bound, entry.late, yielding, matched, version, waived)
        ):
            # Certain to be refused again. What the decision would also say is whether an on-time
            # entry is late now (its best predicted TTFT past its budget): certain when the best
            # predicted then, less the time since, is past it; otherwise unknown (the load may have
            # grown), and the decision is made after all.
            best = memo.predicted_ttft_ms
            if entry.late or best != best:
                failures += 1
                if not entry.late:
                    state.wait(bound, targets.ttft_ms, best, yielding)
                yield Offer(entry, Verdict.WAIT, error=memo.error, budget_ms=targets.ttft_ms)
                continue
            best -= now_s * 1e3 - memo.at_ms
            if best >= targets.ttft_ms:
                yield _late(now_s, queue, entry, late_reject, best, targets.ttft_ms)
                continue

        memo_key = (epoch, now_s * 1e3, bound, yielding, matched, waived)
        # On a fleet of neutral instances only, late and yielding work lands on a neutral instance
        # whatever the decision, where it is held to the tighter TPOT below: it is decided with that
        # target at once (one decision, the one the second would have been) instead of twice.
        direct = (entry.late or yielding) and only_neutral
        # (Built directly: ``dataclasses.replace`` cost more than the rest of this step per request.)
        offered = Targets(bound, targets.tpot_ms, targets.e2e_ms, targets.full_ttft_ms, waived)
        if direct:
            offered = Targets(
                bound, LATE_TPOT_FRACTION * targets.tpot_ms, targets.e2e_ms, targets.full_ttft_ms, waived
            )
        hold = None if epoch is None or memo is None else memo.hold
        if memo is not None and hold is not None:
            # The last refusal fell to the TTFT and TPOT thresholds alone: whether it holds, and
            # whether the entry is late now, from those two metrics on the view of now.
            current = source()
            seen_view = current if isinstance(current, ClusterView) else scheduler.view(current, now_s)
            held = hold.check(scheduler, seen_view, request, now_s, offered, entry.late)
            if held is not None:
                queue.held += 1
                if not entry.late and held == held and held >= targets.ttft_ms:
                    yield _late(now_s, queue, entry, late_reject, held, targets.ttft_ms)
                    continue
                failures += 1
                if not entry.late:
                    state.wait(bound, targets.ttft_ms, held, yielding)
                _remember(entry, memo_key, held, memo.error, False, version, hold)
                refused_here.append(
                    _Refused(request, offered, now_s * 1e3, entry.late, yielding, held, memo.error)
                )
                yield Offer(
                    entry, Verdict.WAIT, error=memo.error, predicted_ttft_ms=held, budget_ms=targets.ttft_ms
                )
                continue
        if refused_here and isinstance(epoch, LazyEpoch):
            epoch = epoch()
        if refused_here and epoch is not None and matched is None:
            easier = next(
                (
                    a
                    for a in refused_here
                    if _no_easier(request, offered, now_s * 1e3, entry.late, yielding, a)
                ),
                None,
            )
            if easier is not None:
                # An easier request was refused earlier in this pass on a fleet no heavier. Its best
                # predicted TTFT is at most this one's: past this one's budget, this one is late;
                # otherwise whether it is late is unknown unless it is already late.
                if not entry.late and easier.best == easier.best and easier.best >= targets.ttft_ms:
                    yield _late(now_s, queue, entry, late_reject, easier.best, targets.ttft_ms)
                    continue
                if entry.late or easier.best != easier.best:
                    failures += 1
                    if not entry.late:
                        state.wait(bound, targets.ttft_ms, easier.best, yielding)
                    _remember(entry, memo_key, easier.best, easier.error, easier.free, version)
                    yield Offer(entry, Verdict.WAIT, error=easier.error, budget_ms=targets.ttft_ms)
                    continue
        try:
            decision = schedule(source() if seen_view is None else seen_view, request, now_s, targets=offered)
        except NoInstanceError as exc:
            best = _best_ttft(exc)
            if not entry.late and best == best and best >= targets.ttft_ms:
                yield _late(now_s, queue, entry, late_reject, best, targets.ttft_ms)
                continue
            failures += 1
            if not entry.late:
                state.wait(bound, targets.ttft_ms, best, yielding)
            free = epoch is not None and bound_free(scheduler, exc)
            hold = None if epoch is None else ThresholdHold.of(exc, request)
            _remember(entry, memo_key, best, exc, free, version, hold)
            refused_here.append(
                _Refused(request, offered, now_s * 1e3, entry.late, yielding, best, exc, free)
            )
            yield Offer(entry, Verdict.WAIT, error=exc, predicted_ttft_ms=best, budget_ms=targets.ttft_ms)
            continue
        except EmptyClusterError as exc:
            queue.remove(entry.request_id)
            yield Offer(entry, Verdict.REJECT, error=exc)
            continue
        if direct:
            pass
        elif (entry.late or yielding) and decision.mode is Mode.NEUTRAL:
            # On a neutral instance its prefill runs between the decode steps of every request there,
            # which the TPOT prediction of the batch does not cover: such work keeps clear of the
            # target (and takes what the fallback passes give, as before).
            neutral = replace(offered, tpot_ms=LATE_TPOT_FRACTION * offered.tpot_ms)
            try:
                decision = schedule(source(), request, now_s, targets=neutral)
            except NoInstanceError as exc:
                failures += 1
                if not entry.late:
                    state.wait(bound, targets.ttft_ms, math.nan, yielding)
                # (No late check on this miss, as before: remembered without its best TTFT.)
                _remember(entry, memo_key, error=exc)
                yield Offer(
                    entry,
                    Verdict.WAIT,
                    error=exc,
                    predicted_ttft_ms=_best_ttft(exc),
                    budget_ms=targets.ttft_ms,
                )
                continue
        elif (entry.late or yielding) and _relaxed(decision):
            # Work that yields (late, or a long prompt past the release limit) takes only a placement
            # that keeps every promise; the fallback passes (KV over life, the safety valve dropped)
            # are for on-time work that cannot wait.
            failures += 1
            if not entry.late:
                state.wait(bound, targets.ttft_ms, math.nan, yielding)
            _remember(entry, memo_key)
            refused_here.append(_Refused(request, offered, now_s * 1e3, entry.late, yielding, math.nan, None))
            yield Offer(entry, Verdict.WAIT, budget_ms=targets.ttft_ms)
            continue
        failures = 0
        queue.remove(entry.request_id)
        work = queue.work_tokens(entry)
        queue.note_dispatch(now_s, work)
        dispatched += work
        dispatched_n += 1
        yield Offer(entry, Verdict.DISPATCH, decision=decision, budget_ms=targets.ttft_ms)
    queue.scanned(now_s)  # every entry was judged


@dataclass(frozen=True, slots=True)
class _Refused:
    """A failed attempt of an offer pass: the request, the targets it was offered, how, and the miss."""

    request: ScheduleInput
    targets: Targets
    #: When it was made (ms on the caller's clock).
    at_ms: float
    late: bool
    yielding: bool
    best: float
    error: SchedulingError | None
    #: The bound played no part in the failure (:func:`bound_free`).
    free: bool = False


def _no_easier(
    request: ScheduleInput, offered: Targets, at_ms: float, late: bool, yielding: bool, a: _Refused
) -> bool:
    """Whether ``request``, offered ``offered`` at ``at_ms``, is certain to be refused
    wherever ``a`` was: offered the same way, no easier in anything a decision reads (prompt, output
    estimate and bound, max tokens, targets, deadline), with nothing that may favour one instance for
    it alone (a prefix, excluded instances). Decisions are monotone in each of these."""
    r = a.request
    if (
        late != a.late
        or yielding != a.yielding
        or offered.margin_waived != a.targets.margin_waived
        or request.prefix_hashes
        or r.prefix_hashes
        or request.exclude_instance_ids
        or r.exclude_instance_ids
        or request.model != r.model
        or request.stages != r.stages
        or (request.ttft_slo_ms == 0) != (r.ttft_slo_ms == 0)
        or (request.tpot_slo_ms == 0) != (r.tpot_slo_ms == 0)
        or (request.e2e_slo_ms == 0) != (r.e2e_slo_ms == 0)
        or (request.expected_output_tokens is None) != (r.expected_output_tokens is None)
        or (request.output_tokens_bound is None) != (r.output_tokens_bound is None)
    ):
        return False
    if not (
        request.prompt_tokens >= r.prompt_tokens
        and request.max_tokens >= r.max_tokens
        and (request.expected_output_tokens or 0) >= (r.expected_output_tokens or 0)
        and (request.output_tokens_bound or 0) >= (r.output_tokens_bound or 0)
        and (a.free or offered.ttft_ms + at_ms <= a.targets.ttft_ms + a.at_ms)
        and offered.tpot_ms <= a.targets.tpot_ms
    ):
        return False
    if request.e2e_slo_ms > 0:
        if request.arrival_s is None or r.arrival_s is None:
            return False
        return request.arrival_s + request.e2e_slo_ms * 1e-3 <= r.arrival_s + r.e2e_slo_ms * 1e-3
    return True


def _remember(
    entry: QueueEntry,
    key: tuple[int | LazyEpoch | None, float, float, bool, Mapping[str, int] | None, bool],
    best: float = math.nan,
    error: SchedulingError | None = None,
    free: bool = False,
    version: int = -1,
    hold: ThresholdHold | None = None,
) -> None:
    """Keep ``entry``'s failed attempt (``key``: the epoch, time, bound, yielding flag, matched
    blocks and pace waiver it was made with) for the next pass, when incremental dispatch is on (an
    epoch is given)."""
    epoch, at_ms, bound, yielding, matched, waived = key
    if isinstance(epoch, LazyEpoch):
        epoch = epoch()
    if epoch is not None:
        entry.refusal = Refusal(
            epoch, at_ms, bound, entry.late, yielding, best, error, matched, free, version, hold, waived
        )


#: The threshold filters whose verdict on an instance does not read the TTFT bound a decision is
#: offered: (``slo`` target, metric) of :class:`router.core.filters.MetricThreshold`. The TPOT of
#: the batch with the request in it, and that of the residents, read the load, the prompt and the
#: TPOT targets only (the ``tpot_packing`` target does read the TTFT need: not listed).
_BOUND_FREE_THRESHOLDS = frozenset(
    {
        ("tpot", "predicted_tpot"),
        ("tpot", "predicted_tpot_after_slot_wait"),
        ("tpot_residents", "predicted_tpot_residents"),
    }
)


#: Per stage spec (by id, the spec kept to hold its id): the labels :func:`bound_free` accepts.
_FREE_LABELS: dict[int, tuple[Any, frozenset[str]]] = {}


def bound_free(scheduler: Scheduler, exc: NoInstanceError) -> bool:
    """Whether a failed decision failed whatever its TTFT bound: every candidate was dropped first
    (in chain order, every filter counted) by a threshold of :data:`_BOUND_FREE_THRESHOLDS` that
    applies in every pass (``relax_pass`` 0), or by the request's own exclusions.

    Why that is enough: such a filter drops the instance again, in every pass, in a decision with
    any other TTFT bound on a fleet no lighter and TPOT targets no looser (the decisions are
    monotone in load: :class:`LoadWatch`), unless the chain skips it, which it does only once every
    candidate is already out for every pass (``chain._evaluate``). So in the same epoch no bound
    lets the request through, and the refused entry's release limit growing with time (its bound
    as a moment moving later) is no reason to decide it again. Conservative: an instance dropped
    first by the TTFT threshold, or by any filter not listed, makes the failure depend on the bound.
    """
    try:
        spec = scheduler.policy.spec(Stage(exc.stage))
    except ValueError:
        return False
    found = _FREE_LABELS.get(id(spec))
    if found is None or found[0] is not spec:
        free = {EXCLUDED}
        other: set[str] = set()  # (a label two filters share counts only if both qualify)
        for f in spec.filters:
            key = (getattr(f, "slo", None), getattr(f, "metric", None))
            (free if key in _BOUND_FREE_THRESHOLDS and f.relax_pass == 0 else other).add(f.label)
        other.update(g.label for g in spec.global_filters)
        if len(_FREE_LABELS) >= 64:  # (a few policies per process; bounded all the same)
            _FREE_LABELS.clear()
        found = _FREE_LABELS[id(spec)] = (spec, frozenset(free - other))
    labels = found[1]
    drops = exc.drops
    return bool(drops) and all(label in labels for label in drops)


#: The threshold filters a :class:`ThresholdHold` re-checks: (``slo`` target, metric) of
#: :class:`router.core.filters.MetricThreshold`: the request's TTFT bound, its TPOT target and the
#: residents' TPOT with it.
_HOLD_THRESHOLDS = frozenset(
    {("ttft", "predicted_ttft"), ("tpot", "predicted_tpot"), ("tpot_residents", "predicted_tpot_residents")}
)


#: Per stage spec (by id, the spec kept to hold its id): the thresholds a hold re-checks (label →
#: filter), or None where the spec has a filter the hold cannot evaluate alone (see :func:`_hold_spec`).
_HOLD_SPECS: dict[int, tuple[Any, dict[str, Any] | None]] = {}


def _hold_spec(spec: Any) -> dict[str, Any] | None:
    """For a stage spec: its thresholds of :data:`_HOLD_THRESHOLDS` that apply in every pass and do not
    let empty instances through (label → filter), or None when it has none, or a filter other than
    threshold filters, Schedulability and Staleness, or a global filter other than Failover (the
    eligible candidates a hold computes are those of these filters alone)."""
    found = _HOLD_SPECS.get(id(spec))
    if found is not None and found[0] is spec:
        return found[1]
    held: dict[str, Any] = {}
    other: set[str] = set()
    ok = True
    explainers = {id(f) for f in spec.explainers}
    for f in spec.filters:
        kind = type(f).__name__
        if kind == "MetricThreshold" and id(f) in explainers:
            key = (f.slo, f.metric)
            if key in _HOLD_THRESHOLDS and f.relax_pass == 0 and not f.empty_passes:
                held[f.label] = f
            else:
                other.add(f.label)
        elif kind in ("Schedulability", "Staleness"):
            other.add(f.label)
        else:
            ok = False
    for g in spec.global_filters:
        ok = ok and type(g).__name__ == "Failover"
        other.add(g.label)
    # Checked in this order (the check stops once every candidate is out): the TPOT column, which
    # drops most refused requests, then the TTFT one, then the residents' TPOT.
    rank = {"predicted_tpot": 0, "predicted_ttft": 1}
    ordered = sorted(held.items(), key=lambda item: rank.get(item[1].metric, 2))
    result = {k: f for k, f in ordered if k not in other} if ok else None
    if not result:
        result = None
    if len(_HOLD_SPECS) >= 64:  # (a few policies per process; bounded all the same)
        _HOLD_SPECS.clear()
    _HOLD_SPECS[id(spec)] = (spec, result)
    return result


@dataclass(frozen=True, slots=True, eq=False)
class ThresholdHold:
    """A refusal on a fleet of neutral instances whose every candidate fell first to the TTFT, the TPOT
    or the residents' TPOT threshold: whether it holds is checked on the fleet of now by those alone.

    Why exact. Those thresholds apply in every pass (relax pass 0) and never let an instance
    through for being empty, so an instance either of them drops now is out of every pass of a
    decision now; when every candidate is, the decision fails, whatever the other filters and the
    selector would say (:func:`router.core.chain.run_stage`). The check computes those metric
    columns of the decision itself (:meth:`Scheduler.context` with the targets the decision would be
    offered) on the view the decision would read, and compares them with the filters' own bounds.
    It needs no load epoch, so it holds a refusal across every change that lets no instance pass:
    a completion elsewhere, a prefill progressing on an instance the TPOT threshold keeps out, a
    calibration change.

    What the decision would also report, the best predicted TTFT over the candidates only
    thresholds dropped (an on-time entry whose best is past its budget turns late), is computed as
    :func:`router.core.chain._failure` computes it: the candidates, less the request's exclusions,
    kept by the stage's other filters (Schedulability, Staleness, Failover: :func:`_hold_spec`).
    """

    request: ScheduleInput
    spec: Any
    ids: tuple[str, ...]
    candidates: BoolArray
    thresholds: dict[str, Any]

    @staticmethod
    def of(exc: NoInstanceError, request: ScheduleInput) -> ThresholdHold | None:
        """The hold of a failed decision, or None when it is not one of that kind."""
        failure = getattr(exc, "failure", None)
        if not isinstance(failure, StageFailure) or exc.stage != Stage.NEUTRAL.value:
            return None
        thresholds = _hold_spec(failure.spec)
        if thresholds is None:
            return None
        table = failure.ctx.view.instances
        if not bool((table.roles == int(Role.NEUTRAL)).all()):
            return None
        drops = exc.drops
        if not drops or not all(label in thresholds for label in drops):
            return None
        return ThresholdHold(request, failure.spec, table.ids, failure.outcome.candidate_mask, thresholds)

    def check(
        self,
        scheduler: Scheduler,
        view: ClusterView,
        request: ScheduleInput,
        now_s: float,
        targets: Targets,
        late: bool = False,
    ) -> float | None:
        """None when a decision for ``request`` offered ``targets`` on ``view`` at ``now_s`` might not
        fail; else the best predicted TTFT it would report (NaN: none, or not asked for: ``late``, an
        entry already late, whose refusal reads no TTFT)."""
        table = view.instances
        if request is not self.request or table.ids != self.ids:
            return None
        if scheduler.policy.spec(Stage.NEUTRAL) is not self.spec:
            return None
        if not bool((table.roles == int(Role.NEUTRAL)).all()):
            return None
        ctx = scheduler.context(view, request, now_s, targets)
        if not np.count_nonzero(self.candidates & ctx.usable()):
            return None  # no usable candidate: the decision reports that instead (chain._failure)
        out = ~self.candidates
        for f in self.thresholds.values():
            out = out | ~(ctx.metric(f.metric) < np.array(f.bound(ctx)))
            if bool(out.all()):
                break
        else:
            return None
        if (
            late
            or ctx.predictors is None
            or not any(getattr(m, "metric", None) in TTFT_METRICS for m in self.spec.explainers)
        ):
            return math.nan
        eligible = self.candidates
        if request.exclude_instance_ids:
            eligible = eligible.copy()
            for instance_id in request.exclude_instance_ids:
                i = table.index.get(instance_id)
                if i is not None:
                    eligible[i] = False
        explainers = {id(f) for f in self.spec.explainers}
        marked = table.all_false()
        for f in self.spec.filters:
            if id(f) in explainers:
                continue
            keep, mark = f.apply(ctx)
            eligible = eligible & keep
            if mark is not None and mark is not table.all_false():
                marked = marked | mark
        for g in self.spec.global_filters:
            eligible = eligible & g.apply_global(ctx, marked)
        values = ctx.metric("predicted_ttft")[eligible]
        values = values[~np.isnan(values)]
        return float(values.min()) if len(values) else math.nan


def _shed(queue: RouterQueue, entry: QueueEntry, why: Overlong) -> Offer:
    queue.remove(entry.request_id)
    queue.note_shed(entry.request_id)
    return Offer(
        entry,
        Verdict.REJECT,
        error=ShedError(
            f"request {entry.request_id!r} refused by the router queue (--queue-objective g): the fleet is "
            f"short and its best predicted completion, {why.remaining_ms:.0f} ms from now, is over the "
            f"{why.limit_ms:.0f} ms it now serves; retry later or with fewer max_tokens"
        ),
    )


def _idle_floor_ms(scheduler: Scheduler, request: ScheduleInput, drain: FleetDrain | None) -> float:
    if drain is not None:  # calibrated, like the decisions
        return 2.0 * drain.idle_ms(drain.compute_tokens(request))
    predictors = scheduler.predictors
    if predictors is None:
        return math.inf
    budget = scheduler.config.default_max_num_batched_tokens
    return 2.0 * float(predictors.default.predict_ttft_ms(request.prompt_tokens, 0, 0, budget))


@dataclass(frozen=True)
class _InSight:
    """What a late entry's best case was made of when it was refused (said in the refusal, so a user
    sees whether the fleet's backlog, the queue's recent drain or the request's own prefill decided)."""

    drain: FleetDrain
    #: Prompt tokens to prefill (:meth:`RouterQueue.work_tokens`) queued in front of it, in how many entries.
    tokens_ahead: float
    entries_ahead: int
    #: Its own prefill on an idle instance, less the longest prefix an instance is known to hold (ms).
    own_ms: float

    def describe(self) -> str:
        drain = self.drain
        drained = ""
        if drain.queue_rate is not None and self.tokens_ahead > 0:
            wait = self.tokens_ahead / drain.queue_rate
            if drain.queue_request_rate:
                wait = min(wait, self.entries_ahead / drain.queue_request_rate)
            drained = f", {wait:.0f} ms at the rate the queue drained lately"
        return (
            f" ({self.tokens_ahead:.0f} prompt tokens in {self.entries_ahead} requests queued in front: "
            f"{drain.fluid_start_ms(self.tokens_ahead):.0f} ms at the fleet's prefill rate{drained}; "
            f"its own prefill {self.own_ms:.0f} ms)"
        )


def _lapse(
    queue: RouterQueue,
    entry: QueueEntry,
    now_s: float,
    start_ms: float = math.nan,
    parts: _InSight | None = None,
) -> Offer:
    """Refuse late ``entry`` (already out of the queue) whose late allowance ended or cannot be kept."""
    request = entry.request
    if request.e2e_slo_ms > 0 and request.ttft_slo_ms == 0 and request.tpot_slo_ms == 0:
        kind, target = "e2e", request.e2e_slo_ms
    else:
        kind = "TTFT"
        target = resolve_targets(request, queue.default_ttft_ms, queue.default_tpot_ms).full_ttft_ms
    waited = (now_s - entry.enqueued_s) * 1e3
    if start_ms == start_ms:
        why = f"its first token could come {start_ms:.0f} ms from now at best, behind the requests queued before it,"
        if parts is not None:
            why = why[:-1] + parts.describe() + ","
    else:
        why = f"no instance could take it in {waited:.0f} ms of waiting,"
    error = LateError(
        f"request {entry.request_id!r} cannot meet its {kind} target of {target:.0f} ms, and {why} past "
        f"{queue.config.late_allowance:g}x that target beyond its deadline (--late-policy serve serves a late "
        "request only within --late-allowance); relax the target, retry later or add capacity"
    )
    return Offer(entry, Verdict.REJECT, error=error, predicted_ttft_ms=start_ms, budget_ms=math.nan)


def _late(
    now_s: float,
    queue: RouterQueue,
    entry: QueueEntry,
    reject: bool,
    predicted_ms: float,
    budget_ms: float,
    why: Hopeless | None = None,
) -> Offer:
    request = entry.request
    target = resolve_targets(request, queue.default_ttft_ms, queue.default_tpot_ms).full_ttft_ms
    queue.forget_arrival(entry.request_id)
    if not reject:
        queue.mark_late(entry.request_id, now_s)
        return Offer(entry, Verdict.LATE, predicted_ttft_ms=predicted_ms, budget_ms=budget_ms, hopeless=why)
    queue.remove(entry.request_id)
    if why is not None and why.e2e_ms == why.e2e_ms:
        message = (
            f"request {entry.request_id!r} cannot meet its e2e target of {why.e2e_ms:.0f} ms: best predicted "
            f"completion {why.predicted_e2e_ms:.0f} ms after arrival, behind the requests queued in front of it"
        )
    else:
        if why is not None:
            predicted = f"best predicted TTFT {predicted_ms:.0f} ms behind the requests queued in front of it"
        elif predicted_ms == predicted_ms:
            predicted = f"best predicted TTFT {predicted_ms:.0f} ms"
        else:
            predicted = "its deadline passed"
        message = (
            f"request {entry.request_id!r} cannot meet its TTFT target of {target:.0f} ms: {predicted} with "
            f"{max(budget_ms, 0.0):.0f} ms of the target left"
        )
    return Offer(
        entry,
        Verdict.REJECT,
        error=LateError(f"{message} (--late-policy reject; relax the target or retry later)"),
        predicted_ttft_ms=predicted_ms,
        budget_ms=budget_ms,
        hopeless=why,
    )
