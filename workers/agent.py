"""The status agent: turns an engine's load changes into CMS status reports.

:class:`StatusAgent` listens to the engine (``Engine.add_load_listener``) and,
on every change, builds an ``InstanceStatus`` from ``Engine.load()`` and hands
it to a :class:`StatusSink` — in production ``cms.agent.AgentWriter``, which
registers the instance, sends the newest status (latest wins), heartbeats and
deregisters on shutdown.

- Publishing is coalesced: the first change after a quiet period is published
  on the next turn of the event loop; further changes within ``coalesce_s``
  are folded into one publish at the end of that window.
- ``update_id`` grows with every status that differs from the last one
  published. It starts from the epoch time in microseconds, so it keeps
  growing across a worker restart (the CMS keeps the last status of a
  re-registered instance and ignores ids that are not newer).
- ``admitted_request_ids`` are the engine's recent admissions, at most
  ``max_admitted_ids``; ``step_samples`` are the steps finished since the
  previous status, at most ``max_step_samples`` (the newest).
- Engine liveness, not just agent liveness: an engine that holds work
  (waiting or running requests) but has finished no step for
  ``engine_stall_s`` is reported unschedulable, with the reason in
  ``unschedulable_reason``, until its steps resume. The agent checks this on
  a timer of its own, because a hung engine announces nothing; the heartbeat
  keeps the CMS entry alive, so without this check a hung engine would keep
  receiving traffic.
- Nothing here raises into the worker: a failing sink is logged and skipped.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Protocol

from slorouter.v1 import cms_pb2

from cms.transport import ClientTls
from engine.interface import Engine, EngineLoad, StepRecord

logger = logging.getLogger(__name__)

#: Longest ``unschedulable_reason`` a status carries (the agent writes it from a fixed template).
MAX_REASON_CHARS = 200


class StatusSink(Protocol):
    """Where statuses go (``cms.agent.AgentWriter`` implements it)."""

    async def start(self) -> None:
        """Begin delivering; returns at once and never raises."""

    def publish(self, status: cms_pb2.InstanceStatus) -> None:
        """Take the newest status; never blocks, never raises."""

    async def stop(self) -> None:
        """Stop delivering and deregister. Idempotent."""


def make_cms_sink(
    target: str,
    metadata: cms_pb2.InstanceMetadata,
    *,
    auth_token: str | None = None,
    heartbeat_interval_s: float = 0.5,
    backoff_max_s: float = 5.0,
    tls: ClientTls | None = None,
) -> StatusSink:
    """The CMS writer for ``target`` (``host:port`` or ``grpc://host:port``)."""
    from cms.agent import AgentWriter

    return AgentWriter(
        target,
        metadata,
        auth_token=auth_token,
        heartbeat_interval_s=heartbeat_interval_s,
        backoff_max_s=backoff_max_s,
        tls=tls,
    )


def build_status(
    instance_id: str,
    load: EngineLoad,
    *,
    update_id: int,
    timestamp_ms: int,
    step_samples: tuple[StepRecord, ...] = (),
    max_admitted_ids: int = 256,
    unschedulable_reason: str = "",
) -> cms_pb2.InstanceStatus:
    """An ``InstanceStatus`` for ``load``; the admitted ids are cut to the newest ``max_admitted_ids``.

    A non-empty ``unschedulable_reason`` makes the instance unschedulable whatever the engine says.
    """
    admitted = load.recent_admitted_request_ids[-max_admitted_ids:] if max_admitted_ids > 0 else ()
    return cms_pb2.InstanceStatus(
        instance_id=instance_id,
        update_id=update_id,
        timestamp_ms=timestamp_ms,
        schedulable=load.schedulable and not unschedulable_reason,
        unschedulable_reason=unschedulable_reason[:MAX_REASON_CHARS],
        num_waiting_requests=load.num_waiting_requests,
        num_running_requests=load.num_running_requests,
        num_uncomputed_prefill_tokens=load.num_uncomputed_prefill_tokens,
        num_decode_requests=load.num_decode_requests,
        num_decode_tokens=load.num_decode_tokens,
        num_used_kv_tokens=load.num_used_kv_tokens,
        cache_hit_rate=min(1.0, max(0.0, load.cache_hit_rate)),
        num_preemptions=load.num_preemptions,
        num_preemption_recompute_tokens=load.num_preemption_recompute_tokens,
        admitted_request_ids=admitted,
        step_samples=[
            cms_pb2.StepSample(
                num_prefill_tokens=s.num_prefill_tokens,
                num_decode_requests=s.num_decode_requests,
                num_decode_tokens=s.num_decode_tokens,
                duration_ms=s.duration_ms,
            )
            for s in step_samples
        ],
    )


class StatusAgent:
    """Publishes an engine's load to a :class:`StatusSink`; see the module docstring.

    ``clock`` gives epoch seconds (status timestamps and the first update id);
    coalescing and the stall check use the event loop's clock.
    ``engine_stall_s`` (0 = off) is how long an engine holding work may go
    without finishing a step before it is reported unschedulable.
    """

    def __init__(
        self,
        engine: Engine,
        metadata: cms_pb2.InstanceMetadata,
        sink: StatusSink,
        *,
        coalesce_s: float = 0.005,
        max_admitted_ids: int = 256,
        max_step_samples: int = 64,
        engine_stall_s: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if coalesce_s < 0:
            raise ValueError(f"coalesce_s must be >= 0, got {coalesce_s}")
        if not (math.isfinite(engine_stall_s) and engine_stall_s >= 0):
            raise ValueError(f"engine_stall_s must be a finite number >= 0 (0 = off), got {engine_stall_s!r}")
        if max_admitted_ids < 0 or max_step_samples < 0:
            raise ValueError(
                f"max_admitted_ids and max_step_samples must be >= 0, got {max_admitted_ids}, {max_step_samples}"
            )
        self._engine = engine
        self._instance_id = metadata.instance_id
        self._sink = sink
        self._coalesce_s = coalesce_s
        self._max_ids = max_admitted_ids
        self._max_samples = max_step_samples
        self._clock = clock
        self._update_id = int(clock() * 1_000_000)
        self._last_load: EngineLoad | None = None
        self._last_status: cms_pb2.InstanceStatus | None = None
        self._last_publish_at = float("-inf")
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listening = False
        self._started = False
        self._stopping: asyncio.Task[None] | None = None
        self._stall_s = engine_stall_s
        self._stall_timer: asyncio.TimerHandle | None = None
        #: The engine's step count when it last made progress (or had nothing to do), and when.
        self._progress_steps = -1
        self._progress_at = 0.0
        #: Since when an engine marked stalled holds no work (None: it holds some, or is not marked).
        self._idle_since: float | None = None
        #: Why the engine is unschedulable as far as the agent can tell ("" = it is not stalled).
        self._stall_reason = ""
        #: Statuses handed to the sink (for tests and metrics).
        self.published = 0

    @property
    def last_status(self) -> cms_pb2.InstanceStatus | None:
        """The last status handed to the sink."""
        return self._last_status

    @property
    def sink(self) -> StatusSink:
        return self._sink

    @property
    def stall_reason(self) -> str:
        """Why the engine is reported unschedulable by the stall check ("" while it makes progress)."""
        return self._stall_reason

    async def start(self) -> None:
        """Start the sink, publish the current load and follow the engine. Returns at once."""
        if self._started:
            return
        self._started = True
        self._loop = asyncio.get_running_loop()
        try:
            await self._sink.start()
        except Exception:
            logger.exception("status sink failed to start; the worker keeps serving")
        if not self._listening:
            self._listening = True
            self._engine.add_load_listener(self._on_change)
        self._progress_at = self._loop.time()
        self._flush()
        if self._stall_s > 0:
            self._schedule_stall_check()

    async def stop(self) -> None:
        """Stop publishing and stop the sink (which deregisters). Idempotent."""
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_task(self._stop())
        await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        try:
            await self._sink.stop()
        except Exception:
            logger.exception("status sink failed to stop")

    def _on_change(self) -> None:
        # Called by the engine on every load change, possibly many times per step: only schedule.
        if self._stopping is not None or self._timer is not None or self._loop is None:
            return
        delay = max(0.0, self._last_publish_at + self._coalesce_s - self._loop.time())
        self._timer = self._loop.call_later(delay, self._flush)

    # ------------------------------------------------------------------ engine liveness

    def _schedule_stall_check(self) -> None:
        assert self._loop is not None
        # A few checks per stall period: a stall is noticed within 1.25 × engine_stall_s.
        self._stall_timer = self._loop.call_later(min(1.0, self._stall_s / 4), self._check_stall)

    def _check_stall(self) -> None:
        self._stall_timer = None
        if self._stopping is not None:
            return
        try:
            before = self._stall_reason
            load = self._engine.load()
            self._note_progress(load)
            if self._stall_reason != before:
                if self._timer is not None:
                    self._timer.cancel()
                self._flush(force=True)
        except Exception:
            logger.exception("checking the engine's liveness failed; the worker keeps serving")
        self._schedule_stall_check()

    def _note_progress(self, load: EngineLoad) -> None:
        """Update the stall verdict from ``load`` (called on every change and by the stall timer).

        The verdict is lifted when a step finishes. An engine marked stalled
        that then holds nothing (its requests were aborted, e.g. by the
        router's first-message deadline) cannot show progress; after
        ``engine_stall_s`` without work it is given the benefit of the doubt
        and reported schedulable again, on probation: the next work it holds
        without finishing a step marks it again.
        """
        if self._stall_s <= 0 or self._loop is None:
            return
        now = self._loop.time()
        holding = load.num_waiting_requests + load.num_running_requests
        if load.num_steps != self._progress_steps:
            self._progress_steps = load.num_steps
            self._progress_at = now
            self._idle_since = None
            if self._stall_reason:
                logger.warning("engine steps resumed; schedulable again")
                self._stall_reason = ""
            return
        if holding == 0:
            if not self._stall_reason:
                self._progress_at = now
                return
            if self._idle_since is None:
                self._idle_since = now
            if now - self._idle_since >= self._stall_s:
                logger.warning(
                    "engine marked stalled holds no work for %.1f s; schedulable again on probation",
                    now - self._idle_since,
                )
                self._stall_reason = ""
                self._progress_at = now
                self._idle_since = None
            return
        self._idle_since = None
        idle_s = now - self._progress_at
        if idle_s >= self._stall_s:
            if not self._stall_reason:
                logger.warning(
                    "engine stalled: no step for %.1f s while holding %d requests; reporting unschedulable",
                    idle_s,
                    holding,
                )
            self._stall_reason = (
                f"engine stalled: no step finished for over {self._stall_s:g} s "
                f"(--engine-stall-s) while holding {holding} requests"
            )

    # ------------------------------------------------------------------ publishing

    def _flush(self, force: bool = False) -> None:
        self._timer = None
        if self._stopping is not None or self._loop is None:
            return
        try:
            load = self._engine.load()
            self._note_progress(load)
            if load == self._last_load and not force:
                return
            samples = self._new_steps(load)
            self._update_id += 1
            status = build_status(
                self._instance_id,
                load,
                update_id=self._update_id,
                timestamp_ms=int(self._clock() * 1000),
                step_samples=samples,
                max_admitted_ids=self._max_ids,
                unschedulable_reason=self._stall_reason,
            )
            self._last_load = load
            self._last_status = status
            self._last_publish_at = self._loop.time()
            self._sink.publish(status)
            self.published += 1
        except Exception:
            logger.exception("publishing a status failed; the worker keeps serving")

    def _new_steps(self, load: EngineLoad) -> tuple[StepRecord, ...]:
        """The step samples finished since the last status (the newest ``max_step_samples``)."""
        if self._max_samples == 0:
            return ()
        steps = load.recent_steps
        previous = self._last_load
        if load.num_steps > 0 and previous is not None:
            new = load.num_steps - previous.num_steps
            steps = steps[len(steps) - new :] if 0 <= new < len(steps) else steps
        return steps[-self._max_samples :]
