"""The pure parts of the vLLM gRPC protocol: endpoints, the detokenizer, the agent's status and flags."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from slorouter.v1 import cms_pb2, common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2

from cms import limits
from router.core.protocols import VLLM_GRPC, WORKER, dial_endpoint, split_endpoint
from router.tokenize import load_tokenizer
from router.vllm_grpc import Detokenizer, vllm_sampling
from workers.stock_agent import (
    AgentConfig,
    DecodeStepEstimate,
    decode_context_tokens,
    measurement_ms,
    status_from_loads,
)


def test_endpoints_carry_the_protocol_and_worker_endpoints_stay_bare() -> None:
    assert dial_endpoint("h:1", "") == "h:1"
    assert dial_endpoint("h:1", WORKER) == "h:1"
    assert dial_endpoint("h:1", VLLM_GRPC) == "vllm-grpc://h:1"
    assert split_endpoint("vllm-grpc://h:1") == (VLLM_GRPC, "h:1")
    assert split_endpoint("h:1") == (WORKER, "h:1")


def test_the_cms_refuses_an_unknown_worker_protocol() -> None:
    md = cms_pb2.InstanceMetadata(instance_id="a", endpoint="h:1", worker_protocol="http")
    with pytest.raises(limits.FieldLimitError, match="worker_protocol"):
        limits.check_metadata(md)
    md.worker_protocol = VLLM_GRPC
    limits.check_metadata(md)


class _Bytes:
    """A byte-level vocabulary: token i is byte i, decoded as UTF-8 with replacement (like BPE)."""

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


@given(st.text(min_size=0, max_size=40), st.text(min_size=1, max_size=60), st.integers(1, 5))
def test_detokenized_pieces_add_up_to_the_continuations_text(prefix: str, text: str, step: int) -> None:
    tok = _Bytes()
    context = list(prefix.encode())
    ids = list(text.encode())
    detok = Detokenizer(tok.decode, context)
    pieces = [detok.add(ids[i : i + step]) for i in range(0, len(ids), step)]
    # No piece ends inside a character; together they are the text (held-back bytes are released).
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_word_level_pieces_carry_their_leading_space() -> None:
    tok = load_tokenizer(None)
    prompt = tok.encode("hello world")
    out = tok.encode(" again and again")
    detok = Detokenizer(tok.decode, prompt)
    assert "".join(detok.add([t]) for t in out) == tok.decode(prompt + out)[len(tok.decode(prompt)) :]


def test_sampling_keeps_the_requests_fields_with_the_legs_budget() -> None:
    ours = common_pb2.SamplingParams(max_tokens=100, temperature=0.5, top_p=0.9, top_k=5, seed=(1 << 40) + 3)
    ours.stop.append("x")
    theirs = vllm_sampling(ours, 7)
    assert theirs.max_tokens == 7 and theirs.top_k == 5 and list(theirs.stop) == ["x"]
    assert theirs.HasField("temperature") and abs(theirs.temperature - 0.5) < 1e-6
    assert 0 <= theirs.seed < 1 << 31


def test_status_from_loads_sums_ranks_and_dates_the_measurement() -> None:
    loads = vllm_pb2.GetLoadsResponse(timestamp="2026-01-01T00:00:00+00:00")
    loads.loads.add(
        num_running_reqs=3,
        num_waiting_reqs=2,
        token_usage=0.25,
        max_total_num_tokens=1000,
        num_waiting_uncached_tokens=300,
    )
    loads.loads.add(num_running_reqs=1, num_waiting_reqs=0, token_usage=0.5, max_total_num_tokens=1000)
    now_ms = 1_900_000_000_000
    status = status_from_loads("v", loads, 2000, update_id=7, now_ms=now_ms)
    assert (status.num_running_requests, status.num_waiting_requests) == (4, 2)
    assert status.num_used_kv_tokens == 250 + 500
    assert status.num_uncomputed_prefill_tokens == 300
    assert status.schedulable and status.update_id == 7
    assert status.timestamp_ms == 1_767_225_600_000
    sick = status_from_loads(
        "v", loads, 2000, update_id=8, now_ms=now_ms, unschedulable_reason="engine paused"
    )
    assert not sick.schedulable and sick.unschedulable_reason == "engine paused"


def test_status_from_loads_reports_the_ranks_cache_hit_rate_weighted_by_their_work() -> None:
    loads = vllm_pb2.GetLoadsResponse(timestamp="2026-01-01T00:00:00+00:00")
    loads.loads.add(num_running_reqs=3, cache_hit_rate=0.8)
    loads.loads.add(num_running_reqs=0, cache_hit_rate=0.2)
    status = status_from_loads("v", loads, 2000, update_id=1, now_ms=0)
    assert status.cache_hit_rate == pytest.approx((4 * 0.8 + 1 * 0.2) / 5)
    loads.loads.add(num_running_reqs=1, cache_hit_rate=float("nan"))  # a rank that cannot say
    loads.loads.add(num_running_reqs=1, cache_hit_rate=7.0)  # out of range: read as all hits
    status = status_from_loads("v", loads, 2000, update_id=2, now_ms=0)
    assert status.cache_hit_rate == pytest.approx((4 * 0.8 + 1 * 0.2 + 2 * 1.0) / 7)
    assert (
        status_from_loads("v", vllm_pb2.GetLoadsResponse(), 2000, update_id=3, now_ms=0).cache_hit_rate == 0
    )


def test_a_measurement_is_never_dated_in_the_future_nor_unreadable() -> None:
    assert measurement_ms("2099-01-01T00:00:00+00:00", 5) == 5
    assert measurement_ms("not a time", 9) == 9


@pytest.mark.parametrize(
    ("change", "flag"),
    [
        ({"engine": "nohost"}, "--engine"),
        ({"cms": "h:0"}, "--cms"),
        ({"instance_id": ""}, "--instance-id"),
        ({"role": "both"}, "--role"),
        ({"poll_interval_s": 0.0}, "--poll-interval-s"),
        ({"probe_timeout_s": float("nan")}, "--probe-timeout-s"),
        ({"health_interval_s": -1.0}, "--health-interval-s"),
        ({"advertise": "x"}, "--advertise"),
        ({"max_num_batched_tokens": -1}, "--max-num-batched-tokens"),
    ],
)
def test_agent_flags_are_checked_by_name(change: dict[str, object], flag: str) -> None:
    base: dict[str, object] = {"engine": "127.0.0.1:1", "cms": "127.0.0.1:2", "instance_id": "v"}
    with pytest.raises(ValueError, match=flag):
        AgentConfig(**{**base, **change}).check()  # type: ignore[arg-type]


def _engine_timeline(
    batches: list[tuple[int, float, float]], poll_s: float, estimate: DecodeStepEstimate
) -> list[float]:
    """Run a fake engine's steps and poll it as the agent does; the estimated step times (ms).

    ``batches``: (running requests R, step duration d in s, how long the phase lasts in s), R = 0
    for idle. Each step streams R tokens at its end; ``gen_throughput`` is what vLLM's servicer
    reports: the tokens streamed over the last 2 s, divided by 2.
    """
    streamed: list[tuple[float, int]] = []  # (time, tokens)
    phases: list[tuple[float, float, int, float]] = []  # (start, end, R, d)
    t = 0.0
    for running, step_s, length in batches:
        phases.append((t, t + length, running, step_s))
        end = t + length
        if running:
            s = t + step_s
            while s <= end:
                streamed.append((s, running))
                s += step_s
        t = end
    out: list[float] = []
    now = 0.0
    while now <= t:
        running = next((r for a, b, r, _ in phases if a <= now < b), 0)
        window = [n for at, n in streamed if now - 2.0 < at <= now]
        sample = estimate.observe(now, running, running * 100, sum(window) / 2.0)
        if sample is not None:
            out.append(sample.duration_ms)
        now += poll_s
    return out


# No per-example deadline: the simulated timeline is a few thousand steps, slow on a busy host.
@settings(deadline=None)
@given(st.integers(1, 64), st.floats(0.002, 0.2))
def test_the_decode_step_estimate_recovers_a_steady_engines_step_time(running: int, step_s: float) -> None:
    samples = _engine_timeline([(running, step_s, 4.0)], 0.1, DecodeStepEstimate())
    assert samples
    for ms in samples[-5:]:
        # The window holds a whole number of steps: up to one step's tokens of the 2 s are cut.
        assert abs(ms - step_s * 1e3) <= step_s * 1e3 * (0.02 + step_s / 2.0), (ms, step_s)


# No per-example deadline: the simulated timeline is a few thousand steps, slow on a busy host.
@settings(deadline=None)
@given(st.integers(1, 64), st.floats(0.002, 0.05), st.floats(0.5, 0.9))
def test_idle_time_drops_out_of_the_decode_step_estimate(running: int, step_s: float, idle: float) -> None:
    # A batch, an idle stretch, the batch again: the last samples' windows hold the idle stretch
    # and the estimate is still the busy step time (not inflated by the idle share of the window).
    samples = _engine_timeline(
        [(running, step_s, 3.0), (0, 0.0, idle), (running, step_s, 1.0)], 0.1, DecodeStepEstimate()
    )
    assert samples
    for ms in samples[-3:]:
        # Each busy/idle edge costs up to a step of tokens and a poll interval of sampled R.
        assert abs(ms - step_s * 1e3) <= step_s * 1e3 * 0.2 + 2 * step_s * 1e3 * step_s / 0.5, (ms, step_s)


def test_the_decode_step_estimate_is_sent_once_a_quarter_window_not_once_a_poll() -> None:
    # Polled every 0.1 s for 6 s: the window fills at 2 s, then a sample every 0.5 s (each one
    # averages the whole window; one per poll would repeat it and crowd out the prefill samples).
    samples = _engine_timeline([(8, 0.02, 6.0)], 0.1, DecodeStepEstimate())
    assert 8 <= len(samples) <= 9


def test_no_decode_step_estimate_before_the_window_fills_or_when_idle() -> None:
    estimate = DecodeStepEstimate()
    assert _engine_timeline([(8, 0.01, 1.5)], 0.1, estimate) == []  # the first 2 s: G undercounts
    assert _engine_timeline([(0, 0.0, 5.0)], 0.1, DecodeStepEstimate()) == []  # nothing streamed


def test_the_status_carries_the_step_sample() -> None:
    sample = cms_pb2.StepSample(num_decode_requests=4, num_decode_tokens=800, duration_ms=12.5)
    status = status_from_loads(
        "v", vllm_pb2.GetLoadsResponse(), 1000, update_id=1, now_ms=5, step_sample=sample
    )
    assert list(status.step_samples) == [sample]
    assert not status_from_loads("v", vllm_pb2.GetLoadsResponse(), 1000, update_id=1, now_ms=5).step_samples


def test_the_decode_context_is_the_kv_in_use_less_the_running_requests_partly_empty_last_blocks() -> None:
    # Three running requests of 200, 130 and 60 tokens in 128-token blocks: 2 + 2 + 1 blocks.
    used = 5 * 128
    contexts = 200 + 130 + 60
    estimate = decode_context_tokens(used, 3, 128)
    assert abs(estimate - contexts) < abs(used - contexts)
    assert estimate == used - round(3 * 127 / 2)
    assert decode_context_tokens(used, 0, 128) == used  # nothing runs: nothing to take off
    assert decode_context_tokens(used, 3, 0) == used  # block unknown: the KV in use as it is
    assert decode_context_tokens(100, 10, 128) == 0  # never below 0
    loads = vllm_pb2.GetLoadsResponse(timestamp="2026-01-01T00:00:00+00:00")
    loads.loads.add(num_running_reqs=3, token_usage=0.5, max_total_num_tokens=1280)
    status = status_from_loads("v", loads, 1280, update_id=1, now_ms=1_900_000_000_000, block_size=128)
    assert status.num_used_kv_tokens == 640 and status.num_decode_tokens == estimate
