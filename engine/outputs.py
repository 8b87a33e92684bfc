"""What the modelled engine outputs: token values and where EOS falls, as pure functions of the request.

Output tokens depend only on the request (sampling seed, prompt, position),
never on the engine or on timing, so a ``Prefill`` on one sim worker followed
by a ``Decode`` on another yields exactly the tokens a ``Generate`` on one
would, and the simulator (which never makes tokens) ends a request exactly
where the sim worker would (:func:`eos_position`). Token ids are printable
ASCII bytes of the built-in tokenizer (:mod:`engine.tokenizer`).
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence

from engine.interface import Sampling

_MASK64 = (1 << 64) - 1
_EOS_SALT = 0x5EED_E05E_0F5E_0000
# Output tokens are drawn from these bytes: letters weighted roughly like
# English, spaces and a little punctuation, all single-byte UTF-8.
_ALPHABET = tuple(b"etaoinshrdlucmfwypvbgkjqxz etaoinshrdlu      ,.")


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
    return _ALPHABET[_mix64(key ^ (position * 0xD1B54A32D192ED03 & _MASK64)) % len(_ALPHABET)]


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
