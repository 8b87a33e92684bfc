"""The ``sim`` engine's model: a token-level continuous-batching scheduler without a clock.

:class:`SimCore` is the part of the simulated engine that decides what one
engine step contains and what it produces. It never sleeps and never reads a
clock: a caller asks for the next step (:meth:`SimCore.schedule`), lets its
duration pass however it likes — ``asyncio.sleep`` in the real-time
:class:`workers.sim_engine.SimEngine`, a virtual clock in a cluster simulator —
and then applies it (:meth:`SimCore.finish_step`). Requests may be added or
aborted between the two calls.

The model follows vLLM's scheduler where it matters for routing:

- every step first gives each running request in decode one token, then fills
  the rest of the ``max_num_batched_tokens`` budget with prefill chunks,
  first-come first-served (running prefills before waiting requests);
- the KV cache has ``kv_capacity_tokens // block_size`` blocks; a step that
  cannot allocate a block for a running request preempts the newest running
  request (its KV is freed, it goes back to the front of the waiting queue
  and is recomputed later; its generated tokens are kept, nothing is lost);
- a request samples one token at the end of the step that computes its whole
  context; a PD prefill (``hold_kv``) then keeps its KV blocks until
  :meth:`SimCore.release_held` frees them;
- a running request's token budget can be raised in place
  (:meth:`SimCore.extend`): it goes on decoding in the running batch, its KV
  and its place kept, as an engine does when whoever asked for the tokens lets
  the request keep generating (a router whose slice cap is its own count, not
  the engine's). A request added with ``pause_at_end`` stops at its last token
  without leaving the batch, so its driver can decide there whether it goes on
  (``extend``) or ends (``abort``) before the next step;
- a step lasts ``ttft(prefill tokens) + tpot(decode batch, context)`` from the
  engine's *ground-truth* profiles (see :class:`ProfileCostModel`), times
  ``1 + kv_slowdown * KV use``. The ground truth is the hardware the engine
  runs on; it is a model object of its own, never the router's predictor, so a
  simulation can put the router in front of hardware it was not profiled on
  (another profile, ``speed_factor``, ``noise``, ``kv_slowdown``).

Load counters are kept incrementally so :meth:`SimCore.load` is cheap (the
properties ``num_waiting`` ... ``num_used_kv_tokens`` cost nothing);
:meth:`SimCore.check_invariants` recomputes them for tests:

- ``num_uncomputed_prefill_tokens``: context tokens still to compute before a
  request's next sample, over waiting and running requests in prefill (a
  preempted request counts its whole context again); a chunk counts until
  the step computing it has finished;
- ``num_decode_requests`` / ``num_decode_tokens``: requests that will decode
  here (``counts_as_decode``), waiting or running, and the sum of their
  current context lengths;
- ``num_used_kv_tokens``: allocated blocks (held prefills included) times the
  block size.
"""

from __future__ import annotations

import enum
import math
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from engine.interface import (
    DuplicateRequestError,
    EngineLoad,
    EngineOverloadedError,
    InvalidRequestError,
    StepRecord,
)
from predictor import LatencyPredictor


def _doc(text: str) -> dict[str, Any]:
    return {"doc": text}


@dataclass(frozen=True)
class SimConfig:
    """Everything that shapes the simulated engine (the ``sim`` backend's command-line flags)."""

    max_num_batched_tokens: int = field(
        default=2048, metadata=_doc("token budget of one engine step (decode tokens + prefill chunks)")
    )
    kv_capacity_tokens: int = field(default=65536, metadata=_doc("KV cache size in tokens"))
    block_size: int = field(default=16, metadata=_doc("tokens per KV cache block"))
    max_model_len: int = field(default=8192, metadata=_doc("longest prompt + output accepted, in tokens"))
    max_num_seqs: int = field(default=256, metadata=_doc("most requests running in one step"))
    max_waiting_requests: int = field(
        default=4096, metadata=_doc("bound on the waiting queue; beyond it new requests are refused")
    )
    speed_factor: float = field(
        default=1.0,
        metadata=_doc("the engine runs this many times faster than the profile (2.0 halves each step)"),
    )
    noise: float = field(
        default=0.0, metadata=_doc("relative standard deviation of the seeded step-time noise (0 = none)")
    )
    seed: int = field(default=0, metadata=_doc("seed of the step-time noise"))
    kv_slowdown: float = field(
        default=0.0,
        metadata=_doc(
            "ground truth only: a step takes this fraction longer with a full KV cache (linear in KV use)"
        ),
    )
    eos_probability: float = field(
        default=0.0, metadata=_doc("chance that each output token is EOS (ends the request early)")
    )
    kv_bytes_per_token: int = field(
        default=57344, metadata=_doc("KV bytes per token, for the PD transfer time (Qwen2.5-7B bf16: 57344)")
    )
    kv_bandwidth_gbps: float = field(
        default=100.0, metadata=_doc("bandwidth of a PD KV transfer, in gigabits per second")
    )
    kv_hold_timeout_s: float = field(
        default=30.0, metadata=_doc("a prefill's KV is freed if no decode pulls it within this time")
    )
    max_recent_admitted_ids: int = field(
        default=256, metadata=_doc("how many recently admitted request ids the load reports")
    )
    max_recent_steps: int = field(default=32, metadata=_doc("how many recent step samples the load reports"))
    prefix_cache_block_tokens: int = field(
        default=0,
        metadata=_doc(
            "tokens per prefix-cache block (a multiple of block_size); 0 = no prefix caching. "
            "KV of full prompt blocks stays cached by content after its request ends, LRU-evicted"
        ),
    )
    max_kv_events: int = field(
        default=65536,
        metadata=_doc(
            "bound on the prefix-cache events kept for a reader; past it they are dropped and "
            "the reader resynchronises from the cache's contents"
        ),
    )

    def __post_init__(self) -> None:
        positive_ints = (
            "max_num_batched_tokens",
            "kv_capacity_tokens",
            "block_size",
            "max_model_len",
            "max_num_seqs",
            "max_waiting_requests",
            "kv_bytes_per_token",
            "max_recent_admitted_ids",
            "max_recent_steps",
            "max_kv_events",
        )
        for name in positive_ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be an integer > 0, got {value!r}")
        for name in ("speed_factor", "kv_bandwidth_gbps", "kv_hold_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if not (math.isfinite(self.kv_slowdown) and 0.0 <= self.kv_slowdown <= 10.0):
            raise ValueError(f"kv_slowdown must be in [0, 10], got {self.kv_slowdown!r}")
        if not (math.isfinite(self.noise) and 0.0 <= self.noise < 1.0):
            raise ValueError(f"noise must be in [0, 1), got {self.noise!r}")
        if not (math.isfinite(self.eos_probability) and 0.0 <= self.eos_probability <= 1.0):
            raise ValueError(f"eos_probability must be in [0, 1], got {self.eos_probability!r}")
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(
                f"max_num_seqs ({self.max_num_seqs}) must not exceed max_num_batched_tokens "
                f"({self.max_num_batched_tokens}): every running decode needs one token of the step budget"
            )
        if (
            isinstance(self.prefix_cache_block_tokens, bool)
            or not isinstance(self.prefix_cache_block_tokens, int)
            or self.prefix_cache_block_tokens < 0
            or self.prefix_cache_block_tokens % self.block_size
        ):
            raise ValueError(
                f"prefix_cache_block_tokens must be 0 (off) or a positive multiple of block_size ({self.block_size}), "
                f"got {self.prefix_cache_block_tokens!r}"
            )
        if self.kv_capacity_tokens < self.block_size:
            raise ValueError(
                f"kv_capacity_tokens ({self.kv_capacity_tokens}) must hold at least one block "
                f"(block_size {self.block_size})"
            )
        usable = self.kv_capacity_tokens // self.block_size * self.block_size
        if self.max_model_len > usable:
            # A request the cache cannot hold alone would be preempted forever.
            raise ValueError(
                f"max_model_len ({self.max_model_len}) must not exceed the KV capacity "
                f"({usable} tokens in whole blocks); raise kv_capacity_tokens or lower max_model_len"
            )

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_capacity_tokens // self.block_size

    def kv_transfer_s(self, num_tokens: int) -> float:
        """Simulated time to move ``num_tokens`` tokens of KV between instances."""
        return num_tokens * self.kv_bytes_per_token * 8.0 / (self.kv_bandwidth_gbps * 1e9)


class StepCostModel(Protocol):
    """Duration of one engine step from its composition."""

    def step_ms(self, num_prefill_tokens: int, num_decode_requests: int, num_decode_tokens: int) -> float:
        """Milliseconds the step takes; called once per step, in step order."""


class ProfileCostModel:
    """Step time from the same TTFT/TPOT profiles the router predicts with.

    ``ttft(prefill tokens) + tpot(decode requests, decode tokens)`` (each term
    0 when there is no such work, TPOT with the predictor's tokens-per-request
    floor), divided by ``speed_factor`` and multiplied by a seeded noise factor
    ``max(0, 1 + noise * N(0, 1))``.
    """

    def __init__(
        self,
        predictor: LatencyPredictor,
        *,
        speed_factor: float = 1.0,
        noise: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        if not speed_factor > 0:
            raise ValueError(f"speed_factor must be > 0, got {speed_factor!r}")
        self._predictor = predictor
        self._scale = 1.0 / speed_factor
        self._noise = noise
        self._rng = rng if rng is not None else random.Random(0)
        # Prefill tokens per step never exceed the chunk budget, so this stays small.
        self._ttft_cache: dict[int, float] = {}

    def base_step_ms(
        self, num_prefill_tokens: int, num_decode_requests: int, num_decode_tokens: int
    ) -> float:
        """The step time without noise, in milliseconds."""
        ms = 0.0
        if num_prefill_tokens > 0:
            ttft = self._ttft_cache.get(num_prefill_tokens)
            if ttft is None:
                ttft = float(self._predictor.ttft_profile.grid(float(num_prefill_tokens)))
                if len(self._ttft_cache) < 65536:
                    self._ttft_cache[num_prefill_tokens] = ttft
            ms += ttft
        if num_decode_requests > 0:
            ms += self._predictor.predict_tpot_ms(num_decode_requests, num_decode_tokens)
        return ms * self._scale

    def step_ms(self, num_prefill_tokens: int, num_decode_requests: int, num_decode_tokens: int) -> float:
        ms = self.base_step_ms(num_prefill_tokens, num_decode_requests, num_decode_tokens)
        if self._noise > 0.0:
            ms *= max(0.0, 1.0 + self._noise * self._rng.gauss(0.0, 1.0))
        return ms


@dataclass(frozen=True)
class SimRequestSpec:
    """A request as the model sees it: token counts only, no token values."""

    request_id: str
    #: Tokens of context known at admission: the prompt, plus the tokens already
    #: generated elsewhere when a decode continues a request.
    num_context_tokens: int
    #: Tokens this engine generates before the request finishes (>= 1).
    max_new_tokens: int
    #: Leading context tokens whose KV is already here (pulled from a prefill instance).
    num_cached_tokens: int = 0
    #: Keep the KV after the last token until :meth:`SimCore.release_held` (PD prefill).
    hold_kv: bool = False
    #: Whether the load counts the request among decode requests (it will decode here).
    counts_as_decode: bool = True
    #: Chained content hashes of the prompt's full prefix-cache blocks, in order
    #: (:mod:`fleet.prefix`; ``SimConfig.prefix_cache_block_tokens`` tokens each). Empty: nothing of the
    #: prompt is looked up in or stored into the prefix cache.
    block_hashes: tuple[int, ...] = ()
    #: At its last token the request is paused, not finished: it keeps its KV, its seat and its place
    #: in the running batch, generating nothing, until :meth:`SimCore.extend` raises its budget (it goes
    #: on in place) or :meth:`SimCore.abort` ends it, which its driver must do before the next
    #: :meth:`SimCore.schedule`. The last token is reported as ``finished`` either way.
    pause_at_end: bool = False


class KvEventKind(str, enum.Enum):
    """What happened to cached prefix blocks (the kinds of vLLM's ``KvCacheEvent``)."""

    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"


class KvEvent(NamedTuple):
    """Blocks that entered (``STORED``) or left (``REMOVED``) the prefix cache, or all of it left."""

    kind: KvEventKind
    block_hashes: tuple[int, ...] = ()


class TokenOutput(NamedTuple):
    """One token a step produced for a request (a tuple: the simulator makes millions)."""

    request_id: str
    #: 0-based index of the token among those this engine generated for the request.
    position: int
    finished: bool
    #: The request finished and its KV is now held for a decode instance.
    held: bool


@dataclass(frozen=True)
class StepResult:
    """What one finished step produced."""

    record: StepRecord
    outputs: tuple[TokenOutput, ...]


class _Phase(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    #: In the running batch at its last token, waiting for :meth:`SimCore.extend` or ``abort``.
    PAUSED = "paused"
    HELD = "held"
    DONE = "done"


class _Request:
    """Mutable scheduling state of one request (private to the core)."""

    __slots__ = (
        "cached",
        "discount",
        "extended_at",
        "num_blocks",
        "num_computed",
        "num_generated",
        "num_tokens",
        "phase",
        "preempted",
        "prefill_target",
        "spec",
    )

    def __init__(self, spec: SimRequestSpec) -> None:
        self.spec = spec
        self.num_tokens = spec.num_context_tokens
        self.num_generated = 0
        #: Its budget before the last :meth:`SimCore.extend` (0: never raised): the token past it opens a
        #: new run, reported as a first token is.
        self.extended_at = 0
        self.num_blocks = 0
        self.phase = _Phase.WAITING
        #: Preempted and not re-admitted since: its next admission re-prefills what it had computed.
        self.preempted = False
        #: Hashes of the prefix-cache blocks it references, a prefix of ``spec.block_hashes``.
        self.cached: list[int] = []
        #: While waiting: the tokens the prefix cache is expected to spare it (the load reports
        #: them as not to compute); 0 once its lookup ran.
        self.discount = 0
        if spec.num_cached_tokens > 0:
            # At least one token must be computed to sample the next one.
            self.num_computed = min(spec.num_cached_tokens, self.num_tokens - 1)
            gap = self.num_tokens - self.num_computed
            self.prefill_target = self.num_tokens if gap > 1 else self.num_computed
        else:
            self.num_computed = 0
            self.prefill_target = self.num_tokens

    @property
    def uncomputed_prefill(self) -> int:
        left = self.prefill_target - self.num_computed - self.discount
        return left if left > 0 else 0


@dataclass(frozen=True)
class ScheduledStep:
    """The composition of one step, decided by :meth:`SimCore.schedule`; pass it back to ``finish_step``."""

    num_prefill_tokens: int
    num_decode_requests: int
    num_decode_tokens: int
    duration_ms: float
    num_preempted: int
    _entries: tuple[tuple[_Request, int], ...] = field(repr=False, compare=False)

    @property
    def request_ids(self) -> tuple[str, ...]:
        return tuple(req.spec.request_id for req, _ in self._entries)


class SimCore:
    """The clockless engine model; see the module docstring.

    Not thread-safe; a real-time runner calls it from its event loop only.
    """

    def __init__(self, config: SimConfig, cost: StepCostModel) -> None:
        self.config = config
        self._cost = cost
        self._bs = config.block_size
        self._total_blocks = config.num_kv_blocks
        self._free_blocks = self._total_blocks
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._active: dict[str, _Request] = {}
        self._held: dict[str, _Request] = {}
        #: Running requests at their last token (``pause_at_end``), waiting for ``extend`` or ``abort``.
        self._paused: dict[str, _Request] = {}
        self._recent_admitted: deque[str] = deque(maxlen=config.max_recent_admitted_ids)
        self._recent_steps: deque[StepRecord] = deque(maxlen=config.max_recent_steps)
        self._uncomputed = 0
        self._decode_requests = 0
        self._decode_tokens = 0
        self._num_steps = 0
        self._num_preemptions = 0
        self._recompute_tokens = 0
        self._step_pending = False
        # Prefix cache (off when prefix_cache_block_tokens is 0). A cached block is a run of ``_kpb`` KV
        # blocks named by its chained hash; ``_ref`` counts the requests referencing each one
        # (0: evictable, then it is also in ``_lru``, oldest first). Evictable blocks count as free:
        # ``_free_blocks`` = blocks no request references; the empty ones are those beyond the
        # evictable ones, and allocating past them evicts the least recently used.
        self._pbt = config.prefix_cache_block_tokens
        self._kpb = config.prefix_cache_block_tokens // config.block_size
        self._ref: dict[int, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._events: deque[KvEvent] = deque()
        self._events_lost = False
        self._query_tokens = 0
        self._hit_tokens = 0
        #: Told of every prefix-cache lookup: (request id, prompt tokens looked up, tokens found). The
        #: virtual-time simulator sets it to count hits per request (a hit rate over part of a run);
        #: None (the default) keeps no per-request record.
        self.on_lookup: Callable[[str, int, int], None] | None = None

    # ------------------------------------------------------------------ requests

    def add(self, spec: SimRequestSpec) -> None:
        """Queue a request (FCFS). A held KV of the same id is released first.

        Raises :class:`DuplicateRequestError` when the id is waiting or running,
        :class:`EngineOverloadedError` when the waiting queue is full and
        :class:`InvalidRequestError` for counts the cache could never hold.
        """
        rid = spec.request_id
        if rid in self._active:
            raise DuplicateRequestError(f"request_id {rid!r} is already running on this engine; use a new id")
        if len(self._waiting) >= self.config.max_waiting_requests:
            raise EngineOverloadedError(
                f"waiting queue is full ({self.config.max_waiting_requests} requests); retry later or elsewhere"
            )
        if spec.num_context_tokens < 1 or spec.max_new_tokens < 1:
            raise InvalidRequestError(
                f"request {rid!r} needs >= 1 context token and >= 1 new token, got "
                f"{spec.num_context_tokens} and {spec.max_new_tokens}"
            )
        if not 0 <= spec.num_cached_tokens <= spec.num_context_tokens:
            raise InvalidRequestError(
                f"request {rid!r}: num_cached_tokens {spec.num_cached_tokens} must be within the context "
                f"({spec.num_context_tokens} tokens)"
            )
        longest = spec.num_context_tokens + spec.max_new_tokens - 1
        if self._blocks_for(longest) > self._total_blocks:
            raise InvalidRequestError(
                f"request {rid!r} needs {longest} tokens of KV but the cache holds "
                f"{self._total_blocks * self._bs}; lower max_tokens or shorten the prompt"
            )
        if spec.pause_at_end and spec.hold_kv:
            raise InvalidRequestError(
                f"request {rid!r}: pause_at_end and hold_kv exclude each other (a paused request keeps "
                "running; a held one has left the batch)"
            )
        if spec.block_hashes and self._pbt and len(spec.block_hashes) * self._pbt > spec.num_context_tokens:
            raise InvalidRequestError(
                f"request {rid!r}: {len(spec.block_hashes)} prefix blocks of {self._pbt} tokens do not fit in "
                f"its {spec.num_context_tokens} context tokens; hash only the prompt's full blocks"
            )
        self.release_held(rid)
        req = _Request(spec)
        req.discount = self._peek(req)
        self._active[rid] = req
        self._waiting.append(req)
        self._recent_admitted.append(rid)
        self._uncomputed += req.uncomputed_prefill
        if spec.counts_as_decode:
            self._decode_requests += 1
            self._decode_tokens += req.num_tokens

    def abort(self, request_id: str) -> bool:
        """Drop a waiting, running or held request and free its KV; False if unknown."""
        req = self._active.pop(request_id, None)
        found = self.release_held(request_id) is not None
        if req is None:
            return found
        if req.phase is _Phase.WAITING:
            self._waiting.remove(req)
        else:
            self._running.remove(req)
            self._paused.pop(request_id, None)
        self._retire(req)
        return True

    def extend(self, request_id: str, max_new_tokens: int, *, pause_at_end: bool | None = None) -> bool:
        """Raise a waiting or running request's budget to ``max_new_tokens`` new tokens, in place.

        ``max_new_tokens`` counts from the request's admission, like ``SimRequestSpec.max_new_tokens``
        (the tokens already generated included). Nothing is recomputed and nothing moves: a running
        request keeps its KV blocks, its seat and its place in the batch (so it is preempted when it
        would have been), and one paused at its last token goes on decoding at the next step. This is
        what an engine does when the caller simply lets a request keep generating; the first token
        past the old budget is reported as a run's first token is (``finish_step(ends_only=True)``).
        ``pause_at_end``: whether it pauses again at the new end (None: as before). False when the id
        is not waiting or running here (held, finished or unknown).

        Raises :class:`InvalidRequestError` for a budget that does not raise the old one or reach past
        the tokens generated, or that the cache could never hold.
        """
        req = self._active.get(request_id)
        if req is None:
            return False
        spec = req.spec
        if max_new_tokens < spec.max_new_tokens or max_new_tokens <= req.num_generated:
            raise InvalidRequestError(
                f"request {request_id!r}: max_new_tokens {max_new_tokens} must be at least its budget "
                f"({spec.max_new_tokens}) and above the {req.num_generated} tokens it generated"
            )
        longest = spec.num_context_tokens + max_new_tokens - 1
        if self._blocks_for(longest) > self._total_blocks:
            raise InvalidRequestError(
                f"request {request_id!r} would need {longest} tokens of KV but the cache holds "
                f"{self._total_blocks * self._bs}; raise its budget by less"
            )
        pause = spec.pause_at_end if pause_at_end is None else pause_at_end
        if pause and spec.hold_kv:
            raise InvalidRequestError(f"request {request_id!r}: pause_at_end and hold_kv exclude each other")
        counts = spec.counts_as_decode or max_new_tokens > 1
        if counts and not spec.counts_as_decode:
            self._decode_requests += 1
            self._decode_tokens += req.num_tokens
        req.spec = SimRequestSpec(
            spec.request_id,
            spec.num_context_tokens,
            max_new_tokens,
            num_cached_tokens=spec.num_cached_tokens,
            hold_kv=spec.hold_kv,
            counts_as_decode=counts,
            block_hashes=spec.block_hashes,
            pause_at_end=pause,
        )
        req.extended_at = spec.max_new_tokens
        if req.phase is _Phase.PAUSED:
            req.phase = _Phase.RUNNING
            del self._paused[request_id]
        return True

    def has_paused(self) -> bool:
        """Whether a request is paused at its last token (the engine steps again once it is
        extended or aborted)."""
        return bool(self._paused)

    def is_paused(self, request_id: str) -> bool:
        """Whether the request is paused at its last token (``pause_at_end``), in the batch still."""
        return request_id in self._paused

    def release_held(self, request_id: str) -> int | None:
        """Free a held prefill's KV; the number of context tokens it held, or None if none is held."""
        req = self._held.pop(request_id, None)
        if req is None:
            return None
        self._free(req)
        req.phase = _Phase.DONE
        return req.num_computed

    def generated_tokens(self, request_id: str) -> int | None:
        """Tokens a waiting or running request has generated so far (kept across preemption); None if unknown."""
        req = self._active.get(request_id)
        return None if req is None else req.num_generated

    def decode_progress(self, request_id: str) -> tuple[int, int, bool] | None:
        """(tokens of context now, tokens still to generate, decoding) of a waiting or running request.

        ``decoding``: its prefill is done (nothing left to compute but the token of the next step).
        None if unknown.
        """
        req = self._active.get(request_id)
        if req is None:
            return None
        return (
            req.spec.num_context_tokens + req.num_generated,
            req.spec.max_new_tokens - req.num_generated,
            req.uncomputed_prefill == 0,
        )

    def decode_progress_many(self, request_ids: Iterable[str]) -> list[tuple[int, int, bool] | None]:
        """:meth:`decode_progress` of each of ``request_ids`` (the same values, one call for many)."""
        active = self._active
        out: list[tuple[int, int, bool] | None] = []
        for request_id in request_ids:
            req = active.get(request_id)
            if req is None:
                out.append(None)
                continue
            spec = req.spec
            generated = req.num_generated
            out.append(
                (
                    spec.num_context_tokens + generated,
                    spec.max_new_tokens - generated,
                    req.prefill_target - req.num_computed - req.discount <= 0,
                )
            )
        return out

    def is_active(self, request_id: str) -> bool:
        return request_id in self._active

    def is_held(self, request_id: str) -> bool:
        return request_id in self._held

    def held_tokens(self, request_id: str) -> int | None:
        req = self._held.get(request_id)
        return None if req is None else req.num_computed

    @property
    def has_unfinished(self) -> bool:
        """True while any request waits or runs (held KV does not count)."""
        return bool(self._active)

    # ------------------------------------------------------------------ steps

    def schedule(self) -> ScheduledStep | None:
        """Decide the next step; None when there is nothing that can run now.

        Allocates the step's KV blocks (preempting as needed). Call
        :meth:`finish_step` with the result before scheduling again.
        """
        if self._step_pending:
            raise RuntimeError("finish_step() the previous step before scheduling another")
        if self._paused:
            raise RuntimeError(
                f"{len(self._paused)} request(s) paused at their last token: extend() or abort() them "
                "before the next step"
            )
        if not self._running and not self._waiting:
            return None
        budget = self.config.max_num_batched_tokens
        scheduled: dict[_Request, int] = {}
        preempted = 0

        def make_room(req: _Request, upto_tokens: int) -> bool:
            """Allocate blocks for ``req`` up to ``upto_tokens``, preempting the newest; False if ``req`` went."""
            nonlocal budget, preempted
            need = self._blocks_for(upto_tokens) - req.num_blocks
            while need > self._free_blocks:
                victim = self._running[-1]
                budget += scheduled.pop(victim, 0)
                self._preempt(victim)
                preempted += 1
                if victim is req:
                    return False
            self._take(need)
            req.num_blocks += need
            return True

        # 1. one token for every running decode, oldest first.
        for req in tuple(self._running):
            if budget <= 0:
                break
            if req.phase is not _Phase.RUNNING or req.num_computed < req.prefill_target:
                continue
            if make_room(req, req.num_computed + 1):
                scheduled[req] = 1
                budget -= 1
        # 2. chunks for running prefills, first come first served.
        for req in tuple(self._running):
            if budget <= 0:
                break
            if req.phase is not _Phase.RUNNING or req in scheduled or req.num_computed >= req.prefill_target:
                continue
            n = min(req.prefill_target - req.num_computed, budget)
            if make_room(req, req.num_computed + n):
                scheduled[req] = n
                budget -= n
        # 3. admit waiting requests while budget, seats and free blocks last; never
        # right after a preemption (the preempted would just be re-admitted).
        while (
            preempted == 0 and budget > 0 and self._waiting and len(self._running) < self.config.max_num_seqs
        ):
            req = self._waiting[0]
            hits = self._match(req)
            if hits:
                # Take the cached prefix, as vLLM does when it schedules a waiting request: its
                # blocks are referenced (no longer evictable) and count as computed.
                hit_tokens = len(hits) * self._pbt
                start = max(req.num_computed, hit_tokens)
                revived = sum(1 for h in hits if self._ref[h] == 0) * self._kpb
                n = min(req.prefill_target - start, budget)
                need = self._blocks_for(start + n) - len(hits) * self._kpb
                if need + revived > self._free_blocks:
                    break
                self._waiting.popleft()
                self._uncomputed -= req.uncomputed_prefill
                self._lookup(req, len(hits))
                for h in hits:
                    self._reference(h)
                req.cached = list(hits)
                req.num_blocks = len(hits) * self._kpb
                req.num_computed = start
                self._uncomputed += req.uncomputed_prefill
                if req.preempted:
                    self._recompute_tokens += req.prefill_target - start
                    req.preempted = False
            else:
                n = min(req.prefill_target - req.num_computed, budget) if req.uncomputed_prefill else 1
                need = self._blocks_for(req.num_computed + n) - req.num_blocks
                if need > self._free_blocks:
                    break
                self._waiting.popleft()
                if self._pbt:
                    self._uncomputed -= req.uncomputed_prefill
                    self._lookup(req, 0)
                    self._uncomputed += req.uncomputed_prefill
                if req.preempted:
                    self._recompute_tokens += req.prefill_target - req.num_computed
                    req.preempted = False
            self._take(need)
            req.num_blocks += need
            req.phase = _Phase.RUNNING
            self._running.append(req)
            scheduled[req] = n
            budget -= n

        if not scheduled:
            return None
        prefill_tokens = decode_requests = decode_tokens = 0
        for req, n in scheduled.items():
            if req.num_computed < req.prefill_target:
                prefill_tokens += n
            else:
                decode_requests += 1
                decode_tokens += req.num_tokens
        self._num_preemptions += preempted
        self._step_pending = True
        duration_ms = self._cost.step_ms(prefill_tokens, decode_requests, decode_tokens)
        if self.config.kv_slowdown > 0.0:
            # Hardware the profile did not capture: steps slow down as the KV cache fills
            # (attention over more resident blocks, allocator pressure).
            used = (self._total_blocks - self._free_blocks) / self._total_blocks
            duration_ms *= 1.0 + self.config.kv_slowdown * used
        return ScheduledStep(
            num_prefill_tokens=prefill_tokens,
            num_decode_requests=decode_requests,
            num_decode_tokens=decode_tokens,
            duration_ms=duration_ms,
            num_preempted=preempted,
            _entries=tuple(scheduled.items()),
        )

    def finish_step(self, step: ScheduledStep, *, ends_only: bool = False) -> StepResult:
        """Apply a scheduled step: computed tokens advance, finished contexts sample one token each.

        Requests aborted since :meth:`schedule` are skipped. ``ends_only``: report only each
        request's first and last token (what the virtual-time simulator reads; the engine's state
        is the same either way, and a large batch's step then makes no tuple per request).
        """
        self._step_pending = False
        outputs: list[TokenOutput] = []
        for req, n in step._entries:
            if req.phase is not _Phase.RUNNING:
                continue
            self._uncomputed -= req.uncomputed_prefill
            req.num_computed += n
            if self._pbt and len(req.cached) < len(req.spec.block_hashes):
                self._publish(req)
            if req.num_computed < req.num_tokens:
                self._uncomputed += req.uncomputed_prefill
                continue
            req.num_tokens += 1
            req.num_generated += 1
            if req.spec.counts_as_decode:
                self._decode_tokens += 1
            if req.num_generated < req.spec.max_new_tokens:
                if not ends_only or req.num_generated == 1 or req.num_generated == req.extended_at + 1:
                    outputs.append(TokenOutput(req.spec.request_id, req.num_generated - 1, False, False))
                continue
            if req.spec.pause_at_end:
                # Its budget is spent but it stays in the batch, KV and all, until extended or aborted.
                outputs.append(TokenOutput(req.spec.request_id, req.num_generated - 1, True, False))
                req.phase = _Phase.PAUSED
                self._paused[req.spec.request_id] = req
                continue
            hold = req.spec.hold_kv
            outputs.append(TokenOutput(req.spec.request_id, req.num_generated - 1, True, hold))
            del self._active[req.spec.request_id]
            self._running.remove(req)
            self._retire(req, hold=hold)
        record = StepRecord(
            num_prefill_tokens=step.num_prefill_tokens,
            num_decode_requests=step.num_decode_requests,
            num_decode_tokens=step.num_decode_tokens,
            duration_ms=step.duration_ms,
        )
        self._recent_steps.append(record)
        self._num_steps += 1
        return StepResult(record=record, outputs=tuple(outputs))

    # ------------------------------------------------------------------ load

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_uncomputed_prefill_tokens(self) -> int:
        return self._uncomputed

    @property
    def num_decode_requests(self) -> int:
        return self._decode_requests

    @property
    def num_decode_tokens(self) -> int:
        return self._decode_tokens

    @property
    def num_used_kv_tokens(self) -> int:
        return (self._total_blocks - self._free_blocks) * self._bs

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def num_steps(self) -> int:
        return self._num_steps

    @property
    def num_preemptions(self) -> int:
        return self._num_preemptions

    @property
    def num_preemption_recompute_tokens(self) -> int:
        """Tokens preempted requests re-prefilled when re-admitted, less those the prefix cache held."""
        return self._recompute_tokens

    def load(self, *, schedulable: bool = True) -> EngineLoad:
        """The load right now, with the recent admissions and step samples."""
        return EngineLoad(
            num_waiting_requests=len(self._waiting),
            num_running_requests=len(self._running),
            num_uncomputed_prefill_tokens=self._uncomputed,
            num_decode_requests=self._decode_requests,
            num_decode_tokens=self._decode_tokens,
            num_used_kv_tokens=self.num_used_kv_tokens,
            schedulable=schedulable,
            recent_admitted_request_ids=tuple(self._recent_admitted),
            recent_steps=tuple(self._recent_steps),
            num_steps=self._num_steps,
            prefix_cache_query_tokens=self._query_tokens,
            prefix_cache_hit_tokens=self._hit_tokens,
            num_preemptions=self._num_preemptions,
            num_preemption_recompute_tokens=self._recompute_tokens,
        )

    # ------------------------------------------------------------------ prefix cache

    @property
    def prefix_block_tokens(self) -> int:
        """Tokens per prefix-cache block (0: prefix caching off)."""
        return self._pbt

    @property
    def cache_hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache over prompt tokens looked up, since the start (0 before any)."""
        return self._hit_tokens / self._query_tokens if self._query_tokens else 0.0

    @property
    def cache_query_tokens(self) -> int:
        return self._query_tokens

    @property
    def cache_hit_tokens(self) -> int:
        return self._hit_tokens

    def cached_block_hashes(self) -> frozenset[int]:
        """Every block hash the prefix cache holds now (in use or evictable): the truth an index mirrors."""
        return frozenset(self._ref)

    def drain_kv_events(self) -> tuple[list[KvEvent], bool]:
        """The cache events since the last call, oldest first, and whether some were lost.

        When events were lost (more than ``max_kv_events`` piled up unread) the list starts with
        a ``CLEARED`` event followed by one ``STORED`` event of the whole cache, so a reader that
        applies the list in order ends up with the cache's contents either way.
        """
        events = list(self._events)
        self._events.clear()
        lost = self._events_lost
        if lost:
            self._events_lost = False
            events = [KvEvent(KvEventKind.CLEARED), KvEvent(KvEventKind.STORED, tuple(self._ref))]
        return events, lost

    def check_invariants(self) -> None:
        """Recompute every counter from scratch and raise AssertionError on a mismatch (tests)."""
        reqs = [*self._waiting, *self._running]
        assert len(reqs) == len(self._active), "active index out of sync"
        assert all(r.phase is _Phase.WAITING for r in self._waiting)
        assert all(r.phase in (_Phase.RUNNING, _Phase.PAUSED) for r in self._running)
        assert {r.spec.request_id for r in self._running if r.phase is _Phase.PAUSED} == set(self._paused)
        assert all(r.num_generated == r.spec.max_new_tokens for r in self._paused.values()), "paused early"
        assert all(r.phase is _Phase.HELD for r in self._held.values())
        assert sum(r.uncomputed_prefill for r in reqs) == self._uncomputed, "uncomputed prefill tokens"
        decoding = [r for r in reqs if r.spec.counts_as_decode]
        assert len(decoding) == self._decode_requests, "decode requests"
        assert sum(r.num_tokens for r in decoding) == self._decode_tokens, "decode tokens"
        holders = [*reqs, *self._held.values()]
        refs: dict[int, int] = {}
        for r in holders:
            assert list(r.spec.block_hashes[: len(r.cached)]) == r.cached, "cached blocks are a prefix"
            assert r.num_blocks >= len(r.cached) * self._kpb
            for h in r.cached:
                refs[h] = refs.get(h, 0) + 1
        assert all(self._ref.get(h) == c for h, c in refs.items()), "prefix-cache reference counts"
        assert {h for h, c in self._ref.items() if c == 0} == set(self._lru), "evictable blocks"
        private = sum(r.num_blocks - len(r.cached) * self._kpb for r in holders)
        used = private + len(refs) * self._kpb
        assert used == self._total_blocks - self._free_blocks, "KV blocks"
        assert self._free_blocks >= len(self._lru) * self._kpb, "evictable blocks exceed free blocks"
        assert 0 <= self._free_blocks <= self._total_blocks
        for r in reqs:
            assert 0 <= r.num_computed <= r.num_tokens
            assert r.num_blocks >= self._blocks_for(r.num_computed) or r.phase is _Phase.WAITING
        assert len(self._running) <= self.config.max_num_seqs

    # ------------------------------------------------------------------ internals

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self._bs)

    # ------------------------------------------------------------------ prefix cache internals

    def _match(self, req: _Request) -> tuple[int, ...]:
        """The leading block hashes of a waiting request the cache holds (at least one token left to compute)."""
        hashes = req.spec.block_hashes
        if not self._pbt or not hashes or req.spec.num_cached_tokens or req.num_computed:
            return ()
        ref = self._ref
        limit = min(len(hashes), (req.num_tokens - 1) // self._pbt)
        k = 0
        while k < limit and hashes[k] in ref:
            k += 1
        return hashes[:k]

    def _peek(self, req: _Request) -> int:
        """Tokens the cache would spare ``req`` if it were scheduled now (what the load discounts)."""
        return len(self._match(req)) * self._pbt

    def _lookup(self, req: _Request, hit_blocks: int) -> None:
        """Count a prefix-cache lookup of ``req`` (vLLM's queries and hits, in tokens)."""
        req.discount = 0
        if req.spec.num_cached_tokens:
            return  # a decode continuing from pulled KV asks the cache nothing
        self._query_tokens += req.spec.num_context_tokens
        self._hit_tokens += hit_blocks * self._pbt
        if self.on_lookup is not None:
            self.on_lookup(req.spec.request_id, req.spec.num_context_tokens, hit_blocks * self._pbt)

    def _reference(self, h: int) -> None:
        count = self._ref[h]
        if count == 0:
            del self._lru[h]
            self._free_blocks -= self._kpb
        self._ref[h] = count + 1

    def _take(self, n: int) -> None:
        """Allocate ``n`` free blocks, evicting least recently used cached blocks past the empty ones."""
        lru = self._lru
        if lru:
            empty = self._free_blocks - len(lru) * self._kpb
            if n > empty:
                evicted: list[int] = []
                while n > empty:
                    h, _ = lru.popitem(last=False)
                    del self._ref[h]
                    evicted.append(h)
                    empty += self._kpb
                self._event(KvEvent(KvEventKind.REMOVED, tuple(evicted)))
        self._free_blocks -= n

    def _free(self, req: _Request) -> None:
        """Give back every block ``req`` references: private ones at once, cached ones to the LRU.

        Its cached blocks go to the LRU's recent end last block first, so a prompt's tail is
        evicted before its head (the head is what other requests share), as vLLM frees them.
        """
        shared = len(req.cached) * self._kpb
        self._free_blocks += req.num_blocks - shared
        for h in reversed(req.cached):
            count = self._ref[h] - 1
            self._ref[h] = count
            if count == 0:
                self._lru[h] = None
                self._free_blocks += self._kpb
        req.cached = []
        req.num_blocks = 0

    def _publish(self, req: _Request) -> None:
        """Name the prompt blocks ``req`` has finished computing by their hash (the cache keeps them).

        A block someone else computed meanwhile is shared instead: ``req``'s own copy is freed.
        """
        hashes = req.spec.block_hashes
        cached = req.cached
        stored: list[int] = []
        j = len(cached)
        while j < len(hashes) and (j + 1) * self._pbt <= req.num_computed:
            h = hashes[j]
            if h in self._ref:
                self._reference(h)
                self._free_blocks += self._kpb
            else:
                self._ref[h] = 1
                stored.append(h)
            cached.append(h)
            j += 1
        if stored:
            self._event(KvEvent(KvEventKind.STORED, tuple(stored)))

    def _event(self, event: KvEvent) -> None:
        if len(self._events) >= self.config.max_kv_events:
            self._events.clear()
            self._events_lost = True
        self._events.append(event)

    def _preempt(self, req: _Request) -> None:
        self._running.remove(req)
        self._uncomputed -= req.uncomputed_prefill
        self._free(req)
        req.num_computed = 0
        req.prefill_target = req.num_tokens
        req.phase = _Phase.WAITING
        req.preempted = True
        req.discount = self._peek(req)
        self._uncomputed += req.uncomputed_prefill
        self._waiting.appendleft(req)

    def _retire(self, req: _Request, *, hold: bool = False) -> None:
        """Take a request out of the load counters; keep its blocks when ``hold``."""
        self._uncomputed -= req.uncomputed_prefill
        if req.spec.counts_as_decode:
            self._decode_requests -= 1
            self._decode_tokens -= req.num_tokens
        if hold:
            req.phase = _Phase.HELD
            self._held[req.spec.request_id] = req
            return
        self._free(req)
        req.phase = _Phase.DONE
