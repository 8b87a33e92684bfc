"""Fast-forwarding runs of identical pure-decode steps of a :class:`engine.model.SimCore`.

Most steps of a busy decode instance look alike: nothing waits, nothing is
being prefilled, every running request gets one token, and no request
finishes. Stepping them one by one through ``schedule``/``finish_step`` costs
Python work per request per step, which dominates a large simulation. A
:class:`DecodeRun` plans such a run instead: the step durations come from the
engine's own cost model (so they are the very numbers stepping would
produce), the load the router would see at any time inside the run is computed
from the run's start state, and the core is advanced only when the run ends or
something touches the instance (a request added, KV released) — by exactly the
number of steps finished by then (:meth:`DecodeRun.apply`).

A run is planned only when stepping would be *identical* to it:

- the core has no waiting request and no uncomputed prefill token, so every
  running request is decoding and every step schedules each of them once
  (the step budget always covers the batch: ``max_num_seqs <=
  max_num_batched_tokens``);
- it stops one step before the first request would finish (that step, which
  produces a final token, is stepped normally);
- it stops before the free KV blocks would run out (so nothing is preempted);
- the cost model is deterministic (no step-time noise), so planning durations
  ahead draws nothing from an RNG.

:meth:`DecodeRun.apply` writes the core's private request state (computed,
generated and context tokens, KV blocks, counters, recent steps) the way the
skipped ``finish_step`` calls would have. That couples this module to
:class:`SimCore`'s internals; ``tests/bench/test_simulate_fastforward.py``
checks, step for step, that a fast-forwarded core ends in the same state as a
stepped one, so a change to the core fails loudly there rather than skewing
results.
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

from engine.interface import StepRecord
from engine.model import ProfileCostModel, SimCore
from predictor import LatencyPredictor

#: Runs shorter than this are stepped normally (planning costs about as much as a few steps).
MIN_RUN_STEPS = 4

#: Step durations are computed in chunks, starting with this many steps and doubling: most
#: runs are cut short by a new request long before their planned end, and a chunk costs
#: about the same for 1 or 64 steps (one vectorised predictor call).
FIRST_CHUNK_STEPS = 64


class DecodeStepTimes:
    """A noise-free step cost model, plus durations of many pure-decode steps at once.

    ``cost`` is the ``ProfileCostModel`` engines using these times must step
    with. The array path uses the predictor's vectorised TPOT (element-wise
    equal to its scalar path); every batch is checked against ``cost.step_ms``
    at its first step, and a mismatch switches this object to calling
    ``cost.step_ms`` per step.
    """

    def __init__(self, predictor: LatencyPredictor, speed_factor: float = 1.0) -> None:
        self.cost = ProfileCostModel(predictor, speed_factor=speed_factor)
        self._predictor = predictor
        self._scale = 1.0 / speed_factor
        self.vectorised = True

    def step_ms(self, batch: int, first_tokens: int, num_steps: int) -> list[float]:
        """Durations (ms) of ``num_steps`` steps of ``batch`` decodes, the first holding ``first_tokens`` tokens.

        Each step adds ``batch`` tokens to the context.
        """
        step_ms = self.cost.step_ms
        if self.vectorised:
            tokens = first_tokens + batch * np.arange(num_steps, dtype=np.float64)
            values: list[float] = (
                self._predictor.decode_step_ms(np.full(num_steps, float(batch)), tokens) * self._scale
            ).tolist()
            if values[0] == step_ms(0, batch, first_tokens):
                return values
            self.vectorised = False
        return [step_ms(0, batch, first_tokens + k * batch) for k in range(num_steps)]


class DecodeRun:
    """A planned run of pure-decode steps on one core, starting at ``start_s`` (virtual seconds).

    Only ``ends`` (the end time of each step planned so far) grows while the run
    lasts; the core is untouched until :meth:`apply`.
    """

    __slots__ = (
        "_chunk",
        "_durations_ms",
        "batch",
        "core",
        "counted",
        "cycle",
        "decode_tokens0",
        "ends",
        "max_steps",
        "start_s",
        "step_tokens0",
        "times",
        "used_blocks0",
    )

    def __init__(
        self,
        core: SimCore,
        times: DecodeStepTimes,
        start_s: float,
        max_steps: int,
        cycle: list[int],
        step_tokens0: int,
        counted: int,
    ) -> None:
        """Use :meth:`plan`; this only records its findings (call :meth:`extend` before use)."""
        self.core = core
        self.times = times
        self.start_s = start_s
        #: Steps the run may last (it ends one step before the first request finishes).
        self.max_steps = max_steps
        #: Blocks the run allocates through step ``u`` for ``u < block_size``; the pattern repeats.
        self.cycle = cycle
        self.batch = core.num_running
        #: Context tokens of the batch in the run's first step (what the step time is looked up with).
        self.step_tokens0 = step_tokens0
        #: Running requests the core counts as decode load (each adds a token per step to its counter).
        self.counted = counted
        self.decode_tokens0 = core.num_decode_tokens
        self.used_blocks0 = core.num_used_kv_tokens // core.config.block_size
        self.ends: list[float] = []
        self._durations_ms: list[float] = []
        self._chunk = FIRST_CHUNK_STEPS

    @classmethod
    def plan(cls, core: SimCore, times: DecodeStepTimes, start_s: float) -> DecodeRun | None:
        """A run starting now on ``core`` (idle, between steps), or None when stepping must go on normally."""
        if core.num_waiting or core.num_uncomputed_prefill_tokens or not core.num_running:
            return None
        if core.config.kv_slowdown > 0.0:
            return None  # step times depend on KV use, which the vectorised times do not model
        running = core._running
        max_steps = min(r.spec.max_new_tokens - r.num_generated for r in running) - 1
        if max_steps < MIN_RUN_STEPS:
            return None
        bs = core.config.block_size
        # A request needs a new block in step s exactly when (computed + s) is a multiple of bs,
        # so the blocks each step allocates repeat with period bs.
        per_step = [0] * bs
        step_tokens0 = counted = 0
        for r in running:
            computed = r.num_computed
            if r.num_blocks != -(-computed // bs):
                return None  # blocks beyond the computed context: not the steady state assumed here
            per_step[-computed % bs] += 1
            step_tokens0 += r.num_tokens
            counted += r.spec.counts_as_decode
            if r.extended_at and r.num_generated <= r.extended_at:
                # The first token past a raised budget is reported (SimCore.extend): stepped, not skipped.
                max_steps = min(max_steps, r.extended_at - r.num_generated)
        if max_steps < MIN_RUN_STEPS:
            return None
        cycle: list[int] = []
        total = 0
        for n in per_step:
            total += n
            cycle.append(total)
        run = cls(core, times, start_s, max_steps, cycle, step_tokens0, counted)
        free = core.config.num_kv_blocks - run.used_blocks0
        if run.blocks_through(max_steps - 1) > free:
            # The first step that would run out of blocks ends the run.
            lo, hi = 0, max_steps - 1
            while lo < hi:
                mid = (lo + hi) // 2
                if run.blocks_through(mid) > free:
                    hi = mid
                else:
                    lo = mid + 1
            if lo < MIN_RUN_STEPS:
                return None
            run.max_steps = lo
        run.extend()
        return run

    # ------------------------------------------------------------------ timeline

    @property
    def complete(self) -> bool:
        """Whether every step of the run is planned (``ends[-1]`` is then the run's end)."""
        return len(self.ends) >= self.max_steps

    def extend(self) -> None:
        """Plan the next chunk of steps (durations from the cost model, as ``schedule`` computes them)."""
        s0 = len(self.ends)
        upto = min(self.max_steps, s0 + self._chunk)
        self._chunk *= 2
        t = self.ends[-1] if self.ends else self.start_s
        durations = self.times.step_ms(self.batch, self.step_tokens0 + s0 * self.batch, upto - s0)
        self._durations_ms.extend(durations)
        ends = self.ends
        for ms in durations:
            # The same float operations as stepping: each end is the previous end plus the duration.
            t = t + ms * 1e-3
            ends.append(t)

    def steps_done(self, now_s: float) -> int:
        """Steps of the run finished at ``now_s`` (a step ending exactly then counts as finished)."""
        return bisect_right(self.ends, now_s)

    def step_start(self, s: int) -> float:
        """When step ``s`` starts."""
        return self.ends[s - 1] if s > 0 else self.start_s

    def decode_tokens_at(self, s: int) -> int:
        """The core's ``num_decode_tokens`` while step ``s`` runs."""
        return self.decode_tokens0 + s * self.counted

    def blocks_through(self, s: int) -> int:
        """Blocks the run allocates in its steps 0 to ``s``."""
        cycles, u = divmod(s, len(self.cycle))
        return cycles * self.batch + self.cycle[u]

    def used_kv_tokens_at(self, s: int) -> int:
        """The core's ``num_used_kv_tokens`` while step ``s`` runs (its blocks already allocated)."""
        return (self.used_blocks0 + self.blocks_through(s)) * self.core.config.block_size

    # ------------------------------------------------------------------ applying

    def apply(self, s: int) -> None:
        """Advance the core by the run's first ``s`` steps, as ``schedule`` + ``finish_step`` would have.

        Call once, at the end of the run's use; the run is spent afterwards.
        """
        if not 0 <= s <= len(self.ends):
            raise ValueError(f"a run of {len(self.ends)} planned steps cannot apply {s}")
        if s == 0:
            return
        core = self.core
        bs = core.config.block_size
        allocated = 0
        for req in core._running:
            computed = req.num_computed + s
            need = -(-computed // bs) - req.num_blocks
            if need > 0:
                req.num_blocks += need
                allocated += need
            req.num_computed = computed
            req.num_tokens += s
            req.num_generated += s
        core._take(allocated)  # (past the empty blocks it evicts cached prefixes, as stepping would)
        core._decode_tokens += s * self.counted
        core._num_steps += s
        recent = core._recent_steps
        first = max(0, s - (recent.maxlen or s))
        batch = self.batch
        for u in range(first, s):
            recent.append(StepRecord(0, batch, self.step_tokens0 + u * batch, self._durations_ms[u]))
