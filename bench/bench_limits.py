"""What the input limits cost on the router hop: ``limits.check_generate_request`` per call.

    python -m bench limits

Every ``Router.Generate`` / ``Router.Schedule`` runs this check before anything
else (cms/limits.py). It is timed on requests of the sizes the router sees
(a 1000-token prompt, a 4000-character text prompt with stop strings, and a
prompt at the 1,048,576-id bound), beside the time the same process takes to
parse the message, which every call pays anyway.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

from slorouter.v1 import common_pb2, router_pb2

from bench.figures import Figure
from cms import limits

_ROUNDS = 2000


def _request(prompt_tokens: int = 0, text: str = "", stops: int = 0) -> router_pb2.GenerateRequest:
    request = router_pb2.GenerateRequest(
        request_id="req-0123456789abcdef",
        model="qwen2.5-7b",
        sampling=common_pb2.SamplingParams(max_tokens=256, temperature=0.7, top_p=0.9),
        slo=common_pb2.SloTarget(ttft_ms=500, tpot_ms=50),
        slo_class="chat",
    )
    if text:
        request.prompt = text
    else:
        request.prompt_token_ids.extend(range(1, prompt_tokens + 1))
    request.sampling.stop.extend(f"stop-{i}" for i in range(stops))
    return request


def _time_us(fn: Callable[[], object], rounds: int) -> tuple[float, float]:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    samples.sort()
    return statistics.median(samples), samples[min(len(samples) - 1, int(0.99 * len(samples)))]


def main() -> list[Figure]:
    cases = {
        "1000 prompt ids": (_request(prompt_tokens=1000), _ROUNDS),
        "4000-char text, 8 stop strings": (_request(text="x" * 4000, stops=8), _ROUNDS),
        f"{limits.MAX_TOKEN_IDS:,} prompt ids (the bound)": (
            _request(prompt_tokens=limits.MAX_TOKEN_IDS),
            20,
        ),
    }
    figures = []
    print("input limits: limits.check_generate_request per call, beside parsing the same message")
    for name, (request, rounds) in cases.items():
        wire = request.SerializeToString()
        check_p50, check_p99 = _time_us(functools.partial(limits.check_generate_request, request), rounds)
        parse_p50, _ = _time_us(functools.partial(router_pb2.GenerateRequest.FromString, wire), rounds)
        print(
            f"  {name:<40} check p50 {check_p50:9.1f} µs  p99 {check_p99:9.1f} µs   "
            f"(parsing it: p50 {parse_p50:9.1f} µs)"
        )
        if name == "1000 prompt ids":
            figures.append(
                Figure(
                    "input limits per request (1000 prompt ids)",
                    f"p50 {check_p50:.1f} µs, p99 {check_p99:.1f} µs (parsing: {parse_p50:.1f} µs)",
                )
            )
    return figures


if __name__ == "__main__":
    main()
