"""What the router knows of each instance's prefix cache: an index of block hashes per instance.

An engine with prefix caching keeps the KV of a prompt's full blocks under a
chained hash (:mod:`fleet.prefix`), so a new prompt needs computing only past
its longest run of leading blocks the instance still holds. The router's
prediction charges only those tokens (``cached_prompt_tokens`` and
``predicted_ttft`` in :mod:`router.core.metrics`). The index answers one
question per decision — for this prompt's block hashes, how many leading
blocks does each instance hold — from one of two sources behind one
interface, :class:`PrefixSource`:

- :class:`ExactPrefixIndex`: fed the engines' own cache events (blocks
  stored, blocks removed, all cleared — the kinds of vLLM's
  ``SubscribeKvEvents`` stream; the sim engine emits the same kinds,
  :meth:`engine.model.SimCore.drain_kv_events`), so it holds what each engine
  holds;
- :class:`ApproximatePrefixIndex`: for engines that publish no events, the
  router's own routing history: the blocks it sent to each instance, aged by
  LRU within the instance's KV capacity. It misses what the engine evicted
  early (KV pressure) and keeps what it has not heard of being evicted, the
  way SGLang's and vLLM router's ``cache_aware`` radix trees do.

Bounded: each instance keeps at most ``max_blocks_per_instance`` hashes (the
least recently used go first) and the index at most ``max_instances``
instances (the least recently touched go first), so memory is at most
``max_instances * max_blocks_per_instance`` entries whatever the traffic. The
LRU order beside them (segments, below) holds at most twice an instance's
hashes plus a slack, and the kept lookups a fixed number of hashes.

Cost: a lookup reads the per-block bitsets of the instances holding each
of the prompt's blocks (one Python int per block, a bit per instance) and
ANDs them along the chain, all in C loops (``map``/``accumulate``): the
running AND after block ``j`` is the set of instances holding the prefix up
to ``j``, and an instance's match ends where its bit drops out. The instances
come out in groups of equal depth (usually a handful), so the per-view
column (:func:`cached_tokens_column`) is built from the groups with a few
numpy calls, not a Python step per matching instance: a 32k-token prompt in
512-token blocks over 256 instances is 64 dictionary reads and big-int ANDs
in C, whatever the fleet size and however many instances hold it.

Coarser than blocks where traffic allows: an instance's LRU order is kept in
*segments*, runs of hashes used together, so a dispatch that resends a prefix
the instance holds as whole segments (a prompt family's head, a conversation's
earlier turns) moves those segments and inserts only the new tail, with no work
per held block; a lookup resumes the last walk from the same first block while
no holder set it crossed has changed, comparing those blocks instead of reading
their holders; and a lookup ending at one depth hands out a kept column. The
answers are the step-by-step index's (``tests/router/core/test_prefix_fast.py``,
``test_prefix_segments.py``).

Pure and synchronous like the rest of the core: callers feed it (the router
shell from its event stream or its dispatches, the simulator from its
engines), and nothing here does I/O.
"""

from __future__ import annotations

import enum
import math
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from itertools import compress, groupby, islice, repeat
from operator import eq
from typing import Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from router.core.columns import FloatArray, IntArray

#: Default bound on the hashes kept per instance (2M tokens of KV in 32-token blocks).
DEFAULT_MAX_BLOCKS_PER_INSTANCE = 65536
#: Default bound on the instances the index keeps.
DEFAULT_MAX_INSTANCES = 4096
#: Bound on the membership rows :meth:`BlockIndex._column` keeps for the cached view (each a byte
#: per view instance); past it they are all dropped and rebuilt as lookups come.
_MEMBER_ROWS = 256
#: Stale entries a slot's segments may hold past twice its live hashes before they are compacted.
_SEGMENT_SLACK = 1024
#: Bound on the holder sets :meth:`BlockIndex._share` keeps one object of (past it, it starts over).
_SHARED_SETS = 4096
#: A lookup's walk is kept for the next one from the same first block when it went this many blocks
#: with two or more instances holding them all (:meth:`BlockIndex._groups`); at most ``_WALKS`` kept,
#: of at most ``_WALK_BLOCKS`` hashes in all (past either, they all go).
_WALK_MIN = 16
_WALKS = 4096
_WALK_BLOCKS = 1 << 17


class PrefixRouting(str, enum.Enum):
    """Where the router's knowledge of the instances' caches comes from (``--prefix-cache-routing``)."""

    #: Exact where the engines publish cache events, else approximate.
    AUTO = "auto"
    EXACT = "exact"
    APPROXIMATE = "approximate"
    #: No cache in the prediction (every prompt charged in full, as before prefix caching).
    OFF = "off"


PREFIX_ROUTING_MODES = tuple(m.value for m in PrefixRouting)


class PrefixSource(Protocol):
    """What a decision asks of the router's cache knowledge.

    ``block_tokens`` is the granularity of the hashes it holds (a request's
    ``prefix_hashes`` must be hashed the same way). :meth:`matched_blocks` is
    called once per decision that has hashes; :meth:`dispatched` when a
    request's prefill is sent to an instance (real decisions only).
    """

    name: str
    block_tokens: int

    def matched_blocks(self, hashes: Sequence[int]) -> Mapping[str, int]:
        """Instance id -> how many of ``hashes``' leading blocks it holds (instances holding none left out)."""
        ...

    def dispatched(
        self, instance_id: str, hashes: Sequence[int], capacity_tokens: float, private_tokens: int = 0
    ) -> None:
        """A prompt with ``hashes`` was sent to ``instance_id`` (whose KV holds ``capacity_tokens``);
        ``private_tokens`` more of its KV (the unshared tail, the output) are its own."""
        ...


class _Segment:
    """Hashes of one instance used together, in LRU order, and how many are still live there."""

    __slots__ = ("hashes", "live")

    def __init__(self, hashes: Sequence[int]) -> None:
        self.hashes = hashes
        self.live = len(hashes)


class BlockIndex:
    """Per instance, an LRU set of block hashes; per hash, a bitset of the instances holding it.

    ``max_blocks_per_instance`` and ``max_instances`` bound the memory (see the module doc).
    """

    def __init__(
        self,
        block_tokens: int,
        *,
        max_blocks_per_instance: int = DEFAULT_MAX_BLOCKS_PER_INSTANCE,
        max_instances: int = DEFAULT_MAX_INSTANCES,
        chain_block_tokens: int = 0,
    ) -> None:
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
        if chain_block_tokens < 0 or (chain_block_tokens and block_tokens % chain_block_tokens):
            raise ValueError(
                f"chain_block_tokens must be 0 or divide block_tokens ({block_tokens}), got {chain_block_tokens}"
            )
        #: The block the hashes are chained in (an engine's cache block, what its KV events name);
        #: a prompt is looked up at every ``block_tokens`` boundary (:func:`fleet.prefix.lookup_block_hashes`).
        self.chain_block_tokens = chain_block_tokens or block_tokens
        if max_blocks_per_instance <= 0:
            raise ValueError(f"max_blocks_per_instance must be > 0, got {max_blocks_per_instance}")
        if max_instances <= 0:
            raise ValueError(f"max_instances must be > 0, got {max_instances}")
        self.block_tokens = block_tokens
        self.max_blocks_per_instance = max_blocks_per_instance
        self.max_instances = max_instances
        self._slot: OrderedDict[str, int] = OrderedDict()  # instance -> slot, least recently touched first
        self._ids: list[str] = []  # slot -> instance ("" when free)
        self._free_slots: list[int] = []
        # Per slot, its LRU order kept in *segments*: runs of hashes used together (a dispatched
        # prompt's new tail, the prefix it shares), in LRU order themselves, each with the count of
        # its entries still live. ``_blocks`` maps each hash a slot holds to its segment; an entry of a
        # segment is live while its hash still maps there (a later use moved it to a newer segment,
        # or it was removed: stale, skipped). A use that is new hashes followed by whole live
        # segments (a family's prompt sent again where its prefix is) moves those segments to the end
        # and adds one for the new hashes: no work per held block (:meth:`_add_slot`).
        self._blocks: list[dict[int, int]] = []  # slot -> {hash: its segment}
        self._segments: list[OrderedDict[int, _Segment]] = []  # slot -> {id: segment}, least recent first
        self._stored: list[int] = []  # slot -> entries in its segments, live and stale (bounded)
        self._next_segment = 0
        self._shared: dict[int, int] = {}  # holder set -> its one int object (:meth:`_share`)
        # First block -> (holder epoch, blocks walked, running set there, groups before): the lookups'
        # kept walks, valid while the epoch stands (bumped by any holder change but a block's first
        # holder coming or its only holder going).
        self._walks: dict[int, tuple[int, Sequence[int], int, tuple[tuple[int, int], ...]]] = {}
        self._walked = 0  # hashes the kept walks were given, at least what they hold
        self._holder_epoch = 0
        self._holders: dict[int, int] = {}  # hash -> bitset of slots holding it
        self._slot_epoch = 0  # bumped whenever an instance takes or leaves a slot
        self._view: tuple[object, int, IntArray] | None = None  # (ids, epoch, slot per view position)
        # Per holder bitset, its membership laid out on the cached view (0/1 per position): a prompt
        # family's holders change rarely between decisions, so a lookup whose instances end at one
        # depth reuses the row instead of unpacking the bitset again (cleared with the view).
        self._members: dict[int, npt.NDArray[np.uint8]] = {}
        # And per (holder bitset, value), the column itself, read-only: a family's lookups between
        # two changes of its holders hand out the same column (cleared with the rows).
        self._columns: dict[tuple[int, float], FloatArray] = {}

    # ------------------------------------------------------------------ reading

    def _groups(self, hashes: Sequence[int]) -> list[tuple[int, int]]:
        """``(bitset, depth)`` per group of slots whose match of ``hashes`` ends at the same ``depth``
        (>= 1), shallowest first: the slots that hold the first ``depth`` blocks and not the next.

        One walk down the chain ANDing each block's holders into the running set of slots holding the
        prefix so far, stopping when it is empty (a loop beats C-level ``accumulate`` here: it stops
        at the first block nobody holds, and a request's own tail is usually nobody's).

        Resumed where the last walk from the same first block left off, when it went at least
        ``_WALK_MIN`` blocks with two or more slots holding them all and no holder set changed since
        but by a block nobody held getting its first holder or one holder dropping a block it held
        alone (the dispatches' usual churn, a prompt's own tail): neither touches blocks two slots
        hold, so the walk's state there stands; the blocks are compared, not their holders read.
        """
        holders = self._holders
        if not hashes or not holders:
            return []
        first = hashes[0]
        walk = self._walks.get(first)
        start = 1
        if walk is not None and walk[0] == self._holder_epoch and hashes[: len(walk[1])] == walk[1]:
            start = len(walk[1])
            alive = walk[2]
            groups = list(walk[3])
        else:
            walk = None
            alive = holders.get(first, 0)
            if not alive:
                return []
            groups = []
        mark: tuple[int, int, int] | None = None  # (depth, alive, groups) at the deepest change with 2+ slots
        # Each block's holders, read in C as the walk goes.
        for j, bits in enumerate(map(holders.get, islice(hashes, start, None), repeat(0)), start):
            if bits != alive:  # (the same set block after block is the common case: no AND to build)
                nxt = alive & bits
                if nxt != alive:
                    if alive & (alive - 1):
                        mark = (j, alive, len(groups))
                    groups.append((alive & ~nxt, j))
                    if not nxt:
                        break
                    alive = nxt
        else:
            if alive & (alive - 1):
                mark = (len(hashes), alive, len(groups))
            groups.append((alive, len(hashes)))
        if mark is not None and mark[0] >= _WALK_MIN and mark[0] > start:
            walks = self._walks
            self._walked += mark[0]  # (an upper bound: a walk replaced still counts)
            if len(walks) >= _WALKS or self._walked > _WALK_BLOCKS:
                walks.clear()
                self._walked = mark[0]
            walks[first] = (self._holder_epoch, hashes[: mark[0]], mark[1], tuple(groups[: mark[2]]))
        return groups

    def matched_blocks(self, hashes: Sequence[int]) -> dict[str, int]:
        """Instance id -> leading blocks of ``hashes`` it holds (only instances holding >= 1)."""
        found: dict[str, int] = {}
        ids = self._ids
        for bits, depth in self._groups(hashes):
            _record(bits, depth, ids, found)
        return found

    def matched_column(self, hashes: Sequence[int], ids: Sequence[str]) -> IntArray:
        """Per instance of ``ids``, the leading blocks of ``hashes`` it holds (0 where none or unknown):
        :meth:`matched_blocks` laid out on ``ids``."""
        groups = self._groups(hashes)
        out: IntArray = self._column(groups, ids, [float(d) for _, d in groups]).astype(np.intp)
        return out

    def cached_column(self, hashes: Sequence[int], ids: Sequence[str], ceiling: int) -> FloatArray:
        """Per instance of ``ids``, the tokens of ``hashes``' leading blocks it holds, at most ``ceiling``."""
        groups = self._groups(hashes)
        per = self.block_tokens
        return self._column(groups, ids, [float(min(d * per, ceiling)) for _, d in groups])

    def _column(self, groups: list[tuple[int, int]], ids: Sequence[str], values: list[float]) -> FloatArray:
        """``values[k]`` at the positions of ``ids`` whose slot is in ``groups[k]``'s bitset, 0 elsewhere.

        Built with a few numpy calls whatever the number of matching instances: the bitsets are
        unpacked to a 0/1 row per group (bit ``s`` at column ``s``), folded into a value per slot,
        and read out through the view's slot positions (:meth:`_view_slots`)."""
        if not groups:
            return np.zeros(len(ids))
        view = self._view_slots(ids)
        width = len(self._ids) // 8 + 1  # a spare bit past the last slot: the "no slot" position
        if len(groups) == 1:
            bits = groups[0][0]
            cached = self._view
            kept = self._members if cached is not None and cached[2] is view else None
            member = kept.get(bits) if kept is not None else None
            if member is None:
                member = np.unpackbits(
                    np.frombuffer(bits.to_bytes(width, "little"), np.uint8), bitorder="little"
                )[view]
                if kept is not None:
                    if len(kept) >= _MEMBER_ROWS:
                        kept.clear()
                    kept[bits] = member
            columns = self._columns if kept is not None else None
            one = columns.get((bits, values[0])) if columns is not None else None
            if one is None:
                one = np.multiply(member, values[0], dtype=np.float64)
                if columns is not None:
                    if len(columns) >= _MEMBER_ROWS:
                        columns.clear()
                    one.setflags(write=False)
                    columns[(bits, values[0])] = one
            return one
        packed = b"".join(bits.to_bytes(width, "little") for bits, _ in groups)
        rows = np.unpackbits(
            np.frombuffer(packed, np.uint8).reshape(len(groups), width), axis=1, bitorder="little"
        )
        per_slot: FloatArray = np.matmul(np.array(values, dtype=np.float64), rows, dtype=np.float64)
        out: FloatArray = per_slot[view]
        return out

    def _view_slots(self, ids: Sequence[str]) -> IntArray:
        """Per position of ``ids``, its slot (or ``len(self._ids)``, a bit no slot has, for an instance
        without one), cached while the same ``ids`` tuple comes back and no instance took or left a slot
        (a view's layout is reused across decisions while the fleet stands)."""
        cached = self._view
        if cached is not None and cached[0] is ids and cached[1] == self._slot_epoch:
            return cached[2]
        none = len(self._ids)
        get = self._slot.get
        slots = np.fromiter((get(i, none) for i in ids), dtype=np.intp, count=len(ids))
        if isinstance(ids, tuple):  # immutable: safe to key on its identity
            self._view = (ids, self._slot_epoch, slots)
            self._members.clear()
            self._columns.clear()
        return slots

    def deepest_match(self, hashes: Sequence[int]) -> int:
        """The most leading blocks of ``hashes`` any instance holds (0 for none)."""
        groups = self._groups(hashes)
        return groups[-1][1] if groups else 0

    def blocks_of(self, instance_id: str) -> frozenset[int]:
        slot = self._slot.get(instance_id)
        return frozenset() if slot is None else frozenset(self._blocks[slot])

    def instances(self) -> tuple[str, ...]:
        return tuple(self._slot)

    @property
    def num_entries(self) -> int:
        """(instance, hash) pairs held: the index's memory, in entries."""
        return sum(len(b) for b in self._blocks)

    # ------------------------------------------------------------------ writing

    def add(self, instance_id: str, hashes: Iterable[int], *, limit: int | None = None) -> None:
        """``instance_id`` holds ``hashes`` (each becomes its most recently used, in the order given).

        Past ``limit`` (and always past ``max_blocks_per_instance``) its least recently used go.
        """
        slot = self._touch(instance_id)
        self._add_slot(slot, hashes)
        self._evict(slot, limit)

    def _add_slot(self, slot: int, hashes: Iterable[int]) -> None:
        """Make ``hashes`` the slot's most recently used, in order (the LRU order a step-by-step
        insert-or-move would leave; a hash named twice counts at its last mention).

        Fast: ``hashes`` are new ones followed by whole live segments, each in its own order (the
        usual dispatch: a prompt's new tail, reversed, then the prefix it shares with the prompts
        last sent there): the segments move to the end, one step each, after a new segment of the
        new hashes; no work per held hash. Otherwise each run of new or held hashes becomes a new
        segment, the held ones leaving their old segments (stale there)."""
        seq: tuple[int, ...] = hashes if isinstance(hashes, tuple) else tuple(hashes)
        if not seq:
            return
        blocks = self._blocks[slot]
        segments = self._segments[slot]
        whole: list[int] = []  # the whole live segments ``seq`` ends with, last first
        end = len(seq)
        get = blocks.get
        while end:
            sid = get(seq[end - 1])
            if sid is None:
                break
            segment = segments[sid]
            n = len(segment.hashes)
            if segment.live != n or n > end or sid in whole or seq[end - n : end] != segment.hashes:
                end = -1  # (not of that shape)
                break
            whole.append(sid)
            end -= n
        if end >= 0:
            fresh = seq[:end]
            done = True
            if fresh:
                sid = self._next_segment
                self._next_segment = sid + 1
                before = len(blocks)
                olds = list(
                    map(blocks.setdefault, fresh, repeat(sid))
                )  # (the test and the insert: one C loop)
                if len(blocks) - before != len(fresh):  # some held, or one named twice: undone
                    for h, old in zip(fresh, olds, strict=True):
                        if old == sid:
                            blocks.pop(h, None)
                    done = False
                else:
                    segments[sid] = _Segment(fresh)
                    self._stored[slot] += len(fresh)
                    self._hold(slot, fresh)
            if done:
                for sid in reversed(whole):
                    segments.move_to_end(sid)
                return
        seq = _last_mentions(seq)
        for held, run_ in groupby(seq, blocks.__contains__):
            run = tuple(run_)
            if held:
                for old, n in Counter(map(blocks.__getitem__, run)).items():
                    segment = segments[old]
                    segment.live -= n
                    if not segment.live:
                        del segments[old]
                        self._stored[slot] -= len(segment.hashes)
            sid = self._next_segment
            self._next_segment = sid + 1
            blocks.update(zip(run, repeat(sid)))
            segments[sid] = _Segment(run)
            self._stored[slot] += len(run)
            if not held:
                self._hold(slot, run)
        self._bound(slot)

    def _hold(self, slot: int, new: Sequence[int]) -> None:
        """Give ``new`` (hashes the slot did not hold) the slot's bit."""
        bit = self._bit(slot)
        holders = self._holders
        before = len(holders)
        olds = list(map(holders.setdefault, new, repeat(bit)))  # (a block nobody held: the bit as it is)
        if len(holders) - before != len(new):
            self._holder_epoch += 1  # (a block others hold gains a holder)
            share = self._share
            for h, old in zip(new, olds, strict=True):
                if old is not bit:  # held elsewhere (never by this slot: ``new``)
                    holders[h] = share(old | bit)

    def _evict(self, slot: int, limit: int | None) -> None:
        """Drop the slot's least recently used past ``limit`` (and always past ``max_blocks_per_instance``):
        the oldest segments' live entries, oldest first."""
        blocks = self._blocks[slot]
        cap = self.max_blocks_per_instance if limit is None else min(limit, self.max_blocks_per_instance)
        excess = len(blocks) - max(cap, 1)
        if excess <= 0:
            return
        segments = self._segments[slot]
        victims: list[int] = []
        stored = self._stored[slot]
        while excess > 0:  # (the segments hold every live hash: they last)
            sid, segment = next(iter(segments.items()))
            run = segment.hashes
            stored -= len(run)
            if segment.live != len(run):
                run = tuple(compress(run, map(eq, map(blocks.get, run), repeat(sid))))
            if len(run) <= excess:
                del segments[sid]
                victims.extend(run)
                excess -= len(run)
            else:
                victims.extend(run[:excess])
                segment.hashes = run = run[excess:]
                segment.live = len(run)
                stored += len(run)
                excess = 0
        self._stored[slot] = stored
        bit = self._bit(slot)
        mask = ~bit
        holders = self._holders
        pop = holders.pop
        # One loop, both maps per hash while it is at hand (measured: faster in the decision than a
        # C loop per map, each reading the evicted hashes cold again).
        for h in victims:
            del blocks[h]
            held = pop(h, None)  # (None: a placeholder)
            if held is not None and held != bit:  # others hold it too
                self._holder_epoch += 1
                if held & mask:
                    holders[h] = self._share(held & mask)

    def _bound(self, slot: int) -> None:
        """Keep the slot's stale entries within its live hashes plus a slack: past it, every segment
        keeps only its live entries (amortised: at least as many entries went stale since the last
        time as this reads)."""
        blocks = self._blocks[slot]
        if self._stored[slot] <= 2 * len(blocks) + _SEGMENT_SLACK:
            return
        get = blocks.get
        for sid, segment in self._segments[slot].items():
            if segment.live != len(segment.hashes):
                segment.hashes = tuple(
                    compress(segment.hashes, map(eq, map(get, segment.hashes), repeat(sid)))
                )
        self._stored[slot] = len(blocks)

    def _bit(self, slot: int) -> int:
        """The slot's bit, one int object per slot (shared by the holder sets it stands alone in)."""
        return self._share(1 << slot)

    def _share(self, bits: int) -> int:
        """One int object per holder set: the blocks of a prefix held by the same instances hold the
        same object, which a lookup's walk compares by identity first (no read of the int)."""
        got = self._shared.get(bits)
        if got is None:
            if len(self._shared) >= _SHARED_SETS:
                self._shared.clear()
            self._shared[bits] = got = bits
        return got

    def lru_order(self, instance_id: str) -> list[int]:
        """``instance_id``'s hashes, least recently used first (for checks, not on a decision's path)."""
        slot = self._slot.get(instance_id)
        if slot is None:
            return []
        blocks = self._blocks[slot]
        return [h for sid, s in self._segments[slot].items() for h in s.hashes if blocks.get(h) == sid]

    def remove(self, instance_id: str, hashes: Iterable[int]) -> None:
        """``instance_id`` no longer holds ``hashes`` (unknown ones are ignored)."""
        slot = self._slot.get(instance_id)
        if slot is None:
            return
        bit = 1 << slot
        blocks = self._blocks[slot]
        segments = self._segments[slot]
        for h in hashes:
            sid = blocks.pop(h, None)
            if sid is not None:
                segment = segments[sid]
                segment.live -= 1
                if not segment.live:
                    del segments[sid]
                    self._stored[slot] -= len(segment.hashes)
                self._drop_bit(h, bit)
        self._bound(slot)

    def clear(self, instance_id: str) -> None:
        """``instance_id`` holds nothing (its slot is kept)."""
        slot = self._slot.get(instance_id)
        if slot is None:
            return
        bit = 1 << slot
        for h in self._blocks[slot]:
            self._drop_bit(h, bit)
        self._blocks[slot].clear()
        self._segments[slot].clear()
        self._stored[slot] = 0

    def forget(self, instance_id: str) -> None:
        """Drop ``instance_id`` altogether (it left the fleet)."""
        if instance_id not in self._slot:
            return
        self.clear(instance_id)
        self._holder_epoch += 1  # (its slot may go to another instance)
        slot = self._slot.pop(instance_id)
        self._ids[slot] = ""
        self._free_slots.append(slot)
        self._slot_epoch += 1

    def retain(self, instance_ids: Iterable[str]) -> None:
        """Forget every instance not in ``instance_ids`` (the fleet now)."""
        keep = set(instance_ids)
        for instance_id in [i for i in self._slot if i not in keep]:
            self.forget(instance_id)

    # ------------------------------------------------------------------ internals

    def _touch(self, instance_id: str) -> int:
        slot = self._slot.get(instance_id)
        if slot is not None:
            self._slot.move_to_end(instance_id)
            return slot
        if len(self._slot) >= self.max_instances:
            self.forget(next(iter(self._slot)))
        if self._free_slots:
            slot = self._free_slots.pop()
            self._ids[slot] = instance_id
        else:
            slot = len(self._ids)
            self._ids.append(instance_id)
            self._blocks.append({})
            self._segments.append(OrderedDict())
            self._stored.append(0)
        self._slot[instance_id] = slot
        self._slot_epoch += 1
        return slot

    def _drop_bit(self, h: int, bit: int) -> None:
        self._holder_epoch += 1
        rest = self._holders.get(h, 0) & ~bit
        if rest:
            self._holders[h] = self._share(rest)
        else:
            self._holders.pop(h, None)


def _last_mentions(seq: tuple[int, ...]) -> tuple[int, ...]:
    """``seq`` with each hash kept at its last mention only (the order an insert-or-move leaves)."""
    return tuple(reversed(dict.fromkeys(reversed(seq))))


def _record(bits: int, depth: int, ids: list[str], found: dict[str, int]) -> None:
    while bits:
        low = bits & -bits
        found[ids[low.bit_length() - 1]] = depth
        bits ^= low


class ApproximatePrefixIndex(BlockIndex):
    """The router's routing history: the blocks it sent to each instance, LRU within its KV capacity.

    A dispatched prompt's blocks become the instance's most recently used,
    its first block last, so under pressure a prompt's tail ages out before
    the head other prompts share (as an engine frees a finished request's
    blocks, tail first). The instance keeps at most its KV capacity in blocks.

    The request's own KV (the prompt past its last full block, its output)
    takes room in the engine too while it runs, pushing cached blocks out: it
    enters the LRU as placeholder blocks that match no prompt, newest of all,
    and ages out like the rest.
    """

    name = "approximate"

    def __init__(self, block_tokens: int, **bounds: int) -> None:
        super().__init__(block_tokens, **bounds)
        self._placeholder = 0

    def dispatched(
        self, instance_id: str, hashes: Sequence[int], capacity_tokens: float, private_tokens: int = 0
    ) -> None:
        limit = None
        if math.isfinite(capacity_tokens) and capacity_tokens > 0:
            limit = int(capacity_tokens // self.block_tokens)
        blocks = min(max(private_tokens, 0) // self.block_tokens, self.max_blocks_per_instance)
        # Placeholders: odd-width ints no 64-bit chained hash equals (Python hashes fit in 64 bits).
        first = self._placeholder
        self._placeholder += blocks
        slot = self._touch(instance_id)
        self._add_slot(slot, hashes[::-1])
        if blocks:
            # They hold room in the LRU, never a match: fresh (never seen) keys, no holder bit, a
            # segment of their own (a range: no list built).
            fresh = range((1 << 64) + first, (1 << 64) + first + blocks)
            sid = self._next_segment
            self._next_segment = sid + 1
            self._blocks[slot].update(zip(fresh, repeat(sid)))
            self._segments[slot][sid] = _Segment(fresh)
            self._stored[slot] += blocks
        self._evict(slot, limit)


class KvEventKind(str, enum.Enum):
    """The kinds of cache event an engine reports (vLLM's ``BlockStored``, ``BlockRemoved``,
    ``AllBlocksCleared``; :class:`engine.model.KvEventKind` has the same values)."""

    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"


class ExactPrefixIndex(BlockIndex):
    """What each engine reported it holds, from its cache events, plus what is on its way there.

    :meth:`apply` takes one instance's events in the order the engine emitted
    them. A reader that lost events (a gap in the stream, a reconnect) calls
    :meth:`clear` and replays the engine's full contents as one ``STORED``
    event, which is what the sim engine's drain hands over after an overflow.

    Dispatched, not yet reported: an engine reports a prompt's blocks only
    once it has scheduled the prompt, so for the time a request waits in the
    engine's queue the events say nothing of it, and a second request with
    the same prefix arriving meanwhile would be sent anywhere (computing the
    prefix twice, on two instances). :meth:`dispatched` therefore marks the
    blocks it sent as *pending* on that instance; a lookup counts pending
    blocks as held. A pending block becomes real when the engine's ``STORED``
    names it, and goes when ``REMOVED`` or ``CLEARED`` does. Blocks of a
    request the engine never schedules (aborted, refused) linger only until
    newer dispatches push them out: each instance keeps at most its KV
    capacity (and ``max_blocks_per_instance``) in pending blocks, least
    recently dispatched first out.
    """

    name = "exact"

    def __init__(self, block_tokens: int, **bounds: int) -> None:
        super().__init__(block_tokens, **bounds)
        self._pending: dict[int, OrderedDict[int, None]] = {}  # slot -> dispatched, not yet reported
        self._pending_holders: dict[int, int] = {}  # hash -> bitset of slots it is pending on

    def dispatched(
        self, instance_id: str, hashes: Sequence[int], capacity_tokens: float, private_tokens: int = 0
    ) -> None:
        if not hashes:
            return
        slot = self._touch(instance_id)
        bit = 1 << slot
        held = self._blocks[slot]
        pending = self._pending.setdefault(slot, OrderedDict())
        holders = self._pending_holders
        for h in hashes:
            if h in held:
                continue
            if h in pending:
                pending.move_to_end(h)
            else:
                pending[h] = None
                holders[h] = holders.get(h, 0) | bit
        cap = self.max_blocks_per_instance
        if math.isfinite(capacity_tokens) and capacity_tokens > 0:
            cap = min(cap, int(capacity_tokens // self.block_tokens))
        cap = max(cap, 1)
        while len(pending) > cap:
            h, _ = pending.popitem(last=False)
            self._unpend(h, bit)

    def apply(self, instance_id: str, events: Iterable[tuple[str, Sequence[int]]]) -> None:
        """Apply ``(kind, block hashes)`` events of one instance, oldest first (``kind``: a
        :class:`KvEventKind` value)."""
        for kind, hashes in events:
            if kind == "stored":
                self.add(instance_id, hashes)
                self._settle(instance_id, hashes)
            elif kind == "removed":
                self.remove(instance_id, hashes)
                self._settle(instance_id, hashes)
            elif kind == "cleared":
                self.clear(instance_id)
            else:
                raise ValueError(f"unknown KV event kind {kind!r}; use stored, removed or cleared")

    def clear(self, instance_id: str) -> None:
        """``instance_id`` holds nothing, reported or pending (its slot is kept)."""
        super().clear(instance_id)
        slot = self._slot.get(instance_id)
        if slot is not None:
            bit = 1 << slot
            for h in self._pending.pop(slot, {}):
                self._unpend(h, bit)

    def _groups(self, hashes: Sequence[int]) -> list[tuple[int, int]]:
        """As :meth:`BlockIndex._groups`, a pending block counting as held."""
        extra = self._pending_holders
        if not extra:
            return super()._groups(hashes)
        holders = self._holders
        if not hashes:
            return []
        alive = holders.get(hashes[0], 0) | extra.get(hashes[0], 0)
        if not alive:
            return []
        groups: list[tuple[int, int]] = []
        for j in range(1, len(hashes)):
            h = hashes[j]
            nxt = alive & (holders.get(h, 0) | extra.get(h, 0))
            if nxt != alive:
                groups.append((alive & ~nxt, j))
                if not nxt:
                    return groups
                alive = nxt
        groups.append((alive, len(hashes)))
        return groups

    def set_live(self, instance_id: str, live: bool) -> None:
        """The event feed's stream state; ``exact`` keeps what it heard until the feed clears it."""

    def pending_of(self, instance_id: str) -> frozenset[int]:
        """The hashes dispatched to ``instance_id`` that its engine has not reported yet."""
        slot = self._slot.get(instance_id)
        return frozenset(self._pending.get(slot, ())) if slot is not None else frozenset()

    @property
    def num_entries(self) -> int:
        return super().num_entries + sum(len(p) for p in self._pending.values())

    def _settle(self, instance_id: str, hashes: Sequence[int]) -> None:
        slot = self._slot.get(instance_id)
        pending = self._pending.get(slot) if slot is not None else None
        if not pending or slot is None:
            return
        bit = 1 << slot
        for h in hashes:
            if h in pending:
                del pending[h]
                self._unpend(h, bit)

    def _unpend(self, h: int, bit: int) -> None:
        rest = self._pending_holders.get(h, 0) & ~bit
        if rest:
            self._pending_holders[h] = rest
        else:
            self._pending_holders.pop(h, None)


def cached_tokens_column(
    source: PrefixSource,
    ids: Sequence[str],
    index: Mapping[str, int],
    hashes: Sequence[int],
    prompt_tokens: int,
) -> FloatArray:
    """Per view instance, the prompt tokens its cache holds (at most ``prompt_tokens - 1``: the
    engine computes at least the last token to sample the first output)."""
    ceiling = max(prompt_tokens - 1, 0)
    if isinstance(source, (BlockIndex, AutoPrefixIndex)):
        return source.cached_column(hashes, ids, ceiling)
    out = np.zeros(len(ids))
    found = source.matched_blocks(hashes)
    if found:
        per = source.block_tokens
        for instance_id, n in found.items():
            i = index.get(instance_id)
            if i is not None:
                out[i] = min(n * per, ceiling)
    return out


def best_cached_tokens(source: PrefixSource | None, hashes: Sequence[int], prompt_tokens: int) -> int:
    """The most of a prompt any instance's cache holds, as the router knows it (at most
    ``prompt_tokens - 1``; 0 without a source or hashes): the best case of its prefill, for the judges
    of a request before any placement (the arrival check, the router queue's hopeless test). A
    prompt mostly cached costs little prefill where it is cached, so judging it as uncached would
    refuse or turn late a request the fleet can serve in time."""
    if source is None or not hashes:
        return 0
    if isinstance(source, BlockIndex):
        return min(source.deepest_match(hashes) * source.block_tokens, max(prompt_tokens - 1, 0))
    found = source.matched_blocks(hashes)
    if not found:
        return 0
    return min(max(found.values()) * source.block_tokens, max(prompt_tokens - 1, 0))


_Column = TypeVar("_Column", IntArray, FloatArray)


class AutoPrefixIndex:
    """``auto``: the exact index for the instances whose events arrive, the routing history for the rest.

    The router's event feed (:mod:`router.kv_events`) marks an instance *live*
    while its event stream is up and in sync (after the snapshot it starts
    with); a lookup then takes that instance's answer from :attr:`exact`, and
    every other instance's from :attr:`approximate`. The routing history learns
    every dispatch, live instance or not, so an instance whose stream breaks
    falls back to what the router sent it, not to nothing; its exact entries go
    at once (they would go stale unseen). Without any live instance a lookup
    costs one probe of the empty exact index more than ``approximate`` alone.
    """

    name = "auto"

    def __init__(self, block_tokens: int, **bounds: int) -> None:
        self.exact = ExactPrefixIndex(block_tokens, **bounds)
        self.approximate = ApproximatePrefixIndex(block_tokens, **bounds)
        self.block_tokens = block_tokens
        self.chain_block_tokens = self.exact.chain_block_tokens
        self._live: set[str] = set()
        self._live_epoch = 0  # bumped whenever an instance goes live or stops being live
        self._live_view: tuple[object, int, npt.NDArray[np.bool_]] | None = None  # (ids, epoch, mask)

    def is_live(self, instance_id: str) -> bool:
        return instance_id in self._live

    def set_live(self, instance_id: str, live: bool) -> None:
        """Whether ``instance_id``'s events arrive in sync; going down drops its exact entries."""
        if live:
            if instance_id not in self._live:
                self._live.add(instance_id)
                self._live_epoch += 1
        elif instance_id in self._live:
            self._live.discard(instance_id)
            self._live_epoch += 1
            self.exact.clear(instance_id)

    def matched_blocks(self, hashes: Sequence[int]) -> dict[str, int]:
        found = self.approximate.matched_blocks(hashes)
        live = self._live
        if live:
            if found:
                found = {i: n for i, n in found.items() if i not in live}
            found.update(self.exact.matched_blocks(hashes))
        return found

    def matched_column(self, hashes: Sequence[int], ids: Sequence[str]) -> IntArray:
        """:meth:`matched_blocks` laid out on ``ids`` (as :meth:`BlockIndex.matched_column`): the
        routing history's answer, the exact index's for the live instances."""
        out = self.approximate.matched_column(hashes, ids)
        if self._live:
            out = self._merge(self.exact.matched_column(hashes, ids), out, ids)
        return out

    def cached_column(self, hashes: Sequence[int], ids: Sequence[str], ceiling: int) -> FloatArray:
        """As :meth:`BlockIndex.cached_column`, each live instance's from the exact index."""
        out = self.approximate.cached_column(hashes, ids, ceiling)
        if self._live:
            out = self._merge(self.exact.cached_column(hashes, ids, ceiling), out, ids)
        return out

    def _merge(self, exact: _Column, approximate: _Column, ids: Sequence[str]) -> _Column:
        """As :meth:`matched_blocks` merges: the exact index's hit where it has one, else nothing for a
        live instance and the routing history's for the rest."""
        out: _Column = np.where(exact > 0, exact, np.where(self._live_mask(ids), 0, approximate))
        return out

    def _live_mask(self, ids: Sequence[str]) -> npt.NDArray[np.bool_]:
        """Per position of ``ids``, whether it is live; cached like :meth:`BlockIndex._view_slots`."""
        cached = self._live_view
        if cached is not None and cached[0] is ids and cached[1] == self._live_epoch:
            return cached[2]
        live = self._live
        mask = np.fromiter((i in live for i in ids), dtype=bool, count=len(ids))
        if isinstance(ids, tuple):
            self._live_view = (ids, self._live_epoch, mask)
        return mask

    def dispatched(
        self, instance_id: str, hashes: Sequence[int], capacity_tokens: float, private_tokens: int = 0
    ) -> None:
        self.approximate.dispatched(instance_id, hashes, capacity_tokens, private_tokens)
        if instance_id in self._live:
            self.exact.dispatched(instance_id, hashes, capacity_tokens, private_tokens)

    def apply(self, instance_id: str, events: Iterable[tuple[str, Sequence[int]]]) -> None:
        self.exact.apply(instance_id, events)

    def clear(self, instance_id: str) -> None:
        self.exact.clear(instance_id)

    def forget(self, instance_id: str) -> None:
        """``instance_id`` left the fleet: nothing of it is kept."""
        if instance_id in self._live:
            self._live.discard(instance_id)
            self._live_epoch += 1
        self.exact.forget(instance_id)
        self.approximate.forget(instance_id)

    @property
    def num_entries(self) -> int:
        return self.exact.num_entries + self.approximate.num_entries
