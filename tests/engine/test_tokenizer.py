from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine import tokenizer
from engine.tokenizer import EOS_TOKEN_ID, VOCAB_SIZE, IncrementalDecoder, SimpleTokenizer


def test_bytes_are_ids_and_specials_decode_to_nothing() -> None:
    tok = SimpleTokenizer()
    assert tok.encode("hi") == [104, 105]
    assert tok.decode([104, EOS_TOKEN_ID, 105]) == "hi"
    assert tok.vocab_size == VOCAB_SIZE
    assert tokenizer.encode("ok") == [111, 107]
    assert tokenizer.decode([111, 107]) == "ok"


def test_out_of_vocabulary_id_is_an_error_naming_the_id() -> None:
    with pytest.raises(ValueError, match="token id 4000"):
        SimpleTokenizer().decode([1, 4000])


@given(st.text())
def test_decode_inverts_encode(text: str) -> None:
    tok = SimpleTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


@given(st.text(min_size=1), st.integers(min_value=1, max_value=5))
def test_incremental_decoding_equals_whole_decoding(text: str, piece: int) -> None:
    ids = SimpleTokenizer().encode(text)
    dec = IncrementalDecoder()
    out = "".join(dec.push(ids[i : i + piece]) for i in range(0, len(ids), piece)) + dec.flush()
    assert out == text
