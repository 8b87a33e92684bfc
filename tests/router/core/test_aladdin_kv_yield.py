"""binpack's (e) on a decoder and a request judged by its e2e deadline alone: it is held within
headroom² of the KV (``kv_peak_exact_yielding``), leaving the last share to requests whose first token cannot wait;
a TTFT-judged request keeps the plain headroom."""

from __future__ import annotations

from router.core.decision import Decision
from tests.router.core.helpers import NOW, inst, make_request, make_scheduler, make_snapshot


def _place(**request: float) -> Decision:
    # Two decoders of 100k tokens: "full" projects 88,000 + 10 × 256 of growth (90.6 % with no
    # request; 92.1 % with this one, between headroom² = 90.25 % and the headroom, 95 %) and
    # "light" 50 %. Best fit takes the fuller one when (e) allows it.
    scheduler = make_scheduler("binpack", tpot_slo_ms=50.0)
    snapshot = make_snapshot(
        inst("p", "prefill"),
        inst("full", "decode", decode_requests=10, decode_tokens=5000, used_kv_tokens=88_000),
        inst("light", "decode", decode_requests=10, decode_tokens=5000, used_kv_tokens=50_000),
    )
    view = scheduler.view(snapshot, NOW)
    req = make_request("r", 1000, expected_output_tokens=500, output_tokens_bound=800, **request)
    return scheduler.schedule(view, req, NOW, dry_run=True)


def test_a_request_judged_by_its_deadline_alone_leaves_the_last_of_the_kv() -> None:
    """Due in 60 s, it would bring "full" to 92.1 % of its KV: over headroom², so it goes to
    "light" (PD interactive-batch, 8 req/s, 1 + 2: batch answers took each room a finishing leg left
    and interactive requests lapsed in the router queue, refused by (e) on both decoders)."""
    decision = _place(e2e_slo_ms=60_000.0)
    assert decision.decode is not None and decision.decode.instance_id == "light"
    assert decision.context.metric("kv_peak_exact_yielding")[1] > 0.95


def test_a_ttft_judged_request_takes_the_kv_up_to_the_headroom() -> None:
    decision = _place(ttft_slo_ms=1000.0, tpot_slo_ms=50.0)
    assert decision.decode is not None and decision.decode.instance_id == "full"
    assert decision.context.metric("kv_peak_exact_yielding")[1] < 0.95
