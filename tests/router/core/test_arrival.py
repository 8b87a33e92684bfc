"""The arrival check refuses a request only on what is known: a length prior is no grounds."""

from __future__ import annotations

import pytest

from fleet.prefix import token_block_hashes
from router.core.arrival import ArrivalCheck
from router.core.errors import UnmeetableError
from tests.router.core.helpers import NOW, inst, make_request, make_scheduler, make_snapshot


def _check() -> ArrivalCheck:
    scheduler = make_scheduler()
    snapshot = make_snapshot(inst("a"), inst("b"))
    return ArrivalCheck(scheduler, lambda: snapshot)


def test_a_learned_length_past_the_e2e_target_is_refused_at_arrival() -> None:
    # 4,000 tokens decoded alone at >= 10 ms each cannot finish within 2 s.
    request = make_request(prompt_tokens=256, e2e_slo_ms=2000.0, expected_output_tokens=4000, max_tokens=4000)
    with pytest.raises(UnmeetableError, match="e2e target"):
        _check().check(request, NOW)


@pytest.mark.parametrize("guess", ["output_tokens_prior", "output_tokens_pooled"])
def test_a_guessed_length_is_not_grounds_to_refuse(guess: str) -> None:
    # The same request before anything is learned of its class: its cap (a prior) or every class's mean
    # (pooled, a rare class of short alerts before eight of them finished) says nothing of its length.
    # Refused on it, none of the class would ever finish to teach the predictor.
    request = make_request(
        prompt_tokens=256, e2e_slo_ms=2000.0, expected_output_tokens=4000, max_tokens=4000, **{guess: True}
    )
    assert request.output_tokens_guessed
    _check().check(request, NOW)


def test_a_prompt_whose_prefill_alone_misses_the_e2e_target_is_refused_even_with_a_prior() -> None:
    request = make_request(prompt_tokens=256, e2e_slo_ms=1.0, max_tokens=4000, output_tokens_prior=True)
    with pytest.raises(UnmeetableError, match="e2e target"):
        _check().check(request, NOW)


def test_a_prompt_mostly_cached_is_judged_by_its_uncached_part() -> None:
    # 16k tokens take well over 500 ms to prefill on an idle instance; with all but its last block
    # cached on "a" (as the router knows it) the prefill is a few hundred tokens, well within.
    scheduler = make_scheduler(prefix_cache_routing="approximate", prefix_block_tokens=256)
    snapshot = make_snapshot(inst("a"), inst("b"))
    check = ArrivalCheck(scheduler, lambda: snapshot)
    hashes = token_block_hashes(list(range(16_384)), 256)
    request = make_request(prompt_tokens=16_384, ttft_slo_ms=500.0, tpot_slo_ms=1000.0, prefix_hashes=hashes)
    with pytest.raises(UnmeetableError, match="TTFT target"):
        check.check(request, NOW)
    assert scheduler.prefix is not None
    scheduler.prefix.dispatched("a", hashes[:-1], 1_000_000)
    check.check(request, NOW)
