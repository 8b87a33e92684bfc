"""``slo-router profile``: measure a live worker and write TTFT/TPOT profiles in the seed schema.

Everything goes through the Worker service, so any backend can be profiled:

- TTFT, per prompt length: ``Generate`` with ``max_tokens=1`` on an idle
  instance, one request at a time; the latency is from sending the request to
  receiving its token.
- TPOT, per (batch size, tokens per request): ``batch`` concurrent
  ``Generate`` streams with prompts of that length and ``ignore_eos``; the
  samples are the gaps between consecutive tokens of a stream once every
  stream of the batch has its first token (so no prefill shares those steps).
  A message carrying k tokens after a gap g counts as k gaps of g/k.

Prompts are fresh random token ids (seeded), so no prefix cache can shorten
a prefill. Each point records mean, p50, p95 and p99 in milliseconds; the
router's predictor reads p50.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
from slorouter.v1 import cms_pb2, common_pb2, worker_pb2, worker_pb2_grpc
from tqdm import tqdm

from cms import limits
from cms.transport import message_size_options, open_channel


def _doc(text: str) -> dict[str, Any]:
    return {"doc": text}


@dataclass(frozen=True)
class ProfilePlan:
    """What ``slo-router profile`` measures."""

    tokens: tuple[int, ...] = field(
        default=(128, 256, 512, 1024, 2048), metadata=_doc("prompt lengths of the TTFT profile (tokens)")
    )
    batch_sizes: tuple[int, ...] = field(
        default=(1, 2, 4, 8, 16), metadata=_doc("decode batch sizes of the TPOT grid")
    )
    tokens_per_request: tuple[int, ...] = field(
        default=(128, 512, 1024), metadata=_doc("context lengths of the TPOT grid (tokens per request)")
    )
    repeats: int = field(
        default=5, metadata=_doc("TTFT requests per prompt length; TPOT batches per grid point")
    )
    decode_tokens: int = field(default=16, metadata=_doc("output tokens per request in the TPOT runs"))
    max_token_id: int = field(default=999, metadata=_doc("prompt token ids are drawn from 1..max_token_id"))
    timeout_s: float = field(default=300.0, metadata=_doc("deadline of each measuring call"))
    seed: int = field(default=0, metadata=_doc("seed of the random prompts"))

    def __post_init__(self) -> None:
        for name in ("tokens", "batch_sizes", "tokens_per_request"):
            values = getattr(self, name)
            if not values or any(v <= 0 for v in values) or len(set(values)) != len(values):
                raise ValueError(f"{name} must be distinct positive integers, got {list(values)}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.decode_tokens < 3:
            raise ValueError(
                f"decode_tokens must be >= 3 (gaps between tokens are measured), got {self.decode_tokens}"
            )
        if self.max_token_id < 1 or not self.timeout_s > 0:
            raise ValueError("max_token_id must be >= 1 and timeout_s > 0")


class Progress:
    """Progress of a profiling run on a text stream (stderr by default).

    On a terminal, a tqdm bar redrawn in place; otherwise (a log file, a pipe)
    one short line each time the measured point changes, never a carriage return.
    """

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self._total = max(1, total)
        self._done = 0
        self._stream = stream if stream is not None else sys.stderr
        self._label = ""
        self._bar: tqdm[Any] | None = None
        if getattr(self._stream, "isatty", lambda: False)():
            self._bar = tqdm(
                total=self._total, file=self._stream, desc="profiling", unit="sample", leave=True
            )

    def advance(self, label: str) -> None:
        self._done += 1
        if self._bar is not None:
            self._bar.set_postfix_str(label, refresh=False)
            self._bar.update(1)
            if self._done >= self._total:
                self._bar.close()
            return
        if label != self._label or self._done >= self._total:
            self._label = label
            self._stream.write(f"profiling {self._done}/{self._total}: {label}\n")
            self._stream.flush()


def summarize(samples_ms: Sequence[float]) -> dict[str, float]:
    """mean, p50, p95 and p99 of the samples (ms), rounded to microseconds."""
    a = np.asarray(samples_ms, dtype=np.float64)
    return {
        "mean": round(float(a.mean()), 4),
        "p50": round(float(np.percentile(a, 50)), 4),
        "p95": round(float(np.percentile(a, 95)), 4),
        "p99": round(float(np.percentile(a, 99)), 4),
    }


class WorkerProfiler:
    """Measures one worker through a Worker stub."""

    def __init__(self, stub: worker_pb2_grpc.WorkerAsyncStub, plan: ProfilePlan) -> None:
        self._stub = stub
        self._plan = plan
        self._rng = random.Random(plan.seed)
        self._next_id = 0

    def _prompt(self, n: int) -> list[int]:
        hi = self._plan.max_token_id
        return [self._rng.randint(1, hi) for _ in range(n)]

    def _request_id(self) -> str:
        self._next_id += 1
        return f"profile-{self._plan.seed}-{self._next_id}-{time.monotonic_ns()}"

    async def ttft_ms(self, num_tokens: int) -> float:
        """One TTFT sample: send a prompt of ``num_tokens``, time its first token."""
        request = worker_pb2.WorkerGenerateRequest(
            request_id=self._request_id(),
            prompt_token_ids=self._prompt(num_tokens),
            sampling=common_pb2.SamplingParams(max_tokens=1, ignore_eos=True),
        )
        start = time.perf_counter()
        call = self._stub.Generate(request, timeout=self._plan.timeout_s)
        try:
            async for message in call:
                if message.token_ids:
                    return (time.perf_counter() - start) * 1000.0
        finally:
            call.cancel()
        raise RuntimeError(f"the worker ended a {num_tokens}-token request without a token")

    async def _timed_stream(self, prompt: list[int], out: list[tuple[float, int]]) -> None:
        request = worker_pb2.WorkerGenerateRequest(
            request_id=self._request_id(),
            prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(max_tokens=self._plan.decode_tokens, ignore_eos=True),
        )
        call = self._stub.Generate(request, timeout=self._plan.timeout_s)
        try:
            async for message in call:
                if message.token_ids:
                    out.append((time.perf_counter(), len(message.token_ids)))
        finally:
            call.cancel()

    async def tpot_gaps_ms(self, batch_size: int, tokens_per_request: int) -> list[float]:
        """Inter-token gaps of one batch of concurrent streams, once all of them decode."""
        arrivals: list[list[tuple[float, int]]] = [[] for _ in range(batch_size)]
        prompts = [self._prompt(tokens_per_request) for _ in range(batch_size)]
        await asyncio.gather(*(self._timed_stream(p, a) for p, a in zip(prompts, arrivals, strict=True)))
        if any(not a for a in arrivals):
            raise RuntimeError("a profiling stream ended without tokens")
        all_decoding = max(a[0][0] for a in arrivals)
        gaps: list[float] = []
        for stream in arrivals:
            for (prev, _), (now, count) in itertools.pairwise(stream):
                if prev >= all_decoding:
                    gaps.extend([(now - prev) * 1000.0 / count] * count)
        return gaps


def _check_fits(info: cms_pb2.InstanceMetadata, plan: ProfilePlan) -> None:
    limit = info.max_model_len
    too_long = [
        t for t in (*plan.tokens, *plan.tokens_per_request) if limit and t + plan.decode_tokens > limit
    ]
    if too_long:
        raise ValueError(
            f"prompt lengths {sorted(set(too_long))} + {plan.decode_tokens} output tokens exceed the worker's "
            f"max_model_len {limit}; pass smaller --tokens / --tokens-per-request"
        )
    capacity = info.kv_capacity_tokens
    over = [
        (b, t)
        for b in plan.batch_sizes
        for t in plan.tokens_per_request
        if capacity and b * (t + plan.decode_tokens) > capacity
    ]
    if over:
        listed = ", ".join(f"{b}x{t}" for b, t in over[:8])
        raise ValueError(
            f"batches {listed} do not fit the worker's KV capacity of {capacity} tokens (they would be "
            "preempted, not measured); pass smaller --batch-sizes / --tokens-per-request"
        )


async def profile_worker(
    target: str,
    plan: ProfilePlan,
    *,
    progress_stream: TextIO | None = None,
    now: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.UTC),
    call_token: str | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Measure the worker at ``target`` (``host:port``); the TTFT and TPOT documents.

    ``call_token``: the worker token (``--worker-auth-token-file``) a worker started with one requires.
    """
    sizes = message_size_options(limits.SERVING_MAX_MESSAGE_BYTES, limits.SERVING_MAX_MESSAGE_BYTES)
    async with open_channel(target, sizes, call_token=call_token) as channel:
        stub: worker_pb2_grpc.WorkerAsyncStub = worker_pb2_grpc.WorkerStub(channel)
        info = await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=plan.timeout_s)
        _check_fits(info, plan)
        profiler = WorkerProfiler(stub, plan)
        total = (
            len(plan.tokens) * plan.repeats
            + len(plan.batch_sizes) * len(plan.tokens_per_request) * plan.repeats
        )
        bar = Progress(total + 1, progress_stream)
        await profiler.ttft_ms(min(plan.tokens))  # warm-up, not recorded
        bar.advance("warm-up")
        ttft_results = []
        for n in sorted(plan.tokens):
            samples = []
            for _ in range(plan.repeats):
                samples.append(await profiler.ttft_ms(n))
                bar.advance(f"ttft {n} tokens")
            ttft_results.append({"tokens_num": n, **summarize(samples)})
        tpot_results = []
        for b in sorted(plan.batch_sizes):
            for t in sorted(plan.tokens_per_request):
                gaps: list[float] = []
                for _ in range(plan.repeats):
                    gaps.extend(await profiler.tpot_gaps_ms(b, t))
                    bar.advance(f"tpot batch {b} x {t} tokens")
                if not gaps:
                    raise RuntimeError(f"no decode gaps measured for batch {b} x {t} tokens")
                tpot_results.append({"batch_size": b, "tokens_per_request": t, **summarize(gaps)})
    stamp = now().strftime("%Y-%m-%dT%H:%M:%SZ")
    model = info.model or "unknown"
    common = (
        f"Measured by `slo-router profile` through the Worker service of {target} "
        f"(instance {info.instance_id or '?'}, chunk budget {info.max_num_batched_tokens} tokens); "
    )
    ttft_doc = {
        "metadata": {
            "model": model,
            "timestamp": stamp,
            "description": common
            + f"TTFT of one request on an idle instance, {plan.repeats} per prompt length, milliseconds.",
        },
        "results": ttft_results,
    }
    tpot_doc = {
        "metadata": {
            "model": model,
            "timestamp": stamp,
            "description": common
            + f"TPOT as inter-token gaps of `batch_size` concurrent streams of {plan.decode_tokens} tokens "
            f"once all decode, {plan.repeats} batch(es) per point, milliseconds.",
        },
        "results": tpot_results,
    }
    return ttft_doc, tpot_doc


def write_profiles(
    out_dir: str | Path, ttft_doc: dict[str, Any], tpot_doc: dict[str, Any]
) -> tuple[Path, Path]:
    """Write ``ttft.json`` and ``tpot.json`` into ``out_dir`` (created if needed)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ttft_path, tpot_path = out / "ttft.json", out / "tpot.json"
    ttft_path.write_text(json.dumps(ttft_doc, indent=1) + "\n", encoding="utf-8")
    tpot_path.write_text(json.dumps(tpot_doc, indent=1) + "\n", encoding="utf-8")
    return ttft_path, tpot_path
