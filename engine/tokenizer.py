"""The built-in byte-level tokenizer.

Ids 0..255 are the UTF-8 bytes of the text; a few special ids follow them.
It needs no files, so the router can count the tokens of a text prompt when
no Hugging Face tokenizer is configured, and the ``sim`` engine uses it to
turn its output token ids into text. Encoding and decoding are exact inverses
for any text (``decode(encode(s)) == s``).
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

NUM_BYTE_TOKENS = 256
BOS_TOKEN_ID = 256
EOS_TOKEN_ID = 257
PAD_TOKEN_ID = 258
#: Ids are ``0 <= id < VOCAB_SIZE``.
VOCAB_SIZE = 259

SPECIAL_TOKEN_IDS = frozenset({BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID})


def _bytes_of(token_ids: Iterable[int]) -> bytes:
    out = bytearray()
    for tid in token_ids:
        if 0 <= tid < NUM_BYTE_TOKENS:
            out.append(tid)
        elif tid not in SPECIAL_TOKEN_IDS:
            raise ValueError(
                f"token id {tid} is outside the built-in tokenizer's vocabulary (0..{VOCAB_SIZE - 1})"
            )
    return bytes(out)


class SimpleTokenizer:
    """Byte-level tokenizer: one token per UTF-8 byte; special tokens decode to nothing."""

    vocab_size = VOCAB_SIZE
    bos_token_id = BOS_TOKEN_ID
    eos_token_id = EOS_TOKEN_ID
    pad_token_id = PAD_TOKEN_ID

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Iterable[int]) -> str:
        """Text of ``token_ids``; special ids are skipped, invalid UTF-8 becomes U+FFFD.

        Raises :class:`ValueError` for an id outside the vocabulary.
        """
        return _bytes_of(token_ids).decode("utf-8", errors="replace")


class IncrementalDecoder:
    """Decodes a token stream piece by piece.

    A multi-byte character split across pieces is emitted once complete, so
    the concatenation of the pieces equals ``SimpleTokenizer().decode`` of the
    whole stream.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: Iterable[int]) -> str:
        return self._decoder.decode(_bytes_of(token_ids))

    def flush(self) -> str:
        """Whatever an incomplete trailing character decodes to at the end of the stream."""
        return self._decoder.decode(b"", final=True)


_DEFAULT = SimpleTokenizer()


def encode(text: str) -> list[int]:
    """Token ids of ``text`` with the built-in tokenizer."""
    return _DEFAULT.encode(text)


def decode(token_ids: Iterable[int]) -> str:
    """Text of ``token_ids`` with the built-in tokenizer."""
    return _DEFAULT.decode(token_ids)
