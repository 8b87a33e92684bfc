"""The request as the scheduling core sees it, and the enums that name roles, stages and modes.

:class:`ScheduleInput` is what the router shell (or the simulator) hands the
scheduler for one request. Imports nothing but :mod:`router.core.errors`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from router.core.errors import InvalidRequestError


class Role(enum.IntEnum):
    """An instance's registered role (values match ``slorouter.v1.InstanceRole``)."""

    NEUTRAL = 1
    PREFILL = 2
    DECODE = 3


class Stage(str, enum.Enum):
    """One placement step of a decision."""

    PREFILL = "prefill"
    DECODE = "decode"
    NEUTRAL = "neutral"


class Mode(str, enum.Enum):
    """``pd``: prefill and decode placed separately; ``neutral``: one instance does both."""

    PD = "pd"
    NEUTRAL = "neutral"


class StageRestriction(str, enum.Enum):
    """Which PD stages a request needs placed (ignored in neutral mode, where one stage does both).

    ``DECODE`` is a decode-only re-placement (the prefill already ran);
    ``PREFILL`` places only the prefill.
    """

    ALL = "all"
    PREFILL = "prefill"
    DECODE = "decode"


# --------------------------------------------------------------------------- request and decision

_INF = float("inf")
_set_attr = object.__setattr__


@dataclass(frozen=True)
class ScheduleInput:
    """What the scheduler needs to know about one request.

    SLO fields are the request's own targets; 0 means "use the router's
    default" (``SchedulerConfig.ttft_slo_ms`` / ``tpot_slo_ms``), except
    ``e2e_slo_ms`` where 0 means "no end-to-end target". A request with only an
    e2e target gets TTFT and TPOT targets derived from it
    (:func:`router.core.queue.resolve_targets`). Token counts use 0 for
    "unknown". ``arrival_s`` (the caller's clock, same as ``now_s``) makes the
    TTFT target the *remaining* budget at decision time; ``None`` schedules
    against the whole target (as if the request had just arrived).
    """

    request_id: str
    prompt_tokens: int
    ttft_slo_ms: float = 0.0
    tpot_slo_ms: float = 0.0
    #: Only instances serving this model (or advertising none) are candidates; "" = any.
    model: str = ""
    #: Instances a retry must avoid (they failed this request already).
    exclude_instance_ids: frozenset[str] = frozenset()
    stages: StageRestriction = StageRestriction.ALL
    #: End-to-end target (ms); 0 = none. Packing derives a TPOT target from it for a request
    #: that sets no TPOT target of its own (:func:`router.core.packing.packing_tpot_target_ms`).
    e2e_slo_ms: float = 0.0
    #: Expected output length in tokens (a class statistic or a length predictor); 0 = unknown.
    expected_output_tokens: int = 0
    #: The request's own output limit in tokens; 0 = unknown.
    max_tokens: int = 0
    #: Higher is more important (``GenerateRequest.priority``).
    priority: int = 0
    #: The request's class label (``GenerateRequest.slo_class``); "" = none.
    slo_class: str = ""
    #: When the request reached the router (s, the scheduler's clock); None = unknown.
    arrival_s: float | None = None
    #: Chained hashes of the prompt's full prefix-cache blocks (:mod:`fleet.prefix`), hashed the way
    #: the scheduler's prefix source holds them; empty = the prompt is charged in full everywhere.
    prefix_hashes: tuple[int, ...] = ()
    #: A cautious bound on the output (the length predictor's high quantile, at least the expected
    #: length); 0 = unknown. Packing paces a request judged only end to end by it, so that the
    #: answers longer than the mean still finish in time (:func:`router.core.packing.packing_tpot_target_ms`).
    output_tokens_bound: int = 0
    #: True when ``expected_output_tokens`` is only the length predictor's prior (the request's
    #: ``max_tokens`` or a default, nothing learned of its class yet): a guess to plan with, never
    #: grounds to refuse the request as hopeless (:mod:`router.core.arrival`).
    output_tokens_prior: bool = False
    #: True when ``expected_output_tokens`` was learned from every class's answers together (the
    #: request's own class has too few yet): an estimate, but not of this request's kind, so a
    #: per-class profile that knows the class better wins over it (:class:`router.core.sa.TaskLengths`).
    output_tokens_pooled: bool = False
    #: For a request judged by its e2e deadline alone: the length predictor's cautious bound with
    #: the class's running answers counted as lower bounds
    #: (:meth:`router.core.lengths.LengthPredictor.censored_bound`); 0 = not asked. ``binpack``
    #: paces the deadline by it where it exceeds ``output_tokens_bound``.
    output_tokens_bound_censored: int = 0

    def __init__(
        self,
        request_id: str,
        prompt_tokens: int,
        ttft_slo_ms: float = 0.0,
        tpot_slo_ms: float = 0.0,
        model: str = "",
        exclude_instance_ids: frozenset[str] = frozenset(),
        stages: StageRestriction = StageRestriction.ALL,
        e2e_slo_ms: float = 0.0,
        expected_output_tokens: int = 0,
        max_tokens: int = 0,
        priority: int = 0,
        slo_class: str = "",
        arrival_s: float | None = None,
        prefix_hashes: tuple[int, ...] = (),
        output_tokens_bound: int = 0,
        output_tokens_prior: bool = False,
        output_tokens_pooled: bool = False,
        output_tokens_bound_censored: int = 0,
    ) -> None:
        # Written out (the dataclass keeps it): one dict instead of 13 frozen attribute sets, for an
        # object built once per decision. The fields and defaults are the dataclass's (tested).
        _set_attr(
            self,
            "__dict__",
            {
                "request_id": request_id,
                "prompt_tokens": prompt_tokens,
                "ttft_slo_ms": ttft_slo_ms,
                "tpot_slo_ms": tpot_slo_ms,
                "model": model,
                "exclude_instance_ids": exclude_instance_ids,
                "stages": stages,
                "e2e_slo_ms": e2e_slo_ms,
                "expected_output_tokens": expected_output_tokens,
                "max_tokens": max_tokens,
                "priority": priority,
                "slo_class": slo_class,
                "arrival_s": arrival_s,
                "prefix_hashes": prefix_hashes,
                "output_tokens_bound": output_tokens_bound,
                "output_tokens_prior": output_tokens_prior,
                "output_tokens_pooled": output_tokens_pooled,
                "output_tokens_bound_censored": output_tokens_bound_censored,
            },
        )
        self.__post_init__()

    def __post_init__(self) -> None:
        # One comparison per field when all is well (built once per decision); the loops name the culprit.
        if self.prompt_tokens < 0:
            raise InvalidRequestError(f"prompt_tokens must be >= 0, got {self.prompt_tokens}")
        if self.expected_output_tokens < 0 or self.max_tokens < 0 or self.output_tokens_bound < 0:
            for count in ("expected_output_tokens", "max_tokens", "output_tokens_bound"):
                if getattr(self, count) < 0:
                    raise InvalidRequestError(
                        f"{count} must be >= 0 (0 = unknown), got {getattr(self, count)}"
                    )
        if not (
            0 <= self.ttft_slo_ms < _INF and 0 <= self.tpot_slo_ms < _INF and 0 <= self.e2e_slo_ms < _INF
        ):
            for name in ("ttft_slo_ms", "tpot_slo_ms", "e2e_slo_ms"):
                value = getattr(self, name)
                if not (value >= 0 and value != _INF):
                    raise InvalidRequestError(
                        f"{name} must be finite and >= 0 (0 = router default), got {value}"
                    )

    @property
    def output_tokens_guessed(self) -> bool:
        """Whether ``expected_output_tokens`` says nothing of this request's own class: a prior (its cap or
        a default) or an estimate pooled over every class. No grounds to refuse the request as unable
        to finish in time: refused, a class's requests never finish, so its own lengths are never
        learned (a rare class of 15-token alerts due in 2 s, costed at every class's 128-token mean,
        was refused at arrival 38 times of 42)."""
        return self.output_tokens_prior or self.output_tokens_pooled

    @property
    def e2e_only(self) -> bool:
        """Whether the request is judged on its end-to-end latency alone (no TTFT or TPOT target of its own)."""
        return self.e2e_slo_ms > 0 and self.ttft_slo_ms == 0 and self.tpot_slo_ms == 0

    @property
    def output_tokens_estimate(self) -> int:
        """Expected generated tokens: ``expected_output_tokens``, else ``max_tokens``, else 0."""
        return self.expected_output_tokens or self.max_tokens


# --------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class Targets:
    """A request's targets in force (ms): TTFT (the remaining budget when ``arrival_s`` is known), TPOT, e2e (0 = none)."""

    ttft_ms: float
    tpot_ms: float
    e2e_ms: float
    #: The whole TTFT target, before subtracting the time already spent (ms).
    full_ttft_ms: float
    #: The router queue offers the request without the margin ``binpack`` holds for it: judged by its
    #: e2e deadline alone, without its own deadline's pace (it has waited its hold and no TPOT-judged
    #: request waits); judged by a TTFT target, without θ's share of the TPOT needs and of the
    #: residents' slack (it can wait no longer than its hold)
    #: (:meth:`router.core.queue.RouterQueue.margin_waived`).
    margin_waived: bool = False

    def __init__(
        self, ttft_ms: float, tpot_ms: float, e2e_ms: float, full_ttft_ms: float, margin_waived: bool = False
    ) -> None:
        # Written out (the dataclass keeps it): one dict instead of 5 frozen attribute sets, for an
        # object built once per decision. The fields are the dataclass's (tested).
        _set_attr(
            self,
            "__dict__",
            {
                "ttft_ms": ttft_ms,
                "tpot_ms": tpot_ms,
                "e2e_ms": e2e_ms,
                "full_ttft_ms": full_ttft_ms,
                "margin_waived": margin_waived,
            },
        )


def resolve_targets(
    request: ScheduleInput, default_ttft_ms: float, default_tpot_ms: float, now_s: float | None = None
) -> Targets:
    """The TTFT and TPOT targets ``request`` is scheduled against.

    Own targets win over the defaults. A request with only an e2e target gets
    a TTFT target from it: what is left after its expected output tokens at
    half the default TPOT, but at least a quarter of the e2e target and at most
    the default TTFT. Its TPOT stays the default here; the pace its deadline
    needs is packing's business (:func:`router.core.packing.packing_tpot_target_ms`).
    With ``now_s`` and ``request.arrival_s`` the TTFT target is the budget
    still left (may be <= 0: nothing can meet it).
    """
    e2e = request.e2e_slo_ms
    if e2e > 0 and request.ttft_slo_ms == 0 and request.tpot_slo_ms == 0:
        n = max(request.output_tokens_estimate, 1)
        ttft = min(default_ttft_ms, max(e2e / 4.0, e2e - n * default_tpot_ms / 2.0))
    else:
        ttft = request.ttft_slo_ms or default_ttft_ms
    tpot = request.tpot_slo_ms or default_tpot_ms
    full = ttft
    if now_s is not None and request.arrival_s is not None:
        ttft -= (now_s - request.arrival_s) * 1e3
    return Targets(ttft, tpot, e2e, full)
