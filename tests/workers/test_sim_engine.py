"""The real-time sim engine, driven directly (no gRPC)."""

from __future__ import annotations

import asyncio
import itertools
import statistics

import pytest

from engine.interface import (
    DuplicateRequestError,
    EngineShuttingDownError,
    InvalidRequestError,
    KvHandleError,
)
from engine.outputs import (
    eos_position,
    output_text,
    output_token,
    prompt_digest,
    request_key,
    stop_string_at,
)
from engine.tokenizer import EOS_TOKEN_ID, SimpleTokenizer
from workers.kv_transfer import SimKvHandle
from workers.sim_engine import SimEngine

from .helpers import PREDICTOR, LoadWatcher, drain, make_engine, prompt, sampling


@pytest.fixture
async def engine() -> SimEngine:
    e = make_engine()
    await e.start()
    yield e  # type: ignore[misc]
    await e.stop()


async def test_streams_exactly_max_tokens_with_matching_text(engine: SimEngine) -> None:
    tokens, text, reason, _ = await drain(engine.generate("a", prompt(40), sampling(25)))
    assert len(tokens) == 25
    assert reason == "length"
    assert text == SimpleTokenizer().decode(tokens)
    assert engine.load().num_used_kv_tokens == 0


async def test_tokens_are_a_function_of_the_request_only() -> None:
    a, b = make_engine(seed=1, noise=0.3), make_engine(seed=2, speed_factor=50.0)
    await a.start()
    await b.start()
    try:
        ta = (await drain(a.generate("x", prompt(30), sampling(12, seed=7))))[0]
        tb = (await drain(b.generate("y", prompt(30), sampling(12, seed=7))))[0]
        tc = (await drain(b.generate("z", prompt(30), sampling(12, seed=8))))[0]
    finally:
        await a.stop()
        await b.stop()
    assert ta == tb
    assert ta != tc


async def test_eos_stops_early_unless_ignored() -> None:
    e = make_engine(eos_probability=0.2)
    await e.start()
    try:
        results = [await drain(e.generate(f"r{i}", prompt(20, i), sampling(64))) for i in range(12)]
        ignored = await drain(e.generate("ig", prompt(20, 0), sampling(64, ignore_eos=True)))
    finally:
        await e.stop()
    stopped = [r for r in results if r[2] == "stop"]
    assert stopped, "with p=0.2 over 64 tokens some requests must hit EOS"
    for tokens, _, reason, _ in results:
        if reason == "stop":
            assert tokens[-1] == EOS_TOKEN_ID and EOS_TOKEN_ID not in tokens[:-1]
        else:
            assert len(tokens) == 64
    assert len(ignored[0]) == 64 and ignored[2] == "length"
    # Same request with and without ignore_eos: identical up to where EOS comes.
    eos = eos_position(request_key(0, prompt_digest(prompt(20, 0))), 0.2)
    assert eos is not None
    if eos < 64:
        assert results[0][0] == [*ignored[0][:eos], EOS_TOKEN_ID]


async def test_stop_strings_end_the_stream_without_the_stop_text(engine: SimEngine) -> None:
    full, full_text, _, _ = await drain(engine.generate("full", prompt(30), sampling(60)))
    stop = full_text[20:22]
    cut = full_text.find(stop)
    tokens, text, reason, _ = await drain(engine.generate("cut", prompt(30), sampling(60, stop=(stop,))))
    assert reason == "stop"
    assert text == full_text[:cut]
    assert tokens == full[: cut + len(stop)]


async def test_a_slow_consumer_gets_the_ready_tokens_in_one_delta(engine: SimEngine) -> None:
    watcher = LoadWatcher(engine)
    stream = engine.generate("slow", prompt(10), sampling(30))
    first = await anext(stream)  # admits the request; then do not read while it runs
    await watcher.until(lambda: not engine.core.has_unfinished)
    rest = [d async for d in stream]
    assert len(rest) == 1
    assert len(first.token_ids) + len(rest[0].token_ids) == 30 and rest[0].finished


async def test_abort_ends_the_stream_and_frees_the_kv(engine: SimEngine) -> None:
    stream = engine.generate("a", prompt(100), sampling(1000))
    await anext(stream)
    assert engine.load().num_used_kv_tokens > 0
    assert await engine.abort("a")
    _, _, reason, _ = await drain(stream)
    assert reason == "abort"
    assert engine.load().num_used_kv_tokens == 0
    assert not await engine.abort("a")


async def test_cancelling_the_consumer_aborts_the_request(engine: SimEngine) -> None:
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate("c", prompt(100), sampling(1000)):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    await asyncio.wait([task])
    assert not engine.core.has_unfinished
    assert engine.load().num_used_kv_tokens == 0


async def test_duplicate_in_flight_id_is_refused(engine: SimEngine) -> None:
    stream = engine.generate("dup", prompt(10), sampling(200))
    await anext(stream)
    with pytest.raises(DuplicateRequestError, match="dup"):
        await drain(engine.generate("dup", prompt(10), sampling(5)))
    await engine.abort("dup")
    await drain(stream)
    # Once finished, the id may be used again.
    assert len((await drain(engine.generate("dup", prompt(10), sampling(5))))[0]) == 5


@pytest.mark.parametrize("max_tokens", [1, 2, 17])
async def test_prefill_then_decode_here_equals_generate(engine: SimEngine, max_tokens: int) -> None:
    reference = (await drain(engine.generate("g", prompt(50), sampling(max_tokens))))[0]
    result = await engine.prefill("p", prompt(50), sampling(max_tokens))
    assert result.first_token_id == reference[0]
    if max_tokens == 1:
        assert result.finished and result.finish_reason == "length" and result.kv_handle == b""
        assert engine.load().num_used_kv_tokens == 0
        return
    assert not result.finished and engine.core.is_held("p")
    rest = await drain(
        engine.decode("p", prompt(50), sampling(max_tokens), result.kv_handle, (result.first_token_id,))
    )
    assert [result.first_token_id, *rest[0]] == reference
    assert engine.load().num_used_kv_tokens == 0


async def test_decode_without_handle_recomputes_and_continues(engine: SimEngine) -> None:
    reference = (await drain(engine.generate("g", prompt(50), sampling(20))))[0]
    rest = (await drain(engine.decode("d", prompt(50), sampling(20), b"", tuple(reference[:7]))))[0]
    assert reference[:7] + rest == reference


async def test_kv_hold_timeout_frees_the_kv_and_the_handle_expires() -> None:
    e = make_engine(kv_hold_timeout_s=0.05)
    await e.start()
    try:
        watcher = LoadWatcher(e)
        result = await e.prefill("p", prompt(64), sampling(8))
        assert e.load().num_used_kv_tokens > 0
        await watcher.until(lambda: e.load().num_used_kv_tokens == 0)
        with pytest.raises(KvHandleError, match="no longer held"):
            await drain(e.decode("p", prompt(64), sampling(8), result.kv_handle, (result.first_token_id,)))
    finally:
        await e.stop()


async def test_bad_handles_and_inputs_are_refused(engine: SimEngine) -> None:
    with pytest.raises(InvalidRequestError, match="kv_handle"):
        await drain(engine.decode("d", prompt(5), sampling(5), b"garbage", (1,)))
    other = SimKvHandle("127.0.0.1:1", engine.engine_id, "nope", "00", 5, "ab").encode()
    with pytest.raises(InvalidRequestError, match="different prompt"):
        await drain(engine.decode("d", prompt(5), sampling(5), other, (1,)))
    with pytest.raises(InvalidRequestError, match="prompt"):
        await drain(engine.generate("e", (), sampling(5)))
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        await drain(engine.generate("e", prompt(5), sampling(0)))
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        await drain(engine.generate("e", prompt(5), sampling(5000)))


async def test_requests_after_stop_are_refused() -> None:
    e = make_engine()
    await e.start()
    stream = e.generate("a", prompt(10), sampling(1000))
    await anext(stream)
    await e.stop()
    await e.stop()  # idempotent
    assert (await drain(stream))[2] == "abort"
    with pytest.raises(EngineShuttingDownError):
        await drain(e.generate("b", prompt(10), sampling(5)))


async def test_lone_request_timing_matches_the_profile() -> None:
    speed = 2.0
    e = make_engine(speed_factor=speed)
    await e.start()
    loop = asyncio.get_running_loop()
    try:
        await drain(e.generate("warm-up", prompt(16), sampling(2)))
        times: list[float] = []
        start = loop.time()
        async for delta in e.generate("t", prompt(512), sampling(40)):
            times.extend([loop.time()] * len(delta.token_ids))
    finally:
        await e.stop()
    ttft_ms = (times[0] - start) * 1000
    expected_ttft = float(PREDICTOR.ttft_profile.grid(512.0)) / speed
    assert ttft_ms == pytest.approx(expected_ttft, rel=0.1)
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(times)]
    expected_tpot = PREDICTOR.predict_tpot_ms(1, 532) / speed
    assert statistics.mean(gaps) == pytest.approx(expected_tpot, rel=0.1)


def test_output_tokens_are_printable_ascii() -> None:
    key = request_key(3, b"x" * 16)
    assert all(32 <= output_token(key, i) < 127 for i in range(200))


async def test_prefix_cache_reuses_a_shared_prompt_prefix_and_reports_it() -> None:
    e = make_engine(prefix_cache_block_tokens=32, block_size=16)
    await e.start()
    try:
        shared = prompt(96)
        first = await drain(e.generate("p1", shared + prompt(40, 100), sampling(4)))
        assert e.load().prefix_cache_hit_tokens == 0
        second = await drain(e.generate("p2", shared + prompt(40, 200), sampling(4)))
        load = e.load()
        # The 96 shared tokens are three whole 32-token blocks; the rest differs.
        assert load.prefix_cache_hit_tokens == 96
        assert load.prefix_cache_query_tokens == 2 * 136
        assert load.cache_hit_rate == pytest.approx(96 / 272)
        assert len(first[0]) == len(second[0]) == 4  # the output does not change
        # Prefill: computes only the uncached part (steps report the prefill tokens they ran).
        prefills = [s.num_prefill_tokens for s in load.recent_steps if s.num_prefill_tokens]
        assert prefills[-1] == 136 - 96
    finally:
        await e.stop()


@pytest.mark.parametrize("length", [1, 2, 9, 40, 133])
async def test_the_planned_stop_string_ends_every_path_at_the_planned_length(
    engine: SimEngine, length: int
) -> None:
    """``slo-router bench`` sends a sim fleet the cap and :func:`stop_string_at`: a Generate, a
    Prefill + Decode and a Decode resumed from any prefix (failover) all end at ``length``."""
    p, cap = prompt(30, length), 200
    key = request_key(0, prompt_digest(p))
    stop = stop_string_at(key, length, max_chars=256)
    assert stop is not None
    planned = sampling(cap, stop=(stop,), ignore_eos=True)
    tokens, text, reason, _ = await drain(engine.generate("g", p, planned))
    assert len(tokens) == length and reason == "stop"
    assert tokens == [output_token(key, i) for i in range(length)]
    assert text == output_text(key, length)[: length - len(stop)]
    first = await engine.prefill("p", p, planned)
    if length == 1:
        assert first.finished and first.finish_reason == "stop"
    else:
        assert not first.finished
        rest = (await drain(engine.decode("p", p, planned, first.kv_handle, (first.first_token_id,))))[0]
        assert [first.first_token_id, *rest] == tokens
    # Resumed with the tokens so far, also when the stop string straddles the resume point.
    for done in sorted({1, length // 2, length - 2, length - 1} & set(range(1, length))):
        resumed = await drain(engine.decode(f"r{done}", p, planned, b"", tuple(tokens[:done])))
        assert tokens[:done] + resumed[0] == tokens and resumed[2] == "stop"
