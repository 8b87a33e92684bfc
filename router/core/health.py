"""Passive outlier detection: instances the router stops using on evidence from its own calls.

The CMS view says what the workers report about themselves; this module
records what the router *observes*: calls that failed to connect, produced
no first message in time, or broke. It is the router's only reason to stop
using an instance that the view still shows as healthy, and the only one left
when the CMS is unreachable (the router then keeps routing on its last view,
see ``ClusterSnapshot.source_lost_at_s``).

The mechanism follows Envoy's outlier detection, reduced to what one router
process needs:

* **ejection** — ``consecutive_failures`` failed calls in a row eject an
  instance for ``base_ejection_s × 2^(n-1)`` (capped at ``max_ejection_s``),
  ``n`` being how many times it was ejected without recovering since;
* **probation** — when the ejection time is over the instance takes traffic
  again, but its next call decides: a failure ejects it again at once with
  the doubled time, a success ends the probation and takes one doubling
  back (``n`` goes down by one), so a flapping instance is ejected for
  longer and longer while one that recovers is soon back to the base time
  (and all the way back once it has had no failure for ``max_ejection_s``);
* **panic** — ejection only narrows the choice: the placement falls back to
  the ejected instances when nothing else can take a request (Envoy's panic
  threshold), so evidence never turns a degraded fleet into an empty one.

Pure and synchronous: the clock is a parameter of every call, so the same
state runs in the router (monotonic seconds) and in tests with a fake clock.
Not thread-safe: the router calls it from its event loop only.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, fields

logger = logging.getLogger(__name__)


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@dataclass(frozen=True)
class OutlierConfig:
    """When a failing instance is ejected and for how long."""

    consecutive_failures: int = field(
        default=1, metadata=_doc("failed calls in a row that eject an instance (1: the first failure)")
    )
    base_ejection_s: float = field(default=2.0, metadata=_doc("ejection time after a first failure, seconds"))
    max_ejection_s: float = field(
        default=60.0, metadata=_doc("longest ejection of an instance that keeps failing, seconds")
    )
    max_tracked: int = field(
        default=65536, metadata=_doc("instances with failure state kept at most (oldest forgotten first)")
    )

    def __post_init__(self) -> None:
        if self.consecutive_failures < 1:
            raise ValueError(f"consecutive_failures must be >= 1, got {self.consecutive_failures}")
        for name in ("base_ejection_s", "max_ejection_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.max_ejection_s < self.base_ejection_s:
            raise ValueError(
                f"max_ejection_s ({self.max_ejection_s}) must be >= base_ejection_s ({self.base_ejection_s})"
            )
        if self.max_tracked < 1:
            raise ValueError(f"max_tracked must be >= 1, got {self.max_tracked}")

    @staticmethod
    def field_docs() -> dict[str, str]:
        return {f.name: f.metadata.get("doc", "") for f in fields(OutlierConfig)}


@dataclass
class _State:
    """The failure record of one instance."""

    consecutive: int = 0
    #: Ejections without a recovery since (the exponent of the ejection time).
    ejections: int = 0
    #: Monotonic time the current ejection ends (-inf: not ejected).
    ejected_until: float = -math.inf
    #: Ejected before and not yet proven healthy by a success.
    probation: bool = False
    reason: str = ""


class OutlierDetector:
    """Ejection state of every instance the router has seen fail; see the module docstring."""

    def __init__(self, config: OutlierConfig | None = None) -> None:
        self.config = config or OutlierConfig()
        self._states: dict[str, _State] = {}
        self._ejected: frozenset[str] = frozenset()
        #: The earliest end of a current ejection: until then ``_ejected`` is exact.
        self._next_change = math.inf
        #: Ejections so far (for metrics and tests).
        self.ejections_total = 0

    def ejected(self, now_s: float) -> frozenset[str]:
        """The instances not to place new work on at ``now_s`` (cheap: cached until one returns)."""
        if now_s >= self._next_change:
            self._refresh(now_s)
        return self._ejected

    def is_ejected(self, instance_id: str, now_s: float) -> bool:
        return instance_id in self.ejected(now_s)

    def in_probation(self, instance_id: str) -> bool:
        state = self._states.get(instance_id)
        return state is not None and state.probation

    def failure(self, instance_id: str, now_s: float, reason: str) -> bool:
        """A call to ``instance_id`` failed in a way that says the instance is unwell.

        Returns whether this failure ejected it. A failure of a call that was
        placed before the instance's ejection (already ejected) only counts
        once: it does not extend the ejection.
        """
        state = self._states.get(instance_id)
        if state is None:
            state = self._states[instance_id] = _State()
            self._trim()
        if state.ejected_until > now_s:
            return False
        if state.ejections and now_s - state.ejected_until >= self.config.max_ejection_s:
            state.ejections = 0  # healthy for the longest ejection time: a fresh start
            state.probation = False
        state.consecutive += 1
        state.reason = reason
        if not (state.probation or state.consecutive >= self.config.consecutive_failures):
            return False
        state.ejections += 1
        duration = min(self.config.base_ejection_s * 2.0 ** (state.ejections - 1), self.config.max_ejection_s)
        state.ejected_until = now_s + duration
        state.consecutive = 0
        state.probation = True
        self.ejections_total += 1
        self._refresh(now_s)
        logger.warning(
            "instance %s ejected for %.1f s after a failed call (%s); ejection %d in a row",
            instance_id,
            duration,
            reason,
            state.ejections,
        )
        return True

    def success(self, instance_id: str, now_s: float) -> None:
        """A call to ``instance_id`` produced what was asked (its first message, or its end)."""
        state = self._states.get(instance_id)
        if state is None:
            return
        state.consecutive = 0
        if state.ejected_until > now_s:
            return  # a call placed before the ejection; the probation decides
        if state.probation:
            state.probation = False
            state.ejections = max(0, state.ejections - 1)
            logger.info("instance %s answered again; out of probation", instance_id)
        if state.ejections == 0:
            del self._states[instance_id]

    def forget(self, instance_id: str) -> None:
        """Drop an instance's record (it left the fleet)."""
        if self._states.pop(instance_id, None) is not None and instance_id in self._ejected:
            self._ejected = self._ejected - {instance_id}

    def reason(self, instance_id: str) -> str:
        state = self._states.get(instance_id)
        return state.reason if state is not None else ""

    def __len__(self) -> int:
        return len(self._states)

    def _refresh(self, now_s: float) -> None:
        ejected = []
        next_change = math.inf
        for instance_id, state in self._states.items():
            if state.ejected_until > now_s:
                ejected.append(instance_id)
                next_change = min(next_change, state.ejected_until)
        self._ejected = frozenset(ejected)
        self._next_change = next_change

    def _trim(self) -> None:
        # Bounded memory whatever the fleet does: forget the oldest records (dicts keep insertion order).
        while len(self._states) > self.config.max_tracked:
            oldest = next(iter(self._states))
            self.forget(oldest)
