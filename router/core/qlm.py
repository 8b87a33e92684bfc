"""QLM-style queue management: request groups, virtual queues, an RCT estimator, a plan generator, eviction.

Pure and synchronous, like :mod:`router.core.queue`: every method takes ``now_s``
from the caller (the router's clock or the simulator's virtual clock) and the
caller carries out what it returns, through the ``qlm`` dispatcher
(:mod:`router.core.dispatchers`): :mod:`router.admission` in the router,
:mod:`sim.cluster` in the simulator. Selected with ``--queue-policy qlm``.

The pieces, and how they are adapted to this router:

* **Request groups.** Waiting requests of the same model, SLO class, prompt
  length bucket and output length bucket (buckets are powers of
  ``--qlm-length-ratio``) share a group. The paper clusters the whole queue
  with k-means and halves oversized clusters; here requests arrive one at a time
  and groups that are already ordered must keep their identity, so the
  clustering is an online grid over the same features and a group that reaches
  its bound (delta = ``--qlm-group-factor`` x the instance's average batch;
  4, the paper's choice) is closed and a new one opened, which is the same split
  in arrival order. A group the plan expects late takes no newcomers. Inside a
  group requests are served first come first served.
* **Virtual queues.** One per instance: the order in which that instance pulls
  groups. A new group goes in deadline order (the plan generator's EDF step,
  taken at insertion) on the queue that frees first. A group one of whose
  requests has been pulled is *started* and stays on its instance (no
  preemptive migration, as in the paper).
* **RCT estimator.** A request's output length is unknown; per SLO class the
  estimator learns its mean and spread online from finished requests
  (:class:`OutputStats`; before any, ``max_tokens`` stands for the mean). An
  instance is ``batch`` slots (its average full batch, learned from the
  batches KV pulling reaches) each producing one token per decode step of
  ``decode_step_s`` (that batch's predicted step times the learned
  inefficiency factor, Eq. 4's epsilon), plus a prefill time per request: its
  token throughput is ``batch / decode_step_s`` and a request's start is when
  a slot frees, in virtual queue order, which is Eq. 2's tokens ahead over the
  throughput. Each duration has a mean and a spread; the check uses the
  ``--qlm-confidence`` quantile (Eq. 12's Delta) and adds spreads along a slot
  linearly. A request meets its deadline when its TTFT deadline (or, for an
  e2e-only request, its completion deadline) is after the quantile of its
  first-token (completion) time.
* **Plan generator.** Orders and assigns the unstarted groups over the virtual
  queues to maximise the requests of groups that meet their deadlines. The
  default is a heuristic: earliest-deadline-first assignment to the queue
  where the group finishes first (load balancing), with Moore–Hodgson's rule
  (when a group would miss, drop the least valuable group placed before it
  on that queue if that saves it; dropped groups go last). :func:`milp_plan`
  solves the paper's position-assignment program exactly with
  ``scipy.optimize.milp`` for small cases. The plan is re-run when, after an
  arrival or an eviction, the estimator predicts a violation the current
  plan did not already expect.
* **LSOs.** Request pulling (§5, §6): an instance pulls the next request of
  its virtual queue's head group while the tokens its running batch will hold
  at their end (prompt and output at the estimator's confidence) stay within
  its KV cache and its engine's sequence cap (:meth:`QlmQueue._room`); for
  streams judged on TPOT (this router's adaptation: the paper's SLOs are
  end-to-end) also while the grown batch's predicted step (the router's
  calibrated prediction, as the ``slo`` policy's) keeps the tightest
  TPOT target running or waiting in that queue; for e2e pulls also while
  the prefill a looser prompt queues in the engine turns no running e2e
  request late and the batch stays joinable for the tightest e2e class seen
  lately (the paper's prefill is a constant; here long prompts are not). An instance whose virtual
  queue is empty pulls the most urgent request waiting on the others. Load
  balancing: the plan moves unstarted groups between virtual queues. Request
  eviction (``--qlm-eviction on``): when the head group's next request cannot
  be pulled, would miss its deadline waiting for room and would meet it if it
  started now, running requests of looser e2e-only groups on that instance
  are evicted, loosest first, until it fits (at most ``--qlm-max-evictions``
  times per request, and only requests predicted to meet their own deadline
  after it, or to miss it anyway: :meth:`QlmQueue._survives`): the caller
  aborts them and they are queued again with their generated tokens appended
  to the prompt and ``max_tokens`` reduced by as many, so the client's stream
  loses and repeats nothing. Only e2e-only requests are evicted: a request
  judged on TTFT/TPOT streams to a reader, and a pause would break its TPOT.
  For a TTFT-judged head (this router's adaptation) a victim must still meet
  its deadline re-run behind the instance's whole virtual queue, not only
  behind the head (see :meth:`QlmQueue._start_behind`).

Late requests: the paper serves a group the plan expects late last; here,
as in the router queue, a request past its deadline that could no longer be
served within ``--late-allowance`` of its target beyond it is refused
(:meth:`QlmQueue.lapsed`): past capacity, served last still took a batch's
room from requests that could meet theirs.

Not built: model swapping and warm start (one model per fleet here), GPU–CPU
state swapping (the engines have no such operation).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import statistics
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from types import EllipsisType
from typing import Any, ClassVar

import numpy as np

from predictor import LatencyPredictor
from router.core.calibration import Correction
from router.core.errors import ConfigError
from router.core.flagged import FlagFields
from router.core.lengths import LengthDistribution, censored_distribution
from router.core.queue import IDLE_SLACK, SPARE_IDLE_INSTANCES
from router.core.request import ScheduleInput, resolve_targets

#: Share of a prompt an instance's prefix cache must hold for the request's group to go to its virtual
#: queue (:meth:`QlmQueue._home`).
HOME_CACHED_SHARE = 0.5


def _doc(doc: str, flag: str) -> dict[str, Any]:
    return {"doc": doc, "flag": flag}


@dataclass(frozen=True)
class QlmConfig(FlagFields):
    """Knobs of the ``qlm`` queue policy (flags of ``slo-router simulate``)."""

    FLAG_CHOICES: ClassVar[dict[str, list[str]]] = {
        "eviction": ["on", "off"],
        "solver": ["heuristic", "milp"],
        "lengths": ["censored", "finished"],
        "wait_margin": ["each", "sum"],
        "streams": ["edf", "qlm", "auto"],
    }

    batch: int = field(
        default=0,
        metadata=_doc(
            "a fixed count of requests an instance runs from its virtual queue at once (0 = none: an instance "
            "pulls while its running batch's tokens fit its KV cache, as seed 004 does, and, for streams "
            "judged on TPOT, while the grown batch's step keeps their target)",
            "--qlm-batch",
        ),
    )
    group_factor: int = field(
        default=4,
        metadata=_doc(
            "delta: a request group holds at most this many average batches of requests (the paper's "
            "choice, 4: finer groups cost plan time for no attainment, coarser ones lose it)",
            "--qlm-group-factor",
        ),
    )
    length_ratio: float = field(
        default=2.0,
        metadata=_doc("prompt and output length buckets of one group span this ratio", "--qlm-length-ratio"),
    )
    confidence: float = field(
        default=0.9,
        metadata=_doc(
            "a request counts as meeting its deadline when it does with at least this probability (the room "
            "a batch keeps for the tightest e2e class is sized at this quantile of its answer while the "
            "looser requests waiting can afford it, and down to its mean as they run out of slack; 0.7 "
            "trades points between mixes, docs/papers.md)",
            "--qlm-confidence",
        ),
    )
    eviction: str = field(
        default="on",
        metadata=_doc(
            "evict running loose requests for a tight group that would miss: on or off", "--qlm-eviction"
        ),
    )
    max_evictions: int = field(
        default=2, metadata=_doc("most times one request may be evicted", "--qlm-max-evictions")
    )
    solver: str = field(
        default="heuristic",
        metadata=_doc(
            "plan generator: heuristic (EDF + Moore-Hodgson) or milp (scipy.optimize.milp, small queues only)",
            "--qlm-solver",
        ),
    )
    lengths: str = field(
        default="finished",
        metadata=_doc(
            "a class's output lengths learned from its finished requests (finished; a running request is "
            "still counted at its expected length given how far it has got) or also from the running "
            "ones as lower bounds (censored, Kaplan-Meier: unbiased, but in simulation its longer "
            "estimates set off evictions that lost 2-10 points, docs/papers.md)",
            "--qlm-lengths",
        ),
    )
    wait_margin: str = field(
        default="each",
        metadata=_doc(
            "the estimator's margin on a wait: each (every request ahead at its own output quantile) or sum "
            "(one margin for the sum of the outputs ahead, the paper's Eq. 2-3; in simulation it traded "
            "points between mixes, +3.7 on one and -2.5 on another, docs/papers.md)",
            "--qlm-wait-margin",
        ),
    )
    streams: str = field(
        default="auto",
        metadata=_doc(
            "who orders and places the TTFT-judged requests: qlm (its virtual queues, beside the e2e "
            "groups), edf (the router queue in deadline order and the slo placement, as the default "
            "queue does; the virtual queues then hold the e2e-judged groups, the paper's scope, and count "
            "the streams running beside them) or auto (qlm while an e2e-judged request arrived in the "
            "last 30 s, else edf: with no e2e work the virtual queues have nothing to plan, and chat "
            "alone met 2.6 points less under qlm; edf too for a stream the prefix index finds part of "
            "cached, --prefix-cache-routing not off: the slo placement prices its cached prefix "
            "and the engine's backlog, Mooncake conversations met 76.5 against 68.9, edf 80.4). Use edf for "
            "streams past capacity beside a mid-deadline e2e class (long-prompt streams + 45 s reports: 1.3 points behind edf where "
            "qlm is 6.5); auto elsewhere (edf beside long-deadline batch work: 2.5-6 points behind, "
            "docs/papers.md)",
            "--qlm-streams",
        ),
    )
    milp_max_groups: int = field(
        default=12,
        metadata=_doc(
            "with --qlm-solver milp, more unstarted groups than this use the heuristic",
            "--qlm-milp-max-groups",
        ),
    )

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ConfigError:
            return ConfigError(f"{name}={getattr(self, name)!r}: {why}")

        if not 0 <= self.batch <= 4096:
            raise bad("batch", "must be within 0..4096 requests")
        if not 1 <= self.group_factor <= 64:
            raise bad("group_factor", "must be within 1..64")
        if not (1.0 < self.length_ratio <= 64.0):
            raise bad("length_ratio", "must be within (1, 64]")
        if not 0.5 <= self.confidence < 1.0:
            raise bad("confidence", "must be within [0.5, 1)")
        if self.eviction not in ("on", "off"):
            raise bad("eviction", "must be on or off")
        if not 0 <= self.max_evictions <= 16:
            raise bad("max_evictions", "must be within 0..16")
        if self.lengths not in ("censored", "finished"):
            raise bad("lengths", "must be censored or finished")
        if self.wait_margin not in ("each", "sum"):
            raise bad("wait_margin", "must be each or sum")
        if self.streams not in ("edf", "qlm", "auto"):
            raise bad("streams", "must be edf, qlm or auto")
        if self.solver not in ("heuristic", "milp"):
            raise bad("solver", "must be heuristic or milp")
        if not 1 <= self.milp_max_groups <= 24:
            raise bad("milp_max_groups", "must be within 1..24")

    @property
    def z(self) -> float:
        return statistics.NormalDist().inv_cdf(self.confidence)


# --------------------------------------------------------------------------- the RCT estimator's inputs


class OutputStats:
    """Output length per SLO class, learned online from the requests dispatched lately.

    What is learned is the fraction of ``max_tokens`` a request of the class
    generates (a mean and a spread): the paper fits the output length of a
    group offline; the fraction is the same statistic made independent of each
    request's own cap, which the router knows.

    The sample is a cohort by *start*: the last :attr:`MEMORY` requests of the
    class that were dispatched. A finished one counts at its length. With
    ``censored`` (``--qlm-lengths censored``) a running one counts too, at the
    length it has reached so far as a lower bound (:meth:`progress`), through
    the Kaplan–Meier estimate of
    :func:`router.core.lengths.censored_distribution`: learning from finished
    requests alone is biased short whenever many start together (the first
    wave of a run, a burst), because the short answers end first. Without it
    (the default) the class's distribution is the finished requests', and the
    bias is met where it did harm, per request: :meth:`given` answers for a
    running request *given how far it has got*, so one that has outlived
    every finished answer is expected to run about as long again, and KV
    pulling counts the batch at those expectations (:meth:`QlmQueue._batch_kv`).
    In simulation the censored class estimate was the accurate one (a mean of
    0.36 of ``max_tokens`` against the finished answers' 0.28) and still lost
    2-10 points: the estimator's longer durations set off evictions that did
    not pay (docs/papers.md). Before a class has :attr:`MIN_FINISHED`
    finished requests, a request is expected to use all of ``max_tokens``.
    """

    #: Requests per class in the cohort (the most recently dispatched ones).
    MEMORY = 512
    #: Finished requests a class needs before its figures are used.
    MIN_FINISHED = 2

    def __init__(self, censored: bool = False) -> None:
        #: Count the running members of the cohort as lower bounds (else finished requests only).
        self.censored = censored
        #: Per class: request id -> [final fraction or None while running, fraction reached so far].
        self._cohort: dict[str, dict[str, list[float | None]]] = {}
        self._finished: dict[str, int] = {}
        self._cache: dict[str, LengthDistribution] = {}
        self._moments: dict[str, tuple[float, float]] = {}
        #: Per class: the moments of :meth:`cautious` (dropped at every change of the class's cohort).
        self._bounds: dict[str, tuple[float, float]] = {}
        self._anon = 0
        #: Bumped by every change of an estimate (the estimator's duration memo is keyed on it).
        self.version = 0

    def _changed(self, slo_class: str) -> None:
        self._cache.pop(slo_class, None)
        self._bounds.pop(slo_class, None)
        self.version += 1

    def cautious(self, slo_class: str, max_tokens: int) -> tuple[float, float]:
        """(mean, standard deviation) of the output of a request of ``slo_class`` asking ``max_tokens``, its
        running members counted as lower bounds (Kaplan–Meier, as ``censored`` does) whatever the mode.

        For a bound that keeps room for a request not yet arrived (:meth:`QlmQueue._joinable`): the
        finished answers alone are the short ones in the first seconds of a run, and sized by them the
        room kept for a 15 s class was a third of what its answers took (a class of ~170-token answers
        estimated at 61 +- 26 tokens 3.7 s in: the looser class filled the batches, and the tight
        class then ran at 60-70 ms a token where ``edf`` ran it at 45, docs/papers.md). Every other
        rule keeps :meth:`estimate` (the censored estimate everywhere set off evictions that did not
        pay). Before :attr:`MIN_FINISHED` finished requests, ``max_tokens`` stands for the mean.
        """
        f = self._bounds.get(slo_class)
        if f is None:
            if self._finished.get(slo_class, 0) < self.MIN_FINISHED:
                return float(max_tokens), 0.0
            events: list[float] = []
            censored: list[float] = []
            for final, reached in self._cohort[slo_class].values():
                if final is not None:
                    events.append(final)
                else:
                    censored.append(reached or 0.0)
            f = self._bounds[slo_class] = censored_distribution(events, censored, 1.0).moments()
        return f[0] * max_tokens, f[1] * max_tokens

    def _entries(self, slo_class: str) -> dict[str, list[float | None]]:
        entries = self._cohort.setdefault(slo_class, {})
        return entries

    def _admit(self, slo_class: str, request_id: str, entry: list[float | None]) -> None:
        entries = self._entries(slo_class)
        entries[request_id] = entry
        while len(entries) > self.MEMORY:
            oldest = next(iter(entries))
            if entries.pop(oldest)[0] is not None:
                self._finished[slo_class] -= 1
        self._changed(slo_class)

    def started(self, slo_class: str, request_id: str) -> None:
        """``request_id`` of ``slo_class`` was dispatched: it joins the cohort as running (once)."""
        if request_id not in self._entries(slo_class):
            self._admit(slo_class, request_id, [None, 0.0])

    def progress(self, slo_class: str, request_id: str, fraction: float) -> None:
        """Running ``request_id`` has generated at least ``fraction`` of its ``max_tokens``."""
        entry = self._cohort.get(slo_class, {}).get(request_id)
        if entry is not None and entry[0] is None and fraction > (entry[1] or 0.0):
            entry[1] = min(max(fraction, 0.0), 1.0)
            self._bounds.pop(slo_class, None)  # the cautious estimate counts running ones in both modes
            if self.censored:  # else the estimate is the finished requests' alone: unchanged
                self._changed(slo_class)

    def dropped(self, slo_class: str, request_id: str) -> None:
        """``request_id`` failed while running: its length is unknown, it leaves the cohort."""
        entry = self._cohort.get(slo_class, {}).pop(request_id, None)
        if entry is not None:
            if entry[0] is not None:
                self._finished[slo_class] -= 1
            self._changed(slo_class)

    def observe(
        self, slo_class: str, output_tokens: int, max_tokens: int, request_id: str | None = None
    ) -> None:
        """A request of ``slo_class`` finished after ``output_tokens`` of its ``max_tokens``."""
        x = min(max(output_tokens / max(max_tokens, 1), 0.0), 1.0)
        entry = None if request_id is None else self._cohort.get(slo_class, {}).get(request_id)
        if entry is None:
            self._anon += 1
            self._admit(slo_class, request_id or f"\x00{self._anon}", [x, x])
        elif entry[0] is None:
            entry[0] = x
            self._changed(slo_class)
        else:
            return
        self._finished[slo_class] = self._finished.get(slo_class, 0) + 1

    def distribution(self, slo_class: str) -> LengthDistribution | None:
        """The class's output as a fraction of ``max_tokens``; None: too few finished yet."""
        cached = self._cache.get(slo_class)
        if cached is not None:
            return cached
        if self._finished.get(slo_class, 0) < self.MIN_FINISHED:
            return None
        events: list[float] = []
        censored: list[float] = []
        for final, reached in self._cohort[slo_class].values():
            if final is not None:
                events.append(final)
            elif self.censored:
                censored.append(reached or 0.0)
        value = self._cache[slo_class] = censored_distribution(events, censored, 1.0)
        self._moments[slo_class] = value.moments()
        return value

    def fraction(self, slo_class: str) -> tuple[float, float] | None:
        """(mean, standard deviation) of the class's output as a fraction of ``max_tokens``; None: too few finished."""
        if slo_class not in self._cache and self.distribution(slo_class) is None:
            return None
        return self._moments[slo_class]

    def estimate(self, slo_class: str, max_tokens: int) -> tuple[float, float]:
        """(mean, standard deviation) of the output of a request of ``slo_class`` asking ``max_tokens``."""
        f = self.fraction(slo_class)
        if f is None:
            return float(max_tokens), 0.0
        return f[0] * max_tokens, f[1] * max_tokens

    def given(self, slo_class: str, max_tokens: int, reached: float) -> tuple[float, float]:
        """(mean, standard deviation) of the whole output of a running request that has reached ``reached``
        (a fraction of ``max_tokens``): the conditional moments, so a request that has outlived the
        typical answer is expected to be a long one."""
        d = self.distribution(slo_class)
        if d is None:
            return float(max_tokens), 0.0
        mean, std = d.given(reached, 1.0)
        return mean * max_tokens, std * max_tokens


@dataclass(frozen=True)
class InstanceModel:
    """What the estimator knows of one instance: slots, decode step, prefill time."""

    batch: int
    #: Seconds per decode step with ``batch`` requests (each gets one token per step).
    decode_step_s: float
    #: Seconds to prefill a prompt of ``n`` tokens.
    prefill_s: Callable[[int], float]
    #: Most requests the engine runs at once (its ``max_num_seqs``); beyond ``batch`` only e2e-only requests.
    most: int = 0
    #: KV cache of the instance in tokens (0: unknown). Pulling is bounded by it (§6: a pull while the
    #: running batch's tokens are below the GPU's capacity).
    kv_tokens: int = 0
    #: Predicted decode step (s) of ``b`` requests holding ``t`` tokens (None: ``decode_step_s`` always).
    step_s: Callable[[int, float], float] | None = None
    #: Seconds a prompt of ``n`` tokens puts between the decode steps of the batch running (its prefill
    #: chunks' compute, without the decode part of those steps; None: not modelled).
    stall_s: Callable[[int], float] | None = None

    @property
    def throughput_tps(self) -> float:
        return self.batch / self.decode_step_s


#: Context tokens per running request assumed when sizing an instance's batch and decode step (the
#: simulator uses its workload's own mean instead).
DEFAULT_CONTEXT = 1024

#: The batch is sized so a pure decode step takes at most this fraction of the TPOT target: prefill
#: chunks of the requests it pulls share the steps (in simulation, 1.0 put a third of the tight class over
#: its TPOT target; 0.6 none).
TPOT_HEADROOM = 0.6

#: A batch that runs or expects TPOT-judged streams grows only while the step they would see (the batch
#: at its mean context over the newcomer's life, as the router's calibration predicts it: see
#: :meth:`QlmQueue._stream_step_s`) stays within this
#: fraction of their tightest TPOT target (see :meth:`QlmQueue._room`): 1.0, the ``slo`` policy's
#: default ``--tpot-slo-dispatch-threshold``.
STREAM_TPOT_SHARE = 1.0

#: A zero decode step, for :meth:`LatencyPredictor.chunked_prefill_ms` pricing a prefill stall alone.
_NO_STEP = np.asarray(0.0)

#: A TPOT target seen on an arrival keeps bounding every instance's batch for this long (s): the next
#: stream of that class must find a batch it can join at once (see :meth:`QlmQueue._room`).
STREAM_MEMORY_S = 30.0

#: The room a batch keeps for the tightest e2e class seen lately (:meth:`QlmQueue._joinable`) is kept only
#: while that class still arrives: while its silence is shorter than this many of its mean gaps between
#: arrivals (and :data:`STREAM_MEMORY_S` at most). A Poisson class is silent that long once in e^8 gaps.
QUIET_GAPS = 8.0


#: ... and at least this long (s): requests that arrive together (a burst) say nothing of the next gap.
QUIET_MIN_S = 2.0

#: The weight of the newest gap in a class's mean gap between arrivals (an exponential average).
GAP_WEIGHT = 0.1

#: The lowest standard score of the tightest e2e class's answer the room kept for it is sized at (see
#: :meth:`QlmQueue._protect_z`): 0, its mean answer.
PROTECT_FLOOR_Z = 0.0

#: The prefill load an instance's engine carries (the share of its time spent prefilling, see
#: :meth:`QlmQueue._prefill_load`) is counted at most this high: a step over ``1 - load`` stays finite.
PREFILL_LOAD_CAP = 0.9

#: Prefills sent to an instance remembered for its prefill load (at most; bounded state).
PREFILLS_MAX = 4096

#: At most this many distinct TPOT targets are remembered (bounded state; the tightest are kept).
STREAM_TARGETS_MAX = 64

#: The running requests' progress reaches the output statistics at most this often (s of the caller's
#: clock): each update re-estimates the lengths of the classes running.
PROGRESS_EVERY_S = 0.5

#: Late groups of one key merge only while the plan holds more groups than this (see
#: :meth:`QlmQueue._merge_late`): a heuristic plan over 64 groups on 4 instances costs ~30 ms of CPU
#: (`python -m bench qlm`), and its cost grows with the square of the groups. At 48 the merging set in
#: on an overloaded two-class mix and cost it 9.5 points; at 96 it does not, and an arrival at 512
#: queued costs 36 ms p50 (87 groups; 340 ms without merging).
MERGE_ABOVE_GROUPS = 96

#: A running request's progress (a fraction of its ``max_tokens``) is counted in steps of one in this many.
PROGRESS_STEPS = 64

#: Stream arrival times remembered for the reserve (at most; the last :data:`STREAM_MEMORY_S` of them).
STREAM_TIMES_MAX = 65536


class _Prefill:
    """Predicted prefill seconds beside a full decode batch (cached per 16-token bucket)."""

    def __init__(self, lp: LatencyPredictor, batch: int, context: float, budget: int) -> None:
        self.lp, self.batch, self.context, self.budget = lp, batch, context, budget
        self.cache: dict[int, float] = {}

    def __call__(self, tokens: int) -> float:
        key = tokens // 16
        value = self.cache.get(key)
        if value is None:
            ms = self.lp.predict_ttft_ms((key + 1) * 16, self.batch, self.batch * self.context, self.budget)
            value = self.cache[key] = float(ms) * 1e-3
        return value


def batch_for(lp: LatencyPredictor, tpot_ms: float, context: float, most: int) -> int:
    """The largest decode batch (<= ``most``) whose predicted step stays under the headroom of ``tpot_ms``."""
    best = 1
    for b in range(1, most + 1):
        if float(lp.predict_tpot_ms(b, b * context)) <= TPOT_HEADROOM * tpot_ms:
            best = b
        else:
            break
    return best


def instance_model(
    lp: LatencyPredictor,
    config: QlmConfig,
    tpot_ms: float,
    context: float = DEFAULT_CONTEXT,
    most: int = 256,
    budget: int = 2048,
    kv_tokens: int = 0,
) -> InstanceModel:
    """An instance's model from its profile: ``config.batch`` (or :func:`batch_for`) slots, step, prefill.

    ``most`` (the engine's ``max_num_seqs``) and ``kv_tokens`` (its KV cache) bound the requests it runs
    beyond ``batch`` when none of them has a TPOT target (with ``--qlm-batch`` set, ``batch`` is the bound).
    """
    if config.batch:
        most = config.batch
    if config.batch:
        batch = config.batch
    elif kv_tokens:
        # The batch the KV pulls to: as many requests of the typical context as the cache holds
        # (the paper's average batch size; the queue refines it online from the batches it sees).
        batch = max(min(most, int(kv_tokens // max(context, 1.0))), 1)
    else:
        batch = batch_for(lp, tpot_ms, context, most)
    step_s = float(lp.predict_tpot_ms(batch, batch * context)) * 1e-3

    def step(b: int, tokens: float) -> float:
        return float(lp.predict_tpot_ms(max(b, 1), tokens)) * 1e-3

    def stall(tokens: int) -> float:
        # The prefill parts of the chunks ``tokens`` puts between decode steps (no decode step added).
        ms = lp.chunked_prefill_ms(np.asarray(float(tokens)), _NO_STEP, np.asarray(float(budget)))
        return float(ms) * 1e-3

    return InstanceModel(batch, step_s, _Prefill(lp, batch, context, budget), most, kv_tokens, step, stall)


# --------------------------------------------------------------------------- requests and groups


@dataclass(eq=False)
class QlmRequest:
    """One request under QLM. ``prompt_tokens``/``max_tokens`` describe what the next dispatch runs."""

    request: ScheduleInput
    arrival_s: float
    #: The deadline the estimator checks (s): the TTFT deadline, or the completion one for e2e-only requests.
    deadline_s: float
    e2e_only: bool
    prompt_tokens: int
    max_tokens: int
    #: Tokens already generated and returned before an eviction (appended to the prompt of the next run).
    generated: int = 0
    evictions: int = 0
    token: Any = None
    group: int = -1
    instance: int = -1
    dispatched_s: float = math.nan
    #: How far it has got while running, a fraction of ``request.max_tokens`` (see :meth:`QlmQueue._progress`).
    reached: float = 0.0
    #: Its KV at its end as last computed: (stats version, reached, mean tokens, variance).
    kv_memo: tuple[int, float, float, float] | None = None
    #: The pure decode step (s) its instance's batch was predicted to take when it joined, itself included
    #: (nan: no step model); with the one at its end, what its tokens are expected to cost
    #: (:meth:`QlmQueue._learn_inefficiency`).
    step0_s: float = math.nan
    #: Its instance's decode clock (:meth:`QlmQueue._clock_at`) when its first token was due: the tokens it
    #: has generated since are the clock's advance (see :meth:`QlmQueue._progress`).
    clock0: float = math.nan
    #: The decode step (s) its deadline needs, set when it is pulled (e2e-judged requests; inf: none
    #: bounds the batch): see :meth:`QlmQueue._pace_s`.
    pace_s: float = math.inf
    #: Prompt tokens of its that other requests running on its instance hold in the engine's KV (shared
    #: prefix blocks: an engine with a prefix cache holds them once); its KV counts only the rest
    #: (:meth:`QlmQueue._kv`). Set when it starts, lowered when it becomes a block's last holder.
    shared: int = 0
    #: The instance whose prefix cache holds most of its prompt, where no other holds as much (-1: none):
    #: its group goes to that instance's virtual queue (:meth:`QlmQueue._new_group`).
    home: int = -1
    #: Per instance, the prompt tokens its prefix cache held when the request arrived (empty: none known).
    cached: tuple[float, ...] = ()

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def resumed(self) -> bool:
        """Evicted before: its first token already went out, only completion counts now."""
        return self.generated > 0


@dataclass(eq=False)
class Group:
    gid: int
    key: tuple[Any, ...]
    bound: int
    members: deque[QlmRequest] = field(default_factory=deque)
    #: The instance it started on (-1: not started; may move between virtual queues).
    pinned: int = -1
    closed: bool = False

    @property
    def deadline_s(self) -> float:
        return min(m.deadline_s for m in self.members) if self.members else math.inf

    @property
    def e2e_only(self) -> bool:
        return all(m.e2e_only for m in self.members)

    def urgency_s(self, now_s: float) -> float:
        """The plan's EDF key: the earliest deadline still ahead of ``now_s``; past ones sort after all."""
        ahead = [m.deadline_s for m in self.members if m.deadline_s > now_s]
        return min(ahead) if ahead else math.inf


# --------------------------------------------------------------------------- the estimator


@dataclass
class _Slots:
    """Free-at times (relative seconds) of an instance's slots: (quantile, mean, variance) triples.

    A slot's free time is the sum of the durations of the requests it runs in turn: Eq. 2's waiting
    time, the output tokens ahead over the throughput, each output normal (Eq. 3). With ``z`` > 0
    (``--qlm-wait-margin sum``) the sum is normal with the summed variance, so its quantile is the mean
    plus ``z`` standard deviations of the sum (the square root of the summed variances), and a
    request's end is its slot's wait and its own output summed the same way. With ``z`` = 0 (``each``,
    the default) the quantiles add: every request ahead at its own quantile, n spreads for n requests
    against the square root of n. The paper's form calls fewer groups late in a deep queue; measured,
    it moved points between mixes rather than adding them (docs/papers.md), so it is an option.
    """

    heap: list[tuple[float, float, float]]
    #: The confidence quantile's standard score (0: the quantiles add, as with no spread).
    z: float = 0.0

    @classmethod
    def of(cls, batch: int, busy: Sequence[tuple[float, float]], z: float = 0.0) -> _Slots:
        slots = cls([(0.0, 0.0, 0.0)] * max(batch, 1), z)
        # The heap orders on the pessimistic free time.
        for mean, q in sorted(busy, key=lambda x: x[1]):
            slots.take(mean, q)
        return slots

    def copy(self) -> _Slots:
        return _Slots(list(self.heap), self.z)

    def take(self, dur_mean: float, dur_q: float) -> tuple[float, float, float]:
        """Start a request of (mean, quantile) duration on the first free slot: its (mean, quantile) start
        and the quantile of its end."""
        q0, m0, v0 = heapq.heappop(self.heap)
        z = self.z
        m1 = m0 + dur_mean
        if z > 0:
            sd = (dur_q - dur_mean) / z
            v1 = v0 + sd * sd
            q1 = m1 + z * math.sqrt(v1)
        else:
            v1, q1 = v0, q0 + dur_q
        heapq.heappush(self.heap, (q1, m1, v1))
        return m0, q0, q1

    def finish_q(self) -> float:
        return max(e[0] for e in self.heap)


@dataclass(frozen=True)
class GroupEstimate:
    """The estimator's view of one group on one virtual queue (absolute seconds)."""

    gid: int
    start_mean_s: float
    start_q_s: float
    finish_mean_s: float
    finish_q_s: float
    #: Members predicted to meet their deadlines / all members.
    meeting: int
    size: int
    #: Members that meet their deadlines at the mean durations (not the confidence quantile).
    meeting_mean: int = 0

    @property
    def meets(self) -> bool:
        return self.meeting == self.size


class Estimator:
    """The RCT estimator: request durations from the instance model and output statistics."""

    #: Durations remembered (at most; then forgotten at once).
    MEMO_MAX = 65536

    def __init__(self, stats: OutputStats, z: float, wait_margin: str = "each") -> None:
        self.stats = stats
        self.z = z
        #: How a wait's margin adds up (``--qlm-wait-margin``): "sum" takes one for the sum of the outputs
        #: ahead (Eq. 2-3, :class:`_Slots`), "each" one per request ahead (each at its own quantile).
        self.wait_margin = wait_margin
        #: (id of model, id of request) -> (model, request, its lengths, stats version, duration). A plan
        #: places every group on every queue several times over; each request's duration changes only
        #: with its instance's model, the output statistics or its own lengths (an eviction), which the
        #: entry checks. The entry holds the objects, so their ids cannot be reused while it stands.
        self._memo: dict[tuple[int, int], tuple[Any, ...]] = {}

    def duration(self, model: InstanceModel, r: QlmRequest) -> tuple[float, float, float, float]:
        """(prefill mean, prefill quantile, whole mean, whole quantile) seconds of running ``r`` to the end."""
        key = (id(model), id(r))
        hit = self._memo.get(key)
        version = self.stats.version
        if (
            hit is not None
            and hit[0] is model
            and hit[1] is r
            and hit[2] == version
            and hit[3] == r.generated
            and hit[4] == r.prompt_tokens
            and hit[5] == r.max_tokens
        ):
            result: tuple[float, float, float, float] = hit[6]
            return result
        result = self._duration(model, r)
        if len(self._memo) >= self.MEMO_MAX:
            self._memo.clear()
        self._memo[key] = (model, r, version, r.generated, r.prompt_tokens, r.max_tokens, result)
        return result

    def _duration(self, model: InstanceModel, r: QlmRequest) -> tuple[float, float, float, float]:
        mean, std = self.stats.estimate(r.request.slo_class, r.request.max_tokens)
        remaining_mean = max(min(mean - r.generated, r.max_tokens), 1.0)
        remaining_q = max(min(mean + self.z * std - r.generated, r.max_tokens), 1.0)
        prefill = model.prefill_s(r.prompt_tokens)
        return (
            prefill,
            prefill,
            prefill + remaining_mean * model.decode_step_s,
            prefill + remaining_q * model.decode_step_s,
        )

    def remaining(self, model: InstanceModel, r: QlmRequest, now_s: float) -> tuple[float, float]:
        """(mean, quantile) seconds until running request ``r`` frees its slot (from its dispatch time)."""
        _, _, whole_mean, whole_q = self.duration(model, r)
        elapsed = max(now_s - r.dispatched_s, 0.0)
        return max(whole_mean - elapsed, 0.0), max(whole_q - elapsed, 0.0)

    def slots(self, model: InstanceModel, running: Sequence[QlmRequest], now_s: float) -> _Slots:
        z = self.z if self.wait_margin == "sum" else 0.0
        return _Slots.of(model.batch, [self.remaining(model, r, now_s) for r in running], z)

    def place(self, model: InstanceModel, slots: _Slots, group: Group, now_s: float) -> GroupEstimate:
        """Append ``group`` to ``slots`` (changed in place); its estimate."""
        start_m = start_q = finish_m = finish_q = math.nan
        meeting = meeting_mean = 0
        for k, r in enumerate(group.members):
            pre_m, pre_q, whole_m, whole_q = self.duration(model, r)
            m0, q0, q1 = slots.take(whole_m, whole_q)
            if k == 0:
                start_m, start_q = now_s + m0, now_s + q0
            end_m, end_q = now_s + m0 + whole_m, now_s + q1
            finish_m = end_m if k == 0 else max(finish_m, end_m)
            finish_q = end_q if k == 0 else max(finish_q, end_q)
            whole = r.e2e_only or r.resumed
            if (end_q if whole else now_s + q0 + pre_q) <= r.deadline_s:
                meeting += 1
            if (end_m if whole else now_s + m0 + pre_m) <= r.deadline_s:
                meeting_mean += 1
        return GroupEstimate(
            group.gid, start_m, start_q, finish_m, finish_q, meeting, len(group.members), meeting_mean
        )

    def queue(
        self, model: InstanceModel, running: Sequence[QlmRequest], groups: Sequence[Group], now_s: float
    ) -> list[GroupEstimate]:
        """Every group of one virtual queue, in order behind ``running``."""
        slots = self.slots(model, running, now_s)
        return [self.place(model, slots, g, now_s) for g in groups]


# --------------------------------------------------------------------------- the plan generator


@dataclass(frozen=True)
class Plan:
    """Group ids per virtual queue in order; the groups the plan expects to miss; requests expected on time."""

    order: tuple[tuple[int, ...], ...]
    late: frozenset[int]
    meeting: int


#: Moore–Hodgson's drop rule tries this many of the smallest earlier groups per queue.
RESCUE_CANDIDATES = 4
#: Plans over at most this many groups are then improved by insertion moves, at most this many passes
#: (each pass costs groups x positions queue estimates: cheap for small plans only).
LOCAL_SEARCH_GROUPS = 12
LOCAL_SEARCH_PASSES = 2


def heuristic_plan(
    estimator: Estimator,
    models: Sequence[InstanceModel],
    running: Sequence[Sequence[QlmRequest]],
    groups: Sequence[Group],
    now_s: float,
    evictable: Callable[[QlmRequest, Group], bool] | None = None,
) -> Plan:
    """EDF assignment to the queue where each group finishes first, with Moore–Hodgson's drop rule.

    A started group (``pinned`` >= 0) may only go to its own queue, but is
    ordered with the others (a tight group may go ahead of it; eviction then
    makes room). A group that would miss on every queue it may use may
    displace the least valuable (fewest requests) group placed before it on one
    queue when that lets it meet: on one machine this rule maximises the number
    of jobs on time; with weights and several machines it is a heuristic (its
    gap to :func:`milp_plan` is measured in the tests and by ``python -m bench qlm``).
    Dropped groups are still served, last, in deadline order. A group that
    meets on no queue even placed right behind the running requests at the
    confidence quantile, but does at the mean durations (the estimator's
    quantile duration outruns its deadline), is not dropped: it keeps
    its deadline-order place where it finishes first, the EDF fallback the paper
    names for when no plan meets every SLO (§A.3) and the least expected
    lateness for it (Eq. 13's objective). Moving it last saved no other request
    and cost it its likeliest chance: on an overloaded two-class mix every tight
    query the 0.9 quantile called late waited ~45 s behind the loose class
    (docs/papers.md). A group late even at the mean is dropped: kept in its
    deadline place, such groups delayed the ones that could still meet theirs
    and, past capacity, every group turned late behind them (chat at 1.3x
    capacity: 43 % against edf's 83 %, docs/papers.md). Plans of at most
    :data:`LOCAL_SEARCH_GROUPS` groups are then improved by moving single
    groups (:func:`_improve`). With
    ``evictable`` (eviction on), a group that misses behind the running
    requests may still go where it meets once the running requests
    ``evictable(request, group)`` are evicted: the plan counts on that LSO.
    """
    n = len(models)
    base = [estimator.slots(models[i], running[i], now_s) for i in range(n)]
    placed: list[list[Group]] = [[] for _ in range(n)]
    states = [b.copy() for b in base]
    dropped: list[Group] = []

    def allowed(g: Group) -> range:
        return range(g.pinned, g.pinned + 1) if g.pinned >= 0 else range(n)

    def late_at_quantile_only(g: Group) -> bool:
        """Placed right behind the running requests on any queue it may use, no member of ``g`` meets its
        deadline at the confidence quantile, but some member does at the mean durations."""
        front = [estimator.place(models[i], base[i].copy(), g, now_s) for i in allowed(g)]
        return all(e.meeting == 0 for e in front) and any(e.meeting_mean > 0 for e in front)

    for group in sorted(groups, key=lambda g: (g.urgency_s(now_s), g.gid)):
        # (requests on time, -finish, queue): most requests on time, then the earliest finish.
        best: tuple[int, float, int] = (0, -math.inf, -1)
        for i in allowed(group):
            est = estimator.place(models[i], states[i].copy(), group, now_s)
            best = max(best, (est.meeting, -est.finish_q_s, i))
        if best[0] < len(group.members) and evictable is not None:
            for i in allowed(group):
                keep = [r for r in running[i] if not evictable(r, group)]
                if len(keep) == len(running[i]):
                    continue
                trial = estimator.slots(models[i], keep, now_s)
                for g in placed[i]:
                    estimator.place(models[i], trial, g, now_s)
                est = estimator.place(models[i], trial, group, now_s)
                best = max(best, (est.meeting, -est.finish_q_s, i))
        if best[0] < len(group.members):
            # Moore–Hodgson: give up a smaller earlier group if that saves more of this one.
            rescue: tuple[int, int, int] | None = None
            for i in allowed(group):
                # The cheapest few candidates (fewest requests) bound the cost of a plan.
                candidates = sorted(range(len(placed[i])), key=lambda k: (len(placed[i][k].members), k))
                for k in candidates[:RESCUE_CANDIDATES]:
                    other = placed[i][k]
                    s = base[i].copy()
                    for j, g in enumerate(placed[i]):
                        if j != k:
                            estimator.place(models[i], s, g, now_s)
                    gain = estimator.place(models[i], s, group, now_s).meeting - best[0] - len(other.members)
                    if gain > 0 and (rescue is None or gain > rescue[0]):
                        rescue = (gain, i, k)
            if rescue is not None:
                _, i, k = rescue
                dropped.append(placed[i].pop(k))
                placed[i].append(group)
                s = base[i].copy()
                for g in placed[i]:
                    estimator.place(models[i], s, g, now_s)
                states[i] = s
                continue
        if best[0] > 0 or late_at_quantile_only(group):
            # On time somewhere: where most of it meets. Or on time nowhere at the confidence quantile,
            # not even first on a queue, but on time at the mean there (a tight class whose answer's
            # quantile outruns its deadline): it keeps its earliest-deadline place where it finishes
            # first (the paper's fallback when no plan meets every SLO, §A.3: EDF), since sending it
            # last saves no one and costs it its likeliest chance. A group late even at the mean, first
            # on every queue, is dropped (served last): in its EDF place it would only delay groups
            # that can still meet theirs, the domino of EDF in overload.
            i = best[2]
            estimator.place(models[i], states[i], group, now_s)
            placed[i].append(group)
            continue
        dropped.append(group)
    for group in sorted(dropped, key=lambda g: (g.deadline_s, g.gid)):
        i = min(allowed(group), key=lambda i: (states[i].finish_q(), i))
        estimator.place(models[i], states[i], group, now_s)
        placed[i].append(group)
    if len(groups) <= LOCAL_SEARCH_GROUPS:
        _improve(estimator, models, running, placed, allowed, now_s)
    order = tuple(tuple(g.gid for g in placed[i]) for i in range(n))
    meeting, late = evaluate(estimator, models, running, {g.gid: g for g in groups}, order, now_s)
    return Plan(order, late, meeting)


def _improve(
    estimator: Estimator,
    models: Sequence[InstanceModel],
    running: Sequence[Sequence[QlmRequest]],
    placed: list[list[Group]],
    allowed: Callable[[Group], range],
    now_s: float,
) -> None:
    """Insertion local search: move one group to another position (any allowed queue) while that helps."""

    def score(i: int, gs: Sequence[Group]) -> int:
        return sum(e.meeting for e in estimator.queue(models[i], running[i], gs, now_s))

    scores = [score(i, placed[i]) for i in range(len(models))]
    for _ in range(LOCAL_SEARCH_PASSES):
        moved = False
        for src in range(len(models)):
            k = 0
            while k < len(placed[src]):
                group = placed[src][k]
                rest = placed[src][:k] + placed[src][k + 1 :]
                rest_score = score(src, rest)
                best: tuple[int, int, int] | None = None  # (gain, queue, position)
                for dst in allowed(group):
                    base = rest if dst == src else placed[dst]
                    before = scores[src] + (0 if dst == src else scores[dst])
                    for pos in range(len(base) + 1):
                        if dst == src and pos == k:
                            continue
                        trial = [*base[:pos], group, *base[pos:]]
                        after = score(dst, trial) + (0 if dst == src else rest_score)
                        if after - before > 0 and (best is None or after - before > best[0]):
                            best = (after - before, dst, pos)
                if best is None:
                    k += 1
                    continue
                _, dst, pos = best
                if dst == src:
                    placed[src] = [*rest[:pos], group, *rest[pos:]]
                else:
                    placed[src] = rest
                    placed[dst] = [*placed[dst][:pos], group, *placed[dst][pos:]]
                    scores[dst] = score(dst, placed[dst])
                scores[src] = score(src, placed[src])
                moved = True
                k += 1
        if not moved:
            return


def evaluate(
    estimator: Estimator,
    models: Sequence[InstanceModel],
    running: Sequence[Sequence[QlmRequest]],
    groups: dict[int, Group],
    order: Sequence[Sequence[int]],
    now_s: float,
) -> tuple[int, frozenset[int]]:
    """Requests on time under ``order``, and the groups with a member predicted late."""
    meeting = 0
    late: set[int] = set()
    for i, gids in enumerate(order):
        for est in estimator.queue(models[i], running[i], [groups[g] for g in gids], now_s):
            meeting += est.meeting
            if not est.meets:
                late.add(est.gid)
    return meeting, frozenset(late)


def milp_plan(
    estimator: Estimator,
    models: Sequence[InstanceModel],
    running: Sequence[Sequence[QlmRequest]],
    groups: Sequence[Group],
    now_s: float,
) -> Plan:
    """The position-assignment program (binary x[q,i,j]: group i at position j of queue q), solved exactly.

    Exact for one-slot instances (``batch`` 1, where the estimator is the serial
    sum of the durations ahead, the paper's waiting time): group i on queue q
    takes ``dur[q,i]`` (the sum of its members' quantile durations) and its
    k-th member (groups run FCFS inside) is on time iff the group starts by
    ``latest[q][i][k]`` (its deadline minus its offset in the group).
    Maximises the requests on time (the paper minimises the groups' summed
    penalty; counting requests is the objective this router reports); big-M
    constraints tie each member's ``met`` to its group's start. A started
    group may only use its own queue. With more slots this is the serial
    relaxation and :func:`evaluate` re-scores its order.
    """
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp

    n_q, n_g = len(models), len(groups)
    if n_g == 0:
        return Plan(tuple(() for _ in models), frozenset(), 0)
    free0 = [min(e[0] for e in estimator.slots(models[i], running[i], now_s).heap) for i in range(n_q)]
    # Per queue and group: its duration, and per member the latest group start that keeps it on time.
    dur = np.zeros((n_q, n_g))
    latest: list[list[list[float]]] = [[[] for _ in range(n_g)] for _ in range(n_q)]
    for q in range(n_q):
        for i, g in enumerate(groups):
            offset = 0.0
            for r in g.members:
                _, pre_q, _, whole_q = estimator.duration(models[q], r)
                event = offset + (whole_q if r.e2e_only or r.resumed else pre_q)
                latest[q][i].append(r.deadline_s - now_s - event)
                offset += whole_q
            dur[q, i] = offset
    members = [(i, k) for i, g in enumerate(groups) for k in range(len(g.members))]
    n_j = n_g
    nx = n_q * n_g * n_j
    nv = nx + len(members)

    def xi(q: int, i: int, j: int) -> int:
        return (q * n_g + i) * n_j + j

    spread = max(abs(v) for per_q in latest for per_g in per_q for v in per_g)
    big = float(dur.sum() + max(free0) + spread + 1.0)
    rows: list[Any] = []
    lo: list[float] = []
    hi: list[float] = []
    upper = np.ones(nv)
    for i, g in enumerate(groups):  # each group at one position, of its own queue if started
        a = np.zeros(nv)
        for q in range(n_q):
            for j in range(n_j):
                a[xi(q, i, j)] = 1
                if g.pinned >= 0 and q != g.pinned:
                    upper[xi(q, i, j)] = 0
        rows.append(a)
        lo.append(1)
        hi.append(1)
    for q in range(n_q):  # at most one group per position
        for j in range(n_j):
            a = np.zeros(nv)
            for i in range(n_g):
                a[xi(q, i, j)] = 1
            rows.append(a)
            lo.append(0)
            hi.append(1)
    # Member m = (i, k) meets only if its group's start is early enough:
    # free0[q] + sum of durations before j - latest[q][i][k] <= M (2 - x[q,i,j] - met[m]).
    for q in range(n_q):
        for j in range(n_j):
            ahead = np.zeros(nv)
            for k in range(j):
                for i2 in range(n_g):
                    ahead[xi(q, i2, k)] += dur[q, i2]
            for m, (i, k) in enumerate(members):
                a = ahead.copy()
                a[xi(q, i, j)] += big
                a[nx + m] += big
                rows.append(a)
                lo.append(-np.inf)
                hi.append(2 * big + latest[q][i][k] - free0[q])
    c = np.zeros(nv)
    c[nx:] = -1.0
    res = milp(
        c,
        constraints=LinearConstraint(np.array(rows), np.array(lo), np.array(hi)),
        integrality=np.ones(nv),
        bounds=Bounds(np.zeros(nv), upper),
    )
    if res.x is None:  # pragma: no cover - always feasible (every met = 0)
        return heuristic_plan(estimator, models, running, groups, now_s)
    x = np.rint(res.x).astype(int)
    order = tuple(
        tuple(groups[i].gid for j in range(n_j) for i in range(n_g) if x[xi(q, i, j)]) for q in range(n_q)
    )
    meeting, late = evaluate(estimator, models, running, {g.gid: g for g in groups}, order, now_s)
    return Plan(order, late, meeting)


# --------------------------------------------------------------------------- the queue


@dataclass(frozen=True)
class Dispatch:
    """Run ``request`` on instance ``instance`` with ``request.prompt_tokens`` / ``request.max_tokens``."""

    request: QlmRequest
    instance: int


#: The caller's eviction: abort ``request`` running on ``instance`` now; returns the tokens it has generated
#: in total (so far, over all its runs), or None when it is no longer running there (finished meanwhile).
Evict = Callable[[QlmRequest, int], "int | None"]


class QlmQueue:
    """Request groups over one virtual queue per instance (see the module doc)."""

    def __init__(
        self,
        config: QlmConfig,
        models: Sequence[InstanceModel],
        default_ttft_ms: float,
        default_tpot_ms: float,
        *,
        max_queue_size: int = 4096,
        prefix_block_tokens: int = 0,
    ) -> None:
        if not models:
            raise ConfigError("qlm needs at least one instance")
        if prefix_block_tokens < 0:
            raise ConfigError(f"prefix_block_tokens must be >= 0, got {prefix_block_tokens}")
        self.config = config
        #: Tokens each of a request's ``prefix_hashes`` stands for (the router's prefix source's block; 0:
        #: the router knows nothing of the engines' prefix caches, so every prompt counts whole in the KV).
        self.prefix_block_tokens = prefix_block_tokens
        #: Per instance: how many running requests reference each prefix block hash (see :meth:`_shared_on`),
        #: and the running request each such block is counted with (its owner, whose KV includes it).
        self._held: list[Counter[int]] = [Counter() for _ in models]
        self._owner: list[dict[int, QlmRequest]] = [{} for _ in models]
        self.base_models = list(models)
        #: The models the estimator uses: each base model's decode step times the learned inefficiency.
        self.models = list(models)
        self.inefficiency = [1.0] * len(models)
        #: Per instance: the average full batch and context per request seen (see :meth:`_observe_batch`),
        #: and the decode step of that batch before the inefficiency factor.
        self.batch_seen = [float(m.batch) for m in models]
        self.context_seen = [float(DEFAULT_CONTEXT) for _ in models]
        #: Per instance: changes of its running batch (a dispatch, an end, an eviction), and the count at
        #: its last batch sample: one sample per batch, however often the caller pumps (see
        #: :meth:`_observe_batch`).
        self.batch_changes = [0] * len(models)
        #: Per instance: its decode clock, the tokens one request decoding there since the start would have
        #: generated: ``_clock`` at ``_clock_s``, then one token per ``_clock_step`` s, the step of the
        #: batch running (set at each change of it). See :meth:`_clock_at`.
        self._clock = [0.0] * len(models)
        self._clock_s = [0.0] * len(models)
        self._clock_step = [math.inf] * len(models)
        #: Queued requests by deadline (deadline, sequence, id; lazily pruned): the late path's candidates.
        self._deadlines: list[tuple[float, int, str]] = []
        self._deadline_seq = 0
        #: Queued requests whose deadline has passed (the late path checks these on every call).
        self._overdue: dict[str, QlmRequest] = {}
        self.batch_sampled = [-1] * len(models)
        #: Per instance: (when, seconds) of each prefill sent there lately: its engine's prefill load
        #: (:meth:`_prefill_load`).
        self._prefills: list[deque[tuple[float, float, float]]] = [deque(maxlen=PREFILLS_MAX) for _ in models]
        self.pure_step = [m.decode_step_s for m in models]
        self.default_ttft_ms = default_ttft_ms
        self.default_tpot_ms = default_tpot_ms
        self.max_queue_size = max_queue_size
        self.stats = OutputStats(censored=config.lengths == "censored")
        self.estimator = Estimator(self.stats, config.z, config.wait_margin)
        self.vqs: list[list[int]] = [[] for _ in models]
        self.groups: dict[int, Group] = {}
        self.open: dict[tuple[Any, ...], int] = {}
        self.queued: dict[str, QlmRequest] = {}
        self.running: list[dict[str, QlmRequest]] = [{} for _ in models]
        #: Per group: the requests the estimator expected to miss when the plan was made.
        self.expected_missing: dict[int, int] = {}
        self._gid = 0
        #: TPOT target (ms) of the streams that arrived lately -> when one last arrived (s).
        self.streams: dict[float, float] = {}
        #: TTFT target (s) of the streams that arrived lately -> when one last arrived (s).
        self._stream_ttfts: dict[float, float] = {}
        #: Arrival times of the streams of the last :data:`STREAM_MEMORY_S` (bounded), and the mean
        #: KV tokens (prompt + expected output) and expected output of a stream (exponential averages).
        self._stream_times: deque[float] = deque(maxlen=STREAM_TIMES_MAX)
        #: When a stream last arrived beside e2e work that the router queue places (:meth:`observe_stream`;
        #: -inf: none).
        self._placed_stream_s = -math.inf
        #: Per instance: the running batch's ends at the mean with each request's KV at its end, as of
        #: (now, batch changes, statistics version, estimator's step) (see :meth:`_kv_wait_s`).
        self._kv_ends: dict[int, tuple[tuple[float, int, int, float], list[tuple[float, float, float]]]] = {}
        self._stream_tokens = 0.0
        self._stream_output = 0.0
        #: e2e budget (s from arrival) of the e2e-only requests that arrived lately -> (when one last
        #: arrived, its class, prompt tokens, max_tokens): the tightest bounds looser pulls (see :meth:`_joinable`).
        self._e2e_budgets: dict[float, tuple[float, str, int, int]] = {}
        #: Per e2e budget: the mean gap (s) between its arrivals (an exponential average; see :data:`QUIET_GAPS`).
        self._e2e_gaps: dict[float, float] = {}
        #: When the running requests' progress last reached the output statistics (see :meth:`_progress`).
        self._progress_s = -math.inf
        #: Counters: plan runs, evictions, groups opened.
        self.plans = self.evictions = self.groups_made = 0
        #: The router's calibration of the instances' steps (rows in this queue's instance order), asked
        #: only when a stream-side check needs it (None: no calibration; see :meth:`_stream_step_s`). The
        #: caller sets it (the ``qlm`` dispatcher, from its scheduler's calibrator).
        self.calibration: Callable[[], Correction | None] | None = None
        #: Per instance (this queue's order), the prompt tokens of a request its prefix cache holds, from
        #: the router's prefix source (None: none known). The caller sets it (the ``qlm`` dispatcher).
        self.cached_prompt: Callable[[ScheduleInput], Sequence[float] | None] | None = None

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        return len(self.queued)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.queued

    def requests(self) -> Iterator[QlmRequest]:
        """Every queued request, virtual queue by virtual queue, in order."""
        for vq in self.vqs:
            for gid in vq:
                yield from self.groups[gid].members

    def estimates(self, now_s: float) -> list[list[GroupEstimate]]:
        return [
            self.estimator.queue(self.models[i], list(self.running[i].values()), self._groups(i), now_s)
            for i in range(len(self.models))
        ]

    def _groups(self, i: int) -> list[Group]:
        return [self.groups[g] for g in self.vqs[i]]

    # ------------------------------------------------------------------ arrivals

    def _key(self, r: QlmRequest) -> tuple[Any, ...]:
        ratio = math.log(self.config.length_ratio)
        req = r.request
        return (
            req.model,
            req.slo_class,
            r.e2e_only,
            r.home,
            int(math.log(max(r.prompt_tokens, 1)) / ratio),
            int(math.log(max(r.max_tokens, 1)) / ratio),
        )

    def make(self, request: ScheduleInput, now_s: float, token: Any = None) -> QlmRequest:
        arrival = request.arrival_s if request.arrival_s is not None else now_s
        targets = resolve_targets(request, self.default_ttft_ms, self.default_tpot_ms)
        only_e2e = request.e2e_slo_ms > 0 and request.ttft_slo_ms == 0 and request.tpot_slo_ms == 0
        deadline = arrival + (request.e2e_slo_ms if only_e2e else targets.full_ttft_ms) * 1e-3
        return QlmRequest(
            request=request,
            arrival_s=arrival,
            deadline_s=deadline,
            e2e_only=only_e2e,
            prompt_tokens=request.prompt_tokens,
            max_tokens=request.max_tokens,
            token=token,
        )

    def push(self, request: ScheduleInput, now_s: float, token: Any = None) -> QlmRequest | None:
        """Queue a new request; None when the queue is full (the caller refuses it).

        Raises ``ValueError`` for an id already queued or running.
        """
        rid = request.request_id
        if rid in self.queued or any(rid in run for run in self.running):
            raise ValueError(f"request {rid!r} is already queued or running")
        if len(self.queued) >= self.max_queue_size:
            return None
        r = self.make(request, now_s, token)
        r.home = self._home(r)
        if r.e2e_only:
            budgets = self._e2e_budgets
            budget = round(r.deadline_s - r.arrival_s, 3)
            seen = budgets.get(budget)
            if seen is not None:
                gap = max(now_s - seen[0], 0.0)
                mean_gap = self._e2e_gaps.get(budget)
                self._e2e_gaps[budget] = gap if mean_gap is None else mean_gap + GAP_WEIGHT * (gap - mean_gap)
            budgets[budget] = (
                now_s,
                request.slo_class,
                request.prompt_tokens,
                request.max_tokens,
            )
            if len(budgets) > STREAM_TARGETS_MAX:
                for t in sorted(budgets)[STREAM_TARGETS_MAX:]:
                    del budgets[t]
                    self._e2e_gaps.pop(t, None)
        if not r.e2e_only:
            self._observe_stream(r, now_s)
        self._add(r, now_s, front=False)
        return r

    def observe_stream(self, request: ScheduleInput, now_s: float) -> None:
        """A TTFT-judged request arrived that another queue orders and places (``--qlm-streams edf``): the
        e2e pulls keep the room and the step the streams expected need (:meth:`stream_reserve`,
        :meth:`stream_tpot_ms`) as when the virtual queues hold them."""
        if self.e2e_seen(now_s):
            # Beside e2e work (``edf``, or ``auto`` for a prompt the prefix index looks up): the e2e pulls
            # leave these streams to the ``slo`` placement's rules (:meth:`_room`).
            self._placed_stream_s = now_s
        self._observe_stream(self.make(request, now_s), now_s)

    def _observe_stream(self, r: QlmRequest, now_s: float) -> None:
        self._saw_stream(self._tpot_ms(r), now_s)
        ttfts = self._stream_ttfts
        ttfts[self._budget(r)] = now_s
        if len(ttfts) > STREAM_TARGETS_MAX:
            for t in sorted(ttfts)[STREAM_TARGETS_MAX:]:
                del ttfts[t]
        mean, _ = self.stats.estimate(r.request.slo_class, r.request.max_tokens)
        first = not self._stream_times
        self._stream_times.append(now_s)
        a = 1.0 if first else 0.05
        self._stream_tokens += a * (self._tokens(r) - self._stream_tokens)
        self._stream_output += a * (min(mean, float(r.max_tokens)) - self._stream_output)

    def started(self, request: ScheduleInput, instance: int, now_s: float, token: Any = None) -> QlmRequest:
        """A request another queue placed (``--qlm-streams edf``) started on instance ``instance``: it runs
        there beside the virtual queues' requests, and counts in every rule that reads the running batch
        (KV pulling, the step and stall bounds, eviction's victims: it is never one, the estimator's
        waits). Its end comes through :meth:`finished` and teaches the estimator like any other."""
        rid = request.request_id
        if rid in self.queued or any(rid in run for run in self.running):
            raise ValueError(f"request {rid!r} is already queued or running")
        r = self.make(request, now_s, token)
        self._run(instance, r, now_s)
        return r

    def _saw_stream(self, tpot_ms: float, now_s: float) -> None:
        streams = self.streams
        streams[tpot_ms] = now_s
        if len(streams) > STREAM_TARGETS_MAX:
            for t in sorted(streams)[STREAM_TARGETS_MAX:]:
                del streams[t]

    def stream_reserve(self, i: int, now_s: float) -> tuple[float, float]:
        """(sequences, KV tokens) instance ``i`` keeps free for the streams expected to run there at once.

        Little's law: streams arrive at the rate seen over the last :data:`STREAM_MEMORY_S` (spread over
        the instances), each runs for its prefill and its expected output at the instance's step.
        """
        times = self._stream_times
        while times and now_s - times[0] > STREAM_MEMORY_S:
            times.popleft()
        if not times:
            return 0.0, 0.0
        model = self.models[i]
        rate = len(times) / STREAM_MEMORY_S / len(self.models)
        duration = model.prefill_s(int(self._stream_tokens)) + self._stream_output * model.decode_step_s
        count = rate * duration
        return count, count * self._stream_tokens

    def e2e_seen(self, now_s: float) -> bool:
        """Whether an e2e-judged request arrived in the last :data:`STREAM_MEMORY_S` (``--qlm-streams auto``
        hands a stream to the virtual queues only then)."""
        return any(now_s - v[0] <= STREAM_MEMORY_S for v in self._e2e_budgets.values())

    def takes_stream(self, request: ScheduleInput, now_s: float) -> bool:
        """Under ``--qlm-streams auto``: does TTFT-judged ``request`` go to the virtual queues (else to the
        router queue and the ``slo`` placement)? Only while e2e work arrives (:meth:`e2e_seen`), and not
        when the router's prefix index finds part of its prompt cached on an instance.

        A stream's first token costs the prefill its instance has not cached, behind the prefills queued
        there: the ``slo`` placement predicts both from the engine's own backlog and the prefix index,
        where the virtual queues price a prefill at the estimator's average batch and the backlog at
        whole prompts. On conversations whose history is cached (the Mooncake trace, 1 s TTFT on prompts
        up to 8k beside 60 s long-prompt work) streams placed by the virtual queues met 67.4 % where
        ``edf`` met 82.8, most missing their first token by 0.1-2 s on an instance taken because its
        queue was empty (docs/papers.md)."""
        if not self.e2e_seen(now_s):
            return False
        if self.cached_prompt is None or not request.prefix_hashes:
            return True
        column = self.cached_prompt(request)
        return not column or max(column) <= 0.0

    def stream_ttft_s(self, now_s: float) -> float:
        """The tightest TTFT target (s) of the streams that arrived in the last :data:`STREAM_MEMORY_S` (inf: none)."""
        live = [t for t, seen in self._stream_ttfts.items() if now_s - seen <= STREAM_MEMORY_S]
        return min(live, default=math.inf)

    def _yields(self, i: int, r: QlmRequest, now_s: float) -> bool:
        """Does e2e ``r``, pulled on instance ``i`` now, yield to the streams the ``slo`` placement places? Yes
        when its own prefill there (the part of its prompt not cached there) is longer than the streams'
        tightest TTFT target allows (``IDLE_SLACK`` times it above the target) and either instance ``i``'s
        engine is not nearly idle (its prefill backlog more than ``IDLE_SLACK - 1`` of that prefill) or fewer
        than :data:`SPARE_IDLE_INSTANCES` instances finish their prefill backlog within that target (the
        one it takes, and one left for the streams).

        The router queue holds a long prompt to the same rule beside tighter traffic (its *yield*, see
        :func:`router.core.queue.offer`): an instance prefilling it gives no stream its first token in
        time, so one instance stays free for the streams' next arrivals. The paper's SLOs are end to end
        and its pulls fill the KV; beside streams whose first token is judged in a second, pulls of
        16k-120k-token prompts onto every instance at once left none able to start a stream in time: on
        the Mooncake trace on 4 instances the chat class met 36.6 % where ``edf``, which yields, met
        48.3 (docs/papers.md, Seed 004)."""
        limit = self.stream_ttft_s(now_s)
        if not math.isfinite(limit):
            return False
        own = self.models[i].prefill_s(self._uncached(i, r))
        if IDLE_SLACK * own <= limit:
            return False
        free = self._engines_free_s(now_s)
        if free is None:
            return False
        if free[i] - now_s + own > IDLE_SLACK * own:
            return True
        return sum(1 for f in free if f - now_s <= limit) < SPARE_IDLE_INSTANCES

    def stream_tpot_ms(self, now_s: float) -> float:
        """The tightest TPOT target of the streams that arrived in the last :data:`STREAM_MEMORY_S` (inf: none)."""
        live = [t for t, seen in self.streams.items() if now_s - seen <= STREAM_MEMORY_S]
        return min(live, default=math.inf)

    def _add(self, r: QlmRequest, now_s: float, *, front: bool, instance: int = -1) -> None:
        key = self._key(r)
        gid = self.open.get(key, -1)
        group = self.groups.get(gid)
        if group is not None and (
            group.closed or len(group.members) >= group.bound or self.expected_missing.get(group.gid, 0) > 0
        ):
            # Full, or expected late by the plan (its members missed or will miss): a newcomer opens
            # a fresh group the plan can still put where it meets its deadline, instead of inheriting
            # a late group's place at the back. (In overload every new group is soon late too, and
            # each one closing after its first member would make a group per request; the plan merges
            # late groups of one key instead: :meth:`_merge_late`.)
            group.closed = True
            group = None
        if group is None:
            group = self._new_group(key, now_s, instance, r.deadline_s, r)
        if front:
            group.members.appendleft(r)
        else:
            group.members.append(r)
        r.group = group.gid
        self.queued[r.request_id] = r
        if not r.resumed:
            heapq.heappush(self._deadlines, (r.deadline_s, self._deadline_seq, r.request_id))
            self._deadline_seq += 1
        if len(group.members) >= group.bound:
            group.closed = True
        self._check(now_s)

    def _new_group(
        self,
        key: tuple[Any, ...],
        now_s: float,
        instance: int,
        deadline_s: float = math.inf,
        newcomer: QlmRequest | None = None,
    ) -> Group:
        gid = self._gid
        self._gid += 1
        self.groups_made += 1
        # A new group goes to the queue that frees first, in deadline order among its groups
        # (the plan generator's own first step, EDF, taken at insertion): the paper queues new groups
        # first come first served and reorders when its estimator predicts a violation, but this
        # router's estimator sees a queue's head waiting for KV and TPOT room only approximately, and a
        # tight group appended behind loose ones that cannot be pulled missed before any re-plan.
        # The plan generator still reorders on a predicted violation. An evicted request's new group
        # goes right behind the head of the queue it left. The tightest e2e class's new group goes to
        # the queue that frees first of those where its first request would end in time pulled now
        # (:meth:`_tight_home`: an instance's prefills are serial, its slots are not).
        home = -1 if newcomer is None else newcomer.home
        if instance >= 0:
            i = instance
            self.vqs[i].insert(1 if self.vqs[i] else 0, gid)
        else:
            if home >= 0 and (
                not self._tightest(newcomer, now_s)  # type: ignore[arg-type]
                or now_s + self._end_now_s(home, newcomer, now_s) <= deadline_s  # type: ignore[arg-type]
            ):
                i = home
            elif newcomer is not None and self._tightest(newcomer, now_s):
                i = self._tight_home(newcomer, now_s)
            else:
                i = min(range(len(self.models)), key=lambda k: (self._backlog_q(k, now_s), k))
            vq = self.vqs[i]
            at = len(vq)
            for k, other in enumerate(vq):
                g = self.groups[other]
                if g.members and g.deadline_s > deadline_s:
                    at = k
                    break
            vq.insert(at, gid)
        group = Group(gid, key, self.config.group_factor * max(self.models[i].batch, 1))
        if instance < 0 and home >= 0 and i == home:
            group.pinned = i  # the plan keeps it where its prompt is cached
        self.groups[gid] = group
        self.open[key] = gid
        return group

    def _home(self, r: QlmRequest) -> int:
        """The instance whose prefix cache holds at least :data:`HOME_CACHED_SHARE` of ``r``'s prompt and more of
        it than every other instance holds (-1: none, or no prefix source).

        A prompt mostly cached on one instance costs that instance a fraction of the prefill it costs any
        other, and runs there without a second copy of its prefix in the fleet's KV (a conversation's
        next turn behind its history, the ``slo`` policy's cached-prefix holder). A prefix every instance
        holds gives no reason to prefer one."""
        if self.cached_prompt is None or not r.request.prefix_hashes:
            return -1
        column = self.cached_prompt(r.request)
        if column is None or len(column) != len(self.models):
            return -1
        r.cached = tuple(column)
        best = max(range(len(column)), key=lambda k: (column[k], -k))
        top = column[best]
        if top < HOME_CACHED_SHARE * r.prompt_tokens or top <= min(column):
            return -1
        return best

    def _tightest(self, r: QlmRequest, now_s: float) -> bool:
        """Is ``r`` e2e-judged and of the tightest e2e class that arrived in the last :data:`STREAM_MEMORY_S`?"""
        if not r.e2e_only:
            return False
        live = [b for b, v in self._e2e_budgets.items() if now_s - v[0] <= STREAM_MEMORY_S]
        return not live or self._budget(r) <= min(live)

    def _tight_home(self, r: QlmRequest, now_s: float) -> int:
        """The virtual queue for a new group of the tightest e2e class, opened by ``r``: of the instances where
        ``r`` pulled now would end by its deadline at its mean answer (:meth:`_end_now_s`), the one whose
        queue frees first (as for every other group); with none, the one where it would end first.

        The queue that frees first is the one whose slots' last free time is earliest: an instance running
        only short answers. A class of long prompts and short answers (5 s labels, ~1,500-token prompts,
        ~30-token answers) then went, group after group, to the one instance running only its own
        requests, whose engine spent its time on their prefills: their decode steps took 120-260 ms where
        40 were expected, and the class met 65-72 % where ``edf`` met 92-94 (docs/papers.md). The
        estimator's slots run in parallel, an engine's prefills do not, so the test adds the prefill
        queued in the engine. Only the tightest class is tested, and at its mean: sent where it ends
        first on every choice (or tested at the confidence's answer), the looser classes of two mixes
        lost 4-6 points."""
        n = len(self.models)
        ends = [self._end_now_s(k, r, now_s) for k in range(n)]
        meets = [k for k in range(n) if now_s + ends[k] <= r.deadline_s]
        if meets:
            return min(meets, key=lambda k: (self._backlog_q(k, now_s), k))
        return min(range(n), key=lambda k: (ends[k], self._backlog_q(k, now_s), k))

    def _end_now_s(self, i: int, r: QlmRequest, now_s: float) -> float:
        """Seconds until e2e ``r`` would end pulled on instance ``i`` now: behind the prefill queued in its engine
        (:meth:`_prefill_backlog_s`), its own prefill, then its mean answer at the grown batch's step (the
        batch running and ``r``, at the tokens they hold now, times the learned inefficiency); 0 with no
        step model (no instance is then ruled out)."""
        model = self.models[i]
        if model.step_s is None:
            return 0.0
        run = list(self.running[i].values())
        step = model.step_s(len(run) + 1, self._tokens_now(run) + r.prompt_tokens) * self.inefficiency[i]
        # Its decode shares the engine with the prefills of its own class sent there while it runs: at the
        # rate they were sent over its own budget lately, a token takes ``step / (1 - load)``.
        step /= 1.0 - self._prefill_load(i, now_s, self._budget(r))
        return (
            self._prefill_backlog_s(i, run, now_s)
            + model.prefill_s(self._uncached(i, r))
            + self._left_tokens(r, 0.0) * step
        )

    @staticmethod
    def _uncached(i: int, r: QlmRequest) -> int:
        """The prompt tokens of ``r`` instance ``i``'s engine would compute (its prefix cache's part known at
        arrival left out; a resumed run computes its whole prompt)."""
        if not r.cached or r.resumed:
            return r.prompt_tokens
        return max(int(r.prompt_tokens - r.cached[i]), 1)

    def _prefill_load(self, i: int, now_s: float, window_s: float) -> float:
        """The share of instance ``i``'s engine time that the prefills of the e2e classes as tight as
        ``window_s`` (an e2e budget) took over the last ``window_s``: the prefill seconds of such requests
        sent there in that window over the window (at most :data:`PREFILL_LOAD_CAP`).

        The engine chunks every prompt it is sent into its decode steps, so while prompts keep coming a
        running request's tokens advance only in the time the prefills leave: its step is the decode
        step over ``1 - load``. The learned inefficiency (Eq. 4's epsilon) carries this only on average
        and late (an average over the requests that ended, each over its whole life). A class whose
        cost is its prompt (5 s labels, ~1,500-token prompts, ~30-token answers) sent its own requests
        to one engine group by group, which then did little but prefill them: their steps took
        120-260 ms where the estimator expected 40-50 (docs/papers.md). Only the tight class's own
        prefills (and tighter ones) are counted: the looser prompts' stall is what :meth:`_room`'s pace
        rules already hold back, and with every prompt sent there counted, two mixes lost 2 points on a
        seed pair each and a run preempted (docs/papers.md)."""
        window_s = max(window_s, 1.0)
        since = now_s - window_s
        busy = 0.0
        for t, s, b in reversed(self._prefills[i]):
            if t <= since:
                break
            if b <= window_s:
                busy += s
        return min(busy / window_s, PREFILL_LOAD_CAP)

    def _backlog_q(self, i: int, now_s: float) -> float:
        s = self.estimator.slots(self.models[i], list(self.running[i].values()), now_s)
        for g in self._groups(i):
            self.estimator.place(self.models[i], s, g, now_s)
        return s.finish_q()

    def _check(self, now_s: float) -> None:
        """Re-plan when the estimator predicts a violation the current plan does not already expect."""
        expected = self.expected_missing
        for ests in self.estimates(now_s):
            for e in ests:
                if e.size - e.meeting > expected.get(e.gid, 0):
                    self.replan(now_s)
                    return

    def _merge_late(self) -> None:
        """Merge the unstarted groups of one key whose every member the last plan expected late, up to the
        group bound.

        A late group takes no newcomers (:meth:`_add`), so in overload, where every new group is soon
        expected late, each request ended up in a group of its own (371 groups at 512 queued in
        `python -m bench qlm`, and the plan generator's cost grows with the square of the groups:
        ~410 ms per arrival). The paper's grouping puts like requests (model, SLO, lengths) in one
        group of at most delta average batches; splitting them by lateness is this router's rule, so
        the late ones of one key go back together: the earliest deadline's group takes the later ones'
        members (each group's order kept, earlier deadlines first) while the bound allows. A newcomer
        still never joins a late group: the plan first tries it fresh, and only once that plan too
        expects it late does it merge. (Letting a late group below one average batch take newcomers
        cured the cost as well, but placed a newcomer at a late group's place in virtual time.) Only
        groups late as a whole merge: a group with a member still on time keeps its own place, or that
        member would queue first come first served behind requests already lost (merging every late
        group lost 10 points of attainment on an overloaded two-class mix, docs/papers.md). And only
        while the plan holds more than :data:`MERGE_ABOVE_GROUPS` groups: below, a plan is cheap and
        the late groups keep the plan's freedom to order them one by one (merging whole-late groups at
        any count still lost 7 points on that mix, and above 48 groups 9.5).
        """
        if len(self.groups) <= MERGE_ABOVE_GROUPS:
            return
        late: dict[tuple[Any, ...], list[Group]] = {}
        for vq in self.vqs:
            for gid in vq:
                g = self.groups[gid]
                if g.pinned < 0 and g.members and self.expected_missing.get(gid, 0) >= len(g.members):
                    late.setdefault(g.key, []).append(g)
        for groups in late.values():
            if len(groups) < 2:
                continue
            groups.sort(key=lambda g: (g.deadline_s, g.gid))
            into = groups[0]
            for g in groups[1:]:
                if len(into.members) + len(g.members) > into.bound:
                    into = g
                    continue
                for r in g.members:
                    r.group = into.gid
                into.members.extend(g.members)
                g.members.clear()
                self.expected_missing[into.gid] = self.expected_missing.get(into.gid, 0) + (
                    self.expected_missing.pop(g.gid, 0)
                )
                for i, vq in enumerate(self.vqs):
                    if g.gid in vq:
                        self._drop_group(i, g)
                        break
                if len(into.members) >= into.bound:
                    into.closed = True

    def replan(self, now_s: float) -> Plan:
        self.plans += 1
        n = len(self.models)
        self._merge_late()
        groups = [self.groups[g] for vq in self.vqs for g in vq]
        running = [list(self.running[i].values()) for i in range(n)]
        if self.config.solver == "milp" and len(groups) <= self.config.milp_max_groups:
            plan = milp_plan(self.estimator, self.models, running, groups, now_s)
        else:
            evictable = None
            if self.config.eviction == "on":
                # The plan asks for every running request and every group it places: the group's start
                # behind all running requests is computed once per (group, instance), a slightly
                # pessimistic form of :meth:`_survives` (the victim's own slot counts as busy); the
                # eviction itself uses the exact check.
                starts: dict[tuple[int, int], float] = {}

                def evictable(r: QlmRequest, group: Group) -> bool:
                    if not self._evictable(r, group) or r.instance < 0:
                        return False
                    key = (group.gid, r.instance)
                    start_q = starts.get(key)
                    if start_q is None:
                        start_q = starts[key] = self._start_behind(r.instance, group, now_s)
                    return self._survives(r, group, now_s, start_q=start_q)

            plan = heuristic_plan(self.estimator, self.models, running, groups, now_s, evictable)
        self.vqs = [list(o) for o in plan.order]
        self.expected_missing = {e.gid: e.size - e.meeting for ests in self.estimates(now_s) for e in ests}
        return plan

    # ------------------------------------------------------------------ the LSOs

    def pump(self, now_s: float, evict: Evict | None = None) -> list[Dispatch]:
        """Pull requests into instances with free slots; evict for a tight head group when enabled.

        Each instance first pulls from its own virtual queue; an instance
        that still has free slots once its own queue is empty then pulls
        from the others' (:meth:`_pull_other`), so no slot idles while a
        request waits.
        """
        out: list[Dispatch] = []
        self._progress(now_s)
        for i in range(len(self.models)):
            out.extend(self._pull(i, now_s))
            evicting = evict is not None and self.config.eviction == "on" and bool(self.vqs[i])
            if evicting and evict is not None and self._evict(i, now_s, evict):
                out.extend(self._pull(i, now_s))
        for i in range(len(self.models)):
            if not self.vqs[i]:
                out.extend(self._pull_other(i, now_s))
            else:
                out.extend(self._pull_urgent(i, now_s))
        return out

    def _clock_at(self, i: int, now_s: float) -> float:
        """Instance ``i``'s decode clock at ``now_s``: the tokens one request decoding there since the start
        would have generated, each step as long as the batch running then was predicted to take."""
        return self._clock[i] + max(now_s - self._clock_s[i], 0.0) / self._clock_step[i]

    def _advance(self, i: int, now_s: float) -> None:
        """Bring instance ``i``'s decode clock to ``now_s`` (before its batch changes)."""
        self._clock[i] = self._clock_at(i, now_s)
        self._clock_s[i] = max(now_s, self._clock_s[i])

    def _reclock(self, i: int) -> None:
        """Instance ``i``'s batch changed: its clock runs at the step of the new batch from here on (its count
        and the tokens it holds, times the learned inefficiency)."""
        model = self.models[i]
        run = self.running[i]
        step = model.decode_step_s
        if model.step_s is not None and run:
            step = model.step_s(len(run), self._tokens_now(run.values())) * self.inefficiency[i]
        self._clock_step[i] = max(step, 1e-6)

    def _progress(self, now_s: float) -> None:
        """How far each running request has got, a lower bound on its length: for its KV at its end
        (:meth:`_kv`, every pump) and, at most every :data:`PROGRESS_EVERY_S`, for the output statistics:
        the cautious estimate the joinable rule reads (:meth:`OutputStats.cautious`) and, under
        ``--qlm-lengths censored``, the class estimates themselves (each update re-estimates the classes
        running).

        The router's clock is what the queue knows of a running request: the tokens an e2e request has
        generated are its instance's decode clock's advance since its prefill (:meth:`_clock_at`: each
        stretch of time over the predicted step of the batch that ran then, the learned inefficiency
        included), a stream's its time since dispatch less its prefill over the step of the batch
        running now, plus what it generated before an eviction. No figure of the request's own length enters. The
        fraction is floored to :data:`PROGRESS_STEPS` steps of ``max_tokens``: a function of the clock
        and of the batch changes, so the router (pumping on every status push) and the simulator (on
        its engines' events) see the same value at
        the same moment, and :meth:`_kv`'s memo is recomputed at most that many times a request.
        """
        update = now_s - self._progress_s >= PROGRESS_EVERY_S
        if update:
            self._progress_s = now_s
        for i, run in enumerate(self.running):
            # An e2e request's tokens since its first was due: the advance of its instance's decode
            # clock, each stretch of time at the step of the batch that ran then (Eq. 4's d for these
            # requests, the learned inefficiency included). The step of the batch running *now* over
            # the whole time since dispatch lagged the tokens really generated whenever the batch had
            # grown since (a request that started beside few others ran faster than the full batch's
            # step says): at 6 instances, 30 req/s, 57 requests counted 61.7k tokens where the engine
            # held over 65.5k, the pulls went on, and the engine preempted (docs/papers.md). The clock
            # changes step only when the batch changes (a dispatch, an end, an eviction): the same
            # events in the router and the simulator, so both count the same progress at the same
            # moment. A stream's progress is still read at the step of the batch running now: the
            # clock for streams too cost chat alone 2.4 points and two TTFT classes beside batch work
            # 1.1 (their step and stall rules, :meth:`_room`, judge a stream's tokens left from it and
            # turned stricter), while the preemptions it cures came from batches of e2e work.
            clock = self._clock_at(i, now_s)
            model = self.models[i]
            step = model.decode_step_s
            if model.step_s is not None and run:
                step = model.step_s(len(run), self._tokens_now(run.values())) * self.inefficiency[i]
            for r in run.values():
                if r.e2e_only or r.resumed:
                    tokens = r.generated + max(clock - r.clock0, 0.0)
                else:
                    decoding = now_s - r.dispatched_s - model.prefill_s(r.prompt_tokens)
                    tokens = r.generated + max(decoding, 0.0) / max(step, 1e-6)
                reached = math.floor(tokens / max(r.request.max_tokens, 1) * PROGRESS_STEPS) / PROGRESS_STEPS
                r.reached = max(r.reached, min(reached, 1.0))
                if update:
                    self.stats.progress(r.request.slo_class, r.request_id, r.reached)

    def _pull_urgent(self, i: int, now_s: float) -> list[Dispatch]:
        """Instance ``i`` takes a TTFT-judged request waiting at the head of another virtual queue whose own
        instance cannot start it now, while its TTFT deadline is still ahead and ``i`` has room for it.

        An adaptation for TTFT-judged classes (the paper's SLOs are end-to-end only): such a request
        waits on its queue until that instance's batch has KV room and a step its TPOT target allows,
        which the estimator sees only approximately; a batch of long e2e requests can take seconds to
        drain that far, past the TTFT deadline, while another instance could start it at once. The
        plan's order on every queue is kept: only heads move, earliest deadline first.
        """
        out: list[Dispatch] = []
        while True:
            best: tuple[float, int, int] | None = None  # (deadline, gid, queue)
            for j, vq in enumerate(self.vqs):
                if j == i or not vq:
                    continue
                group = self.groups[vq[0]]
                if not group.members:
                    continue
                first = group.members[0]
                if first.e2e_only or first.resumed or first.deadline_s <= now_s:
                    continue
                if best is not None and (first.deadline_s, group.gid) >= best[:2]:
                    continue
                if self._stream_late(first, now_s):
                    continue
                if self._room(j, first, now_s=now_s) or not self._room(i, first, now_s=now_s):
                    continue
                best = (first.deadline_s, group.gid, j)
            if best is None:
                return out
            _, gid, j = best
            out.append(self._take(i, j, self.groups[gid], now_s))

    def _take(self, i: int, src: int, group: Group, now_s: float) -> Dispatch:
        """Run ``group``'s first member (its group is on virtual queue ``src``) on instance ``i``."""
        r = group.members.popleft()
        if src == i:
            group.pinned = i
        del self.queued[r.request_id]
        self._overdue.pop(r.request_id, None)
        self._run(i, r, now_s)
        if not group.members:
            self._drop_group(src, group)
        return Dispatch(r, i)

    def _run(self, i: int, r: QlmRequest, now_s: float) -> None:
        """``r`` starts on instance ``i`` now: it joins the running batch and the instance's clock."""
        if r.e2e_only or r.resumed:
            r.pace_s = self._pace_s(i, r, now_s)
        r.instance, r.dispatched_s = i, now_s
        r.shared = self._shared_on(i, r)
        hashes = self._hashes(r)
        if hashes:
            self._held[i].update(hashes)
            owner = self._owner[i]
            for h in hashes:
                owner.setdefault(h, r)
        self._prefills[i].append((now_s, self.models[i].prefill_s(r.prompt_tokens), self._budget(r)))
        self._advance(i, now_s)
        self.running[i][r.request_id] = r
        self.batch_changes[i] += 1
        self._reclock(i)
        # Its first decode step comes after its prefill, counted at the new batch's step.
        r.clock0 = self._clock[i] + self.models[i].prefill_s(r.prompt_tokens) / self._clock_step[i]
        self.stats.started(r.request.slo_class, r.request_id)
        step = self.base_models[i].step_s
        if step is not None:
            run = self.running[i].values()
            r.step0_s = step(len(run), self._tokens_now(run))

    def _tokens(self, r: QlmRequest) -> float:
        """KV tokens ``r`` holds at its end: its prompt and the output it reaches with ``--qlm-confidence``.

        The output's quantile, not its mean: the running batch must fit the cache at the end of its
        requests with the same confidence the estimator's deadlines are checked with (Eq. 12), or
        the engine preempts.
        """
        mean, std = self.stats.estimate(r.request.slo_class, r.request.max_tokens)
        expected = min(max(mean + self.config.z * std - r.generated, 1.0), float(r.max_tokens))
        return float(r.prompt_tokens) + expected

    def _room(
        self,
        i: int,
        r: QlmRequest,
        gone: frozenset[str] = frozenset(),
        now_s: float | None = None,
        *,
        paced: bool = True,
    ) -> bool:
        """May instance ``i`` start ``r`` now (with the running requests ``gone`` evicted first)?

        §6's pull rule: while the tokens of the running batch are below the
        instance's KV capacity. A running request is counted at the tokens it
        will hold when it ends (its prompt and its expected output, from the
        learned output statistics): counting only what it holds now would pull
        requests the cache cannot keep as the batch grows, and the engine would
        preempt them. The engine's ``most`` sequences bound the count. An
        adaptation for this router's streams judged on TPOT (the paper's SLOs
        are end-to-end only): when ``r`` or a running request has a TPOT
        target, the decode step of the grown batch must stay within
        :data:`TPOT_HEADROOM` of the tightest such target. Without a KV figure
        (``kv_tokens`` 0) the instance's ``batch`` bounds the count instead.

        ``paced`` (the default) adds the pace rules of e2e pulls: the prefill a looser pull puts ahead
        of the running e2e requests (the engine's prefill queue, :meth:`_prefill_backlog_s`) must not
        turn one late, and the grown batch must stay joinable for the tightest e2e class seen lately
        (:meth:`_joinable`). Eviction asks without them (``paced=False``): it makes KV room (§5), and
        a head held back only to keep the batch's pace is not what it is for.
        """
        model = self.models[i]
        run = [x for x in self.running[i].values() if x.request_id not in gone]
        # The streams are the ``slo`` placement's: every one under ``--qlm-streams edf``, and under ``auto``
        # while one it hands there arrived lately (:meth:`takes_stream`). A long e2e prompt yields to them
        # as the router queue makes it yield (:meth:`_yields`), on an empty instance too.
        hybrid = self.config.streams == "edf" or (
            now_s is not None
            and now_s - self._placed_stream_s <= STREAM_MEMORY_S
            and self.config.streams == "auto"
        )
        if hybrid and paced and r.e2e_only and now_s is not None and self._yields(i, r, now_s):
            return False
        if not run:
            return True
        if (model.most and len(run) >= model.most) or (not model.kv_tokens and len(run) >= model.batch):
            return False
        held = self._batch_kv(run, r, self._shared_on(i, r) if not gone else 0)
        # An e2e request leaves the room the streams expected at once need (stream_reserve): a stream
        # must join at once, not wait for a KV-full batch of long e2e requests to end.
        #
        # Under ``--qlm-streams edf`` the reserve is held only while the plan expects every request on
        # time: past capacity a seat held empty for a stream not yet arrived is idle room, and the
        # router queue hands the streams the room that frees first anyway (its pass runs before the
        # e2e pulls), as ``edf`` does; a stream that cannot wait goes late there and is refused.
        # Held past capacity too, rag + reports lost 9 points to edf (reports 50.9 %, docs/papers.md).
        seqs, tokens = (
            self.stream_reserve(i, now_s)
            if r.e2e_only and now_s is not None and not (hybrid and any(self.expected_missing.values()))
            else (0.0, 0.0)
        )
        # The reserve stays free beyond the streams already running: the next stream must find a seat the
        # moment it arrives (counting the running ones in it left none free half the time: at 20 req/s with
        # the chat class, 91.8 % against 98.7 %).
        if model.kv_tokens and held + tokens > model.kv_tokens:
            if not (
                tokens > 0 and held <= model.kv_tokens and self._reserve_costs(i, run, r, held, tokens, now_s)
            ):
                return False
            # The reserve would cost ``r`` its deadline: it yields (and the streams' step bound below is
            # taken without it).
            seqs = tokens = 0.0
        if model.step_s is None:
            return True
        # TPOT-judged requests waiting in this instance's virtual queue will join this batch: it must
        # not grow past their step either, or a tight stream could start only after the whole batch
        # drained (head-of-line blocking by the batch's own speed).
        waiting = [
            g.members[0]
            for g in (self.groups.get(gid) for gid in self.vqs[i])
            if g is not None and g.members and not g.key[2]
        ]
        tpots = [self._tpot_ms(x) for x in (*run, r, *waiting) if not x.e2e_only]
        if now_s is not None:
            # And the streams that arrive lately anywhere: the next one must join a batch at once, not
            # after a KV-full batch of long e2e requests drained to its step (the paper's SLOs are
            # end-to-end only, so its batches never had to stay joinable; with a TTFT-judged class a
            # stream waited for the drain and missed its TTFT, see docs/papers.md).
            tpots.append(self.stream_tpot_ms(now_s))
            if hybrid and r.e2e_only and self.stream_tpot_ms(now_s) < math.inf:
                # Under ``--qlm-streams edf`` the ``slo`` policy places the streams, and its residents'
                # filter holds the batch a stream joins to the default TPOT target (the router's
                # ``--tpot-slo``): an e2e pull that grows the batch past it closes the instance to every
                # stream, whatever the streams' own target allows (two TTFT classes' 80-100 ms targets
                # beside 240-300 s batch work: 83-85 % against edf's 99, docs/papers.md).
                tpots.append(self.default_tpot_ms)
        if tpots and min(tpots) < math.inf:
            # The step a stream sees, as the TPOT target judges it (a mean over the stream's life): the
            # grown batch (and the streams' reserve) at the tokens it holds now plus the newcomer's prompt
            # and half its expected output, the mean context over the newcomer's life, as the router's
            # calibration predicts it (the measured interleave of prefill chunks included; the learned
            # inefficiency without a calibration: :meth:`_stream_step_s`), within the target: the bar the ``slo`` policy's TPOT filter sets at its default
            # ``--tpot-slo-dispatch-threshold``. The earlier rule held the pure step at the batch's
            # *end* context to 0.6 of the target: twice pessimistic, it kept chat batches at a third
            # of the room they had, and streams waited past their TTFT (docs/papers.md).
            out_mean, _ = self.stats.estimate(r.request.slo_class, r.request.max_tokens)
            life = self._tokens_now(run) + r.prompt_tokens + 0.5 * min(out_mean, float(r.max_tokens))
            stream_step = self._stream_step_s(i, len(run) + 1 + math.ceil(seqs), life + tokens)
            # An e2e pull with slack is held to the bar the ``slo`` policy holds every placement beside
            # streams to (the router's default TPOT, its residents' filter, which places them under
            # ``edf``) as well as to the streams' own targets: a stream must never be worse off than
            # under ``edf`` for the sake of an e2e request that could have waited (the RCT estimator
            # says which can, :meth:`_has_slack`). One without slack keeps the streams' own targets as
            # the bar: it would miss waiting for them. (Held to their own targets alone, a voice class at
            # 60 ms saw 61-89 ms beside ledger and audit prompts the estimator had minutes of slack for,
            # and the slack pulls took the room the 25 s ledger class needed: voice + ledger + audit
            # 87.4 % against ``edf``'s 90.9, support + translate + archive 91.5 against 92.5,
            # docs/papers.md.)
            bar_ms = min(tpots)
            slack = r.e2e_only and paced and now_s is not None and self._has_slack(i, run, r, now_s)
            if slack:
                bar_ms = min(bar_ms, self.default_tpot_ms)
            if stream_step * 1e3 > STREAM_TPOT_SHARE * bar_ms:
                return False
            # Work that can wait is held back for the streams' stalls; a stream once the plan expects
            # misses (past capacity someone misses anyway, and the streams running are the ones still on
            # time), or while e2e work arrives. Streams alone, below capacity, a stream held back for
            # another's sake trades one for the other and misses its TTFT waiting: on the Azure chat
            # trace the check on every stream pull cost 4.8 points at 1x capacity, and none at all lost
            # 32 points at 1.3x (docs/papers.md). Beside e2e work (the only time ``--qlm-streams auto``
            # gives the virtual queues a stream) the ``slo`` policy, which places the streams under
            # ``edf``, checks every stream's prefill against the streams running; a stream pulled
            # unchecked while the plan still expected every request on time stalled the long-prompt
            # streams beside it past their TPOT (agent + digest: 82.3 % against ``edf``'s 84.5; checked,
            # 83.4, and 83.9 against 84.3 on other seeds, docs/papers.md).
            checked = r.e2e_only or r.resumed or any(self.expected_missing.values())
            if not checked and now_s is not None:
                checked = self.e2e_seen(now_s)
            if checked and not self._stall_fits(i, run, r, stream_step, now_s, cautious=slack):
                return False
        context = held + tokens
        step = model.step_s(len(run) + 1 + math.ceil(seqs), context) * self.inefficiency[i]
        if now_s is not None:
            # The same for end-to-end deadlines: the grown batch's slower step must not turn a running
            # request the estimator had on time into a miss (at the estimator's confidence). Both steps
            # hold the streams' reserve: the streams expected slow the batch whether or not ``r`` joins,
            # and counting them in the grown batch alone (11 sequences on a 25-request batch in the
            # support + translate + archive mix) called every running request within a fifth of its
            # deadline a victim of ``r``, and froze the batch while e2e requests waited (docs/papers.md).
            before = (
                model.step_s(len(run) + math.ceil(seqs), self._batch_kv(run) + tokens) * self.inefficiency[i]
            )
            # And the prefill ``r`` adds: the engine chunks it into the batch's steps, so every request
            # running there waits for it once, behind the prompts pulled there still in their prefill
            # (the streams' own check, :meth:`_stall_fits`, does the same for TPOT targets).
            stall0 = stall1 = 0.0
            if model.stall_s is not None and paced:
                stall0 = self._prefill_backlog_s(i, run, now_s)
                stall1 = stall0 + model.prefill_s(r.prompt_tokens)
            # Other requests queued on this instance's virtual queue besides ``r``: the instance pulls its
            # queue in order, so a refusal holds them all (below).
            behind = paced and self._queued_on(i) > 1
            for x in (*run, r):
                if not (x.e2e_only or x.resumed):
                    continue
                # The prefill counts against a running request only for a looser pull: holding back a
                # request as tight as the one it would slow trades one for the other, and the held one
                # waits in the router (triage, 15 s, waited 3-8 s there behind its own class). Looser is
                # the e2e budget (the SLO of its group), not the deadline: a request of the same class
                # that arrived later has a later deadline and is not looser (judged by deadline, api
                # pulls were held back 9,000 times for the api requests running before them, and
                # waited 5-8 s in the router, docs/papers.md).
                looser = x is not r and self._looser(r, x)
                s0, s1 = (stall0, stall1) if looser else (0.0, 0.0)
                # A looser pull is judged at the estimator's confidence and at the mean: a request whose
                # answer at the quantile misses already is not a lost cause while its mean length still
                # meets, and a looser pull that makes it miss at the mean too is what loses it. With only
                # the quantile, a 15 s class with widely spread answers (sigma 0.5) was "late anyway"
                # beside a busy batch from the start, so every looser pull went ahead and slowed it past
                # its deadline (api + batch past capacity: 73.4 % against edf's 92.8, docs/papers.md).
                # A pull as tight (a stream beside 90 s digests) is not held back for it: that trades one
                # for the other (agent + digest lost 1-2 points, docs/papers.md).
                # With other requests queued behind the pull, a refusal holds the whole virtual queue for
                # ``x``'s deadline, and Eq. 12 asks Delta of each group, not of one running request's
                # tail: a pull that cannot wait for ``x`` (:meth:`_can_wait`) is then held for ``x``'s
                # mean answer only. (At its tail too, a running `completions` request at the edge of its
                # 8 s deadline held the `tickets` and `ledgers` queued behind a refused head for 6-12 s
                # where ``edf`` started them in under one: completions + tickets + ledgers 2.3 points
                # behind ``edf``. Released whether or not the pull could wait, a 16 s class whose cost
                # is its answer lost its tail to looser work that had minutes: 0.65 points on captions +
                # essays + transcripts, docs/papers.md.)
                if not looser:
                    lefts: tuple[float, ...] = (self._left_tokens(x),)
                elif behind and not self._can_wait(i, run, r, now_s):
                    lefts = (self._left_tokens(x, 0.0),)
                else:
                    lefts = (self._left_tokens(x), self._left_tokens(x, 0.0))
                for left in lefts:
                    if now_s + s0 + left * before <= x.deadline_s < now_s + s1 + left * step:
                        return False
            # A looser pull that can wait (:meth:`_can_wait`) waits while the grown batch's step is slower
            # than a tighter request running there needs: the pace its deadline needed when it was pulled
            # (:meth:`_pace_s`, at the estimator's confidence with the class's running answers as lower
            # bounds). The rule above judges a running request from where it stands now; a request of a
            # class whose answers spread widely is late at the quantile beside a busy batch as soon as the
            # batch has slowed, and from then on only its mean protected it, so the looser pulls slowed it
            # to the mean's pace and its long answers missed (a 15 s class beside 120 s batch work at 80-90
            # ms a token where ``edf``, which holds each resident to the pace it was placed at, ran it at
            # 40-50: api + batch at 22 req/s, 77.3 % against ``edf``'s 84.5, docs/papers.md). A pull of
            # the tight class itself is not held to it: holding a class back for its own pace left its
            # requests waiting past their deadlines (api + batch 67-87 %, docs/papers.md).
            if paced and (r.e2e_only or r.resumed):
                paces = [x.pace_s for x in run if (x.e2e_only or x.resumed) and self._looser(r, x)]
                if paces and step > min(paces):
                    if self._can_wait(i, run, r, now_s):
                        return False
                    # One that cannot wait and misses even pulled now, at its mean length at the grown
                    # batch's step behind the prefill queued there, is lost either way: it waits too
                    # rather than slow the tighter requests still on time (the router's late path refuses
                    # it once it is past its allowance). Let go, the middle class of a three-class mix
                    # went at the last moment, ran late at the slowed step and took the tight class's
                    # pace with it (sql + explain + analytics 71.1 % against ``edf``'s 75.1,
                    # docs/papers.md).
                    if now_s + stall1 + self._left_tokens(r, 0.0) * step > r.deadline_s:
                        return False
            # The batch stays joinable for the tightest e2e class: a looser pull may not be the one that
            # closes it, and while it is closed already, a looser pull the RCT estimator says can wait
            # (:meth:`_can_wait`) waits for it to open. (Every looser pull held back while closed froze
            # the batch and the streams beside it lost their turn: the support mix 90.1 against 91.9 %,
            # the 120 s digests row 18 preemptions against 4. None held back: a 120 s class kept every
            # batch closed to a 15 s class beside it, whose requests then ran at 60-70 ms a token
            # against the 45 ms ``edf`` holds them to: api + batch 81.1 % against 92.8, docs/papers.md.)
            if (
                paced
                and r.e2e_only
                and not self._joinable(
                    # The room kept for the tightest class follows the looser backlog's slack
                    # (:meth:`_protect_z`), asked only when ``r`` is looser than that class.
                    i,
                    r,
                    stall1,
                    step,
                    now_s,
                    lambda: self._protect_z(i, run, r, before, now_s),
                )
                and (self._joinable(i, r, stall0, before, now_s) or self._can_wait(i, run, r, now_s))
            ):
                return False
        return True

    def _queued_on(self, i: int) -> int:
        """Requests queued on instance ``i``'s virtual queue."""
        return sum(len(g.members) for g in (self.groups.get(gid) for gid in self.vqs[i]) if g is not None)

    def _pace_s(self, i: int, r: QlmRequest, now_s: float) -> float:
        """The decode step (s) e2e-judged ``r``, pulled on instance ``i`` now, needs to meet its deadline: the
        time left once the prompts queued there and its own are prefilled, over its output at the
        estimator's confidence; over its mean output when even an idle instance could not keep the
        quantile's pace; inf when it could not keep the mean's either (a lost cause bounds nothing), but
        the router's default TPOT while its class has no finished answer (its length is then only its
        ``max_tokens``). The
        idle instance's step is the router's prediction (:meth:`_stream_step_s`: the calibration with
        its measured interleave, or the profile times the learned inefficiency without one).

        The RCT estimator's test (Eq. 4: the output at the batch's step after the prefill) turned
        around: the slowest step at which the request still meets. Its output is sized with the class's
        running answers as lower bounds (:meth:`OutputStats.cautious`, as :meth:`_joinable` sizes the
        tightest class) when that is the longer estimate: in the first seconds of a run the finished
        answers are the short ones (a ~170-token class estimated at 110 tokens at the quantile), and a
        pace sized by them let the looser pulls slow the batch past what the longer answers needed.
        """
        model = self.models[i]
        if model.step_s is None:
            return math.inf
        run = self.running[i].values()
        left_s = (
            r.deadline_s - now_s - self._prefill_backlog_s(i, run, now_s) - model.prefill_s(r.prompt_tokens)
        )
        mean, std = self.stats.estimate(r.request.slo_class, r.request.max_tokens)
        c_mean, c_std = self.stats.cautious(r.request.slo_class, r.request.max_tokens)
        for z in (self.config.z, 0.0):
            out = max(mean + z * std, c_mean + z * c_std) - r.generated
            n = min(max(out, 1.0), float(r.max_tokens))
            if left_s >= n * self._stream_step_s(i, 1, r.prompt_tokens + n):
                return left_s / n
        if self.stats.fraction(r.request.slo_class) is None:
            # Nothing of its class has finished yet, so its answer is taken at its whole ``max_tokens``: a
            # cap, not an estimate, and a cap an idle instance cannot reach in time is no sign of a lost
            # cause. It keeps the pace the ``slo`` placement holds every resident to under ``edf`` (the
            # router's default TPOT). Bounding nothing, it let a 90 s class with 2,500-token prompts fill
            # every batch in the run's first seconds, and the 12 s class ran at 55-63 ms a token where
            # ``edf`` ran it at 45 (answers + summaries, docs/papers.md).
            return self.default_tpot_ms * 1e-3
        return math.inf

    @staticmethod
    def _budget(x: QlmRequest) -> float:
        """Seconds from arrival to ``x``'s deadline (for an e2e-judged request, its class's e2e target)."""
        return round(x.deadline_s - x.arrival_s, 3)

    @classmethod
    def _looser(cls, r: QlmRequest, x: QlmRequest) -> bool:
        """Is pull ``r`` of a looser class than e2e-judged ``x`` running: a larger e2e budget? A stream (judged
        on its first token, so its budget is not comparable) is looser when its deadline is later."""
        if r.e2e_only or r.resumed:
            return cls._budget(r) > cls._budget(x)
        return r.deadline_s > x.deadline_s

    def _reserve_costs(
        self,
        i: int,
        run: Sequence[QlmRequest],
        r: QlmRequest,
        held: float,
        tokens: float,
        now_s: float | None,
    ) -> bool:
        """Would e2e ``r``, held back for the streams' reserve on instance ``i``, miss its deadline waiting for
        the room (it fits without the reserve)?

        The reserve keeps a seat for a stream that has not arrived; the paper's rule for a request that
        cannot be pulled is to act when the estimator predicts it would miss waiting and meet if started
        now (§5, eviction). Past capacity a reserve held against every e2e pull is a trade of a request
        waiting now, on time, for a stream to come: with long-prompt streams (TTFT 2 s) beside a 45 s
        e2e class the reserve (Little's law, about as many streams again as were running) held ~30k of
        a 65k cache, and the e2e class fell to 29.5 % where ``edf`` met 91.9 (docs/papers.md). So the
        reserve yields to a request that the estimator says would miss waiting for it (the running
        requests end in the order the estimator expects, at its confidence, until the batch without
        them leaves ``r`` and the reserve room, then ``r``'s whole duration at the quantile). A request
        with slack to wait still waits, and the streams keep their seats (two TTFT classes beside 240 s
        batch work: 95.2 % against 95.4). One that would miss even pulled now yields nothing to the
        reserve either: ``edf`` keeps no seat for a stream to come, and late at the quantile is not late
        for sure (yielding only to requests that met pulled now at the quantile, agent + digest, 90 s
        digests beside 90 ms long-prompt streams, lost 3.5 points to ``edf``, digests waiting 40-120 s
        in the router; yielding to them: 0.3 behind, docs/papers.md).
        """
        if now_s is None:
            return False
        model = self.models[i]
        _, _, _, whole_q = self.estimator.duration(model, r)
        need = held + tokens - model.kv_tokens
        freed = 0.0
        for end, kv in sorted((self.estimator.remaining(model, x, now_s)[1], self._kv(x)[0]) for x in run):
            freed += kv
            if freed >= need:
                return now_s + end + whole_q > r.deadline_s
        return True

    def _prefill_backlog_s(self, i: int, run: Iterable[QlmRequest], now_s: float) -> float:
        """Seconds of prefill instance ``i``'s engine still has queued for the requests ``run`` pulled there.

        The engine prefills the prompts it is sent in order, so a prompt waits for every one sent before
        it: the backlog is a single server's, each prompt starting when it was sent or when the one
        before it was done, whichever is later (the router's clock; each prefill as the instance's
        model predicts it). Counting each prompt as done once its own prefill time had passed since it
        was sent, a burst of 12 long prompts looked drained while the engine was still seconds from
        the last, and a tight request pulled behind them waited there (TTFT 2.3-3.4 s, no router wait).
        """
        model = self.models[i]
        free = -math.inf
        for x in sorted(run, key=lambda x: x.dispatched_s):
            free = max(free, x.dispatched_s) + model.prefill_s(x.prompt_tokens)
        return max(free - now_s, 0.0)

    def _joinable(
        self,
        i: int,
        r: QlmRequest,
        stall_s: float,
        step_s: float,
        now_s: float,
        z: Callable[[], float] | None = None,
    ) -> bool:
        """Could a request of the tightest e2e class seen lately still meet its deadline on instance ``i`` if
        it arrived now, with e2e-judged ``r`` pulled there first?

        The paper pulls while the batch's tokens fit the KV cache and meets a tight request that cannot
        start by evicting (§5); with room in the cache a tight request is pulled at once, but into the
        batch as it is: behind the prefill of every prompt pulled before it (the engine chunks them in
        order) and at the step of the whole batch. Pulled to the KV capacity, a batch of long-prompt
        loose work took seconds of prefill and a 60-170 ms step, and 6 s requests arriving behind it
        missed with no wait in the router (``urgent`` 81.5 % against edf's 95.4 %, docs/papers.md).
        So, as the streams' step bound keeps a batch joinable for the next stream (:meth:`_room`), a
        looser e2e pull is refused when it is the one that would make the tightest e2e class that
        arrived in the last :data:`STREAM_MEMORY_S` miss at once (:meth:`_room` asks this of the
        batch without and with ``r``; and, while it is closed already, a looser pull that can wait:
        :meth:`_can_wait`): its prompt behind the prefill backlog (``stall_s``), then its output at the
        estimator's confidence at the batch's step (``step_s``), the output judged with the class's
        running requests as lower bounds (:meth:`OutputStats.cautious`). A class that misses even alone
        on an idle instance bounds nothing. ``z`` (when given) is asked for the standard score to size
        that output at instead of the confidence's (:meth:`_protect_z`: lower as the looser backlog runs
        out of slack; :meth:`_room` asks it only of the batch with ``r``, so a lower score releases
        pulls and never holds one that the confidence's would let go).
        """
        live = [(b, v) for b, v in self._e2e_budgets.items() if now_s - v[0] <= self._arriving_s(b)]
        if not live:
            return True
        budget, (_, slo_class, prompt, max_tokens) = min(live)
        if r.deadline_s - now_s <= budget:
            return True  # ``r`` is of the tightest class (or tighter): it is the one the room is kept for
        model = self.models[i]
        mean, std = self.stats.cautious(slo_class, max_tokens)
        left = min(mean + (self.config.z if z is None else z()) * std, float(max_tokens))
        prefill = model.prefill_s(prompt)
        if (
            model.step_s is not None
            and prefill + left * model.step_s(1, prompt + left) * self.inefficiency[i] > budget
        ):
            return True  # it misses even alone
        return stall_s + prefill + left * step_s <= budget

    def _arriving_s(self, budget: float) -> float:
        """How long after its last arrival the e2e class of ``budget`` still counts as arriving: :data:`QUIET_GAPS`
        of its mean gap between arrivals, :data:`STREAM_MEMORY_S` at most (and with no gap seen yet).

        The room :meth:`_joinable` keeps is for the next request of the tightest class; once that class has
        been silent for many of its own gaps (its arrivals stopped: the end of a burst, a class gone quiet)
        none is coming, and room held for it is idle while the looser backlog runs out of time. Held for a
        fixed 30 s after the last one, the 100 s ledgers of an 8 s / 25 s / 100 s mix were held back for
        completions that no longer came once arrivals ended (docs/papers.md)."""
        gap = self._e2e_gaps.get(budget)
        return STREAM_MEMORY_S if gap is None else min(STREAM_MEMORY_S, max(QUIET_GAPS * gap, QUIET_MIN_S))

    def _can_wait(self, i: int, run: Sequence[QlmRequest], r: QlmRequest, now_s: float) -> bool:
        """Would e2e-judged ``r`` still meet its deadline pulled on instance ``i`` only once the tighter e2e
        work ahead of it there has ended?

        The RCT estimator's answer at its confidence, as :meth:`_has_slack` gives it for the streams, with
        the work ahead as the paper's virtual queue orders it (Eq. 1-2 and 10: a request's completion is
        the wait for the work ahead of it, then its own): each running request of a tighter class (a
        smaller e2e budget) ends at its quantile (:meth:`Estimator.remaining`), and the tighter requests
        queued on ``i``'s virtual queue, pulled before ``r``, take their output at the instance's
        throughput (Eq. 2) and the last of them its whole duration. Then ``r`` runs its whole duration at
        its quantile. The paper's plan serves the tight groups first and lets the loose ones fill the
        cache; its estimator sees the decode step of the average batch, not what a batch of long loose
        prompts does to the step the tight class gets, so :meth:`_room` holds a looser pull that can wait
        to keep the batch joinable for the tight class, and lets one that cannot wait go (it would miss
        waiting). (The tighter requests that keep arriving while ``r`` waits, counted as a priority
        queue's stretch of the wait, ``W / (1 - share)``, sent the middle class of three-class mixes
        ahead and lost the tight class more than it gained: docs/papers.md.)
        """
        model = self.models[i]
        _, _, _, whole_q = self.estimator.duration(model, r)
        budget = self._budget(r)
        wait = max(
            (
                self.estimator.remaining(model, x, now_s)[1]
                for x in run
                if (x.e2e_only or x.resumed) and self._budget(x) < budget
            ),
            default=0.0,
        )
        if now_s + wait + whole_q > r.deadline_s:
            return False
        tokens = last_q = 0.0
        for gid in self.vqs[i]:
            g = self.groups.get(gid)
            if g is None or not g.members or not g.e2e_only:
                continue
            head = g.members[0]
            if self._budget(head) >= budget:
                continue
            mean, _ = self.stats.estimate(head.request.slo_class, head.request.max_tokens)
            tokens += len(g.members) * min(mean, float(head.max_tokens))
            last_q = self.estimator.duration(model, head)[3]
        if last_q > 0.0:
            wait = max(wait, tokens / model.throughput_tps + last_q)
        return now_s + wait + whole_q <= r.deadline_s

    def _protect_z(
        self, i: int, run: Sequence[QlmRequest], r: QlmRequest, step_s: float, now_s: float
    ) -> float:
        """The standard score of the tightest e2e class's answer that the room a batch keeps for it
        (:meth:`_joinable`) is sized at, judging looser e2e pull ``r`` on instance ``i``: ``--qlm-confidence``'s
        while the looser backlog can afford it, down to :data:`PROTECT_FLOOR_Z` (the mean answer) as it runs
        out of slack.

        Eq. 12 asks every group to meet its deadline with probability Delta. The room is kept for a tight
        request that has not arrived; sized at its 90 % answer while the looser requests waiting are short
        of time, it trades their likely deadlines for the other class's unlikely tail. So the RCT
        estimator is asked about the looser backlog *held*: ``r`` and the requests as loose as it queued on
        ``i``'s virtual queue, in order, each starting when one of the slots the looser requests hold now
        frees (each at its mean remaining time, :meth:`Estimator.remaining`), prefilled, then its output
        at ``step_s`` (the batch's step now). A member's odds are the standard score of the longest answer
        it would still end by its deadline at; the room is sized at the lowest of them (at most
        ``--qlm-confidence``'s). A member that misses even at its mean answer is lost either way (the
        plan's Moore-Hodgson rule drops such groups) and bounds nothing, as is one that misses started
        now. With minutes of slack (a 120-180 s class) the backlog keeps the tail; a 75-90 s class with
        long prompts, which under the tail's room waited until it could wait no longer and then ran late,
        goes in earlier (docs/papers.md).
        """
        top = self.config.z
        model = self.models[i]
        budget = self._budget(r)
        loose = [x for x in run if (x.e2e_only or x.resumed) and self._budget(x) >= budget]
        # The looser class keeps the slots it holds now: each frees when its request ends (at the mean).
        free = sorted(self.estimator.remaining(model, x, now_s)[0] for x in loose) or [0.0]
        backlog = [r]
        for gid in self.vqs[i]:
            g = self.groups.get(gid)
            if g is None or not g.e2e_only:
                continue
            backlog.extend(x for x in g.members if x is not r and self._budget(x) >= budget)
        lowest = top
        for x in backlog:
            mean, std = self.stats.estimate(x.request.slo_class, x.request.max_tokens)
            prefill = model.prefill_s(x.prompt_tokens)
            need = min(max(mean - x.generated, 1.0), float(x.max_tokens))
            if now_s + prefill + need * step_s > x.deadline_s:
                continue  # lost even started now: it bounds nothing
            start = heapq.heappop(free)
            heapq.heappush(free, start + prefill + need * step_s)
            fits = (x.deadline_s - now_s - start - prefill) / step_s + x.generated
            z = (fits - mean) / std if std > 0.0 else (top if fits >= mean else -math.inf)
            if z >= PROTECT_FLOOR_Z:
                lowest = min(lowest, z)
        return lowest

    def _has_slack(self, i: int, run: Sequence[QlmRequest], r: QlmRequest, now_s: float) -> bool:
        """Would e2e-judged ``r`` still meet its deadline pulled on instance ``i`` only once the streams running
        there have ended?

        The RCT estimator's answer at its confidence: each running stream's end at its quantile
        (:meth:`Estimator.remaining`), then ``r``'s whole duration at its quantile. Such a request can
        wait for the streams it would slow or stall (the paper's e2e deadlines leave it the time), so
        :meth:`_room` holds its pull to the stricter of the streams' targets and the ``slo`` policy's
        bar for them.
        """
        model = self.models[i]
        _, _, _, whole_q = self.estimator.duration(model, r)
        wait = max(
            (self.estimator.remaining(model, x, now_s)[1] for x in run if not (x.e2e_only or x.resumed)),
            default=0.0,
        )
        return now_s + wait + whole_q <= r.deadline_s

    def _correction(self) -> Correction | None:
        source = self.calibration
        return None if source is None else source()

    def _stream_step_s(self, i: int, batch: int, tokens: float) -> float:
        """The time per output token a stream sees on instance ``i`` in a decode batch of ``batch`` requests
        holding ``tokens`` tokens (the router's prediction, as the ``slo`` policy's ``predicted_tpot``).

        With the router's calibration: the profile's step as the calibration corrects it (its TPOT
        factor or refit, from the step samples the engines report), plus the measured interleave, the
        prefill time that ran between decode steps lately (recency-weighted): the same prediction
        the ``slo`` policy holds every stream to under ``edf``. Without one (calibration off, or no
        samples yet): the profile's step times the learned inefficiency (Eq. 4's epsilon).

        Epsilon is the paper's (e2e) model, an average over finished requests, and it lags: the
        streams the virtual queues pulled ran at 66-87 ms TPOT against a 70 ms target in batches this
        predicted at 51-58 ms (rag + reports past capacity, docs/papers.md). The calibration reads
        the steps as they run, and its interleave is the prefill of prompts already computed; the
        prefill known to come next (the prompts still queued on the instance and the newcomer's) is
        priced on top of it by :meth:`_stall_fits`, as the ``slo`` policy's residents' filter adds
        ``prefill_stall_ms`` to ``predicted_tpot``: the two count different prompts (computed and not
        yet computed), only their forecasts overlap.
        """
        model = self.models[i]
        assert model.step_s is not None
        profile_s = model.step_s(batch, tokens)
        correction = self._correction()
        if correction is None:
            return profile_s * self.inefficiency[i]
        return correction.tpot_ms_at(i, profile_s * 1e3, float(max(batch, 1)), tokens) * 1e-3

    def _stall_fits(
        self,
        i: int,
        run: Sequence[QlmRequest],
        r: QlmRequest,
        step_s: float,
        now_s: float | None = None,
        *,
        cautious: bool = False,
    ) -> bool:
        """Do the streams running on instance ``i`` keep their TPOT targets when ``r``'s prompt is prefilled
        beside them?

        The engine chunks a new prompt's prefill into the decode steps of the batch running, so each
        stream decoding there waits for it once, and its mean time per output token grows by that
        prefill over the tokens it has still to generate (its expected output given how far it has
        got, :meth:`OutputStats.given`). The paper's estimator has no prefill cost beside the decodes
        (its SLOs are end to end), and the learned inefficiency carries it only on average, from
        finished requests: a 3,000-token prompt pulled beside a stream with 40 tokens left adds
        ~7 ms to each of them, and in the first seconds of a run (the factor still 1) streams beside
        long e2e prompts missed TPOT targets of 60 ms at 60-106 ms (docs/papers.md). ``step_s``: the
        grown batch's decode step as a stream sees it (:meth:`_stream_step_s`: the measured interleave
        included; the stall here is the prefill known to come next, on top of it). The prompts pulled
        there that are still in their prefill (by the router's clock) come first and stall the same
        streams (the ``slo`` policy's filter counts an instance's prefill backlog the same way).
        """
        model = self.models[i]
        if model.stall_s is None:
            return True  # no prefill model beside the decodes: the learned inefficiency carries it
        filling = (
            []
            if now_s is None
            else [x for x in run if now_s - x.dispatched_s < model.prefill_s(x.prompt_tokens)]
        )
        # Per request still in its prefill: the prompt tokens pulled after it (``run`` is in the order of
        # the pulls), one pass from the end.
        after: dict[str, int] = {}
        queued = 0
        for x in reversed(filling):
            after[x.request_id] = queued
            queued += x.prompt_tokens
        correction = self._correction()
        factor = 1.0 if correction is None else correction.ttft_factor.item(i)
        # The calibrated prefill speed, as the ``slo`` policy's residents' filter prices the same stall
        # (``prefill_stall_ms``: the profile's chunks times the TTFT factor).
        stall_all = model.stall_s(r.prompt_tokens + queued) * factor
        stall_ahead = model.stall_s(queued) * factor if filling else 0.0
        lenient: bool | None = None
        for x in run:
            if x.e2e_only or x.resumed:
                continue
            stall = stall_all
            behind = after.get(x.request_id)
            if behind is not None:
                # A stream still in its prefill: its own prompt and those prefilled before it come before
                # its first token (its TTFT, not its TPOT); only the prompts pulled after it stall its
                # decode.
                stall = model.stall_s(r.prompt_tokens + behind) * factor
            target_ms = self._tpot_ms(x)
            if cautious:
                # A pull that can wait: the ``slo`` policy's bar too, and a stream of a class with no
                # finished answer yet counts as one token from its end (its ``max_tokens`` stands for
                # its length until then, which spread a long prompt's stall over hundreds of tokens
                # the first answers never had: the first voice streams saw 122-127 ms beside audit
                # prompts that had minutes of slack, docs/papers.md).
                target_ms = min(target_ms, self.default_tpot_ms)
            mean, _ = self.stats.given(x.request.slo_class, x.request.max_tokens, x.reached)
            # Over the tokens left, not the whole answer: the cautious side (the ``slo`` policy's
            # residents' TPOT filter divides the same way); over the whole answer lost 1-3 points.
            left = max(mean - x.reached * x.request.max_tokens, 1.0)
            if cautious and self.stats.distribution(x.request.slo_class) is None:
                left = 1.0
            if lenient is None:
                lenient = (
                    r.e2e_only
                    and not cautious
                    and not any(not (y.e2e_only or y.resumed) for y in self.queued.values())
                )
            if lenient:
                # An e2e pull that would miss waiting, while no stream waits for the room: its own prompt's
                # stall counts against the stream's whole answer (its TPOT is the mean over every token,
                # and the tokens out ran at the step), the prompts still in their prefill ahead of it
                # against the tokens left as before. Over the tokens left, a stream a few tokens from its
                # end refused every long e2e prompt alone (reports waited beside assistant streams:
                # 62.1 % against ``edf``'s 89.6 row, docs/papers.md); with streams waiting, the room
                # the e2e request takes is theirs (rag + reports lost 1 point to refusals).
                done = x.reached * x.request.max_tokens
                ahead = stall_ahead if behind is None else 0.0
                own = stall - ahead
                if (step_s + ahead / left + own / (done + left)) * 1e3 <= STREAM_TPOT_SHARE * target_ms:
                    continue
                return False
            if (step_s + stall / left) * 1e3 > STREAM_TPOT_SHARE * target_ms:
                return False
        return True

    @staticmethod
    def _tokens_now(run: Iterable[QlmRequest]) -> float:
        """KV tokens the requests ``run`` hold now: each prompt and the output it has reached (its progress:
        :meth:`_progress`, the router's clock)."""
        return sum(x.request.prompt_tokens + x.reached * x.request.max_tokens for x in run)

    def _kv(self, x: QlmRequest) -> tuple[float, float]:
        """(mean, variance) of the KV tokens ``x`` holds at its end: its prompt and its whole output given how
        far it has got (:meth:`OutputStats.given`), less what an eviction already moved into the prompt and
        the prefix blocks other requests running on its instance hold (``x.shared``)."""
        version = self.stats.version
        memo = x.kv_memo
        if memo is not None and memo[0] == version and memo[1] == x.reached:
            return memo[2] - x.shared, memo[3]
        mean, std = self.stats.given(x.request.slo_class, x.request.max_tokens, x.reached)
        rest = min(max(mean - x.generated, 1.0), float(x.max_tokens))
        kv = float(x.prompt_tokens) + rest
        x.kv_memo = (version, x.reached, kv, std * std)
        return kv - x.shared, std * std

    def _hashes(self, r: QlmRequest) -> tuple[int, ...]:
        """The prefix block hashes ``r``'s run shares with other prompts (none without a prefix source, and
        none for a resumed run, whose prompt the dispatch sends without them)."""
        if not self.prefix_block_tokens or r.resumed:
            return ()
        return r.request.prefix_hashes

    def _shared_on(self, i: int, r: QlmRequest) -> int:
        """Prompt tokens of ``r`` that requests running on instance ``i`` hold in its KV now.

        An engine with a prefix cache keeps a prompt's full blocks once however many running requests
        reference them, so a prompt behind a shared prefix takes only the rest of the KV where another
        request running there brought the prefix (the ``slo`` policy's exact KV peak counts a started
        leg the same way). The hashes are chained, so the blocks held are the prompt's leading ones.
        Counted against the running requests, not the prefix index: a cached block no running request
        references is free KV the engine reclaims, and taking it back costs its room again. Counting
        every prompt whole, the pull rule held a shared-prefix mix's batches at about half the KV the
        engines had (docs/papers.md, Seed 004, 3 Dec).
        """
        hashes = self._hashes(r)
        if not hashes:
            return 0
        held = self._held[i]
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return min(n * self.prefix_block_tokens, max(r.prompt_tokens - 1, 0))

    def _release(self, i: int, r: QlmRequest) -> None:
        """``r`` left instance ``i``'s running batch: its references to prefix blocks go, and a block it was
        counted with that others still reference is counted with one of them from now on (the engine frees
        it only with its last holder; counted with nobody, the batch over-filled the KV: 38 preemptions
        where none came with the hand-over, docs/papers.md)."""
        hashes = self._hashes(r)
        if hashes:
            held, owner = self._held[i], self._owner[i]
            held.subtract(hashes)
            orphans = []
            for h in hashes:
                if held[h] <= 0:
                    del held[h]
                    owner.pop(h, None)
                elif owner.get(h) is r:
                    orphans.append(h)
            if orphans:
                block = self.prefix_block_tokens
                for x in self.running[i].values():
                    if not orphans:
                        break
                    mine = set(self._hashes(x))
                    took = [h for h in orphans if h in mine]
                    if took:
                        for h in took:
                            owner[h] = x
                        x.shared = max(x.shared - len(took) * block, 0)
                        orphans = [h for h in orphans if h not in mine]
        r.shared = 0

    def _batch_kv(self, run: Sequence[QlmRequest], r: QlmRequest | None = None, r_shared: int = 0) -> float:
        """KV tokens the batch ``run`` (and ``r``) holds at its end, at ``--qlm-confidence``.

        §6's pull rule counts the running batch's tokens against the GPU's capacity; the batch must
        still fit when its answers end, so each request counts at its expected end (given its progress:
        a long-running request is expected long) and the batch adds one margin at the confidence
        quantile for the sum: the lengths are independent, so the spread of a sum of n grows with
        the square root of n. Counting each request at its own quantile sized the margin n times over
        (``z`` standard deviations per request), which, once the output estimate stopped being biased
        short, held batches well below the cache (docs/papers.md).
        """
        total = var = 0.0
        for x in run:
            m, v = self._kv(x)
            total += m
            var += v
        if r is not None:
            m, v = self._kv(r)
            total += m - r_shared
            var += v
        return total + self.config.z * math.sqrt(var)

    def _left_tokens(self, x: QlmRequest, z: float | None = None) -> float:
        """Output tokens ``x`` still has to generate at the estimator's confidence (``z``: at that many
        standard deviations above the mean instead; 0 is the mean).

        A running request's answer is judged given how far it has got (:meth:`OutputStats.given`, its
        progress by the router's clock: :meth:`_progress`), as its KV is (:meth:`_kv`): one that has
        outlived the typical answer is expected to be long, and one that has nearly reached it has
        little left. The class's unconditional quantile less the tokens produced since dispatch
        called a request halfway through a typical answer as far from its end as a fresh one's
        spread allows, and e2e pulls waited behind requests the pull would not have made late
        (docs/papers.md).
        """
        z = self.config.z if z is None else z
        if x.instance < 0:
            mean, std = self.stats.estimate(x.request.slo_class, x.request.max_tokens)
            return min(max(mean + z * std - x.generated, 1.0), float(x.max_tokens))
        mean, std = self.stats.given(x.request.slo_class, x.request.max_tokens, x.reached)
        end = min(mean + z * std, float(x.request.max_tokens))
        return max(end - x.reached * x.request.max_tokens, 1.0)

    def _room_wait(self, i: int, r: QlmRequest, now_s: float) -> float:
        """Seconds until ``r`` may be pulled on instance ``i``: running requests end in the order the
        estimator expects (at its confidence) until the rest leaves ``r`` room."""
        model = self.models[i]
        ends = sorted(
            (self.estimator.remaining(model, x, now_s)[1], x.request_id) for x in self.running[i].values()
        )
        gone: set[str] = set()
        for end, rid in ends:
            gone.add(rid)
            if self._room(i, r, frozenset(gone), now_s, paced=False):
                return end
        return ends[-1][0] if ends else 0.0

    def _tpot_ms(self, r: QlmRequest) -> float:
        return resolve_targets(r.request, self.default_ttft_ms, self.default_tpot_ms).tpot_ms

    def _pull(self, i: int, now_s: float) -> list[Dispatch]:
        out: list[Dispatch] = []
        vq = self.vqs[i]
        while vq:
            group = self.groups[vq[0]]
            if not group.members:
                self._drop_group(i, group)
                continue
            group = self._urgent_stream(i, group, now_s)
            first = group.members[0]
            if self._stream_late(first, now_s):
                # A stream whose first token is on time nowhere goes behind the queue's on-time groups:
                # the plan's late groups go last (:meth:`_stream_late`).
                free = self._engines_free_s(now_s)
                on_time = next(
                    (
                        g
                        for g in (self.groups[gid] for gid in vq)
                        if g.members and not self._stream_late(g.members[0], now_s, free)
                    ),
                    None,
                )
                if on_time is not None:
                    group = self._urgent_stream(i, on_time, now_s)
                    first = group.members[0]
            if first.e2e_only or first.resumed:
                if not self._room(i, first, now_s=now_s):
                    self._observe_batch(i)
                    break
                earlier = self._earlier_of_class(i, first, now_s)
                if earlier is not None:
                    out.append(self._take(i, *earlier, now_s))
                    continue
                out.append(self._take(self._tight_pull_home(i, first, now_s), i, group, now_s))
                continue
            home = self._stream_home(i, first, now_s)
            if home < 0:
                self._observe_batch(i)
                break
            out.append(self._take(home, i, group, now_s))
        return out

    def _earlier_of_class(self, i: int, r: QlmRequest, now_s: float) -> tuple[int, Group] | None:
        """A request of ``r``'s class due before ``r``, first in a group started on another instance (pinned
        there) that holds more requests than that instance's batch and that the plan expects late there,
        which that instance cannot start now and instance ``i`` can start now and end in time
        (:meth:`_end_now_s`), with a prompt no longer than ``r``'s: (its queue, its group), the one due
        first; else None.

        The plan places each group where it finishes first, and a started group stays on its instance's
        queue (the plan may not move it). A group is up to delta average batches, so a long-prompt class's
        group is several rounds of one instance's cache: once that cache is full, the group's later
        members wait there while the other instances pull their own queues' groups of the same class, due
        later, and the class is served out of deadline order (completions + tickets + ledgers: a
        67-request `ledgers` group due at 113-128 s, expected late on its full instance, waited there
        while the other three ran `ledgers` due at 137 s and later; `ledgers` 81.4 % against ``edf``'s
        93.2, docs/papers.md). The RCT estimate of the group where it is stuck (the plan's expected
        misses) says who needs the move, and the request must end in time where it moves: a rescue, not
        a reorder. Requests of one class are alike to the pull rules (one budget, one pace, one answer's
        estimate) and the one taken holds no more KV than ``r``, so ``i`` admits what it admitted: the
        paper's pulling with the plan's order kept on every queue, as :meth:`_pull_other` pulls for an
        instance whose own queue is empty. (The ones a full instance cannot start are its long prompts:
        taken whatever their length, api + batch lost 1.1 points, `batch` 92.3 % against 95.1. Without
        the pinned and larger-than-a-batch conditions, a few `digests` pulled 2-4 s ahead of their turn
        early in triage + digests changed that row's drain: 87.7 % against 90.1, docs/papers.md.)
        """
        if not (r.e2e_only and not r.resumed):
            return None
        cls, budget = r.request.slo_class, self._budget(r)
        best: tuple[float, int, Group] | None = None
        for j, vq in enumerate(self.vqs):
            if j == i:
                continue
            for pos, gid in enumerate(vq):
                g = self.groups.get(gid)
                if g is None or not g.members:
                    continue
                m = g.members[0]
                if m.request.slo_class != cls or not m.e2e_only or m.resumed or self._budget(m) != budget:
                    continue
                # The first such group on queue ``j`` only: its members are in deadline order.
                if (
                    m.deadline_s < r.deadline_s
                    and (best is None or m.deadline_s < best[0])
                    and self.expected_missing.get(gid, 0) > 0
                    and g.pinned == j
                    and len(g.members) > self.models[j].batch
                    and m.prompt_tokens <= r.prompt_tokens
                    and now_s + self._end_now_s(i, m, now_s) <= m.deadline_s
                ):
                    waits = pos > 0 or not self._room(j, m, now_s=now_s)
                    if waits and self._room(i, m, now_s=now_s):
                        best = (m.deadline_s, j, g)
                break
        return None if best is None else (best[1], best[2])

    def _tight_pull_home(self, i: int, r: QlmRequest, now_s: float) -> int:
        """The instance that starts e2e ``r`` pulled at the head of virtual queue ``i``: ``i``, unless ``r`` is of
        the tightest e2e class, would end late there (:meth:`_end_now_s`: behind the prefill queued in
        the engine, at the step its prefill load leaves) and ends in time on another instance with room
        for it (the one where it ends first).

        The paper's load balancing (§5) assigns groups to virtual queues and lets each instance pull its
        own; a group is sized in average batches, so a tight group of short answers is many requests,
        and their instance pulls them one by one into its own batch. Where the class's cost is its
        prompt each pull adds a prefill every running member waits through, and :meth:`_room` does not
        hold a pull back for its own class (that trades one for the other): the group's instance did
        little but prefill it while others had the time to (docs/papers.md). A pull moved here keeps the
        plan's order: only the head moves, as for streams (:meth:`_stream_home`)."""
        if not (r.e2e_only and not r.resumed and self._tightest(r, now_s)):
            return i
        if now_s + self._end_now_s(i, r, now_s) <= r.deadline_s:
            return i
        best, best_end = i, math.inf
        for k in range(len(self.models)):
            if k == i:
                continue
            end = now_s + self._end_now_s(k, r, now_s)
            if end <= r.deadline_s and end < best_end and self._room(k, r, now_s=now_s):
                best, best_end = k, end
        return best

    def _stream_home(self, i: int, r: QlmRequest, now_s: float) -> int:
        """The instance that starts TTFT-judged ``r`` (at the head of virtual queue ``i``): of those with room
        for it where its first token is on time (behind the prefill queued there,
        :meth:`_prefill_backlog_s`, and its own), the one where its step would be shortest (the grown
        batch at its mean context over ``r``'s life, as :meth:`_stream_step_s` predicts it: what its TPOT
        target judges), ``i`` on a tie; with none on time, the one where its first token comes soonest;
        -1: none has room.

        The first token is the stream's own first target, which the ``slo`` policy's selector judges
        first too: keyed on the step alone, a stream went to the instance with the shortest step though
        e2e prompts pulled there held its engine's prefill for seconds, and missed its TTFT with no wait in
        the router (the default ``mixed`` workload on 4 instances at 9 req/s: chat 94.7 % against edf's
        97.7, TTFTs of 1.2-2.6 s; 97.9 % with the first token first, docs/papers.md).

        The paper balances load by assigning groups to virtual queues and lets each instance pull only
        its own (§5); its SLOs are end to end, judged when a request ends, and a group waits in its
        queue while the plan weighs it against the others. A stream is judged from its arrival (its
        first token), and while no queue has formed its group is one of like requests arriving one by
        one, every member of which the group's queue pulled: with one class, every stream went to one
        instance until its batch was at its step limit, its prefills queued behind each other (TTFT
        0.3-0.9 s with no wait in the router) while the other instances idled (chat alone: 74 %
        against edf's 91 %, docs/papers.md). So a stream is pulled by the instance with room where it
        runs fastest: load balancing at the pull, the plan's order kept on every queue. (Keyed on the
        fewest running requests or the most KV left instead, chat and a stream + backfill mix traded
        1-3 points between them; the step is the measure a stream's own target uses.)
        """
        best, best_key = -1, (True, math.inf, 0.0)
        out_mean, _ = self.stats.estimate(r.request.slo_class, r.request.max_tokens)
        for k in (i, *(k for k in range(len(self.models)) if k != i)):
            model = self.models[k]
            run = self.running[k].values()
            step_s = model.step_s
            if step_s is None:
                step = float(len(run))
            else:
                life = self._tokens_now(run) + r.prompt_tokens + 0.5 * min(out_mean, float(r.max_tokens))
                step = self._stream_step_s(k, len(run) + 1, life)
            cached = r.cached[k] if r.cached and not r.resumed else 0.0
            # On time: where the most of its prompt is cached (the slo policy's holder), then the shortest
            # step; late: the soonest first token.
            key = (False, -cached, step)
            if model.stall_s is not None and not r.resumed:
                first_s = (
                    now_s
                    + self._prefill_backlog_s(k, run, now_s)
                    + model.prefill_s(int(r.prompt_tokens - cached))
                )
                if first_s > r.deadline_s:
                    key = (True, first_s, 0.0)
            if key < best_key and self._room(k, r, now_s=now_s):
                best, best_key = k, key
        return best

    def _urgent_stream(self, i: int, head: Group, now_s: float) -> Group:
        """The group virtual queue ``i`` pulls from next: ``head``, unless a TTFT-judged request further
        back is due before the head's deadline and still on time.

        The paper's queue holds end-to-end deadlines only, which its plan orders as a whole; here a
        TTFT-judged stream that the plan left behind a group of long e2e requests (expected late on a
        stale estimate, or behind a group that started) would wait until that group is pulled out,
        the batch full of it, and miss a deadline of seconds for one minutes away. The earliest such
        deadline goes first, and while it cannot be started no e2e request takes the room it needs.
        """
        best = head
        due = head.members[0].deadline_s
        for gid in self.vqs[i][1:]:
            g = self.groups[gid]
            if not g.members:
                continue
            first = g.members[0]
            if first.e2e_only or first.resumed or not now_s < first.deadline_s < due:
                continue
            if self._stream_late(first, now_s):
                continue
            best, due = g, first.deadline_s
        return best

    def _engines_free_s(self, now_s: float) -> list[float] | None:
        """When each instance's engine is done with the prefill queued there (:meth:`_prefill_backlog_s`);
        None while an instance's model has no stall estimate yet (no stream is then judged late).

        Kept for one pass over the queued groups by :meth:`_stream_late`'s callers that judge many of them
        before the running requests change: the backlog sorts each instance's running requests."""
        if any(model.stall_s is None for model in self.models):
            return None
        return [
            now_s + self._prefill_backlog_s(k, self.running[k].values(), now_s)
            for k in range(len(self.models))
        ]

    def _stream_late(
        self, r: QlmRequest, now_s: float, free: list[float] | EllipsisType | None = ...
    ) -> bool:
        """Is ``r`` TTFT-judged with its first token on time nowhere: its deadline passed, or on every instance
        the prefill queued in the engine (:meth:`_prefill_backlog_s`) or the wait for KV room for it
        (:meth:`_kv_wait_s`), then its own prefill, end after it?

        The plan serves the groups it expects late last, behind every group still on time (Moore-Hodgson's
        drop, :func:`heuristic_plan`), as ``edf`` moves a request whose first token can no longer come in
        time behind every on-time one. The estimator sees a stream's start through its decode slots, not
        through the prompts the engines still have to prefill, so such a stream stayed at the head of its
        queue (a stream's deadline is the earliest there) and was pulled late, its long prompt prefilled
        beside the e2e work waiting behind it: on rag + reports (2,500-token prompts with a 2 s TTFT
        beside 45 s reports) 44 streams ran and missed, and the reports ``edf`` met and this queue missed
        waited 12 s in the router (p50; ``edf`` 0.9, docs/papers.md). A stream on time nowhere is pulled
        once no on-time group on its queue waits (:meth:`_pull`), is nobody's urgent stream
        (:meth:`_urgent_stream`, :meth:`_pull_urgent`), and an idle instance takes it after the on-time
        groups (:meth:`_pull_other`); the late path refuses it past its allowance (:meth:`lapsed`).

        The cache counts as the engine's prefill does: past capacity a stream at the head of its queue waits
        for the running batch to leave it room, and the router queue's hopeless test counts the work in
        front of a request, not the engine's backlog alone. Judged by the backlog only, a stream no
        instance had room for until after its deadline held its queue, and the on-time e2e requests
        behind it that fit waited with it (rag + reports 79.0 % against ``edf``'s 80.2; with the cache,
        79.8, docs/papers.md)."""
        if r.e2e_only or r.resumed:
            return False
        if now_s >= r.deadline_s:
            return True
        # ``free``: :meth:`_engines_free_s` of this moment when the caller has it (``...``: found here).
        engines = self._engines_free_s(now_s) if free is ... else free
        if engines is None:
            return False
        for k, (first_s, model) in enumerate(zip(engines, self.models, strict=True)):
            prefill = model.prefill_s(r.prompt_tokens)
            if first_s + prefill > r.deadline_s:
                continue
            if now_s + self._kv_wait_s(k, r, now_s) + prefill <= r.deadline_s:
                return False
        return True

    def _kv_wait_s(self, i: int, r: QlmRequest, now_s: float) -> float:
        """Seconds until the batch running on instance ``i`` leaves ``r`` room in the KV cache: its requests end
        at their mean given their progress (:meth:`_left_tokens`, at the estimator's step) until the rest
        and ``r``, counted at their ends with one margin for the sum (:meth:`_batch_kv`), fit the cache and
        its sequences.

        The KV part of :meth:`_room` alone (the part that holds a stream at a full instance), priced per
        running batch once per change of it, so that a queue pass can ask it of every stream it judges."""
        model = self.models[i]
        if not model.kv_tokens:
            return 0.0
        key = (now_s, self.batch_changes[i], self.stats.version, model.decode_step_s)
        memo = self._kv_ends.get(i)
        if memo is None or memo[0] != key:
            ends = sorted(
                (self._left_tokens(x, 0.0) * model.decode_step_s, *self._kv(x))
                for x in self.running[i].values()
            )
            memo = (key, ends)
            self._kv_ends[i] = memo
        ends = memo[1]
        m, v = self._kv(r)
        total = m - self._shared_on(i, r) + sum(e[1] for e in ends)
        var = v + sum(e[2] for e in ends)
        n = len(ends)
        z = self.config.z
        wait = 0.0
        for end, em, ev in ends:
            if total + z * math.sqrt(max(var, 0.0)) <= model.kv_tokens and not (
                model.most and n >= model.most
            ):
                return wait
            total, var, n, wait = total - em, var - ev, n - 1, end
        return wait

    def _observe_batch(self, i: int) -> None:
        """The instance is full (a pull was refused): its running batch is a sample of the average batch.

        The estimator's slots and decode step follow the batch KV pulling really reaches (an
        exponential average of the full batches seen), which is the paper's "average batch size"
        that the throughput and the group bound (delta x the average batch) are stated in.

        Each full batch is one sample, however many pulls it refuses: the router pumps on every
        status push (every few tens of ms), the simulator on its engines' events, and counting a
        sample per refused pull made the average follow the caller's pump rate. In the parity
        workload (tests/router/e2e/test_parity.py) the live router's average fell from 64 to 7 in
        0.3 s where the simulator's fell to 52, and the two placed the first burst differently.
        """
        run = self.running[i]
        if not run or self.batch_sampled[i] == self.batch_changes[i]:
            return
        self.batch_sampled[i] = self.batch_changes[i]
        self.batch_seen[i] = 0.9 * self.batch_seen[i] + 0.1 * len(run)
        context = sum(self._tokens(x) for x in run.values()) / len(run) * 0.75
        self.context_seen[i] = 0.9 * self.context_seen[i] + 0.1 * context
        self._refresh(i)

    def _refresh(self, i: int) -> None:
        base = self.base_models[i]
        batch = max(round(self.batch_seen[i]), 1)
        pure = base.decode_step_s
        if base.step_s is not None:
            pure = base.step_s(batch, batch * self.context_seen[i])
        self.pure_step[i] = pure
        self.models[i] = dataclasses.replace(base, batch=batch, decode_step_s=pure * self.inefficiency[i])

    def _pull_other(self, i: int, now_s: float) -> list[Dispatch]:
        """Request pulling across virtual queues: instance ``i``'s queue is empty but it has free slots.

        The plan assigns groups to virtual queues from the estimator's view
        at its last run, which is re-run only when a miss is predicted; in
        between, requests finish earlier or later than estimated and one
        instance can run dry while another's queue still waits (a burst of
        one group lands on one queue). Leaving slots idle then can only
        delay someone, so the idle instance takes the most urgent waiting
        request elsewhere (earliest deadline still ahead, then queue
        position): the paper's pulling, with the plan's order kept on every
        queue. The group stays where the plan put it (its members pulled
        here just leave it), so no group is split or reordered.
        """
        out: list[Dispatch] = []
        while self.queued:
            best: tuple[float, int, int, int] | None = None  # (urgency, position, gid, queue)
            free = self._engines_free_s(now_s)
            for j, vq in enumerate(self.vqs):
                for pos, gid in enumerate(vq):
                    group = self.groups[gid]
                    if group.members and self._room(i, group.members[0], now_s=now_s):
                        # A stream whose first token is on time nowhere goes after the on-time groups.
                        late = self._stream_late(group.members[0], now_s, free)
                        key = (math.inf if late else group.urgency_s(now_s), pos, gid, j)
                        if best is None or key < best:
                            best = key
            if best is None:
                break
            _, _, gid, j = best
            out.append(self._take(i, j, self.groups[gid], now_s))
        return out

    def _drop_group(self, i: int, group: Group) -> None:
        self.vqs[i].remove(group.gid)
        del self.groups[group.gid]
        if self.open.get(group.key) == group.gid:
            del self.open[group.key]

    def _evictable(self, r: QlmRequest, group: Group) -> bool:
        """May running ``r`` be evicted for ``group``: an e2e-only request of another, looser group."""
        return (
            r.e2e_only
            and r.group != group.gid
            and r.deadline_s > group.deadline_s
            and r.evictions < self.config.max_evictions
        )

    def _restart(self, model: InstanceModel, r: QlmRequest, now_s: float) -> tuple[float, float]:
        """(mean, quantile) seconds running ``r`` takes if evicted now: a prefill of its prompt and the tokens
        it generated, then the rest of its output."""
        rest_m, rest_q = self.estimator.remaining(model, r, now_s)
        done = max(now_s - r.dispatched_s - model.prefill_s(r.prompt_tokens), 0.0) / model.decode_step_s
        again = model.prefill_s(r.prompt_tokens + int(done))
        return again + rest_m, again + rest_q

    def _survives(
        self,
        r: QlmRequest,
        group: Group,
        now_s: float,
        others: Sequence[QlmRequest] | None = None,
        before: Sequence[QlmRequest] = (),
        start_q: float | None = None,
    ) -> bool:
        """May evicting running ``r`` for ``group`` cost no request on time: does ``r`` still meet its deadline?

        The evicted request queues again right behind ``group`` (and the
        requests evicted ``before`` it) on its instance, then recomputes its
        prompt and the tokens it generated (a prefill of both) before decoding
        the rest: its completion is estimated with ``group`` placed first on
        the slots of the ``others`` left running (default: all but ``r``).
        The paper's plan weighs an evicted request's own deadline; without this
        check an eviction that saves a tight request can cost a loose one that
        was on time, which is no gain in requests on time (in simulation at
        14 req/s, a third of the evicted requests then missed their own
        deadline). A request predicted to miss even if it is left running may
        be evicted: no request on time is lost. ``start_q``: the requeued
        request's start (relative quantile), when the caller knows it.
        """
        i = r.instance
        if i < 0:
            return False
        model = self.models[i]
        if start_q is None:
            if others is None:
                others = [x for x in self.running[i].values() if x is not r]
            slots = self.estimator.slots(model, others, now_s)
            self.estimator.place(model, slots, group, now_s)
            for v in before:
                slots.take(*self._restart(model, v, now_s))
            _, start_q, _ = slots.take(0.0, 0.0)
        _, whole_q = self._restart(model, r, now_s)
        if now_s + start_q + whole_q <= r.deadline_s:
            return True
        if not group.e2e_only:
            # For a TTFT-judged head (this router's adaptation) a victim must still meet its deadline:
            # late at the estimator's confidence is not late for sure, and a stream may not take an e2e
            # request's chance that ``edf`` would have left it. Evicting the ones late at the quantile
            # too, streams evicted reports on rag + reports and faq + contracts that then missed (54
            # and 56 evictions over the seeds, 3 and 10 without; docs/papers.md).
            return False
        _, rest_q = self.estimator.remaining(model, r, now_s)
        return now_s + rest_q > r.deadline_s

    def _start_behind(
        self,
        i: int,
        group: Group,
        now_s: float,
        running: Sequence[QlmRequest] | None = None,
        before: Sequence[QlmRequest] = (),
    ) -> float:
        """When a request evicted on instance ``i`` for ``group`` would start again (relative quantile).

        For an e2e-only group, the paper's setting, right behind it: the victim is queued there. For a
        TTFT-judged group (this router's adaptation), once the instance has run everything it holds and
        everything queued for it (at the confidence quantile): a stream is evicted for where streams
        keep arriving, each one that comes goes before the victim (the streams' reserve, their pull
        rules), and the victim must lose no deadline whatever comes first. Judged right behind the
        stream, victims of a 45 s class were evicted for long-prompt streams (TTFT 2 s) 76 times over 3
        seeds and most then missed: rag + reports 64.8 % against 73.9 % with no eviction for streams,
        support + translate + archive 90.9 against 91.4 (docs/papers.md); judged behind the queue
        alone, still 66 times on one seed (64.2 %). A loose victim with minutes of slack still yields
        to a stream stuck behind a full engine (``tests/sim/test_sim_qlm.py``).
        """
        model = self.models[i]
        if running is None:
            running = list(self.running[i].values())
        slots = self.estimator.slots(model, running, now_s)
        for v in before:  # evicted before it: they restart first
            slots.take(*self._restart(model, v, now_s))
        ahead = [group]
        if not group.e2e_only:
            ahead += [self.groups[g] for g in self.vqs[i] if g != group.gid and g in self.groups]
        for g in ahead:
            self.estimator.place(model, slots, g, now_s)
        return slots.take(0.0, 0.0)[1] if group.e2e_only else slots.finish_q()

    def _evict(self, i: int, now_s: float, evict: Evict) -> bool:
        """Request eviction (§5): the head group's next request cannot be pulled (no KV room), would miss its
        deadline waiting and would meet it if it started now: running requests of looser e2e-only groups
        are evicted, loosest first, until it fits.

        Only victims that still meet their own deadline after re-running behind the head, or miss it
        anyway, may go (:meth:`_survives`): an eviction must not trade one request on time for another.
        """
        head = self.groups[self.vqs[i][0]]
        if not head.members:
            return False
        first = head.members[0]
        if self._room(i, first, now_s=now_s, paced=False):
            return False
        model = self.models[i]
        running = list(self.running[i].values())
        evictable = sorted(
            (r for r in running if self._evictable(r, head)), key=lambda r: (-r.deadline_s, r.request_id)
        )
        if not evictable:
            return False
        # The head's first request: on time only if it starts now? It waits until enough running
        # requests end for it to fit (KV room, and the step its TPOT target allows).
        _, pre_q, _, whole_q = self.estimator.duration(model, first)
        event = whole_q if first.e2e_only or first.resumed else pre_q
        if now_s + event > first.deadline_s:
            return False  # it misses even if it starts now: evicting cannot save it
        if now_s + self._room_wait(i, first, now_s) + event <= first.deadline_s:
            return False  # it meets its deadline waiting
        victims: list[QlmRequest] = []
        gone: set[str] = set()
        for r in evictable:
            others = [x for x in running if x.request_id not in gone and x is not r]
            # Where it restarts: right behind an e2e head (the paper's setting), once the instance has
            # run everything else for a stream (:meth:`_start_behind`).
            behind = None if head.e2e_only else self._start_behind(i, head, now_s, others, victims)
            if not self._survives(r, head, now_s, others, victims, start_q=behind):
                continue
            victims.append(r)
            gone.add(r.request_id)
            if self._room(i, first, frozenset(gone), now_s, paced=False):
                break
        else:
            return False  # the allowed victims do not make room
        done = False
        for r in victims:
            total = evict(r, i)
            if total is None:
                continue
            self._advance(i, now_s)
            del self.running[i][r.request_id]
            self._release(i, r)
            self.batch_changes[i] += 1
            self._reclock(i)
            self.evictions += 1
            done = True
            kept = max(min(total, r.request.max_tokens - 1), r.generated)
            r.generated = kept
            r.prompt_tokens = r.request.prompt_tokens + kept
            r.max_tokens = r.request.max_tokens - kept
            r.evictions += 1
            r.instance, r.dispatched_s = -1, math.nan
            # Back into its open group (at the front: it is the oldest), or a new group behind the head.
            self._add(r, now_s, front=True, instance=i)
        return done

    # ------------------------------------------------------------------ completions

    def finished(
        self, request_id: str, output_tokens: int | None = None, now_s: float | None = None
    ) -> QlmRequest | None:
        """A dispatched request ended; ``output_tokens`` (its whole output) and ``now_s`` teach the estimator.

        None as ``output_tokens``: it failed, nothing to learn.
        """
        for i, run in enumerate(self.running):
            r = run.get(request_id)
            if r is None:
                continue
            step = self.base_models[i].step_s
            step1 = math.nan
            if step is not None and output_tokens is not None:
                # The batch's step as it ends: the others where they have got, this one at its whole output.
                tokens = self._tokens_now(run.values()) - r.reached * r.request.max_tokens + output_tokens
                step1 = step(len(run), tokens)
            if now_s is not None:
                self._advance(i, now_s)
            del run[request_id]
            self._release(i, r)
            self.batch_changes[i] += 1
            self._reclock(i)
            if output_tokens is None:
                self.stats.dropped(r.request.slo_class, request_id)
            else:
                self.stats.observe(r.request.slo_class, output_tokens, r.request.max_tokens, request_id)
                if now_s is not None:
                    self._learn_inefficiency(i, r, output_tokens - r.generated, now_s, step1)
            return r
        return None

    def _learn_inefficiency(
        self, i: int, r: QlmRequest, tokens: int, now_s: float, step1_s: float = math.nan
    ) -> None:
        """The paper's inefficiency factor: observed decode time per token over the modelled step, per instance.

        Continuous batching mixes prefill chunks into decode steps and the
        engine may preempt, so a token takes longer than a pure decode step;
        an exponential average of the observed ratio scales the instance's
        step (bounded to [0.5, 8]).

        The modelled step is the one of the batch ``r`` ran in: the mean of the instance's predicted
        pure step when ``r`` joined (``r.step0_s``) and when it ended (``step1_s``), Eq. 4's d for that
        request. Dividing by the step of the instance's *average* batch instead made epsilon carry the
        gap between that batch and the one running: while few requests ran beside an average batch
        still at its initial KV-sized guess, epsilon fell to 0.76 and the stream rules in
        :meth:`_room` let batches grow past the TPOT target (chat alone lost 15-18 points to edf,
        docs/papers.md).
        """
        base = self.base_models[i]
        elapsed = now_s - r.dispatched_s - base.prefill_s(r.prompt_tokens)
        if tokens < 8 or not elapsed > 0:
            return
        modelled = self.pure_step[i]
        if math.isfinite(r.step0_s) and math.isfinite(step1_s):
            modelled = 0.5 * (r.step0_s + step1_s)
        ratio = min(max(elapsed / (tokens * max(modelled, 1e-6)), 0.5), 8.0)
        self.inefficiency[i] = 0.9 * self.inefficiency[i] + 0.1 * ratio
        self._refresh(i)

    def lapsed(self, now_s: float, allowance: float) -> list[QlmRequest]:
        """Take out and return the queued requests past their deadline that could no longer be served within
        ``allowance`` times their target beyond it: the router queue's bounded late path
        (``--late-allowance``; 0 under ``--late-policy reject``), which ``qlm`` shares.

        The paper serves every request in the end: a group the plan expects late goes last. Past
        capacity such a group still takes a batch's room whenever nothing on time can be pulled, and
        its requests, hopeless, are served at the cost of the ones that arrive meanwhile (the streams'
        tail of the rag + reports mix: 53 long-prompt requests 25 s and more past a 2 s TTFT target
        prefilled while the 45 s class waited, docs/papers.md). A TTFT-judged request goes once its
        first token, its prefill started once the first instance to have room for it has it (the
        running requests ending in the estimator's order, :meth:`_room_wait`), would come after its
        deadline plus ``allowance`` times its TTFT target; an e2e-only one once its completion, started now at the mean, would come after
        its deadline plus ``allowance`` times its e2e target. Only requests whose deadline has passed
        are judged (the plan's business before that), and a request evicted before is kept (its first
        run served the client already). Each call looks at the requests past their deadline only.
        """
        heap = self._deadlines
        while heap and heap[0][0] <= now_s:
            _, _, rid = heapq.heappop(heap)
            r = self.queued.get(rid)
            if r is not None and not r.resumed:
                self._overdue[rid] = r
        if not self._overdue:
            return []
        model = min(self.models, key=lambda m: m.decode_step_s)
        out: list[QlmRequest] = []
        for rid, r in list(self._overdue.items()):
            if self.queued.get(rid) is not r or r.resumed:
                del self._overdue[rid]
                continue
            pre_m, _, whole_m, _ = self.estimator.duration(model, r)
            span = r.deadline_s - r.arrival_s
            # A stream's first token comes once an instance has room for it: the router queue judges the
            # same by the rate it drained lately. Judged by its prefill alone, a stream no instance could
            # take for seconds was kept and served late, its long prompt prefilled beside the e2e class
            # (agent + digest: 83.4 % against ``edf``'s 84.5; with the wait, 83.9; rag + reports at 5.5
            # req/s 87.0 against 89.0, with it 88.5, docs/papers.md).
            wait = 0.0
            if not r.e2e_only:
                wait = min(self._room_wait(k, r, now_s) for k in range(len(self.models)))
            if now_s + wait + (whole_m if r.e2e_only else pre_m) > r.deadline_s + allowance * span:
                removed = self.remove(rid)
                assert removed is r
                out.append(r)
        return out

    def remove(self, request_id: str) -> QlmRequest | None:
        """Take a queued request out (cancelled by the client); None if it is not queued."""
        r = self.queued.pop(request_id, None)
        if r is None:
            return None
        self._overdue.pop(request_id, None)
        self.stats.dropped(r.request.slo_class, request_id)  # evicted before: its length stays unknown
        group = self.groups[r.group]
        group.members.remove(r)
        if not group.members:
            for i, vq in enumerate(self.vqs):
                if group.gid in vq:
                    self._drop_group(i, group)
                    break
        return r

    def check_invariants(self) -> None:
        """Every queued request in exactly one group of exactly one virtual queue; bounds hold (tests)."""
        seen: set[str] = set()
        for vq in self.vqs:
            for gid in vq:
                group = self.groups[gid]
                assert len(group.members) <= group.bound, "group over its bound"
                for r in group.members:
                    assert r.request_id not in seen, f"{r.request_id} twice"
                    assert r.group == gid
                    seen.add(r.request_id)
        assert seen == set(self.queued), "queued requests and groups disagree"
        in_vqs = [g for vq in self.vqs for g in vq]
        assert len(in_vqs) == len(set(in_vqs)) and set(in_vqs) == set(self.groups)
        for i, run in enumerate(self.running):
            model = self.models[i]
            assert len(run) <= max(model.batch, model.most) or model.batch == 0
            assert not set(run) & seen
