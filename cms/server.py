"""The ClusterMetadata gRPC service, and a way to run it in-process.

:func:`start_cms_server` serves one store on one address, with the standard
``grpc.health.v1`` health service and server reflection beside it. It is what
``slo-router cms`` runs, what the embedded cluster runs, and what tests run.

With tokens configured (:class:`~cms.auth.TokenTable`) every RPC, reads
included, needs ``authorization: Bearer <token>`` metadata; the token's
principal owns the instance ids it registers (see :mod:`cms.store`). A view
larger than one message is sent in chunks (``ClusterView.chunk_count``), so
a fleet of any size fits the gRPC message limit. ``WatchClusterView`` streams come from one shared
:class:`~cms.view.ViewPump`: each watcher holds at most one pending view
(latest wins), so a slow watcher costs one view of memory and never delays
writers or other watchers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health_pb2
from slorouter.v1 import cms_pb2, cms_pb2_grpc

from cms import limits
from cms.auth import Grant, TokenTable
from cms.errors import (
    ClockSkewError,
    CmsError,
    InvalidArgumentError,
    PermissionDeniedError,
    QuotaExceededError,
    UnauthenticatedError,
    grpc_code,
)
from cms.serving import add_health_and_reflection, bind_server
from cms.store import DEFAULT_LEASE_TTL_S, CmsStore
from cms.transport import ServerTls
from cms.validation import check_clock_skew, check_lease_ttl, validate_instance_id, validate_status
from cms.view import LatestSlot, PumpUpdate, ViewPump, chunk_view, epoch_ms, snapshot_to_view
from fleet.snapshot import ClusterSnapshot

logger = logging.getLogger(__name__)

SERVICE_NAME: str = cms_pb2.DESCRIPTOR.services_by_name["ClusterMetadata"].full_name
DEFAULT_LISTEN = "127.0.0.1:7100"
#: Live instance ids one unrestricted ``write`` token may hold at once (``--max-instances-per-token``).
DEFAULT_MAX_INSTANCES_PER_TOKEN = 64
#: Store writes all ReportStatuses calls together keep in flight: enough to overlap Redis round
#: trips, well below the Redis client's pool of 100 connections (which a 512-status batch would
#: otherwise exhaust on its own).
BATCH_STORE_CONCURRENCY = 32

_CLOSED = object()
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class SkewStats:
    """Clock skew of the statuses a CMS received (``timestamp_ms`` minus the CMS's clock).

    ``ahead_ms``/``behind_ms`` are the largest skews either way since the last
    :meth:`take` (a scrape); ``refused`` counts statuses refused for skew.
    """

    def __init__(self) -> None:
        self.ahead_ms = 0
        self.behind_ms = 0
        self.last_ms = 0
        self.refused = 0

    def observe(self, skew_ms: int) -> None:
        self.last_ms = skew_ms
        if skew_ms > self.ahead_ms:
            self.ahead_ms = skew_ms
        if -skew_ms > self.behind_ms:
            self.behind_ms = -skew_ms

    def take(self) -> tuple[int, int]:
        window = (self.ahead_ms, self.behind_ms)
        self.ahead_ms = self.behind_ms = 0
        return window


class ClusterMetadataService(cms_pb2_grpc.ClusterMetadataServicer):
    """Maps the RPCs onto a :class:`~cms.store.CmsStore`; errors become status codes here."""

    def __init__(
        self,
        store: CmsStore,
        pump: ViewPump,
        *,
        lease_ttl_s: float,
        tokens: TokenTable | None,
        max_watchers: int,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        view_chunk_bytes: int = limits.VIEW_CHUNK_BYTES,
        max_instances_per_token: int = DEFAULT_MAX_INSTANCES_PER_TOKEN,
    ) -> None:
        self._store = store
        self._max_per_token = max_instances_per_token
        #: Instance ids each principal registered through this CMS (pruned to the live view).
        self._held: dict[str, set[str]] = {}
        self._pump = pump
        self._lease_ttl_s = lease_ttl_s
        self._tokens = tokens
        self._max_watchers = max_watchers
        self._clock = clock
        self._wall_clock = wall_clock
        self._chunk_bytes = view_chunk_bytes
        self._watchers: set[LatestSlot[object]] = set()
        self.skew = SkewStats()
        self._batch_slots = asyncio.Semaphore(BATCH_STORE_CONCURRENCY)

    @property
    def watchers(self) -> int:
        return len(self._watchers)

    def close_watchers(self) -> None:
        """End every watch stream normally (used on shutdown)."""
        for slot in self._watchers:
            slot.put(_CLOSED)

    def _grant(self, context: grpc.aio.ServicerContext[Any, Any]) -> Grant | None:
        """The caller's grant (None when this CMS has no tokens)."""
        if self._tokens is None:
            return None
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                grant = self._tokens.grant(value)
                if grant is not None:
                    return grant
                raise UnauthenticatedError(
                    "the authorization token is wrong; use a token of this CMS's --auth-token-file"
                )
        raise UnauthenticatedError("this CMS needs 'authorization: Bearer <token>' metadata on every call")

    def _authorize(self, context: grpc.aio.ServicerContext[Any, Any], instance_id: str | None = None) -> str:
        """The caller's principal ("" when this CMS has no tokens); with ``instance_id``, a write to it.

        A ``read`` token may not write at all; a ``write:ID,...`` token only the ids it lists.
        """
        grant = self._grant(context)
        if grant is None:
            return ""
        if instance_id is not None and not grant.may_write(instance_id):
            if not grant.can_write:
                raise PermissionDeniedError(
                    f"the token of {grant.principal!r} is read-only: it may read the view, not write"
                )
            raise PermissionDeniedError(
                f"the token of {grant.principal!r} may write only instance ids {grant.text()[6:]}, "
                f"not {instance_id!r}"
            )
        return grant.principal

    async def _check_quota(self, principal: str, instance_id: str) -> None:
        """At most ``max_instances_per_token`` live ids per principal (ids of this CMS's registrations)."""
        held = self._held.setdefault(principal, set())
        if instance_id in held or len(held) < self._max_per_token:
            return
        live = {record.metadata.instance_id for record in (await self._store.read_view()).instances}
        held &= live
        if len(held) >= self._max_per_token:
            raise QuotaExceededError(
                f"the token of {principal!r} already holds {len(held)} live instance ids, the most one "
                f"token may (--max-instances-per-token {self._max_per_token}); deregister one or use "
                "another token"
            )

    @staticmethod
    async def _abort(context: grpc.aio.ServicerContext[Any, Any], exc: CmsError) -> NoReturn:
        await context.abort(grpc_code(exc), str(exc))

    async def RegisterInstance(
        self,
        request: cms_pb2.RegisterInstanceRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> cms_pb2.RegisterInstanceResponse:
        try:
            iid = request.metadata.instance_id
            owner = self._authorize(context, iid)
            if self._tokens is not None:
                await self._check_quota(owner, iid)
            epoch = await self._store.register(request.metadata, self._lease_ttl_s, owner)
            if self._tokens is not None:
                self._held.setdefault(owner, set()).add(iid)
        except CmsError as exc:
            await self._abort(context, exc)
        return cms_pb2.RegisterInstanceResponse(lease_ttl_ms=round(self._lease_ttl_s * 1000), epoch=epoch)

    async def ReportStatus(
        self,
        request: cms_pb2.ReportStatusRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> cms_pb2.ReportStatusResponse:
        try:
            owner = self._authorize(context, request.status.instance_id)
            try:
                self.skew.observe(check_clock_skew(request.status, int(self._wall_clock() * 1000)))
            except ClockSkewError:
                self.skew.refused += 1
                self.skew.observe(request.status.timestamp_ms - int(self._wall_clock() * 1000))
                raise
            accepted = await self._store.report(request.status, self._lease_ttl_s, owner)
        except CmsError as exc:
            await self._abort(context, exc)
        return cms_pb2.ReportStatusResponse(accepted=accepted)

    async def ReportStatuses(
        self,
        request: cms_pb2.ReportStatusesRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> cms_pb2.ReportStatusesResponse:
        """Many ReportStatus calls in one: the per-call cost (HTTP/2 frames, the servicer's task,
        the token check) is paid once per batch rather than once per status.

        All or nothing up to the store: the size bound, the token's scope over every instance id,
        each status's fields and its clock skew are checked before any status is stored, so a batch
        with one foreign id or one malformed status stores none of it. The store's own outcome
        (NOT_FOUND after a lapsed lease, an older epoch, a heartbeat) is per status, as separate
        ReportStatus calls would have had it.
        """
        try:
            statuses = request.statuses
            if len(statuses) > limits.MAX_REPORT_BATCH:
                raise InvalidArgumentError(
                    f"statuses: {len(statuses)} statuses in one ReportStatuses call; the limit is "
                    f"{limits.MAX_REPORT_BATCH}"
                )
            owner = self._authorize(context)
            for status in statuses:
                self._authorize(context, status.instance_id)
            now_ms = int(self._wall_clock() * 1000)
            for i, status in enumerate(statuses):
                try:
                    validate_status(status)
                    self.skew.observe(check_clock_skew(status, now_ms))
                except ClockSkewError as exc:
                    self.skew.refused += 1
                    self.skew.observe(status.timestamp_ms - now_ms)
                    raise ClockSkewError(f"statuses[{i}]: {exc}") from None
                except InvalidArgumentError as exc:
                    raise InvalidArgumentError(f"statuses[{i}]: {exc}") from None
            # Concurrently (at most BATCH_STORE_CONCURRENCY in flight), as separate ReportStatus
            # calls would run: a Redis store overlaps the round trips (one after another a batch
            # of 128 waits for 128 of them); a memory store runs them one after another anyway. Two statuses of one instance in a batch resolve
            # by update_id, as two concurrent calls would.
            results = await asyncio.gather(*(self._report_one(status, owner) for status in statuses))
            for result in results:
                if isinstance(result, CmsError):
                    raise result  # the store is down: the whole call may be retried
            outcomes = [result for result in results if not isinstance(result, CmsError)]
        except CmsError as exc:
            await self._abort(context, exc)
        return cms_pb2.ReportStatusesResponse(outcomes=outcomes)

    async def _report_one(
        self, status: cms_pb2.InstanceStatus, owner: str
    ) -> cms_pb2.ReportStatusOutcome | CmsError:
        """One status of a batch: its outcome, or the store's UNAVAILABLE error (which ends the call)."""
        try:
            async with self._batch_slots:
                accepted = await self._store.report(status, self._lease_ttl_s, owner)
        except CmsError as exc:
            code = grpc_code(exc)
            if code == grpc.StatusCode.UNAVAILABLE:
                return exc
            return cms_pb2.ReportStatusOutcome(code=code.value[0], message=str(exc))
        return cms_pb2.ReportStatusOutcome(accepted=accepted)

    async def DeregisterInstance(
        self,
        request: cms_pb2.DeregisterInstanceRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> cms_pb2.DeregisterInstanceResponse:
        try:
            owner = self._authorize(context, request.instance_id)
            validate_instance_id(request.instance_id)
            removed = await self._store.deregister(request.instance_id, owner)
            self._held.get(owner, set()).discard(request.instance_id)
        except CmsError as exc:
            await self._abort(context, exc)
        return cms_pb2.DeregisterInstanceResponse(removed=removed)

    def _to_views(self, snapshot: ClusterSnapshot, model: str) -> list[cms_pb2.ClusterView]:
        view = snapshot_to_view(snapshot, now_s=self._clock(), generated_at_ms=epoch_ms(), model=model)
        return chunk_view(view, self._chunk_bytes)

    def _check_read(
        self, request: cms_pb2.GetClusterViewRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        self._authorize(context)
        try:
            limits.check_text(request.model, "model", limits.MAX_NAME_BYTES)
        except limits.FieldLimitError as exc:
            raise InvalidArgumentError(str(exc)) from None

    async def GetClusterView(
        self,
        request: cms_pb2.GetClusterViewRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> cms_pb2.ClusterView:
        try:
            self._check_read(request, context)
            snapshot = await self._store.read_view()
            views = self._to_views(snapshot, request.model)
            if request.chunk_index >= len(views):
                raise InvalidArgumentError(
                    f"chunk_index: {request.chunk_index}; the view has {len(views)} chunk(s) now"
                )
        except CmsError as exc:
            await self._abort(context, exc)
        return views[request.chunk_index]

    async def WatchClusterView(
        self,
        request: cms_pb2.GetClusterViewRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[cms_pb2.ClusterView]:
        try:
            self._check_read(request, context)
        except CmsError as exc:
            await self._abort(context, exc)
        if len(self._watchers) >= self._max_watchers:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this CMS already serves {self._max_watchers} watchers; use GetClusterView or another replica",
            )
        slot: LatestSlot[object] = LatestSlot()
        self._watchers.add(slot)
        self._pump.add_listener(slot.put)
        try:
            # A new watcher gets the current view at once rather than at the next change.
            if self._pump.error is not None:
                slot.put(self._pump.error)
            elif self._pump.latest is not None:
                slot.put(self._pump.latest)
            while True:
                item = await slot.get()
                if item is _CLOSED:
                    return
                if isinstance(item, CmsError):
                    await self._abort(context, item)
                assert isinstance(item, ClusterSnapshot)
                for view in self._to_views(item, request.model):
                    yield view
        finally:
            self._pump.remove_listener(slot.put)
            self._watchers.discard(slot)


def _split_listen(listen: str) -> tuple[str, int]:
    host, sep, port_text = listen.rpartition(":")
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(f"listen address {listen!r} is not HOST:PORT (PORT 0 picks a free port)")
    return host, int(port_text)


class CmsServer:
    """A running CMS. ``address`` is ``host:port`` with the port actually bound.

    ``stop()`` ends watch streams, then stops the server within ``grace``
    seconds. The store is not closed: whoever made it owns it.
    """

    def __init__(
        self,
        server: grpc.aio.Server,
        service: ClusterMetadataService,
        pump: ViewPump,
        health_servicer: Any,
        host: str,
        port: int,
    ) -> None:
        self._server = server
        self.service = service
        self.pump = pump
        self._health = health_servicer
        self.host = host
        self.port = port
        self.address = f"{host}:{port}"
        self._stopped = False
        self._serving = True
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        """``grpc://host:port``, the form ``open_reader`` takes."""
        return f"grpc://{self.address}"

    def _on_pump(self, update: PumpUpdate) -> None:
        # Health mirrors whether the store answers; flip only on a change.
        serving = isinstance(update, ClusterSnapshot)
        if serving == self._serving:
            return
        self._serving = serving
        task = asyncio.get_running_loop().create_task(
            self._health.set(SERVICE_NAME, _SERVING if serving else _NOT_SERVING)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self, grace: float | None = 1.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        await self._health.enter_graceful_shutdown()
        await self.pump.stop()
        self.service.close_watchers()
        await self._server.stop(grace)
        if self._tasks:
            await asyncio.wait(self._tasks)

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()


async def start_cms_server(
    store: CmsStore,
    listen: str = "127.0.0.1:0",
    *,
    auth_token: str | None = None,
    tokens: TokenTable | None = None,
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
    watch_min_interval_s: float = 0.02,
    watch_refresh_s: float = 0.5,
    max_watchers: int = 1024,
    tls: ServerTls | None = None,
    view_chunk_bytes: int = limits.VIEW_CHUNK_BYTES,
    max_instances_per_token: int = DEFAULT_MAX_INSTANCES_PER_TOKEN,
) -> CmsServer:
    """Serve ``store`` on ``listen`` (``HOST:PORT``; port 0 picks one) and return at once.

    - ``lease_ttl_s``: an instance that neither reports nor heartbeats for
      this long disappears; returned to agents as ``lease_ttl_ms``.
    - ``watch_min_interval_s``: watch pushes are coalesced to at most one per
      this interval; ``watch_refresh_s``: a push at least this often even
      without change (must be <= 1 s).
    - ``max_watchers``: concurrent ``WatchClusterView`` streams; more get
      ``RESOURCE_EXHAUSTED``.
    - ``auth_token`` (one token, principal ``cluster``) or ``tokens`` (a
      table, e.g. one per worker): required on every RPC when given.
    - ``tls``: serve TLS only; ``view_chunk_bytes``: the size views are cut at.
    - ``max_instances_per_token``: live instance ids one token may have
      registered through this CMS at once (token scopes: :mod:`cms.auth`).

    Raises ``OSError`` when the address cannot be bound.
    """
    check_lease_ttl(lease_ttl_s)
    if not 0 < watch_refresh_s <= 1.0:
        raise ValueError(f"watch_refresh_s must be in (0, 1] seconds, got {watch_refresh_s}")
    if max_watchers < 1:
        raise ValueError(f"max_watchers must be >= 1, got {max_watchers}")
    if max_instances_per_token < 1:
        raise ValueError(f"max_instances_per_token must be >= 1, got {max_instances_per_token}")
    if auth_token is not None and not auth_token.strip():
        raise ValueError("auth_token is empty; pass None to disable authentication")
    if auth_token is not None and tokens is not None:
        raise ValueError("give auth_token or tokens, not both")
    if auth_token is not None:
        tokens = TokenTable.single(auth_token)
    if not 1024 <= view_chunk_bytes <= limits.VIEW_MAX_MESSAGE_BYTES - limits.max_instance_state_bytes():
        raise ValueError(
            f"view_chunk_bytes must leave room for one instance below the message limit, got {view_chunk_bytes}"
        )
    host, _ = _split_listen(listen)
    pump = ViewPump(store, min_interval_s=watch_min_interval_s, refresh_s=watch_refresh_s)
    service = ClusterMetadataService(
        store,
        pump,
        lease_ttl_s=lease_ttl_s,
        tokens=tokens,
        max_watchers=max_watchers,
        view_chunk_bytes=view_chunk_bytes,
        max_instances_per_token=max_instances_per_token,
    )
    server, port = await bind_server(
        listen,
        max_receive_bytes=limits.CMS_MAX_RECEIVE_BYTES,
        max_send_bytes=limits.VIEW_MAX_MESSAGE_BYTES,
        tls=tls,
    )
    cms_pb2_grpc.add_ClusterMetadataServicer_to_server(service, server)
    health_servicer = add_health_and_reflection(server, SERVICE_NAME)
    await server.start()
    await health_servicer.set(SERVICE_NAME, _SERVING)
    cms = CmsServer(server, service, pump, health_servicer, host, port)
    pump.add_listener(cms._on_pump)
    await pump.start()
    logger.info(
        "CMS serving on %s (lease %.1f s, auth %s, tls %s)",
        cms.address,
        lease_ttl_s,
        f"on, {len(tokens.entries)} token(s)" if tokens else "off",
        "on" if tls else "off",
    )
    return cms
