"""What a prefix lookup costs in fine and in coarse blocks over an exact index fed fine events.

    python scripts/prefix_lookup_cost.py [INSTANCES]

A 32k-token prompt, chained in 16-token blocks (the sim worker's and vLLM's cache block); the index
holds a 16k-to-20k-token prefix of it on each of INSTANCES (default 256) instances. Prints the
best of five means of ``matched_blocks`` with every 16-token hash and with every 16th (a lookup per
256 tokens, ``--prefix-block-tokens 256 --prefix-chain-block-tokens 16``).
"""

from __future__ import annotations

import random
import sys
import time

from fleet.prefix import lookup_block_hashes, token_block_hashes
from router.core.prefix import ExactPrefixIndex


def main() -> None:
    instances = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    rng = random.Random(1)
    prompt = [rng.randrange(50_000) for _ in range(32_768)]
    fine = token_block_hashes(prompt, 16)
    coarse = lookup_block_hashes(prompt, 16, 256)
    index = ExactPrefixIndex(256, chain_block_tokens=16)
    for i in range(instances):
        index.apply(f"i{i}", [("stored", fine[: 1000 + (i * 250) // max(instances, 1)])])
    for name, hashes in (("16-token lookups", fine), ("256-token lookups", coarse)):
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(50):
                index.matched_blocks(hashes)
            best = min(best, (time.perf_counter() - start) / 50 * 1e6)
        print(f"{name} ({len(hashes)} probes, {instances} instances): {best:.0f} us")


if __name__ == "__main__":
    main()
