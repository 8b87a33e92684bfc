"""Simulated-annealing priority mapping: the ``sa`` queue policy (seed 000).

Per instance, the queued requests placed there are ordered and grouped into
*release batches* by simulated annealing maximizing ``G = n / t``: ``n`` the
requests predicted to meet their targets, ``t`` the sum of their predicted
end-to-end latencies (seconds, the time they already waited included). A
request with only an e2e target counts as met when its e2e latency is within
it; any other request when its TTFT (waiting included) and TPOT are within
theirs (and its e2e, if it has one too).

The router cannot form engine batches or reorder an engine's queue; the
paper submits its planned order into vLLM's continuous batching, so the ``sa``
policy keeps the queue itself and hands the front of an instance's plan over
the moment the engine would start it: when fewer of the policy's requests run
there than the instance's slots (see :class:`SAPlanner`). A plan is priced as
it is run that way: its first batch starts at once, its members priced at
the batch's size, and every later request, in the plan's order, starts when
the first of the ``cap`` slots frees, priced as it joins the running batch
(its prompt prefilled alone beside a full engine's decode step, its decode at
a full engine: :func:`jobs_for`). The
paper prices static batches instead (batch ``k`` starts when the slowest
member of batch ``k-1`` ends); on two-sequence engines that put a translation
due in 800 ms behind a 2 s translation beside a 0.4 s triage, though it
starts when the triage ends, so a plan that met all three looked like one that
lost one (docs/papers.md, seed 000, session 24). With one slot the two are the
same. Later batches' sizes therefore do not change G; only the first batch's
does (how many start now).

The per-request predictions come from the router's latency profile rather than
the paper's linear fit, in the fit's shape: a request of ``l`` prompt tokens and
``o`` expected output tokens in a batch of ``b`` is predicted as if its batch
peers had its lengths (prefill of ``b * l`` tokens; decode steps of ``b``
requests holding ``b * (l + o / 2)`` tokens), so each request's cost is a
function of ``b`` alone and is computed once per run, for every ``b`` up to the
cap (see :func:`jobs_for`).

The search (:func:`anneal`) is Algorithm 1 of the paper: two starting
solutions (the queue order, and the order of smallest predicted e2e latency,
both in full batches); if the latency order meets every target it is taken at
once; otherwise the better start is annealed with three moves (squeeze a
request into the previous batch, delay it into the next one, swap two
requests), ``iterations`` moves per temperature, the temperature multiplied by
``decay`` until it falls under ``min_temperature``. Adaptations, each for a
reason given where it is made: temperatures are in per mille of the start's
``G`` (the acceptance rule needs a unit independent of the workload's latency
scale); a worse move is accepted with the Metropolis probability; the best
solution seen is kept; a move that does not apply becomes a swap; the latency
order's start takes its best first batch; a run that cannot
afford the whole schedule within its time budget keeps the temperatures and
takes fewer moves per level; the best solution is polished by hill climbing
while the budget lasts (:func:`_polish`); a request already lost that a plan
starts after the router queue would refuse it is priced as that refusal (its
wait until then in G's sum, no slot held), the e2e latency G then measures,
since the paper's engines serve every request and this router's queue does not
(:func:`jobs_for`).
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from heapq import heapify, heapreplace
from typing import Any

import numpy as np

from fleet.snapshot import ClusterSnapshot
from predictor.latency import LatencyPredictor
from router.core.columns import ClusterView
from router.core.errors import EmptyClusterError, NoInstanceError
from router.core.plugins import Policy
from router.core.policies import RESIDENTS_TPOT_LABEL
from router.core.queue import Decide, Offer, QueueConfig, QueueEntry, RouterQueue, Verdict
from router.core.request import Role, ScheduleInput, Targets, resolve_targets
from router.core.scheduler import Scheduler

#: Temperatures are in units of this fraction of the starting solution's G (per mille).
TEMPERATURE_UNIT = 1e-3

#: The budget's clock is read every this many moves (within a temperature level, so a level
#: longer than the budget is cut short too).
BUDGET_CHECK_MOVES = 8

#: Under a budget, the polish's best split (best_split, O(n * cap)) runs only when n * cap is at most
#: this.
BEST_SPLIT_OPS = 2048

#: The share of a budget the annealing schedule is fitted to; the rest polishes its best solution.
ANNEAL_SHARE = 0.8


@dataclass(frozen=True)
class AnnealParams:
    """The annealing schedule (the paper's defaults: T0 500, Tthres 20, iter 100, tau 0.95)."""

    initial_temperature: float = 500.0
    iterations: int = 100
    decay: float = 0.95
    min_temperature: float = 20.0
    #: Wall-clock budget of one run (s); None = the schedule alone bounds it.
    budget_s: float | None = None

    @property
    def steps(self) -> int:
        """Temperature levels the schedule visits."""
        if self.initial_temperature < self.min_temperature:
            return 0
        return (
            math.floor(math.log(self.min_temperature / self.initial_temperature) / math.log(self.decay)) + 1
        )


@dataclass(frozen=True)
class Job:
    """One queued request as the annealer sees it; lists are indexed by batch size ``b`` (index 0 unused).

    ``slack_ms[b]``: the latest start of its batch (ms after the plan starts)
    at which it still meets its targets in a batch of ``b`` (-inf: never, e.g.
    its TPOT target fails at that size). ``cost_ms[b]``: its e2e latency when
    its batch starts at once (waited so far + execution). ``exec_ms[b]``: its
    execution time, which sets its batch's duration. ``refuse_ms``: the
    latest start of its batch before the router queue refuses it unserved
    (inf: never); planned to start later, it is refused then, holds no slot and
    adds ``refused_ms`` (its e2e latency at its refusal) to G's sum.
    ``join_*``: the same three figures when it joins a running batch (a
    plan's later request, started on a freed slot): its prompt prefilled alone
    beside the peers' decode step, its decode at a full engine (see
    :func:`jobs_for`); None: priced as a member of a full first batch.
    """

    exec_ms: tuple[float, ...]
    cost_ms: tuple[float, ...]
    slack_ms: tuple[float, ...]
    refuse_ms: float = math.inf
    refused_ms: float = 0.0
    join_exec_ms: float | None = None
    join_cost_ms: float | None = None
    join_slack_ms: float | None = None


@dataclass(frozen=True)
class Plan:
    """An order of jobs (indices into the job list) and its split into release batches."""

    order: tuple[int, ...]
    sizes: tuple[int, ...]
    g: float
    met: int
    total_ms: float
    #: Candidate solutions evaluated (both starts included).
    evaluations: int = 0
    #: The latency-ordered start met every target (no annealing ran).
    early_exit: bool = False

    def batches(self) -> list[tuple[int, ...]]:
        """The release batches, first to last."""
        out: list[tuple[int, ...]] = []
        pos = 0
        for b in self.sizes:
            out.append(self.order[pos : pos + b])
            pos += b
        return out


def evaluate(
    jobs: Sequence[Job],
    order: Sequence[int],
    sizes: Sequence[int],
    start_ms: float = 0.0,
    cap: int | None = None,
) -> tuple[float, int, float]:
    """(G in requests/s, requests meeting their targets, summed e2e latency in ms) of a solution.

    ``start_ms``: when the first batch can start (the instance is busy until
    then). ``cap``: the slots the plan runs on (default: its largest batch).
    The first batch starts at ``start_ms``, each member priced at the batch's
    size; every later request, in the plan's order, starts on the first slot to
    free and is priced as it joins the running batch (its ``join_*`` figures;
    see the module doc).
    """
    width = max(cap or 0, max(sizes, default=1))
    return _Columns.of(jobs, width).evaluate(order, sizes, start_ms)


class _Columns:
    """The jobs' figures by batch size, then job (the annealer's hot loop reads them without attribute lookups)."""

    __slots__ = ("cost", "exec", "join", "refuse", "refused", "slack", "width")

    def __init__(
        self,
        exec_ms: list[list[float]],
        cost_ms: list[list[float]],
        slack_ms: list[list[float]],
        refuse_ms: list[float] | None = None,
        refused_ms: list[float] | None = None,
        join: tuple[list[float], list[float], list[float]] | None = None,
    ) -> None:
        self.exec = exec_ms
        self.cost = cost_ms
        self.slack = slack_ms
        n = len(exec_ms[0]) if exec_ms else 0
        self.refuse = refuse_ms if refuse_ms is not None else [math.inf] * n
        self.refused = refused_ms if refused_ms is not None else [0.0] * n
        self.width = len(exec_ms) - 1
        #: A later request's (execution, cost, slack) as it joins the running batch; default: at ``width``.
        self.join = join if join is not None else (exec_ms[-1], cost_ms[-1], slack_ms[-1])

    @classmethod
    def of(cls, jobs: Sequence[Job], cap: int) -> _Columns:
        sizes = range(cap + 1)
        return cls(
            [[j.exec_ms[b] if b else 0.0 for j in jobs] for b in sizes],
            [[j.cost_ms[b] if b else 0.0 for j in jobs] for b in sizes],
            [[j.slack_ms[b] if b else 0.0 for j in jobs] for b in sizes],
            [j.refuse_ms for j in jobs],
            [j.refused_ms for j in jobs],
            (
                [j.exec_ms[cap] if j.join_exec_ms is None else j.join_exec_ms for j in jobs],
                [j.cost_ms[cap] if j.join_cost_ms is None else j.join_cost_ms for j in jobs],
                [j.slack_ms[cap] if j.join_slack_ms is None else j.join_slack_ms for j in jobs],
            ),
        )

    def evaluate(
        self, order: Sequence[int], sizes: Sequence[int], start_ms: float
    ) -> tuple[float, int, float]:
        """The plan run on ``width`` slots by continuous batching (see :func:`evaluate`)."""
        exec_, cost, slack, refuse, refused = self.exec, self.cost, self.slack, self.refuse, self.refused
        met = 0
        total = 0.0
        first = sizes[0] if sizes else 0
        eb, cb, sb = exec_[first], cost[first], slack[first]
        slots: list[float] = []
        for i in order[:first]:
            if start_ms > refuse[i]:
                # Still queued when the queue refuses it: it never runs (see Job).
                total += refused[i]
                continue
            total += cb[i] + start_ms
            if sb[i] >= start_ms:
                met += 1
            slots.append(start_ms + eb[i])
        if len(order) > first:
            # A slot the first batch leaves empty is filled at the next pass, when a member ends.
            slots.extend([min(slots, default=start_ms)] * (self.width - len(slots)))
            heapify(slots)
            eb, cb, sb = self.join
            for i in order[first:]:
                wait = slots[0]
                if wait > refuse[i]:
                    total += refused[i]
                    continue
                total += cb[i] + wait
                if sb[i] >= wait:
                    met += 1
                heapreplace(slots, wait + eb[i])
        return (met * 1e3 / total if total > 0 else 0.0), met, total


def full_batches(n: int, cap: int) -> tuple[int, ...]:
    """Batch sizes of ``n`` requests in batches of ``cap`` (the last one holds the rest)."""
    return tuple([cap] * (n // cap) + ([n % cap] if n % cap else []))


def anneal(
    jobs: Sequence[Job],
    cap: int,
    params: AnnealParams,
    rng: random.Random,
    *,
    start_ms: float = 0.0,
    clock: Callable[[], float] = time.perf_counter,
    spent_s: float = 0.0,
) -> Plan:
    """The release order and batches of ``jobs`` maximizing G (Algorithm 1 of seed 000; see the module doc).

    ``jobs`` are in queue order (the first starting solution). ``cap`` >= 1
    bounds every batch. ``spent_s`` of ``params.budget_s`` went to costing the
    jobs already; ``clock`` is read every :data:`BUDGET_CHECK_MOVES` moves. Deterministic for a given ``rng`` state when
    ``params.budget_s`` is None.
    """
    n = len(jobs)
    if n == 0:
        return Plan((), (), 0.0, 0, 0.0)
    if cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    # The budget covers the starts too (at 40 queued and a cap of 4 they are a tenth of the budget).
    started = clock()
    deadline = None if params.budget_s is None else started + params.budget_s - spent_s
    sizes0 = full_batches(n, cap)
    columns = _Columns.of(jobs, cap)
    evaluate_ = columns.evaluate
    # Start 2: smallest predicted e2e latency first. The paper leaves its batch sizes open; it takes
    # the uniform size (1..cap) with the best G, so a cap that breaks TPOT targets does not make the
    # annealer climb out of full batches first.
    by_latency = tuple(sorted(range(n), key=lambda i: (jobs[i].exec_ms[1], i)))
    evaluations = 0
    latency_start: tuple[tuple[int, ...], float, int, float] = ((), -1.0, 0, 0.0)
    for b in range(cap, 0, -1):
        sizes_b = full_batches(n, b)
        g_b, met_b, total_b = evaluate_(by_latency, sizes_b, start_ms)
        evaluations += 1
        if g_b > latency_start[1]:
            latency_start = (sizes_b, g_b, met_b, total_b)
    sizes2, g, met, total = latency_start
    if met == n and cap == 1:
        # Every target met: only the summed latency can still improve (for a fixed order only the first
        # batch's size changes it, which the loop above tried). The paper's exit is exact with a cap of
        # 1. With batches the order by single-request latency is not the order of least summed latency
        # (a request fast alone may slow its batch more than another), so with a cap above 1 the exit
        # is the annealer's start instead of its end: hypothesis found queues of four and five where it
        # stood at 93 % and 86 % of the optimum. The budget still bounds the run.
        return Plan(by_latency, sizes2, g, met, total, evaluations, early_exit=True)
    # Start 1: the queue order in full batches.
    fifo = tuple(range(n))
    g1, met1, total1 = evaluate_(fifo, sizes0, start_ms)
    evaluations += 1
    order, sizes = (fifo, sizes0) if g1 > g else (by_latency, sizes2)
    if g1 > g:
        g, met, total = g1, met1, total1
    best = Plan(order, sizes, g, met, total)
    if n == 1:
        return Plan(best.order, best.sizes, g, met, total, evaluations)
    # The paper's acceptance rule compares raw G differences with temperatures in the hundreds; G
    # is in requests/s (0.001..10 depending on the latency scale), so the raw rule would accept
    # every worse move. Differences are taken in per mille of the start's G instead, which keeps
    # the paper's temperatures meaningful: at T0=500 a move 10 % worse is accepted with p = 0.82,
    # at Tthres=20 with p = 0.007.
    unit = max(g, 1e-12) * TEMPERATURE_UNIT
    cur_order = list(order)
    cur_sizes = list(sizes)
    cur_g = g
    temperature = params.initial_temperature
    levels = params.steps
    per_level = params.iterations
    randrange = rng.randrange
    rand = rng.random
    level = in_level = moves = 0
    fitted = False
    while level < levels:
        if deadline is not None and moves % BUDGET_CHECK_MOVES == 0:
            now = clock()
            if now >= deadline:
                break
            if not fitted and moves:
                # The schedule is fitted to the budget once the cost of a move is known: the same
                # temperatures and decay, fewer moves per level, so a run that cannot afford the
                # whole schedule still cools down to min_temperature instead of stopping while hot.
                fitted = True
                affordable = ANNEAL_SHARE * (deadline - now) / max((now - started) / moves, 1e-12)
                left = levels - level
                if left * per_level - in_level > affordable:
                    per_level = max(1, int(affordable // left))
                    in_level = min(in_level, per_level - 1)
        cand_order = cur_order[:]
        cand_sizes = cur_sizes[:]
        _move(cand_order, cand_sizes, cap, randrange)
        evaluations += 1
        moves += 1
        g_new, met_new, total_new = evaluate_(cand_order, cand_sizes, start_ms)
        if g_new > cur_g or rand() < math.exp((g_new - cur_g) / unit / temperature):
            cur_order, cur_sizes, cur_g = cand_order, cand_sizes, g_new
            # The paper returns the last accepted solution; the best one seen is never worse.
            if g_new > best.g:
                best = Plan(tuple(cand_order), tuple(cand_sizes), g_new, met_new, total_new)
        in_level += 1
        if in_level >= per_level:
            in_level = 0
            level += 1
            temperature *= params.decay
    if deadline is not None and clock() >= deadline:
        return replace(best, evaluations=evaluations)
    polished, spent = _polish(columns, best, cap, start_ms, deadline, clock)
    return replace(polished, evaluations=evaluations + spent)


def _polish(
    columns: _Columns,
    plan: Plan,
    cap: int,
    start_ms: float,
    deadline: float | None,
    clock: Callable[[], float],
) -> tuple[Plan, int]:
    """Steepest-free hill climbing from the annealer's best: first-improvement swaps, then the best split.

    An adaptation: with the few hundred moves a short budget affords, the
    annealer often ends one or two swaps short of a local optimum (the same
    targets met, a larger summed latency). Runs while the budget lasts.
    """
    order = list(plan.order)
    sizes = list(plan.sizes)
    g, met, total = plan.g, plan.met, plan.total_ms
    n = len(order)
    batch_of = [k for k, b in enumerate(sizes) for _ in range(b)]
    evaluations = 0
    improved = True
    while improved:
        improved = False
        if deadline is not None and clock() >= deadline:
            break
        fits = deadline is None or n * cap <= BEST_SPLIT_OPS
        split = best_split(columns, order, cap, start_ms) if fits else tuple(sizes)
        if list(split) != sizes:
            g_s, met_s, total_s = columns.evaluate(order, split, start_ms)
            evaluations += 1
            if g_s > g:
                sizes = list(split)
                batch_of = [k for k, b in enumerate(sizes) for _ in range(b)]
                g, met, total = g_s, met_s, total_s
        for i in range(n - 1):
            for j in range(i + 1, n):
                if batch_of[i] == batch_of[j]:
                    continue  # order inside a batch does not matter
                if deadline is not None and evaluations % BUDGET_CHECK_MOVES == 0 and clock() >= deadline:
                    return Plan(tuple(order), tuple(sizes), g, met, total), evaluations
                order[i], order[j] = order[j], order[i]
                g_new, met_new, total_new = columns.evaluate(order, sizes, start_ms)
                evaluations += 1
                if g_new > g * (1 + 1e-12):
                    g, met, total = g_new, met_new, total_new
                    improved = True
                else:
                    order[i], order[j] = order[j], order[i]
    return Plan(tuple(order), tuple(sizes), g, met, total), evaluations


def best_split(columns: _Columns, order: Sequence[int], cap: int, start_ms: float = 0.0) -> tuple[int, ...]:
    """The split of ``order`` into batches of at most ``cap`` with the highest G.

    Only the first batch's size changes G (see :func:`evaluate`): each size
    from 1 to ``cap`` is tried, the rest in full batches; ties go to the
    smaller first batch.
    """
    n = len(order)
    best: tuple[int, ...] = ()
    best_g = -1.0
    for b in range(1, min(cap, n) + 1):
        sizes = (b, *full_batches(n - b, cap))
        g = columns.evaluate(order, sizes, start_ms)[0]
        if g > best_g:
            best, best_g = sizes, g
    return best


def _move(order: list[int], sizes: list[int], cap: int, randrange: Callable[[int], int]) -> None:
    """Apply one of the three moves in place (a squeeze or delay that does not apply becomes a swap)."""
    n = len(order)
    op = randrange(3)
    p = randrange(n)
    if op < 2 and len(sizes) > 0:
        # The batch of position p and where it starts.
        k = 0
        start = 0
        while start + sizes[k] <= p:
            start += sizes[k]
            k += 1
        if op == 0 and k > 0 and sizes[k - 1] < cap:
            # Squeeze into the previous batch: p trades places with the first of its batch (order
            # inside a batch does not matter), which then becomes the previous batch's last.
            order[p], order[start] = order[start], order[p]
            sizes[k - 1] += 1
            sizes[k] -= 1
            if sizes[k] == 0:
                del sizes[k]
            return
        if op == 1:
            last = start + sizes[k] - 1
            if k + 1 < len(sizes) and sizes[k + 1] < cap:
                # Delay into the next batch: p becomes its batch's last, then the next batch's first.
                order[p], order[last] = order[last], order[p]
                sizes[k] -= 1
                sizes[k + 1] += 1
                if sizes[k] == 0:
                    del sizes[k]
                return
            if k + 1 == len(sizes) and sizes[k] > 1:
                # The last batch: the delayed request opens a new one.
                order[p], order[last] = order[last], order[p]
                sizes[k] -= 1
                sizes.append(1)
                return
    # The paper's random swap (also the fallback: with a cap of 1 no squeeze or delay ever applies).
    q = randrange(n - 1)
    if q >= p:
        q += 1
    order[p], order[q] = order[q], order[p]


def exhaustive(jobs: Sequence[Job], cap: int, *, start_ms: float = 0.0, limit: int = 8) -> Plan:
    """The best solution over every first batch of at most ``cap`` jobs and every order of the rest (the reference).

    Order inside the first batch and the sizes of later batches do not change
    G (see :func:`evaluate`), so these are all the distinct solutions (68,880
    for 8 jobs and a cap of 4). Raises ``ValueError`` above ``limit`` jobs.
    """
    n = len(jobs)
    if n > limit:
        raise ValueError(f"exhaustive search is for at most {limit} jobs, got {n}")
    if n == 0:
        return Plan((), (), 0.0, 0, 0.0)
    columns = _Columns.of(jobs, cap)
    best = Plan((), (), -1.0, 0, 0.0)
    count = 0
    everyone = range(n)
    for b in range(1, min(cap, n) + 1):
        sizes = (b, *full_batches(n - b, cap))
        for head in itertools.combinations(everyone, b):
            rest = [i for i in everyone if i not in head]
            for tail in itertools.permutations(rest):
                order = (*head, *tail)
                g, met, total = columns.evaluate(order, sizes, start_ms)
                count += 1
                if g > best.g:
                    best = Plan(order, sizes, g, met, total)
    return replace(best, evaluations=count)


# --------------------------------------------------------------------------- the queue policy


#: Output tokens assumed for a request that states no ``max_tokens`` and whose task type has no
#: finished request yet.
UNKNOWN_OUTPUT_TOKENS = 128

#: The sliding window: one planning run orders at most this many of an instance's waiting requests
#: (the oldest); the rest wait for a later run. It bounds a run's costing, which the budget covers.
WINDOW = 40

#: The request pool closes at the latest this many --sa-pool-ms after its oldest request arrived
#: (see pool_closes): 250 ms at the default pool, a burst of 40 requests 6 ms apart.
POOL_MAX_FACTOR = 10

#: The plan's batch cap is the instance's slots, but at most this many (a run costs every request
#: for each batch size up to the cap, so an engine of 256 sequences is planned in batches of 32).
PLAN_CAP_MAX = 32

#: Slots of an instance whose engine batch is unknown (no ``--sa-max-batch``, no fleet figure): the
#: count does not bound it, the KV memory check of Eq. 20 does.
UNBOUNDED_SLOTS = 1 << 20

#: A release pass passes over at most this many requests of the plan's order that the instance cannot
#: take now (each costs a placement attempt) before it stops.
SKIPPED_MAX = 8

#: How a planner searches (``exhaustive`` only up to EXHAUSTIVE_LIMIT requests per instance).
SEARCHES = ("anneal", "exhaustive")
EXHAUSTIVE_LIMIT = 8

#: Placement for the ``sa`` policy asks the scheduler for a decision on the pre-assigned instance with
#: targets this loose: the annealer, not the TTFT bound, decides when a request goes.
_RELAXED_MS = 1e12


class TaskLengths:
    """Output lengths per task type (the request's SLO class), learned online: seed 000's request profiler (§4).

    The paper lets users state a typical output length or distribution per
    task type and otherwise has the profiler gather it from served requests.
    Here a request's own ``expected_output_tokens`` (the client's hint, or the
    router's length predictor once it has learned its class) wins, unless it
    is flagged ``output_tokens_prior`` (the predictor's ``max_tokens`` guess)
    or ``output_tokens_pooled`` (learned from every class together);
    otherwise the task type's recent outputs (the last :attr:`MEMORY` finished
    requests of that class) give the typical length (their mean: G sums
    latencies) and the length bound (their 90th percentile: what Eq. 20
    reserves in memory). Both are clipped to the request's ``max_tokens``.
    Before :attr:`MIN_SAMPLES` outputs of its type are seen, a request is
    expected to use all of ``max_tokens`` (the only bound the router has),
    shrunk toward the few answers of its type seen so far (:meth:`_blend`); a
    request with the pooled estimate is expected at it until its type has an
    answer of its own, and then at its type's answers alone (:meth:`_own`).

    Why a prior must not override: only requests that finish teach a
    profile, and the plan puts the requests it cannot save last, where the
    queue's late path (``--late-allowance``) refuses them unfinished. On
    bursts of a TTFT-judged class beside an e2e class (docs/papers.md, S/C at
    one sequence) the first burst's chat requests were refused, the router's
    predictor (eight answers before it answers for a class or for all) kept
    passing its prior after this profile had four chat answers, and the chat
    requests were costed at ``max_tokens`` (900 against a typical 220): the
    plan ran summaries due in 35 s before chat requests it could still save,
    71.1 % met against 74.2 % with those requests served late; 74.2 % again
    with this rule. (Lending a cold type every type's lengths was tried too:
    it lost 7.5 points on the seeded mixed run, where one class's answers are
    many times another's.)
    """

    MEMORY = 256
    MIN_SAMPLES = 4

    def __init__(self) -> None:
        self._seen: dict[str, deque[int]] = {}
        self._cache: dict[str, tuple[float, float]] = {}

    def observe(self, task: str, output_tokens: int) -> None:
        if output_tokens < 0:
            return
        seen = self._seen.get(task)
        if seen is None:
            if len(self._seen) >= 4096:  # bounded: a client inventing classes cannot grow it forever
                return
            seen = self._seen[task] = deque(maxlen=self.MEMORY)
        seen.append(int(output_tokens))
        self._cache.pop(task, None)

    def samples(self, task: str) -> int:
        seen = self._seen.get(task)
        return 0 if seen is None else len(seen)

    def _figures(self, task: str) -> tuple[float, float] | None:
        """(mean, 90th percentile) of ``task``'s recent outputs (``None``: fewer than :attr:`MIN_SAMPLES`)."""
        cached = self._cache.get(task)
        if cached is not None:
            return cached
        seen = self._seen.get(task)
        if seen is None or len(seen) < self.MIN_SAMPLES:
            return None
        figures = _mean_p90(seen)
        self._cache[task] = figures
        return figures

    def _answers(self, task: str) -> Sequence[int]:
        seen = self._seen.get(task)
        return () if seen is None else seen

    @staticmethod
    def _hint(request: ScheduleInput) -> int:
        """``request``'s expected output length when it knows something of its own class (0: none, a
        prior, or an estimate pooled over every class).

        A length flagged ``output_tokens_prior`` is the router's length predictor saying it has
        learned nothing yet (``max_tokens`` or a default): it must not override what this profile
        has learned, or a class the predictor has too few answers of is costed at ``max_tokens``.
        One flagged ``output_tokens_pooled`` was learned from every class's answers together (the
        predictor wants eight of a class before it answers for it): it stands in for the class only
        where this profile knows too little of it (see :meth:`_blend`).
        """
        if request.output_tokens_prior or request.output_tokens_pooled:
            return 0
        return request.expected_output_tokens

    def _blend(self, task: str, prior: float) -> float:
        """``prior`` shrunk toward the few answers of ``task`` seen so far: with ``k`` below
        :attr:`MIN_SAMPLES`, the prior counts as ``MIN_SAMPLES - k`` answers beside them.

        Why: a task type whose requests a plan put last, behind a prior as long as ``max_tokens``,
        is refused unfinished by the late path and so never reaches :attr:`MIN_SAMPLES`; its
        prior then stands for good. Three short search answers (101, 37, 44 tokens of a 500 cap),
        costed at the cap, held their batch 9 s in the plan, so every later burst ran its 9 s e-mail
        drafts first and refused the searches (TTFT 500 ms) at their deadline.
        """
        seen = self._answers(task)
        k = len(seen)
        if not k:
            return prior
        return (sum(seen) + (self.MIN_SAMPLES - k) * prior) / self.MIN_SAMPLES

    def _own(self, request: ScheduleInput) -> Sequence[int]:
        """The few answers of ``request``'s type that stand for it instead of the pooled estimate (empty:
        none, or ``request`` carries no pooled estimate).

        Why not shrink the pooled estimate toward them as the cap is (:meth:`_blend`): it is every
        class's mean, not a bound on this one, and a class whose answers differ from the rest stays
        priced far from them while its requests are refused unfinished. Lookups (answers of 17-103
        tokens, a 400 cap) beside 220-token compositions and 350-token digests had three answers by
        the fifth burst of `sa-lookup-compose-digest` on 2 x 2 sequences: the shrunk typical length
        was 116 tokens and the bound 177, so a lookup's run looked as long as a composition's and the
        plan ran compositions first, the lookups refused at their deadline before a fourth answer
        could correct it (docs/papers.md, seed 000, session 26).
        """
        if not request.output_tokens_pooled or request.output_tokens_prior:
            return ()
        return self._answers(request.slo_class)

    def unknown(self, request: ScheduleInput) -> bool:
        """Is ``request``'s length only its prior (no estimate, too few answers of its type)?"""
        if request.output_tokens_pooled and not request.output_tokens_prior:
            return False
        return not self._hint(request) and self._figures(request.slo_class) is None

    def typical(self, request: ScheduleInput) -> float:
        """The output length the latency predictor costs ``request`` with."""
        cap = request.max_tokens or math.inf
        hint = self._hint(request)
        if hint:
            return float(min(hint, cap))
        figures = self._figures(request.slo_class)
        own = self._own(request) if figures is None else ()
        if own:
            return max(min(sum(own) / len(own), cap), 1.0)
        if figures is None:
            pooled = request.expected_output_tokens if request.output_tokens_pooled else 0
            prior = float(
                pooled or request.max_tokens or request.expected_output_tokens or UNKNOWN_OUTPUT_TOKENS
            )
            return max(min(self._blend(request.slo_class, prior), cap), 1.0)
        return max(min(figures[0], cap), 1.0)

    def bound(self, request: ScheduleInput) -> float:
        """The output length Eq. 20 reserves memory for."""
        cap = request.max_tokens or math.inf
        figures = self._figures(request.slo_class)
        own = self._own(request) if figures is None else ()
        if own:  # (the longest answer seen stands for the quantile, as below without the cap's share)
            return max(min(float(max(own)), cap), 1.0)
        if figures is None:
            prior = float(request.max_tokens or request.expected_output_tokens or UNKNOWN_OUTPUT_TOKENS)
            seen = self._answers(request.slo_class)
            if seen:  # the longest answer seen stands for the quantile, the cap for the rest
                k = len(seen)
                prior = (k * max(seen) + (self.MIN_SAMPLES - k) * prior) / self.MIN_SAMPLES
            return max(min(prior, cap), 1.0)
        return max(min(max(figures[1], float(self._hint(request))), cap), 1.0)


def _mean_p90(values: Iterable[int]) -> tuple[float, float]:
    """(mean, 90th percentile by rank) of a non-empty sample of output lengths."""
    ordered = sorted(values)
    return sum(ordered) / len(ordered), float(ordered[int(0.9 * (len(ordered) - 1))])


def preassign(
    needs: Sequence[float],
    eligible: Sequence[Sequence[bool]],
    free: Sequence[float],
    capacity: Sequence[float],
    occupied: Sequence[int],
    slots: Sequence[int],
) -> list[int]:
    """Seed 000's instance pre-assignment (§4.4, Eq. 20): each request, in order, to the instance with the
    largest remaining memory; when no instance has room for it, the remaining memory is reset (a fresh
    iteration) and it goes to the largest again.

    ``needs[r]``: tokens request ``r`` will hold (prompt + output bound; Eq. 20's
    ``token_num`` with the memory already counted in tokens, so ``sigma`` = 1
    token per token and ``mu`` = 1: the engines report their KV in usable
    tokens). ``free[i]``: tokens instance ``i`` has left in the current
    iteration, ``capacity[i]`` in a fresh one. An iteration also holds at most
    ``slots[i]`` requests (the paper's maximum batch size: an instance whose
    batch is full "lacks sufficient space" as surely as one whose memory is),
    ``occupied[i]`` of them taken by its running requests. ``eligible[r][i]``:
    may ``r`` go to ``i`` at all. Returns an instance index per request (-1:
    none eligible). Ties go to the lower index.
    """
    m = len(free)
    rem = list(free)
    count = list(occupied)
    out: list[int] = []
    for need, ok in zip(needs, eligible, strict=True):
        best = -1
        for fresh in (False, True):
            if fresh:
                rem = list(capacity)
                count = [0] * m
            for i in range(m):
                if (
                    ok[i]
                    and count[i] < slots[i]
                    and (rem[i] >= need or fresh)
                    and (best < 0 or rem[i] > rem[best])
                ):
                    best = i
            if best >= 0:
                break
        if best >= 0:
            rem[best] -= need
            count[best] += 1
        out.append(best)
    return out


def jobs_for(
    requests: Sequence[ScheduleInput],
    predictor: LatencyPredictor,
    cap: int,
    now_s: float,
    enqueued_s: Sequence[float],
    default_ttft_ms: float,
    default_tpot_ms: float,
    max_num_batched_tokens: float,
    outputs: Sequence[float] | None = None,
    bounds: Sequence[float] | None = None,
    unknown: Sequence[bool] | None = None,
    refusals_s: Sequence[float] | None = None,
) -> list[Job]:
    """The annealer's view of ``requests`` on an instance predicted by ``predictor`` (see the module doc).

    Each request is costed for every batch size ``1..cap``: prefill of ``b``
    prompts of its length (its TTFT once its batch starts), decode steps of
    ``b`` requests of its lengths (its TPOT), prefill plus ``o - 1`` decode
    steps (its execution time; the prefill emits the first token), with ``o``
    its ``outputs`` entry (the typical length of its task type; default: its
    ``output_tokens_estimate``). The time it has already waited (since
    ``arrival_s``, else since it was queued) counts. ``unknown``: the requests whose
    lengths are only their prior; their own e2e target is judged on their prefill
    alone, not given up for their cap (see where it is applied). With ``bounds`` (the
    task type's length bound, §4), what the plan relies on is costed at the
    bound: how long its batch holds the instance (the wait it imposes on the
    batches after it) and whether it meets its own targets; its latency in
    G's sum stays at the typical length. A plan then only counts a request on
    time if it is on time when the requests ahead run long. ``refusals_s``: when
    the router queue will refuse each request if it is still waiting (its late
    allowance: :meth:`router.core.queue.RouterQueue.refusal_s`; inf: never).

    The join figures (:class:`Job`'s ``join_*``) price a request started on a
    slot freed under a running batch as the engine runs it: its prompt is
    prefilled alone, in one step beside its peers' decode (its TTFT: its
    prefill alone plus a decode step of a full engine, ``cap``), and it decodes
    at a full engine. Priced as a member of a full batch instead (``cap``
    copies of its prompt prefilled), a 1,691-token translation joining on two
    sequences was priced at the prefill of 3,382 tokens, so a plan that starts
    it on a freed slot saw it later than it runs (docs/papers.md, seed 000,
    sessions 26-27). With one slot a request joins no one: the same as a batch of 1.
    """
    n = len(requests)
    if n == 0:
        return []
    prompt = np.array([float(max(r.prompt_tokens, 1)) for r in requests])
    if outputs is None:
        outputs = [float(r.output_tokens_estimate or UNKNOWN_OUTPUT_TOKENS) for r in requests]
    output = np.asarray(outputs, dtype=np.float64)
    # Columns 0..cap-1: batches of 1..cap; column cap: a request joining a running batch of ``cap``.
    b = np.append(np.arange(1, cap + 1, dtype=np.float64), float(cap))
    batch = np.broadcast_to(b[None, :], (n, cap + 1))
    prefill = np.asarray(
        predictor.predict_ttft_ms(prompt[:, None] * batch, 0.0, 0.0, float(max_num_batched_tokens)),
        dtype=np.float64,
    ).copy()
    tpot = np.asarray(
        predictor.predict_tpot_ms(batch, batch * (prompt + output / 2.0)[:, None]), dtype=np.float64
    )
    prefill[:, cap] = prefill[:, 0] + (tpot[:, cap] if cap > 1 else 0.0)
    exec_ms = prefill + np.maximum(output - 1.0, 0.0)[:, None] * tpot
    typical_ms = exec_ms
    if bounds is not None:
        bound = np.maximum(np.asarray(bounds, dtype=np.float64), output)
        tpot = np.asarray(
            predictor.predict_tpot_ms(batch, batch * (prompt + bound / 2.0)[:, None]), dtype=np.float64
        )
        exec_ms = prefill + np.maximum(bound - 1.0, 0.0)[:, None] * tpot
    waited = np.empty(n)
    e2e = np.empty(n)
    e2e_only = np.empty(n, dtype=bool)
    ttft_target = np.empty(n)
    tpot_target = np.empty(n)
    for i, r in enumerate(requests):
        arrival = r.arrival_s if r.arrival_s is not None else enqueued_s[i]
        waited[i] = max(now_s - arrival, 0.0) * 1e3
        e2e[i] = r.e2e_slo_ms if r.e2e_slo_ms > 0 else math.inf
        e2e_only[i] = r.e2e_only
        if not e2e_only[i]:
            targets = resolve_targets(r, default_ttft_ms, default_tpot_ms)
            ttft_target[i], tpot_target[i] = targets.full_ttft_ms, targets.tpot_ms
        else:
            ttft_target[i], tpot_target[i] = math.inf, math.inf
    w = waited[:, None]
    by_e2e = e2e[:, None] - w - exec_ms
    if unknown is not None and any(unknown):
        # A request whose length is only its prior (its task type has no answers yet, no hint) is not
        # given up for its cap: §4's predictor costs a *typical* length, which is unknown here, and
        # max_tokens is a bound, not a typical answer. Its own e2e target is judged as if it answered
        # at once (its prefill), so a plan keeps trying to meet it; the time it holds its batch, and so
        # the waits of the requests behind it, stay priced at the cap. Without this, a burst that
        # arrives before any answer gave up every e2e request whose cap would overrun its target
        # (R/A: agents capped at 400 tokens, 6.8 s, due in 6 s) and ran the others first.
        short = e2e[:, None] - w - prefill
        by_e2e = np.where(np.asarray(unknown, dtype=bool)[:, None], short, by_e2e)
    by_ttft = np.where(tpot <= tpot_target[:, None], ttft_target[:, None] - w - prefill, -math.inf)
    # e2e-only requests: their e2e; the others: TTFT and TPOT, and their e2e if they have one too.
    slack = np.where(e2e_only[:, None], by_e2e, np.minimum(by_ttft, by_e2e))
    head = np.zeros((n, 1))
    exec_rows = np.hstack([head, exec_ms]).tolist()
    cost_rows = np.hstack([head, typical_ms + w]).tolist()
    slack_rows = np.hstack([np.full((n, 1), -math.inf), slack]).tolist()
    if refusals_s is None:
        return [
            Job(
                tuple(e[:-1]),
                tuple(c[:-1]),
                tuple(sl[:-1]),
                join_exec_ms=e[-1],
                join_cost_ms=c[-1],
                join_slack_ms=sl[-1],
            )
            for e, c, sl in zip(exec_rows, cost_rows, slack_rows, strict=True)
        ]
    # A request already lost (it misses its targets even started now, alone, at its typical length) that
    # the plan starts after the queue has refused it never runs: its latency in G's sum is its wait
    # until that refusal, and it holds no slot. Priced as served instead (its wait and execution, its
    # batch's duration), it was worth starting before a request that waits well within its target
    # (SPT), and the plan spent the engine on it (docs/papers.md, seed 000, session 21). A request
    # that can still meet its targets keeps its served price: its "lost" later in a plan is judged at
    # the length bound, which a pessimistic bound would turn into refusals of requests the engine meets.
    own = (
        np.where(np.asarray(unknown, dtype=bool), prefill[:, 0], typical_ms[:, 0])
        if unknown
        else typical_ms[:, 0]
    )
    lost = (e2e - waited - own < 0) | (~e2e_only & (ttft_target - waited - prefill[:, 0] < 0))
    refuse = [
        max(t - now_s, 0.0) * 1e3 if gone else math.inf for t, gone in zip(refusals_s, lost, strict=True)
    ]
    return [
        Job(
            tuple(e[:-1]),
            tuple(c[:-1]),
            tuple(sl[:-1]),
            rf,
            float(wt) + rf if math.isfinite(rf) else 0.0,
            e[-1],
            c[-1],
            sl[-1],
        )
        for e, c, sl, rf, wt in zip(exec_rows, cost_rows, slack_rows, refuse, waited, strict=True)
    ]


@dataclass
class _Released:
    """A request the policy released, until it ends: its task type, the tokens Eq. 20 reserved for it,
    and whether it is judged on its e2e latency alone."""

    task: str
    tokens: float
    e2e_only: bool = False


@dataclass
class PlannerStats:
    """What the ``sa`` policy did (for tests, the bench and the simulator's report)."""

    runs: int = 0
    early_exits: int = 0
    evaluations: int = 0
    #: Runs whose window left waiting requests of the instance out.
    windowed: int = 0
    #: Passes that handed out requests, and the requests handed out.
    batches_released: int = 0
    released: int = 0
    #: Seconds spent planning (costing and annealing; wall clock, or the modeled clock in the simulator).
    anneal_s: float = 0.0
    #: The longest single run (s), on the same clock: what the budget bounds.
    longest_run_s: float = 0.0
    last_plan: Plan | None = None


class SAPlanner:
    """The ``sa`` queue policy: Eq. 20 pre-assignment, a plan per instance, release into continuous batching.

    Driven by :func:`router.core.queue.offer` (the router's admission and the
    simulator alike). Each pass:

    1. **Pre-assignment** (:func:`preassign`, the paper's Eq. 20): the
       waiting requests (up to :data:`WINDOW` per eligible instance, oldest
       first) go to the instance with the largest remaining KV memory, a
       fresh iteration starting when none has room. It is redone on every
       pass over the requests waiting *now*, so a request that arrived a few
       milliseconds after a burst is planned with it (a sliding window, not
       only same-instant arrivals).
    2. **Priority mapping** (:func:`anneal`, Algorithm 1) of the requests
       assigned to an instance that has a free slot, over its oldest
       :data:`WINDOW`, the whole run (costing included) within
       ``--sa-budget-ms``.
    3. **Release into continuous batching**: the front of the plan goes to
       the instance as soon as it has a free slot (fewer of our requests
       running there than its slots: ``--sa-max-batch``, else the engine's
       batch where the fleet states it) and its remaining memory holds the
       request. The paper submits the planned order into vLLM, whose
       continuous batching starts a queued request whenever a sequence ends;
       a router cannot reorder an engine's queue, so it keeps the queue
       itself and hands a request over at the moment the engine would have
       started it. At most the plan's first batch goes at once: a batch the
       plan made smaller than the cap (to keep a TPOT target) stays small.
       Its requests judged on their first token go first
       (:func:`first_tokens_first`).
       On an engine wider than the plan's widest batch (:data:`PLAN_CAP_MAX`)
       a request its pre-assigned instance refuses may go to another instance
       with room (:meth:`_spill`).
    """

    def __init__(
        self,
        config: QueueConfig,
        *,
        seed: int = 0,
        clock: Callable[[], float] = time.perf_counter,
        modeled_evaluation_s: Callable[[int], float] | None = None,
        search: str = "anneal",
        slots: Callable[[str], int] | None = None,
    ) -> None:
        if search not in SEARCHES:
            raise ValueError(f"search must be one of {', '.join(SEARCHES)}, got {search!r}")
        #: ``exhaustive`` plans queues of up to :data:`EXHAUSTIVE_LIMIT` requests by exhaustive search
        #: (the reference of the simulated comparison), larger ones by annealing.
        self.search = search
        self.config = config
        self.cap = config.sa_max_batch
        self.pool_s = config.sa_pool_ms * 1e-3
        #: When the pool matures with no other event (inf: nothing pooled).
        self.wake_s = math.inf
        self.params = AnnealParams(
            config.sa_initial_temperature,
            config.sa_iterations,
            config.sa_decay,
            config.sa_min_temperature,
            config.sa_budget_ms * 1e-3,
        )
        self.rng = random.Random(seed)
        self._clock = clock
        # The simulator's clock for the budget: the modeled cost of one evaluation of n jobs
        # (deterministic, unlike the wall clock of a shared machine).
        self._modeled = modeled_evaluation_s
        #: The engine's batch per instance id where the caller knows it (the simulator's fleet).
        self._engine_slots = slots
        self.lengths = TaskLengths()
        #: Per instance: the requests released there and not ended yet.
        self.running: dict[str, dict[str, _Released]] = {}
        self._where: dict[str, str] = {}
        #: Per instance: the last plan (its request ids and free slots) and its order, reused while
        #: neither changed.
        self._plans: dict[str, tuple[tuple[tuple[str, ...], int], Plan]] = {}
        self.stats = PlannerStats()
        #: The newest arrival a pass has seen, and the arrival before it (pool_closes).
        self._newest_s = -math.inf
        self._before_s = -math.inf
        #: The scheduler's policy and that policy less its residents' TPOT check (:meth:`_waived`).
        self._waived_of: tuple[Policy, Policy] | None = None
        #: On a disaggregated fleet, each prefill instance's share of the decoders' slots, as of the
        #: last pass (:func:`decode_shares`); empty on a colocated fleet.
        self._shares: dict[str, int] = {}

    # ------------------------------------------------------------------ events

    def finished(self, request_id: str, output_tokens: int | None = None) -> None:
        """A request this policy released has ended (``output_tokens``: what it generated, if it completed)."""
        instance = self._where.pop(request_id, None)
        if instance is None:
            return
        running = self.running.get(instance)
        if running is None:
            return
        released = running.pop(request_id, None)
        if not running:
            del self.running[instance]
        if released is not None and output_tokens is not None:
            self.lengths.observe(released.task, output_tokens)

    def busy(self, instance_id: str) -> bool:
        """Has ``instance_id`` no free slot for the policy's next request?"""
        return len(self.running.get(instance_id, ())) >= self.slots(instance_id)

    def slots(self, instance_id: str, reported: float = math.inf) -> int:
        """Requests the policy keeps running on ``instance_id`` at once: ``--sa-max-batch``, else the
        engine's batch (``reported``: its ``max_num_seqs`` as the instance's metadata states it, or the
        simulator's fleet figure), the smaller of the two when both are known. A prefill instance of a
        disaggregated fleet has its share of the decoders' slots instead (:func:`decode_shares`)."""
        share = self._shares.get(instance_id)
        if share is not None:
            return share
        engine = self._engine_slots(instance_id) if self._engine_slots is not None else 0
        if not engine and math.isfinite(reported) and reported > 0:
            engine = int(reported)
        if self.cap and engine:
            return min(self.cap, engine)
        return self.cap or engine or UNBOUNDED_SLOTS

    # ------------------------------------------------------------------ a pass

    def offer(
        self,
        queue: RouterQueue,
        scheduler: Scheduler,
        source: Callable[[], ClusterView | ClusterSnapshot],
        now_s: float,
        schedule: Decide,
    ) -> Iterator[Offer]:
        """One pass (see the class doc); entries leave the queue here, as in :func:`router.core.queue.offer`."""
        self.wake_s = math.inf
        entries = list(queue.entries())
        if not entries:
            return
        # The request pool (Fig. 6: requests collect in a pool before the predictor and the mapper).
        oldest = min(e.enqueued_s for e in entries)
        newest = max(e.enqueued_s for e in entries)
        if newest > self._newest_s:  # new arrivals since the last pass: the one before the oldest new
            self._before_s = max(
                (e.enqueued_s for e in entries if e.enqueued_s < newest), default=self._newest_s
            )
            self._newest_s = newest
        matured = pool_closes(oldest, newest, self.pool_s)
        # A request arriving alone, a quiet pool time after the one before it, has no burst to wait
        # for yet: pooled, it only lost the pool time off its TTFT, which at a light steady load is all
        # the pool did (a 250 ms TTFT class at 0.5 req/s on 3 engines: 91.9 % against fcfs's 95.6 %).
        # It is planned at once while the fleet has a slot to spare besides the one it takes, so a burst
        # it begins still has one for its most urgent request once the plan sees it (with one slot in
        # all, the first arrival of a burst would hold it: G 0.0661 against 0.0747 pooled).
        # Only a request whose first token is judged is worth it: one judged end to end alone loses a
        # pool time of a budget of seconds by waiting, and taken at once as the first arrival of a
        # burst it held a slot the plan then lacked for the burst's urgent requests (12-request bursts
        # 3 ms apart on 2 x 2 sequences, code reviews due in 30 s: G 0.1639 against 0.1805 planned
        # whole, as the same bursts arriving together are).
        first = entries[0].request
        alone = (
            len(entries) == 1
            and oldest - self._before_s >= self.pool_s
            and not (first.e2e_slo_ms > 0 and not first.ttft_slo_ms and not first.tpot_slo_ms)
        )
        if now_s < matured and not alone:
            self.wake_s = matured
            return
        view = _as_view(scheduler, source(), now_s)
        inst = view.instances
        m = inst.n
        roles = inst.roles
        usable = [
            bool(inst.schedulable[i]) and int(roles[i]) in (Role.NEUTRAL, Role.PREFILL) for i in range(m)
        ]
        seqs = inst.max_num_seqs
        self._shares = {}
        slots = [
            self.slots(iid, math.inf if seqs is None else float(seqs[i])) for i, iid in enumerate(inst.ids)
        ]
        self._shares = decode_shares(inst.ids, roles, inst.schedulable, slots)
        slots = [self._shares.get(iid, slots[i]) for i, iid in enumerate(inst.ids)]
        occupied = [len(self.running.get(iid, ())) for iid in inst.ids]
        spare = sum(
            min(slots[i] - occupied[i], 2) for i, u in enumerate(usable) if u and occupied[i] < slots[i]
        )
        if not spare:
            return  # no instance can take anything now: nothing to plan
        if now_s < matured and spare < 2:  # (alone, but on the fleet's last free slot: pooled)
            self.wake_s = matured
            return
        window = entries[: WINDOW * max(sum(usable), 1)]
        # Eq. 20 deals the requests out in their priority order, not their arrival order (see deal_order).
        window = [window[k] for k in deal_order(window, now_s)]
        eligible: list[list[bool]] = []
        needs: list[float] = []
        for entry in window:
            r = entry.request
            mask = inst.model_mask(r.model)
            eligible.append(
                [usable[i] and bool(mask[i]) and inst.ids[i] not in r.exclude_instance_ids for i in range(m)]
            )
            needs.append(float(max(r.prompt_tokens, 1)) + self.lengths.bound(r))
        capacity = [float(inst.kv_capacity_tokens[i]) for i in range(m)]
        free = [self._free_tokens(inst, i) for i in range(m)]
        where = preassign(needs, eligible, free, capacity, occupied, slots)
        if len(window) == 1 and where[0] >= 0:
            # A lone request has nothing to be planned or dealt against: it goes where the scheduler
            # predicts it starts soonest among the instances with a free slot and room for it. Dealt
            # to the largest remaining memory (Eq. 20's rule, which spreads a burst's memory), it
            # landed behind another request's long prefill while an instance sat idle (a 250 ms TTFT
            # class at 1.5 req/s on 3 engines: 90.8 % against fcfs's 93.1, with no pool at all).
            need = needs[0]
            among = frozenset(
                inst.ids[j]
                for j in range(m)
                if eligible[0][j] and occupied[j] < slots[j] and (need <= free[j] or not occupied[j])
            )
            if among:
                yield from self._release(
                    queue, scheduler, source, now_s, schedule, view, where[0], window, 1, among=among
                )
                return
        groups: dict[int, list[QueueEntry]] = {}
        for entry, i in zip(window, where, strict=True):
            if i < 0:
                # No instance may take it: the scheduler says why (none fits now, or none at all).
                targets = resolve_targets(entry.request, queue.default_ttft_ms, queue.default_tpot_ms, now_s)
                try:
                    schedule(view, entry.request, now_s, targets=_relaxed(targets))
                except EmptyClusterError as exc:
                    queue.remove(entry.request_id)
                    yield Offer(entry, Verdict.REJECT, error=exc)
                    continue
                except NoInstanceError as exc:
                    yield Offer(entry, Verdict.WAIT, error=exc)
                    continue
                yield Offer(entry, Verdict.WAIT)
                continue
            groups.setdefault(i, []).append(entry)
        for i, group in groups.items():
            # An instance's plan starts from its requests in queue order (Algorithm 1's first start), as
            # they would be without the deal's order.
            group.sort(key=lambda e: e.seq)
            if occupied[i] >= slots[i]:
                continue
            yield from self._release(
                queue, scheduler, source, now_s, schedule, view, i, group, slots[i] - occupied[i]
            )

    def _free_tokens(self, inst: Any, i: int) -> float:
        """KV tokens instance ``i`` has left: its capacity less what it holds or we reserved there, if more."""
        reserved = sum(r.tokens for r in self.running.get(inst.ids[i], {}).values())
        return max(float(inst.kv_capacity_tokens[i]) - max(float(inst.used_kv_tokens[i]), reserved), 0.0)

    def _release(
        self,
        queue: RouterQueue,
        scheduler: Scheduler,
        source: Callable[[], ClusterView | ClusterSnapshot],
        now_s: float,
        schedule: Decide,
        view: ClusterView,
        i: int,
        group: list[QueueEntry],
        room: int,
        among: frozenset[str] = frozenset(),
    ) -> Iterator[Offer]:
        """Release ``group``'s planned first batch to instance ``i`` (``among``: one request, to whichever
        of these instances the scheduler picks)."""
        inst = view.instances
        instance = inst.ids[i]
        plan = self._plan(queue, scheduler, view, now_s, i, group, room)
        first = plan.sizes[0] if plan.sizes else 0
        role = inst.roles[i]
        # Only this instance among those of its role: the decode leg of a disaggregated request may go anywhere.
        others = frozenset(iid for j, iid in enumerate(inst.ids) if inst.roles[j] == role and iid != instance)
        if among:
            others = frozenset(
                iid
                for j, iid in enumerate(inst.ids)
                if inst.roles[j] in (Role.NEUTRAL, Role.PREFILL) and iid not in among
            )
        free = self._free_tokens(inst, i) if not among else math.inf  # (``among`` holds it: see offer)
        seqs = inst.max_num_seqs
        # An engine batch wider than the plan's widest batch (PLAN_CAP_MAX): a request its instance
        # refuses may go to another (_spill). On narrower engines, the paper's regime, it waits.
        wide = self.slots(instance, math.inf if seqs is None else float(seqs[i])) > PLAN_CAP_MAX
        released = 0
        # The plan's order is the priority sequence: the slots it frees go to its first requests that
        # the instance can take now. One it cannot (the memory of Eq. 20 spoken for, or the scheduler
        # refusing it: the residents' TPOT a larger engine batch would break) waits for a later pass,
        # and the next in the order takes the slot instead of waiting behind it.
        want = min(first, room)
        skipped = 0
        # On a wide engine the plan's first batch is not a batch the engine starts together (it is seldom
        # idle): handed out as planned (the mixed workload on 4 default engines, reordered: 81.7 -> 80.3 %).
        for k in plan.order if wide else first_tokens_first(plan.order, first, group):
            if released >= want or skipped >= SKIPPED_MAX:
                break
            entry = group[k]
            request = entry.request
            need = float(max(request.prompt_tokens, 1)) + self.lengths.bound(request)
            if need > free and self.running.get(instance):
                skipped += 1  # its memory is spoken for until a running request ends
                continue
            pinned = replace(request, exclude_instance_ids=request.exclude_instance_ids | others)
            targets = resolve_targets(request, queue.default_ttft_ms, queue.default_tpot_ms, now_s)
            at = instance
            # On an engine wider than the plan (PLAN_CAP_MAX) the scheduler holds the request's own
            # targets, as under fcfs and edf: the plan prices a batch's prefill on an idle engine, and
            # a wide engine is seldom idle (its prompts in prefill, its decode batch), so released
            # under relaxed targets a 1 s-TTFT prompt went behind 1-2 s of another's prefill (a
            # 48-prefix shared-prefix workload at 7 req/s on 4 default engines: 84.2 % met against
            # fcfs's 92.5; docs/papers.md, seed 000). On narrower engines, the paper's regime, the
            # plan's timing is the engine's and the scheduler checks only what the plan cannot see.
            bound = targets if wide else _relaxed(targets)
            try:
                if not among and self._e2e_residents(instance):
                    decision = schedule(
                        source(), pinned, now_s, targets=bound, policy=self._waived(scheduler)
                    )
                else:
                    decision = schedule(source(), pinned, now_s, targets=bound)
            except NoInstanceError as exc:
                spilled = (
                    self._spill(request, inst, instance, source, now_s, schedule, targets) if wide else None
                )
                if spilled is None:
                    # The instance cannot take it now (its residents' TPOT, ejected, full): planned again
                    # on the next pass.
                    yield Offer(entry, Verdict.WAIT, error=exc, budget_ms=targets.ttft_ms)
                    skipped += 1
                    continue
                decision, at = spilled
            except EmptyClusterError as exc:
                queue.remove(entry.request_id)
                yield Offer(entry, Verdict.REJECT, error=exc)
                continue
            queue.remove(entry.request_id)
            if at == instance:
                free -= need
            if among and decision.prefill is not None:
                instance = at = decision.prefill.instance_id
            self.running.setdefault(at, {})[entry.request_id] = _Released(
                request.slo_class, need, request.e2e_only
            )
            self._where[entry.request_id] = at
            released += 1
            yield Offer(entry, Verdict.DISPATCH, decision=decision, budget_ms=targets.ttft_ms)
        if released:
            self.stats.batches_released += 1
            self.stats.released += released
            self._plans.pop(instance, None)

    def _e2e_residents(self, instance: str) -> bool:
        """Whether every request the policy runs on ``instance`` (one at least) is judged on e2e alone.

        The scheduler holds an instance's residents to the default TPOT target
        (``tpot_residents``: a status does not carry their own targets), so it
        refused a translation the plan started on a freed slot beside a triage
        due end to end in seconds, whose pace no target bounds, for 300 ms, and
        the translation missed (docs/papers.md, seed 000, session 26). The
        policy knows its residents' targets, and the plan priced their ends with
        the newcomer beside them (:func:`jobs_for`), so there it waives the check.
        """
        running = self.running.get(instance)
        return running is not None and len(running) > 0 and all(r.e2e_only for r in running.values())

    def _waived(self, scheduler: Scheduler) -> Policy:
        """The scheduler's policy less its residents' TPOT check (see :meth:`_e2e_residents`)."""
        policy = scheduler.policy
        if self._waived_of is None or self._waived_of[0] is not policy:
            self._waived_of = (policy, policy.without(RESIDENTS_TPOT_LABEL))
        return self._waived_of[1]

    def _spill(
        self,
        request: ScheduleInput,
        inst: Any,
        instance: str,
        source: Callable[[], ClusterView | ClusterSnapshot],
        now_s: float,
        schedule: Decide,
        targets: Targets,
    ) -> tuple[Any, str] | None:
        """Another instance of the fleet for a request its pre-assigned ``instance`` refuses now, on a
        large-batch engine: (the decision, where it goes), or None when none takes it either.

        Eq. 20 deals the requests out by remaining memory, the resource that bounds a batch on the
        paper's engines; on an engine of hundreds of sequences memory seldom binds (free KV stayed over
        5,000 tokens on every planning run of `mixed` at 12 req/s) and what refuses a request is the
        scheduler's check on the residents' TPOT, which the deal cannot see. A chat dealt to an
        instance whose residents are at their TPOT waited in the router while another instance had
        room for it (2,764 of 4,162 chat refusals there). So the request the plan releases now goes where
        the scheduler finds room among the instances with a free slot: the plan's decision (this
        request starts now) is kept, only the deal's instance is not.
        """
        closed = frozenset(
            iid
            for j, iid in enumerate(inst.ids)
            if iid == instance or int(inst.roles[j]) not in (Role.NEUTRAL, Role.PREFILL) or self.busy(iid)
        )
        if len(closed) >= len(inst.ids):
            return None
        elsewhere = replace(request, exclude_instance_ids=request.exclude_instance_ids | closed)
        try:
            decision = schedule(source(), elsewhere, now_s, targets=targets)
        except (NoInstanceError, EmptyClusterError):
            return None
        at = decision.prefill.instance_id if decision.prefill is not None else instance
        return decision, at

    def _plan(
        self,
        queue: RouterQueue,
        scheduler: Scheduler,
        view: ClusterView,
        now_s: float,
        i: int,
        group: list[QueueEntry],
        room: int,
    ) -> Plan:
        instance = view.instances.ids[i]
        key = (tuple(e.request_id for e in group), room)
        cached = self._plans.get(instance)
        if cached is not None and cached[0] == key:
            return cached[1]
        seqs = view.instances.max_num_seqs
        reported = math.inf if seqs is None else float(seqs[i])
        # Planned for the slots free now: the plan's first batch is what starts at once, and a batch of
        # the engine's full width, with fewer slots free, started only whichever member the order
        # listed first (a search due in 1 s beside an e-mail draft due in 20 s on a two-sequence
        # engine with one slot taken: the draft, and the search missed). Later batches are sized
        # alike, a cautious reading of when the running requests end.
        cap = max(min(self.slots(instance, reported), PLAN_CAP_MAX, len(group), room), 1)
        predictors = scheduler.predictors
        if predictors is None:
            # No latency predictor: nothing to anneal with; queue order in full batches.
            plan = Plan(tuple(range(len(group))), full_batches(len(group), cap), 0.0, 0, 0.0)
        else:
            clock = self._clock if self._modeled is None else modeled_clock(self._modeled(len(group)))
            started = time.perf_counter()
            predictor = predictors.for_group(view.instances.groups[i])
            requests = [e.request for e in group]
            jobs = jobs_for(
                requests,
                predictor,
                cap,
                now_s,
                [e.enqueued_s for e in group],
                queue.default_ttft_ms,
                queue.default_tpot_ms,
                float(view.instances.max_num_batched_tokens[i]),
                [self.lengths.typical(r) for r in requests],
                [self.lengths.bound(r) for r in requests],
                [self.lengths.unknown(r) for r in requests],
                [queue.refusal_s(e) for e in group],
            )
            # The budget covers the costing too (modeled in the simulator).
            spent = time.perf_counter() - started if self._modeled is None else modeled_costing_s(len(jobs))
            plan = self._anneal(jobs, cap, spent, clock)
        self._plans[instance] = (key, plan)
        return plan

    def _anneal(self, jobs: list[Job], cap: int, spent_s: float, clock: Callable[[], float]) -> Plan:
        started = clock()
        if self.search == "exhaustive" and len(jobs) <= EXHAUSTIVE_LIMIT:
            plan = exhaustive(jobs, cap)
        else:
            plan = anneal(jobs, cap, self.params, self.rng, clock=clock, spent_s=spent_s)
        took = clock() - started + spent_s
        self.stats.anneal_s += took
        self.stats.longest_run_s = max(self.stats.longest_run_s, took)
        self.stats.runs += 1
        self.stats.early_exits += plan.early_exit
        self.stats.evaluations += plan.evaluations
        self.stats.last_plan = plan
        return plan


def decode_shares(
    ids: Sequence[str], roles: Iterable[Any], schedulable: Iterable[Any], slots: Sequence[int]
) -> dict[str, int]:
    """Each prefill instance's share of the decoders' slots on a disaggregated fleet (empty otherwise).

    A request the policy releases holds its slot until it ends (:meth:`SAPlanner.finished`), and
    on a disaggregated fleet it spends nearly all of that time on a decoder: the prefill engine hands
    it over after its prompt. Counted against the prefill engine's own batch, the fleet ran at most
    that many requests while its decoders had room for more (one prefill and two decode engines of
    two sequences each: two requests at a time on four decode slots, 28.3 % met against fcfs's 54.3;
    docs/papers.md, seed 000). So the decoders' slots (``slots``, per instance, already
    bounded by ``--sa-max-batch``) are dealt out over the prefill instances, the remainder to the
    first ones, one at least each.
    """
    prefill = [
        iid for iid, r, ok in zip(ids, roles, schedulable, strict=True) if ok and int(r) == Role.PREFILL
    ]
    decode = sum(
        n for r, ok, n in zip(roles, schedulable, slots, strict=True) if ok and int(r) == Role.DECODE
    )
    if not prefill or not decode:
        return {}
    base, extra = divmod(min(decode, UNBOUNDED_SLOTS), len(prefill))
    return {iid: max(base + (k < extra), 1) for k, iid in enumerate(prefill)}


def pool_closes(oldest_s: float, newest_s: float, pool_s: float) -> float:
    """When the request pool (Fig. 6) is planned: once no request has joined it for ``pool_s``, and at the
    latest :data:`POOL_MAX_FACTOR` x ``pool_s`` after its oldest request arrived.

    The paper collects requests in a pool before the predictor and the mapper
    but leaves open when the pool is handed over (its experiments send every
    request of a burst at once). A pool closed a fixed ``pool_s`` after its
    oldest request cuts a burst whose requests arrive a few milliseconds apart:
    the first arrivals fill every free slot in arrival order before the plan
    has seen the rest (40 requests 5 ms apart on 4 two-sequence engines, a
    25 ms pool: G 0.0729 against 0.0841 with the same burst arriving at once).
    Closing once arrivals pause for ``pool_s`` plans such a burst as one; a
    lone request still waits ``pool_s``, and the cap bounds what a steady run
    of close arrivals adds to a request's TTFT. A backlog (its oldest request
    waiting past the cap) is planned at once (and a request arriving alone on
    a fleet with slots to spare: :meth:`SAPlanner.offer`).
    """
    return min(newest_s + pool_s, oldest_s + POOL_MAX_FACTOR * pool_s)


def deal_order(entries: Sequence[QueueEntry], now_s: float) -> list[int]:
    """The order in which pre-assignment (Eq. 20) deals ``entries`` out: deadline first, lapsed deadlines last.

    Algorithm 2 predicts every request's latency, then deals the requests
    round-robin to the instance with the most memory left; the paper does not
    fix the order of the deal. Here it is the requests' deadline (the queue's
    own: the TTFT deadline, or the completion deadline of a request judged on
    e2e alone), earliest first, and a request whose deadline has passed goes
    last. Why not arrival order (the earlier build): on a pass where one
    instance has a free slot and the others are full, the first request dealt
    is the only one that instance's plan can start now, and the rest are
    dealt alternately across the instances, so in arrival order a TTFT-judged
    request of a burst could wait on a busy instance while the free slot took
    a ticket due in 25 s; its plan never saw the urgent request. Dealt by
    deadline, the free slot's plan holds the most urgent requests, and the
    urgent requests of a burst are spread over the instances instead of
    wherever arrival order put them (2-sequence engines, 10-request bursts:
    G 0.1554 -> 0.1610 and 0.1155 -> 0.1166 on two workloads, docs/papers.md).
    Ties: queue order.
    """
    return sorted(
        range(len(entries)), key=lambda k: (entries[k].deadline_s < now_s, entries[k].deadline_s, k)
    )


def first_tokens_first(order: Sequence[int], first: int, group: Sequence[QueueEntry]) -> list[int]:
    """``order`` with its first ``first`` requests handed out those judged on their first token first
    (earliest deadline first), then those judged end to end alone, each set in the plan's order.

    The plan prices a first batch as if its members started together and leaves the order inside it
    open (Eq. 14's batch shares its prefill); an engine starts its step at the first request that
    reaches it idle, and one arriving a moment later waits for that step. Handed out in the plan's
    order (the latency order puts a 40-token OCR answer before a 120-token answer), a 300 ms-TTFT
    question of 244 tokens reached a two-sequence engine behind an OCR of 1,754 prompt tokens and got
    its first token after the OCR's prefill (318-386 ms; docs/papers.md, seed 000).
    Which member goes first costs an end-to-end target one short prefill at most.
    """
    head = sorted(
        range(min(first, len(order))),
        key=lambda p: (
            group[order[p]].request.e2e_only,
            0.0 if group[order[p]].request.e2e_only else group[order[p]].deadline_s,
            p,
        ),
    )
    return [order[p] for p in head] + list(order[first:])


def _relaxed(targets: Targets) -> Targets:
    return replace(targets, ttft_ms=_RELAXED_MS, tpot_ms=_RELAXED_MS)


def _as_view(scheduler: Scheduler, source: ClusterView | ClusterSnapshot, now_s: float) -> ClusterView:
    return source if isinstance(source, ClusterView) else scheduler.view(source, now_s)


def modeled_clock(evaluation_s: float) -> Callable[[], float]:
    """A clock for :func:`anneal` that counts moves instead of reading the time (deterministic).

    anneal reads its clock at the start and then every :data:`BUDGET_CHECK_MOVES`
    moves; each reading advances this one by that many evaluations of ``evaluation_s``.
    """
    ticks = [0.0]

    def clock() -> float:
        now = ticks[0]
        ticks[0] += evaluation_s * BUDGET_CHECK_MOVES
        return now

    return clock


def modeled_costing_s(n: int) -> float:
    """The simulator's stand-in for the time :func:`jobs_for` takes for ``n`` requests (s; measured as below)."""
    return 0.25e-3 + 3e-6 * n


def modeled_evaluation_s(n: int) -> float:
    """The simulator's stand-in for the wall clock: the cost of evaluating one solution of ``n`` jobs (s).

    Measured on the development machine (thread CPU time of whole annealing
    runs, polish included): about 1 µs per move plus 0.25 µs per job.
    """
    return 1.0e-6 + 0.25e-6 * n
