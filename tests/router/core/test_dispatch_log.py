"""The queue's dispatch log answers the drain rate's "tokens since" as the walk over the window did."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.queue import DispatchLog


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.floats(0.0, 0.05), st.integers(0, 5000), st.floats(-0.1, 1.5)), min_size=1, max_size=400
    ),
    window_s=st.floats(0.01, 1.0),
)
def test_tokens_since_is_the_sum_over_the_dispatches_kept(
    steps: list[tuple[float, int, float]], window_s: float
) -> None:
    log = DispatchLog()
    kept: list[tuple[float, int]] = []  # the reference: the deque the queue kept before
    now = 0.0
    for gap, tokens, back_s in steps:
        now += gap  # the caller's clock: never backwards, often the same instant
        log.add(now, tokens, now - window_s)
        kept.append((now, tokens))
        while kept and kept[0][0] < now - window_s:
            kept.pop(0)
        assert len(log) == len(kept)
        start = now - back_s
        expected = 0
        for t, n in reversed(kept):
            if t < start:
                break
            expected += n
        assert log.tokens_since(start) == expected
