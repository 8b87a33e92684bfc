"""The engine interface every backend (``sim``, ``vllm``) implements.

The Worker gRPC service and the status agent talk to an engine only through
:class:`Engine`. Values crossing this boundary are frozen dataclasses; token
streams are async iterators of :class:`TokenDelta`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol


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


@dataclass(frozen=True)
class EngineInfo:
    """Static facts the agent registers (InstanceMetadata)."""

    model: str
    max_num_batched_tokens: int
    kv_capacity_tokens: int
    block_size: int
    max_model_len: int


class Engine(Protocol):
    """An LLM engine serving token-id requests.

    Every method may be called concurrently from the event loop. Streams end
    with a delta whose ``finished`` is true; an aborted request's stream ends
    with ``finish_reason == "abort"``. Cancelling the consumer of a stream
    aborts the request on the engine and frees its KV.
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
