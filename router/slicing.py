"""Slice-level dispatch in the router (``--dispatch-mode slice``).

Each request is served as a sequence of slices of at most ``--slice-tokens``
new tokens. :class:`SliceDispatcher` holds the pool of slices waiting for a
placement and runs the schedule points on a background task: every interval
(adaptive unless ``--slice-interval-ms`` fixes it) it batches the pool with
the serving-time batcher and offloads the batches max-min into per-instance
local queues (:class:`router.core.slicing.SliceScheduler`, the same object the
simulator drives). A queued batch is handed to its instance as soon as the KV
its running slices plan to hold leaves room for it.

:meth:`SliceDispatcher.stream` serves one request: it waits for a placement,
streams the slice from the worker (``Generate`` for the first slice, a
``Decode`` with the tokens generated so far and no KV handle for the next
ones, so the instance recomputes prompt + generated tokens; ``max_tokens`` of
a ``Decode`` counts the whole output, so it is set to the tokens so far plus
this slice), and when a slice ends with ``finish_reason == "length"`` before
the request's ``max_tokens`` it goes back to the pool. The client sees one
stream: a slice's last message is forwarded without ``finished``, and
nothing is re-sent (the worker only streams tokens after the ones it was
given). A worker failure mid-slice keeps the tokens so far and puts the
request back in the pool, up to ``max_retries`` times.

Only neutral instances take slices (a slice is prefill and decode on one
instance); a fleet without schedulable neutral instances fails the request
with ``UNAVAILABLE``. Every instance is priced with its own estimators (its
profile group, chunk budget, KV capacity and block size, scaled by what it is
seen to do: :class:`router.core.slicing.InstanceModels`), so a heterogeneous
fleet is balanced the same whatever order it is listed in. A slice that ends
with output left is followed at once by the next one
(:meth:`SliceDispatcher.resume`), not after the next schedule point.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from dataclasses import dataclass

import grpc
from slorouter.v1 import cms_pb2, common_pb2, worker_pb2

from cms import limits
from fleet.snapshot import ClusterSnapshot, InstanceRecord
from router.core.decision import Choice
from router.core.errors import EmptyClusterError, NoInstanceError, RetriesExhaustedError
from router.core.lifecycle import Phase, RequestState
from router.core.predictors import PredictorSet
from router.core.protocols import dial_endpoint
from router.core.request import Mode, Stage
from router.core.slicing import (
    InstanceShape,
    ModelBook,
    SliceConfig,
    SliceRequest,
    SliceScheduler,
    add_slice_arguments,
    slice_config_of,
    slice_length,
)
from router.forward import LegError, LegTokens, WorkerClient
from router.legs import LegLedger
from router.mux import Tokens
from router.placement import SnapshotSource
from router.route import Route

logger = logging.getLogger(__name__)

#: ``--dispatch-mode`` values.
DISPATCH_MODES = ("request", "slice")


@dataclass(frozen=True)
class SliceTarget:
    """Where one slice runs (satisfies :class:`router.legs.Target`)."""

    instance_id: str
    endpoint: str


def slice_route(instance_id: str, endpoint: str = "") -> Route:
    """A request's route as metrics and the client's ``RouteInfo`` see it: its first slice's instance."""
    choice = Choice(instance_id, endpoint, Stage.NEUTRAL, math.nan, math.nan)
    return Route(
        mode=Mode.NEUTRAL,
        policy="slice",
        prefill=choice,
        decode=choice,
        prefill_group=Stage.NEUTRAL.value,
        decode_group=Stage.NEUTRAL.value,
    )


@dataclass
class _Waiter:
    request: SliceRequest
    future: asyncio.Future[tuple[SliceTarget, int]]


class SliceDispatcher:
    """The router's slice pool and schedule points; see the module docstring.

    ``start()`` launches the schedule loop, ``stop()`` (idempotent) ends it and
    fails the slices still waiting with :class:`EmptyClusterError`.
    """

    def __init__(
        self,
        source: SnapshotSource,
        predictors: PredictorSet | None,
        config: SliceConfig,
        *,
        staleness_s: float,
        profile_label: str = "profile",
        max_retries: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if predictors is None:
            raise ValueError(
                "--dispatch-mode slice needs latency profiles (--profile) to estimate slice times"
            )
        self.config = config
        self._source = source
        self._predictors = predictors
        self._staleness_s = staleness_s
        self._profile_label = profile_label
        self._max_retries = max_retries
        self._clock = clock
        self._sched: SliceScheduler | None = None
        #: Each instance's estimators, kept while its shape holds (see _scheduler).
        self._book = ModelBook(predictors.for_group, config)
        self._endpoints: dict[str, str] = {}
        self._waiting: dict[int, _Waiter] = {}
        #: Slices placed per instance since the start (for tests and logs).
        self.placed_slices: dict[str, int] = {}
        #: Slices that arrived since the last schedule point.
        self._pending: list[SliceRequest] = []
        #: Running slices' progress by ticket: the prompt's length and the request's tokens so far
        #: (the list the caller appends each relayed message to). The scheduler books a running
        #: slice's KV from it (SliceScheduler.committed_kv), as the simulator does from its engines.
        self._running: dict[int, tuple[int, Sequence[int]]] = {}
        self._next_ticket = 0
        self._next_at = 0.0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="slice-dispatcher")

    async def stop(self) -> None:
        self._stopped = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for waiter in self._waiting.values():
            if not waiter.future.done():
                waiter.future.set_exception(EmptyClusterError("the router is shutting down"))
        self._waiting.clear()

    @property
    def waiting(self) -> int:
        """Slices waiting for a placement (in the pool or in a local queue)."""
        return len(self._waiting)

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            delay = self._next_at - self._clock()
            if delay > 0:
                await asyncio.sleep(delay)
            self._wake.clear()
            try:
                self._schedule_point()
            except Exception:  # one bad snapshot must not end the loop; the waiting requests time out
                logger.exception("slice schedule point failed")

    # ------------------------------------------------------------------ schedule points

    def _neutral(self, snapshot: ClusterSnapshot, now: float) -> list[InstanceRecord]:
        return [
            r
            for r in snapshot.instances
            if r.metadata.role == cms_pb2.INSTANCE_ROLE_NEUTRAL
            and r.status is not None
            and r.status.schedulable
            and snapshot.age_s(r, now) <= self._staleness_s
        ]

    def _scheduler(self, records: Sequence[InstanceRecord]) -> SliceScheduler:
        """The slice scheduler over ``records``, each instance with its own estimators
        (:class:`ModelBook`: from its profile group and its own engine limits, kept while they hold)."""
        ids = [r.metadata.instance_id for r in records]
        shapes = {}
        for r in records:
            meta = r.metadata
            shapes[meta.instance_id] = InstanceShape(
                meta.labels.get(self._profile_label, ""),
                max_num_batched_tokens=meta.max_num_batched_tokens or 2048,
                kv_capacity_tokens=meta.kv_capacity_tokens or 65536,
                block_size=meta.block_size or 16,
                max_model_len=meta.max_model_len or 8192,
                max_num_seqs=meta.max_num_seqs or 256,
            )
        models = self._book.models(shapes)
        if self._sched is None:
            first = models[ids[0]]
            self._sched = SliceScheduler(self.config, first.serving, first.memory, ids)
            self._sched.progress = self._context_now
        self._sched.set_models(models)
        self._sched.set_instances(ids)
        return self._sched

    def _schedule_point(self) -> None:
        now = self._clock()
        records = self._neutral(self._source.snapshot(), now)
        if not records:
            self._fail_pool(
                EmptyClusterError(
                    "slice dispatch found no schedulable neutral instance; start neutral workers "
                    "(slices run prefill and decode on one instance) or use --dispatch-mode request"
                )
            )
            self._next_at = now + self.config.min_interval_ms * 1e-3
            return
        for r in records:
            self._endpoints[r.metadata.instance_id] = dial_endpoint(
                r.metadata.endpoint, r.metadata.worker_protocol
            )
        sched = self._scheduler(records)
        # New slices join the pool; slices cancelled while waiting in it leave it here.
        sched.pool = [r for r in [*sched.pool, *self._pending] if self._live(r)]
        self._pending = []
        sched.schedule()
        self._next_at = now + sched.interval_ms() * 1e-3
        for instance in sched.instances:
            self._admit(instance)
        if sched.pool:
            self._wake.set()

    def _context_now(self, key: Hashable) -> int | None:
        found = self._running.get(int(key))  # type: ignore[call-overload]
        return None if found is None else found[0] + len(found[1])

    def _live(self, request: SliceRequest) -> bool:
        waiter = self._waiting.get(int(request.key))  # type: ignore[call-overload]
        return waiter is not None and not waiter.future.done()

    def _fail_pool(self, exc: Exception) -> None:
        """Fail every slice waiting in the pool (not those queued on an instance: they will run)."""
        pool = [*self._pending, *(self._sched.pool if self._sched is not None else [])]
        self._pending = []
        if self._sched is not None:
            self._sched.pool = []
        for request in pool:
            waiter = self._waiting.pop(int(request.key), None)  # type: ignore[call-overload]
            if waiter is not None and not waiter.future.done():
                waiter.future.set_exception(exc)

    def _admit(self, instance: str) -> None:
        sched = self._sched
        if sched is None:
            return
        target = SliceTarget(instance, self._endpoints.get(instance, ""))
        for key, batch in sched.admit(instance):
            for request in batch.requests:
                waiter = self._waiting.pop(int(request.key), None)  # type: ignore[call-overload]
                if waiter is None or waiter.future.done():
                    # Cancelled while queued: its slice ends before it starts.
                    sched.finish(instance, key, request)
                    continue
                waiter.future.set_result((target, key))
                self.placed_slices[instance] = self.placed_slices.get(instance, 0) + 1

    # ------------------------------------------------------------------ one slice

    async def acquire(self, context_tokens: int, slice_tokens: int) -> tuple[SliceTarget, int, SliceRequest]:
        """Wait until the slice is placed; the instance, the batch key and the slice for :meth:`finish`."""
        if self._stopped:
            raise EmptyClusterError("the router is shutting down")
        if len(self._waiting) >= self.config.max_waiting_slices:
            instances = len(self._sched.instances) if self._sched is not None else 0
            raise NoInstanceError(
                f"{len(self._waiting)} slices already wait for a placement (the slice pool's bound); "
                "retry later or add neutral instances",
                stage="neutral",
                candidates=instances,
                drops={"slice_pool_full": instances},
            )
        ticket = self._next_ticket
        self._next_ticket += 1
        request = SliceRequest(ticket, context_tokens, slice_tokens)
        future: asyncio.Future[tuple[SliceTarget, int]] = asyncio.get_running_loop().create_future()
        self._waiting[ticket] = _Waiter(request, future)
        self._pending.append(request)
        self._wake.set()
        try:
            target, key = await future
        except asyncio.CancelledError:
            self._waiting.pop(ticket, None)
            if future.done() and not future.cancelled() and future.exception() is None:
                # Placed just as the caller went away: end the slice at once.
                self.finish(future.result()[0], future.result()[1], request)
            raise
        return target, key, request

    def resume(
        self,
        target: SliceTarget,
        key: int,
        request: SliceRequest,
        context_tokens: int,
        remaining_tokens: int,
        generated_tokens: int = 0,
    ) -> tuple[SliceTarget, int, SliceRequest] | None:
        """End a slice that leaves output to generate and place the next one at once.

        :meth:`SliceScheduler.resume`: no wait for a schedule point or a local
        queue between two slices of a stream. None when there is no scheduler
        to place it (the caller then waits for a placement as for a first slice).
        """
        sched = self._sched
        if sched is None or not sched.instances:
            return None
        ticket = self._next_ticket
        self._next_ticket += 1
        length = slice_length(
            context_tokens,
            remaining_tokens,
            sched.models(target.instance_id).serving,
            self.config,
            generated_tokens,
        )
        following = SliceRequest(ticket, context_tokens, length)
        instance, new_key, _batch = sched.resume(
            target.instance_id, key, request, following, self._clock() * 1e3
        )
        self.placed_slices[instance] = self.placed_slices.get(instance, 0) + 1
        self._admit(target.instance_id)
        return SliceTarget(instance, self._endpoints.get(instance, "")), new_key, following

    def finish(self, target: SliceTarget, key: int, request: SliceRequest) -> None:
        """The slice ended (done, failed or cancelled): free its place, start queued batches."""
        sched = self._sched
        if sched is None:
            return
        sched.finish(target.instance_id, key, request, self._clock() * 1e3)
        self._admit(target.instance_id)

    # ------------------------------------------------------------------ one request

    async def stream(
        self,
        request_id: str,
        prompt_token_ids: tuple[int, ...],
        sampling: common_pb2.SamplingParams,
        state: RequestState,
        workers: WorkerClient,
        timeout_s: float,
    ) -> AsyncIterator[tuple[LegTokens, str]]:
        """Serve a request slice by slice; yields each worker message and the instance it came from.

        ``state`` is the request's lifecycle: this moves its phase (placed, prefilling, decoding; a
        slice's end or failure is a pause and a requeue, the next slice resumes with the tokens so
        far). The caller adds every yielded message's tokens to ``state.tokens`` before asking for
        the next; only the request's last message has ``finished`` set.
        """
        generated = state.tokens
        total = sampling.max_tokens
        failures = 0
        slice_no = 0
        placed: tuple[SliceTarget, int, SliceRequest] | None = None
        while True:
            remaining = total - len(generated)
            context = len(prompt_token_ids) + len(generated)
            if placed is None:
                sched = self._sched
                length = self.config.slice_tokens
                if sched is not None and sched.instances:
                    serving = sched.models(min(sched.instances)).serving
                    length = slice_length(context, remaining, serving, self.config, len(generated))
                target, key, request = await self.acquire(context, min(length, remaining))
            else:
                target, key, request = placed
                placed = None
            slice_tokens = request.slice_tokens
            self._running[int(request.key)] = (len(prompt_token_ids), generated)  # type: ignore[call-overload]
            state.to(Phase.PLACED)
            state.to(Phase.PREFILLING)
            # Worker request ids follow the id limits too (cms/limits.py): ':' separates the slice.
            slice_id = limits.derived_id(request_id, f":s{slice_no}")
            slice_no += 1
            ledger = LegLedger()
            part = common_pb2.SamplingParams()
            part.CopyFrom(sampling)
            call: worker_pb2.WorkerGenerateRequest | worker_pb2.DecodeRequest
            if generated:
                part.max_tokens = (
                    len(generated) + slice_tokens
                )  # a Decode's max_tokens counts the whole output
                call = worker_pb2.DecodeRequest(
                    request_id=slice_id,
                    prompt_token_ids=prompt_token_ids,
                    sampling=part,
                    generated_token_ids=generated,
                )
            else:
                part.max_tokens = slice_tokens
                call = worker_pb2.WorkerGenerateRequest(
                    request_id=slice_id, prompt_token_ids=prompt_token_ids, sampling=part
                )
            ended = False
            carried = False
            try:
                async for message in workers.stream(target, call, timeout_s, ledger):
                    if not message.finished:
                        if message.token_ids:
                            state.advance(Phase.DECODING)
                            yield message, target.instance_id
                        continue
                    ended = True
                    produced = len(generated) + len(message.token_ids)
                    done = message.finish_reason != "length" or produced >= total
                    if message.finish_reason == "abort":
                        raise LegError(
                            target.instance_id, grpc.StatusCode.UNAVAILABLE, "the slice was aborted"
                        )
                    state.advance(Phase.DECODING)
                    if done:
                        yield message, target.instance_id
                        return
                    if message.token_ids:
                        carry = Tokens(
                            message.request_id,
                            list(message.token_ids),
                            message.text,
                            False,
                            "",
                            message.num_prompt_tokens,
                            message.num_cached_prompt_tokens,
                        )
                        yield carry, target.instance_id
                    carried = True
                    state.pause("the slice ended")
                    state.requeue()
                    break
                else:
                    raise LegError(
                        target.instance_id, grpc.StatusCode.UNAVAILABLE, "slice stream ended early"
                    )
            except LegError as exc:
                if not exc.retryable:
                    raise
                failures += 1
                state.pause(f"the slice on {target.instance_id} failed")
                state.requeue()
                if failures > self._max_retries:
                    raise RetriesExhaustedError(
                        f"slices failed {failures} times after {len(generated)} tokens "
                        f"(--max-retries {self._max_retries}): {exc}"
                    ) from exc
                logger.warning(
                    "request %s: slice on %s failed (%s); back to the pool",
                    request_id,
                    target.instance_id,
                    exc,
                )
            finally:
                self._running.pop(int(request.key), None)  # type: ignore[call-overload]
                left = total - len(generated)
                if carried and left > 0 and self.config.resume_at_once:
                    placed = self.resume(
                        target, key, request, len(prompt_token_ids) + len(generated), left, len(generated)
                    )
                if placed is None:
                    self.finish(target, key, request)
                if not ended:
                    workers.abort_all(slice_id, ledger)


# --------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--dispatch-mode``, ``--slice-tokens`` and ``--slice-interval-ms`` (router and ``up``)."""
    group = parser.add_argument_group("dispatch")
    group.add_argument(
        "--dispatch-mode",
        choices=DISPATCH_MODES,
        default="request",
        help="request: place each whole request (the scheduling policy); slice: place requests "
        "--slice-tokens new tokens at a time, batched and offloaded max-min to neutral instances (SCLS, "
        "seed 002). On continuous-batching engines slices pay where the KV does not hold the load: "
        "where request dispatch makes the engines preempt about once per ten requests or more, slices "
        "keep a KV plan that holds, complete every request without preempting and do 1.0x-2.6x the "
        "work on long prompts and small KV; with long answers (hundreds of tokens) they do 0.88x-0.97x "
        "(a smaller decode batch), and everywhere they lose SLO attainment to slo (a first slice "
        "waits for a schedule point and room in the plan: TTFT grows); where the KV holds request "
        "dispatch wins outright (slices 0.91-0.97x, attainment down by up to half). `slo-router simulate --dispatch-modes request,slice,auto` "
        "tells which side of that line a fleet and workload are on. There is no live 'auto': its rule "
        "counts the engines' preemptions under request dispatch, which an instance's status does not "
        "carry, and which stop once slices run (default: %(default)s)",
    )
    add_slice_arguments(
        group,
        interval_help="slice mode: fixed time between schedule points (default: adaptive, "
        "max(0.5 x queued work of the least-loaded instance, 200 ms))",
    )


def slice_config_from_args(args: argparse.Namespace) -> SliceConfig | None:
    """The slice configuration the flags ask for, or ``None`` for request dispatch; errors name the flag."""
    if args.dispatch_mode != "slice":
        return None
    return slice_config_of(args.slice_tokens, args.slice_interval_ms)
