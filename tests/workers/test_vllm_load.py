"""The ``vllm`` backend's parts that need no vLLM: load bookkeeping, kv handle, configuration and flags."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util

import pytest

from engine.interface import EngineLoad, InvalidRequestError
from workers.backends import BackendError
from workers.vllm_engine import (
    VllmEngine,
    VllmEngineConfig,
    VllmKvHandle,
    add_arguments,
    build_engine,
    config_from_args,
    prompt_digest,
    step_stats_from_vllm,
)
from workers.vllm_load import LoadBook, StepStats


def make_book(**kw: int) -> LoadBook:
    book = LoadBook(**kw)
    book.kv_capacity_tokens = 1000
    return book


def step(
    running: int = 0,
    waiting: int = 0,
    kv: float = 0.0,
    *,
    num_prefill_tokens: int | None = None,
    num_decode_requests: int | None = None,
    duration_ms: float | None = None,
) -> StepStats:
    return StepStats(running, waiting, kv, num_prefill_tokens, num_decode_requests, duration_ms)


# ---------------------------------------------------------------------- LoadBook


def test_admitted_request_is_waiting_backlog_until_vllm_reports() -> None:
    book = make_book()
    book.admit("a", 300)
    load = book.load(schedulable=True)
    assert (load.num_waiting_requests, load.num_running_requests) == (1, 0)
    assert load.num_uncomputed_prefill_tokens == 300
    assert load.num_decode_requests == 0
    assert load.recent_admitted_request_ids == ("a",)


def test_step_prefill_tokens_are_handed_out_first_come_first_served() -> None:
    book = make_book()
    book.admit("a", 300)
    book.admit("b", 200)
    book.on_step(step(running=2, num_prefill_tokens=400, num_decode_requests=0, duration_ms=5.0))
    load = book.load(schedulable=True)
    # a is done (300), b got the remaining 100.
    assert load.num_uncomputed_prefill_tokens == 100
    assert (load.num_waiting_requests, load.num_running_requests) == (0, 2)
    assert load.recent_steps[-1].num_prefill_tokens == 400
    assert load.num_steps == 1


def test_first_output_moves_a_request_to_decode_with_its_context() -> None:
    book = make_book()
    book.admit("a", 100)
    book.on_output("a", 1)
    book.on_output("a", 2)
    load = book.load(schedulable=True)
    assert load.num_uncomputed_prefill_tokens == 0
    assert (load.num_decode_requests, load.num_decode_tokens) == (1, 103)


def test_pd_decode_counts_as_decode_from_admission_minus_transferred_kv() -> None:
    book = make_book()
    book.admit("d", 301, num_cached_tokens=256, decode_stage=True)
    load = book.load(schedulable=True)
    assert load.num_uncomputed_prefill_tokens == 45
    assert (load.num_decode_requests, load.num_decode_tokens) == (1, 301)


def test_release_and_stale_vllm_counts_never_report_more_than_is_in_flight() -> None:
    book = make_book()
    book.admit("a", 10)
    book.admit("b", 10)
    book.on_step(step(running=2, waiting=0, kv=0.5))
    assert book.load(schedulable=True).num_used_kv_tokens == 500
    assert book.release("a")
    assert not book.release("a")
    load = book.load(schedulable=True)
    assert (load.num_running_requests, load.num_waiting_requests) == (1, 0)
    book.release("b")
    load = book.load(schedulable=True)
    assert (load.num_running_requests, load.num_used_kv_tokens, load.num_uncomputed_prefill_tokens) == (
        0,
        0,
        0,
    )


def test_decode_context_of_a_step_scales_when_vllm_batch_differs() -> None:
    book = make_book()
    for rid in ("a", "b"):
        book.admit(rid, 100)
        book.on_output(rid, 1)
    book.on_step(step(running=2, num_prefill_tokens=0, num_decode_requests=2, duration_ms=1.0))
    book.on_step(step(running=2, num_prefill_tokens=0, num_decode_requests=1, duration_ms=1.0))
    first, second = book.load(schedulable=True).recent_steps
    assert first.num_decode_tokens == 202
    assert second.num_decode_tokens == 101


def test_windows_are_bounded_and_steps_without_details_are_not_samples() -> None:
    book = make_book(max_recent_admitted_ids=3, max_recent_steps=2)
    for i in range(5):
        book.admit(f"r{i}", 1)
    for _ in range(4):
        book.on_step(step(num_prefill_tokens=0, num_decode_requests=0, duration_ms=1.0))
    book.on_step(step())
    load = book.load(schedulable=False)
    assert load.recent_admitted_request_ids == ("r2", "r3", "r4")
    assert len(load.recent_steps) == 2
    assert load.num_steps == 4
    assert not load.schedulable


def test_loads_compare_equal_only_when_nothing_changed() -> None:
    book = make_book()
    # (vLLM's wrapper counts preemptions from its start: 0, where the default says "not counted".)
    assert book.load(schedulable=True) == EngineLoad(schedulable=True, num_preemptions=0)
    book.admit("a", 5)
    assert book.load(schedulable=True) != EngineLoad(schedulable=True)


def test_step_stats_read_vllm_shaped_objects() -> None:
    @dataclasses.dataclass
    class Details:
        num_ctx_tokens: int = 45
        num_generation_requests: int = 3
        elapsed_ms: float = 2.5
        is_dummy: bool = False

    @dataclasses.dataclass
    class Scheduler:
        num_running_reqs: int = 3
        num_waiting_reqs: int = 1
        kv_cache_usage: float = 0.25
        iteration_details: Details | None = dataclasses.field(default_factory=Details)

    stats = step_stats_from_vllm(Scheduler())
    assert stats == StepStats(3, 1, 0.25, num_prefill_tokens=45, num_decode_requests=3, duration_ms=2.5)
    assert (
        step_stats_from_vllm(Scheduler(iteration_details=Details(is_dummy=True))).num_prefill_tokens is None
    )


def test_the_book_counts_vllms_preemptions_from_its_iteration_stats() -> None:
    from workers.vllm_engine import preempted_requests

    @dataclasses.dataclass
    class Iteration:
        num_preempted_reqs: int = 2

    assert preempted_requests(Iteration()) == 2
    assert preempted_requests(None) == 0  # a step without iteration statistics
    book = LoadBook()
    assert book.load(schedulable=True).num_preemptions == 0  # counted from the start: 0, not unknown
    book.on_preempted(preempted_requests(Iteration()))
    book.on_preempted(preempted_requests(Iteration(1)))
    assert book.load(schedulable=True).num_preemptions == 3


def test_the_book_counts_what_vllms_preempted_requests_recompute_once_its_prefix_cache_shows() -> None:
    from workers.vllm_engine import preemption_recompute_tokens

    @dataclasses.dataclass
    class PrefixCache:
        queries: int = 0
        preempted_queries: int = 0
        preempted_hits: int = 0

    @dataclasses.dataclass
    class Scheduler:
        prefix_cache_stats: PrefixCache | None

    assert preemption_recompute_tokens(Scheduler(PrefixCache(100, 300, 200))) == 100
    assert preemption_recompute_tokens(Scheduler(PrefixCache(100))) == 0  # it caches; nothing preempted
    assert preemption_recompute_tokens(Scheduler(PrefixCache())) is None  # no lookup: no caching shown
    assert preemption_recompute_tokens(Scheduler(None)) is None
    book = LoadBook()
    assert book.load(schedulable=True).num_preemption_recompute_tokens is None  # not known yet
    book.on_recomputed(0)
    assert book.load(schedulable=True).num_preemption_recompute_tokens == 0
    book.on_recomputed(100)
    book.on_recomputed(40)
    assert book.load(schedulable=True).num_preemption_recompute_tokens == 140


# ---------------------------------------------------------------------- kv handle


def test_kv_handle_round_trips_and_counts_whole_blocks_only() -> None:
    handle = VllmKvHandle(
        prompt_digest=prompt_digest([1, 2, 3]),
        num_prompt_tokens=300,
        block_size=128,
        connector="NixlConnector",
        kv_transfer_params={"do_remote_prefill": True, "remote_block_ids": [1, 2]},
    )
    assert VllmKvHandle.decode(handle.encode()) == handle
    assert handle.num_transferable_tokens == 256
    assert dataclasses.replace(handle, num_prompt_tokens=256).num_transferable_tokens == 128
    assert dataclasses.replace(handle, num_prompt_tokens=1).num_transferable_tokens == 0


@pytest.mark.parametrize(
    "data",
    [
        b"garbage",
        b"\xff\xfe",
        b"[]",
        b'{"format": "slo-router.sim-kv.v1"}',
        b'{"format": "slo-router.vllm-kv.v1"}',
    ],
)
def test_a_foreign_kv_handle_is_rejected_naming_the_field(data: bytes) -> None:
    with pytest.raises(InvalidRequestError, match="kv_handle"):
        VllmKvHandle.decode(data)


def test_prompt_digest_depends_on_every_token() -> None:
    assert prompt_digest([1, 2, 3]) != prompt_digest([1, 2, 4])
    assert prompt_digest([1, 2, 3]) != prompt_digest([3, 2, 1])
    assert prompt_digest([1, 2, 3]) == prompt_digest((1, 2, 3))


# ---------------------------------------------------------------------- configuration and flags


def test_every_config_field_is_documented() -> None:
    missing = [f.name for f in dataclasses.fields(VllmEngineConfig) if not f.metadata.get("doc")]
    assert not missing


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"model": ""}, "model"),
        ({"max_num_seqs": -1}, "max_num_seqs"),
        ({"kv_role": "kv_sender", "kv_connector": "ExampleConnector"}, "kv_role"),
        ({"kv_role": "kv_producer"}, "kv_role"),
        ({"kv_shared_dir": "/tmp/x", "kv_connector": "NixlConnector"}, "kv_shared_dir"),
        ({"max_recent_steps": 0}, "max_recent_steps"),
    ],
)
def test_bad_config_names_the_field(overrides: dict[str, object], field: str) -> None:
    values: dict[str, object] = {"model": "/m"}
    values.update(overrides)
    with pytest.raises(ValueError, match=field):
        VllmEngineConfig(**values)  # type: ignore[arg-type]


def test_example_connector_runs_as_the_guarded_subclass() -> None:
    config = VllmEngineConfig(
        model="/m", kv_connector="ExampleConnector", kv_role="kv_consumer", kv_shared_dir="/shared"
    )
    assert config.kv_transfer_config() == {
        "kv_connector": "GuardedExampleConnector",
        "kv_connector_module_path": "workers.vllm_connector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"shared_storage_path": "/shared"},
    }
    nixl = VllmEngineConfig(model="/m", kv_connector="NixlConnector", kv_role="kv_producer")
    assert nixl.kv_transfer_config() == {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
    assert VllmEngineConfig(model="/m").kv_transfer_config() is None


def parse(*argv: str, role: str = "neutral") -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", default=role)
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_build_engine_args_and_kv_role_follows_the_worker_role() -> None:
    args = parse(
        "--model", "/models/tiny", "--max-num-seqs", "4", "--enforce-eager", "--kv-connector", "ExampleConnector",
        "--kv-shared-dir", "/shared", "--role", "decode",
        "--vllm-arg", "seed=7", "--vllm-arg", "block-size=128", "--vllm-arg", "tokenizer_mode=slow",
    )  # fmt: skip
    kwargs = config_from_args(args).engine_kwargs()
    assert kwargs["model"] == "/models/tiny"
    assert kwargs["max_num_seqs"] == 4
    assert kwargs["enforce_eager"] is True
    assert "max_model_len" not in kwargs  # 0 = vLLM's default
    assert (kwargs["seed"], kwargs["block_size"], kwargs["tokenizer_mode"]) == (7, 128, "slow")
    assert kwargs["kv_transfer_config"]["kv_role"] == "kv_consumer"
    assert kwargs["enable_logging_iteration_details"] is True
    # vLLM's default stat loggers are off; the engine passes its own step listener instead.
    assert kwargs["disable_log_stats"] is True
    assert parse("--model", "m", "--kv-connector", "X", role="prefill").kv_connector == "X"
    assert (
        config_from_args(parse("--model", "m", "--kv-connector", "X", role="prefill")).kv_role
        == "kv_producer"
    )
    assert config_from_args(parse("--model", "m", "--kv-connector", "X")).kv_role == "kv_both"
    assert config_from_args(parse("--model", "m")).kv_role == ""


def test_missing_model_and_bad_vllm_arg_are_flag_errors() -> None:
    with pytest.raises(ValueError, match="model"):
        build_engine(parse())
    with pytest.raises(SystemExit):
        parse("--model", "m", "--vllm-arg", "novalue")


def test_build_engine_without_vllm_says_where_to_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(BackendError, match="make vllm-venv"):
        build_engine(parse("--model", "/m"))


def test_info_before_start_is_provisional_and_requests_are_refused() -> None:
    engine = VllmEngine(config_from_args(parse("--model", "/m", "--max-model-len", "512")))
    info = engine.info
    assert (info.model, info.max_model_len, info.kv_capacity_tokens, info.block_size) == ("/m", 512, 0, 0)
    assert not engine.load().schedulable
