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


@dataclass(frozen=True)
class ScheduleInput:
    """What the scheduler needs to know about one request.

    SLO fields are the request's own targets; 0 means "use the router's
    default" (``SchedulerConfig.ttft_slo_ms`` / ``tpot_slo_ms``).
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

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0:
            raise InvalidRequestError(f"prompt_tokens must be >= 0, got {self.prompt_tokens}")
        for count in ("expected_output_tokens", "max_tokens"):
            if getattr(self, count) < 0:
                raise InvalidRequestError(f"{count} must be >= 0 (0 = unknown), got {getattr(self, count)}")
        for name in ("ttft_slo_ms", "tpot_slo_ms", "e2e_slo_ms"):
            value = getattr(self, name)
            if not (value >= 0 and value != float("inf")):
                raise InvalidRequestError(f"{name} must be finite and >= 0 (0 = router default), got {value}")
