"""The arrival check refuses a request only on what is known: a length prior is no grounds."""

from __future__ import annotations

import pytest

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


def test_a_prior_length_is_not_grounds_to_refuse() -> None:
    # The same request before anything is learned of its class: its cap is only a guess of its length.
    request = make_request(
        prompt_tokens=256,
        e2e_slo_ms=2000.0,
        expected_output_tokens=4000,
        max_tokens=4000,
        output_tokens_prior=True,
    )
    _check().check(request, NOW)


def test_a_prompt_whose_prefill_alone_misses_the_e2e_target_is_refused_even_with_a_prior() -> None:
    request = make_request(prompt_tokens=256, e2e_slo_ms=1.0, max_tokens=4000, output_tokens_prior=True)
    with pytest.raises(UnmeetableError, match="e2e target"):
        _check().check(request, NOW)
