"""Predictor speed: one array call over many instances, and one scalar call."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from bench.figures import Figure
from predictor import LatencyPredictor

PROFILE = Path(__file__).resolve().parent.parent / "profiling_data" / "qwen2.5-7b-2xv100-linear"


def _time_us(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1e3)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99) - 1]


def main() -> list[Figure]:
    lp = LatencyPredictor.from_files(PROFILE / "ttft.json", PROFILE / "tpot.json")
    rng = np.random.default_rng(0)
    figure = Figure("", "")
    for n in (1, 16, 256, 4096):
        prefill = rng.integers(0, 20000, n).astype(np.float64)
        batch = rng.integers(0, 256, n).astype(np.float64)
        tokens = batch * rng.integers(8, 4096, n)
        budget = np.full(n, 2048.0)
        p50_t, p99_t = _time_us(partial(lp.predict_ttft_ms, prefill, batch, tokens, budget), 300)
        p50_d, p99_d = _time_us(partial(lp.predict_tpot_ms, batch + 1, tokens + 512), 300)
        print(
            f"array call, {n:5d} instances: ttft p50 {p50_t:8.1f} us p99 {p99_t:8.1f} us | "
            f"tpot p50 {p50_d:8.1f} us p99 {p99_d:8.1f} us"
        )
        if n == 4096:
            figure = Figure(
                "predictor, one array call over 4096 instances",
                f"TTFT p50 {p50_t:.0f} µs, TPOT p50 {p50_d:.0f} µs",
            )
    p50_t, p99_t = _time_us(lambda: lp.predict_ttft_ms(3000, 16, 16000, 2048), 2000)
    p50_d, p99_d = _time_us(lambda: lp.predict_tpot_ms(16, 16000), 2000)
    print(
        f"scalar call, one instance:  ttft p50 {p50_t:8.1f} us p99 {p99_t:8.1f} us | "
        f"tpot p50 {p50_d:8.1f} us p99 {p99_d:8.1f} us"
    )
    return [figure]


if __name__ == "__main__":
    main()
