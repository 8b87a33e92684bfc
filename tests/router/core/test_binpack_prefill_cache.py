"""binpack on a P/D fleet: the prefill stage sends a prompt to the prefill instance that would compute
the fewest of its tokens (its longest cached prefix) among those meeting its TTFT target, then the
lowest TTFT; without cache knowledge the TTFT alone decides."""

from __future__ import annotations

import pytest

from tests.router.core.helpers import NOW, binpack_with_cached_holder, inst, make_snapshot


@pytest.mark.parametrize("routing", ["approximate", "off"])
def test_prefill_goes_to_the_cached_prefix_within_the_ttft_target(routing: str) -> None:
    scheduler, request = binpack_with_cached_holder(routing)
    # "holder" has 1,500 prompt tokens queued (a later first token than the idle "quick", both well
    # within 5 s) and 768 of this prompt's 1,000 tokens cached: it computes 232 where "quick" computes
    # all 1,000.
    snapshot = make_snapshot(
        inst("quick", "prefill"),
        inst("holder", "prefill", running=1, prefill_tokens=1500),
        inst("dec", "decode"),
    )
    decision = scheduler.schedule(scheduler.view(snapshot, NOW), request, NOW, dry_run=True)
    assert decision.prefill is not None
    ttft = decision.context.metric("predicted_ttft")
    assert ttft[1] > ttft[0]
    assert decision.prefill.instance_id == ("holder" if routing == "approximate" else "quick")
