"""binpack's decode stage and a request paced short: its deadline paced over its expected length
because no decoder keeps the pace of its cautious length now. It goes to the decoder with the lowest
step, not the fullest; every other request keeps best fit."""

from __future__ import annotations

from router.core.decision import Decision
from router.core.packing import resident_tpot_pacing
from tests.router.core.helpers import NOW, inst, make_request, make_scheduler, make_snapshot


def _place(bound_tokens: int, **request: float) -> Decision:
    # Two decoders both (b) admits at the expected length's pace: "full" (16 requests, a γ-horizon
    # step near 20 ms with the request) and "light" (8, near 16 ms); idle, the step is near 12 ms.
    scheduler = make_scheduler("binpack", tpot_slo_ms=50.0)
    snapshot = make_snapshot(
        inst("p", "prefill"),
        inst("full", "decode", decode_requests=16, decode_tokens=200, used_kv_tokens=200),
        inst("light", "decode", decode_requests=8, decode_tokens=100, used_kv_tokens=100),
    )
    view = scheduler.view(snapshot, NOW)
    code = make_request("code", 100, expected_output_tokens=100, output_tokens_bound=bound_tokens, **request)
    return scheduler.schedule(view, code, NOW, dry_run=True)


def test_a_request_paced_short_goes_to_the_decoder_with_the_lowest_step() -> None:
    """Due in 3 s with a cautious bound of 200 tokens: that pace (about 14.6 ms) is kept by an idle
    decoder but by neither busy one, so the request is paced over its expected 100 tokens, which
    both keep. Best fit sent it to the fullest, where every answer longer than expected misses
    (PD `mixed`, seed 37, 12 req/s, 3 + 3: code answers placed at batch 56-63, 43-45 ms a token)."""
    decision = _place(200, e2e_slo_ms=3000.0)
    _, paced, length = resident_tpot_pacing(decision.context, make_scheduler("binpack").config)
    assert paced and length == 100.0
    assert decision.decode is not None and decision.decode.instance_id == "light"


def test_a_request_paced_by_its_cautious_length_keeps_best_fit() -> None:
    """With a bound of 140 tokens both decoders keep the cautious pace (about 20.9 ms): best fit,
    the fuller one."""
    decision = _place(140, e2e_slo_ms=3000.0)
    _, paced, length = resident_tpot_pacing(decision.context, make_scheduler("binpack").config)
    assert paced and length == 140.0
    assert decision.decode is not None and decision.decode.instance_id == "full"


def test_a_tpot_judged_request_keeps_best_fit() -> None:
    decision = _place(200, tpot_slo_ms=50.0)
    assert decision.decode is not None and decision.decode.instance_id == "full"
