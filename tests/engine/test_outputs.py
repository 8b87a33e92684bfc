"""The sim engine's output as a pure function: the text bench predicts, and the stop string that ends it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.outputs import output_text, output_token, request_key, stop_string_at

KEYS = st.integers(min_value=0, max_value=2**64 - 1)


@given(key=KEYS, length=st.integers(min_value=0, max_value=600))
@settings(max_examples=60, deadline=None)
def test_output_text_is_the_output_tokens_text(key: int, length: int) -> None:
    assert output_text(key, length) == bytes(output_token(key, i) for i in range(length)).decode("ascii")


@given(key=KEYS, length=st.integers(min_value=1, max_value=5000))
@settings(max_examples=150, deadline=None)
def test_the_stop_string_first_occurs_where_the_answer_ends(key: int, length: int) -> None:
    stop = stop_string_at(key, length, max_chars=256)
    assert stop is not None and 1 <= len(stop) <= 256
    text = output_text(key, length + 50)
    # First found when the length-th token is out: exactly where the answer must end.
    assert text.find(stop) + len(stop) == length


def test_a_stop_string_longer_than_allowed_is_not_offered() -> None:
    key = request_key(0, b"p" * 16)
    needed = len(stop_string_at(key, 3000, max_chars=256) or "")
    assert needed > 1
    assert stop_string_at(key, 3000, max_chars=needed - 1) is None
