"""The router's in-flight account: load it dispatched that the instances do not report yet.

A dispatch is recorded at once, so the next decision sees it; the CMS status
of the instance catches up only after the engine admits the request. Each
request has one *entry* per instance it was sent to, holding the *legs* it
runs there (prefill, decode, or both on one instance):

* prefill leg: +1 request, +prompt tokens of prefill backlog;
* decode leg: +1 decode request, +prompt tokens of decode context;
* every entry: +1 request and +prompt tokens of KV once, whatever its legs.

An entry leaves when

* that instance's status lists the request id in ``admitted_request_ids``
  (:meth:`InflightAccount.reconcile`) — each instance's entry separately, so a
  request admitted by its prefill instance keeps its decode entry until the
  decode instance admits it too;
* that instance lists no admitted ids (a stock vLLM engine) and its status was
  measured after the router saw the instance running the request
  (:meth:`InflightAccount.confirm`);
* the request ends at the router (:meth:`InflightAccount.release`), for all
  its instances or one;
* it is ``expiry_s`` old (:meth:`InflightAccount.expire`).

Invariants (they fix the anchor's local-account bugs): every mutation is
idempotent (recording the same leg twice, releasing twice, reconciling the same
snapshot twice change nothing); a removal subtracts exactly what its entry
added, so no counter goes negative; a request is counted once per instance
(a neutral request is one request, not two); and a leg is not recorded on an
instance whose latest reconciled status already reports the request, so load
is never counted both in-flight and in the status.

Residents. A decode leg recorded with ``final_tokens`` (its context plus the
output it is expected to still generate) also enters the *resident* tally of
its instance, which stays until the request ends at the router
(:meth:`InflightAccount.release`) or ``resident_expiry_s`` passes — not at
admission: packing (:mod:`router.core.packing`) needs the expected growth of
every request living on an instance, which no status reports. The router
forwards every token a request produces, so it also keeps each resident leg's
context as it grows (:meth:`InflightAccount.advance`, no version change: only
the exact KV peak reads it, per decision, through :meth:`resident_legs`).

Not thread-safe: the router calls it from its event loop only.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fleet.snapshot import ClusterSnapshot, InstanceRecord
from router.core.columns import (
    INFLIGHT_ALL,
    INFLIGHT_DECODE_REQUESTS,
    INFLIGHT_DECODE_TOKENS,
    INFLIGHT_PREFILL_REQUESTS,
    INFLIGHT_PREFILL_TOKENS,
    INFLIGHT_REQUESTS,
    INFLIGHT_RESIDENT_REQUESTS,
    INFLIGHT_RESIDENT_TOKENS,
    INFLIGHT_ROWS,
    INFLIGHT_TOKENS,
    InflightColumns,
    ResidentLegs,
)

_ENTRY = INFLIGHT_REQUESTS | INFLIGHT_TOKENS
_PREFILL_LEG = INFLIGHT_PREFILL_REQUESTS | INFLIGHT_PREFILL_TOKENS
_DECODE_LEG = INFLIGHT_DECODE_REQUESTS | INFLIGHT_DECODE_TOKENS
_RESIDENT = INFLIGHT_RESIDENT_REQUESTS | INFLIGHT_RESIDENT_TOKENS


def _columns_of(new_entry: bool, prefill: bool, decode: bool) -> int:
    """The in-flight columns a change touches (``INFLIGHT_*`` bits)."""
    return (_ENTRY if new_entry else 0) | (_PREFILL_LEG if prefill else 0) | (_DECODE_LEG if decode else 0)


@dataclass(frozen=True)
class InflightTotals:
    """One instance's in-flight sums."""

    requests: int = 0
    prefill_requests: int = 0
    prefill_tokens: int = 0
    decode_requests: int = 0
    decode_tokens: int = 0
    tokens: int = 0


@dataclass(frozen=True)
class InflightEntry:
    """One request's dispatch to one instance."""

    request_id: str
    instance_id: str
    prefill: bool
    decode: bool
    prompt_tokens: int
    recorded_at_s: float
    #: Prompt tokens expected in the instance's prefix cache: its prefill leg counts only the rest.
    cached_tokens: int = 0


class _Totals:
    __slots__ = (
        "decode_requests",
        "decode_tokens",
        "prefill_requests",
        "prefill_tokens",
        "requests",
        "tokens",
    )

    def __init__(self) -> None:
        self.requests = 0
        self.prefill_requests = 0
        self.prefill_tokens = 0
        self.decode_requests = 0
        self.decode_tokens = 0
        self.tokens = 0

    def add(self, entry: InflightEntry, sign: int, *, new_entry: bool, prefill: bool, decode: bool) -> None:
        p = entry.prompt_tokens
        if new_entry:
            self.requests = max(0, self.requests + sign)
            self.tokens = max(0, self.tokens + sign * p)
        if prefill:
            self.prefill_requests = max(0, self.prefill_requests + sign)
            self.prefill_tokens = max(0, self.prefill_tokens + sign * (p - entry.cached_tokens))
        if decode:
            self.decode_requests = max(0, self.decode_requests + sign)
            self.decode_tokens = max(0, self.decode_tokens + sign * p)

    def frozen(self) -> InflightTotals:
        return InflightTotals(
            self.requests,
            self.prefill_requests,
            self.prefill_tokens,
            self.decode_requests,
            self.decode_tokens,
            self.tokens,
        )


_NO_LEGS = ResidentLegs(np.zeros(0, dtype=np.intp), np.zeros(0), np.zeros(0), np.zeros(0, dtype=bool))

#: How many recent changes :meth:`InflightAccount.changed_since` can describe.
JOURNAL_LENGTH = 4096


class InflightAccount:
    """Dispatched load per instance, until the instance reports it (see the module doc).

    ``version`` increases with every change, so views can cache columns per
    version and update them for just the instances that changed
    (:meth:`changed_since`, :meth:`changes_since`).
    """

    def __init__(self, expiry_s: float = 10.0, resident_expiry_s: float = 900.0) -> None:
        if not expiry_s > 0:
            raise ValueError(f"expiry_s must be > 0, got {expiry_s}")
        if not resident_expiry_s > 0:
            raise ValueError(f"resident_expiry_s must be > 0, got {resident_expiry_s}")
        self.expiry_s = expiry_s
        self.resident_expiry_s = resident_expiry_s
        # request_id -> (instance_id, final tokens, recorded at), in recording order.
        self._resident: dict[str, tuple[str, int, float]] = {}
        # request_id -> the resident leg's context now (prompt + tokens produced), see advance().
        self._resident_context: dict[str, int] = {}
        #: The context each resident leg started from (its prompt): what it has produced is the rest.
        self._resident_prompt: dict[str, int] = {}
        # request_id -> the TPOT its resident leg must keep (ms), when the dispatch said (see record()).
        self._resident_need: dict[str, float] = {}
        # The resident legs whose recorded need is a deadline's pace (see record()).
        self._resident_paced: set[str] = set()
        #: Per paced resident leg: the output length its pace spreads its deadline over.
        self._resident_paced_tokens: dict[str, float] = {}
        # request_id -> when its resident leg's first output token came (see advance()).
        self._resident_first: dict[str, float] = {}
        # request_id -> prompt tokens its instance's prefix cache held when the leg was placed there
        # (colocated legs only; see record()).
        self._resident_cached: dict[str, int] = {}
        # instance_id -> [resident decode legs, sum of their final tokens]
        self._resident_totals: dict[str, list[int]] = {}
        # instance_id -> its resident legs' request ids (an ordered set), for one instance's legs.
        self._resident_on: dict[str, dict[str, None]] = {}
        self.version = 0
        # (request_id, instance_id) -> entry, in recording order (expiry walks it from the front).
        self._entries: dict[tuple[str, str], InflightEntry] = {}
        self._by_request: dict[str, dict[str, InflightEntry]] = {}
        self._by_instance: dict[str, dict[str, InflightEntry]] = {}
        self._totals: dict[str, _Totals] = {}
        self._snapshot: ClusterSnapshot | None = None
        self._positions: Mapping[str, int] | None = None
        # (instance, INFLIGHT_* columns) changed by each of the last versions; _journal_start is the
        # version before the oldest.
        self._journal: deque[tuple[str, int]] = deque(maxlen=JOURNAL_LENGTH)
        self._journal_start = 0
        # (request_id, instance_id) -> epoch ms at which the instance was seen running the request
        # (its first output), for instances that list no admitted ids (see :meth:`confirm`).
        self._confirmed: dict[tuple[str, str], int] = {}
        # instance_id -> how many of its entries are confirmed (reconcile looks only at those).
        self._confirmed_on: dict[str, int] = {}
        # instance_id -> the summed rows other router processes dispatched there (--processes N);
        # added to this account's own sums in every query (see :meth:`set_peers`).
        self._peers: dict[str, tuple[int, ...]] = {}

    def _touch(self, instance_id: str, columns: int) -> None:
        if len(self._journal) == JOURNAL_LENGTH:
            self._journal_start += 1
        self._journal.append((instance_id, columns))
        self.version += 1

    def changed_since(self, version: int) -> set[str] | None:
        """Instances whose sums changed after ``version``; ``None`` when that is too far back to tell."""
        changes = self.changes_since(version)
        return None if changes is None else set(changes)

    def changes_since(self, version: int) -> dict[str, int] | None:
        """Like :meth:`changed_since`, with a mask of the ``INFLIGHT_*`` columns that changed per instance."""
        if version > self.version or version < self._journal_start:
            return None
        journal = self._journal
        changes: dict[str, int] = {}
        for k in range(self.version - version, 0, -1):
            instance_id, columns = journal[-k]
            changes[instance_id] = changes.get(instance_id, 0) | columns
        return changes

    def totals_row(self, instance_id: str) -> tuple[int, ...]:
        """One instance's sums in :class:`~router.core.columns.InflightColumns` matrix-row order (zeros when none).

        Includes what peer router processes dispatched there (:meth:`set_peers`).
        """
        own = self.own_row(instance_id)
        peer = self._peers.get(instance_id)
        if peer is None:
            return own
        return tuple(a + b for a, b in zip(own, peer, strict=True))

    def own_instances(self) -> list[str]:
        """Instances this account itself holds load for (what a process publishes to its peers)."""
        return list(self._totals.keys() | self._resident_totals.keys())

    def set_peers(self, rows: Mapping[str, tuple[int, ...]]) -> int:
        """Replace the load peer router processes dispatched, per instance (rows in :meth:`totals_row` order).

        Every instance whose peer row changed is journalled, so cached views
        update just those columns. Returns how many changed.
        """
        changed = 0
        for instance_id in self._peers.keys() | rows.keys():
            new = rows.get(instance_id)
            if new is not None and not any(new):
                new = None
            if self._peers.get(instance_id) == new:
                continue
            if new is None:
                del self._peers[instance_id]
            else:
                if len(new) != INFLIGHT_ROWS:
                    raise ValueError(
                        f"peer row of {instance_id!r} has {len(new)} values, expected {INFLIGHT_ROWS}"
                    )
                self._peers[instance_id] = new
            self._touch(instance_id, INFLIGHT_ALL)
            changed += 1
        return changed

    def own_row(self, instance_id: str) -> tuple[int, ...]:
        """One instance's sums from this account's own dispatches only."""
        t = self._totals.get(instance_id)
        r = self._resident_totals.get(instance_id)
        resident = (r[0], r[1]) if r is not None else (0, 0)
        if t is None:
            return (0, 0, 0, 0, 0, 0, *resident)
        return (
            t.requests,
            t.prefill_requests,
            t.prefill_tokens,
            t.decode_requests,
            t.decode_tokens,
            t.tokens,
            *resident,
        )

    def resident(self, instance_id: str) -> tuple[int, int]:
        """(resident decode legs, sum of their final tokens) of one instance."""
        r = self._resident_totals.get(instance_id)
        own = (r[0], r[1]) if r is not None else (0, 0)
        peer = self._peers.get(instance_id)
        if peer is None:
            return own
        return own[0] + peer[-2], own[1] + peer[-1]

    def advance(self, request_id: str, context_tokens: int, now_s: float | None = None) -> None:
        """The resident leg of ``request_id`` holds ``context_tokens`` now (prompt + output so far).

        Only ever grows the context; a request without a resident leg is ignored. ``now_s`` (the
        clock views are built on; None: not known) of the first advance past the prompt is when
        the leg's first output token came: its decode time so far is counted from it.
        """
        if request_id in self._resident and context_tokens > self._resident_context.get(request_id, 0):
            self._resident_context[request_id] = context_tokens
            if (
                now_s is not None
                and request_id not in self._resident_first
                and context_tokens > self._resident_prompt.get(request_id, context_tokens)
            ):
                self._resident_first[request_id] = now_s

    def resident_legs(self, index: Mapping[str, int], n: int) -> ResidentLegs | None:
        """Every resident leg on a view's instances: its context now and the output still expected.

        None when peer router processes hold residents (they publish only sums), so packing falls
        back to the sums. Costs O(resident legs).
        """
        if any(row[-2] for row in self._peers.values()):
            return None
        legs = self._resident
        if not legs:
            return _NO_LEGS
        contexts = self._resident_context
        instance = np.fromiter((index.get(v[0], -1) for v in legs.values()), dtype=np.intp, count=len(legs))
        final = np.fromiter((v[1] for v in legs.values()), dtype=np.float64, count=len(legs))
        context = np.fromiter((contexts[r] for r in legs), dtype=np.float64, count=len(legs))
        # A leg starts decoding once its instance admits it (its in-flight decode entry leaves).
        entries = self._entries
        started = np.fromiter(
            ((r, v[0]) not in entries for r, v in legs.items()), dtype=bool, count=len(legs)
        )
        prompts = self._resident_prompt
        prompt = np.fromiter((prompts.get(r, contexts[r]) for r in legs), dtype=np.float64, count=len(legs))
        needs = self._resident_need
        need = np.fromiter((needs.get(r, np.inf) for r in legs), dtype=np.float64, count=len(legs))
        marked = self._resident_paced
        paced = np.fromiter((r in marked for r in legs), dtype=bool, count=len(legs))
        firsts = self._resident_first
        first = np.fromiter((firsts.get(r, np.nan) for r in legs), dtype=np.float64, count=len(legs))
        lengths = self._resident_paced_tokens
        length = np.fromiter((lengths.get(r, np.nan) for r in legs), dtype=np.float64, count=len(legs))
        hits = self._resident_cached
        cached = np.fromiter((hits.get(r, 0) for r in legs), dtype=np.float64, count=len(legs))
        keep = (instance >= 0) & (instance < n)
        if not keep.all():
            instance, context, final, started = instance[keep], context[keep], final[keep], started[keep]
            prompt, need, paced, first = prompt[keep], need[keep], paced[keep], first[keep]
            length, cached = length[keep], cached[keep]
        return ResidentLegs(
            instance,
            context,
            np.maximum(final - context, 0.0),
            started,
            np.maximum(context - prompt, 0.0),
            need,
            paced,
            np.where(started, first, np.nan),
            length,
            cached,
        )

    def resident_legs_on(self, instance_id: str) -> list[tuple[int, int, bool, int]] | None:
        """The resident legs of one instance as (context now, output still expected, started, cached).

        None when peer router processes hold residents (as :meth:`resident_legs`). Costs
        O(legs on the instance): packing updates one instance's peak after a change there.
        """
        if any(row[-2] for row in self._peers.values()):
            return None
        ids = self._resident_on.get(instance_id)
        if not ids:
            return []
        legs, contexts, entries, hits = (
            self._resident,
            self._resident_context,
            self._entries,
            self._resident_cached,
        )
        out = []
        for r in ids:
            context = contexts[r]
            out.append(
                (context, max(legs[r][1] - context, 0), (r, instance_id) not in entries, hits.get(r, 0))
            )
        return out

    def resident_progress(self, instance_id: str) -> list[tuple[str, int, bool]]:
        """The resident legs of one instance as (request id, context now, started), in recording order.

        Own legs only (a peer process re-estimates its own). Costs O(legs on the instance).
        """
        ids = self._resident_on.get(instance_id)
        if not ids:
            return []
        contexts, entries = self._resident_context, self._entries
        return [(r, contexts[r], (r, instance_id) not in entries) for r in ids]

    def resident_count(self) -> int:
        """How many resident decode legs this account holds (its own)."""
        return len(self._resident)

    def resident_instances(self) -> list[str]:
        """The instances this account holds resident decode legs on (its own)."""
        return list(self._resident_on)

    def is_resident(self, request_id: str) -> bool:
        """Whether ``request_id`` has a resident decode leg here."""
        return request_id in self._resident

    def set_resident_finals(self, instance_id: str, finals: Mapping[str, int]) -> bool:
        """Replace the final tokens of resident legs on ``instance_id`` (request id -> final tokens).

        What a leg is expected to reach changes as it streams: the router re-estimates it from the
        tokens it has forwarded (:meth:`router.placement.Placer.refresh_residents`), as the
        simulator does on each status push. Legs not resident on that instance are ignored; the
        resident columns of the instance change once, and only when their sum does. Returns
        whether it did.
        """
        for request_id, final in finals.items():
            if final < 0:
                raise ValueError(f"final tokens of {request_id!r} must be >= 0, got {final}")
        legs = self._resident
        delta = 0
        for request_id, final in finals.items():
            found = legs.get(request_id)
            if found is None or found[0] != instance_id or found[1] == final:
                continue
            delta += final - found[1]
            legs[request_id] = (instance_id, final, found[2])
        if delta == 0:
            return False
        self._resident_totals[instance_id][1] += delta
        self._touch(instance_id, INFLIGHT_RESIDENT_TOKENS)
        return True

    # ------------------------------------------------------------------ queries

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_request

    def __len__(self) -> int:
        """Number of requests with at least one entry."""
        return len(self._by_request)

    def is_empty(self) -> bool:
        return not self._entries

    def entries(self, request_id: str | None = None) -> tuple[InflightEntry, ...]:
        """Every entry (of one request, or of all), in recording order."""
        if request_id is None:
            return tuple(self._entries.values())
        return tuple(self._by_request.get(request_id, {}).values())

    def totals(self, instance_id: str) -> InflightTotals:
        """The in-flight sums of one instance (zeros when it has none), peer processes' included."""
        if instance_id in self._peers:
            return InflightTotals(*self.totals_row(instance_id)[:6])
        found = self._totals.get(instance_id)
        return found.frozen() if found is not None else InflightTotals()

    def columns(self, index: Mapping[str, int], n: int) -> InflightColumns:
        """The sums as columns over a view whose instance ``i`` is ``index[id] == i``.

        Costs O(instances with entries); instances not in ``index`` are skipped.
        """
        cols = np.zeros((INFLIGHT_ROWS, n))
        for instance_id in self._totals.keys() | self._resident_totals.keys() | self._peers.keys():
            i = index.get(instance_id)
            if i is not None:
                cols[:, i] = self.totals_row(instance_id)
        return InflightColumns.of(cols)

    # ------------------------------------------------------------------ mutations

    def record(
        self,
        request_id: str,
        prefill_instance: str | None,
        decode_instance: str | None,
        prompt_tokens: int,
        now_s: float,
        final_tokens: int = 0,
        cached_prefill_tokens: int = 0,
        tpot_need_ms: float = 0.0,
        tpot_paced: bool = False,
        paced_tokens: float = math.nan,
    ) -> None:
        """Account a dispatch: a prefill leg on ``prefill_instance`` and a decode leg on ``decode_instance``.

        ``final_tokens`` (> 0) makes the decode leg resident on its instance
        until the request ends: the tokens its KV reaches at the end (context +
        expected output still to come); 0 = unknown (not resident).
        ``tpot_need_ms`` (> 0) is the TPOT that resident leg must keep on its
        instance (packing holds later placements there to it); 0 = unknown.
        ``tpot_paced`` says that need is the pace an e2e deadline needs, not a TPOT target, and
        ``paced_tokens`` is then the output length that pace spreads the deadline over (nan: unknown).
        ``cached_prefill_tokens`` of the prompt are expected in the prefill
        instance's prefix cache: its prefill leg counts only the rest.

        Neutral mode passes the same instance twice (one entry with both legs);
        a decode-only re-placement passes ``prefill_instance=None``. Recording
        a leg that already exists does nothing; recording on an instance whose
        last reconciled status already lists the request does nothing either.
        """
        if prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
        if final_tokens < 0:
            raise ValueError(f"final_tokens must be >= 0, got {final_tokens}")
        if not tpot_need_ms >= 0:
            raise ValueError(f"tpot_need_ms must be >= 0 (0 = unknown), got {tpot_need_ms}")
        if decode_instance is not None and final_tokens > 0:
            self._add_resident(request_id, decode_instance, final_tokens, now_s, prompt_tokens)
            if tpot_need_ms > 0 and request_id in self._resident:
                self._resident_need[request_id] = tpot_need_ms
                if tpot_paced:
                    self._resident_paced.add(request_id)
                    if paced_tokens > 0:
                        self._resident_paced_tokens[request_id] = paced_tokens
        cached = min(max(cached_prefill_tokens, 0), prompt_tokens)
        if cached > 0 and prefill_instance == decode_instance and request_id in self._resident:
            # The leg decodes where its prompt found those tokens cached: held once, however many share them.
            self._resident_cached[request_id] = cached
        if prefill_instance is not None and prefill_instance == decode_instance:
            self._add(request_id, prefill_instance, True, True, prompt_tokens, now_s, cached)
            return
        if prefill_instance is not None:
            self._add(request_id, prefill_instance, True, False, prompt_tokens, now_s, cached)
        if decode_instance is not None:
            self._add(request_id, decode_instance, False, True, prompt_tokens, now_s)

    def _add(
        self,
        request_id: str,
        instance_id: str,
        prefill: bool,
        decode: bool,
        tokens: int,
        now_s: float,
        cached: int = 0,
    ) -> None:
        if self._reported(request_id, instance_id):
            return
        key = (request_id, instance_id)
        old = self._entries.get(key)
        if old is not None:
            add_prefill = prefill and not old.prefill
            add_decode = decode and not old.decode
            if not (add_prefill or add_decode):
                return
            # A second leg on the same instance keeps the entry's tokens and time.
            entry = InflightEntry(
                request_id,
                instance_id,
                old.prefill or prefill,
                old.decode or decode,
                old.prompt_tokens,
                old.recorded_at_s,
                old.cached_tokens,
            )
            self._entries[key] = entry
            self._by_request[request_id][instance_id] = entry
            self._by_instance[instance_id][request_id] = entry
            self._totals[instance_id].add(entry, +1, new_entry=False, prefill=add_prefill, decode=add_decode)
            self._touch(instance_id, _columns_of(False, add_prefill, add_decode))
        else:
            entry = InflightEntry(request_id, instance_id, prefill, decode, tokens, now_s, cached)
            self._entries[key] = entry
            self._by_request.setdefault(request_id, {})[instance_id] = entry
            self._by_instance.setdefault(instance_id, {})[request_id] = entry
            self._totals.setdefault(instance_id, _Totals()).add(
                entry, +1, new_entry=True, prefill=prefill, decode=decode
            )
            self._touch(instance_id, _columns_of(True, prefill, decode))

    def _add_resident(
        self, request_id: str, instance_id: str, final_tokens: int, now_s: float, context_tokens: int
    ) -> None:
        old = self._resident.get(request_id)
        if old is not None:
            if old[0] == instance_id:
                return  # idempotent: the same leg recorded twice
            self._drop_resident(request_id)
        self._resident[request_id] = (instance_id, final_tokens, now_s)
        self._resident_context[request_id] = context_tokens
        self._resident_prompt[request_id] = context_tokens
        self._resident_on.setdefault(instance_id, {})[request_id] = None
        totals = self._resident_totals.setdefault(instance_id, [0, 0])
        totals[0] += 1
        totals[1] += final_tokens
        self._touch(instance_id, _RESIDENT)

    def _drop_resident(self, request_id: str) -> bool:
        found = self._resident.pop(request_id, None)
        if found is None:
            return False
        self._resident_context.pop(request_id, None)
        self._resident_prompt.pop(request_id, None)
        self._resident_need.pop(request_id, None)
        self._resident_paced.discard(request_id)
        self._resident_paced_tokens.pop(request_id, None)
        self._resident_first.pop(request_id, None)
        self._resident_cached.pop(request_id, None)
        instance_id, final_tokens, _ = found
        on = self._resident_on[instance_id]
        del on[request_id]
        if not on:
            del self._resident_on[instance_id]
        totals = self._resident_totals[instance_id]
        totals[0] -= 1
        totals[1] -= final_tokens
        if totals[0] <= 0:
            del self._resident_totals[instance_id]
        self._touch(instance_id, _RESIDENT)
        return True

    def confirm(self, request_id: str, instance_id: str, at_ms: int) -> None:
        """The instance was seen running the request at epoch ms ``at_ms`` (its first output arrived).

        For engines whose status lists no admitted request ids (a stock vLLM behind
        ``slo-router agent``): the entry then leaves at the first reconciled status of that
        instance measured at or after ``at_ms``, which counts the request itself. Without it the
        entry would stay until the request ends or expires, counted twice meanwhile. Confirming an
        entry that does not exist, or twice, changes nothing.
        """
        key = (request_id, instance_id)
        if key not in self._entries or key in self._confirmed:
            return
        self._confirmed[key] = at_ms
        self._confirmed_on[instance_id] = self._confirmed_on.get(instance_id, 0) + 1

    def _remove(self, entry: InflightEntry) -> None:
        key = (entry.request_id, entry.instance_id)
        if self._entries.pop(key, None) is None:
            return
        if self._confirmed.pop(key, None) is not None:
            left = self._confirmed_on[entry.instance_id] - 1
            if left:
                self._confirmed_on[entry.instance_id] = left
            else:
                del self._confirmed_on[entry.instance_id]
        by_request = self._by_request[entry.request_id]
        del by_request[entry.instance_id]
        if not by_request:
            del self._by_request[entry.request_id]
        by_instance = self._by_instance[entry.instance_id]
        del by_instance[entry.request_id]
        totals = self._totals[entry.instance_id]
        totals.add(entry, -1, new_entry=True, prefill=entry.prefill, decode=entry.decode)
        if not by_instance:
            del self._by_instance[entry.instance_id]
            del self._totals[entry.instance_id]
        self._touch(entry.instance_id, _columns_of(True, entry.prefill, entry.decode))

    def release(self, request_id: str, instance_id: str | None = None) -> int:
        """The request ended (or one of its instances is abandoned): drop its entries.

        Returns how many entries were removed (0 when there were none: releasing twice is harmless).
        """
        resident = self._resident.get(request_id)
        if resident is not None and (instance_id is None or resident[0] == instance_id):
            self._drop_resident(request_id)
        entries = self._by_request.get(request_id)
        if not entries:
            return 0
        targets = (
            list(entries.values())
            if instance_id is None
            else [e for e in entries.values() if e.instance_id == instance_id]
        )
        for entry in targets:
            self._remove(entry)
        return len(targets)

    def expire(self, now_s: float) -> int:
        """Drop entries at least ``expiry_s`` old; returns how many.

        Entries are checked in recording order and the walk stops at the first
        young one, so a clock that goes backwards delays expiry but never
        loses an entry early.
        """
        removed = 0
        resident_deadline = now_s - self.resident_expiry_s
        while self._resident:
            request_id, (_, _, recorded_at_s) = next(iter(self._resident.items()))
            if recorded_at_s > resident_deadline:
                break
            self._drop_resident(request_id)
        deadline = now_s - self.expiry_s
        while self._entries:
            entry = next(iter(self._entries.values()))
            if entry.recorded_at_s > deadline:
                break
            self._remove(entry)
            removed += 1
        return removed

    def reconcile(self, snapshot: ClusterSnapshot, positions: Mapping[str, int] | None = None) -> int:
        """Drop every entry whose instance's status lists its request as admitted, or was measured
        after the entry was confirmed (:meth:`confirm`); returns how many.

        Costs O(instances with entries) when ``positions`` (instance id → index
        in ``snapshot.instances``, e.g. a view's ``InstanceTable.index``) is
        given, else one pass over the snapshot to build it. Also remembers the
        snapshot, so a leg recorded later on an instance that already reports
        the request is not counted twice.
        """
        self._snapshot = snapshot
        self._positions = positions
        removed = 0
        for instance_id in list(self._by_instance):
            record = self._record(instance_id)
            if record is None or record.status is None:
                continue
            if instance_id in self._confirmed_on:
                measured_ms = record.status.timestamp_ms
                for request_id, entry in list(self._by_instance[instance_id].items()):
                    at_ms = self._confirmed.get((request_id, instance_id))
                    if at_ms is not None and measured_ms >= at_ms:
                        self._remove(entry)
                        removed += 1
                if instance_id not in self._by_instance:
                    continue
            admitted = record.status.admitted_request_ids
            if not admitted:
                continue
            by_instance = self._by_instance[instance_id]
            ids = set(admitted) if len(admitted) > 8 else admitted
            for request_id in [r for r in by_instance if r in ids]:
                self._remove(by_instance[request_id])
                removed += 1
        return removed

    def _record(self, instance_id: str) -> InstanceRecord | None:
        snapshot = self._snapshot
        if snapshot is None:
            return None
        if self._positions is None:
            self._positions = {r.instance_id: i for i, r in enumerate(snapshot.instances)}
        i = self._positions.get(instance_id)
        return snapshot.instances[i] if i is not None else None

    def _reported(self, request_id: str, instance_id: str) -> bool:
        record = self._record(instance_id)
        return (
            record is not None
            and record.status is not None
            and request_id in record.status.admitted_request_ids
        )
