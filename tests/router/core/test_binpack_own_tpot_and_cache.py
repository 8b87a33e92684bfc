"""binpack on colocated instances: a TPOT-judged request's own step with the measured interleaving of
the prompts to come within its target, and best fit among the instances that compute the fewest of
its prompt's tokens (its longest cached prefix) when the router knows the prefix caches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from router.core.calibration import Correction
from router.core.scheduler import Scheduler
from tests.router.core.helpers import (
    NOW,
    binpack_with_cached_holder,
    decoding,
    inst,
    make_request,
    make_scheduler,
    make_snapshot,
)


@dataclass
class _Interleaved:
    """A calibration whose measured step is four times the profile's (prompts interleaved)."""

    factor: float = 4.0

    def correction(self, ids: Any, groups: Any) -> Correction:
        n = len(ids)
        return Correction(
            ttft_factor=np.ones(n),
            tpot_factor=np.full(n, self.factor),
            interleave_ms=np.zeros(n),
            coefs=None,
            has_fit=np.zeros(n, dtype=bool),
            min_factor=0.1,
            max_factor=10.0,
        )


def _busy(instance_id: str, running: int = 4) -> Any:
    return decoding(instance_id, running, 400)


def _place(scheduler: Scheduler, request: Any, *records: Any) -> str:
    decision = scheduler.schedule(scheduler.view(make_snapshot(*records), NOW), request, NOW, dry_run=True)
    assert decision.prefill is not None
    return decision.prefill.instance_id


def test_own_tpot_with_the_measured_interleave_keeps_a_stream_off_an_instance_it_would_miss_on() -> None:
    tpot = make_request("t", 256, max_tokens=64, ttft_slo_ms=5_000.0, tpot_slo_ms=50.0)
    plain = make_scheduler("binpack")
    measured = make_scheduler("binpack")
    assert measured.predictors is not None
    measured.predictors.calibration = _Interleaved()  # type: ignore[assignment]
    # The profile's step keeps the target: best fit packs the busy instance either way ...
    assert _place(plain, tpot, _busy("busy"), inst("idle")) == "busy"
    ctx = measured.schedule(
        measured.view(make_snapshot(_busy("busy"), inst("idle")), NOW), tpot, NOW, dry_run=True
    )
    own = ctx.context.metric("predicted_tpot_own")
    assert own.tolist() == ctx.context.metric("predicted_tpot").tolist()
    assert own[0] >= 50.0
    # ... but measured four times slower the stream would miss its 50 ms there: the empty bin takes it.
    assert ctx.prefill is not None and ctx.prefill.instance_id == "idle"


def test_own_tpot_leaves_a_deadline_judged_request_to_its_pace() -> None:
    e2e = make_request("e", 256, max_tokens=64, e2e_slo_ms=60_000.0)
    measured = make_scheduler("binpack")
    assert measured.predictors is not None
    measured.predictors.calibration = _Interleaved()  # type: ignore[assignment]
    decision = measured.schedule(
        measured.view(make_snapshot(_busy("busy"), inst("idle")), NOW), e2e, NOW, dry_run=True
    )
    assert decision.context.metric("predicted_tpot_own").tolist() == [0.0, 0.0]
    assert decision.prefill is not None and decision.prefill.instance_id == "busy"


@pytest.mark.parametrize("routing", ["approximate", "off"])
def test_best_fit_among_the_instances_holding_the_longest_cached_prefix(routing: str) -> None:
    scheduler, request = binpack_with_cached_holder(routing)
    # Best fit alone takes the fuller instance; knowing "holder" has 768 of the prompt's tokens cached,
    # binpack sends it there. Without cache knowledge every instance computes the whole prompt.
    where = _place(scheduler, request, _busy("fuller", 6), _busy("holder", 2))
    assert where == ("holder" if routing == "approximate" else "fuller")
