"""The agent-side writer: keeps one instance registered and its status current in the CMS.

Every worker runs one :class:`AgentWriter`. The worker calls :meth:`publish`
whenever its load changes; a background loop does the rest:

- registers the instance (and re-registers after ``NOT_FOUND`` or when it has
  not reached the CMS for a whole lease, e.g. after a Redis restart);
- sends the newest published status as soon as the previous RPC finished —
  statuses published meanwhile are coalesced, the latest wins;
- heartbeats: with nothing new to send it re-sends the last status (same
  ``update_id``, ``timestamp_ms`` refreshed from ``clock``) at least every
  ``heartbeat_interval_s`` (capped at a third of the lease), which renews the
  lease; before the first status it renews by re-registering;
- when the CMS is unreachable or failing, retries with capped exponential
  backoff and jitter (tenacity) while the worker keeps serving.

Nothing here raises into the worker. ``update_id`` is the caller's: it must
grow with every real change, and it should keep growing across a worker
restart (e.g. start from the epoch time in microseconds), because the CMS
keeps the last status of a re-registered instance and treats an id that is
not newer as a heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType

import grpc
from slorouter.v1 import cms_pb2, cms_pb2_grpc
from tenacity import RetryCallState

from cms import limits
from cms.auth import bearer
from cms.backoff import channel_options, retrying, strip_grpc_scheme
from cms.tasks import cancel_and_wait
from cms.transport import ClientTls, message_size_options, open_channel

logger = logging.getLogger(__name__)


#: google.rpc.Code value -> grpc.StatusCode (ReportStatusOutcome.code).
_STATUS_CODES: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


class _Retry(Exception):
    """One attempt failed in a way that backing off and trying again may fix."""


#: Bytes of statuses one ReportStatuses call of a StatusBatcher carries at most: half the CMS's
#: message limit, so a batch always fits whatever else the message holds.
BATCH_BYTES = limits.CMS_MAX_RECEIVE_BYTES // 2


class StatusBatcher:
    """One connection that carries the statuses of many :class:`AgentWriter` s (e.g. every
    instance on a node) to the CMS, many per ``ReportStatuses`` call.

    A writer's :meth:`report` joins the next call; a call leaves as soon as the previous one
    returned (no timer: under load the batches grow by themselves, idle a status goes alone),
    with at most ``limits.MAX_REPORT_BATCH`` statuses and :data:`BATCH_BYTES` bytes. Each writer gets its own status's outcome,
    so re-registration after ``NOT_FOUND`` stays the writer's business. Against a CMS without
    ``ReportStatuses`` (``UNIMPLEMENTED``) it sends one ``ReportStatus`` per status from then on.
    All writers sharing it use its token, so that token must allow writing all their ids.
    """

    def __init__(
        self,
        target: str,
        *,
        auth_token: str | None = None,
        rpc_timeout_s: float = 1.0,
        backoff_max_s: float = 5.0,
        tls: ClientTls | None = None,
    ) -> None:
        if not rpc_timeout_s > 0:
            raise ValueError(f"rpc_timeout_s must be > 0, got {rpc_timeout_s}")
        self.target = strip_grpc_scheme(target)
        self._call_metadata = bearer(auth_token)
        self._rpc_timeout_s = rpc_timeout_s
        self._backoff_max_s = backoff_max_s
        self._tls = tls
        #: Whether the CMS offers ReportStatuses (None until the first call tells).
        self.batched: bool | None = None
        #: ReportStatuses calls made, and the statuses they carried (for tests and metrics).
        self.calls = 0
        self.statuses = 0
        self._queue: list[tuple[cms_pb2.InstanceStatus, asyncio.Future[tuple[grpc.StatusCode, str]]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: cms_pb2_grpc.ClusterMetadataAsyncStub | None = None

    def _open(self) -> cms_pb2_grpc.ClusterMetadataAsyncStub:
        if self._stub is None:
            self._channel = open_channel(
                self.target,
                [
                    *channel_options(self._backoff_max_s),
                    *message_size_options(limits.CMS_MAX_RECEIVE_BYTES, limits.CMS_MAX_RECEIVE_BYTES),
                ],
                tls=self._tls,
            )
            self._stub = cms_pb2_grpc.ClusterMetadataStub(self._channel)
        return self._stub

    async def report(self, status: cms_pb2.InstanceStatus) -> tuple[grpc.StatusCode, str]:
        """Send ``status`` with the next batch; its code and details (``OK`` when stored or a heartbeat)."""
        future: asyncio.Future[tuple[grpc.StatusCode, str]] = asyncio.get_running_loop().create_future()
        self._queue.append((status, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush(), name="cms-status-batcher")
        return await asyncio.shield(future)

    async def _flush(self) -> None:
        stub = self._open()
        while self._queue:
            batch = self._take()
            try:
                results = await self._send(stub, [status for status, _ in batch])
            except BaseException as exc:  # closed, or a bug: no writer may wait for ever
                code = (
                    grpc.StatusCode.CANCELLED
                    if isinstance(exc, asyncio.CancelledError)
                    else grpc.StatusCode.INTERNAL
                )
                for _, future in [*batch, *self._queue]:
                    if not future.done():
                        future.set_result((code, f"the status batcher stopped: {exc!r}"))
                self._queue.clear()
                raise
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)

    def _take(self) -> list[tuple[cms_pb2.InstanceStatus, asyncio.Future[tuple[grpc.StatusCode, str]]]]:
        """The next batch: at most MAX_REPORT_BATCH statuses and BATCH_BYTES bytes (at least one)."""
        count = size = 0
        for status, _ in self._queue:
            size += status.ByteSize() + 8  # the repeated field's tag and length
            if count and (count >= limits.MAX_REPORT_BATCH or size > BATCH_BYTES):
                break
            count += 1
        batch = self._queue[:count]
        del self._queue[:count]
        return batch

    async def _send(
        self, stub: cms_pb2_grpc.ClusterMetadataAsyncStub, statuses: list[cms_pb2.InstanceStatus]
    ) -> list[tuple[grpc.StatusCode, str]]:
        if self.batched is not False:
            try:
                response = await stub.ReportStatuses(
                    cms_pb2.ReportStatusesRequest(statuses=statuses),
                    timeout=self._rpc_timeout_s,
                    metadata=self._call_metadata,
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    return [(exc.code(), exc.details() or "")] * len(statuses)
                logger.info("CMS at %s has no ReportStatuses; using ReportStatus", self.target)
                self.batched = False
            else:
                self.batched = True
                self.calls += 1
                self.statuses += len(statuses)
                if len(response.outcomes) != len(statuses):
                    return [
                        (grpc.StatusCode.INTERNAL, "the CMS answered a batch with the wrong count")
                    ] * len(statuses)
                return [
                    (_STATUS_CODES.get(o.code, grpc.StatusCode.UNKNOWN), o.message) for o in response.outcomes
                ]
        results = []
        for status in statuses:
            try:
                await stub.ReportStatus(
                    cms_pb2.ReportStatusRequest(status=status),
                    timeout=self._rpc_timeout_s,
                    metadata=self._call_metadata,
                )
            except grpc.aio.AioRpcError as exc:
                results.append((exc.code(), exc.details() or ""))
            else:
                results.append((grpc.StatusCode.OK, ""))
        return results

    async def close(self) -> None:
        """Stop sending (waiting writers get ``CANCELLED``) and close the connection. Idempotent."""
        flusher, self._flusher = self._flusher, None
        if flusher is not None:
            await cancel_and_wait(flusher)
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close(None)


class AgentWriter:
    """Registers one instance with a CMS and keeps its status there.

    ``target`` is ``host:port`` or ``grpc://host:port``. ``clock`` gives epoch
    seconds for heartbeat timestamps; intervals use the event loop's clock.

    Counters (for tests and metrics): ``registrations`` (successful
    RegisterInstance calls), ``registrations_failed``, ``reports_sent``
    (successful reports, heartbeats included), ``reports_failed``; ``batched`` (whether
    the CMS offers ``ReportStatuses``; it falls back to ``ReportStatus`` on ``UNIMPLEMENTED``).

    With a shared ``batcher`` (:class:`StatusBatcher`, owned and closed by the caller) its
    statuses travel with those of the other writers on the batcher's connection and token;
    registration, heartbeat timing and deregistration stay this writer's.
    """

    def __init__(
        self,
        target: str,
        metadata: cms_pb2.InstanceMetadata,
        *,
        auth_token: str | None = None,
        heartbeat_interval_s: float = 0.5,
        rpc_timeout_s: float = 1.0,
        backoff_max_s: float = 5.0,
        clock: Callable[[], float] = time.time,
        tls: ClientTls | None = None,
        batcher: StatusBatcher | None = None,
    ) -> None:
        for name, value in (
            ("heartbeat_interval_s", heartbeat_interval_s),
            ("rpc_timeout_s", rpc_timeout_s),
            ("backoff_max_s", backoff_max_s),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if not metadata.instance_id:
            raise ValueError("metadata.instance_id must not be empty")
        self.target = strip_grpc_scheme(target)
        self._metadata = cms_pb2.InstanceMetadata()
        self._metadata.CopyFrom(metadata)
        self._call_metadata = bearer(auth_token)
        self._tls = tls
        self._batcher = batcher
        #: The registration epoch the CMS gave at the last registration (0 before).
        self.epoch = 0
        self._heartbeat_interval_s = heartbeat_interval_s
        self._rpc_timeout_s = rpc_timeout_s
        self._backoff_max_s = backoff_max_s
        self._clock = clock

        self.registered = False
        self.registrations = 0
        self.registrations_failed = 0
        self.reports_sent = 0
        self.reports_failed = 0
        #: Whether the CMS offers ReportStatuses (None until the first report tells).
        self.batched: bool | None = None
        #: Lease the CMS granted at the last registration, in seconds (None before).
        self.lease_ttl_s: float | None = None

        self._pending: cms_pb2.InstanceStatus | None = None
        self._last: cms_pb2.InstanceStatus | None = None
        self._last_ok = 0.0
        self._failing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._wake: asyncio.Event | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: cms_pb2_grpc.ClusterMetadataAsyncStub | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping: asyncio.Task[None] | None = None

    @property
    def instance_id(self) -> str:
        return self._metadata.instance_id

    @property
    def last_sent(self) -> cms_pb2.InstanceStatus | None:
        """The last status the CMS acknowledged (a heartbeat re-sends it)."""
        return self._last

    async def start(self) -> None:
        """Start the background loop and return at once (a down CMS is not an error here)."""
        if self._task is not None or self._stopping is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._wake = asyncio.Event()
        self._channel = open_channel(
            self.target,
            [
                *channel_options(self._backoff_max_s),
                *message_size_options(limits.CMS_MAX_RECEIVE_BYTES, limits.CMS_MAX_RECEIVE_BYTES),
            ],
            tls=self._tls,
        )
        self._stub = cms_pb2_grpc.ClusterMetadataStub(self._channel)
        self._task = self._loop.create_task(self._run(), name=f"cms-agent:{self.instance_id}")

    def publish(self, status: cms_pb2.InstanceStatus) -> None:
        """Hand over the newest status; never blocks, never raises.

        The status is copied, and its ``instance_id`` is set to this agent's.
        Safe to call from another thread than the one running the loop.
        """
        own = cms_pb2.InstanceStatus()
        own.CopyFrom(status)
        own.instance_id = self._metadata.instance_id
        loop = self._loop
        if loop is None or threading.get_ident() == self._loop_thread:
            self._set_pending(own)
            return
        with contextlib.suppress(RuntimeError):  # a closed loop: the agent is gone with it
            loop.call_soon_threadsafe(self._set_pending, own)

    def _set_pending(self, status: cms_pb2.InstanceStatus) -> None:
        self._pending = status
        if self._wake is not None:
            self._wake.set()

    # -- the loop ---------------------------------------------------------------------------------

    def _heartbeat_every_s(self) -> float:
        if self.lease_ttl_s:
            return min(self._heartbeat_interval_s, self.lease_ttl_s / 3)
        return self._heartbeat_interval_s

    async def _wait_for_work(self) -> None:
        assert self._loop is not None and self._wake is not None
        while self._pending is None and self.registered:
            due = self._last_ok + self._heartbeat_every_s() - self._loop.time()
            if due <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), due)
            except TimeoutError:
                return

    async def _run(self) -> None:
        while True:
            try:
                await self._wait_for_work()
                async for attempt in retrying(
                    backoff_max_s=self._backoff_max_s, retry_on=_Retry, before_sleep=self._before_sleep
                ):
                    with attempt:
                        await self._send_once()
                if self._failing:
                    self._failing = False
                    logger.info("agent %s: CMS at %s reachable again", self.instance_id, self.target)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not kill the agent, nor spin
                logger.exception("agent %s: unexpected error; continuing", self.instance_id)
                await asyncio.sleep(self._backoff_max_s)

    def _before_sleep(self, state: RetryCallState) -> None:
        if not self._failing:
            self._failing = True
            exc = state.outcome.exception() if state.outcome is not None else None
            logger.warning(
                "agent %s: CMS at %s failing (%s); retrying with backoff up to %.1f s",
                self.instance_id,
                self.target,
                exc,
                self._backoff_max_s,
            )

    async def _send_once(self) -> None:
        assert self._loop is not None
        if self.registered and self.lease_ttl_s and self._loop.time() - self._last_ok > self.lease_ttl_s:
            self.registered = False  # we have been silent for a whole lease: it lapsed
        for _ in range(2):  # a second round only after NOT_FOUND made us re-register
            just_registered = False
            if not self.registered:
                await self._register()
                just_registered = True
            status = self._pending
            if status is None and self._last is not None:
                status = self._heartbeat()
            if status is None:
                if not just_registered:
                    await self._register()  # no status yet: re-registering renews the lease
                return
            if await self._report(status):
                return
        raise _Retry("the CMS forgot the instance right after registering it")

    def _heartbeat(self) -> cms_pb2.InstanceStatus:
        assert self._last is not None
        beat = cms_pb2.InstanceStatus()
        beat.CopyFrom(self._last)
        beat.timestamp_ms = int(self._clock() * 1000)
        return beat

    async def _register(self) -> None:
        assert self._stub is not None and self._loop is not None
        try:
            response = await self._stub.RegisterInstance(
                cms_pb2.RegisterInstanceRequest(metadata=self._metadata),
                timeout=self._rpc_timeout_s,
                metadata=self._call_metadata,
            )
        except grpc.aio.AioRpcError as exc:
            self.registered = False
            self.registrations_failed += 1
            refused = exc.code() in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.UNAUTHENTICATED,
                grpc.StatusCode.ALREADY_EXISTS,
                grpc.StatusCode.PERMISSION_DENIED,
            )
            if refused and not self._failing:  # once per outage, not once per retry
                logger.error("agent %s: the CMS refuses to register it: %s", self.instance_id, exc.details())
            raise _Retry(f"RegisterInstance: {exc.code().name}: {exc.details()}") from exc
        if not self.registered:  # a renewal (no status to send yet) is not news
            logger.info(
                "agent %s: registered with the CMS at %s (lease %.1f s)",
                self.instance_id,
                self.target,
                response.lease_ttl_ms / 1000.0,
            )
        self.registered = True
        self.registrations += 1
        self.epoch = response.epoch
        self.lease_ttl_s = response.lease_ttl_ms / 1000.0 or None
        self._last_ok = self._loop.time()

    async def _call_report(self, status: cms_pb2.InstanceStatus) -> tuple[grpc.StatusCode, str]:
        """Send one status; the call's code and details (``OK`` when stored or taken as a heartbeat).

        Uses ``ReportStatuses`` while the CMS offers it and ``ReportStatus`` once it answered
        ``UNIMPLEMENTED`` (a CMS older than the batched call), for the rest of this writer's life.
        """
        assert self._stub is not None
        if self._batcher is not None:
            code, details = await self._batcher.report(status)
            self.batched = self._batcher.batched
            return code, details
        try:
            if self.batched is not False:
                try:
                    response = await self._stub.ReportStatuses(
                        cms_pb2.ReportStatusesRequest(statuses=[status]),
                        timeout=self._rpc_timeout_s,
                        metadata=self._call_metadata,
                    )
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                        raise
                    logger.info(
                        "agent %s: the CMS has no ReportStatuses; using ReportStatus", self.instance_id
                    )
                    self.batched = False
                else:
                    self.batched = True
                    if len(response.outcomes) != 1:
                        return grpc.StatusCode.INTERNAL, f"{len(response.outcomes)} outcomes for one status"
                    outcome = response.outcomes[0]
                    return _STATUS_CODES.get(outcome.code, grpc.StatusCode.UNKNOWN), outcome.message
            await self._stub.ReportStatus(
                cms_pb2.ReportStatusRequest(status=status),
                timeout=self._rpc_timeout_s,
                metadata=self._call_metadata,
            )
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
        return grpc.StatusCode.OK, ""

    async def _report(self, status: cms_pb2.InstanceStatus) -> bool:
        """Send one status. ``False`` means "re-register, then send again"."""
        assert self._loop is not None
        status.epoch = self.epoch  # statuses are ours (copied in publish); stamp the current epoch
        code, details = await self._call_report(status)
        if code != grpc.StatusCode.OK:
            self.reports_failed += 1
            if code == grpc.StatusCode.NOT_FOUND:
                self.registered = False
                return False
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                # Sending it again cannot help: drop it and keep going.
                logger.error("agent %s: the CMS rejected a status: %s", self.instance_id, details)
                if self._pending is status:
                    self._pending = None
                if self._last is not None and self._last.update_id == status.update_id:
                    self._last = None
                return True
            if code == grpc.StatusCode.UNAUTHENTICATED and not self._failing:
                logger.error("agent %s: %s", self.instance_id, details)
            raise _Retry(f"ReportStatus: {code.name}: {details}")
        self.reports_sent += 1
        self._last_ok = self._loop.time()
        if self._pending is status:
            self._pending = None
        if self._last is None or status is not self._last:
            self._last = status
        return True

    # -- shutdown ---------------------------------------------------------------------------------

    async def stop(self) -> None:
        """Stop the loop, deregister best-effort within ``rpc_timeout_s``, close. Idempotent."""
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_task(self._stop())
        await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)
        if self._stub is not None and self.registrations:
            try:
                await self._stub.DeregisterInstance(
                    cms_pb2.DeregisterInstanceRequest(instance_id=self.instance_id),
                    timeout=self._rpc_timeout_s,
                    metadata=self._call_metadata,
                )
            except grpc.aio.AioRpcError as exc:
                logger.debug("agent %s: deregistration failed: %s", self.instance_id, exc.code().name)
        self.registered = False
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close(None)

    async def __aenter__(self) -> AgentWriter:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
