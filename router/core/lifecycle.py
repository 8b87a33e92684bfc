"""One request's life: its phase, the legal moves between phases, and the tokens it has produced.

Every request the router serves (and every request the simulator replays) is
one :class:`RequestState`. Its :attr:`~RequestState.phase` is the single
answer to "where is this request now"; logs, the metrics and the ``Schedule``
answer read it from here, and the moves between phases are checked against
one table, :data:`TRANSITIONS`. A move the table does not hold is a bug in the
caller and raises :class:`~router.core.errors.IllegalTransitionError` at once,
rather than letting two parts of the router disagree about a request.

::

    QUEUED -> PLACED -> PREFILLING -> TRANSFERRING -> DECODING -> DONE
    PLACED -> DECODING                 (resume on a KV the prefill instance still holds)
    PREFILLING -> DECODING | DONE      (neutral: the stream goes on; a one-token answer ends)
    PLACED | PREFILLING | TRANSFERRING | DECODING -> PAUSED -> QUEUED   (pause, requeue, resume)
    any live phase -> FAILED | CANCELLED

- ``QUEUED``: waiting for a dispatcher to place it (also the moment between
  arrival and an instant placement when nothing waits).
- ``PLACED``: instances chosen and recorded in the in-flight account; no leg
  has started yet.
- ``PREFILLING``: the prompt (plus, after a pause, the tokens so far) is being
  computed; the first token ends it.
- ``TRANSFERRING``: disaggregated serving only: the first token exists and the
  KV moves to the decode instance.
- ``DECODING``: tokens stream from the decode (or neutral) instance.
- ``PAUSED``: the request stopped running but keeps every token produced so
  far: a decode instance failed (failover), the QLM dispatcher evicted it, a
  slice ended, or a leg failed before its first token (retry). The next move is
  :meth:`~RequestState.requeue` (back to ``QUEUED``), from where it resumes with
  the tokens so far — one transition for all four causes.
- ``DONE``, ``FAILED``, ``CANCELLED``: terminal; nothing leaves them.

Tokens only ever grow (:meth:`RequestState.add_tokens`), and only while a leg
produces them (``PREFILLING``/``DECODING``), so a pause can neither lose nor
repeat one: a resumed run continues after :attr:`RequestState.resume_from`.

Pure: no I/O and no clock; times are passed in by the driver (the asyncio
router or the simulator's virtual clock).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import Any

from router.core.errors import IllegalTransitionError


class Phase(str, enum.Enum):
    """Where a request is in its life (see the module doc); the value is the name logs and metrics use."""

    QUEUED = "queued"
    PLACED = "placed"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    DECODING = "decoding"
    PAUSED = "paused"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({Phase.DONE, Phase.FAILED, Phase.CANCELLED})
_ENDS = (Phase.FAILED, Phase.CANCELLED)

#: Every legal move, in one place. A live phase may always end in failure or cancellation.
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.QUEUED: frozenset({Phase.PLACED, *_ENDS}),
    # A placed request starts a prefill, or (resuming on a KV its prefill instance still holds)
    # goes straight to decode; a placement whose leg cannot start pauses for another.
    Phase.PLACED: frozenset({Phase.PREFILLING, Phase.DECODING, Phase.PAUSED, *_ENDS}),
    # The first token: PD moves the KV, neutral keeps decoding, a one-token answer is done.
    Phase.PREFILLING: frozenset({Phase.TRANSFERRING, Phase.DECODING, Phase.DONE, Phase.PAUSED, *_ENDS}),
    Phase.TRANSFERRING: frozenset({Phase.DECODING, Phase.PAUSED, *_ENDS}),
    Phase.DECODING: frozenset({Phase.DONE, Phase.PAUSED, *_ENDS}),
    Phase.PAUSED: frozenset({Phase.QUEUED, *_ENDS}),
    Phase.DONE: frozenset(),
    Phase.FAILED: frozenset(),
    Phase.CANCELLED: frozenset(),
}

#: Phases in which a leg produces tokens.
PRODUCING = frozenset({Phase.PREFILLING, Phase.DECODING})

#: Hears every move (old phase, new phase): the router's metrics keep a gauge per phase with it.
PhaseListener = Callable[[Phase, Phase], None]


def legal(old: Phase, new: Phase) -> bool:
    """Whether ``old`` → ``new`` is a move of :data:`TRANSITIONS`."""
    return new in TRANSITIONS[old]


class RequestState:
    """One request's state: its phase, its tokens so far and the times the driver noted.

    Mutable by design (it *is* the request's state) but changed only through
    its methods, each of which checks the move. Not thread-safe: one driver owns
    it (the asyncio task serving the request, or the simulator's loop).
    """

    __slots__ = (
        "cached_prompt_tokens",
        "first_token_at",
        "last_token_at",
        "late",
        "listener",
        "pause_reason",
        "pauses",
        "phase",
        "prompt_tokens",
        "queue_wait_s",
        "request_id",
        "resume_from",
        "route",
        "started",
        "tokens",
    )

    def __init__(
        self,
        request_id: str = "",
        *,
        started: float = 0.0,
        prompt_tokens: int = 0,
        listener: PhaseListener | None = None,
    ) -> None:
        self.request_id = request_id
        self.phase = Phase.QUEUED
        #: When the request arrived (the driver's clock).
        self.started = started
        self.prompt_tokens = prompt_tokens
        #: Every token produced so far, in order (the client has each one it was sent).
        self.tokens: list[int] = []
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        #: Prompt tokens the producing instance did not recompute (reported by the worker).
        self.cached_prompt_tokens = 0
        #: Time spent waiting in the router's queue (s), over every wait, and whether it left late.
        self.queue_wait_s = 0.0
        self.late = False
        #: How many times it paused, why the last time, and how many tokens it had then.
        self.pauses = 0
        self.pause_reason = ""
        self.resume_from = 0
        #: The driver's record of where it runs (the router's ``Route``; the core never reads it).
        self.route: Any = None
        self.listener = listener
        if listener is not None:
            listener(Phase.QUEUED, Phase.QUEUED)

    def __repr__(self) -> str:
        return f"RequestState({self.request_id!r}, {self.phase.value}, tokens={len(self.tokens)})"

    # ------------------------------------------------------------------ moves

    def to(self, new: Phase) -> None:
        """Move to ``new``; :class:`IllegalTransitionError` when :data:`TRANSITIONS` does not allow it."""
        old = self.phase
        if new not in TRANSITIONS[old]:
            raise IllegalTransitionError(
                f"request {self.request_id!r}: {old.value} -> {new.value} is not a legal move "
                f"(from {old.value}: {', '.join(sorted(p.value for p in TRANSITIONS[old])) or 'none'})"
            )
        self.phase = new
        if self.listener is not None:
            self.listener(old, new)

    def advance(self, new: Phase) -> None:
        """Move to ``new`` unless already there (a leg reporting the phase it is in twice)."""
        if self.phase is not new:
            self.to(new)

    def pause(self, reason: str) -> None:
        """Stop running, keeping every token: failover, eviction, a slice's end or a failed start."""
        self.to(Phase.PAUSED)
        self.pauses += 1
        self.pause_reason = reason
        self.resume_from = len(self.tokens)

    def requeue(self) -> None:
        """A paused request waits to be placed again; it resumes after :attr:`resume_from` tokens."""
        self.to(Phase.QUEUED)

    def end(self, phase: Phase) -> None:
        """End in ``phase`` (``DONE``, ``FAILED`` or ``CANCELLED``); ending twice keeps the first end."""
        if phase not in _TERMINAL:
            raise IllegalTransitionError(f"request {self.request_id!r}: {phase.value} is not an end")
        if not self.phase.terminal:
            self.to(phase)

    # ------------------------------------------------------------------ tokens

    def add_tokens(self, token_ids: Iterable[int], now: float) -> int:
        """Append what a leg produced; the index of the first of them. Only a producing phase has tokens."""
        index = len(self.tokens)
        if self.phase not in PRODUCING:
            raise IllegalTransitionError(
                f"request {self.request_id!r}: tokens arrived while {self.phase.value} (no leg produces then)"
            )
        self.tokens.extend(token_ids)
        if len(self.tokens) > index:
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now
        return index

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output token after the first (None before two tokens)."""
        first, last, n = self.first_token_at, self.last_token_at, len(self.tokens)
        return (last - first) / (n - 1) if first is not None and last is not None and n > 1 else None
