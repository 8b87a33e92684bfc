"""What a decision produces: a :class:`Choice` per stage, the per-stage outcomes and the lazy trace.

A :class:`Decision` keeps its :class:`~router.core.plugins.DecisionContext` so
the per-candidate trace (``Schedule``'s explanation) is built only when asked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from router.core.columns import BoolArray, FloatArray, IntArray
from router.core.plugins import DecisionContext
from router.core.request import Mode, Stage

# The decision core builds a few frozen dataclasses per decision (the view, the decision, its
# choices). Their generated __init__ sets each field with object.__setattr__, which costs more
# than the arithmetic of a small fleet's decision; these classes define an __init__ with the same
# signature that sets the instance __dict__ in one step (tests check the signatures match).
_set_attr = object.__setattr__


@dataclass(frozen=True)
class Choice:
    """One placement: where a stage runs and what it is predicted to cost there.

    Predictions are NaN when the scheduler has no latency predictor.
    ``fallback_pass`` is 0 when the instance passed every filter, ``k`` when
    it was chosen in fallback pass ``k`` (droppable filters relaxed).
    """

    instance_id: str
    endpoint: str
    stage: Stage
    predicted_ttft_ms: float
    predicted_tpot_ms: float
    fallback_pass: int = 0

    def __init__(
        self,
        instance_id: str,
        endpoint: str,
        stage: Stage,
        predicted_ttft_ms: float,
        predicted_tpot_ms: float,
        fallback_pass: int = 0,
    ) -> None:
        _set_attr(
            self,
            "__dict__",
            {
                "instance_id": instance_id,
                "endpoint": endpoint,
                "stage": stage,
                "predicted_ttft_ms": predicted_ttft_ms,
                "predicted_tpot_ms": predicted_tpot_ms,
                "fallback_pass": fallback_pass,
            },
        )


@dataclass(frozen=True)
class TraceEntry:
    """One candidate of one evaluated stage, as the ``Schedule`` trace reports it.

    ``dropped_by`` is the label of the first filter (in chain order, with the
    filters active in the pass that decided the stage) that dropped the
    candidate, or ``""`` if it survived. ``metrics`` holds every metric the
    decision computed, at this instance.
    """

    instance_id: str
    stage: Stage
    selected: bool
    dropped_by: str
    predicted_ttft_ms: float
    predicted_tpot_ms: float
    metrics: Mapping[str, float] = field(default_factory=dict)


class StageOutcome(NamedTuple):
    """The columnar record of one evaluated stage (the source of the trace).

    ``candidate_mask`` marks the stage's candidates in the view;
    ``keeps[k]`` is filter ``labels[k]``'s keep-mask over the view and
    ``relax[k]`` its relax pass (0 = always applied); a stage decided by
    :mod:`router.core.fused` computes ``keeps`` on first read. ``selected`` is a view
    index, or -1 when nothing survived; ``fallback_pass`` is the pass that
    decided the stage (the last one tried when nothing survived). (Immutable;
    a named tuple because one is built per stage of every decision.)
    """

    stage: Stage
    candidate_mask: BoolArray
    labels: tuple[str, ...]
    keeps: Sequence[BoolArray]
    relax: tuple[int, ...]
    selected: int
    fallback_pass: int

    @property
    def candidates(self) -> IntArray:
        """The candidates' view indices, ascending."""
        return self.candidate_mask.nonzero()[0]

    @property
    def active(self) -> tuple[bool, ...]:
        """Per filter: did it apply in the deciding pass?"""
        return tuple(r == 0 or r > self.fallback_pass for r in self.relax)

    def first_drop(self, *, every_filter: bool = False) -> npt.NDArray[np.int64]:
        """Per candidate, the index of the first filter that dropped it, or -1.

        Only the filters active in the deciding pass count, unless ``every_filter``.
        """
        candidates = self.candidates
        active = (True,) * len(self.labels) if every_filter else self.active
        out = np.full(len(candidates), -1, dtype=np.int64)
        for k in range(len(self.labels) - 1, -1, -1):
            if active[k]:
                out[~self.keeps[k][candidates]] = k
        return out


@dataclass(frozen=True, eq=False)
class Decision:
    """Where a request goes.

    In ``pd`` mode ``prefill`` and ``decode`` are the two placements (one of
    them is ``None`` when the request restricted the stages; they may name the
    same instance under adaptive PD). In ``neutral`` mode both hold the same
    :class:`Choice` (stage ``NEUTRAL``). ``trace`` lists every candidate of
    every evaluated stage; it is built on first access, so the ``Generate``
    path never pays for it. For that the decision keeps its context (the
    view's columns): keep the :class:`Choice` objects, not the decision,
    for the lifetime of a request.
    """

    request_id: str
    mode: Mode
    policy: str
    prefill: Choice | None
    decode: Choice | None
    decided_at_s: float
    outcomes: tuple[StageOutcome, ...] = field(repr=False)
    context: DecisionContext = field(repr=False)

    def __init__(
        self,
        request_id: str,
        mode: Mode,
        policy: str,
        prefill: Choice | None,
        decode: Choice | None,
        decided_at_s: float,
        outcomes: tuple[StageOutcome, ...],
        context: DecisionContext,
    ) -> None:
        _set_attr(
            self,
            "__dict__",
            {
                "request_id": request_id,
                "mode": mode,
                "policy": policy,
                "prefill": prefill,
                "decode": decode,
                "decided_at_s": decided_at_s,
                "outcomes": outcomes,
                "context": context,
            },
        )

    @property
    def instance_ids(self) -> tuple[str, ...]:
        """The distinct instances this decision uses, prefill first."""
        ids = [c.instance_id for c in (self.prefill, self.decode) if c is not None]
        return tuple(dict.fromkeys(ids))

    @cached_property
    def trace(self) -> tuple[TraceEntry, ...]:
        """Every candidate of every evaluated stage, in stage then view order (built on first access)."""
        return self._trace(0)

    def trace_top(self, limit: int) -> tuple[TraceEntry, ...]:
        """At most ``limit`` candidates per evaluated stage, the most telling first (0: :attr:`trace`).

        Per stage: the selected candidate, then the candidates that passed the
        most filters (survivors, then those dropped by a later filter of the
        chain: the near misses), each group by the stage's prediction (TTFT;
        the decode stage: TPOT), lowest first, NaN last; ties in view order.
        Only these entries are built, so a large fleet's answer stays small.
        """
        return self.trace if limit <= 0 else self._trace(limit)

    def _trace(self, limit: int) -> tuple[TraceEntry, ...]:
        ctx = self.context
        ids = ctx.view.instances.ids
        ttft = ctx.metric_or_nan("predicted_ttft")
        tpot = ctx.metric_or_nan("predicted_tpot")
        # The drops first: a stage the fused pass decided computes its keep-masks now, and with
        # them the columns of thresholds it judged at its best candidates only (``at_best``).
        first_drops = [outcome.first_drop() for outcome in self.outcomes]
        computed = ctx.computed_metrics()
        entries: list[TraceEntry] = []
        for outcome, drops in zip(self.outcomes, first_drops, strict=True):
            # Python ints once per stage: indexing the arrays per entry costs more on a large fleet.
            candidates, firsts = outcome.candidates.tolist(), drops.tolist()
            positions = (
                range(len(candidates)) if limit <= 0 else _most_telling(outcome, drops, ttft, tpot, limit)
            )
            for pos in positions:
                i = candidates[pos]
                k = firsts[pos]
                entries.append(
                    TraceEntry(
                        instance_id=ids[i],
                        stage=outcome.stage,
                        selected=i == outcome.selected,
                        dropped_by=outcome.labels[k] if k >= 0 else "",
                        predicted_ttft_ms=float(ttft[i]),
                        predicted_tpot_ms=float(tpot[i]),
                        metrics={name: float(values[i]) for name, values in computed.items()},
                    )
                )
        return tuple(entries)


def _most_telling(
    outcome: StageOutcome,
    drops: npt.NDArray[np.int64],
    ttft: FloatArray,
    tpot: FloatArray,
    limit: int,
) -> list[int]:
    """Positions in ``outcome.candidates`` of the ``limit`` entries :meth:`Decision.trace_top` keeps, in order."""
    candidates = outcome.candidates
    # How far each candidate got in the chain: the index of the filter that dropped it, or past the end.
    depth = np.where(drops < 0, len(outcome.labels), drops)
    prediction = (tpot if outcome.stage is Stage.DECODE else ttft)[candidates]
    prediction = np.where(np.isnan(prediction), np.inf, prediction)
    # np.lexsort: the last key sorts first, and it is stable (view order breaks the remaining ties).
    order = np.lexsort((prediction, -depth, candidates != outcome.selected))
    return [int(pos) for pos in order[:limit]]
