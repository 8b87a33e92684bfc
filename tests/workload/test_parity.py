"""The same workload and seed give the same requests in ``slo-router bench`` and ``slo-router simulate``.

Each side is built the way its command builds it: the real ``slo-router`` parser reads the flags,
then ``bench``'s own planning (:func:`bench.cli.load_source`, :func:`bench.cli.plan_requests`,
what ``bench.cli.run`` replays) and ``simulate``'s (:func:`sim.cli.load_source`,
:func:`sim.cli.run_plans`, what ``sim.cli.run`` hands the sweep) make the plans. They must agree
request for request on everything a run replays: arrival time, class, SLO, priority, prompt (its
length and its token ids), ``max_tokens``, the answer's true length, and the prefix blocks. One
case also runs ``bench`` for real against a loopback router and checks what went over the wire.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import bench.cli
import sim.cli
from bench.loadgen import sent_max_tokens
from fleet.prefix import id_block_hashes, token_block_hashes
from router.cli import build_parser, main
from tests.bench.fake_router import FakeRouter, fake_router_in_thread
from workload.spec import RequestPlan

BURSTY = ("--burstiness", "0.5")
TRACE = Path(__file__).resolve().parents[1] / "data" / "traces" / "mooncake-conversation-head300.jsonl"

WORKLOAD_FILE = """\
name: parity
arrival: {process: gamma, rate_per_s: 3, burstiness: 0.4}
token_id_low: 10
token_id_high: 5000
classes:
  - name: chat
    share: 0.6
    ttft_ms: 700
    tpot_ms: 45
    prompt: lognormal(300,0.8,16,2048)
    output: uniform(8,300)
    max_tokens: 512
    ignore_eos: false
    priority: 2
  - preset: shared-prefix
    share: 0.3
  - name: batch
    share: 0.1
    e2e_ms: 20000
    prompt: fixed(1500)
    output: fixed(64)
"""


def _args(command: str, argv: Sequence[str]) -> argparse.Namespace:
    return build_parser().parse_args([command, *argv])


def bench_plans(argv: Sequence[str]) -> list[RequestPlan]:
    args = _args("bench", argv)
    spec, trace = bench.cli.load_source(args)
    return bench.cli.plan_requests(args, spec, trace)


def simulate_plans(argv: Sequence[str]) -> list[RequestPlan]:
    args = _args("simulate", argv)
    workload, trace, rates = sim.cli.load_source(args)
    assert len(rates) == 1
    return sim.cli.run_plans(args, workload, trace)(workload.with_arrival(rate_per_s=rates[0]), rates[0])


def replayed(plan: RequestPlan) -> tuple[Any, ...]:
    """Everything of a planned request that either command replays."""
    return (
        plan.index,
        plan.arrival_s,
        plan.class_name,
        plan.slo,
        plan.priority,
        plan.prompt_tokens,
        tuple(plan.prompt_token_ids()),
        plan.max_tokens,
        plan.true_output_tokens,
        plan.ignore_eos,
        plan.hash_ids,
        plan.prefix_block_tokens,
    )


def _cases(tmp_path: Path) -> dict[str, tuple[list[str], list[str]]]:
    """name -> (bench flags, simulate flags) naming the same workload, seed, count and rate."""
    path = tmp_path / "parity.yaml"
    path.write_text(WORKLOAD_FILE)
    return {
        "preset": (
            ["--workload", "mixed", "--seed", "11", "--num-requests", "150", "--rate", "6"],
            ["--workload", "mixed", "--seed", "11", "--num-requests", "150", "--rates", "6"],
        ),
        "preset-prefix-bursty": (
            ["--workload", "prefix-heavy", "--seed", "3", "--num-requests", "80", "--rate", "2.5", *BURSTY],
            ["--workload", "prefix-heavy", "--seed", "3", "--num-requests", "80", "--rates", "2.5", *BURSTY],
        ),
        "file": (
            ["--workload", str(path), "--seed", "5", "--num-requests", "120"],
            ["--workload", str(path), "--seed", "5", "--num-requests", "120", "--rates", "3"],
        ),
        "trace-own-timing": (
            ["--workload", f"trace:{TRACE}", "--num-requests", "120", "--trace-speed", "4"],
            ["--workload", f"trace:{TRACE}", "--num-requests", "120", "--trace-speed", "4"],
        ),
        "trace-rescaled": (
            ["--workload", f"trace:{TRACE}", "--seed", "9", "--rate", "7"],
            ["--workload", f"trace:{TRACE}", "--seed", "9", "--rates", "7"],
        ),
    }


CASE_NAMES = ["preset", "preset-prefix-bursty", "file", "trace-own-timing", "trace-rescaled"]


@pytest.mark.parametrize("case", CASE_NAMES)
def test_bench_and_simulate_plan_the_same_requests(tmp_path: Path, case: str) -> None:
    bench_argv, simulate_argv = _cases(tmp_path)[case]
    ours, theirs = bench_plans(bench_argv), simulate_plans(simulate_argv)
    assert len(ours) == len(theirs) > 50
    for a, b in zip(ours, theirs, strict=True):
        assert replayed(a) == replayed(b)
    # Not a vacuous agreement: the plans really vary in what is compared.
    assert len({p.class_name for p in ours}) > 1 or case not in ("preset", "file")
    assert len({p.prompt_tokens for p in ours}) > 10
    assert len({p.arrival_s for p in ours}) > 10


@pytest.mark.parametrize("case", ["preset-prefix-bursty", "trace-own-timing"])
def test_prefix_blocks_mean_the_same_in_both(tmp_path: Path, case: str) -> None:
    """The simulator names a prefix block by its id (``id_block_hashes``); a live router hashes the
    tokens ``bench`` sends (``token_block_hashes``). Over a whole plan the two namings must match
    one for one, so a prefix cache sees exactly the same reuse in both runs."""
    bench_argv, simulate_argv = _cases(tmp_path)[case]
    sent, simulated = bench_plans(bench_argv), simulate_plans(simulate_argv)
    id_to_token: dict[int, int] = {}
    token_to_id: dict[int, int] = {}
    shared = 0
    for live, virtual in zip(sent, simulated, strict=True):
        block = virtual.prefix_block_tokens
        by_id = id_block_hashes(virtual.hash_ids, virtual.prompt_tokens, block)
        by_tokens = token_block_hashes(live.prompt_token_ids(), block)[: len(by_id)]
        assert len(by_tokens) == len(by_id)
        for i, t in zip(by_id, by_tokens, strict=True):
            shared += i in id_to_token
            assert id_to_token.setdefault(i, t) == t
            assert token_to_id.setdefault(t, i) == i
    assert shared > 20  # prompts really share prefix blocks


@pytest.mark.parametrize("command", ["bench", "simulate"])
def test_both_refuse_to_reshape_a_trace(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, "--workload", f"trace:{TRACE}", "--burstiness", "0.5"]) == 2
    assert "a trace replays its own arrivals: drop" in capsys.readouterr().err


def test_bench_sends_the_planned_requests(tmp_path: Path) -> None:
    """``slo-router bench`` for real, against a loopback router: what arrives is simulate's plan."""
    flags = ["--workload", "mixed", "--seed", "4", "--num-requests", "40"]
    planned = simulate_plans([*flags, "--rates", "400"])
    servicer = FakeRouter(token_delay_s=0.0)
    out = tmp_path / "bench.json"
    with fake_router_in_thread(servicer) as address:
        live = ["--target", address, "--rate", "400", "--request-id-prefix", "r-", "--no-progress"]
        code = main(["bench", *flags, *live, "--output", str(out)])
    assert code == 0
    assert json.loads(out.read_text())["meta"]["issued"] == len(planned)
    received = {int(r.request_id.removeprefix("r-")): r for r in servicer.received}
    assert sorted(received) == [p.index for p in planned]
    for plan in planned:
        got = received[plan.index]
        assert list(got.prompt_token_ids) == plan.prompt_token_ids()
        assert got.slo_class == plan.class_name
        assert got.priority == plan.priority
        assert got.sampling.ignore_eos == plan.ignore_eos
        # The one difference in replay, not in the plan: a live engine is told the answer's length
        # through max_tokens when it must ignore EOS; the simulator's router sees the plan's cap.
        assert got.sampling.max_tokens == sent_max_tokens(plan)
