"""The stock-path bench's verdict figures: per-round pairs, medians over rounds, the spread beside them."""

from __future__ import annotations

from bench.vllm_stock import Pairs, Run, summarize

WORKLOAD = ((1, 6), (16, 2), (64, 1))


def _pairs(rounds: list[dict[int, tuple[float, float, float, float]]]) -> Pairs:
    """``rounds``: per round, per concurrency, (direct tok/s, direct TTFT, router tok/s, router TTFT)."""
    pairs = Pairs()
    for figures in rounds:
        for concurrency, (d_rate, d_ttft, r_rate, r_ttft) in figures.items():
            requests = concurrency * dict(WORKLOAD)[concurrency]
            pairs.add("direct", concurrency, Run(d_rate, d_ttft, 128 * requests, requests, 0.0))
            pairs.add("router", concurrency, Run(r_rate, r_ttft, 128 * requests, requests, 0.5))
        pairs.load.append(1.0)
    return pairs


def test_each_round_is_judged_against_its_own_direct_run() -> None:
    # A slow round for both sides (the host's load), and rounds where each side had the better host:
    # best-of-rounds would compare router's best with direct's best; the pairs compare each round.
    pairs = _pairs(
        [
            {1: (100, 5.0, 100, 8.0), 16: (1000, 20.0, 950, 24.0), 64: (4000, 50, 3000, 90)},
            {1: (50, 9.0, 45, 10.0), 16: (500, 40.0, 400, 50.0), 64: (2000, 80, 1900, 85)},
            {1: (100, 5.0, 110, 6.0), 16: (1000, 20.0, 1200, 19.0), 64: (4000, 50, 3800, 60)},
        ]
    )
    assert pairs.ratios(16) == [0.95, 0.8, 1.2]
    assert pairs.ttft_added(1) == [3.0, 1.0, 1.0]
    text, lines = summarize(pairs, WORKLOAD)
    assert "at 16 streams 0.95 (0.80–1.20)" in text
    assert "at 64 streams 0.95 (0.75–0.95)" in text
    assert "TTFT added at 1 stream +1.0 (+1.0–+3.0) ms" in text
    assert "TTFT added at 16 streams +4.0 (-1.0–+10.0) ms" in text
    assert "medians over 3 paired rounds" in text
    assert len(lines) == 1 + len(WORKLOAD)
