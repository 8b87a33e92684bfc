"""Every error the router's scheduling core raises, in one small tree.

::

    RouterError                       root; catch this to catch them all
    ├── ConfigError (ValueError)      a config value, flag or policy file is wrong: fix it and restart
    │   ├── UnknownPluginError        a metric/filter/selector/policy name is not registered
    │   └── PolicyFileError           a ``--policy-config`` YAML file cannot be used
    ├── DuplicatePluginError          two plugins registered under one name (a programming error)
    ├── IllegalTransitionError        a request's phase asked to make a move the lifecycle forbids
    │                                 (a programming error; :mod:`router.core.lifecycle`)
    ├── InvalidRequestError (ValueError)  a request is malformed: the client must fix it
    ├── DuplicateRequestError         a request id that is already in flight
    ├── RetriesExhaustedError         every attempt on a worker failed
    ├── ShuttingDownError             the router is draining (SIGTERM): retry on another replica
    └── SchedulingError               no placement for this request, now
        ├── EmptyClusterError         no instance at all, or none usable (all without status, stale
        │                             or unschedulable): the fleet or the CMS is down
        ├── NoInstanceError           usable instances exist but none passed a stage's filters
        │                             (typically: none is predicted to meet the SLO)
        ├── QueueFullError            the router queue is full and this request was the least valuable
        ├── QueueTimeoutError         a request waited in the router queue past ``--max-queue-wait-ms``
        ├── UnmeetableError           a target below the idle-instance best case (refused at arrival)
        └── LateError                 a queued request can no longer meet its TTFT target
                                      (``--late-policy reject``)

The gRPC service maps them in one place; the intended codes are
``InvalidRequestError`` → ``INVALID_ARGUMENT``, ``DuplicateRequestError`` →
``ALREADY_EXISTS``, ``NoInstanceError``, ``QueueFullError``, ``QueueTimeoutError`` and ``UnmeetableError`` →
``RESOURCE_EXHAUSTED``, ``LateError`` → ``DEADLINE_EXCEEDED``,
``EmptyClusterError`` and ``RetriesExhaustedError`` → ``UNAVAILABLE``
(``ConfigError`` never reaches a request: it is raised at start-up). Every
message says what to fix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any


class RouterError(Exception):
    """Root of every error raised by the router's scheduling core."""


class ConfigError(RouterError, ValueError):
    """A configuration value, flag or policy file is invalid; the message names the field."""


class UnknownPluginError(ConfigError):
    """A metric, filter, selector or policy name that is not registered."""


class PolicyFileError(ConfigError):
    """A ``--policy-config`` YAML file cannot be loaded; the message names the file and the entry."""


def status_name(exc: RouterError) -> str:
    """The gRPC status code (its name) a router error is answered with: the one mapping.

    The router's service answers with ``grpc.StatusCode[status_name(exc)]``; the simulator
    records the same name as a request's error code.
    """
    if isinstance(exc, InvalidRequestError):
        return "INVALID_ARGUMENT"
    if isinstance(exc, DuplicateRequestError):
        return "ALREADY_EXISTS"
    if isinstance(exc, (NoInstanceError, QueueFullError, QueueTimeoutError, UnmeetableError)):
        return "RESOURCE_EXHAUSTED"
    if isinstance(exc, LateError):
        return "DEADLINE_EXCEEDED"
    if isinstance(exc, (EmptyClusterError, RetriesExhaustedError, ShuttingDownError)):
        return "UNAVAILABLE"
    return "INTERNAL"


class DuplicatePluginError(RouterError):
    """Two plugins of one kind were registered under the same name."""


class IllegalTransitionError(RouterError):
    """A request's phase was asked to make a move :data:`router.core.lifecycle.TRANSITIONS` forbids."""


class InvalidRequestError(RouterError, ValueError):
    """A request is malformed (missing prompt, bad SLO values, ...); the message names the field."""


class DuplicateRequestError(RouterError):
    """A request id that is already in flight at this router."""


class RetriesExhaustedError(RouterError):
    """Every attempt to run a request on a worker failed; the message lists the attempts."""


class SchedulingError(RouterError):
    """No placement could be made for a request."""


class EmptyClusterError(SchedulingError):
    """The view has no instance for the request, or none that is usable at all.

    ``instances`` counts the instances considered (after the model match);
    ``usable`` is how many had a fresh status and were schedulable (0 unless the
    error is about a missing role).
    """

    def __init__(self, message: str, *, instances: int = 0, usable: int = 0) -> None:
        super().__init__(message)
        self.instances = instances
        self.usable = usable


@dataclass(frozen=True)
class ThresholdMiss:
    """The best value a threshold filter saw among otherwise eligible candidates.

    ``best`` is NaN when no candidate reached that filter (all were dropped for
    other reasons).
    """

    filter: str
    metric: str
    best: float
    limit: float


class NoInstanceError(SchedulingError):
    """No candidate of ``stage`` survived its filters, even after the fallback pass.

    Attributes: ``stage`` (``"prefill"``, ``"decode"`` or ``"neutral"``),
    ``candidates`` (instances of the stage's role), ``drops`` (filter label →
    candidates that filter dropped first, in chain order, with every filter
    applied), ``misses`` (per threshold filter: the best value against its
    limit) and ``healthy_candidates`` (candidates dropped only by threshold
    filters, i.e. capacity exists but cannot meet the target).

    ``message`` and ``drops`` may be given as functions that build them, and
    the misses as ``lazy_misses`` (the number of threshold filters and a
    function giving the miss of the k-th): they run the first time they are read
    (``str(error)``, ``error.args``, ``error.drops``, ``error.misses``;
    :meth:`iter_misses` builds them one at a time). The router queue's
    decisions that leave their request waiting raise this error thousands of
    times a minute and read only the first miss of one metric; the text, the
    drop counts and the other misses are for the errors that reach a client.
    ``failure`` keeps the failed stage for the router queue (see the attribute).
    """

    def __init__(
        self,
        message: str | Callable[[], str],
        *,
        stage: str,
        candidates: int,
        drops: Mapping[str, int] | Callable[[], Mapping[str, int]],
        misses: tuple[ThresholdMiss, ...] = (),
        healthy_candidates: int = 0,
        lazy_misses: tuple[int, Callable[[int], ThresholdMiss]] | None = None,
        failure: Any = None,
    ) -> None:
        if callable(message):
            super().__init__()
            self._message: Callable[[], str] | None = message
        else:
            super().__init__(message)
            self._message = None
        self.stage = stage
        self.candidates = candidates
        self._drops: dict[str, int] | None = None
        self._make_drops: Callable[[], Mapping[str, int]] | None = None
        if callable(drops):
            self._make_drops = drops
        else:
            self._drops = dict(drops)
        self._misses = list(misses)
        self._miss_count = len(misses)
        self._make_miss: Callable[[int], ThresholdMiss] | None = None
        if lazy_misses is not None:
            self._miss_count, self._make_miss = lazy_misses
            self._misses = []
        self.healthy_candidates = healthy_candidates
        #: The failed stage as the chain left it (:class:`router.core.chain.StageFailure`: its
        #: outcome's masks and the candidates only thresholds dropped), or None. The router queue
        #: reads it to judge a held refusal's lateness as the decision would; it is not pickled.
        self.failure = failure

    def iter_misses(self) -> Iterator[ThresholdMiss]:
        """The misses in filter order, each built only when the iteration reaches it."""
        k = 0
        while k < self._miss_count:
            if k == len(self._misses):
                make = self._make_miss
                assert make is not None
                self._misses.append(make(k))
            yield self._misses[k]
            k += 1

    @property
    def misses(self) -> tuple[ThresholdMiss, ...]:
        """Per threshold filter, in order: the best value against its limit."""
        if len(self._misses) < self._miss_count:
            for _ in self.iter_misses():
                pass
        return tuple(self._misses)

    def _render(self) -> None:
        make = self._message
        if make is not None:
            self._message = None
            BaseException.args.__set__(self, (make(),))  # type: ignore[attr-defined]

    @property
    def args(self) -> tuple[object, ...]:
        self._render()
        return BaseException.args.__get__(self)  # type: ignore[attr-defined,no-any-return]

    @args.setter
    def args(self, value: tuple[object, ...]) -> None:
        self._message = None
        BaseException.args.__set__(self, value)  # type: ignore[attr-defined]

    def __str__(self) -> str:
        self._render()
        return super().__str__()

    def __repr__(self) -> str:
        self._render()
        return super().__repr__()

    def __reduce__(self) -> tuple[object, ...]:
        self._render()
        return (
            _rebuild_no_instance,
            (str(self), self.stage, self.candidates, self.drops, self.misses, self.healthy_candidates),
        )

    @property
    def drops(self) -> dict[str, int]:
        found = self._drops
        if found is None:
            make = self._make_drops
            assert make is not None
            self._make_drops = None
            found = self._drops = dict(make())
        return found


def _rebuild_no_instance(
    message: str,
    stage: str,
    candidates: int,
    drops: Mapping[str, int],
    misses: tuple[ThresholdMiss, ...],
    healthy_candidates: int,
) -> NoInstanceError:
    return NoInstanceError(
        message,
        stage=stage,
        candidates=candidates,
        drops=drops,
        misses=misses,
        healthy_candidates=healthy_candidates,
    )


class QueueFullError(SchedulingError):
    """The router queue is full and this request was the least valuable one: it was shed."""


class ShuttingDownError(RouterError):
    """The router is shutting down (SIGTERM): a request not yet running, or one still running at the
    end of ``--drain-timeout-s``. Retryable: another router replica takes it."""


class UnmeetableError(SchedulingError):
    """A target below the best prediction for the request on an idle instance: refused at arrival."""


class QueueTimeoutError(SchedulingError):
    """A request waited in the router queue longer than ``max_queue_wait_ms``."""


class ShedError(QueueFullError):
    """Shed by the router queue's objective (``queue_objective`` ``g``): the fleet is short and this
    request is among the longest to serve."""


class LateError(SchedulingError):
    """A queued request can no longer meet its TTFT target and ``late_policy`` is ``reject``."""
