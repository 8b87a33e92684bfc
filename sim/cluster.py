"""The virtual-time cluster simulator behind ``slo-router simulate``.

One run replays a workload plan (:func:`bench.workload.generate_requests`) on a
simulated fleet (:mod:`sim.fleet`) with one scheduling policy, as a
discrete-event simulation: no sockets, no sleeping, no wall clock. The two
moving parts are the real ones:

- placement: :class:`router.core.scheduler.Scheduler` — the same scheduling core the
  gRPC router runs — decides every request over a
  :class:`router.core.columns.ClusterView` at the request's arrival time;
- engines: every instance is a :class:`sim.engine.SimCore` — the model
  the ``sim`` worker runs in real time — stepped in virtual time: a step
  starts when the engine has work, ends ``duration_ms`` later (from the
  instance's *ground truth*: its group's true profile, speed, noise and KV
  slowdown, loaded apart from the router's predictors), and its outputs drive
  the requests.

Calibration: with ``SchedulerConfig.calibration`` other than ``off`` the
scheduler's :class:`router.core.calibration.Calibrator` is fed, before every
decision, the step samples the engines finished since the previous one
(fast-forwarded runs included), as the agents' status pushes carry them to a
live router.

What a request goes through (times are virtual):

- neutral: the instance gets the whole request at arrival; TTFT is the end of
  the step that samples its first token;
- PD: the prefill instance gets the prompt with ``max_new_tokens=1`` and holds
  the KV; the first token exists at the end of that step (TTFT); the KV then
  moves for ``SimConfig.kv_transfer_s(prompt)`` of the *decode* instance
  (0 when adaptive PD put both stages on one instance), after which the
  prefill instance frees it and the decode instance admits the request with
  the prompt cached, exactly as the sim worker's ``Decode`` does;
- no placement (:class:`router.core.errors.NoInstanceError`, e.g. the ``slo``
  policy predicts every instance would miss the SLO): without a router queue
  the request is rejected at arrival with ``RESOURCE_EXHAUSTED``
  (``UNAVAILABLE`` for :class:`~router.core.errors.EmptyClusterError`) and
  misses its SLO; with one (``queue=QueueConfig(...)``) it waits in the same
  :class:`router.core.queue.RouterQueue` the router runs, offered again after
  every engine event (a step ending, a KV transfer landing) and at the moments
  an entry expires or turns late, exactly as the router's admission does on
  status pushes, completions and timers; an engine
  refusing a request (full waiting queue, too long for ``max_model_len``)
  fails it likewise (``RESOURCE_EXHAUSTED`` / ``INVALID_ARGUMENT``).

TPOT is the mean gap between output tokens after the first, e2e the time from
arrival to the last token; results are :class:`bench.report.RequestResult`
records, so ``bench`` and ``simulate`` report the same way.

What the router sees. Agents push status on every load change (a request
admitted, a step started or ended, KV freed) and heartbeat every
:data:`AGENT_HEARTBEAT_S`; pushes are instantaneous. So the view's load
columns are the engines' current counters, and a status's age is the time
since the instance's last change (a heartbeat resets the age, not the
content), or 0 for an idle instance. The router's backlog metric advances a
busy instance's backlog over that age, as it does live. Dispatch to a worker
is instantaneous too, so the only in-flight load (dispatched, not yet
reported) is a PD request's decode leg: counted on the decode instance from
the decision until that instance admits it after the KV transfer, as
:class:`router.core.inflight.InflightAccount` would.

Output lengths (no oracle). A request carries what a client sends: ``max_tokens`` (a cap),
its class, priority and SLO. The engine stops it at its true length
(``RequestPlan.true_output_tokens``: the workload's output distribution or the trace's
length, and with ``ignore_eos`` off an EOS drawn with the generating instance's
``eos_probability``, as the sim worker does). Policies that need a length get
``ScheduleInput.expected_output_tokens`` from a :class:`router.core.lengths.LengthPredictor`
fed only the lengths of requests that have finished, and the resident decode legs' remaining
output is that predictor's conditional estimate, never the engine's counter.
``oracle_lengths=True`` (``--oracle-lengths``) hands policies the true length instead, for
ablations only.

Simplifications: no network or RPC latency besides the KV transfer; no
retries or failover (every worker stays healthy); the router's tokenizer is exact
(``prompt_tokens`` is what the engine sees); a held KV is always pulled right
after its transfer (``kv_hold_timeout_s`` never fires).

Speed, without changing any result (``tests/bench/test_simulate.py`` runs both
ways and compares):

- the view is built from numpy columns updated only for instances whose
  engine changed since the previous decision (no protobuf snapshots), and
  values the core caches per snapshot that depend only on the fleet's static
  columns are carried from one decision's view to the next
  (:data:`STATIC_MEMO_KEYS`);
- idle engines are never stepped, and runs of identical pure-decode steps are
  fast-forwarded (:mod:`sim.fastforward`): planned from the engine's own
  cost model, seen by the router through computed columns, and applied to the
  engine only when the run ends or the instance is touched;
- the calibration is fed only the instances with steps it has not seen (a
  run's unfed steps are found by the end time of the first of them), in
  instance order, all of one feed in one :meth:`Calibrator.observe_steps` call
  (one sample array, each instance's batch a slice of it);
- an instance's resident legs are re-estimated with one engine call
  (``SimCore.decode_progress_many``) and one length-predictor call
  (``LengthPredictor.remaining_many``), and a stepped engine reports only the
  first and last token of each request (``finish_step(ends_only=True)``), the
  only ones the simulation reads. ``tests/sim/test_seeded_outcomes.py`` holds
  per-request digests of 15 seeded runs recorded before these changes.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import random
import time
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from slorouter.v1 import cms_pb2

from engine.interface import EngineOverloadedError, InvalidRequestError
from engine.model import ProfileCostModel, ScheduledStep, SimConfig, SimCore, SimRequestSpec
from engine.outputs import eos_position, prompt_digest, request_key
from fleet.prefix import id_block_hashes
from fleet.snapshot import ClusterSnapshot, InstanceRecord
from predictor import LatencyPredictor
from router.core.calibration import CalibrationConfig, Calibrator
from router.core.capacity import InstanceRates, LoadShape, LoadTracker, fleet_instance_rates
from router.core.columns import (
    INFLIGHT_ROWS,
    ClusterView,
    InflightColumns,
    InstanceTable,
    LegList,
    ResidentLegs,
)
from router.core.config import SchedulerConfig
from router.core.decision import Decision
from router.core.dispatch import (
    Action,
    Arrival,
    Completion,
    DispatchSetup,
    Event,
    Outcome,
    Paused,
    Preempted,
    Served,
    Timer,
    ViewChanged,
    make_dispatcher,
)
from router.core.errors import LateError, SchedulingError, status_name
from router.core.lengths import LengthConfig, LengthPredictor
from router.core.packing import binpacks, resident_tpot_pacing
from router.core.plugins import Policy
from router.core.predictors import PredictorSet
from router.core.prefix import ExactPrefixIndex, PrefixRouting
from router.core.qlm import QlmConfig
from router.core.queue import QueueConfig
from router.core.request import Mode, Role, ScheduleInput, Targets
from router.core.scheduler import Scheduler, cached_at
from router.core.slicing import SliceConfig
from router.core.theta import ThetaFit
from router.core.worker_count import Desired, DesiredInstances
from sim.fastforward import DecodeRun, DecodeStepTimes
from sim.fleet import FleetError, FleetSpec
from workload.report import RequestResult, slo_met
from workload.spec import RequestPlan

#: Seconds between two agent heartbeats; a heartbeat resets a status's age (not its content).
AGENT_HEARTBEAT_S = 1.0

#: Keys of ``InstanceTable.memo`` whose values depend only on columns that never
#: change during a simulation (ids, roles, profile groups, models, chunk
#: budgets, schedulability). They are computed by the first decision and handed
#: to the following ones; anything else is recomputed per decision. A key is
#: either one of these strings or a tuple starting with one.
STATIC_MEMO_KEYS = frozenset(
    {"predictor_parts", "full_chunk_ms", "plan", "model_mask", "sorted_ids", "all_true", "schedulability"}
)

# Event kinds.
_PROTO_ROLES = {
    Role.PREFILL: cms_pb2.INSTANCE_ROLE_PREFILL,
    Role.DECODE: cms_pb2.INSTANCE_ROLE_DECODE,
    Role.NEUTRAL: cms_pb2.INSTANCE_ROLE_NEUTRAL,
}

_STEP_END = 0  # a stepped engine step ends
_KV_READY = 1  # a PD request's KV reached its decode instance
_RUN_END = 2  # a fast-forwarded decode run reaches the end of its planned steps
_QUEUE_TIMER = 3  # a queued request expires or turns late by the clock alone

# Request stages.
_PENDING = 0  # not arrived yet
_PREFILL = 1  # PD: prefill leg on the prefill instance
_TRANSFER = 2  # PD: KV moving to the decode instance
_SERVING = 3  # neutral request, or PD decode leg, on its instance
_DONE = 4


def _readonly(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    array.setflags(write=False)
    return array


def _static_key(key: Hashable) -> bool:
    name = key[0] if isinstance(key, tuple) and key else key
    return isinstance(name, str) and name in STATIC_MEMO_KEYS


class SimFleet:
    """A :class:`FleetSpec` made ready to simulate: profiles loaded and static view columns built, once.

    Reused by every run of a sweep; runs never mutate it.
    """

    def __init__(self, spec: FleetSpec, *, profile_label: str = "profile") -> None:
        self.spec = spec
        by_path: dict[str, LatencyPredictor] = {}
        group_predictors: dict[str, LatencyPredictor] = {}
        for group in spec.groups:
            key = str(group.profile)
            if key not in by_path:
                by_path[key] = LatencyPredictor.from_files(
                    group.profile / "ttft.json", group.profile / "tpot.json"
                )
            group_predictors[group.name] = by_path[key]
        #: The router's predictors: one per profile group (the group's name), the first group's by default.
        self.predictors = PredictorSet(group_predictors[spec.groups[0].name], group_predictors)
        # The engines' ground truth: loaded again, so no engine ever steps with an object the
        # router predicts with, even when the true profile is the same directory.
        truth_by_path: dict[str, LatencyPredictor] = {}
        group_truths: dict[str, LatencyPredictor] = {}
        for group in spec.groups:
            key = str(group.truth)
            if key not in truth_by_path:
                truth_by_path[key] = LatencyPredictor.from_files(
                    group.truth / "ttft.json", group.truth / "tpot.json"
                )
            group_truths[group.name] = truth_by_path[key]
        ids: list[str] = []
        groups: list[str] = []
        roles: list[Role] = []
        configs: list[SimConfig] = []
        truths: list[LatencyPredictor] = []
        for group in spec.groups:
            for instance_id in group.instance_ids():
                ids.append(instance_id)
                groups.append(group.name)
                roles.append(group.role)
                configs.append(group.engine)
                truths.append(group_truths[group.name])
        n = len(ids)
        self.n = n
        self.ids = tuple(ids)
        self.index = {instance_id: i for i, instance_id in enumerate(ids)}
        if len(self.index) != n:
            raise FleetError("two groups produce the same instance id; rename one of the groups")
        self.groups = tuple(groups)
        self.roles = tuple(roles)
        #: Engine configuration and ground-truth step-time profile per instance.
        self.configs = tuple(configs)
        self.instance_truths = tuple(truths)
        rank = np.empty(n, dtype=np.intp)
        rank[np.argsort(np.array(ids, dtype=object), kind="stable")] = np.arange(n)
        empty = ("",) * n
        no_code = _readonly(np.full(n, -1, dtype=np.intp))
        ones = _readonly(np.ones(n, dtype=bool))
        # Every column of InstanceTable that stays fixed during a run.
        self.static_columns: dict[str, Any] = {
            "snapshot": self._snapshot(profile_label),
            "ids": self.ids,
            "index": self.index,
            "endpoints": tuple(f"sim://{i}" for i in ids),
            "models": empty,
            "node_ids": empty,
            "unit_ids": empty,
            "groups": self.groups,
            "roles": _readonly(np.array([int(r) for r in roles], dtype=np.int8)),
            "node_codes": no_code,
            "unit_codes": no_code,
            "id_rank": _readonly(rank),
            "max_num_batched_tokens": _readonly(
                np.array([c.max_num_batched_tokens for c in configs], dtype=np.float64)
            ),
            "kv_capacity_tokens": _readonly(
                np.array([c.kv_capacity_tokens for c in configs], dtype=np.float64)
            ),
            "max_num_seqs": _readonly(np.array([c.max_num_seqs for c in configs], dtype=np.float64)),
            "has_status": ones,
            "schedulable": ones,
        }

    def _snapshot(self, profile_label: str) -> ClusterSnapshot:
        """The fleet's metadata as a CMS snapshot (identity and documentation only: loads come from the engines)."""
        records = []
        for instance_id, group, config, role in zip(
            self.ids, self.groups, self.configs, self.roles, strict=True
        ):
            metadata = cms_pb2.InstanceMetadata(
                instance_id=instance_id,
                endpoint=f"sim://{instance_id}",
                role=_PROTO_ROLES[role],
                max_num_batched_tokens=config.max_num_batched_tokens,
                kv_capacity_tokens=config.kv_capacity_tokens,
                block_size=config.block_size,
                labels={profile_label: group},
                max_model_len=config.max_model_len,
                max_num_seqs=config.max_num_seqs,
            )
            records.append(InstanceRecord(metadata=metadata, status=None, status_age_s=math.inf))
        return ClusterSnapshot(instances=tuple(records), taken_at_s=0.0)


@dataclass(frozen=True)
class SimStats:
    """Counts of one run (virtual-time facts only, so they are deterministic)."""

    decisions: int
    rejected: int
    steps: int
    preemptions: int
    kv_transfers: int
    events: int
    #: Time-averages over the run of instances holding work: "decode" counts a PD-role instance
    #: holding decode work (a decode request, or a decode leg whose KV is on its way), "prefill"
    #: one holding other work (prompts to compute, KV held for a transfer) — an adaptive-PD
    #: instance may count in both — and "neutral" a neutral-role instance holding any work.
    mean_busy_prefill: float = 0.0
    mean_busy_decode: float = 0.0
    mean_busy_neutral: float = 0.0
    #: Requests that waited in the router queue, were found late (served late, or refused with
    #: ``late_policy=reject``), or were shed from a full queue.
    queued: int = 0
    late: int = 0
    shed: int = 0
    #: Under the ``qlm`` queue policy: running requests evicted (and queued again), plan generator runs.
    evicted: int = 0
    plans: int = 0
    #: Tokens preempted requests re-prefilled when re-admitted, less those their engines' prefix caches
    #: held (all instances): the work preemptions wasted.
    preemption_recompute_tokens: int = 0


@dataclass(frozen=True)
class SimOutcome:
    """One run: a result per planned request (in plan order), the virtual makespan and counts.

    ``wall_s`` is the only wall-clock figure; keep it out of anything that must be reproducible.
    """

    results: tuple[RequestResult, ...]
    duration_s: float
    stats: SimStats
    wall_s: float
    #: Per planned request: time waited in the router queue (ms) and whether it left the queue late.
    queue_wait_ms: tuple[float, ...] = ()
    late: tuple[bool, ...] = ()
    #: Prompt tokens the engines found in their prefix caches over those they looked up (None:
    #: no prefix caching in the run).
    cache_hit_rate: float | None = None
    #: Per planned request (with prefix caching): prompt tokens its engines looked up in their prefix
    #: caches and the tokens they found (a preempted request is looked up again when re-admitted).
    cache_tokens: tuple[tuple[int, int], ...] = ()
    #: Per planned request: refused by the router (no placement, shed, expired, late and rejected).
    refused: tuple[bool, ...] = ()
    #: ``slo_router_desired_instances`` as the router would export it at the last arrival.
    desired: Desired | None = None
    #: The run stopped early at ``simulate``'s ``miss_limit`` (then ``results`` is empty) and the
    #: misses among the scored requests it had counted by then.
    stopped: bool = False
    misses: int = 0
    #: Per instance: engine time spent stepping (s) and the end of its last step (s).
    busy_s: tuple[float, ...] = ()
    last_busy_s: tuple[float, ...] = ()
    #: Context tokens recomputed by resumed runs, and each resume's stall (ms): a paused run's last
    #: token to the next run's first.
    recomputed_tokens: int = 0
    resume_gaps_ms: tuple[float, ...] = ()
    #: The dispatcher's own counts (:meth:`router.core.dispatch.Dispatcher.counters`).
    counters: dict[str, int] = field(default_factory=dict)


class _Req:
    """Mutable state of one request during a run."""

    __slots__ = (
        "base",
        "cached",
        "capped",
        "decode",
        "done_s",
        "error_code",
        "error_message",
        "expected",
        "first_s",
        "idx",
        "last_s",
        "late",
        "out",
        "paced_tokens",
        "paused_at",
        "predicted_tpot_ms",
        "predicted_ttft_ms",
        "prefill",
        "queue_wait_s",
        "resident",
        "resident_tokens",
        "stage",
        "tokens",
        "tpot_need_ms",
        "tpot_paced",
        "waiting",
    )

    def __init__(self) -> None:
        self.stage = _PENDING
        #: Waiting for the dispatcher (queued, or evicted and not yet placed again).
        self.waiting = False
        self.idx = -1
        self.prefill = -1
        self.decode = -1
        self.resident = -1  # instance holding its resident decode leg (-1: none)
        self.resident_tokens = 0.0
        self.first_s = -1.0
        self.done_s = -1.0
        #: When its last run ended (a pause at a cap), and when it paused (-1: never).
        self.last_s = -1.0
        self.paused_at = -1.0
        #: Its current run has a cap (a slice).
        self.capped = False
        #: Tokens its engine request had generated before the current run (a run continued in place
        #: by ``SimCore.extend`` counts on from the run before; 0 for a run added afresh).
        self.base = 0
        self.tokens = 0
        self.error_code: str | None = None
        self.error_message = ""
        self.predicted_ttft_ms: float | None = None
        self.predicted_tpot_ms: float | None = None
        self.queue_wait_s = 0.0
        self.late = False
        #: Output tokens the router expects (its estimate at arrival) and the engine's true length.
        self.expected = 0
        self.out = 0
        #: The TPOT its resident leg must keep (packing.resident_tpot_need_ms at its placement; 0 = none).
        self.tpot_need_ms = 0.0
        #: Whether that need is an e2e deadline's pace (packing.resident_tpot_need), not a TPOT target.
        self.tpot_paced = False
        #: For a paced need, the output length its pace spreads the deadline over (nan: none).
        self.paced_tokens = math.nan
        #: Prompt tokens the router counted cached where its colocated resident leg was placed (0: none
        #: counted, a PD leg, or a leg placed again after a pause or an eviction).
        self.cached = 0


def finished_result(
    plan: RequestPlan,
    *,
    first_s: float,
    done_s: float,
    tokens: int,
    error_code: str | None,
    error_message: str,
    **extra: Any,
) -> RequestResult:
    """What a client would have measured of a simulated request (times in virtual seconds; a
    negative ``first_s`` means no token arrived). ``extra`` carries the instance ids and the like."""
    ok = error_code is None
    first = first_s if first_s >= 0 else None
    tpot = None
    if ok and first is not None and tokens >= 2:
        tpot = (done_s - first) * 1000.0 / (tokens - 1)
    return RequestResult.of_plan(
        plan,
        start_s=plan.arrival_s,
        completion_tokens=tokens,
        ttft_ms=None if first is None else (first - plan.arrival_s) * 1000.0,
        tpot_ms=tpot,
        e2e_ms=(done_s - plan.arrival_s) * 1000.0,
        error_code=error_code,
        error_message=error_message,
        finish_reason="length" if ok else "",
        **extra,
    )


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


# Rows of the load matrix (one column per instance), in InstanceTable field order.
_LOAD_ROWS = (
    "uncomputed_prefill_tokens",
    "decode_requests",
    "decode_tokens",
    "used_kv_tokens",
    "waiting_requests",
    "running_requests",
)


class _Simulation:
    """The state of one run; :meth:`run` consumes it."""

    def __init__(
        self,
        fleet: SimFleet,
        scheduler: Scheduler,
        plans: Sequence[RequestPlan],
        *,
        seed: int,
        reuse_static_memo: bool,
        fast_forward: bool,
        calibrator: Calibrator | None = None,
        queue: QueueConfig | None = None,
        qlm: QlmConfig | None = None,
        sa_search: str = "anneal",
        oracle_lengths: bool = False,
        lengths: LengthConfig | None = None,
        prefix_block_tokens: int = 0,
        incremental_dispatch: str = "on",
        slicing: SliceConfig | None = None,
        resume_cache: bool = False,
        miss_limit: tuple[float, int] | None = None,
        dispatch_mode: str = "",
    ) -> None:
        self.fleet = fleet
        #: (scored from, s; most misses): the run stops once more requests arriving at or after that
        #: time have missed their SLO (see ``simulate``).
        self.miss_limit = miss_limit
        self.misses = 0
        self.stopped = False
        #: What the router learns of output lengths (from finished requests only).
        self.lengths = LengthPredictor(lengths)
        self.oracle_lengths = oracle_lengths
        #: The autoscaling signal as the router computes it (``slo_router_desired_instances``):
        #: the last minute's load, and Eq. 7 fitted over its heartbeats; read at the last arrival.
        self.placed = LoadTracker()
        self.demand = DesiredInstances(
            self._instance_rates,
            default_tpot_ms=scheduler.config.tpot_slo_ms,
            default_ttft_ms=scheduler.config.ttft_slo_ms,
        )
        self.desired: Desired | None = None
        defaults = scheduler.config
        #: The dispatcher the router would run (router.core.dispatch), driven here in virtual time;
        #: deterministic (the run's seed, and sa's annealing budget on a modeled clock).
        self.dispatcher = make_dispatcher(
            DispatchSetup(
                queue or QueueConfig(queue_policy="none"),
                defaults.ttft_slo_ms,
                defaults.tpot_slo_ms,
                qlm or QlmConfig(),
                seed=seed,
                sa_search=sa_search,
                modeled_clock=True,
                incremental=incremental_dispatch,
                slicing=slicing or SliceConfig(),
                dispatcher=dispatch_mode or ("slice" if slicing is not None else ""),
            )
        )
        #: Engines keep a paused run's blocks in their prefix cache (vLLM's automatic prefix caching):
        #: a run resumed at once on the instance it left recomputes only its last partial block.
        self.resume_cache = resume_cache
        #: A capped run with output left pauses in its engine at its cap (``pause_at_end``) so that a
        #: slice continued in place goes on in that engine's running batch (``SimCore.extend``), as a
        #: live leg does, instead of re-entering its waiting queue; only where the dispatcher continues.
        self.park = slicing is not None and slicing.continue_in_place
        #: Whether a capped run ended in the step being finished (see _step_end).
        self.capped_ended = False
        #: While an action list is carried out: the instances capped runs landed on (see _landed).
        self.carrying = False
        self.landed: dict[int, None] = {}
        #: Per instance: engine time spent stepping (s) and the end of its last step; context tokens
        #: recomputed by resumed runs; the stall between a paused run's last token and the next run's first.
        self.busy_s = [0.0] * fleet.n
        self.last_busy = [0.0] * fleet.n
        self.recomputed = 0
        self.gaps_ms: list[float] = []
        self.lent = _Lent(self)
        self.evicted = 0
        self.timer_at = math.inf
        self.queued = self.late = self.shed = 0
        self.scheduler = scheduler
        #: The router's calibration, fed the engines' step samples before each decision (None: off).
        self.calibrator = calibrator
        #: Per instance: step samples the router has not seen yet (prefill tokens, decode batch,
        #: decode tokens, ms), and steps of the current fast-forwarded run already fed.
        self.pending_samples: list[list[tuple[int, int, int, float]]] = [[] for _ in range(fleet.n)]
        self.run_fed = [0] * fleet.n
        #: Instances with pending samples, and per instance when the first step of its run not fed
        #: yet ends (inf: none planned): a feed touches only the instances with something new.
        self.pending_ids: set[int] = set()
        self.feed_at = np.full(fleet.n, np.inf)
        self.expired_at = 0.0
        self.plans = plans
        self.reuse_static_memo = reuse_static_memo
        n = fleet.n
        shared: dict[tuple[int, float], DecodeStepTimes] = {}
        self.cores: list[SimCore] = []
        #: Step times of instances whose decode runs may be fast-forwarded (None: always stepped).
        self.times: list[DecodeStepTimes | None] = []
        for i, (config, lp) in enumerate(zip(fleet.configs, fleet.instance_truths, strict=True)):
            if prefix_block_tokens and config.prefix_cache_block_tokens != prefix_block_tokens:
                config = dataclasses.replace(config, prefix_cache_block_tokens=prefix_block_tokens)
            if config.noise > 0 or config.kv_slowdown > 0:
                # Planning steps ahead would draw the noise out of order: these engines are always stepped.
                rng = random.Random((config.seed * 1_000_003 + seed) * 65_537 + i)
                cost = ProfileCostModel(lp, speed_factor=config.speed_factor, noise=config.noise, rng=rng)
                self.cores.append(SimCore(config, cost))
                self.times.append(None)
                continue
            # Instances of one profile and speed share a cost model (and its TTFT cache).
            key = (id(lp), config.speed_factor)
            if key not in shared:
                shared[key] = DecodeStepTimes(lp, config.speed_factor)
            self.cores.append(SimCore(config, shared[key].cost))
            self.times.append(shared[key] if fast_forward else None)
        self.runs: list[DecodeRun | None] = [None] * n
        self.run_event: list[int] = [-1] * n
        #: When each fast-forwarded instance's load columns next change (inf: not fast-forwarding).
        self.run_next = np.full(n, np.inf)
        self.steps: list[ScheduledStep | None] = [None] * n
        self.busy = np.zeros(n, dtype=bool)
        self.changed_at = np.zeros(n)
        self.load = np.zeros((len(_LOAD_ROWS), n))
        self.dirty: set[int] = set()
        # In-flight sums, rows in InflightColumns field order: requests, prefill legs, prefill tokens,
        # decode legs, decode tokens, tokens, resident decode legs, their final tokens. Only decode
        # legs are ever in flight (see the module doc); a decode leg is resident from the decision
        # until its request ends, with prompt + max_tokens as its final KV.
        self.inflight = np.zeros((INFLIGHT_ROWS, n))
        # The safety valve's inputs, as the agents report them: the mean duration of the recent
        # steps that decoded (the last ``max_recent_steps``, as the sim worker's load reports them;
        # NaN while the instance has no decode work) and when it last preempted.
        self.measured = np.full(n, np.nan)
        self.step_window: list[deque[float]] = [deque(maxlen=c.max_recent_steps) for c in fleet.configs]
        #: Per instance, the steps of its fast-forwarded run already in its step window.
        self.run_measured = [0] * n
        self.last_preempt_s = np.full(n, -np.inf)
        #: Requests each engine preempted so far, as its status's cumulative count carries it.
        self.preempt_count = np.zeros(n)
        #: And the tokens they computed again for the requests they preempted (beyond cache hits).
        self.recompute_count = np.zeros(n)
        # Busy-instance accounting (SimStats.mean_busy_*): per instance, does it hold decode work /
        # other work, and the time integral of the counts per kind.
        self.neutral_role = np.array([r is Role.NEUTRAL for r in fleet.roles])
        self.hold_decode = np.zeros(n, dtype=bool)
        self.hold_other = np.zeros(n, dtype=bool)
        self.touched: set[int] = set()
        self.busy_counts = [0, 0, 0]  # prefill, decode, neutral
        self.busy_integral = [0.0, 0.0, 0.0]
        self.busy_since = 0.0
        self.inflight_columns: InflightColumns | None = None
        # Per instance, its resident decode legs: request index -> (prompt tokens, final tokens).
        self.resident_on: list[dict[int, tuple[int, float]]] = [{} for _ in range(n)]
        #: When each instance's resident legs were last re-estimated (see _reestimate_residents).
        self.refreshed_at = np.zeros(n)
        # The legs of the last view, reused while nothing they depend on changed: (key, legs).
        self.legs_version = 0
        self.legs_cache: tuple[tuple[float, int, int], ResidentLegs] | None = None
        self.static_memo: dict[Any, Any] = {}
        self.heap: list[tuple[float, int, int, int]] = []
        self.seq = 0
        self.reqs = [_Req() for _ in plans]
        # Per request, what the engines and the length predictor are asked by (made once).
        self.rids = [str(k) for k in range(len(plans))]
        self.class_of = [p.class_name for p in plans]
        self.prompt_of = [p.prompt_tokens for p in plans]
        self.cap_of = [p.max_tokens for p in plans]
        self.bucket_of = [self.lengths.bucket(p.prompt_tokens) for p in plans]
        for k, r in enumerate(self.reqs):
            r.idx = k
        # Each request's output key (engine.outputs.request_key), made once when an EOS is drawn.
        self.output_keys: dict[int, int] = {}
        self.now = 0.0
        self.decisions = self.rejected = self.num_steps = self.kv_transfers = self.events = 0
        # Prefix caching: each plan's chained block hashes (empty without engine caching or hash ids),
        # and the router's exact index when it is fed the engines' KV events.
        block = prefix_block_tokens
        self.block_hashes: list[tuple[int, ...]] = [
            id_block_hashes(p.hash_ids, p.prompt_tokens, block) if block and p.hash_ids else () for p in plans
        ]
        prefix = scheduler.prefix
        self.exact_index = prefix if isinstance(prefix, ExactPrefixIndex) else None
        # Per planned request: prompt tokens its engine looked up in the prefix cache and found there
        # (every engine request is named by its plan index), for a hit rate over part of the run.
        self.cache_query = [0] * len(plans)
        self.cache_hit = [0] * len(plans)
        #: Per planned request: refused by the router (what ``SimStats.rejected`` counts).
        self.refused = [False] * len(plans)
        #: The longest prompt + max_tokens the router admits: the longest max_model_len of the fleet.
        self.admit_len = max(c.max_model_len for c in fleet.configs)
        if block:
            for core in self.cores:
                core.on_lookup = self._count_lookup

    # ------------------------------------------------------------------ the loop

    def run(self) -> tuple[float, SimStats]:
        arrivals = [p.arrival_s for p in self.plans]
        heap = self.heap
        k, n = 0, len(arrivals)
        pop = heapq.heappop
        while (k < n or heap) and not self.stopped:
            if self.touched:
                self._account_busy()
            if heap and (k >= n or heap[0][0] <= arrivals[k]):
                t, seq, kind, x = pop(heap)
                if kind == _QUEUE_TIMER and not len(self.dispatcher):
                    # Set while requests waited, the queue has emptied since: nothing happens at t.
                    # (Taking its time as an event stretched the run's span, and with it the
                    # busy-instance means and goodput, by however long the timer was set ahead.)
                    self.timer_at = math.inf
                    continue
                self._busy_until(t)
                self.now = t
                if kind == _STEP_END:
                    self._step_end(x, t)
                elif kind == _KV_READY:
                    self._kv_ready(x, t)
                elif kind == _RUN_END:
                    self._run_end(x, seq, t)
                else:
                    self.timer_at = math.inf
                if len(self.dispatcher):
                    self._handle(Timer() if kind == _QUEUE_TIMER else ViewChanged(), t)
            else:
                t = arrivals[k]
                self._busy_until(t)
                self.now = t
                self._arrive(k, t)
                k += 1
                if k == n:
                    self.desired = self.demand.desired(t, self.placed.shape(t))
            self.events += 1
        stats = SimStats(
            decisions=self.decisions,
            rejected=self.rejected,
            steps=self.num_steps,
            preemptions=sum(core.num_preemptions for core in self.cores),
            kv_transfers=self.kv_transfers,
            events=self.events,
            queued=self.queued,
            late=self.late,
            shed=self.shed,
            evicted=self.evicted,
            plans=self.dispatcher.counters().get("plans", 0),
            preemption_recompute_tokens=sum(core.num_preemption_recompute_tokens for core in self.cores),
        )
        end = max(self.now, arrivals[-1] if arrivals else 0.0)
        self._account_busy()
        self._busy_until(end)
        start = arrivals[0] if arrivals else 0.0
        span = end - start
        if span > 0:
            means = [x / span for x in self.busy_integral]
            stats = dataclasses.replace(
                stats, mean_busy_prefill=means[0], mean_busy_decode=means[1], mean_busy_neutral=means[2]
            )
        return end, stats

    def _measure(self, i: int, duration_ms: float) -> None:
        window = self.step_window[i]
        window.append(duration_ms)
        self.measured[i] = sum(window) / len(window)

    def _measure_run(self, i: int, run: DecodeRun, upto: int) -> None:
        """Put steps ``run_measured[i]`` .. ``upto`` of instance ``i``'s fast-forwarded run in its step window.

        Each step of a run is a step the engine finished, and an engine's load reports every one
        (``engine.model.SimCore``'s recent steps, which ``DecodeRun.apply`` fills the same way).
        Counted as one sample per run, the window would be held by the slower steps that carry a
        prefill chunk (each stepped, so each counted) and read well above the TPOT the decodes get,
        tripping the packing valve (``overpacked``) and the queue's load watch on instances that
        keep their targets. Only the newest ``max_recent_steps`` can stay in the window, so a long
        run costs no more than that.
        """
        done = self.run_measured[i]
        if upto > done:
            window = self.step_window[i]
            first = max(done, upto - (window.maxlen or upto))
            window.extend(run._durations_ms[first:upto])
            self.measured[i] = sum(window) / len(window)
            self.run_measured[i] = upto

    def _busy_until(self, t: float) -> None:
        dt = t - self.busy_since
        if dt > 0:
            counts = self.busy_counts
            integral = self.busy_integral
            for kind in range(3):
                if counts[kind]:
                    integral[kind] += counts[kind] * dt
            self.busy_since = t

    def _account_busy(self) -> None:
        """Refresh which kind of work the touched instances hold (the counts change only here)."""
        counts = self.busy_counts
        for i in self.touched:
            core = self.cores[i]
            decode = core.num_decode_requests > 0 or self.inflight[3, i] > 0
            other = core.num_running + core.num_waiting + core.num_held > core.num_decode_requests
            if self.neutral_role[i]:
                was = self.hold_decode[i] or self.hold_other[i]
                now = decode or other
                counts[2] += int(now) - int(was)
            else:
                counts[1] += int(decode) - int(self.hold_decode[i])
                counts[0] += int(other) - int(self.hold_other[i])
            self.hold_decode[i] = decode
            self.hold_other[i] = other
        self.touched.clear()

    def _push(self, t: float, kind: int, x: int) -> int:
        seq = self.seq
        heapq.heappush(self.heap, (t, seq, kind, x))
        self.seq = seq + 1
        return seq

    # ------------------------------------------------------------------ engines

    def _start(self, i: int, now: float) -> None:
        """Start instance ``i``'s next step if it has one, or a fast-forwarded run (call only while it is idle)."""
        times = self.times[i]
        if times is not None:
            run = DecodeRun.plan(self.cores[i], times, now)
            if run is not None:
                self.runs[i] = run
                self.run_event[i] = self._push(run.ends[-1], _RUN_END, i)
                self._next_feed(i, run)
                self.run_measured[i] = 0  # its steps join the window as they end (_measure_run)
                self.run_next[i] = -np.inf  # the next view takes the run's columns
                self.busy[i] = True
                self.changed_at[i] = now
                self.dirty.add(i)
                self.touched.add(i)
                return
        step = self.cores[i].schedule()
        self.steps[i] = step
        if step is not None:
            self.busy[i] = True
            self._push(now + step.duration_ms * 1e-3, _STEP_END, i)
            self.num_steps += 1
        else:
            self.busy[i] = False
        self.changed_at[i] = now
        self.dirty.add(i)
        self.touched.add(i)

    def _settle(self, i: int, now: float) -> SimCore:
        """Instance ``i``'s core as stepping would have it at ``now``: call before changing it from outside."""
        run = self.runs[i]
        if run is not None:
            self._materialize(i, run, now)
        return self.cores[i]

    def _changed(self, i: int, now: float) -> None:
        """Instance ``i``'s load changed outside a step boundary; start a step if it was idle."""
        self.legs_version += 1
        if self.steps[i] is None:
            self._start(i, now)
        else:
            self.changed_at[i] = now
            self.dirty.add(i)
            self.touched.add(i)

    def _materialize(self, i: int, run: DecodeRun, now: float) -> None:
        """End instance ``i``'s fast-forwarded run at ``now``: apply its finished steps, resume the one running."""
        s = run.steps_done(now)
        self._run_busy(i, run, s)
        self._run_samples(i, run, s)
        self._measure_run(i, run, s)
        run.apply(s)
        self.runs[i] = None
        self.run_next[i] = np.inf
        # The step in progress at ``now`` is the one stepping would have scheduled at its start.
        step = self.cores[i].schedule()
        assert step is not None, "a decode run always has a next step"
        self.steps[i] = step
        start = run.step_start(s)
        self._push(start + step.duration_ms * 1e-3, _STEP_END, i)
        self.num_steps += s + 1
        self.changed_at[i] = start
        self.dirty.add(i)
        self.touched.add(i)

    def _run_busy(self, i: int, run: DecodeRun, s: int) -> None:
        """Count the first ``s`` steps of instance ``i``'s fast-forwarded run as its busy time."""
        if s > 0:
            self.busy_s[i] += sum(run._durations_ms[:s]) * 1e-3
            self.last_busy[i] = run.ends[s - 1]

    def _run_end(self, i: int, seq: int, now: float) -> None:
        """The last planned step of instance ``i``'s run ended: plan more, or apply the run and step on."""
        run = self.runs[i]
        if run is None or self.run_event[i] != seq:
            return  # the run was materialized since this event was pushed
        if not run.complete:
            run.extend()
            self._next_feed(i, run)
            self.run_event[i] = self._push(run.ends[-1], _RUN_END, i)
            return
        self._run_busy(i, run, len(run.ends))
        self._run_samples(i, run, len(run.ends))
        self._measure_run(i, run, len(run.ends))
        run.apply(len(run.ends))
        self.num_steps += len(run.ends)
        self.runs[i] = None
        self.run_next[i] = np.inf
        self._start(i, now)

    def _step_end(self, i: int, now: float) -> None:
        step = self.steps[i]
        assert step is not None
        result = self.cores[i].finish_step(step, ends_only=True)
        self.steps[i] = None
        self.busy_s[i] += step.duration_ms * 1e-3
        self.last_busy[i] = now
        if step.num_decode_requests > 0:
            self._measure(i, step.duration_ms)
        if step.num_preempted > 0:
            self.last_preempt_s[i] = now
            # A dispatcher that plans KV learns that the plan over-filled it.
            self._handle(Preempted(self.fleet.ids[i]), now)
        if self.calibrator is not None:
            pending = self.pending_samples[i]
            pending.append(
                (step.num_prefill_tokens, step.num_decode_requests, step.num_decode_tokens, step.duration_ms)
            )
            self.pending_ids.add(i)
            if len(pending) > 4096:  # bounded: the router keeps a window of recent steps anyway
                del pending[:-1024]
        # Dispatches of capped runs (slices) made while the step's ends are taken land on their
        # engines at once but start idle engines only after (see _landed).
        carrying, self.carrying = self.carrying, True
        try:
            for rid, position, finished, held in result.outputs:
                # (and the first token of a run continued in place: SimCore.extend reports it)
                if position == 0 or finished or position == self.reqs[int(rid)].base:
                    self._token(int(rid), position, finished, held, now)
            if self.capped_ended:
                # Capped runs ended: the room they freed is offered before the instance plans its
                # next step, so what the dispatcher places there joins that step (an uncapped end
                # waits for the view after the event, as it always has).
                self.capped_ended = False
                if len(self.dispatcher):
                    self._handle(ViewChanged(), now)
        finally:
            self.carrying = carrying
        landed, self.landed = self.landed, {}
        if i in landed:
            del landed[i]
            self._changed(i, now)  # starts its next step, with the slices placed there
        elif self.steps[i] is None and self.runs[i] is None:
            self._start(i, now)
        for j in sorted(landed):
            self._changed(j, now)

    def _token(self, idx: int, position: int, finished: bool, held: bool, now: float) -> None:
        """Token ``position`` of request ``idx`` on its current instance (only first and last tokens come here)."""
        r = self.reqs[idx]
        if r.stage == _PREFILL:
            r.first_s = now
            r.tokens = 1
            if not held:  # a one-token request: the prefill was all of it
                self._finish(r, now)
                return
            r.stage = _TRANSFER
            delay = 0.0
            if r.decode != r.prefill:
                delay = self.fleet.configs[r.decode].kv_transfer_s(self.plans[idx].prompt_tokens)
                self.kv_transfers += 1
            self._push(now + delay, _KV_READY, idx)
            return
        if r.first_s < 0:
            r.first_s = now
        elif position == r.base and r.last_s >= 0:
            self.gaps_ms.append((now - r.last_s) * 1000.0)
        if finished:
            r.tokens += position + 1 - r.base
            self.capped_ended |= r.capped
            if r.capped and r.tokens < r.out and r.tokens < self.cap_of[idx]:
                i = r.decode
                self._pause(r, now)  # the run ended at its placement's cap, with output left
                self._handle(Paused(str(idx), r.tokens), now)
                self._unpark(idx, i)  # not continued there: the leg ends
                return
            self._finish(r, now)

    def _kv_ready(self, idx: int, now: float) -> None:
        """The KV of PD request ``idx`` reached its decode instance: free it on prefill, admit decode."""
        r = self.reqs[idx]
        plan = self.plans[idx]
        rid = str(idx)
        p, d = r.prefill, r.decode
        if p != d:
            self._settle(p, now).release_held(rid)
            self._changed(p, now)
            self._inflight(d, -1, plan.prompt_tokens)
        spec = SimRequestSpec(
            request_id=rid,
            num_context_tokens=plan.prompt_tokens + 1,
            max_new_tokens=r.out - 1,
            num_cached_tokens=plan.prompt_tokens,
            counts_as_decode=True,
        )
        try:
            self._settle(d, now).add(spec)
        except EngineOverloadedError as exc:
            self.cores[d].release_held(rid)
            self._fail(r, "RESOURCE_EXHAUSTED", f"decode instance {self.fleet.ids[d]}: {exc}", now)
        else:
            r.stage = _SERVING
        self._changed(d, now)

    # ------------------------------------------------------------------ calibration

    def _run_samples(self, i: int, run: DecodeRun, upto: int, *, final: bool = True) -> None:
        """Queue the samples of steps ``run_fed[i]`` .. ``upto`` of instance ``i``'s fast-forwarded run.

        ``final``: the run ends here (the next run starts from its first step).
        """
        if self.calibrator is None:
            self.run_fed[i] = 0
            return
        fed = self.run_fed[i]
        if upto > fed:
            batch = run.batch
            first = run.step_tokens0 + fed * batch
            self.pending_samples[i].extend(
                zip(
                    itertools.repeat(0),
                    itertools.repeat(batch),
                    range(first, first + (upto - fed) * batch, batch),
                    run._durations_ms[fed:upto],
                )
            )
            self.pending_ids.add(i)
        if final:
            self.run_fed[i] = 0
            self.feed_at[i] = np.inf
        else:
            self.run_fed[i] = max(fed, upto)
            self._next_feed(i, run)

    def _next_feed(self, i: int, run: DecodeRun) -> None:
        """Note when the first step of instance ``i``'s run not fed yet ends (call when that changes)."""
        if self.calibrator is not None:
            fed = self.run_fed[i]
            self.feed_at[i] = run.ends[fed] if fed < len(run.ends) else np.inf

    def _feed_calibration(self, now: float) -> None:
        """What the agents' status pushes carry: every step finished since the last decision."""
        calibrator = self.calibrator
        assert calibrator is not None
        runs = self.runs
        # Runs with a step finished and not fed (feed_at is the end of the first such step).
        for i in np.flatnonzero(self.feed_at <= now).tolist():
            run = runs[i]
            assert run is not None
            self._run_samples(i, run, run.steps_done(now), final=False)
        if self.pending_ids:
            ids, groups, pending = self.fleet.ids, self.fleet.groups, self.pending_samples
            # In instance order, as each instance's status push would be read.
            order = sorted(self.pending_ids)
            # One array for every instance's samples, each batch a slice of it.
            steps = np.array([row for i in order for row in pending[i]], dtype=np.float64)
            batches = []
            start = 0
            for i in order:
                end = start + len(pending[i])
                batches.append((ids[i], groups[i], steps[start:end]))
                start = end
                pending[i].clear()
            self.pending_ids.clear()
            calibrator.observe_steps(batches, now)
        if now - self.expired_at >= 1.0:
            calibrator.expire(now)
            self.expired_at = now

    # ------------------------------------------------------------------ requests

    def _burst_goes_on(self, idx: int, now: float) -> bool:
        """Whether another request arrives at ``now`` after request ``idx`` (its burst's pass waits for it)."""
        return idx + 1 < len(self.plans) and self.plans[idx + 1].arrival_s <= now

    def _arrive(self, idx: int, now: float) -> None:
        plan = self.plans[idx]
        r = self.reqs[idx]
        if plan.prompt_tokens + plan.max_tokens > self.admit_len:
            # The router refuses it on arrival (router/service.py checks the prompt and max_tokens
            # against the longest max_model_len the fleet advertises), before any queue sees it: no
            # instance could ever run it. Failing it at dispatch instead let a queue hold it first
            # (a planning policy held such requests 3-8 s, each second counted in G's latency sum).
            self.rejected += 1
            self.refused[idx] = True
            self._fail(
                r,
                "INVALID_ARGUMENT",
                f"prompt ({plan.prompt_tokens}) + max_tokens ({plan.max_tokens}) exceeds "
                f"max_model_len={self.admit_len}, the longest of the fleet",
                now,
            )
            # The burst's pass would have come with this, its last arrival.
            in_burst = idx > 0 and self.plans[idx - 1].arrival_s == now
            if self.dispatcher.coalesce_arrivals and in_burst and not self._burst_goes_on(idx, now):
                self._handle(ViewChanged(), now)
            return
        pooled = False
        censored = 0
        if self.oracle_lengths:
            r.expected = bound = self._true_length(idx, 0)
        else:
            estimate = self.lengths.estimate(plan.class_name, plan.prompt_tokens, plan.max_tokens)
            r.expected = estimate.tokens
            bound = estimate.bound_tokens
            pooled = estimate.source == "all"
            if plan.slo.e2e_ms and not plan.slo.tpot_ms and binpacks(self.scheduler.config):
                censored = self.lengths.censored_bound(
                    plan.class_name,
                    plan.prompt_tokens,
                    self._class_reached(plan.class_name, now),
                    plan.max_tokens,
                )
        if self.oracle_lengths:
            mean, learned = float(r.expected), True
        else:
            mean, learned = estimate.mean, estimate.samples > 0
        self.placed.observe(now, plan.prompt_tokens, r.expected)
        self.demand.observe(
            now,
            plan.prompt_tokens,
            mean,
            learned=learned,
            tpot_ms=plan.slo.tpot_ms or 0.0,
            e2e_ms=plan.slo.e2e_ms or 0.0,
            paced_tokens=float(bound),
            ttft_ms=plan.slo.ttft_ms or 0.0,
        )
        request = ScheduleInput(
            request_id=str(idx),
            prompt_tokens=plan.prompt_tokens,
            ttft_slo_ms=plan.slo.ttft_ms or 0.0,
            tpot_slo_ms=plan.slo.tpot_ms or 0.0,
            e2e_slo_ms=plan.slo.e2e_ms or 0.0,
            expected_output_tokens=r.expected,
            output_tokens_bound=bound,
            output_tokens_prior=not learned,
            output_tokens_pooled=pooled,
            output_tokens_bound_censored=censored,
            max_tokens=plan.max_tokens,
            priority=plan.priority,
            slo_class=plan.class_name,
            arrival_s=plan.arrival_s if self.dispatcher.waits else None,
            prefix_hashes=self.block_hashes[idx] if self.scheduler.prefix is not None else (),
        )
        if self.calibrator is not None:
            self._feed_calibration(now)
        dispatcher = self.dispatcher
        try:
            self._handle(Arrival(request, idx), now)
        except (
            SchedulingError
        ) as exc:  # the dispatcher cannot take it at all (e.g. qlm without neutral instances)
            self.rejected += 1
            self.refused[idx] = True
            self._fail(r, status_name(exc), str(exc), now)
            return
        # Arrivals at the same instant are one burst, offered in one pass (the router's driver
        # coalesces a burst's passes with call_soon the same way).
        if dispatcher.coalesce_arrivals and not self._burst_goes_on(idx, now):
            self._handle(ViewChanged(), now)
        if r.waiting:
            self.queued += 1

    def _instance_rates(self, load: LoadShape, tpot_target_ms: float) -> InstanceRates:
        """One instance's service rates for ``load``, as the router's ``Placer`` computes them."""
        configs = self.fleet.configs
        predictors = self.scheduler.predictors
        assert predictors is not None
        return fleet_instance_rates(
            predictors.default,
            mean_prompt_tokens=load.mean_prompt_tokens,
            mean_output_tokens=load.mean_output_tokens,
            tpot_target_ms=tpot_target_ms,
            kv_capacities=[c.kv_capacity_tokens for c in configs],
            chunk_budgets=[c.max_num_batched_tokens for c in configs],
            kv_headroom=self.scheduler.config.kv_packing_headroom,
            seq_caps=[c.max_num_seqs for c in configs],
        )

    def _true_length(self, idx: int, i: int) -> int:
        """Tokens request ``idx`` really generates when instance ``i`` generates it (engine truth)."""
        plan = self.plans[idx]
        n = plan.true_output_tokens
        p = self.fleet.configs[i].eos_probability
        if p > 0.0 and not plan.ignore_eos:
            # The sim worker's draw, keyed as the worker keys it: by the prompt's tokens and the
            # sampling seed, 0 as `slo-router bench` sends it. So a live run over sim workers ends
            # each answer where this one does (tests/workload/test_parity.py).
            key = self.output_keys.get(idx)
            if key is None:
                key = self.output_keys[idx] = request_key(0, prompt_digest(plan.prompt_token_ids()))
            eos = eos_position(key, p)
            if eos is not None:
                n = min(n, eos + 1)
        return max(n, 1)

    def _keep_static(self, view: ClusterView) -> None:
        if self.reuse_static_memo:
            for key, value in view.instances.memo.items():
                if key not in self.static_memo and _static_key(key):
                    self.static_memo[key] = value

    # ------------------------------------------------------------------ the dispatcher's actions

    def _handle(self, event: Event, now: float) -> None:
        """Hand ``event`` to the dispatcher and carry out its actions, as the router's driver does."""
        if self.calibrator is not None and isinstance(event, (ViewChanged, Timer)) and len(self.dispatcher):
            self._feed_calibration(now)
        # Each action is carried out before the next is taken: a dispatch lands on its engine (and
        # so in the next view) before the pass makes its next decision.
        carrying, self.carrying = self.carrying, True
        try:
            for action in self.dispatcher.handle(event, now, self.lent):
                self._carry(action, now)
        finally:
            self.carrying = carrying
        if not carrying and self.landed:
            landed, self.landed = self.landed, {}
            for i in landed:
                self._changed(i, now)
        self.lent.keep_last()
        # The next moment the dispatcher asks to be woken with no other event.
        wake = self.dispatcher.wake_s()
        when = math.inf if wake is None else wake
        if when < self.timer_at:
            self.timer_at = when
            self._push(when + 1e-6, _QUEUE_TIMER, -1)

    def _carry(self, action: Action, now: float) -> None:
        idx: int = action.token
        r = self.reqs[idx]
        outcome = action.outcome
        if outcome is Outcome.QUEUED:
            r.waiting = True
        elif outcome is Outcome.LATE:
            self.late += 1
        elif outcome is Outcome.EVICT:
            r.waiting = True
            self.evicted += 1
        elif outcome is Outcome.DISPATCH:
            r.waiting = False
            assert action.decision is not None
            if r.tokens == 0:
                r.queue_wait_s = action.waited_s
            r.late = action.late
            self._dispatch(idx, r, self.plans[idx], action.decision, now, action.cap, action.continues)
        elif outcome is Outcome.REFUSE:
            r.waiting = False
            self.rejected += 1
            self.refused[idx] = True
            r.queue_wait_s = action.waited_s
            error = action.error
            assert error is not None
            if action.event == "shed":
                self.shed += 1
            if isinstance(error, LateError):
                self.late += 1
            self._fail(r, status_name(error), str(error), now)
        else:  # LEFT: no client of the simulator cancels
            r.waiting = False

    def _evict(self, idx: int, now: float) -> int | None:
        """Abort running request ``idx`` (the dispatcher preempts it); the tokens it has returned in total."""
        r = self.reqs[idx]
        if r.stage != _SERVING:
            return None
        i = r.decode
        rid = str(idx)
        core = self._settle(i, now)
        generated = core.generated_tokens(rid)
        if generated is None:
            return None
        core.abort(rid)
        r.tokens += generated - r.base  # returned to the client; the next run continues after them
        r.base = 0
        self._resident(r, i, -1, 0)
        r.stage = _PENDING
        if self.carrying and self.cores[i].has_paused():
            # A slice paused at its cap there waits for the dispatcher's answer in the same pass:
            # the engine steps again once every action of the pass is carried out.
            self.landed[i] = None
        else:
            self._changed(i, now)
        return int(r.tokens)

    def _produced(self, idx: int, now: float) -> int | None:
        """Tokens running request ``idx`` has produced in all (its runs before this one and this one's)."""
        r = self.reqs[idx]
        if r.stage != _SERVING:
            return None
        generated = self._settle(r.decode, now).generated_tokens(str(idx))
        return None if generated is None else int(r.tokens + generated - r.base)

    def _pause(self, r: _Req, now: float) -> None:
        """The lifecycle's pause: the run ended at its cap; the request keeps its tokens and waits to be
        resumed where the dispatcher places it next (:class:`~router.core.dispatch.Paused`)."""
        self._resident(r, r.resident, -1, 0)
        r.stage = _PENDING
        r.paused_at = r.last_s = now

    def _dispatch(
        self,
        idx: int,
        r: _Req,
        plan: RequestPlan,
        decision: Decision,
        now: float,
        cap: int = 0,
        continues: bool = False,
    ) -> None:
        assert decision.prefill is not None and decision.decode is not None
        previous = r.decode
        r.capped = cap > 0
        # The simulator keeps its own in-flight columns (no Scheduler.record): the hooks hear here.
        self.scheduler.dispatched(decision, now)
        index = self.fleet.index
        p = r.prefill = index[decision.prefill.instance_id]
        d = r.decode = index[decision.decode.instance_id]
        if r.tokens:
            r.cached = 0
            # A run that continues where it paused this very moment never left its engine (see _resume).
            goes_on = continues and r.paused_at == now and previous == d
            self._resume(idx, r, plan, d, now, cap, cached=self._cached(r, previous, d, now), goes_on=goes_on)
            return
        r.predicted_ttft_ms = _finite(decision.prefill.predicted_ttft_ms)
        r.predicted_tpot_ms = _finite(decision.decode.predicted_tpot_ms)
        r.tpot_need_ms, r.tpot_paced, r.paced_tokens = resident_tpot_pacing(
            decision.context, self.scheduler.config
        )
        neutral = decision.mode is Mode.NEUTRAL
        r.cached = cached_at(decision.context, decision.prefill.instance_id) if neutral else 0
        limit = min(self.fleet.configs[p].max_model_len, self.fleet.configs[d].max_model_len)
        if plan.prompt_tokens + plan.max_tokens > limit:
            self._fail(
                r,
                "INVALID_ARGUMENT",
                f"prompt ({plan.prompt_tokens}) + max_tokens ({plan.max_tokens}) exceeds max_model_len={limit}",
                now,
            )
            return
        rid = str(idx)
        out = r.out = self._true_length(idx, d)
        hashes = self.block_hashes[idx]
        # Engine truth below (the engine ends a one-token answer at its first token, so a PD
        # prefill then holds no KV); the router's resident leg is costed by its own estimate.
        r.base = 0
        if neutral:
            new = min(out, cap) if cap else out
            spec = SimRequestSpec(
                rid,
                plan.prompt_tokens,
                new,
                counts_as_decode=new > 1,
                block_hashes=hashes,
                pause_at_end=self._parks(cap, new, min(out, plan.max_tokens)),
            )
        else:
            spec = SimRequestSpec(
                rid,
                plan.prompt_tokens,
                1,
                hold_kv=out > 1,
                counts_as_decode=False,
                block_hashes=hashes,
            )
        try:
            self._settle(p, now).add(spec)
        except EngineOverloadedError as exc:
            self._fail(r, "RESOURCE_EXHAUSTED", f"instance {self.fleet.ids[p]}: {exc}", now)
            return
        except InvalidRequestError as exc:
            self._fail(r, "INVALID_ARGUMENT", f"instance {self.fleet.ids[p]}: {exc}", now)
            return
        r.stage = _SERVING if neutral else _PREFILL
        if not neutral and out > 1 and d != p:
            self._inflight(d, +1, plan.prompt_tokens)
        if out > 1:
            self._resident(r, d, +1, plan.prompt_tokens + r.expected, plan.prompt_tokens)
        self._landed(p, now, r.capped)

    def _landed(self, i: int, now: float, capped: bool) -> None:
        """A dispatch reached instance ``i``'s engine. Capped runs (slices) are admitted in batches:
        an idle engine starts its step once the whole action list is carried out, so a batch's
        slices share their first step (an uncapped dispatch starts an idle engine at once)."""
        if capped and self.carrying:
            self.landed[i] = None
        else:
            self._changed(i, now)

    def _parks(self, cap: int, new_tokens: int, left: int) -> bool:
        """Whether a run of ``new_tokens`` under ``cap`` pauses in its engine at its end (see ``park``):
        it ends at the cap with output left."""
        return self.park and cap > 0 and new_tokens < left

    def _unpark(self, idx: int, i: int) -> None:
        """End request ``idx``'s run paused at its cap on instance ``i``, unless it was continued there
        (the router closes a leg it does not continue; its KV is freed now)."""
        core = self.cores[i]
        rid = str(idx)
        if core.is_paused(rid):
            core.abort(rid)

    def _cached(self, r: _Req, previous: int, i: int, now: float) -> bool:
        """Whether a resumed request finds its blocks in instance ``i``'s prefix cache: it paused there
        this very moment (its blocks were freed, not yet reused) and the engines keep them."""
        return self.resume_cache and r.paused_at == now and previous == i

    def _resume(
        self,
        idx: int,
        r: _Req,
        plan: RequestPlan,
        i: int,
        now: float,
        cap: int = 0,
        *,
        cached: bool = False,
        goes_on: bool = False,
    ) -> None:
        """Run paused request ``idx`` again on (neutral) instance ``i``: the lifecycle's resume.

        Its prompt and the tokens returned so far are recomputed (but for the full blocks still
        ``cached``), at most ``cap`` new tokens when the placement has one; the engine stops at the
        answer's true end, which the cap left to it may not reach. ``goes_on``: the dispatcher
        continued the run where it paused (:attr:`~router.core.dispatch.Action.continues`; the
        router lets the engine's leg run past the cap): its whole context is still in the engine,
        nothing is recomputed and it goes on as a decode: its engine paused the run at the cap in its
        running batch (``park``), and its budget is raised there (``SimCore.extend``), so it decodes
        at the next step with its KV and its place in the batch, as a live leg that never stopped.
        """
        rid = str(idx)
        prompt = plan.prompt_tokens + r.tokens
        left = min(plan.max_tokens - r.tokens, r.out - r.tokens)
        new_tokens = max(min(left, cap) if cap else left, 1)
        core = self._settle(i, now)
        if goes_on and core.is_paused(rid):
            base = core.generated_tokens(rid)
            assert base is not None
            core.extend(rid, base + new_tokens, pause_at_end=self._parks(cap, new_tokens, left))
            r.base = base
            r.stage = _SERVING
            self._resident(r, i, +1, prompt + max(r.expected - r.tokens, 1), prompt)
            self._landed(i, now, r.capped)
            return
        self._unpark(idx, i)
        r.base = 0
        hit = 0
        if goes_on:
            hit = prompt
        elif cached:
            block = self.fleet.configs[i].block_size
            hit = min((prompt - 1) // block * block, prompt - 1)
        self.recomputed += prompt - hit
        spec = SimRequestSpec(
            rid,
            prompt,
            new_tokens,
            num_cached_tokens=hit,
            counts_as_decode=new_tokens > 1,
            pause_at_end=self._parks(cap, new_tokens, left),
            # The context still starts with the prompt's prefix blocks: the engine looks them up in its
            # prefix cache, as vLLM does for any new leg (a continued or cached leg asks it nothing).
            block_hashes=() if hit else self.block_hashes[idx],
        )
        try:
            core.add(spec)
        except EngineOverloadedError as exc:
            self._fail(r, "RESOURCE_EXHAUSTED", f"instance {self.fleet.ids[i]}: {exc}", now)
            return
        except InvalidRequestError as exc:
            self._fail(r, "INVALID_ARGUMENT", f"instance {self.fleet.ids[i]}: {exc}", now)
            return
        r.stage = _SERVING
        if new_tokens > 1:
            self._resident(r, i, +1, prompt + max(r.expected - r.tokens, 1), prompt)
        self._landed(i, now, r.capped)

    def _finish(self, r: _Req, now: float) -> None:
        r.stage = _DONE
        r.done_s = now
        plan = self.plans[r.idx]
        self.lengths.observe(plan.class_name, plan.prompt_tokens, r.tokens)
        theta = self.scheduler.predictors.theta if self.scheduler.predictors is not None else None
        if theta is not None and r.tokens >= 2 and r.first_s >= 0:
            # As the router's service does: the TPOT target in force, none for an e2e-judged request.
            target = plan.slo.tpot_ms or (0.0 if plan.slo.e2e_ms else self.scheduler.config.tpot_slo_ms)
            theta.observe((now - r.first_s) * 1e3 / (r.tokens - 1), target, plan.class_name)
        self._resident(r, r.resident, -1, 0)
        self._handle(Completion(str(r.idx), int(r.tokens)), now)
        self._outcome(r)

    def _fail(self, r: _Req, code: str, message: str, now: float) -> None:
        self._resident(r, r.resident, -1, 0)
        r.stage = _DONE
        r.done_s = now
        r.error_code = code
        r.error_message = message
        self._handle(Completion(str(r.idx)), now)
        self._outcome(r)

    def _outcome(self, r: _Req) -> None:
        """Tell the dispatcher how request ``r`` ended (queue objective g steers its shedding by the
        misses), as the router's driver does when a call ends."""
        if self.miss_limit is not None:
            self._count_miss(r)
        if self.dispatcher.shed_limit_ms(r.done_s) is None:
            return  # nothing steers by it
        result = finished_result(
            self.plans[r.idx],
            first_s=r.first_s,
            done_s=r.done_s,
            tokens=r.tokens,
            error_code=r.error_code,
            error_message=r.error_message,
        )
        self._handle(Served(str(r.idx), slo_met(result), result.tpot_ms), r.done_s)

    def _count_miss(self, r: _Req) -> None:
        """Count ``r`` against ``miss_limit`` when it is scored and missed its SLO (judged as
        ``workload.report`` judges it); past the limit the run stops."""
        assert self.miss_limit is not None
        scored_from, limit = self.miss_limit
        plan = self.plans[r.idx]
        if plan.arrival_s < scored_from:
            return
        result = finished_result(
            plan,
            first_s=r.first_s,
            done_s=r.done_s,
            tokens=r.tokens,
            error_code=r.error_code,
            error_message=r.error_message,
        )
        if not slo_met(result):
            self.misses += 1
            if self.misses > limit:
                self.stopped = True

    def _resident(self, r: _Req, i: int, sign: int, final_tokens: float, prompt_tokens: int = 0) -> None:
        """Make request ``r``'s decode leg resident on ``i`` (+1), or end its residence (-1)."""
        if i < 0:
            return
        m = self.inflight
        if sign > 0:
            r.resident = i
            r.resident_tokens = final_tokens
            self.resident_on[i][r.idx] = (prompt_tokens, final_tokens)
        elif r.resident != i:
            return
        else:
            final_tokens = r.resident_tokens
            r.resident = -1
            self.resident_on[i].pop(r.idx, None)
        self.legs_version += 1
        m[6, i] += sign
        m[7, i] += sign * final_tokens
        self.inflight_columns = None

    def _resident_legs(self, now: float) -> ResidentLegs:
        """Every resident decode leg with its progress at ``now`` (packing's exact KV peak).

        A leg its decode instance runs holds its context and generated tokens
        (a fast-forwarded run adds one per step it has done, to every running
        request); a leg not there yet (its prefill or KV transfer is under way)
        holds its prompt, has its whole output ahead and has not started. The legs change only with
        time, between events, or when a request is placed or ends: a queue pump's
        many views of one instant share them.
        """
        key = (now, self.events, self.legs_version)
        cached = self.legs_cache
        if cached is not None and cached[0] == key:
            return cached[1]
        instance: list[int] = []
        context: list[float] = []
        remaining: list[float] = []
        started: list[bool] = []
        generated: list[float] = []
        need: list[float] = []
        paced: list[bool] = []
        first_token: list[float] = []
        paced_tokens: list[float] = []
        hits: list[float] = []
        reqs = self.reqs
        for i in range(len(self.resident_on)):
            on = self.resident_on[i]
            prompts = [prompt for prompt, _ in on.values()]
            for (cur, rem, decoding, hit), prompt, idx in zip(
                self._legs_on(i, now), prompts, on, strict=True
            ):
                instance.append(i)
                context.append(cur)
                remaining.append(rem)
                started.append(decoding)
                generated.append(max(cur - prompt, 0.0))
                need.append(reqs[idx].tpot_need_ms or np.inf)
                paced.append(reqs[idx].tpot_paced)
                paced_tokens.append(reqs[idx].paced_tokens)
                first = reqs[idx].first_s
                first_token.append(first if decoding and first >= 0 else np.nan)
                hits.append(hit)
        found = ResidentLegs(
            np.array(instance, dtype=np.intp),
            np.array(context, dtype=np.float64),
            np.array(remaining, dtype=np.float64),
            np.array(started, dtype=bool),
            np.array(generated, dtype=np.float64),
            np.array(need, dtype=np.float64),
            np.array(paced, dtype=bool),
            np.array(first_token, dtype=np.float64),
            np.array(paced_tokens, dtype=np.float64),
            np.array(hits, dtype=np.float64),
        )
        self.legs_cache = (key, found)
        return found

    def _legs_on(self, i: int, now: float) -> LegList:
        """Instance ``i``'s resident legs at ``now``: (context, output still to come, decoding) each."""
        legs = self.resident_on[i]
        if not legs:
            return []
        run = self.runs[i]
        s = run.steps_done(now) if run is not None else 0
        rids = self.rids
        progress = self.cores[i].decode_progress_many([rids[idx] for idx in legs])
        out: LegList = []
        reqs = self.reqs
        if self.oracle_lengths:
            for (idx, (prompt, final)), found in zip(legs.items(), progress, strict=True):
                cached = float(reqs[idx].cached)
                if found is None:
                    out.append((float(prompt), float(max(final - prompt, 0)), False, cached))
                else:
                    out.append((float(found[0] + s), float(max(found[1] - s, 0)), found[2], cached))
            return out
        # What the router can know: the tokens streamed so far, and its length predictor (asked
        # once for all the legs that are running).
        classes, buckets, prompts, caps = self.class_of, self.bucket_of, self.prompt_of, self.cap_of
        running = [idx for idx, found in zip(legs, progress, strict=True) if found is not None]
        generated = [found[0] + s - prompts[idx] for idx, found in zip(legs, progress, strict=True) if found]
        remaining = iter(
            self.lengths.remaining_many(
                [classes[idx] for idx in running],
                [buckets[idx] for idx in running],
                generated,
                [caps[idx] for idx in running],
            )
        )
        for (idx, (prompt, final)), found in zip(legs.items(), progress, strict=True):
            cached = float(reqs[idx].cached)
            if found is None:
                out.append((float(prompt), float(max(final - prompt, 0)), False, cached))
            else:
                out.append((float(found[0] + s), next(remaining), found[2], cached))
        return out

    def _class_reached(self, slo_class: str, now: float) -> list[int]:
        """The output tokens each running answer of ``slo_class`` has produced so far (those with
        any): the lower bounds of :meth:`LengthPredictor.censored_bound`."""
        out: list[int] = []
        classes, prompts, rids = self.class_of, self.prompt_of, self.rids
        for i, on in enumerate(self.resident_on):
            mine = [idx for idx in on if classes[idx] == slo_class]
            if not mine:
                continue
            run = self.runs[i]
            s = run.steps_done(now) if run is not None else 0
            for idx, found in zip(
                mine, self.cores[i].decode_progress_many([rids[idx] for idx in mine]), strict=True
            ):
                if found is not None and found[0] + s - prompts[idx] > 0:
                    out.append(found[0] + s - prompts[idx])
        return out

    def _inflight(self, i: int, sign: int, prompt_tokens: int) -> None:
        """Add (+1) or remove (-1) a decode leg of ``prompt_tokens`` on instance ``i``."""
        m = self.inflight
        m[0, i] += sign
        m[3, i] += sign
        m[4, i] += sign * prompt_tokens
        m[5, i] += sign * prompt_tokens
        self.inflight_columns = None
        self.touched.add(i)

    # ------------------------------------------------------------------ the view

    def _view(self, now: float) -> ClusterView:
        load = self.load
        uncomputed, decode_requests, decode_tokens, used_kv, waiting, running = load
        cores = self.cores
        runs = self.runs
        if not self.oracle_lengths:
            self._reestimate_residents(now)
        exact = self.exact_index
        for i in self.dirty:
            if runs[i] is not None:
                self.run_next[i] = -np.inf
            core = cores[i]
            if exact is not None:
                # What the engine's KV-event stream carries to the router (instantaneous, as pushes are).
                events, _ = core.drain_kv_events()
                if events:
                    exact.apply(self.fleet.ids[i], [(e.kind.value, e.block_hashes) for e in events])
            uncomputed[i] = core.num_uncomputed_prefill_tokens
            decode_requests[i] = core.num_decode_requests
            decode_tokens[i] = core.num_decode_tokens
            used_kv[i] = core.num_used_kv_tokens
            waiting[i] = core.num_waiting
            running[i] = core.num_running
            self.preempt_count[i] = core.num_preemptions
            self.recompute_count[i] = core.num_preemption_recompute_tokens
            if core.num_decode_requests == 0:
                self.measured[i] = np.nan  # no decode work: nothing to measure, nothing over-packed
                self.step_window[i].clear()
        self.dirty.clear()
        for i in np.flatnonzero(self.run_next <= now).tolist():
            run = runs[i]
            assert run is not None
            s = run.steps_done(now)
            if s == len(run.ends) and not run.complete:
                # The planned steps end right now and the event planning more has not run yet
                # (another event of the same instant asked for a view first): plan them here.
                run.extend()
                self._next_feed(i, run)
            self._measure_run(i, run, s)  # the steps it finished, as its status push would carry them
            decode_tokens[i] = run.decode_tokens_at(s)
            used_kv[i] = run.used_kv_tokens_at(s)
            self.changed_at[i] = run.step_start(s)
            # A complete run ending right now: its end event applies it and refreshes the columns.
            self.run_next[i] = run.ends[s] if s < len(run.ends) else np.inf
        rows = _readonly(load.copy())
        age = now - self.changed_at
        age *= self.busy  # idle instances: a heartbeat-fresh status
        if age.max() >= AGENT_HEARTBEAT_S:
            age = np.mod(age, AGENT_HEARTBEAT_S)
        _readonly(age)
        table = InstanceTable(
            **self.fleet.static_columns,
            status_age_s=age,
            **{name: rows[k] for k, name in enumerate(_LOAD_ROWS)},
            memo=dict(self.static_memo),
            measured_decode_step_ms=_readonly(self.measured.copy()),
            preempting=_readonly((now - self.last_preempt_s < AGENT_HEARTBEAT_S).astype(np.float64)),
            preemptions=_readonly(self.preempt_count.copy()),
            preemption_recompute_tokens=_readonly(self.recompute_count.copy()),
        )
        # Built only when a decision reads them (adaptive PD's exact KV peak), as the router does.
        return ClusterView(table, self._inflight_columns(), now, age, residents=_SimLegs(self, now))

    def _reestimate_residents(self, now: float) -> None:
        """Refresh the router's expected final length of the resident legs of changed instances.

        A leg enters with ``prompt + estimate`` as its final length; one that outlives its
        estimate would leave the sums saying it is done (no growth left). The router sees the
        tokens streamed, so on each status push (an instance's load changed) and heartbeat it
        re-estimates each leg as what it holds plus the predictor's conditional remaining output.
        """
        due = set(self.dirty)
        stale = self.refreshed_at <= now - AGENT_HEARTBEAT_S
        if stale.any():
            due.update(np.flatnonzero(stale).tolist())
        m = self.inflight
        reqs = self.reqs
        for i in due:
            self.refreshed_at[i] = now
            legs = self.resident_on[i]
            if not legs:
                continue
            total = 0.0
            for (idx, (prompt, _)), (context, remaining, _started, _cached) in zip(
                list(legs.items()), self._legs_on(i, now), strict=True
            ):
                final = context + remaining
                legs[idx] = (prompt, final)
                reqs[idx].resident_tokens = final
                total += final
            if total != m[7, i]:
                m[7, i] = total
                self.inflight_columns = None
                self.legs_version += 1

    def _inflight_columns(self) -> InflightColumns:
        columns = self.inflight_columns
        if columns is None:
            columns = self.inflight_columns = InflightColumns.of(self.inflight.copy())
        return columns

    # ------------------------------------------------------------------ results

    def cache_hit_rate(self) -> float:
        """The fleet's prefix-cache hit rate: cached prompt tokens over prompt tokens looked up."""
        queried = sum(core.cache_query_tokens for core in self.cores)
        return sum(core.cache_hit_tokens for core in self.cores) / queried if queried else 0.0

    def _count_lookup(self, request_id: str, query_tokens: int, hit_tokens: int) -> None:
        idx = int(request_id)
        self.cache_query[idx] += query_tokens
        self.cache_hit[idx] += hit_tokens

    def results(self) -> tuple[RequestResult, ...]:
        out = []
        ids = self.fleet.ids
        for plan, r in zip(self.plans, self.reqs, strict=True):
            if r.stage != _DONE:  # cannot happen: every event is processed before results are read
                raise RuntimeError(f"request {plan.index} did not finish (stage {r.stage})")
            out.append(
                finished_result(
                    plan,
                    first_s=r.first_s,
                    done_s=r.done_s,
                    tokens=r.tokens,
                    error_code=r.error_code,
                    error_message=r.error_message,
                    prefill_instance_id=ids[r.prefill] if r.prefill >= 0 else "",
                    decode_instance_id=ids[r.decode] if r.decode >= 0 else "",
                    predicted_ttft_ms=r.predicted_ttft_ms,
                    predicted_tpot_ms=r.predicted_tpot_ms,
                    queue_wait_ms=r.queue_wait_s * 1e3,
                )
            )
        return tuple(out)


class _Lent:
    """The :class:`~router.core.dispatch.Fleet` the simulator lends its dispatcher: views of the
    virtual fleet now, decisions by the router's own scheduler (counted), and preemption."""

    def __init__(self, sim: _Simulation) -> None:
        self.sim = sim
        self._last: ClusterView | None = None

    @property
    def scheduler(self) -> Scheduler:
        return self.sim.scheduler

    def view(self) -> ClusterView:
        self.keep_last()
        view = self._last = self.sim._view(self.sim.now)
        return view

    def keep_last(self) -> None:
        """Carry the static memo of the last view built to the next one (see ``STATIC_MEMO_KEYS``)."""
        if self._last is not None:
            self.sim._keep_static(self._last)
            self._last = None

    def snapshot(self) -> ClusterSnapshot:
        snapshot: ClusterSnapshot = self.sim.fleet.static_columns["snapshot"]
        return snapshot

    def decide(
        self,
        view: ClusterView | ClusterSnapshot,
        request: ScheduleInput,
        now: float,
        *,
        targets: Targets | None = None,
        policy: Policy | None = None,
    ) -> Decision:
        self.sim.decisions += 1
        return self.sim.scheduler.schedule(view, request, now, targets=targets, policy=policy)

    def evict(self, request_id: str) -> int | None:
        return self.sim._evict(int(request_id), self.sim.now)

    def produced(self, request_id: str) -> int | None:
        return self.sim._produced(int(request_id), self.sim.now)


class _SimLegs:
    """The simulation's resident legs at one moment, as a view's :class:`ResidentSource`."""

    __slots__ = ("now", "sim")

    def __init__(self, sim: _Simulation, now: float) -> None:
        self.sim = sim
        self.now = now

    def legs(self) -> ResidentLegs:
        return self.sim._resident_legs(self.now)

    def legs_on(self, index: int) -> LegList:
        return self.sim._legs_on(index, self.now)


def simulate(
    fleet: SimFleet,
    config: SchedulerConfig,
    plans: Sequence[RequestPlan],
    *,
    seed: int = 0,
    reuse_static_memo: bool = True,
    fast_forward: bool = True,
    queue: QueueConfig | None = None,
    qlm: QlmConfig | None = None,
    sa_search: str = "anneal",
    oracle_lengths: bool = False,
    engine_prefix_cache: bool = True,
    incremental_dispatch: str = "on",
    calibration: CalibrationConfig | None = None,
    slicing: SliceConfig | None = None,
    resume_cache: bool = False,
    miss_limit: tuple[float, int] | None = None,
    dispatch_mode: str = "",
) -> SimOutcome:
    """Run ``plans`` (open-loop, in arrival order) on ``fleet`` with the policy ``config`` names.

    Deterministic for a seed: the scheduler's RNG is ``random.Random(seed)`` and
    engine noise (if any) is seeded from ``seed`` and the instance. Every engine
    starts empty. ``reuse_static_memo=False`` recomputes every cached column per
    decision and ``fast_forward=False`` steps every engine step (both slower;
    the results are the same). ``queue`` runs the router queue (``None`` or
    policy ``none``: a request without a placement at arrival is rejected);
    ``qlm`` configures the ``qlm`` queue policy (default :class:`QlmConfig`).
    ``sa_search="exhaustive"`` makes the ``sa`` policy plan small queues by
    exhaustive search (the reference its annealing is compared with).
    ``oracle_lengths=True`` gives policies each request's true output length (an ablation; by
    default they get an online estimate learned from finished requests).
    ``incremental_dispatch="off"`` offers every waiting request to placement on every pass (the
    reference incremental dispatch is compared with: :class:`router.core.queue.LoadWatch`);
    ``"exact"`` turns off the watch's jitter tolerances. ``calibration``: the calibrator's
    settings (default: ``CalibrationConfig(mode=config.calibration)``, as the router's); its
    mode must be ``config.calibration``.

    Prefix caching: when the plans carry prefix-block ids (``RequestPlan.hash_ids``) and
    ``engine_prefix_cache`` is on, every engine caches prompt KV in blocks of the plans'
    ``prefix_block_tokens`` (content-addressed by the chained hash of the block ids, which
    stand for the tokens), and the router hashes prompts the same way. Its knowledge of the
    caches follows ``config.prefix_cache_routing``: ``auto`` and ``exact`` read the engines' KV
    events, ``approximate`` its own dispatches, ``off`` charges every prompt in full.

    ``miss_limit`` (``slo-router plan``'s search, which only asks whether a fleet meets a target):
    ``(scored_from_s, k)`` stops the run as soon as more than ``k`` requests arriving at or after
    ``scored_from_s`` have missed their SLO; the outcome then says ``stopped`` and carries no
    results. A run that does not reach the limit is the same run as without it.

    ``dispatch_mode`` names the dispatcher to run instead of the queue policy's (``"auto"``, with
    ``slicing`` for its slices: :mod:`router.core.auto_dispatch`); by default ``"slice"`` when
    ``slicing`` is given.
    """
    if any(b.arrival_s < a.arrival_s for a, b in itertools.pairwise(plans)):
        raise ValueError("plans must be in arrival order")
    started = time.perf_counter()
    predictors = fleet.predictors
    learn_theta = config.scheduling_policy == "binpack" and config.binpack_theta_adapt
    if config.calibration != "off" or learn_theta:
        # A fresh set per run: the calibration (the scheduler attaches it) and θ are the run's state.
        predictors = PredictorSet(fleet.predictors.default, fleet.predictors.groups)
    if learn_theta:
        predictors.theta = ThetaFit(config.binpack_theta)
    if calibration is not None:
        if calibration.mode != config.calibration:
            raise ValueError(
                f"calibration mode {calibration.mode!r} differs from the config's {config.calibration!r}"
            )
        if calibration.enabled:
            predictors.calibration = Calibrator(calibration, predictors.step_predictor)
    block = prefix_cache_block(plans, fleet) if engine_prefix_cache else 0
    if block:
        config = dataclasses.replace(config, prefix_block_tokens=block)  # hashed as the engines cache
    scheduler = Scheduler(config, predictors, random.Random(seed))
    if block and config.prefix_cache_routing in (PrefixRouting.AUTO.value, PrefixRouting.EXACT.value):
        scheduler.use_exact_prefix_index()
    calibrator = predictors.calibration
    sim = _Simulation(
        fleet,
        scheduler,
        plans,
        seed=seed,
        reuse_static_memo=reuse_static_memo,
        fast_forward=fast_forward,
        calibrator=calibrator,
        queue=queue,
        qlm=qlm,
        sa_search=sa_search,
        oracle_lengths=oracle_lengths,
        prefix_block_tokens=block,
        incremental_dispatch=incremental_dispatch,
        slicing=slicing,
        resume_cache=resume_cache,
        miss_limit=miss_limit,
        dispatch_mode=dispatch_mode,
    )
    duration_s, stats = sim.run()
    if sim.stopped:
        return SimOutcome(
            results=(),
            duration_s=duration_s,
            stats=stats,
            wall_s=time.perf_counter() - started,
            stopped=True,
            misses=sim.misses,
        )
    results = sim.results()
    return SimOutcome(
        results=results,
        duration_s=duration_s,
        stats=stats,
        wall_s=time.perf_counter() - started,
        queue_wait_ms=tuple(r.queue_wait_s * 1e3 for r in sim.reqs),
        late=tuple(r.late for r in sim.reqs),
        cache_hit_rate=sim.cache_hit_rate() if block else None,
        cache_tokens=tuple(zip(sim.cache_query, sim.cache_hit, strict=True)) if block else (),
        refused=tuple(sim.refused),
        desired=sim.desired,
        misses=sim.misses,
        busy_s=tuple(sim.busy_s),
        last_busy_s=tuple(sim.last_busy),
        recomputed_tokens=sim.recomputed,
        resume_gaps_ms=tuple(sim.gaps_ms),
        counters=sim.dispatcher.counters(),
    )


def prefix_cache_block(plans: Sequence[RequestPlan], fleet: SimFleet) -> int:
    """The prefix-cache block of a run: the plans' ``prefix_block_tokens`` (0 when no plan has hash ids)."""
    blocks = {p.prefix_block_tokens for p in plans if p.hash_ids}
    if not blocks:
        return 0
    if len(blocks) > 1:
        raise ValueError(f"the plans mix prefix blocks of {sorted(blocks)} tokens; one size per run")
    block = blocks.pop()
    for config in fleet.configs:
        if block % config.block_size:
            raise FleetError(
                f"prefix blocks of {block} tokens (the workload's) are not whole KV blocks of "
                f"--block-size {config.block_size}; pick a block size that divides {block}"
            )
    return block


def stats_to_dict(stats: SimStats) -> dict[str, int]:
    return dataclasses.asdict(stats)
