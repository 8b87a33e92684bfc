"""The chain that runs a policy: mode, candidates per stage, filters with fallback passes, selector.

For one request (:func:`run`):

1. Candidates are the view's instances serving the request's model. None →
   :class:`EmptyClusterError` (so is "none usable": no fresh, schedulable
   status at all, found when a stage comes up empty).
2. The policy's hooks run (adaptive PD elects its reserves).
3. Mode: PD when the candidates hold a prefill-role and a decode-role instance
   (prefill stage on the former, decode stage on the latter) or when the
   policy is role-agnostic (both stages on every candidate); otherwise neutral
   (one stage on the neutral-role instances). The request may restrict the PD
   stages (decode-only re-placement).
4. Each stage (:func:`run_stage`, the definition; :mod:`router.core.fused`
   decides the common case in one pass with the same result): the request's exclusions, then the
   single-instance filters in order (every one runs: their failover marks
   matter), then the global filters with the union of the marks. Pass 0
   applies them all; if nothing survives, fallback pass ``k`` (for each
   distinct ``relax_pass`` in increasing order) drops the filters with
   ``1 <= relax_pass <= k``. The selector picks among the first non-empty
   pass's survivors.
5. A stage with no survivor fails the whole decision (PD is all or nothing):
   :class:`EmptyClusterError` if the stage had no usable candidate at all,
   else :class:`NoInstanceError` with per-filter drop counts and, per
   threshold, the best value against its limit.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from router.core import fused
from router.core.columns import BoolArray, InstanceTable, IntArray
from router.core.decision import Choice, Decision, StageOutcome
from router.core.errors import EmptyClusterError, NoInstanceError, ThresholdMiss
from router.core.plugins import DecisionContext, Policy, StageSpec
from router.core.request import Mode, Role, Stage, StageRestriction

EXCLUDED = "excluded"

#: Decide stages with :func:`router.core.fused.try_stage` where it applies (False: the composed
#: chain alone; the tests compare the two).
FUSED = True


class StageFailure(NamedTuple):
    """A stage that kept no candidate, as the chain left it: carried by its :class:`NoInstanceError`.

    Why: a refused request waits in the router queue, which must learn, while the refusal still
    holds, whether its TTFT target went out of reach, exactly as a new decision would report it
    (the best predicted TTFT over ``eligible``: the candidates only threshold filters dropped). The
    router queue keeps it for that (``router.core.queue.TpotHold``).
    """

    spec: StageSpec
    outcome: StageOutcome
    ctx: DecisionContext
    #: The view indices of the candidates that only threshold filters dropped (read-only).
    eligible: IntArray


class _Plan(NamedTuple):
    mode: Mode
    prefill: BoolArray
    decode: BoolArray
    neutral: BoolArray
    instances: int  # instances serving the model


#: Plans by (models, roles) objects: a new snapshot whose instances kept their metadata shares its
#: layout's ``models`` tuple and ``roles`` array (router.core.view), hence its plans. The objects are
#: kept in the entry (their ids stay theirs while it lives); bounded by :data:`_PLANS_KEPT`.
_PLANS: dict[tuple[int, int, str, bool], tuple[tuple[str, ...], npt.NDArray[np.int8], _Plan]] = {}
_PLANS_KEPT = 64


def _plan(policy: Policy, table: InstanceTable, model: str) -> _Plan:
    """Mode and the candidate masks per stage for ``model``; cached per snapshot and per layout."""
    key = ("plan", model, policy.role_agnostic)
    plan: _Plan | None = table.memo.get(key)
    if plan is not None:
        return plan
    shared = (id(table.models), id(table.roles), model, policy.role_agnostic)
    found = _PLANS.get(shared)
    if found is not None and found[0] is table.models and found[1] is table.roles:
        plan = found[2]
    else:
        base = table.model_mask(model)
        count = int(np.count_nonzero(base))
        none = np.zeros(table.n, dtype=bool)
        if policy.role_agnostic:
            plan = _Plan(Mode.PD, base, base, none, count)
        else:
            prefill = base & (table.roles == Role.PREFILL)
            decode = base & (table.roles == Role.DECODE)
            if np.count_nonzero(prefill) and np.count_nonzero(decode):
                plan = _Plan(Mode.PD, prefill, decode, none, count)
            else:
                plan = _Plan(Mode.NEUTRAL, none, none, base & (table.roles == Role.NEUTRAL), count)
        for mask in (plan.prefill, plan.decode, plan.neutral):
            mask.setflags(write=False)  # shared by every decision on this snapshot (and layout)
        if len(_PLANS) >= _PLANS_KEPT:
            _PLANS.clear()
        _PLANS[shared] = (table.models, table.roles, plan)
    table.memo[key] = plan
    return plan


def _describe_unusable(ctx: DecisionContext, base: BoolArray, what: str) -> str:
    table = ctx.view.instances
    total = int(np.count_nonzero(base))
    no_status = int(np.count_nonzero(base & ~table.has_status))
    unschedulable = int(np.count_nonzero(base & table.has_status & ~table.schedulable))
    stale = int(np.count_nonzero(base & table.schedulable & ~ctx.fresh()))
    return (
        f"no usable {what}: {total} instance(s), {no_status} without a status yet, {unschedulable} unschedulable, "
        f"{stale} with a status older than {ctx.max_status_age_s:g} s; check that the workers are up and "
        f"reporting to the CMS"
    )


def run(policy: Policy, ctx: DecisionContext, now_s: float) -> Decision:
    """Place ``ctx.request`` with ``policy`` (see the module doc); raises a :class:`SchedulingError`."""
    request = ctx.request
    if request is None:
        raise ValueError("a decision needs a request")
    table = ctx.view.instances
    plan = _plan(policy, table, request.model)
    if not plan.instances:
        what = f"instance serves model {request.model!r}" if request.model and table.n else "instance"
        raise EmptyClusterError(f"no {what} in the cluster view; register workers with the CMS", instances=0)
    for hook in policy.hooks:
        hook.prepare(ctx)
    stages: tuple[tuple[Stage, BoolArray], ...]
    if plan.mode is Mode.NEUTRAL:
        stages = ((Stage.NEUTRAL, plan.neutral),)
    elif request.stages is StageRestriction.PREFILL:
        stages = ((Stage.PREFILL, plan.prefill),)
    elif request.stages is StageRestriction.DECODE:
        stages = ((Stage.DECODE, plan.decode),)
    else:
        stages = ((Stage.PREFILL, plan.prefill), (Stage.DECODE, plan.decode))

    outcomes = []
    for stage, candidates in stages:
        spec = policy.spec(stage)
        # The fused pass decides a stage whose first pass keeps a candidate; the composed chain
        # (its definition) decides the rest and explains failures.
        outcome = fused.try_stage(ctx, spec, stage, candidates, _evaluate) if FUSED else None
        if outcome is None:
            outcome = run_stage(ctx, spec, stage, candidates)
        outcomes.append(outcome)
        if outcome.selected < 0:
            raise _failure(ctx, spec, outcome, candidates, plan)
    # Built once every stage is decided, so both predictions are usually cached by then.
    choices = {outcome.stage: _choice(ctx, outcome) for outcome in outcomes}
    prefill: Choice | None
    decode: Choice | None
    if plan.mode is Mode.NEUTRAL:
        prefill = decode = choices[Stage.NEUTRAL]
    else:
        prefill, decode = choices.get(Stage.PREFILL), choices.get(Stage.DECODE)
    return Decision(request.request_id, plan.mode, policy.name, prefill, decode, now_s, tuple(outcomes), ctx)


#: The TPOT a stage's choice reports: a decode leg that finds its engine at its sequence cap waits for
#: a slot before its second token, and the mean TPOT its client measures carries that wait
#: (``predicted_tpot`` itself wherever a slot is free or no engine states a cap).
_REPORTED_TPOT = {
    Stage.DECODE: "predicted_tpot_after_slot_wait",
    Stage.PREFILL: "predicted_tpot",
    Stage.NEUTRAL: "predicted_tpot",
}


def _choice(ctx: DecisionContext, outcome: StageOutcome) -> Choice:
    i = outcome.selected
    table = ctx.view.instances
    return Choice(
        table.ids[i],
        table.endpoints[i],
        outcome.stage,
        ctx.metric_at("predicted_ttft", i),
        ctx.metric_at(_REPORTED_TPOT[outcome.stage], i),
        outcome.fallback_pass,
    )


def _evaluate(
    ctx: DecisionContext, spec: StageSpec, candidates: BoolArray
) -> tuple[tuple[str, ...], list[BoolArray], tuple[int, ...]]:
    """Every filter's label, keep-mask over the view and relax pass, in chain order.

    Once the candidates that pass every filter applied so far in all passes
    (relax pass 0) are none, no pass can keep one: the stage fails whatever
    the later filters say. A later filter that marks nothing for failover
    (``StageSpec.markless``) is then not applied; its keep-mask is all true,
    so it drops no candidate first (each was dropped by an earlier one) and
    the failure reads the same. A decision that leaves a queued request
    waiting mostly fails on its TTFT, before the TPOT, residents and KV
    thresholds, which no longer compute their predictions for it.
    """
    keeps: list[BoolArray] = []
    labels, relax = spec.labels, spec.relax
    request = ctx.request
    table = ctx.view.instances
    alive: BoolArray | None = candidates  # None: nothing survives every pass
    if request is not None and request.exclude_instance_ids:
        keep = np.ones(table.n, dtype=bool)
        for instance_id in request.exclude_instance_ids:
            i = table.index.get(instance_id)
            if i is not None:
                keep[i] = False
        keeps.append(keep)
        alive = alive & keep
        labels, relax = (EXCLUDED, *labels), (0, *relax)
    no_marks = table.all_false()
    marked = no_marks
    everywhere = table.all_true()
    # The relax-pass-0 keeps not yet folded into ``alive``: it is only read before a markless
    # filter, so a chain without one (e.g. load-balance) never computes it.
    unfolded: list[BoolArray] = []
    for f, markless, r in zip(spec.filters, spec.markless, spec.relax, strict=False):
        if markless:
            if alive is not None:
                for keep in unfolded:
                    alive = alive & keep
                unfolded.clear()
            if alive is None or not np.count_nonzero(alive):  # (ndarray.any costs ~10x more)
                alive = None
                keeps.append(everywhere)
                continue
        keep, mark = f.apply(ctx)
        keeps.append(keep)
        if mark is not None and mark is not no_marks:
            marked = mark if marked is no_marks else marked | mark
        if r == 0 and alive is not None:
            unfolded.append(keep)
    for g in spec.global_filters:
        keeps.append(g.apply_global(ctx, marked))
    return labels, keeps, relax


def run_stage(ctx: DecisionContext, spec: StageSpec, stage: Stage, candidates: BoolArray) -> StageOutcome:
    """Filter ``candidates`` (a mask over the view) through ``spec`` and select; see the module doc."""
    labels, keeps, relax = _evaluate(ctx, spec, candidates)
    table = ctx.view.instances
    everywhere = table.all_true()
    fixed = []
    relaxed = []
    for keep, r in zip(keeps, relax, strict=True):
        if r:
            relaxed.append((r, keep))
        elif keep is not everywhere:  # (e.g. failover with nothing marked keeps everything)
            fixed.append(keep)
    # The masks that always apply are mostly the snapshot's own (candidates, health, failover):
    # the same read-only array objects decision after decision, so their product is kept with the
    # snapshot's columns (a read-only array cannot change: the same objects, the same values).
    # (The masks are compared by id: the memo holds them, so no other live array has their ids.)
    key = ("always", stage)
    ids = tuple(map(id, fixed))
    found: tuple[BoolArray, tuple[int, ...], list[BoolArray], BoolArray, IntArray] | None = table.memo.get(
        key
    )
    if found is not None and found[0] is candidates and found[1] == ids:
        always, nonzero = found[3], found[4]
    else:
        always = candidates
        for keep in fixed:
            always = always & keep
        nonzero = always.nonzero()[0]
        if not candidates.flags.writeable and not any([keep.flags.writeable for keep in fixed]):
            always.setflags(write=False)
            nonzero.setflags(write=False)
            table.memo[key] = (candidates, ids, fixed, always, nonzero)
    selected = -1
    fallback_pass = 0
    survivors = nonzero if not relaxed else _apply_relaxable(always, relaxed, 0, everywhere)
    if len(survivors) == 0 and relaxed:
        for fallback_pass in sorted({r for r, _ in relaxed}):
            survivors = _apply_relaxable(always, relaxed, fallback_pass, everywhere)
            if len(survivors):
                break
    if len(survivors):
        selected = spec.selector.select(ctx, survivors, fallback_pass)
    return StageOutcome._make((stage, candidates, labels, tuple(keeps), relax, selected, fallback_pass))


def _apply_relaxable(
    always: BoolArray, relaxed: list[tuple[int, BoolArray]], fallback_pass: int, everywhere: BoolArray
) -> IntArray:
    alive = always
    for r, keep in relaxed:
        if r > fallback_pass and keep is not everywhere:
            alive = alive & keep
    return alive.nonzero()[0]


def _failure(
    ctx: DecisionContext, spec: StageSpec, outcome: StageOutcome, candidates: BoolArray, plan: _Plan
) -> Exception:
    stage = outcome.stage.value
    n = len(outcome.candidates)
    table = ctx.view.instances
    base = table.model_mask(ctx.request.model if ctx.request is not None else "")
    if not np.count_nonzero(base & ctx.usable()):
        return EmptyClusterError(_describe_unusable(ctx, base, "instance"), instances=plan.instances)
    if plan.mode is Mode.NEUTRAL and not np.count_nonzero(candidates):
        prefills = int(np.count_nonzero(base & (table.roles == Role.PREFILL)))
        decodes = int(np.count_nonzero(base & (table.roles == Role.DECODE)))
        return EmptyClusterError(
            f"cannot serve: no neutral instance and no prefill+decode pair ({prefills} prefill, "
            f"{decodes} decode instance(s)); start the missing role",
            instances=plan.instances,
        )
    if not np.count_nonzero(candidates & ctx.usable()):
        return EmptyClusterError(
            _describe_unusable(ctx, candidates, f"{stage} instance"), instances=n, usable=0
        )
    # Candidates that only thresholds stopped: what the policy could have used with a looser target.
    thresholds = spec.explainers
    threshold_labels = {f.label for f in thresholds}
    eligible = candidates.copy()
    for label, keep in zip(outcome.labels, outcome.keeps, strict=True):
        if label not in threshold_labels:
            eligible &= keep
    eligible_index = eligible.nonzero()[0]

    def miss(k: int) -> ThresholdMiss:
        f = thresholds[k]
        return ThresholdMiss(f.label, *f.explain_miss(ctx, eligible_index))

    request_id = ctx.request.request_id if ctx.request else ""

    # The drop counts and the text are built when read: a decision that leaves a queued request
    # waiting reads only the misses (see NoInstanceError).
    def drops() -> dict[str, int]:
        first = outcome.first_drop(every_filter=True)
        counts = {label: int(np.count_nonzero(first == k)) for k, label in enumerate(outcome.labels)}
        return {label: count for label, count in counts.items() if count}

    def message() -> str:
        parts = [f"no {stage} instance for request {request_id!r}: {n} candidate(s)"]
        dropped = error.drops
        misses = error.misses
        if dropped:
            parts.append(
                "dropped first by " + ", ".join(f"{label} {count}" for label, count in dropped.items())
            )
        for miss in misses:
            if miss.best == miss.best:
                parts.append(f"best {miss.metric} {miss.best:.1f} vs limit {miss.limit:.1f}")
        if len(eligible_index) and thresholds:
            parts.append(
                "no instance is predicted to meet the target: relax the request's SLO or the dispatch "
                "thresholds, add capacity, or retry later"
            )
        else:
            parts.append(
                "every candidate is excluded, unhealthy or in a failed failure domain; check the fleet"
            )
        return "; ".join(parts)

    error = NoInstanceError(
        message,
        stage=stage,
        candidates=n,
        drops=drops,
        healthy_candidates=len(eligible_index),
        lazy_misses=(len(thresholds), miss),
        failure=StageFailure(spec, outcome, ctx, eligible_index),
    )
    return error
