"""binpack on colocated instances: a request judged by its e2e deadline alone keeps the pace its
deadline needs at the step with the measured interleaving of the prompts to come, where the fleet
has an empty instance to open instead."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from router.core.calibration import Correction
from router.core.scheduler import Decision
from tests.router.core.helpers import NOW, decoding, inst, make_request, make_scheduler, make_snapshot


@dataclass
class _Interleaved:
    """A calibration measuring ``interleave_ms`` of prefill between every instance's decode steps."""

    interleave_ms: float

    def correction(self, ids: Any, groups: Any) -> Correction:
        n = len(ids)
        return Correction(
            ttft_factor=np.ones(n),
            tpot_factor=np.ones(n),
            interleave_ms=np.full(n, self.interleave_ms),
            coefs=None,
            has_fit=np.zeros(n, dtype=bool),
            min_factor=0.1,
            max_factor=10.0,
        )


def _decide(policy: str, interleave_ms: float, *records: Any) -> Decision:
    scheduler = make_scheduler(policy, tpot_slo_ms=50.0)
    assert scheduler.predictors is not None
    scheduler.predictors.calibration = _Interleaved(interleave_ms)  # type: ignore[assignment]
    # 500 tokens (its cautious bound) in 12 s: a pace of about 24 ms a token.
    request = make_request(
        "bulk", 256, max_tokens=600, e2e_slo_ms=12_000.0, expected_output_tokens=400, output_tokens_bound=500
    )
    return scheduler.schedule(scheduler.view(make_snapshot(*records), NOW), request, NOW, dry_run=True)


def _placed(decision: Decision) -> str:
    assert decision.prefill is not None
    return decision.prefill.instance_id


def test_a_paced_request_goes_to_an_empty_instance_when_the_interleave_breaks_its_pace() -> None:
    # The decode step alone (b's γ horizon, ~18 ms) keeps the pace on the busy instance: best fit.
    assert _placed(_decide("binpack", 0.0, decoding("busy", 4, 400), inst("idle"))) == "busy"
    # With 15 ms of prompts between its steps (~32 ms) it would miss there: the empty bin takes it.
    decision = _decide("binpack", 15.0, decoding("busy", 4, 400), inst("idle"))
    own = decision.context.metric("predicted_tpot_own")
    tpot = decision.context.metric("predicted_tpot")
    assert own[0] > 50.0 > tpot[0]  # the step scaled by target / pace: the target bounds the pace
    assert _placed(decision) == "idle"


def test_without_an_empty_instance_the_pace_is_left_to_b() -> None:
    decision = _decide("binpack", 15.0, decoding("busy", 4, 400), decoding("fuller", 6, 400))
    assert decision.context.metric("predicted_tpot_own").tolist() == [0.0, 0.0]
    assert _placed(decision) == "fuller"


def test_other_policies_and_unpaced_deadlines_read_no_own_pace() -> None:
    decision = _decide("slo", 15.0, decoding("busy", 4, 400), inst("idle"))
    assert decision.context.metric("predicted_tpot_own").tolist() == [0.0, 0.0]
