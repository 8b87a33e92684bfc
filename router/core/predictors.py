"""Latency predictors by profile group, evaluated over a view's columns.

A heterogeneous fleet runs instances with different profiles (GPU, model
parallelism, engine version). Each instance names its group with a metadata
label (``SchedulerConfig.profile_label``, default ``profile``); the
:class:`PredictorSet` maps group names to :class:`predictor.LatencyPredictor`
objects and falls back to the default one for instances without the label or
with a group it does not know. Evaluation is vectorised per group: one
predictor call per group present in the view.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from predictor import LatencyPredictor
from router.core.calibration import Calibrator, StepPredictor
from router.core.columns import FloatArray, InstanceTable, IntArray

if TYPE_CHECKING:
    from router.core.theta import ThetaFit

logger = logging.getLogger(__name__)

# (predictor, view indices of its instances or None for "every instance")
_Parts = tuple[tuple[LatencyPredictor, IntArray | None], ...]


class PredictorSet:
    """A default predictor plus optional predictors per profile group."""

    def __init__(
        self, default: LatencyPredictor, groups: Mapping[str, LatencyPredictor] | None = None
    ) -> None:
        self.default = default
        self.groups = dict(groups or {})
        #: Online calibration of this set's predictions (None: the profiles as they are).
        self.calibration: Calibrator | None = None
        #: Aladdin's θ learned online (router.core.theta.ThetaFit; None: --binpack-theta fixed).
        self.theta: ThetaFit | None = None
        self._warned: set[str] = set()
        # The parts of the last table asked about (decisions ask several times per table).
        self._last_table: InstanceTable | None = None
        self._last_parts: _Parts = ()

    @classmethod
    def from_files(
        cls,
        default: tuple[str | Path, str | Path],
        groups: Mapping[str, tuple[str | Path, str | Path]] | None = None,
    ) -> PredictorSet:
        """Load ``(ttft_path, tpot_path)`` pairs: the default and one per group.

        Raises :class:`predictor.ProfileError` naming the bad file.
        """
        return cls(
            LatencyPredictor.from_files(*default),
            {name: LatencyPredictor.from_files(*paths) for name, paths in (groups or {}).items()},
        )

    @classmethod
    def of(cls, predictors: LatencyPredictor | PredictorSet | None) -> PredictorSet | None:
        """Wrap a single predictor; pass a set or ``None`` through."""
        if predictors is None or isinstance(predictors, PredictorSet):
            return predictors
        return cls(predictors)

    def for_group(self, group: str) -> LatencyPredictor:
        """The predictor of ``group`` ("" or unknown → the default, with one warning per unknown name)."""
        found = self.groups.get(group)
        if found is not None:
            return found
        if group and group not in self._warned:
            self._warned.add(group)
            logger.warning("no profile for group %r; its instances use the default profile", group)
        return self.default

    def step_predictor(self, group: str) -> StepPredictor:
        """The profile's (prefill ms, decode ms) of engine steps, as the group's profile predicts them."""
        lp = self.for_group(group)

        def predict(
            prefill: FloatArray, batch: FloatArray, tokens: FloatArray
        ) -> tuple[FloatArray, FloatArray]:
            pre = np.where(prefill > 0, lp.prefill_step_ms(np.maximum(prefill, 1.0)), 0.0)
            return pre, lp.decode_step_ms(batch, tokens)

        return predict

    def only(self, table: InstanceTable) -> LatencyPredictor | None:
        """The one predictor every instance of ``table`` uses, or ``None`` when they use several."""
        parts = self._last_parts if table is self._last_table else self._parts(table)
        return parts[0][0] if len(parts) == 1 else None

    def _parts(self, table: InstanceTable) -> _Parts:
        if table is self._last_table:
            return self._last_parts
        key = ("predictor_parts", self)
        parts: _Parts | None = table.memo.get(key)
        if parts is None:
            by_predictor: dict[int, tuple[LatencyPredictor, list[int]]] = {}
            for i, group in enumerate(table.groups):
                lp = self.for_group(group)
                by_predictor.setdefault(id(lp), (lp, []))[1].append(i)
            if len(by_predictor) <= 1:
                parts = ((self.default if not by_predictor else next(iter(by_predictor.values()))[0], None),)
            else:
                parts = tuple((lp, np.asarray(idx, dtype=np.intp)) for lp, idx in by_predictor.values())
            table.memo[key] = parts
        self._last_table, self._last_parts = table, parts
        return parts

    def _apply(
        self,
        table: InstanceTable,
        fn: Callable[[LatencyPredictor, list[FloatArray]], FloatArray],
        *cols: FloatArray,
    ) -> FloatArray:
        parts = self._parts(table)
        if len(parts) == 1:
            return fn(parts[0][0], list(cols))
        out = np.empty(table.n)
        for lp, idx in parts:
            out[idx] = fn(lp, [c[idx] for c in cols])
        return out

    def decode_step_ms(
        self, table: InstanceTable, decode_requests: FloatArray, decode_tokens: FloatArray
    ) -> FloatArray:
        """Per instance: ``predict_tpot_ms(decode_requests, decode_tokens)`` with its group's profile."""
        return self._apply(table, lambda lp, c: lp.decode_step_ms(c[0], c[1]), decode_requests, decode_tokens)

    def busy_decode_step_ms(
        self, table: InstanceTable, decode_requests: FloatArray, decode_tokens: FloatArray
    ) -> FloatArray:
        """:meth:`decode_step_ms` when every input is > 0 (fewer array operations)."""
        lp = self.only(table)
        if lp is not None:  # per decision: skip the generic per-group split
            return lp.busy_decode_step_ms(decode_requests, decode_tokens)
        return self._apply(
            table, lambda lp, c: lp.busy_decode_step_ms(c[0], c[1]), decode_requests, decode_tokens
        )

    def prefill_step_ms(self, table: InstanceTable, tokens: FloatArray) -> FloatArray:
        """Per instance: the profiled latency of one prefill step of ``tokens``."""
        return self._apply(table, lambda lp, c: lp.prefill_step_ms(c[0]), tokens)

    def chunked_prefill_ms(
        self,
        table: InstanceTable,
        prefill_tokens: FloatArray,
        decode_step_ms: FloatArray,
        full_chunk_ms: FloatArray,
    ) -> FloatArray:
        """Per instance: ``predict_ttft_ms`` from a cached decode step and full-chunk latency.

        The chunk budget is the table's ``max_num_batched_tokens`` (always > 0).
        """
        return self._apply(
            table,
            lambda lp, c: lp.chunked_prefill_ms(c[0], c[1], c[2], c[3]),
            prefill_tokens,
            decode_step_ms,
            table.max_num_batched_tokens,
            full_chunk_ms,
        )

    def positive_chunked_prefill_ms(
        self,
        table: InstanceTable,
        prefill_tokens: FloatArray,
        decode_step_ms: FloatArray,
        full_step_ms: FloatArray,
    ) -> FloatArray:
        """:meth:`chunked_prefill_ms` when every ``prefill_tokens`` is > 0 and ``full_step_ms`` is
        ``full_chunk_ms + decode_step_ms`` (fewer array operations)."""
        lp = self.only(table)
        if lp is not None:  # per decision: skip the generic per-group split
            return lp.positive_chunked_prefill_ms(
                prefill_tokens, decode_step_ms, table.max_num_batched_tokens, full_step_ms
            )
        return self._apply(
            table,
            lambda lp, c: lp.positive_chunked_prefill_ms(c[0], c[1], c[2], c[3]),
            prefill_tokens,
            decode_step_ms,
            table.max_num_batched_tokens,
            full_step_ms,
        )
