"""The engine interface every backend (``sim``, ``vllm``) implements.

The Worker gRPC service and the status agent talk to an engine only through
:class:`Engine`. Values crossing this boundary are frozen dataclasses; token
streams are async iterators of :class:`TokenDelta`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


class EngineError(Exception):
    """Root of the errors an engine raises; the Worker service maps them to gRPC codes."""


class InvalidRequestError(EngineError):
    """The request cannot be served as given (empty prompt, max_tokens out of range, ...)."""


class DuplicateRequestError(EngineError):
    """A request with this id is already running on this engine."""


class KvHandleError(EngineError):
    """A kv_handle is unknown, malformed or expired (its KV was already freed)."""


class EngineOverloadedError(EngineError):
    """The engine refuses new work (shutting down, or its queue bound is reached)."""


class EngineShuttingDownError(EngineOverloadedError):
    """The engine is not running (not started yet, or stopping); another instance should serve."""


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters as the engine needs them (see ``SamplingParams`` in common.proto)."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one request; the last delta has ``finished`` set and a reason."""

    token_ids: tuple[int, ...]
    text: str = ""
    finished: bool = False
    finish_reason: str = ""  # "length" | "stop" | "abort"
    #: Prompt tokens whose KV the engine did not compute (pulled or prefix-cached); first delta only.
    num_cached_prompt_tokens: int = 0


@dataclass(frozen=True)
class PrefillResult:
    """Outcome of a prefill-only request: the first token and a handle to its KV."""

    first_token_id: int
    text: str
    kv_handle: bytes
    finished: bool = False
    finish_reason: str = ""
    num_prompt_tokens: int = 0


@dataclass(frozen=True)
class StepRecord:
    """One engine step, as measured."""

    num_prefill_tokens: int
    num_decode_requests: int
    num_decode_tokens: int
    duration_ms: float


@dataclass(frozen=True)
class EngineLoad:
    """The engine's load right now; maps onto ``InstanceStatus`` in cms.proto."""

    num_waiting_requests: int = 0
    num_running_requests: int = 0
    num_uncomputed_prefill_tokens: int = 0
    num_decode_requests: int = 0
    num_decode_tokens: int = 0
    num_used_kv_tokens: int = 0
    schedulable: bool = True
    # Requests admitted since the last load() call would be ambiguous with
    # several readers, so engines report a bounded window of recent admissions.
    recent_admitted_request_ids: tuple[str, ...] = ()
    recent_steps: tuple[StepRecord, ...] = field(default=())
    # Steps finished since the engine started; lets a reader tell two loads
    # apart whose bounded windows happen to look the same.
    num_steps: int = 0
    # Prefix cache, since the engine started (vLLM's prefix_cache_queries / _hits counters):
    # prompt tokens looked up, and those found cached. Both 0 without prefix caching.
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    # Requests the engine preempted since it started (KV ran out); None: the engine does not count them.
    num_preemptions: int | None = None
    # Tokens preempted requests re-prefilled when re-admitted, less those found in the prefix cache
    # (vLLM's prefix-cache stats: preempted_queries - preempted_hits); None: the engine does not count them.
    num_preemption_recompute_tokens: int | None = None

    @property
    def cache_hit_rate(self) -> float:
        """Cached prompt tokens over prompt tokens looked up (0 before any lookup)."""
        q = self.prefix_cache_query_tokens
        return self.prefix_cache_hit_tokens / q if q else 0.0


@dataclass(frozen=True)
class EngineInfo:
    """Static facts the agent registers (InstanceMetadata)."""

    model: str
    max_num_batched_tokens: int
    kv_capacity_tokens: int
    block_size: int
    max_model_len: int
    #: Most requests running at once (0 = unknown).
    max_num_seqs: int = 0


class Engine(Protocol):
    """An LLM engine serving token-id requests.

    Every method may be called concurrently from the event loop. Streams end
    with a delta whose ``finished`` is true; an aborted request's stream ends
    with ``finish_reason == "abort"``. Cancelling the consumer of a stream
    aborts the request on the engine and frees its KV. A consumer that falls
    behind gets the tokens produced meanwhile merged into one delta (see
    :class:`DeltaCollector`), so a slow client never grows a queue.
    """

    @property
    def info(self) -> EngineInfo: ...

    async def start(self) -> None:
        """Start the engine; returns once it can accept requests."""

    async def stop(self) -> None:
        """Abort everything and release resources. Idempotent."""

    def generate(
        self, request_id: str, prompt_token_ids: tuple[int, ...], sampling: Sampling
    ) -> AsyncIterator[TokenDelta]:
        """Prefill and decode here; stream the tokens (neutral mode)."""

    async def prefill(
        self, request_id: str, prompt_token_ids: tuple[int, ...], sampling: Sampling
    ) -> PrefillResult:
        """Compute the prompt, keep its KV for a decode instance to pull, return the first token."""

    def decode(
        self,
        request_id: str,
        prompt_token_ids: tuple[int, ...],
        sampling: Sampling,
        kv_handle: bytes,
        generated_token_ids: tuple[int, ...],
    ) -> AsyncIterator[TokenDelta]:
        """Continue a request after ``generated_token_ids``; stream the rest.

        With a ``kv_handle`` the KV is pulled from the prefill instance; with an
        empty one the context (prompt + generated tokens) is recomputed here.
        """

    async def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV; False if the engine does not know it."""

    def load(self) -> EngineLoad:
        """The current load (cheap; called by the agent on every change)."""

    def add_load_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from the event loop, without arguments) on every load change."""


@runtime_checkable
class EndpointAware(Protocol):
    """An engine that needs the address its Worker service is reachable at.

    The server calls :meth:`set_endpoint` once it has bound its port, before
    serving; the ``sim`` engine writes it into its kv handles so a decode
    instance knows where to pull from.
    """

    def set_endpoint(self, endpoint: str) -> None: ...


class TextTokenizer(Protocol):
    """Turns a text prompt into token ids (the Worker service's ``prompt`` field)."""

    def encode(self, text: str) -> list[int]: ...


@runtime_checkable
class TokenizingEngine(Protocol):
    """An engine that brings its own tokenizer for text prompts (else the built-in one is used)."""

    @property
    def tokenizer(self) -> TextTokenizer: ...


_MAX_TOKEN_ID = 2**32 - 1


def validate_request(
    info: EngineInfo,
    request_id: str,
    prompt_token_ids: Sequence[int],
    sampling: Sampling,
    generated_token_ids: Sequence[int] = (),
) -> None:
    """Raise :class:`InvalidRequestError` naming the field if the request cannot be served.

    Shared by every backend and the Worker service so both reject the same
    inputs with the same messages.
    """
    if not request_id:
        raise InvalidRequestError("request_id: must not be empty")
    if not prompt_token_ids:
        raise InvalidRequestError("prompt: empty; send prompt_token_ids or a non-empty prompt text")
    for name, ids in (("prompt_token_ids", prompt_token_ids), ("generated_token_ids", generated_token_ids)):
        if ids and (min(ids) < 0 or max(ids) > _MAX_TOKEN_ID):
            raise InvalidRequestError(f"{name}: token ids must be in 0..{_MAX_TOKEN_ID}")
    if sampling.max_tokens <= 0:
        raise InvalidRequestError(f"sampling.max_tokens: must be > 0, got {sampling.max_tokens}")
    if sampling.temperature < 0:
        raise InvalidRequestError(f"sampling.temperature: must be >= 0, got {sampling.temperature}")
    if not 0.0 <= sampling.top_p <= 1.0:
        raise InvalidRequestError(f"sampling.top_p: must be in [0, 1] (0 = default), got {sampling.top_p}")
    if sampling.top_k < 0:
        raise InvalidRequestError(f"sampling.top_k: must be >= 0, got {sampling.top_k}")
    if any(not s for s in sampling.stop):
        raise InvalidRequestError("sampling.stop: stop strings must not be empty")
    if len(generated_token_ids) >= sampling.max_tokens:
        raise InvalidRequestError(
            f"generated_token_ids: already holds {len(generated_token_ids)} tokens, which reaches "
            f"sampling.max_tokens={sampling.max_tokens}; nothing is left to decode"
        )
    limit = info.max_model_len
    if limit > 0:
        if len(prompt_token_ids) >= limit:
            raise InvalidRequestError(
                f"prompt: {len(prompt_token_ids)} tokens leave no room for output within the model limit "
                f"max_model_len={limit}; shorten the prompt"
            )
        # max_tokens counts the request's whole output, generated_token_ids included.
        if len(prompt_token_ids) + sampling.max_tokens > limit:
            raise InvalidRequestError(
                f"sampling.max_tokens: prompt ({len(prompt_token_ids)} tokens) + max_tokens "
                f"({sampling.max_tokens}) = {len(prompt_token_ids) + sampling.max_tokens} exceeds the model "
                f"limit max_model_len={limit}; lower max_tokens to at most {limit - len(prompt_token_ids)}"
            )


class DeltaCollector:
    """The hand-off from an engine's step loop to one request's stream consumer.

    The producer calls :meth:`put` (never blocks); the consumer awaits
    :meth:`get`, which returns everything produced since its last call merged
    into one delta. A consumer that falls behind therefore receives its tokens
    in fewer, larger messages, and memory stays bounded by the request's own
    output length rather than by the number of steps.
    """

    def __init__(self) -> None:
        self._token_ids: list[int] = []
        self._text: list[str] = []
        self._finished = False
        self._finish_reason = ""
        self._ready = asyncio.Event()
        self._closed = False

    @property
    def finished(self) -> bool:
        """True once the final delta has been put (it may not have been taken yet)."""
        return self._finished

    def put(
        self, token_ids: Sequence[int], text: str = "", *, finished: bool = False, finish_reason: str = ""
    ) -> None:
        """Add new tokens; ignored after the final delta was put."""
        if self._finished:
            return
        self._token_ids.extend(token_ids)
        if text:
            self._text.append(text)
        if finished:
            self._finished = True
            self._finish_reason = finish_reason
        self._ready.set()

    async def get(self) -> TokenDelta:
        """Everything put since the last call, as one delta; waits while there is nothing.

        After the final delta has been taken, further calls raise
        :class:`RuntimeError` (the stream is over).
        """
        if self._closed:
            raise RuntimeError("the stream already ended")
        await self._ready.wait()
        delta = TokenDelta(
            token_ids=tuple(self._token_ids),
            text="".join(self._text),
            finished=self._finished,
            finish_reason=self._finish_reason,
        )
        self._token_ids.clear()
        self._text.clear()
        self._ready.clear()
        if self._finished:
            self._closed = True
        return delta
