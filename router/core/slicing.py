"""Slice-level scheduling: estimators, the serving-time batcher, the max-min offloader, the interval.

Slice-level dispatch caps every placement of a request at ``S`` new tokens (a
*slice*). A request that still has tokens to generate after its slice goes back
to the pool with what it generated appended to its context, and is placed
again, together with newly arrived requests, at the next schedule point. Because
a slice is short, the work and the KV a batch of slices needs are known within
a narrow range before it runs; this module turns that into decisions:

- :class:`ServingTimeModel` estimates how long an instance takes to serve a
  batch of slices (prefill of the batch plus the sum of its per-iteration
  decode steps), from the instance's latency profile. Its decode term is a
  four-parameter fit of the per-iteration latency over batch size and cached
  length, so the slice length is an argument, not something profiled:
  changing ``S`` needs no new profile.
- :class:`MemoryModel` says whether a batch fits the KV cache over the whole
  slice (every request's context plus the tokens of its slice), with a
  headroom factor.
- :func:`batch_requests` partitions the pool into batches with a dynamic
  programme over requests sorted by context length that minimises the total
  estimated serving time under the memory constraint.
- :func:`offload_max_min` sends the batch with the longest estimated serving
  time to the instance with the least outstanding estimated work, one batch at
  a time; :class:`LoadLedger` keeps that outstanding work (added at offload,
  removed when the batch completes).
- :func:`next_interval_ms` adapts the time between schedule points to the load.
- :class:`SliceScheduler` ties them together (pool, schedule points,
  per-instance local queues, admission, completion) for the simulator and the
  router's dispatcher alike.

Adaptation to continuous-batching engines (the engines this project drives:
vLLM and the ``sim`` engine model). The original formulation assumes static
batching: a batch is padded to its longest input, so its cost depends on the
batch size ``N`` and the longest input ``L``, and its KV on ``N * (L + S)``.
Continuous-batching engines neither pad nor keep finished requests in the
batch, so here

- the prefill term is the engine's own chunked prefill of the batch's actual
  context-token sum (no ``N * L`` padding), taken from the profile;
- the decode term is the fitted per-iteration latency at the batch's *mean*
  cached length (what the engine's step really attends over), summed over the
  batch generation length ``G = min(S, longest remaining output in the batch)``
  minus the one token the prefill step already samples, with ``N`` held fixed
  (an upper bound: requests whose slice ends earlier leave the batch sooner);
- the KV need is the sum over requests of ``context + slice`` rounded up to
  whole blocks, not ``N * (L + S)``;
- an instance may run several batches at once (the engine merges them into
  its running batch): a queued batch starts as soon as the KV its instance's
  running slices plan to hold leaves room for it, and the adaptive interval
  scales with the work still waiting in local queues (``overlap_batches``;
  off, an instance serves one batch at a time as with static batching).

The dynamic programme still walks requests sorted by context length and
considers contiguous runs only, as the original does: runs of similar length
keep the batch's decode steps uniform and its KV bound tight. Growing a run
only adds KV, so the inner loop stops at the first run that does not fit.

Pure and synchronous: no I/O, no clock, no globals.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Container, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from predictor import LatencyPredictor

#: Default slice length, in new tokens per placement.
DEFAULT_SLICE_TOKENS = 128


def _doc(text: str) -> dict[str, Any]:
    return {"doc": text}


@dataclass(frozen=True)
class SliceConfig:
    """Knobs of slice-level dispatch (``--slice-tokens``, ``--slice-interval-ms``, ...)."""

    slice_tokens: int = field(
        default=DEFAULT_SLICE_TOKENS, metadata=_doc("most new tokens one placement of a request generates")
    )
    interval_ms: float | None = field(
        default=None,
        metadata=_doc("fixed time between schedule points in ms; None adapts it to the load"),
    )
    interval_load_factor: float = field(
        default=0.5,
        metadata=_doc(
            "adaptive interval: this fraction of the least-loaded instance's outstanding work, < 1"
        ),
    )
    min_interval_ms: float = field(
        default=200.0, metadata=_doc("adaptive interval: never shorter than this, in ms")
    )
    overlap_batches: bool = field(
        default=True,
        metadata=_doc(
            "continuous-batching engines: an instance takes a queued batch as soon as the KV its running "
            "slices plan to hold leaves room for it; False serves one batch at a time (static batching)"
        ),
    )
    max_batching_slices: int = field(
        default=2048,
        metadata=_doc("most slices one schedule point batches, oldest first; the rest wait for the next"),
    )
    max_waiting_slices: int = field(
        default=65536,
        metadata=_doc("router: most slices waiting for a placement; beyond it requests are refused"),
    )
    kv_headroom: float = field(
        default=0.9, metadata=_doc("share of an instance's KV capacity a batch may plan to fill, in (0, 1]")
    )
    resume_at_once: bool = field(
        default=True,
        metadata=_doc(
            "place a request's next slice as soon as its slice ends (SliceScheduler.resume); False sends "
            "it back to the pool for the next schedule point, as the paper does"
        ),
    )
    prefix_cache: bool = field(
        default=True,
        metadata=_doc(
            "engines keep a finished slice's KV blocks in their prefix cache (vLLM's automatic prefix "
            "caching): a slice resumed at once on the instance it left recomputes only its last partial "
            "block, and resume() prices staying there without the re-prefill"
        ),
    )
    continue_in_place: bool = field(
        default=True,
        metadata=_doc(
            "a slice resumed at once on the instance it ran on continues its run there: the router lets "
            "the engine's leg go on past the slice's end (the next slice only moves its authorisation "
            "on), so a boundary costs the engine nothing unless the slice moves; False stops the leg and "
            "starts a new one there (its last partial block prefilled again)"
        ),
    )
    continue_within_kv: bool = field(
        default=True,
        metadata=_doc(
            "a slice resumed where it ran is admitted only within its instance's KV (the whole cache, times "
            "the preemption cap; the headroom is kept from new work for it): shortened to the room there, "
            "else moved where it fits, else it waits, ahead of new work, for the first instance with room; "
            "False admits it there whatever the plan holds"
        ),
    )
    split_batches: bool = field(
        default=True,
        metadata=_doc(
            "continuous-batching engines: a queued batch's slices start as its instance's planned KV "
            "frees room for each (the rest waits at the queue's head); False admits a batch only whole"
        ),
    )
    backfill: bool = field(
        default=True,
        metadata=_doc(
            "continuous-batching engines: while the queue head's first slice does not fit its "
            "instance's planned KV, later queued batches whose slices fit start (in queue order); False "
            "keeps the queue in order, the slices behind a blocked head waiting with it"
        ),
    )
    grow_with_answer: bool = field(
        default=True,
        metadata=_doc(
            "a resumed slice is at least as long as the answer so far (at most 8 x slice_tokens): a long "
            "answer crosses O(log) slice boundaries instead of one per slice_tokens; False keeps "
            "slice_tokens (and the recompute_share rule)"
        ),
    )
    head_wait_intervals: float | None = field(
        default=3.0,
        metadata=_doc(
            "backfill: a queue head whose first slice has waited this many schedule intervals for room "
            "starts within its instance's whole KV (times the preemption cap), the room the headroom keeps "
            "for running slices, as a continued slice does; None keeps it within the budget, passed by "
            "smaller work for as long as that fits"
        ),
    )
    recompute_share: float | None = field(
        default=0.25,
        metadata=_doc(
            "adaptive slice length: a resumed slice is made long enough that re-prefilling its context "
            "costs at most this share of the slice's decode time alone; None keeps every slice at "
            "slice_tokens"
        ),
    )

    def __post_init__(self) -> None:
        if isinstance(self.slice_tokens, bool) or not isinstance(self.slice_tokens, int):
            raise ValueError(f"slice_tokens must be an integer, got {self.slice_tokens!r}")
        if not 1 <= self.slice_tokens <= 1_000_000:
            raise ValueError(f"slice_tokens must be in 1..1000000, got {self.slice_tokens}")
        if self.interval_ms is not None and not (
            math.isfinite(self.interval_ms) and 0.0 < self.interval_ms <= 3_600_000.0
        ):
            raise ValueError(
                f"interval_ms must be in (0, 3600000] or None (adaptive), got {self.interval_ms!r}"
            )
        if not (math.isfinite(self.interval_load_factor) and 0.0 < self.interval_load_factor < 1.0):
            raise ValueError(f"interval_load_factor must be in (0, 1), got {self.interval_load_factor!r}")
        if not (math.isfinite(self.min_interval_ms) and 0.0 < self.min_interval_ms <= 3_600_000.0):
            raise ValueError(f"min_interval_ms must be in (0, 3600000], got {self.min_interval_ms!r}")
        if isinstance(self.max_batching_slices, bool) or not (
            isinstance(self.max_batching_slices, int) and self.max_batching_slices >= 1
        ):
            raise ValueError(f"max_batching_slices must be an integer >= 1, got {self.max_batching_slices!r}")
        if isinstance(self.max_waiting_slices, bool) or not (
            isinstance(self.max_waiting_slices, int) and self.max_waiting_slices >= 1
        ):
            raise ValueError(f"max_waiting_slices must be an integer >= 1, got {self.max_waiting_slices!r}")
        if not (math.isfinite(self.kv_headroom) and 0.0 < self.kv_headroom <= 1.0):
            raise ValueError(f"kv_headroom must be in (0, 1], got {self.kv_headroom!r}")
        if self.head_wait_intervals is not None and not (
            math.isfinite(self.head_wait_intervals) and 0.0 <= self.head_wait_intervals <= 1000.0
        ):
            raise ValueError(
                f"head_wait_intervals must be in [0, 1000] or None, got {self.head_wait_intervals!r}"
            )
        if self.recompute_share is not None and not (
            math.isfinite(self.recompute_share) and 0.0 < self.recompute_share <= 10.0
        ):
            raise ValueError(f"recompute_share must be in (0, 10] or None, got {self.recompute_share!r}")


# --------------------------------------------------------------------------- estimators


@dataclass(frozen=True)
class DecodeFit:
    """Per-iteration decode latency ``d1*N*l + d2*N + d3*l + d4`` (ms) for batch ``N``, cached length ``l``."""

    d1: float
    d2: float
    d3: float
    d4: float

    def step_ms(self, batch: float, cached_tokens: float) -> float:
        return self.d1 * batch * cached_tokens + self.d2 * batch + self.d3 * cached_tokens + self.d4

    def steps_ms(self, batch: int, mean_context: float, steps: int) -> float:
        """Sum of :meth:`step_ms` over ``steps`` iterations at cached lengths ``mean_context + 1 ..``.

        Closed form of the sum (the cached length grows by one per iteration),
        so its cost does not depend on ``steps``.
        """
        if steps <= 0 or batch <= 0:
            return 0.0
        lengths = steps * mean_context + steps * (steps + 1) / 2.0  # sum of the cached lengths
        return (self.d1 * batch + self.d3) * lengths + steps * (self.d2 * batch + self.d4)


def fit_decode(
    predictor: LatencyPredictor, *, max_batch: int = 256, max_context_tokens: int = 8192
) -> DecodeFit:
    """Least-squares fit of :class:`DecodeFit` to the profile's per-iteration (TPOT) latency.

    Samples the profile (through the predictor, so its interpolation applies)
    at batch sizes ``1, 2, 4, ... max_batch`` and cached lengths ``8 ..
    max_context_tokens`` on a doubling grid: the points a slice batch uses.
    """
    if max_batch < 1 or max_context_tokens < 8:
        raise ValueError(
            f"fit_decode needs max_batch >= 1 and max_context_tokens >= 8, got {max_batch}, {max_context_tokens}"
        )
    batches = sorted({*(2**k for k in range(max_batch.bit_length()) if 2**k <= max_batch), max_batch})
    lengths = sorted(
        {
            *(2**k for k in range(3, max_context_tokens.bit_length()) if 2**k <= max_context_tokens),
            max_context_tokens,
        }
    )
    grid_n, grid_l = np.meshgrid(np.array(batches, dtype=np.float64), np.array(lengths, dtype=np.float64))
    n, ln = grid_n.ravel(), grid_l.ravel()
    y = predictor.decode_step_ms(n, n * ln)
    a = np.column_stack([n * ln, n, ln, np.ones_like(n)])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    return DecodeFit(*(float(c) for c in coef))


class ServingTimeModel:
    """Estimated time (ms) for one instance to serve a batch of slices alone.

    ``serve_ms(N, P, G) = prefill(P) + decode(N, P / N, G - 1)``: the
    instance's chunked prefill of the ``P`` context tokens of the batch (each
    chunk a profiled prefill step, as the engine runs it), then ``G - 1``
    decode iterations of ``N`` requests at the fitted per-iteration latency.
    The first token of every request comes out of its prefill step.
    """

    def __init__(
        self,
        predictor: LatencyPredictor,
        *,
        max_num_batched_tokens: int,
        decode: DecodeFit | None = None,
        max_batch: int = 256,
        max_context_tokens: int = 8192,
    ) -> None:
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.predictor = predictor
        self.max_num_batched_tokens = max_num_batched_tokens
        self.decode = decode or fit_decode(
            predictor, max_batch=max_batch, max_context_tokens=max_context_tokens
        )
        self._full_chunk_ms = float(predictor.prefill_step_ms(float(max_num_batched_tokens)))
        self._tail_cache: dict[int, float] = {}

    def prefill_ms(self, context_tokens: int) -> float:
        """Chunked prefill of ``context_tokens`` tokens with no decode batch beside it."""
        if context_tokens <= 0:
            return 0.0
        m = self.max_num_batched_tokens
        full, tail = divmod(context_tokens, m)
        ms = full * self._full_chunk_ms
        if tail:
            cached = self._tail_cache.get(tail)
            if cached is None:
                cached = float(self.predictor.prefill_step_ms(float(tail)))
                if len(self._tail_cache) < 65536:
                    self._tail_cache[tail] = cached
            ms += cached
        return ms

    def serve_ms(
        self, batch: int, context_tokens: int, generation_tokens: int, cached_tokens: int = 0
    ) -> float:
        """Serving time of ``batch`` requests holding ``context_tokens`` tokens in all, for ``generation_tokens`` iterations.

        ``cached_tokens`` of the contexts are in the instance's prefix cache: not prefilled again.
        """
        if batch <= 0:
            return 0.0
        return self.prefill_ms(context_tokens - min(cached_tokens, context_tokens)) + self.decode.steps_ms(
            batch, context_tokens / batch, generation_tokens - 1
        )

    def marginal_ms(self, context_tokens: int, generation_tokens: int) -> float:
        """What one request adds to an instance's work when it joins the engine's running batch.

        Its chunked prefill, then its share of ``generation_tokens - 1``
        decode steps: the per-request terms of the fitted step
        (``d1·l + d2`` at its own cached length ``l``), not the step's
        fixed part, which the running batch pays anyway. For a resumed slice
        on a continuous-batching engine (see :meth:`SliceScheduler.resume`).
        """
        steps = generation_tokens - 1
        d = self.decode
        decode = 0.0
        if steps > 0:
            lengths = steps * context_tokens + steps * (steps + 1) / 2.0
            decode = d.d1 * lengths + d.d2 * steps
        return self.prefill_ms(context_tokens) + max(decode, 0.0)

    def exact_serve_ms(self, contexts: Sequence[int], generation_tokens: Sequence[int]) -> float:
        """The same batch summed step by step from the profile (no fit, requests leave as they finish).

        What the engine model would take if it ran the batch alone; for tests
        and calibration, O(slice length) per call.
        """
        if not contexts:
            return 0.0
        ms = self.prefill_ms(sum(contexts))
        tokens = [c + 1 for c in contexts]  # after the prefill step sampled one token each
        remaining = [g - 1 for g in generation_tokens]
        while True:
            live = [k for k, r in enumerate(remaining) if r > 0]
            if not live:
                return ms
            ms += self.predictor.predict_tpot_ms(len(live), sum(tokens[k] for k in live))
            for k in live:
                tokens[k] += 1
                remaining[k] -= 1


@dataclass(frozen=True)
class MemoryModel:
    """Whether a batch's KV fits an instance over its whole slice.

    A request holds ``context + slice`` tokens of KV by the end of its slice,
    rounded up to whole blocks; a batch fits when the sum stays within
    ``headroom * kv_capacity_tokens`` and it has at most ``max_batch`` requests.
    """

    kv_capacity_tokens: int
    block_size: int = 16
    headroom: float = 0.9
    max_batch: int = 256

    def __post_init__(self) -> None:
        if self.kv_capacity_tokens < 1 or self.block_size < 1 or self.max_batch < 1:
            raise ValueError(
                "kv_capacity_tokens, block_size and max_batch must be >= 1, got "
                f"{self.kv_capacity_tokens}, {self.block_size}, {self.max_batch}"
            )
        if not 0.0 < self.headroom <= 1.0:
            raise ValueError(f"headroom must be in (0, 1], got {self.headroom!r}")

    @property
    def budget_tokens(self) -> float:
        return self.headroom * self.kv_capacity_tokens

    def request_kv_tokens(self, context_tokens: int, slice_tokens: int) -> int:
        """KV tokens (whole blocks) a request holds at the end of its slice."""
        bs = self.block_size
        return -(-(context_tokens + slice_tokens) // bs) * bs

    def fits(self, batch: int, kv_tokens: int) -> bool:
        return batch <= self.max_batch and kv_tokens <= self.budget_tokens


# --------------------------------------------------------------------------- batching


@dataclass(frozen=True)
class SliceRequest:
    """A request in the slice pool, as the batcher sees it."""

    key: Hashable
    #: Tokens the instance prefills for this slice: the prompt plus every token generated so far.
    context_tokens: int
    #: Tokens this slice generates at most: ``min(S, tokens still to generate)``, >= 1.
    slice_tokens: int
    #: Chained hashes of the context's leading blocks other requests may share (a system prompt, a
    #: document), ``prefix_block_tokens`` tokens each; empty: nothing shared.
    prefix: tuple[int, ...] = ()
    prefix_block_tokens: int = 0

    @property
    def shared_tokens(self) -> int:
        """Tokens of the context its shareable prefix blocks cover."""
        return min(len(self.prefix) * self.prefix_block_tokens, self.context_tokens)


def kv_need(memory: MemoryModel, requests: Iterable[SliceRequest], held: Container[int] = ()) -> int:
    """KV tokens ``requests`` add to an instance whose running slices hold the prefix blocks ``held``.

    The engines share a prompt's cached prefix blocks among the requests running on them (vLLM's
    automatic prefix caching references a block, it does not copy it), so a prefix is held once per
    instance, not once per request: each request adds its own part (the context past its shared
    prefix, plus its slice, in whole blocks) and each prefix block neither held there nor brought by
    an earlier one of ``requests``. Without prefixes, the paper's ``sum(context + slice)``.
    """
    last = deque(kv_needs(memory, requests, held), maxlen=1)
    return last[0] if last else 0


def leading_blocks(hashes: Sequence[int], held: Container[int]) -> int:
    """How many of a prompt's chained block ``hashes``, from its first, are in ``held``."""
    k = 0
    while k < len(hashes) and hashes[k] in held:
        k += 1
    return k


def kv_needs(
    memory: MemoryModel, requests: Iterable[SliceRequest], held: Container[int] = ()
) -> Iterator[int]:
    """:func:`kv_need` of each leading run of ``requests`` in turn (the first one, the first two, ...)."""
    seen: set[int] = set()
    total = 0
    for r in requests:
        total += memory.request_kv_tokens(r.context_tokens - r.shared_tokens, r.slice_tokens)
        for h in r.prefix:
            if h not in held and h not in seen:
                seen.add(h)
                total += r.prefix_block_tokens
        yield total


@dataclass(frozen=True)
class SliceBatch:
    """Requests served together on one instance for one slice, with their estimates."""

    requests: tuple[SliceRequest, ...]
    serve_ms: float
    kv_tokens: int

    @property
    def context_tokens(self) -> int:
        return sum(r.context_tokens for r in self.requests)


def _sort_key(r: SliceRequest) -> tuple[tuple[int, ...], int, int, str]:
    # Requests behind the same first prefix block next to each other: a run of them holds the
    # prefix once (kv_need). Without prefixes, by context length as the paper sorts.
    return (r.prefix[:1], r.context_tokens, r.slice_tokens, repr(r.key))


def batch_requests(
    requests: Sequence[SliceRequest], serving: ServingTimeModel, memory: MemoryModel
) -> list[SliceBatch]:
    """Partition ``requests`` into batches of least total estimated serving time.

    Requests are sorted by context length (behind the same first shared prefix block, when they
    have one: :func:`kv_need` counts a run's shared blocks once); ``best[i]`` is the least total
    serving time of the first ``i`` of them, over partitions into contiguous
    runs: ``best[i] = min_j best[j - 1] + serve(run j..i)`` with run ``j..i``
    allowed only if it fits :class:`MemoryModel` (a request alone always
    does: it has to be served somehow). Runs are grown from ``i`` downwards
    and the growth stops at the first run that does not fit (longer runs hold
    more KV). On equal totals the shorter run found first is kept. Batches
    come back in sorted order.
    """
    ordered = sorted(requests, key=_sort_key)
    n = len(ordered)
    if n == 0:
        return []
    ctx = [r.context_tokens for r in ordered]
    gen = [r.slice_tokens for r in ordered]
    kv = [memory.request_kv_tokens(r.context_tokens - r.shared_tokens, r.slice_tokens) for r in ordered]
    shared = any(r.prefix for r in ordered)
    best = [0.0] * (n + 1)
    cut = [0] * (n + 1)
    cost = [0.0] * (n + 1)
    for i in range(1, n + 1):
        # The request alone.
        last = ordered[i - 1]
        seen = set(last.prefix)
        run_ctx, run_gen = ctx[i - 1], gen[i - 1]
        run_kv = kv[i - 1] + len(seen) * last.prefix_block_tokens
        alone = serving.serve_ms(1, run_ctx, run_gen)
        best[i], cut[i], cost[i] = best[i - 1] + alone, i - 1, alone
        j = i - 1  # the run grows to requests j..i (1-based), i.e. ordered[j - 1 : i]
        while j > 0:
            run_ctx += ctx[j - 1]
            run_kv += kv[j - 1]
            if shared:
                for h in ordered[j - 1].prefix:
                    if h not in seen:
                        seen.add(h)
                        run_kv += ordered[j - 1].prefix_block_tokens
            run_gen = max(run_gen, gen[j - 1])
            size = i - j + 1
            if not memory.fits(size, run_kv):
                break
            t_run = serving.serve_ms(size, run_ctx, run_gen)
            total = best[j - 1] + t_run
            if total < best[i]:
                best[i], cut[i], cost[i] = total, j - 1, t_run
            j -= 1
    batches: list[SliceBatch] = []
    i = n
    while i > 0:
        p = cut[i]
        members = tuple(ordered[p:i])
        batches.append(SliceBatch(members, cost[i], kv_need(memory, members)))
        i = p
    batches.reverse()
    return batches


def total_serve_ms(batches: Sequence[SliceBatch]) -> float:
    return sum(b.serve_ms for b in batches)


# --------------------------------------------------------------------------- offloading


def offload_max_min(serve_ms: Sequence[float], loads: Sequence[float]) -> tuple[list[int], list[float]]:
    """Assign batches to instances: the longest batch first, each to the least-loaded instance.

    ``serve_ms[b]`` is batch ``b``'s estimated serving time and ``loads[w]``
    instance ``w``'s outstanding estimated work. Returns the instance of every
    batch (in the order of ``serve_ms``) and the loads after the assignment.
    Ties: among equally long batches the earlier goes first; among equally
    loaded instances the lower index wins.
    """
    if not loads:
        raise ValueError("offload_max_min needs at least one instance")
    after = [float(x) for x in loads]
    where = [-1] * len(serve_ms)
    for b in sorted(range(len(serve_ms)), key=lambda k: (-serve_ms[k], k)):
        w = min(range(len(after)), key=lambda k: (after[k], k))
        where[b] = w
        after[w] += serve_ms[b]
    return where, after


class LoadLedger:
    """Outstanding estimated work per instance: what the offloader balances.

    :meth:`add` when a batch is offloaded, :meth:`done` when the instance has
    served it (subtracting the same estimate, so estimation errors never
    accumulate in the ledger).
    """

    def __init__(self, instances: int) -> None:
        if instances < 1:
            raise ValueError(f"a load ledger needs at least one instance, got {instances}")
        self._loads = [0.0] * instances

    @property
    def loads(self) -> list[float]:
        return list(self._loads)

    def add(self, instance: int, serve_ms: float) -> None:
        self._loads[instance] += serve_ms

    def done(self, instance: int, serve_ms: float) -> None:
        # Clamp rounding residue: a drained instance reads exactly idle.
        self._loads[instance] = max(0.0, self._loads[instance] - serve_ms)

    def offload(self, batches: Sequence[SliceBatch]) -> list[int]:
        """:func:`offload_max_min` over the ledger's loads; records the assignment."""
        where, after = offload_max_min([b.serve_ms for b in batches], self._loads)
        self._loads = after
        return where


def next_interval_ms(loads: Sequence[float], config: SliceConfig) -> float:
    """Time to the next schedule point: fixed, or ``max(factor * least load, minimum)``.

    A lightly loaded fleet gets requests quickly; a busy one lets the pool
    fill, so the batcher sees more requests at once and forms larger batches.
    """
    if config.interval_ms is not None:
        return config.interval_ms
    least = min(loads) if loads else 0.0
    return max(config.interval_load_factor * least, config.min_interval_ms)


# --------------------------------------------------------------------------- online estimators


#: Weight an observation keeps after 64 more (the online fits forget old behaviour at this pace).
_DECAY = 0.5 ** (1 / 64)


class ServingFit:
    """One instance's serving-time estimator, fitted online: the model's estimate times a learned scale.

    The paper fits its serving-time coefficients offline (profiled
    per-iteration latency, ``curve_fit``). Here the shape comes from the
    instance's own profile (:class:`ServingTimeModel`) and its scale from
    what the instance really does: at every batch completion the time it
    was busy since its previous completion (or since it took work while
    idle) is set against the batch's estimate, and the scale is the ratio of
    their decayed sums. Batches that overlap on a continuous-batching engine
    are counted by busy time, not by each batch's own span, so the ratio is
    how much work per estimated millisecond the instance really gets
    through. Bounded to [0.25, 4] so one odd batch cannot run away with it.
    """

    def __init__(self) -> None:
        self._observed = 0.0
        self._estimated = 0.0

    @property
    def scale(self) -> float:
        if self._estimated < 1.0:
            return 1.0
        return min(4.0, max(0.25, self._observed / self._estimated))

    def observe(self, busy_ms: float, estimated_ms: float) -> None:
        if not (math.isfinite(busy_ms) and busy_ms >= 0.0 and estimated_ms > 0.0):
            return
        self._observed = self._observed * _DECAY + busy_ms
        self._estimated = self._estimated * _DECAY + estimated_ms


class MemoryFit:
    """One instance's memory estimator, fitted online: how much of its KV budget slices may plan.

    The paper's estimator is exact for static batching (every request of a
    batch holds ``context + S`` until the batch ends) and multiplies the free
    memory by a fixed ζ < 1 for engines that use more than the token count.
    On a continuous-batching engine the plan errs the other way: a slice
    that ends early (its answer's end of sequence) never holds its whole
    ``S``, and it leaves the batch at once. Two online terms make the
    budget what the instance really holds:

    - ``usage``: the decayed ratio of the KV slices really reached (context
      plus the tokens they produced) to what they planned; the budget is
      divided by it (a plan that is twice what slices use may book twice
      the budget), never by less than 1 (no shrinking for slices that run
      to their end);
    - ``zeta``: a cap that shrinks by a fifth (down to 0.5) at every
      preemption seen on the instance (the plan over-filled it) and gives
      back 1 % per batch that completes without one (up to 1).

    The share of the budget slices may plan is ``zeta / usage``, at most 2.
    """

    def __init__(self) -> None:
        self.zeta = 1.0
        self._planned = 0.0
        self._used = 0.0

    @property
    def usage(self) -> float:
        if self._planned < 1.0:
            return 1.0
        return min(1.0, max(0.25, self._used / self._planned))

    @property
    def share(self) -> float:
        return min(2.0, self.zeta / self.usage)

    def observe(self, planned_tokens: int, used_tokens: int) -> None:
        if planned_tokens <= 0 or used_tokens < 0:
            return
        self._planned = self._planned * _DECAY + planned_tokens
        self._used = self._used * _DECAY + min(used_tokens, planned_tokens)

    def preempted(self) -> None:
        self.zeta = max(0.5, self.zeta * 0.8)

    def clean_batch(self) -> None:
        self.zeta = min(1.0, self.zeta + 0.01)


@dataclass
class InstanceModels:
    """What the slice scheduler knows about one instance: its own estimators."""

    serving: ServingTimeModel
    memory: MemoryModel
    serving_fit: ServingFit = field(default_factory=ServingFit)
    memory_fit: MemoryFit = field(default_factory=MemoryFit)

    @property
    def budget_tokens(self) -> float:
        return self.memory.budget_tokens * self.memory_fit.share

    def estimate_ms(
        self, batch: int, context_tokens: int, generation_tokens: int, cached_tokens: int = 0
    ) -> float:
        return self.serving_fit.scale * self.serving.serve_ms(
            batch, context_tokens, generation_tokens, cached_tokens
        )


@dataclass(frozen=True)
class InstanceShape:
    """What an instance's estimators are built from: its profile group and its engine's limits."""

    group: str
    max_num_batched_tokens: int = 2048
    kv_capacity_tokens: int = 65536
    block_size: int = 16
    max_model_len: int = 8192
    max_num_seqs: int = 256


class ModelBook:
    """Each instance's estimators (:class:`InstanceModels`), built from its :class:`InstanceShape`.

    One builder for both drivers (the router reads the shapes from the
    instances' metadata, the simulator from its engines' configs): the
    serving-time model comes from the profile group's predictor and the
    instance's chunk budget, model length and batch limit (shared by every
    instance of the same shape: fitting it is the costly part), the memory
    model from its own KV capacity and block size. An instance keeps its
    models, and so its online fits, while its shape is unchanged.
    """

    def __init__(self, predictor_for: Callable[[str], LatencyPredictor], config: SliceConfig) -> None:
        self._predictor_for = predictor_for
        self._config = config
        self._servings: dict[tuple[str, int, int, int], ServingTimeModel] = {}
        self._built: dict[str, tuple[InstanceShape, InstanceModels]] = {}

    def models(self, shapes: Mapping[str, InstanceShape]) -> dict[str, InstanceModels]:
        """The models of every instance in ``shapes`` (instance id -> shape), in its order."""
        out: dict[str, InstanceModels] = {}
        for instance, shape in shapes.items():
            known = self._built.get(instance)
            if known is not None and known[0] == shape:
                out[instance] = known[1]
                continue
            key = (shape.group, shape.max_num_batched_tokens, shape.max_model_len, shape.max_num_seqs)
            serving = self._servings.get(key)
            if serving is None:
                serving = ServingTimeModel(
                    self._predictor_for(shape.group),
                    max_num_batched_tokens=shape.max_num_batched_tokens,
                    max_batch=shape.max_num_seqs,
                    max_context_tokens=max(shape.max_model_len, 8),
                )
                self._servings[key] = serving
            memory = MemoryModel(
                kv_capacity_tokens=shape.kv_capacity_tokens,
                block_size=shape.block_size,
                headroom=self._config.kv_headroom,
                max_batch=shape.max_num_seqs,
            )
            built = InstanceModels(serving, memory)
            self._built[instance] = (shape, built)
            out[instance] = built
        return out


# --------------------------------------------------------------------------- flags


def add_slice_arguments(group: Any, *, interval_help: str) -> None:
    """``--slice-tokens`` and ``--slice-interval-ms`` (the router, ``up`` and ``simulate`` share them)."""
    group.add_argument(
        "--slice-tokens",
        type=int,
        default=DEFAULT_SLICE_TOKENS,
        metavar="S",
        help="slice mode: new tokens of a first slice; a resumed slice is at least as long as the answer "
        "so far, and long enough that re-prefilling its context costs at most a quarter of its decode "
        "(at most 8x S) (default: %(default)s)",
    )
    group.add_argument("--slice-interval-ms", type=float, metavar="MS", help=interval_help)


def slice_config_of(slice_tokens: int, interval_ms: float | None, **extra: Any) -> SliceConfig:
    """:class:`SliceConfig` from the flags' values; a ``ValueError`` names the flag as typed."""
    try:
        return SliceConfig(slice_tokens=slice_tokens, interval_ms=interval_ms, **extra)
    except ValueError as exc:
        flag = "--slice-tokens" if "slice_tokens" in str(exc) else "--slice-interval-ms"
        raise ValueError(f"{flag}: {exc}") from None


def slice_length(
    context_tokens: int,
    remaining_tokens: int,
    serving: ServingTimeModel,
    config: SliceConfig,
    generated_tokens: int = 0,
) -> int:
    """New tokens the next slice of a request may generate (≥ 1, ≤ ``remaining_tokens``).

    ``slice_tokens``, or longer, never more than 8 × ``slice_tokens``. The
    paper leaves the slice length fixed and shows (its §5.5) that it trades
    the batch size (longer slices book more KV) against the reschedules
    (each re-prefills the context, and here may move it to another
    instance and wait in that engine's queue). Its fixed 128 rests on long
    answers being rare; where they are not, they cross a boundary every
    128 tokens. Two rules lengthen a resumed slice:

    - ``grow_with_answer``: at least as long as the answer so far
      (``generated_tokens``), so slices double: a first slice stays short
      (most answers end in it, and it books little KV) while an answer that
      has shown itself long crosses O(log) boundaries. Measured on 26
      KV-limited scenarios: long-answer mixes 0.875-0.943x -> 0.908-0.998x
      of request dispatch, geometric mean 1.235 -> 1.270 (docs/papers.md);
    - ``recompute_share``: long enough that re-prefilling ``context_tokens``
      costs at most that share of the slice's own decode (batch of one, the
      cautious side), so the overhead per generated token stays bounded as
      the context grows.
    """
    base = config.slice_tokens
    length = base
    share = config.recompute_share
    if share is not None and context_tokens > 0:
        prefill = serving.prefill_ms(context_tokens)
        per_token = serving.decode.step_ms(1.0, float(context_tokens))
        if per_token > 0:
            length = max(base, min(8 * base, math.ceil(prefill / (share * per_token))))
    if config.grow_with_answer and generated_tokens > 0:
        length = max(length, min(8 * base, generated_tokens))
    return max(1, min(length, remaining_tokens))


# --------------------------------------------------------------------------- when slices pay


#: Preemptions per request under request dispatch from which slice dispatch is chosen (``auto``).
SLICE_WHEN_PREEMPTIONS_PER_REQUEST = 0.1


#: Tokens request dispatch recomputed for the requests its engines preempted (less their prefix-cache
#: hits), per prompt token dispatched, from which slice dispatch is chosen (``auto``): the preemption
#: line above in work, a preempted request recomputing about 2.5 mean prompts where nothing is cached
#: (its context so far, and the longest are preempted first; 1-4.5 over the rows of docs/papers.md).
SLICE_WHEN_RECOMPUTED_PER_PROMPT_TOKEN = 0.25


def slices_pay_recomputed(recomputed_tokens: float, prompt_tokens: float) -> bool:
    """Whether slice dispatch beats request dispatch on a fleet, from the prefill work request
    dispatch wasted there: the tokens its engines computed again for the requests they preempted,
    less their prefix-cache hits, against the prompt tokens of the requests it dispatched.

    The same regime line as :func:`slices_pay`, in work rather than in preemptions: a preemption
    behind a long cached prefix recomputes only the part past it, one of a long request much more
    than a prompt.
    """
    if prompt_tokens <= 0:
        return False
    return max(0.0, recomputed_tokens) / prompt_tokens >= SLICE_WHEN_RECOMPUTED_PER_PROMPT_TOKEN


def slices_pay(preemptions: int, requests: int) -> bool:
    """Whether slice dispatch beats request dispatch on a fleet, from what request dispatch did there.

    On continuous-batching engines request dispatch already returns each
    answer as it ends and batches at the iteration level, so the paper's
    gains over static batching are not there to take; what slices still
    buy is a KV plan that holds. Where the engines run out of KV, request
    dispatch lets them over-commit and preempt: the preempted requests are
    recomputed whole, often more than once, while slices plan their KV and
    (almost) never preempt, at the price of re-prefilling a context per
    slice (mostly served from the prefix cache when the slice resumes where
    it was) and of a schedule point's wait for a first slice. Measured on
    the simulator (``docs/papers.md``, the regime table) slices kept at
    least 0.95x the throughput, and mostly more (up to 2.6x), wherever
    request dispatch preempted about once per ten requests or more, except
    where answers run long (0.91-1.0x: a smaller decode batch), and lost
    (0.91-0.97x, lower attainment through the first slice's wait) where the
    KV held or preemptions were rarer.
    """
    if requests <= 0:
        return False
    return preemptions / requests >= SLICE_WHEN_PREEMPTIONS_PER_REQUEST


# --------------------------------------------------------------------------- the whole cycle


def kv_peak_of(held: Sequence[tuple[float, float]]) -> float:
    """The peak over time of the KV of slices ``(tokens held now, steps to their end)``.

    Each slice adds a token a step and leaves at its end, so the sum rises
    between two ends and falls at each: its peak is at an end ``k`` (or now),
    where the slices alive are those with at least ``k`` steps to go. Sorted
    by steps to go (longest first), the value at the m-th is the first m
    slices' tokens plus m times its steps (ties: the last of them counts them
    all). O(n log n).
    """
    if not held:
        return 0.0
    ordered = sorted(held, key=lambda h: -h[1])
    peak = now = sum(h[0] for h in ordered)  # now: every slice alive, nothing added yet
    total = 0.0
    for m, (tokens, steps) in enumerate(ordered, start=1):
        total += tokens
        if m < len(ordered) and ordered[m][1] == steps:
            continue
        peak = max(peak, total + m * steps)
    return max(peak, now)


@dataclass
class _Running:
    batch: SliceBatch
    unfinished: int
    #: KV each request of the batch plans to hold on this instance (its own block size).
    kv: dict[Hashable, int]


class SliceScheduler:
    """The pool, the schedule points and each instance's local queue, without a clock or I/O.

    The caller (the simulator in virtual time, the router's dispatcher in
    real time) drives it:

    1. :meth:`add` puts a request's first slice in the pool;
    2. at a schedule point, :meth:`schedule` batches the pool and offloads
       the batches max-min into per-instance local queues; the caller waits
       :meth:`interval_ms` for the next one;
    3. :meth:`admit` hands an instance the queued batches it can take now
       (one at a time, or, with ``overlap_batches``, while the KV its running
       slices plan to hold leaves room: continuous-batching engines run
       several batches at once);
    4. :meth:`finish` when a slice ends for good (done, failed or cancelled);
       :meth:`resume` when it ends with output still to generate: the next
       slice is placed at once (see below). Either frees the slice's planned
       KV and, with the batch's last slice, takes the batch's estimate off
       the instance's load. Then :meth:`admit` again.

    Every instance has its own estimators (:class:`InstanceModels`, given by
    :meth:`set_models`; without them every instance shares the models the
    scheduler was built with): a batch's serving time is estimated on each
    instance it could go to, the offloader sends it where it would finish
    first, and each instance's KV budget is its own. Batching uses a
    reference that does not depend on the order the fleet is listed in: the
    tightest KV budget (a batch then fits any instance) and the slowest
    serving model. Ties between instances go to the lower instance id.

    Resumed slices. The paper sends an unfinished request back to the pool
    to be batched with the next schedule point's arrivals. On a
    continuous-batching engine the batch a slice joins is the engine's
    running batch whatever the router grouped it with, so grouping buys
    nothing, while waiting for the next point stalls the client's stream
    for up to a whole interval plus a local queue. :meth:`resume` places the
    next slice at once instead: on the instance that would finish it first
    (its load plus this slice's estimate) among those whose planned KV has
    room for it now, the instance it just left always among them (it has
    just freed at least the slice's context), and admits it there ahead of
    any queued batch. A stream thus never waits for a schedule point or a
    local queue between its slices; the rebalancing the paper gets from
    re-pooling still happens, slice by slice.

    Instances are named by id; :meth:`set_instances` follows a changing fleet
    (a removed instance's queued batches go back to the pool).
    """

    def __init__(
        self, config: SliceConfig, serving: ServingTimeModel, memory: MemoryModel, instances: Sequence[str]
    ) -> None:
        self.config = config
        self.serving = serving
        self.memory = memory
        self.pool: list[SliceRequest] = []
        self._ids: list[str] = []
        self._models: dict[str, InstanceModels] = {}
        self._given: dict[str, InstanceModels] = {}
        self._loads: dict[str, float] = {}
        self._queues: dict[str, list[SliceBatch]] = {}
        self._running: dict[str, dict[int, _Running]] = {}
        self._planned_kv: dict[str, int] = {}
        #: Per instance: the prefix blocks its running slices reference (hash -> slices), and the KV
        #: tokens those blocks hold (once each, however many slices share them).
        self._refs: dict[str, dict[int, int]] = {}
        self._shared_kv: dict[str, int] = {}
        self._busy_mark: dict[str, float | None] = {}
        self._next_key = 0
        #: The driver's reader of a running slice's context now (prompt + every token produced so
        #: far, by request key; None: unknown). With it the KV a running slice will still add is
        #: counted from its progress (:meth:`committed_kv`); without it, whole from its start.
        self.progress: Callable[[Hashable], int | None] | None = None
        #: The driver's reader of the KV an instance holds for requests this scheduler did not place
        #: (an instance shared with request dispatch: ``auto`` after its switch), as
        #: :func:`kv_peak_of` takes them (tokens held now, steps to their expected end). The plan
        #: counts them beside its own slices (:meth:`committed_kv`); None: it owns the instances' KV.
        self.residents: Callable[[str], list[tuple[float, float]]] | None = None
        #: The driver's reader of the engines' prefix caches: for a prefix's chained block hashes, how
        #: many leading blocks each instance holds (the router's prefix index). A batch is priced
        #: without the prefill of what its instance caches; None: only this plan's own running and
        #: queued slices say where a prefix is.
        self.cached: Callable[[tuple[int, ...]], Mapping[str, int]] | None = None
        self.batches = 0
        self.schedule_points = 0
        self.resumed = 0
        self.moved = 0
        #: Resumed slices shortened to the room where they ran, and those that waited for room there.
        self.shortened = 0
        self.waited = 0
        #: Keys of the resumed slices waiting at a queue's head for room (``continue_within_kv``).
        self._held_back: set[Hashable] = set()
        self._blocked_since: dict[Hashable, float] = {}
        self.set_instances(instances)

    @property
    def instances(self) -> tuple[str, ...]:
        return tuple(self._ids)

    def models(self, instance: str) -> InstanceModels:
        """The estimators of ``instance`` (its own, or the shared ones)."""
        found = self._models.get(instance)
        if found is None:
            found = self._given.get(instance) or InstanceModels(self.serving, self.memory)
            self._models[instance] = found
        return found

    def set_models(self, models: dict[str, InstanceModels]) -> None:
        """Per-instance estimators; an instance keeps its online fits while its profile is unchanged."""
        for instance, m in models.items():
            old = self._models.get(instance)
            if old is not None and old.serving is m.serving and old.memory == m.memory:
                continue
            if old is not None:
                m.serving_fit, m.memory_fit = old.serving_fit, old.memory_fit
            self._given[instance] = m
            self._models[instance] = m

    def load_ms(self, instance: str) -> float:
        """The instance's outstanding estimated work (queued and running batches)."""
        return self._loads[instance]

    def queued(self, instance: str) -> int:
        return len(self._queues[instance])

    def planned_kv(self, instance: str) -> int:
        return self._planned_kv[instance] + self._shared_kv.get(instance, 0)

    def _need(self, instance: str, requests: Iterable[SliceRequest]) -> int:
        """KV ``requests`` add to ``instance`` beside its running slices (:func:`kv_need`)."""
        return kv_need(self.models(instance).memory, requests, self._refs.get(instance, {}))

    def _hold(self, instance: str, request: SliceRequest, sign: int) -> None:
        """Count ``request``'s prefix blocks in (``sign`` 1) or out of (-1) ``instance``'s running slices."""
        if not request.prefix:
            return
        refs = self._refs.setdefault(instance, {})
        for h in request.prefix:
            count = refs.get(h, 0) + sign
            if count > 0:
                if h not in refs:
                    self._shared_kv[instance] = self._shared_kv.get(instance, 0) + request.prefix_block_tokens
                refs[h] = count
            elif h in refs:
                del refs[h]
                self._shared_kv[instance] -= request.prefix_block_tokens

    def budget_kv(self, instance: str) -> float:
        """The KV ``instance``'s slices may book.

        With the driver's progress, the headroom times the preemption cap ζ:
        :meth:`committed_kv` is a bound (every running slice to its end), and
        stretching the budget as well by how little of their booking slices
        use (the early ends, :attr:`MemoryFit.usage`) made the engines
        preempt (22 times where request dispatch did 210: interactive-batch,
        16k, 6 req/s). Without progress, the budget scaled by that usage
        (:attr:`InstanceModels.budget_tokens`), which stands in for the
        progress it cannot see."""
        m = self.models(instance)
        if self.progress is None:
            return m.budget_tokens
        return m.memory.budget_tokens * min(1.0, m.memory_fit.zeta)

    def committed_kv(self, instance: str) -> float:
        """The KV ``instance``'s running slices will hold at their peak, from their progress.

        The paper's memory model is static batching's: every request of a
        batch holds its context plus the whole slice ``S`` until the batch
        ends, so a batch is booked at ``Σ(context + S)``. On a
        continuous-batching engine the slices of an instance started at
        different times and each grows by a token a step: a slice half way
        through holds half its ``S`` and leaves first. Booked whole from its
        start, the plan kept the engines at about 85 % of their KV where
        answers are long (resumed slices of long contexts run up to 8 S), and
        lost throughput to request dispatch (``interactive-batch``, 0.85×).
        With the driver's progress (:attr:`progress`) the booking is the
        exact peak over the running slices' remaining steps (the sum over the
        slices still alive at each slice's end: :func:`kv_peak_of`), at most
        the whole booking; slices whose progress is unknown count whole.
        Slices admitted next count at their whole ``context + S`` from now
        (their start waits for their prefill, a delay nobody knows).
        """
        held = self._held(instance)
        others = self._residents(instance)
        # The prefix blocks the running slices share, held once, counted as held to the end (a bound:
        # they leave with the last slice that references them).
        shared = float(self._shared_kv.get(instance, 0))
        if held is None:
            planned = float(self._planned_kv.get(instance, 0)) + shared
            return planned + kv_peak_of(others) if others else planned
        return shared + (kv_peak_of(held + others) if others else kv_peak_of(held))

    def _residents(self, instance: str) -> list[tuple[float, float]]:
        """The requests ``instance`` runs that this scheduler did not place (:attr:`residents`).

        Under ``auto`` the requests request dispatch placed before the switch keep running where
        they are, and a plan that counted only its own slices filled the KV they hold: the engines
        preempted the slices beside them (304 preemptions after the switch where slices from the
        start had none: docs/papers.md, seed 002). Counted at their peak with the slices (each
        holds its context now and grows a token a step to its expected end), the slices fit beside
        them and take their room as they end."""
        read = self.residents
        return read(instance) if read is not None else []

    def _held(self, instance: str) -> list[tuple[float, float]] | None:
        """The running slices of ``instance`` as :func:`kv_peak_of` takes them; None without progress."""
        read = self.progress
        running = self._running.get(instance)
        if read is None or not running:
            return None
        held: list[tuple[float, float]] = []
        for entry in running.values():
            for r in entry.batch.requests:
                planned = entry.kv.get(r.key)
                if planned is None:
                    continue  # ended
                now = read(r.key)
                final = r.context_tokens + r.slice_tokens
                if now is None or now < r.context_tokens:
                    held.append((float(planned), 0.0))
                    continue
                # The blocks' rounding stays with the slice to its end.
                now = min(now, final)
                held.append((float(now + planned - final), float(final - now)))
        return held

    def set_instances(self, instances: Sequence[str]) -> None:
        """Follow the fleet: new instances start idle; a removed one's queued batches return to the pool."""
        ids = list(dict.fromkeys(instances))
        for gone in [i for i in self._ids if i not in ids]:
            for batch in self._queues.pop(gone):
                self.pool.extend(batch.requests)
                for r in batch.requests:
                    self._blocked_since.pop(r.key, None)
                self._held_back.difference_update(r.key for r in batch.requests)
            del self._loads[gone]
            # Running slices of a removed instance end through finish() when their streams fail.
            if not self._running[gone]:
                del self._running[gone]
                del self._planned_kv[gone]
                self._refs.pop(gone, None)
                self._shared_kv.pop(gone, None)
        for new in ids:
            if new not in self._loads:
                self._loads[new] = 0.0
                self._queues[new] = []
                self._running.setdefault(new, {})
                self._planned_kv.setdefault(new, 0)
                self._busy_mark.setdefault(new, None)
        self._ids = ids

    def add(self, request: SliceRequest) -> None:
        self.pool.append(request)

    def _reference(self) -> tuple[ServingTimeModel, MemoryModel]:
        """The batcher's models, whatever order the fleet is listed in (see the class doc)."""
        if not self._ids:
            return self.serving, self.memory
        ordered = sorted(self._ids)
        probe = (8, 8 * 512, self.config.slice_tokens)
        serving = max(ordered, key=lambda i: self.models(i).estimate_ms(*probe))
        memory = min(ordered, key=lambda i: (self.models(i).budget_tokens, self.models(i).memory.max_batch))
        m = self.models(memory)
        tight = MemoryModel(
            kv_capacity_tokens=m.memory.kv_capacity_tokens,
            block_size=max(self.models(i).memory.block_size for i in ordered),
            headroom=m.memory.headroom * min(1.0, m.memory_fit.zeta),
            max_batch=min(self.models(i).memory.max_batch for i in ordered),
        )
        return self.models(serving).serving, tight

    def _estimate(self, instance: str, batch: SliceBatch, cached_tokens: int = 0) -> float:
        gen = max((r.slice_tokens for r in batch.requests), default=0)
        return self.models(instance).estimate_ms(
            len(batch.requests), batch.context_tokens, gen, cached_tokens
        )

    def _cached_tokens(
        self, batch: SliceBatch, instances: Sequence[str], here: Mapping[str, set[int]]
    ) -> dict[str, int]:
        """Context tokens of ``batch`` each instance would not prefill again: the leading prefix blocks
        of each request that the instance caches (:attr:`cached`) or that a slice running or queued
        there brings (``here``)."""
        out = dict.fromkeys(instances, 0)
        found: dict[tuple[int, ...], Mapping[str, int]] = {}
        for r in batch.requests:
            if not r.prefix:
                continue
            if self.cached is not None and r.prefix not in found:
                found[r.prefix] = self.cached(r.prefix)
            engine = found.get(r.prefix, {})
            for i in instances:
                k = leading_blocks(r.prefix, here.get(i, ()))
                out[i] += max(k, engine.get(i, 0)) * r.prefix_block_tokens
        return out

    def _marginal(
        self, instance: str, request: SliceRequest, cached: bool = False, continues: bool = False
    ) -> float:
        """What ``request``'s slice adds to ``instance``'s work: its prefill and its share of the decode.

        Eq. 1 prices every slice with the prefill of its input. With the context's full blocks
        in the instance's prefix cache (``cached``: the slice resumes where it was) the engine
        still runs a prefill step, over the last partial block, and a prefill step is not free:
        the profile's prefill of a few tokens is most of a step (49 ms for 1 token against a
        17 ms decode step on the bundled 7B profile), and every running slice of the instance
        waits for it. Priced at nothing, as it was, staying looked free while a slice boundary
        cost the instance a whole step. A slice that ``continues`` its run (the engine never
        stopped it: :attr:`SliceConfig.continue_in_place`) has nothing to prefill: its decode only.
        """
        m = self.models(instance)
        cost = m.serving.marginal_ms(request.context_tokens, request.slice_tokens)
        if continues:
            cost -= m.serving.prefill_ms(request.context_tokens)
        elif cached:
            bs = m.memory.block_size
            tail = request.context_tokens % bs or min(bs, request.context_tokens)
            cost -= m.serving.prefill_ms(request.context_tokens) - m.serving.prefill_ms(tail)
        return m.serving_fit.scale * max(cost, 0.0)

    def schedule(self) -> list[tuple[SliceBatch, str]]:
        """Batch the whole pool and offload it max-min; the (batch, instance) pairs, longest batch first.

        Each batch, longest first (on the reference model), goes to the
        instance where it would finish first: least ``load + its estimate
        there`` (on a homogeneous fleet, the least-loaded instance: the
        paper's max-min). The batch carries that instance's estimate, which
        is what its completion takes off the load.
        """
        self.schedule_points += 1
        if not self.pool or not self._ids:
            return []
        # The batcher's work grows with the pool times the largest batch: bound what one point takes.
        cap = self.config.max_batching_slices
        pool, self.pool = self.pool[:cap], self.pool[cap:]
        serving, memory = self._reference()
        batches = batch_requests(pool, serving, memory)
        ordered = sorted(self._ids)
        # Where each prefix is already: blocks the running and queued slices of an instance bring.
        here: dict[str, set[int]] = {}
        if any(r.prefix for r in pool):
            for i in ordered:
                held = set(self._refs.get(i, {}))
                for queued in self._queues[i]:
                    for r in queued.requests:
                        held.update(r.prefix)
                here[i] = held
        placed = []
        for b in sorted(range(len(batches)), key=lambda k: (-batches[k].serve_ms, k)):
            batch = batches[b]
            cached = self._cached_tokens(batch, ordered, here) if here else {}
            costs = {i: self._estimate(i, batch, cached.get(i, 0)) for i in ordered}
            instance = min(ordered, key=lambda i: (self._loads[i] + costs[i], i))
            mine = SliceBatch(batch.requests, costs[instance], batch.kv_tokens)
            self._loads[instance] += mine.serve_ms
            self._queues[instance].append(mine)
            if here:
                for r in batch.requests:
                    here[instance].update(r.prefix)
            placed.append((mine, instance))
        self.batches += len(batches)
        return placed

    def interval_ms(self) -> float:
        """Time to the next schedule point (:func:`next_interval_ms` over the backlog).

        One batch at a time: the backlog is the load (queued and running
        batches), as in the original. With overlapping batches an instance
        starts new work as soon as its KV has room, so only what waits in
        its local queue is backlog.
        """
        if self.config.overlap_batches:
            backlog = [sum(b.serve_ms for b in self._queues[i]) for i in self._ids]
        else:
            backlog = [self._loads[i] for i in self._ids]
        return next_interval_ms(backlog, self.config)

    def _start(self, instance: str, batch: SliceBatch, now: float | None) -> int:
        for r in batch.requests:
            self._blocked_since.pop(r.key, None)
        running = self._running[instance]
        if not running and now is not None:
            self._busy_mark[instance] = now
        key = self._next_key
        self._next_key += 1
        memory = self.models(instance).memory
        # Each slice books its own part; the prefix blocks it shares are counted once per instance.
        kv = {
            r.key: memory.request_kv_tokens(r.context_tokens - r.shared_tokens, r.slice_tokens)
            for r in batch.requests
        }
        for r in batch.requests:
            self._hold(instance, r, 1)
        running[key] = _Running(batch, len(batch.requests), kv)
        self._planned_kv[instance] += sum(kv.values())
        return key

    def admit(self, instance: str, now: float | None = None) -> list[tuple[int, SliceBatch]]:
        """The queued batches ``instance`` takes now, each with its key for :meth:`finish`.

        In queue order; behind a head whose first slice does not fit, the later batches that do
        (:attr:`SliceConfig.backfill`, :meth:`_backfill`).

        ``now`` (ms, any origin) lets the instance's serving-time fit see how
        long it is busy; without it the fit stays as it is.
        """
        queue = self._queues.get(instance)
        if queue is None:
            return []
        out = self._take_held_back(instance, now) if self._held_back else []
        if not queue:
            return out
        running = self._running[instance]
        budget = self.budget_kv(instance)
        # Requests placed by another dispatcher hold KV here too: a head is then checked for room
        # even where no slice of this plan runs.
        shared = bool(self._residents(instance))
        while queue:
            batch = queue[0]
            first = batch.requests[0]
            if len(batch.requests) == 1 and first.key in self._held_back:
                # A resumed slice that found no room: it goes on as a running request's continuation
                # (within the whole KV, shortened to the room), ahead of new work.
                part = self._fitted(instance, first) if running or shared else first
                if part is None:
                    break
                self._held_back.discard(first.key)
                queue.pop(0)
                started = SliceBatch((part,), batch.serve_ms, self._need(instance, (part,)))
                out.append((self._start(instance, started, now), started))
                continue
            if running or shared:
                if running and not self.config.overlap_batches:
                    break
                room = budget - self.committed_kv(instance)
                need = self._need(instance, batch.requests)
                if need > room and self.config.backfill and self._head_waited(first.key, now):
                    # Passed for its intervals: it starts within the room kept for running slices,
                    # less a block of growth for each of them (what one needs to go on at its end).
                    slices = sum(e.unfinished for e in running.values())
                    block = self.models(instance).memory.block_size
                    room = self.ceiling_kv(instance) - self.committed_kv(instance) - slices * block
                if need > room:
                    head = self._split(instance, batch, room) if self.config.split_batches else None
                    if head is None:
                        if self.config.backfill:
                            out.extend(self._backfill(instance, now, budget))
                        break
                    queue[0] = head[1]
                    batch = head[0]
                    out.append((self._start(instance, batch, now), batch))
                    break
            queue.pop(0)
            out.append((self._start(instance, batch, now), batch))
        return out

    def _head_waited(self, key: Hashable, now: float | None) -> bool:
        """Whether the blocked queue head ``key`` has waited :attr:`SliceConfig.head_wait_intervals`
        schedule intervals for room (its wait starts the first time it is found blocked).

        Backfill lets smaller work take the room a blocked head cannot use yet, and nothing else
        bounds how long the head is passed: where small first slices keep coming, the room a large
        one needs (its whole context and slice) seldom opens within the budget. Least-requests'
        engines admit their queue in order, so there a large prompt waits for its blocks only.
        Traced on the 600-request long-answer runs (docs/papers.md, seed 002): codegen on 8k of KV
        (seed 23), mean time to first token 0.6 s in the smallest prompt quartile against 6.1 s in
        the largest (least-requests 1.7 and 1.9 s); 99 % of the requests done within 3 s of
        least-requests, and the run ended by a 2,048-token answer with a 1,794-token prompt whose
        first slice waited 21.5 s (least-requests 5.5 s). Once passed for ``head_wait_intervals``
        intervals, the head goes on as a running slice's continuation does: within the whole KV
        times the preemption cap (:meth:`ceiling_kv`), the room the headroom keeps for the slices
        already running, which backfill never takes, less one block of growth per running slice
        (so each can still go on at its slice's end: without it, twice as many continued slices
        found no room and waited, and a stream stalled 5.2 s at p99 on 8k of KV). The plan stays
        within the KV, so no engine preempts for it; what it costs is continuations finding less
        of that room (shortened, or waiting, which re-prefills). Three intervals: one lost three
        runs of the suite's interactive-batch set-ups (continuations waiting), two and three did
        about as well on the rest (docs/papers.md). Only with backfill: a queue kept in order
        passes nobody.
        """
        wait = self.config.head_wait_intervals
        if wait is None or now is None:
            return False
        since = self._blocked_since.setdefault(key, now)
        return now - since >= wait * self.interval_ms()

    def _backfill(self, instance: str, now: float | None, budget: float) -> list[tuple[int, SliceBatch]]:
        """Queued batches behind a blocked head whose slices fit ``instance``'s planned KV now.

        The queue head's first slice does not fit the room the running slices leave (``budget``
        less :meth:`committed_kv`); a batch behind it whose first slice does fit starts now, whole
        or split to the room (:meth:`_split`), scanning the queue in order. The paper's instance
        serves its local queue one static batch at a time, so an order is all it has; an engine
        that batches continuously runs whatever fits beside its running requests, and kept in
        order the room the head cannot use stayed empty while work waited behind it (codegen on
        8k of KV, 6 instances: the plan at 84 % of a 90 % budget while work waited, 0.926x of
        least-requests; with backfill 0.994x). A resumed slice waiting for room
        (``continue_within_kv``) is never passed: it sits at the head and stops the scan before
        this is called. The head gets no reservation; how long it may be passed is bounded by
        :attr:`SliceConfig.head_wait_intervals` (:meth:`_head_waited`), after which it takes room
        backfill never uses (docs/papers.md, seed 002).
        """
        out: list[tuple[int, SliceBatch]] = []
        queue = self._queues[instance]
        k = 1
        while k < len(queue):
            batch = queue[k]
            first = batch.requests[0]
            room = budget - self.committed_kv(instance)
            if first.key in self._held_back or self._need(instance, (first,)) > room:
                k += 1
                continue
            if self._need(instance, batch.requests) <= room:
                queue.pop(k)
                out.append((self._start(instance, batch, now), batch))
                continue
            parts = self._split(instance, batch, room)
            if parts is None:
                k += 1
                continue
            queue[k] = parts[1]
            out.append((self._start(instance, parts[0], now), parts[0]))
            k += 1
        return out

    def _take_held_back(self, instance: str, now: float | None) -> list[tuple[int, SliceBatch]]:
        """Resumed slices waiting at another instance's queue head that fit ``instance`` now.

        A slice that waited has left its engine (its context is prefilled again wherever it
        starts), so the first instance with room for it is as good as the one it left: it starts
        there, within that instance's whole KV like any continuation, ahead of new work."""
        out: list[tuple[int, SliceBatch]] = []
        for other in sorted(self._ids):
            if other == instance:
                continue
            queue = self._queues[other]
            while queue and len(queue[0].requests) == 1 and queue[0].requests[0].key in self._held_back:
                waiting = queue[0]
                part = self._fitted(instance, waiting.requests[0])
                if part is None:
                    break
                queue.pop(0)
                self._held_back.discard(part.key)
                self._loads[other] = max(0.0, self._loads[other] - waiting.serve_ms)
                cost = self._marginal(instance, part)
                self._loads[instance] += cost
                self.moved += 1
                started = SliceBatch((part,), cost, self._need(instance, (part,)))
                out.append((self._start(instance, started, now), started))
        return out

    def _split(self, instance: str, batch: SliceBatch, room: float) -> tuple[SliceBatch, SliceBatch] | None:
        """The batch's first slices that fit ``room`` KV tokens on ``instance``, and the rest.

        A continuous-batching engine merges whatever it is given into its
        running batch, so a queued batch need not wait whole for room: its
        slices start as the KV frees, the rest staying at the queue's head.
        Each part carries its share of the batch's estimate (by context and
        slice tokens), so the load ledger still sums to what was added.
        None when not even the first slice fits.
        """
        taken = 0
        for need in kv_needs(self.models(instance).memory, batch.requests, self._refs.get(instance, {})):
            if need > room:
                break
            taken += 1
        if taken == 0 or taken == len(batch.requests):
            return None
        head, rest = batch.requests[:taken], batch.requests[taken:]
        weight = [r.context_tokens + r.slice_tokens for r in batch.requests]
        share = sum(weight[:taken]) / max(sum(weight), 1)
        memory = self.models(instance).memory
        return (
            SliceBatch(head, batch.serve_ms * share, kv_need(memory, head)),
            SliceBatch(rest, batch.serve_ms * (1.0 - share), kv_need(memory, rest)),
        )

    def _end(
        self, instance: str, key: int, request: SliceRequest, now: float | None, produced: int | None
    ) -> bool:
        running = self._running[instance]
        entry = running[key]
        if request.key in entry.kv:
            self._hold(instance, request, -1)
        planned = entry.kv.pop(request.key, 0)
        self._planned_kv[instance] -= planned
        if produced is not None and instance in self._loads:
            own = request.context_tokens - request.shared_tokens
            self.models(instance).memory_fit.observe(planned, own + produced)
        entry.unfinished -= 1
        if entry.unfinished > 0:
            return False
        del running[key]
        if instance in self._loads:
            m = self.models(instance)
            mark = self._busy_mark.get(instance)
            if now is not None and mark is not None:
                scale = m.serving_fit.scale
                m.serving_fit.observe(now - mark, entry.batch.serve_ms / scale if scale > 0 else 0.0)
                self._busy_mark[instance] = now if running else None
            m.memory_fit.clean_batch()
            # Subtract the same estimate that was added: estimation errors never accumulate
            # (and a drained instance reads exactly idle, without rounding residue).
            drained = not running and not self._queues[instance]
            self._loads[instance] = 0.0 if drained else max(0.0, self._loads[instance] - entry.batch.serve_ms)
        elif not running:
            del self._running[instance]
            del self._planned_kv[instance]
            self._refs.pop(instance, None)
            self._shared_kv.pop(instance, None)
        return True

    def finish(
        self,
        instance: str,
        key: int,
        request: SliceRequest,
        now: float | None = None,
        produced: int | None = None,
    ) -> bool:
        """Slice ``request`` of batch ``key`` on ``instance`` ended; True when it was the batch's last.

        ``produced`` (the tokens the slice generated, when known) feeds the
        instance's memory fit.
        """
        return self._end(instance, key, request, now, produced)

    def ceiling_kv(self, instance: str) -> float:
        """The KV a slice continued where it ran may bring ``instance``'s plan up to.

        The engine preempts only when its blocks run out, so a plan of upper bounds (every running
        slice booked to its end) that stays within the whole cache never makes it preempt. New
        work is admitted within the headroom (:meth:`budget_kv`); what the headroom keeps is room
        for the slices already running to go on, as an engine serves its running requests before
        it admits new ones. Times the preemption cap ζ, as the budget.
        """
        m = self.models(instance)
        return m.memory.kv_capacity_tokens * min(1.0, m.memory_fit.zeta)

    def _fitted(self, instance: str, following: SliceRequest) -> SliceRequest | None:
        """``following`` as it may continue on ``instance`` (its KV held there): whole, or shortened
        to the room under :meth:`ceiling_kv`; None when not even a block of growth fits."""
        memory = self.models(instance).memory
        ceiling = self.ceiling_kv(instance)
        held = self._held(instance) or []
        others = self._residents(instance)
        shared = float(self._shared_kv.get(instance, 0))

        def need(tokens: int) -> int:
            # Its own part and any prefix block the instance's running slices do not hold already.
            return self._need(instance, (replace(following, slice_tokens=tokens),))

        def peak(tokens: int) -> float:
            # Its context is held from now and grows a token a step to the slice's end: it weighs on
            # the instance's peak only while it runs, so a short slice fits where a long one does not.
            kv = need(tokens)
            return shared + kv_peak_of([*held, *others, (float(kv - tokens), float(tokens))])

        if self.progress is None:
            room = ceiling - self.committed_kv(instance)
            if need(following.slice_tokens) <= room:
                return following
            tokens = int(room) // memory.block_size * memory.block_size - need(0)
        else:
            if peak(following.slice_tokens) <= ceiling:
                return following
            lo, hi = 0, following.slice_tokens  # peak(lo) fits (or lo = 0), peak(hi) does not
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if peak(mid) <= ceiling:
                    lo = mid
                else:
                    hi = mid
            tokens = lo
        if tokens < min(memory.block_size, following.slice_tokens):
            return None
        self.shortened += 1
        return replace(following, slice_tokens=min(tokens, following.slice_tokens))

    def resume(
        self,
        instance: str,
        key: int,
        request: SliceRequest,
        following: SliceRequest,
        now: float | None = None,
        produced: int | None = None,
    ) -> tuple[str, int, SliceBatch] | None:
        """End ``request``'s slice and place ``following`` (its next slice) at once (see the class doc).

        Returns the instance, the batch key for :meth:`finish` / :meth:`resume`
        and the one-slice batch (its slice may be shorter than ``following``'s:
        ``continue_within_kv``); the slice is admitted (the caller starts it).
        None when it fits nowhere now: it waits at the head of ``instance``'s
        queue, and the first instance whose :meth:`admit` finds room for it
        starts it, ahead of new work.
        """
        self._end(instance, key, request, now, produced)
        self.resumed += 1
        ordered = sorted(self._ids)
        within = self.config.continue_within_kv
        options = []
        for i in ordered:
            here = i == instance
            part = following
            if here and within:
                fitted = self._fitted(i, following)
                if fitted is None:
                    continue
                part = fitted
            kv = self._need(i, (part,))
            if not here and self.committed_kv(i) + kv > self.budget_kv(i):
                continue
            cost = self._marginal(
                i,
                part,
                cached=self.config.prefix_cache and here,
                continues=self.config.continue_in_place and here,
            )
            options.append((self._loads[i] + cost, i, cost, kv, part))
        if not options and instance in self._loads and within:
            # Nowhere has room: it waits for its instance's next free room, ahead of queued work.
            self.waited += 1
            kv = self._need(instance, (following,))
            cost = self._marginal(instance, following)
            self._queues[instance].insert(0, SliceBatch((following,), cost, kv))
            self._held_back.add(following.key)
            self._loads[instance] += cost
            return None
        if not options:  # the instance left the fleet: any instance, least loaded
            for i in ordered:
                kv = self._need(i, (following,))
                cost = self._marginal(i, following)
                options.append((self._loads[i] + cost, i, cost, kv, following))
        if not options:
            raise ValueError("resume needs at least one instance")
        _, target, cost, kv, part = min(options, key=lambda o: (o[0], o[1]))
        if target != instance:
            self.moved += 1
        batch = SliceBatch((part,), cost, kv)
        self._loads[target] += cost
        return target, self._start(target, batch, now), batch

    def preempted(self, instance: str) -> None:
        """The instance preempted a request: its plan over-filled the KV (the memory fit learns it)."""
        if instance in self._ids:
            self.models(instance).memory_fit.preempted()
