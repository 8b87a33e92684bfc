"""What a prefix lookup costs in fine and in coarse blocks over an exact index fed fine events, and
what a decision's two index calls cost on the routing history.

    python scripts/prefix_lookup_cost.py [INSTANCES]
    PYTHONPATH=. python scripts/prefix_lookup_cost.py --bench-row [ROUNDS]

Exact index: a 32k-token prompt, chained in 16-token blocks (the sim worker's and vLLM's cache
block); the index holds a 16k-to-20k-token prefix of it on each of INSTANCES (default 256)
instances. Prints the best of five means of ``matched_blocks`` with every 16-token hash and with
every 16th (a lookup per 256 tokens, ``--prefix-block-tokens 256 --prefix-chain-block-tokens 16``),
and of ``cached_tokens_column`` (what a decision reads: the cached tokens laid on the view).

Routing history: the scheduler bench's long-prompt traffic (``bench.bench_scheduler``: 8 prompt
families of 48 shared 512-token blocks and 16 of each prompt's own, 200k tokens of KV per instance)
and per decision the column then the dispatch to the instance holding the most. Prints the mean
of each over 1,600 decisions. Figures only; the host's load weighs on them.

``--bench-row``: the scheduler bench's 32k-token row itself (``make bench``: ``slo`` at 256
instances, prefix-cache routing ``off`` then ``approximate`` then ``off``), ROUNDS times (default 3),
p50 of the wall clock and of the thread's CPU time, and the ratio of ``approximate`` to the mean of
the two ``off`` runs around it (run it on two checkouts in turn to compare them).
"""

from __future__ import annotations

import random
import sys
import time

import numpy as np

from fleet.prefix import id_block_hashes, lookup_block_hashes, token_block_hashes
from router.core.prefix import ApproximatePrefixIndex, ExactPrefixIndex, cached_tokens_column


def _exact(instances: int) -> None:
    rng = random.Random(1)
    prompt = [rng.randrange(50_000) for _ in range(32_768)]
    fine = token_block_hashes(prompt, 16)
    coarse = lookup_block_hashes(prompt, 16, 256)
    index = ExactPrefixIndex(256, chain_block_tokens=16)
    ids = tuple(f"i{i}" for i in range(instances))
    for i, instance_id in enumerate(ids):
        index.apply(instance_id, [("stored", fine[: 1000 + (i * 250) // max(instances, 1)])])
    positions = {instance_id: i for i, instance_id in enumerate(ids)}
    for name, hashes in (("16-token lookups", fine), ("256-token lookups", coarse)):
        for call, run in (
            ("matched_blocks", lambda h=hashes: index.matched_blocks(h)),
            ("cached_tokens_column", lambda h=hashes: cached_tokens_column(index, ids, positions, h, 32_768)),
        ):
            best = float("inf")
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(50):
                    run()
                best = min(best, (time.perf_counter() - start) / 50 * 1e6)
            print(f"exact, {name} ({len(hashes)} probes, {instances} instances), {call}: {best:.0f} us")


def _history(instances: int) -> None:
    block, tokens = 512, 32_768

    def prompt_hashes(family: int, own: int) -> tuple[int, ...]:
        ids = [family * 1000 + j for j in range(48)] + [10**6 + own * 100 + j for j in range(16)]
        return id_block_hashes(ids, tokens, block)

    ids = tuple(f"i{i}" for i in range(instances))
    positions = {instance_id: i for i, instance_id in enumerate(ids)}
    index = ApproximatePrefixIndex(block)
    for k, instance_id in enumerate(ids):
        index.dispatched(instance_id, prompt_hashes(k % 8, k), 10_000_000)
    rng = random.Random(3)
    column_ns = dispatch_ns = 0
    decisions = 1600
    for _ in range(decisions):
        hashes = prompt_hashes(rng.randrange(8), rng.randrange(1 << 20))
        start = time.perf_counter_ns()
        column = cached_tokens_column(index, ids, positions, hashes, tokens)
        middle = time.perf_counter_ns()
        target = ids[int(np.argmax(column))]
        index.dispatched(target, hashes, 200_000.0, 256)
        column_ns += middle - start
        dispatch_ns += time.perf_counter_ns() - middle
    print(
        f"approximate, 64 probes, {instances} instances: cached_tokens_column "
        f"{column_ns / decisions / 1e3:.1f} us, dispatched {dispatch_ns / decisions / 1e3:.1f} us"
    )


def _bench_row(rounds: int) -> None:
    import types

    import bench.bench_scheduler as bench
    from predictor import LatencyPredictor

    lp = LatencyPredictor.from_files(bench.PROFILE / "ttft.json", bench.PROFILE / "tpot.json")
    for r in range(rounds):
        cells = []
        for name, clock in (("wall", time.perf_counter_ns), ("cpu", time.thread_time_ns)):
            # The bench times with ``time.perf_counter_ns``: hand it this clock instead.
            setattr(bench, "time", types.SimpleNamespace(perf_counter_ns=clock))  # noqa: B010
            off = bench.measure_long_prompt(256, lp, 1500, "off")[0]
            aware = bench.measure_long_prompt(256, lp, 1500, "approximate")[0]
            off = (off + bench.measure_long_prompt(256, lp, 1500, "off")[0]) / 2
            cells.append(f"{name} off {off:6.1f} approximate {aware:6.1f} us ({aware / off:.2f}x)")
        setattr(bench, "time", time)  # noqa: B010
        print(f"round {r + 1}: " + "   ".join(cells))


def main() -> None:
    if "--bench-row" in sys.argv:
        rest = [a for a in sys.argv[1:] if a != "--bench-row"]
        _bench_row(int(rest[0]) if rest else 3)
        return
    instances = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    if instances <= 0:
        raise SystemExit(f"INSTANCES must be > 0, got {instances}")
    _exact(instances)
    _history(instances)


if __name__ == "__main__":
    main()
