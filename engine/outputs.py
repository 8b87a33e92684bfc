"""What the modelled engine outputs: token values and where EOS falls, as pure functions of the request.

Output tokens depend only on the request (sampling seed, prompt, position),
never on the engine or on timing, so a ``Prefill`` on one sim worker followed
by a ``Decode`` on another yields exactly the tokens a ``Generate`` on one
would, and the simulator (which never makes tokens) ends a request exactly
where the sim worker would (:func:`eos_position`). Token ids are printable
ASCII bytes of the built-in tokenizer (:mod:`engine.tokenizer`).

Because the output is known in advance, a client can also end it at a chosen
length the way it would end a real model's answer: with a stop string
(:func:`stop_string_at`), which ``slo-router bench`` uses so the router sees a
cap, never the length.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from engine.interface import Sampling

_MASK64 = (1 << 64) - 1
_EOS_SALT = 0x5EED_E05E_0F5E_0000
# Output tokens are drawn from these bytes: letters weighted roughly like
# English, spaces and a little punctuation, all single-byte UTF-8.
_ALPHABET = tuple(b"etaoinshrdlucmfwypvbgkjqxz etaoinshrdlu      ,.")
_ALPHABET_ARRAY = np.array(_ALPHABET, dtype=np.uint8)
_POSITION_MUL = 0xD1B54A32D192ED03


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a fast, well-spread 64-bit hash of an integer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def prompt_digest(prompt_token_ids: Sequence[int]) -> bytes:
    """A 16-byte digest of a prompt's token ids."""
    return hashlib.blake2b(
        struct.pack(f"<{len(prompt_token_ids)}I", *prompt_token_ids), digest_size=16
    ).digest()


def request_key(seed: int, digest: bytes) -> int:
    """The 64-bit key every output token of a request derives from."""
    h = hashlib.blake2b(digest, digest_size=8, key=(seed & _MASK64).to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little")


def output_token(key: int, position: int) -> int:
    """The (non-EOS) token id at ``position`` (0-based) of a request's output."""
    return _ALPHABET[_mix64(key ^ (position * _POSITION_MUL & _MASK64)) % len(_ALPHABET)]


def _mix64_array(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """:func:`_mix64` of every element (numpy's uint64 arithmetic wraps modulo 2**64, as masking does)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    out: npt.NDArray[np.uint64] = x ^ (x >> np.uint64(31))
    return out


def output_text(key: int, length: int) -> str:
    """The text of a request's first ``length`` (non-EOS) output tokens: :func:`output_token` at
    positions ``0 .. length-1``, one ASCII character each (the byte tokenizer's text of them)."""
    positions = np.arange(length, dtype=np.uint64) * np.uint64(_POSITION_MUL)
    mixed = _mix64_array(np.uint64(key & _MASK64) ^ positions)
    chars: bytes = _ALPHABET_ARRAY[mixed % np.uint64(len(_ALPHABET))].tobytes()
    return chars.decode("ascii")


def stop_string_at(key: int, length: int, *, max_chars: int) -> str | None:
    """The shortest stop string that ends a request's output after exactly ``length`` tokens.

    It is the output's own last characters up to ``length``, as few as make their first
    occurrence in the output end there: an engine that honours stop strings (the sim worker does,
    as vLLM does) therefore stops on the ``length``-th token, and reports ``"stop"``. This is how
    ``slo-router bench`` makes a sim fleet end an answer at its planned length while the request
    carries only its cap as ``max_tokens``: a stop string is a sampling parameter the router
    passes through and never reads, so it cannot serve as a length oracle. ``None`` when no
    suffix of at most ``max_chars`` characters is unique so far (very unlikely for this
    pseudo-random text; the caller then needs another way to stop there).
    """
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    text = output_text(key, length)
    for k in range(1, min(length, max_chars) + 1):
        if text.find(text[length - k :]) == length - k:
            return text[length - k :]
    return None


def eos_position(key: int, eos_probability: float) -> int | None:
    """Index of the request's EOS token, geometric with ``eos_probability``; None when EOS never comes."""
    if eos_probability <= 0.0:
        return None
    if eos_probability >= 1.0:
        return 0
    u = (_mix64(key ^ _EOS_SALT) + 0.5) / 2.0**64
    return int(math.log(u) / math.log1p(-eos_probability))


def output_length(key: int, sampling: Sampling, eos_probability: float) -> tuple[int, str]:
    """Tokens the request produces in total and why it ends (``"length"`` or ``"stop"``), stop strings aside."""
    eos = None if sampling.ignore_eos else eos_position(key, eos_probability)
    if eos is not None and eos + 1 <= sampling.max_tokens:
        return eos + 1, "stop"
    return sampling.max_tokens, "length"
