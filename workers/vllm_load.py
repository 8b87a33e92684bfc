"""The ``vllm`` engine's load bookkeeping, kept apart from vLLM so it can be tested alone.

vLLM reports, once per engine step, how many requests run and wait and how
full the KV cache is (its scheduler statistics), plus what the step did
(tokens of prompt computed, decode batch, duration). It does not report the
two quantities the router's predictor needs most: the prompt tokens still to
compute (the prefill backlog) and the total context of the decode batch. The
engine wrapper knows every request it handed to vLLM, so :class:`LoadBook`
combines the two views:

- running, waiting and KV usage come from vLLM's last step, corrected for what
  the wrapper knows happened since (a request admitted after that step is
  waiting; a finished one is gone);
- the prefill backlog is each request's prompt minus what was computed: a
  step's computed prompt tokens are handed out first-come first-served (the
  order vLLM's scheduler serves prefills in) and a request's first output
  token settles it;
- decode requests and their context come from the wrapper's own count of
  output tokens.

Everything here runs on the event loop and does no I/O.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.interface import EngineLoad, StepRecord


@dataclass(frozen=True)
class StepStats:
    """What one vLLM engine step reported, in plain numbers.

    The ``num_*`` step-detail fields are None when vLLM did not send
    iteration details for the step (then no :class:`StepRecord` is kept).
    """

    num_running_requests: int
    num_waiting_requests: int
    kv_cache_usage: float
    num_prefill_tokens: int | None = None
    num_decode_requests: int | None = None
    duration_ms: float | None = None


@dataclass
class _Tracked:
    prompt_tokens: int
    uncomputed_tokens: int
    context_tokens: int
    # Counts as "in or waiting for decode" (a PD decode does from admission).
    decode_stage: bool
    has_output: bool = False


class LoadBook:
    """Per-request bookkeeping plus vLLM's last step statistics; builds :class:`EngineLoad`."""

    def __init__(self, *, max_recent_admitted_ids: int = 64, max_recent_steps: int = 32) -> None:
        if max_recent_admitted_ids < 1:
            raise ValueError(f"max_recent_admitted_ids: must be >= 1, got {max_recent_admitted_ids}")
        if max_recent_steps < 1:
            raise ValueError(f"max_recent_steps: must be >= 1, got {max_recent_steps}")
        self._requests: dict[str, _Tracked] = {}
        # Admitted after vLLM's last step report, so not in its counts yet.
        self._unseen: set[str] = set()
        self._recent_ids: deque[str] = deque(maxlen=max_recent_admitted_ids)
        self._steps: deque[StepRecord] = deque(maxlen=max_recent_steps)
        self._num_steps = 0
        self._running = 0
        self._waiting = 0
        self._kv_usage = 0.0
        self._num_preemptions = 0
        #: None until vLLM's prefix-cache statistics show it caches (without prefix caching it does
        #: not count what its preempted requests recompute).
        self._num_preemption_recompute_tokens: int | None = None
        self.kv_capacity_tokens = 0

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    @property
    def request_ids(self) -> tuple[str, ...]:
        return tuple(self._requests)

    @property
    def num_steps(self) -> int:
        return self._num_steps

    def admit(
        self,
        request_id: str,
        num_prompt_tokens: int,
        *,
        num_cached_tokens: int = 0,
        decode_stage: bool = False,
    ) -> None:
        """A request was handed to vLLM.

        ``num_cached_tokens`` is how much of the prompt is expected to arrive
        computed (KV transferred from a prefill instance); ``decode_stage``
        marks a PD decode, which is in the decode stage from the start.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already tracked")
        uncomputed = max(0, num_prompt_tokens - max(0, num_cached_tokens))
        self._requests[request_id] = _Tracked(
            prompt_tokens=num_prompt_tokens,
            uncomputed_tokens=uncomputed,
            context_tokens=num_prompt_tokens,
            decode_stage=decode_stage,
        )
        self._unseen.add(request_id)
        self._recent_ids.append(request_id)

    def on_output(self, request_id: str, num_new_tokens: int) -> None:
        """vLLM produced ``num_new_tokens`` output tokens for a request (its prompt is computed)."""
        tracked = self._requests.get(request_id)
        if tracked is None:
            return
        tracked.uncomputed_tokens = 0
        tracked.has_output = True
        tracked.decode_stage = True
        tracked.context_tokens += num_new_tokens
        self._unseen.discard(request_id)

    def release(self, request_id: str) -> bool:
        """A request finished or was aborted; False if it was not tracked."""
        self._unseen.discard(request_id)
        return self._requests.pop(request_id, None) is not None

    def on_step(self, stats: StepStats) -> None:
        """vLLM finished a step and reported its statistics."""
        self._running = max(0, stats.num_running_requests)
        self._waiting = max(0, stats.num_waiting_requests)
        self._kv_usage = min(1.0, max(0.0, stats.kv_cache_usage))
        self._unseen.clear()
        if stats.num_prefill_tokens is None:
            return
        prefill_tokens = max(0, stats.num_prefill_tokens)
        remaining = prefill_tokens
        for tracked in self._requests.values():
            if remaining <= 0:
                break
            done = min(remaining, tracked.uncomputed_tokens)
            tracked.uncomputed_tokens -= done
            remaining -= done
        decode_requests = max(0, stats.num_decode_requests or 0)
        self._steps.append(
            StepRecord(
                num_prefill_tokens=prefill_tokens,
                num_decode_requests=decode_requests,
                num_decode_tokens=self._decode_context_estimate(decode_requests),
                duration_ms=max(0.0, stats.duration_ms or 0.0),
            )
        )
        self._num_steps += 1

    def on_preempted(self, count: int) -> None:
        """vLLM preempted ``count`` requests (its ``IterationStats.num_preempted_reqs``)."""
        self._num_preemptions += max(0, count)

    def on_recomputed(self, tokens: int) -> None:
        """vLLM's prefix cache looked up its preempted requests again and ``tokens`` of them were not
        there (its ``PrefixCacheStats``: ``preempted_queries - preempted_hits``; 0 once it caches)."""
        self._num_preemption_recompute_tokens = (self._num_preemption_recompute_tokens or 0) + max(0, tokens)

    def _decode_context_estimate(self, decode_requests: int) -> int:
        """Total context of a step's decode batch of ``decode_requests`` requests.

        vLLM names no requests in its step details; the requests that already
        produced output are that batch, so their context is used, scaled by
        their mean when the two counts differ (preemption, a race with a
        finishing request).
        """
        if decode_requests == 0:
            return 0
        contexts = [t.context_tokens for t in self._requests.values() if t.has_output]
        if not contexts:
            return 0
        if len(contexts) == decode_requests:
            return sum(contexts)
        return round(sum(contexts) / len(contexts) * decode_requests)

    def load(self, *, schedulable: bool) -> EngineLoad:
        """The load right now."""
        active = len(self._requests)
        running = min(self._running, active)
        waiting = min(self._waiting + len(self._unseen), active - running)
        decode = [t for t in self._requests.values() if t.decode_stage]
        return EngineLoad(
            num_waiting_requests=waiting,
            num_running_requests=running,
            num_uncomputed_prefill_tokens=sum(t.uncomputed_tokens for t in self._requests.values()),
            num_decode_requests=len(decode),
            num_decode_tokens=sum(t.context_tokens for t in decode),
            # vLLM's usage lags a finish or abort until its next step; with
            # nothing left the cache holds nothing of ours.
            num_used_kv_tokens=round(self._kv_usage * self.kv_capacity_tokens) if active else 0,
            schedulable=schedulable,
            recent_admitted_request_ids=tuple(self._recent_ids),
            recent_steps=tuple(self._steps),
            num_steps=self._num_steps,
            num_preemptions=self._num_preemptions,
            num_preemption_recompute_tokens=self._num_preemption_recompute_tokens,
        )
