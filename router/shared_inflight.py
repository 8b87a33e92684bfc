"""The in-flight account shared by the router processes of ``--processes N``.

N router processes accept on one port (``SO_REUSEPORT``: the kernel spreads
connections over them). Each decides with its own scheduler, so each must see
the load the others dispatched but no instance reports yet, or N processes
would each admit up to the whole fleet's headroom (N-fold over-admission).

Why shared memory and not the CMS status path: the in-flight account exists
to cover the gap between a dispatch and the instance's next status report
(tens of ms to a heartbeat); publishing the deltas through the CMS would add
a CMS round trip and the view pump's coalescing to that same gap, and put a
write per dispatch on the CMS. A segment on this host costs a copy of a few
rows per publish and no syscall, and the processes of ``--processes`` are on
one host by construction.

Layout: one *slot* per process, each written by its owner only and read by
all: a sequence number (odd while the owner writes: a seqlock), the number of
rows, then up to :data:`MAX_ROWS` rows of (instance id, the eight in-flight
sums of :meth:`router.core.inflight.InflightAccount.own_row`). A process
publishes its own sums when they changed and reads its peers' every
``interval_s`` (:class:`InflightSharing`), and hands their sum per instance
to :meth:`~router.core.inflight.InflightAccount.set_peers`.

Staleness: a dispatch by one process is visible to the others at most
``interval_s`` plus one event-loop turn later (default 5 ms). In that window
the processes can over-admit by at most what the others dispatch in it; a
process that dies leaves its last rows until the parent clears its slot. A
reader that finds a slot mid-write (sequence odd or moved) keeps that peer's
previous rows for one more round.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from multiprocessing import resource_tracker, shared_memory

import numpy as np

from cms import limits
from router.core.columns import INFLIGHT_ROWS
from router.core.inflight import InflightAccount

logger = logging.getLogger(__name__)

#: Most router processes one segment serves (``--processes``).
MAX_PROCESSES = 32
#: Instances one process can publish load for (more are left out, with a warning).
MAX_ROWS = 1024
DEFAULT_INTERVAL_S = 0.005

_ROW = np.dtype([("id", f"S{limits.MAX_ID_BYTES}"), ("sums", "<i8", (INFLIGHT_ROWS,))])
_HEADER = np.dtype([("seq", "<u8"), ("count", "<u8")])
_SLOT_BYTES = _HEADER.itemsize + MAX_ROWS * _ROW.itemsize


def segment_bytes(processes: int) -> int:
    return processes * _SLOT_BYTES


class SharedInflight:
    """The segment of ``processes`` slots; this process writes slot ``slot``."""

    def __init__(self, name: str | None, processes: int, slot: int, *, create: bool = False) -> None:
        if not 1 <= processes <= MAX_PROCESSES:
            raise ValueError(f"--processes {processes}: must be within [1, {MAX_PROCESSES}]")
        if not 0 <= slot < processes:
            raise ValueError(f"slot {slot} is outside [0, {processes})")
        self.processes = processes
        self.slot = slot
        self._shm = shared_memory.SharedMemory(name=name, create=create, size=segment_bytes(processes))
        self._owner = create
        if not create:
            # Python (< 3.13) registers an attached segment with this process's resource tracker,
            # which unlinks it when this process dies: one killed router would take the segment
            # from every other one (and its restart would find none). Only the creator owns it.
            resource_tracker.unregister(self._shm._name, "shared_memory")  # type: ignore[attr-defined]
        if self._shm.size < segment_bytes(processes):
            self._shm.close()
            raise ValueError(f"shared in-flight segment {name!r} is too small for {processes} processes")
        buf = self._shm.buf
        self._headers = [
            np.ndarray((1,), _HEADER, buffer=buf, offset=k * _SLOT_BYTES) for k in range(processes)
        ]
        self._rows = [
            np.ndarray((MAX_ROWS,), _ROW, buffer=buf, offset=k * _SLOT_BYTES + _HEADER.itemsize)
            for k in range(processes)
        ]
        if create:
            np.ndarray((segment_bytes(processes),), np.uint8, buffer=buf)[:] = 0
        # slot -> (sequence number read, its rows): a slot whose sequence did not move is not re-read.
        self._last_peer_rows: dict[int, tuple[int, dict[str, tuple[int, ...]]]] = {}
        self._warned = False

    @property
    def name(self) -> str:
        return self._shm.name

    def publish(self, rows: dict[str, tuple[int, ...]]) -> None:
        """Write this process's rows (instance id -> sums) into its slot."""
        items = list(rows.items())
        if len(items) > MAX_ROWS:
            if not self._warned:
                logger.warning("in-flight load on %d instances; sharing the first %d", len(items), MAX_ROWS)
                self._warned = True
            items = items[:MAX_ROWS]
        header, table = self._headers[self.slot], self._rows[self.slot]
        header["seq"] += 1  # odd: writing
        for k, (instance_id, sums) in enumerate(items):
            table[k] = (instance_id.encode(), sums)
        header["count"] = len(items)
        header["seq"] += 1  # even: consistent

    def clear(self, slot: int) -> None:
        """Empty ``slot`` (its process is gone)."""
        header = self._headers[slot]
        header["seq"] += 1
        header["count"] = 0
        header["seq"] += 1

    def _read_slot(self, slot: int) -> dict[str, tuple[int, ...]]:
        """The rows of ``slot``; its previous rows while it is mid-write (or unchanged)."""
        header, table = self._headers[slot], self._rows[slot]
        last = self._last_peer_rows.get(slot, (-1, {}))
        seq = int(header["seq"][0])
        if seq % 2 or seq == last[0]:
            return last[1]
        count = min(int(header["count"][0]), MAX_ROWS)
        copy = table[:count].copy()
        if int(header["seq"][0]) != seq:
            return last[1]
        rows = {bytes(r["id"]).decode(): tuple(int(v) for v in r["sums"]) for r in copy}
        self._last_peer_rows[slot] = (seq, rows)
        return rows

    def peers(self) -> dict[str, tuple[int, ...]]:
        """The sum over the other processes' slots, per instance."""
        total: dict[str, list[int]] = {}
        for slot in range(self.processes):
            if slot == self.slot:
                continue
            for instance_id, sums in self._read_slot(slot).items():
                acc = total.setdefault(instance_id, [0] * INFLIGHT_ROWS)
                for i, v in enumerate(sums):
                    acc[i] += v
        return {k: tuple(v) for k, v in total.items()}

    def close(self) -> None:
        # The arrays hold views of the buffer: drop them before closing the mapping.
        self._headers.clear()
        self._rows.clear()
        self._shm.close()
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()


class InflightSharing:
    """Keeps ``account`` and the segment in step: publishes its own sums, takes the peers'."""

    def __init__(
        self, shared: SharedInflight, account: InflightAccount, interval_s: float = DEFAULT_INTERVAL_S
    ) -> None:
        self._shared = shared
        self._account = account
        self._interval_s = interval_s
        self._published_version = -1
        self._task: asyncio.Task[None] | None = None

    def sync(self) -> None:
        """One round: publish when this process's own sums changed, then take the peers' sums."""
        account = self._account
        # set_peers below bumps the version too: compare against the version it left.
        if account.version != self._published_version:
            self._shared.publish({i: account.own_row(i) for i in account.own_instances()})
        account.set_peers(self._shared.peers())
        self._published_version = account.version

    async def _run(self) -> None:
        while True:
            try:
                self.sync()
            except Exception:  # a torn or foreign segment must not stop serving
                logger.exception("could not share the in-flight account")
            await asyncio.sleep(self._interval_s)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="inflight-sharing")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._shared.publish({})
        self._shared.close()
