"""Content addresses of prompt prefixes: the block hashes an engine's prefix cache and a router agree on.

A prefix cache (vLLM's automatic prefix caching, the sim engine's) stores KV
per block of ``block_tokens`` tokens under a hash of that block's tokens *and
of everything before it*: the hash of block ``j`` is ``H(hash of block j-1,
tokens of block j)``. Two prompts then share the hashes of exactly their
common full blocks, and one hash names one whole prefix, so "how much of this
prompt does an instance hold" is "how many of its leading hashes does it
hold". Only full blocks get a hash (a partial last block is never reused).

Two ways to name a block's content, both chained the same way:

- :func:`token_block_hashes` from the prompt's token ids (the sim worker and
  the router hashing the same ``prompt_token_ids``);
- :func:`id_block_hashes` from a trace's prefix-block ids (Mooncake's
  ``hash_ids``: equal ids mean equal tokens), used by the virtual-time
  simulator, which never builds token ids. Its block is one trace block
  (``RequestPlan.prefix_block_tokens`` tokens, 512 in Mooncake), coarser than
  an engine's KV block: a cache block there spans several KV blocks.

Python's ``hash`` of a tuple of ints is the same in every process (only
``str``/``bytes`` hashing is randomised), so a router and a worker on
different hosts compute the same values without sharing any state. A vLLM
engine hashes differently (SHA-256 over its own block layout); a router fed
by its KV events must hash prompts with vLLM's function, which is the event
source's business, not this module's.
"""

from __future__ import annotations

from collections.abc import Sequence

#: The parent hash of a prompt's first block (any fixed value; it keeps block 0 of an id
#: apart from the same id's hash elsewhere).
ROOT_HASH = 0x51_0C0FFEE

#: Most block hashes one prompt carries (a 1M-token prompt in 16-token blocks); longer prompts
#: are hashed over their first MAX_PREFIX_BLOCKS blocks only.
MAX_PREFIX_BLOCKS = 65536


def token_block_hashes(token_ids: Sequence[int], block_tokens: int) -> tuple[int, ...]:
    """The chained hash of every full ``block_tokens``-token block of ``token_ids``, in order."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
    n = min(len(token_ids) // block_tokens, MAX_PREFIX_BLOCKS)
    out: list[int] = []
    parent = ROOT_HASH
    ids = tuple(token_ids[: n * block_tokens])
    for j in range(n):
        parent = hash((parent, ids[j * block_tokens : (j + 1) * block_tokens]))
        out.append(parent)
    return tuple(out)


def lookup_block_hashes(token_ids: Sequence[int], chain_tokens: int, lookup_tokens: int) -> tuple[int, ...]:
    """The chained hashes of ``token_ids`` in ``chain_tokens``-token blocks (an engine's cache block),
    kept only where a block ends on a ``lookup_tokens`` boundary (a multiple of ``chain_tokens``).

    A chained hash names the whole prefix up to its block, so the kept hashes are exactly the
    engine's own names for the prompt's prefixes of 1, 2, ... lookup blocks: a router can follow an
    engine's KV events in its fine blocks and still look a prompt up in coarse ones (a 32k-token
    prompt is 128 lookups of 256 tokens instead of 2,048 of 16).
    """
    if chain_tokens <= 0 or lookup_tokens % chain_tokens:
        raise ValueError(
            f"lookup_tokens ({lookup_tokens}) must be a positive multiple of chain_tokens ({chain_tokens})"
        )
    hashes = token_block_hashes(token_ids, chain_tokens)
    stride = lookup_tokens // chain_tokens
    return hashes if stride == 1 else hashes[stride - 1 :: stride]


def id_block_hashes(block_ids: Sequence[int], prompt_tokens: int, block_tokens: int) -> tuple[int, ...]:
    """The chained hash of every *full* block a prompt of ``prompt_tokens`` tokens has among ``block_ids``.

    ``block_ids[j]`` names the content of tokens ``j * block_tokens`` to
    ``(j + 1) * block_tokens`` (a trace's ``hash_ids``); a block the prompt
    does not fill is left out.
    """
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
    n = min(len(block_ids), prompt_tokens // block_tokens, MAX_PREFIX_BLOCKS)
    out: list[int] = []
    parent = ROOT_HASH
    for j in range(n):
        parent = hash((parent, int(block_ids[j])))
        out.append(parent)
    return tuple(out)
