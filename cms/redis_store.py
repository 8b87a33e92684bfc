"""Redis store: one view shared by several CMS replicas and routers.

Layout, every key under ``slorouter:{<cluster>}:`` (the braces make the
cluster name a hash tag, so a cluster's keys share one Redis Cluster slot)::

    instances        SET   ids ever registered and not yet cleaned up (discovery index)
    meta:<id>        HASH  pb = InstanceMetadata bytes, kv_cap = kv_capacity_tokens,
                           ep = endpoint, owner = principal that registered it,
                           epoch = registration epoch
    status:<id>      HASH  pb = InstanceStatus bytes of the last accepted status,
                           uid = its update_id, ep = the epoch it was accepted in,
                           ts / sched = timestamp_ms / schedulable
                           as refreshed by heartbeats, recv_us = Redis TIME when last received
    version          INT   bumped on every change of the view
    epochs           INT   the registration epoch counter
    changes          pub/sub channel; the new version is published on every bump

Liveness is the key TTL: every register and report sets ``PEXPIRE`` on both
``meta:<id>`` and ``status:<id>`` to the lease. An instance whose ``meta`` key
expired is gone; the next read drops it from ``instances``, deletes its
status and bumps the version, so watchers learn about it.

Every write and the read are single Lua scripts, so each is atomic and costs
one round trip. Status ages use Redis's own clock (``TIME``) for both the
receive stamp and "now", so CMS replicas and readers on other hosts agree on
ages without trusting any worker or host clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import struct
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from slorouter.v1 import cms_pb2

from cms.errors import (
    AlreadyExistsError,
    InstanceNotFoundError,
    InvalidArgumentError,
    PermissionDeniedError,
    StoreUnavailableError,
)
from cms.tasks import raise_if_cancelling
from cms.validation import (
    check_clock_skew,
    check_lease_ttl,
    endpoint_taken_message,
    kv_over_capacity_message,
    not_owner_message,
    status_age_s,
    validate_instance_id,
    validate_metadata,
    validate_status,
)
from fleet.snapshot import ClusterSnapshot, InstanceRecord

logger = logging.getLogger(__name__)

_CLUSTER_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")

# Decimal strings of unsigned integers without leading zeros compare by
# length, then lexically; Lua numbers are doubles and would round a uint64.
_LUA_GT = """
local function gt(a, b)
  if #a ~= #b then return #a > #b end
  return a > b
end
local function bump(version_key, channel)
  local v = redis.call('INCR', version_key)
  redis.call('PUBLISH', channel, v)
end
local function now_us()
  local t = redis.call('TIME')
  return t[1] .. string.format('%06d', tonumber(t[2]))
end
"""

# KEYS: instances, meta, status, version, epochs. ARGV: id, pb, kv_cap, ttl_ms, channel,
# endpoint, owner. Returns {code, detail}: 1 registered (detail = epoch), -1 live at
# another endpoint (detail = it), -2 owned by another principal.
_REGISTER = (
    _LUA_GT
    + """
local cur = redis.call('HMGET', KEYS[2], 'ep', 'owner', 'pb')
if cur[3] then
  if cur[1] and cur[1] ~= ARGV[6] then return {-1, cur[1]} end
  if (cur[2] or '') ~= ARGV[7] then return {-2, ''} end
end
local changed = redis.call('SADD', KEYS[1], ARGV[1]) == 1
if not cur[3] then
  -- a new registration (or one whose lease lapsed): nothing of the old one survives
  redis.call('DEL', KEYS[3])
  changed = true
end
local epoch = redis.call('INCR', KEYS[5])
if cur[3] ~= ARGV[2] then
  redis.call('HSET', KEYS[2], 'pb', ARGV[2], 'kv_cap', ARGV[3], 'ep', ARGV[6], 'owner', ARGV[7])
  changed = true
end
redis.call('HSET', KEYS[2], 'epoch', epoch)
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('PEXPIRE', KEYS[3], ARGV[4])
if changed then bump(KEYS[4], ARGV[5]) end
return {1, tostring(epoch)}
"""
)

# KEYS: meta, status, version. ARGV: pb, update_id, timestamp_ms, schedulable,
# num_used_kv_tokens, ttl_ms, channel, owner, epoch (0 = current). Returns {code, detail}:
# 1 accepted, 0 heartbeat (or a status of an older epoch, dropped), -1 not registered,
# -2 over KV capacity (detail = capacity), -3 owned by another principal, -4 unknown epoch.
_REPORT = (
    _LUA_GT
    + """
local meta = redis.call('HMGET', KEYS[1], 'kv_cap', 'owner', 'epoch', 'pb')
if not meta[4] then return {-1, ''} end
if (meta[2] or '') ~= ARGV[8] then return {-3, ''} end
local epoch = meta[3] or '0'
if ARGV[9] ~= '0' and ARGV[9] ~= epoch then
  if gt(epoch, ARGV[9]) then return {0, ''} end
  return {-4, ''}
end
local cap = meta[1]
if cap and cap ~= '0' and gt(ARGV[5], cap) then return {-2, cap} end
local cur = redis.call('HMGET', KEYS[2], 'uid', 'ts', 'sched', 'ep')
local result = 0
local changed = false
if not cur[1] or cur[4] ~= epoch or gt(ARGV[2], cur[1]) then
  redis.call('HSET', KEYS[2], 'pb', ARGV[1], 'uid', ARGV[2], 'ts', ARGV[3], 'sched', ARGV[4],
             'recv_us', now_us(), 'ep', epoch)
  result = 1
  changed = true
elseif tonumber(ARGV[3]) >= tonumber(cur[2]) then
  redis.call('HSET', KEYS[2], 'ts', ARGV[3], 'sched', ARGV[4], 'recv_us', now_us())
  changed = cur[3] ~= ARGV[4]
end
redis.call('PEXPIRE', KEYS[1], ARGV[6])
redis.call('PEXPIRE', KEYS[2], ARGV[6])
if changed then bump(KEYS[3], ARGV[7]) end
return {result, ''}
"""
)

# KEYS: instances, meta, status, version. ARGV: id, channel, owner. Returns 1 removed,
# 0 not registered, -3 owned by another principal.
_DEREGISTER = (
    _LUA_GT
    + """
local existed = redis.call('EXISTS', KEYS[2])
if existed == 1 and (redis.call('HGET', KEYS[2], 'owner') or '') ~= ARGV[3] then return -3 end
redis.call('DEL', KEYS[2], KEYS[3])
redis.call('SREM', KEYS[1], ARGV[1])
if existed == 1 then bump(KEYS[4], ARGV[2]) end
return existed
"""
)

# KEYS: instances, version. ARGV: key prefix, channel.
# Returns {now_us, version, blob}; the blob packs, per live instance, meta pb, status pb,
# ts, sched, recv_us, each as a 4-byte big-endian length (0xFFFFFFFF = absent) and the
# bytes. One bulk string instead of five per instance keeps the client's parsing cheap.
_READ = (
    _LUA_GT
    + """
local parts = {}
local absent = struct.pack('>I4', 4294967295)
local function put(value)
  if value then
    parts[#parts + 1] = struct.pack('>I4', #value)
    parts[#parts + 1] = value
  else
    parts[#parts + 1] = absent
  end
end
local gone = 0
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local meta = redis.call('HGET', ARGV[1] .. 'meta:' .. id, 'pb')
  if meta then
    local st = redis.call('HMGET', ARGV[1] .. 'status:' .. id, 'pb', 'ts', 'sched', 'recv_us')
    put(meta)
    put(st[1])
    put(st[2])
    put(st[3])
    put(st[4])
  else
    redis.call('SREM', KEYS[1], id)
    redis.call('DEL', ARGV[1] .. 'status:' .. id)
    gone = gone + 1
  end
end
if gone > 0 then bump(KEYS[2], ARGV[2]) end
return {now_us(), redis.call('GET', KEYS[2]) or '0', table.concat(parts)}
"""
)

_ABSENT = 0xFFFFFFFF
_LENGTH = struct.Struct(">I")


def _unpack_fields(blob: bytes) -> list[bytes | None]:
    fields: list[bytes | None] = []
    offset, end = 0, len(blob)
    unpack = _LENGTH.unpack_from
    while offset < end:
        (length,) = unpack(blob, offset)
        offset += 4
        if length == _ABSENT:
            fields.append(None)
        else:
            fields.append(blob[offset : offset + length])
            offset += length
    return fields


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"***@{netloc}"))


class RedisStore:
    """A :class:`cms.store.CmsStore` in Redis (``redis.asyncio``).

    ``url`` is ``redis://host:port/db`` (``rediss://`` and ``unix://`` work
    too). ``op_timeout_s`` bounds every Redis command; a failure or timeout
    raises :class:`~cms.errors.StoreUnavailableError`. The client connects
    lazily, so constructing a store never fails because Redis is down.
    """

    def __init__(self, url: str, *, cluster_name: str = "default", op_timeout_s: float = 1.0) -> None:
        if not _CLUSTER_NAME.fullmatch(cluster_name):
            raise ValueError(f"cluster_name {cluster_name!r} must be 1-64 characters of A-Z a-z 0-9 . _ -")
        if not op_timeout_s > 0:
            raise ValueError(f"op_timeout_s must be > 0, got {op_timeout_s}")
        self.url = _redact(url)
        self.cluster_name = cluster_name
        self._prefix = f"slorouter:{{{cluster_name}}}:"
        self._index_key = self._prefix + "instances"
        self._version_key = self._prefix + "version"
        self._epochs_key = self._prefix + "epochs"
        self._channel = self._prefix + "changes"
        # One quick retry lets a pooled connection that died with a Redis
        # restart reconnect; anything longer is the caller's backoff. A
        # timeout is not retried: a frozen Redis (SIGSTOP, a stuck host)
        # answers a second attempt no better, and the caller must learn that
        # the store is unavailable after one ``op_timeout_s``, not two.
        self._redis: aioredis.Redis = aioredis.Redis.from_url(
            url,
            socket_timeout=op_timeout_s,
            socket_connect_timeout=op_timeout_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        )
        self._register = self._redis.register_script(_REGISTER)
        self._report = self._redis.register_script(_REPORT)
        self._deregister = self._redis.register_script(_DEREGISTER)
        self._read = self._redis.register_script(_READ)
        self._pubsub: PubSub | None = None
        self._known_version = -1  # the newest version seen by a read, a GET or an announcement
        self._closed = False

    def key(self, kind: str, instance_id: str) -> str:
        """The Redis key of ``kind`` (``meta`` or ``status``) for an instance."""
        return f"{self._prefix}{kind}:{instance_id}"

    async def _call(self, what: str, script: Any, keys: list[str], args: list[Any]) -> Any:
        if self._closed:
            raise StoreUnavailableError("the Redis store is closed")
        try:
            return await script(keys=keys, args=args)
        except (TimeoutError, RedisError, OSError) as exc:
            raise_if_cancelling()
            raise StoreUnavailableError(f"Redis at {self.url} failed during {what}: {exc}") from exc

    async def register(self, metadata: cms_pb2.InstanceMetadata, lease_ttl_s: float, owner: str = "") -> int:
        validate_metadata(metadata)
        check_lease_ttl(lease_ttl_s)
        iid = metadata.instance_id
        code, detail = await self._call(
            "register",
            self._register,
            [
                self._index_key,
                self.key("meta", iid),
                self.key("status", iid),
                self._version_key,
                self._epochs_key,
            ],
            [
                iid,
                metadata.SerializeToString(deterministic=True),
                str(metadata.kv_capacity_tokens),
                _ttl_ms(lease_ttl_s),
                self._channel,
                metadata.endpoint,
                owner,
            ],
        )
        if code == -1:
            raise AlreadyExistsError(endpoint_taken_message(iid, _text(detail)))
        if code == -2:
            raise PermissionDeniedError(not_owner_message(iid))
        return int(detail)

    async def report(self, status: cms_pb2.InstanceStatus, lease_ttl_s: float, owner: str = "") -> bool:
        validate_status(status)
        check_lease_ttl(lease_ttl_s)
        check_clock_skew(status, int(time.time() * 1000))
        iid = status.instance_id
        code, detail = await self._call(
            "report",
            self._report,
            [self.key("meta", iid), self.key("status", iid), self._version_key],
            [
                status.SerializeToString(deterministic=True),
                str(status.update_id),
                str(status.timestamp_ms),
                "1" if status.schedulable else "0",
                str(status.num_used_kv_tokens),
                _ttl_ms(lease_ttl_s),
                self._channel,
                owner,
                str(status.epoch),
            ],
        )
        if code in (-1, -4):
            raise InstanceNotFoundError(
                f"instance {iid!r} is not registered (or its lease lapsed, or epoch {status.epoch} is not "
                "its registration); register it again"
            )
        if code == -2:
            raise InvalidArgumentError(kv_over_capacity_message(status.num_used_kv_tokens, int(detail)))
        if code == -3:
            raise PermissionDeniedError(not_owner_message(iid))
        return bool(code == 1)

    async def deregister(self, instance_id: str, owner: str = "") -> bool:
        validate_instance_id(instance_id)
        existed = await self._call(
            "deregister",
            self._deregister,
            [
                self._index_key,
                self.key("meta", instance_id),
                self.key("status", instance_id),
                self._version_key,
            ],
            [instance_id, self._channel, owner],
        )
        if existed == -3:
            raise PermissionDeniedError(not_owner_message(instance_id))
        return bool(existed == 1)

    async def read_view(self) -> ClusterSnapshot:
        raw = await self._call(
            "read", self._read, [self._index_key, self._version_key], [self._prefix, self._channel]
        )
        taken_at = time.monotonic()
        now_us = int(raw[0])
        fields = _unpack_fields(raw[2])
        records = []
        for i in range(0, len(fields), 5):
            meta_pb, status_pb, ts, sched, recv_us = fields[i : i + 5]
            assert meta_pb is not None
            metadata = cms_pb2.InstanceMetadata.FromString(meta_pb)
            status: cms_pb2.InstanceStatus | None = None
            age_s = 0.0
            if status_pb is not None and ts is not None and recv_us is not None:
                status = cms_pb2.InstanceStatus.FromString(status_pb)
                status.timestamp_ms = int(ts)
                status.schedulable = sched == b"1"
                age_s = status_age_s((now_us - int(recv_us)) / 1e6, now_us / 1000 - status.timestamp_ms)
            records.append(InstanceRecord(metadata=metadata, status=status, status_age_s=age_s))
        records.sort(key=lambda r: r.instance_id)
        self._known_version = int(raw[1])
        return ClusterSnapshot(instances=tuple(records), taken_at_s=taken_at, version=self._known_version)

    async def _subscription(self) -> PubSub:
        if self._pubsub is None:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self._channel)
            except BaseException:
                await pubsub.aclose()  # type: ignore[no-untyped-call]
                raise
            self._pubsub = pubsub
        return self._pubsub

    async def _drop_subscription(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(RedisError, OSError):
                await pubsub.aclose()  # type: ignore[no-untyped-call]

    async def wait_changed(self, after_version: int | None, timeout_s: float) -> None:
        if after_version is None or self._closed:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            fresh = self._pubsub is None
            pubsub = await self._subscription()
            if fresh or after_version != self._known_version:
                # The subscription may be younger than the caller's version:
                # compare with the counter, so a change in between is not
                # missed. Otherwise every later change is queued on it already.
                self._known_version = int(await self._redis.get(self._version_key) or 0)
                if self._known_version != after_version:
                    return
            while (remaining := deadline - loop.time()) > 0:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=remaining)
                raise_if_cancelling()
                newest = _published_version(message)
                for _ in range(1000):  # drain what is queued: one wake-up per burst
                    if message is None:
                        break
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0)
                    newest = max(newest, _published_version(message))
                # Announcements of changes the caller already read are echoes.
                if newest > after_version:
                    self._known_version = max(self._known_version, newest)
                    return
        except (TimeoutError, RedisError, OSError) as exc:
            raise_if_cancelling()
            logger.debug("watching %s for changes failed: %s", self.url, exc)
            await self._drop_subscription()
            await asyncio.sleep(max(0.0, deadline - loop.time()))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._drop_subscription()
        await self._redis.aclose()


def _published_version(message: dict[str, Any] | None) -> int:
    """The version a change announcement carries (-1 for none; huge if unreadable)."""
    if message is None:
        return -1
    try:
        return int(message["data"])
    except (KeyError, TypeError, ValueError):
        return 1 << 62


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _ttl_ms(lease_ttl_s: float) -> int:
    return max(1, round(lease_ttl_s * 1000))
