"""The same workload and seed give the same requests in ``slo-router bench`` and ``slo-router simulate``.

Each side is built the way its command builds it: the real ``slo-router`` parser reads the flags,
then ``bench``'s own planning (:func:`bench.cli.load_source`, :func:`bench.cli.plan_requests`,
what ``bench.cli.run`` replays) and ``simulate``'s (:func:`sim.cli.load_source`,
:func:`sim.cli.run_plans`, what ``sim.cli.run`` hands the sweep) make the plans. They must agree
request for request on everything a run replays: arrival time, class, SLO, priority, prompt (its
length and its token ids), ``max_tokens``, the answer's true length, and the prefix blocks.

Then what ``bench`` puts on the wire: against sim engines (``--engine sim``, the default) the
router is told what ``simulate`` tells it, the plan's cap, and the answer still ends at its true
length, by a stop string the sim engine's output first contains there; a loopback router over sim
workers (PD and neutral) streams every answer at exactly its planned length.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from slorouter.v1 import router_pb2

import bench.cli
import sim.cli
from bench.loadgen import LoadConfig, build_request
from engine.model import SimConfig
from engine.outputs import output_text, prompt_digest, request_key
from fleet.prefix import id_block_hashes, token_block_hashes
from router.cli import build_parser, main
from router.core.config import SchedulerConfig
from sim.cluster import SimFleet, simulate
from sim.fleet import fleet_from_counts
from tests.bench.fake_router import FakeRouter, fake_router_in_thread
from tests.router.e2e.cluster import embedded_cluster
from workload.spec import RequestPlan, SloTarget

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


@pytest.mark.parametrize("engine", ["sim", "vllm"])
def test_bench_sends_the_planned_requests(tmp_path: Path, engine: str) -> None:
    """``slo-router bench`` for real, against a loopback router: what arrives is simulate's plan."""
    flags = ["--workload", "mixed", "--seed", "4", "--num-requests", "40"]
    planned = simulate_plans([*flags, "--rates", "400"])
    servicer = FakeRouter(token_delay_s=0.0)
    out = tmp_path / "bench.json"
    with fake_router_in_thread(servicer) as address:
        live = ["--target", address, "--rate", "400", "--request-id-prefix", "r-", "--no-progress"]
        code = main(["bench", *flags, *live, "--engine", engine, "--output", str(out)])
    assert code == 0
    assert json.loads(out.read_text())["meta"]["issued"] == len(planned)
    received = {int(r.request_id.removeprefix("r-")): r for r in servicer.received}
    assert sorted(received) == [p.index for p in planned]
    shorter = 0
    for plan in planned:
        got = received[plan.index]
        assert list(got.prompt_token_ids) == plan.prompt_token_ids()
        assert got.slo_class == plan.class_name
        assert got.priority == plan.priority
        assert got.sampling.ignore_eos == plan.ignore_eos
        length = plan.true_output_tokens
        shorter += length < plan.max_tokens
        if engine == "sim":
            # The router sees what simulate gives it, the cap; the answer's length travels only as
            # a stop string that the sim engine's output first contains at that length.
            assert got.sampling.max_tokens == plan.max_tokens
            if length < plan.max_tokens:
                (stop,) = got.sampling.stop
                text = output_text(request_key(0, prompt_digest(plan.prompt_token_ids())), plan.max_tokens)
                assert text.find(stop) + len(stop) == length
            else:
                assert not got.sampling.stop
        else:
            # A real model can only be told a length through max_tokens (with ignore_eos).
            assert got.sampling.max_tokens == (length if plan.ignore_eos else plan.max_tokens)
            assert not got.sampling.stop
    assert shorter > len(planned) // 2  # the cap and the length really differ


@contextmanager
def cluster_in_thread(**kwargs: Any) -> Iterator[str]:
    """A router over sim workers (:func:`embedded_cluster`) on its own event loop in a thread, so
    the synchronous ``slo-router bench`` can drive it; yields the router's address."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    address: list[str] = []
    failure: list[BaseException] = []
    stop: asyncio.Event | None = None

    async def serve() -> None:
        nonlocal stop
        stop = asyncio.Event()
        async with embedded_cluster(**kwargs) as cluster:
            address.append(cluster.router.address)
            ready.set()
            await stop.wait()

    def run() -> None:
        try:
            loop.run_until_complete(serve())
        except BaseException as exc:  # reported to the test below
            failure.append(exc)
            ready.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert ready.wait(timeout=60), "the cluster did not start"
        assert not failure, failure
        yield address[0]
    finally:
        if stop is not None:
            loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=60)
        loop.close()


#: Sim workers fast enough for a short test, and large enough for the mixed preset's caps.
FAST_ENGINES = {"speed_factor": 50.0, "max_model_len": 8192, "kv_capacity_tokens": 131072}


@pytest.mark.parametrize(
    ("mode", "engine"),
    [("pd", "sim"), ("neutral", "sim"), ("neutral", "vllm")],
    ids=["pd", "neutral", "vllm"],
)
def test_a_live_router_streams_each_answer_at_its_planned_length(
    tmp_path: Path, mode: str, engine: str
) -> None:
    """Over a real router and sim workers, every answer has exactly the plan's length, and its
    finish reason and usage say how it ended: ``--engine sim`` sends the cap, so an answer shorter
    than it ends on the stop string ("stop"); ``--engine vllm`` sends the length ("length")."""
    flags = ["--workload", "mixed", "--seed", "2", "--num-requests", "24", "--rate", "12"]
    planned = bench_plans(flags)
    roles = {"prefill": 1, "decode": 1} if mode == "pd" else {"neutral": 2}
    out = tmp_path / "bench.json"
    # The profile's predictions, not the calibration's: the workers' measured steps follow the host,
    # and on a loaded one a refit may judge a long prompt out of its TTFT target at arrival.
    uncalibrated = {"calibration": "off"}
    with cluster_in_thread(
        policy="load-balance", engine_overrides=FAST_ENGINES, scheduler_overrides=uncalibrated, **roles
    ) as address:
        live = ["--target", address, "--engine", engine, "--no-progress", "--output", str(out)]
        assert main(["bench", *flags, *live]) == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["engine"] == engine
    results = {r["index"]: r for r in doc["requests"]}
    assert sorted(results) == [p.index for p in planned]
    # No error but refusals at arrival: among others, usage agreed with the stream and the length
    # with the plan. (Before any answer has finished the router costs a request by its cap, as in
    # simulate: a 4 s e2e target may look out of reach then.)
    refused = {i for i, r in results.items() if r["error_code"] == "RESOURCE_EXHAUSTED" and not r["ttft_ms"]}
    assert doc["overall"]["errors"] == len(refused) <= len(planned) // 4, doc["overall"][
        "first_error_by_code"
    ]
    stopped = 0
    for plan in planned:
        r = results[plan.index]
        if plan.index in refused:
            continue
        assert r["completion_tokens"] == plan.true_output_tokens
        shorter = plan.true_output_tokens < plan.max_tokens
        stopped += shorter
        assert r["finish_reason"] == ("stop" if shorter and engine == "sim" else "length")
        if mode == "pd":
            assert r["prefill_instance_id"] == "prefill-0" and r["decode_instance_id"] == "decode-0"
    assert stopped > len(planned) // 2
    # Judged as before: attainment, goodput and tokens from the measured streams.
    completed = sum(p.true_output_tokens for p in planned if p.index not in refused)
    assert doc["overall"]["completion_tokens"] == completed


def test_an_eos_ends_the_same_answers_live_and_simulated(tmp_path: Path) -> None:
    """Classes without ``ignore_eos`` on engines with an ``eos_probability``: the simulator draws
    each EOS as the sim worker does (from the prompt's tokens and the seed bench sends), so live and
    simulated runs cut the same answers at the same token."""
    path = tmp_path / "parity.yaml"
    path.write_text(WORKLOAD_FILE)
    flags = ["--workload", str(path), "--seed", "5", "--num-requests", "24", "--rate", "12"]
    planned = bench_plans(flags)
    eos = 0.01
    fleet = SimFleet(fleet_from_counts(neutral=2, engine=SimConfig(eos_probability=eos)))
    outcome = simulate(fleet, SchedulerConfig(scheduling_policy="load-balance"), planned, seed=0)
    simulated = {r.index: r.completion_tokens for r in outcome.results if r.ok}
    out = tmp_path / "bench.json"
    engines = {**FAST_ENGINES, "eos_probability": eos}
    with cluster_in_thread(policy="load-balance", engine_overrides=engines, neutral=2) as address:
        live = ["--target", address, "--no-progress", "--output", str(out)]
        assert main(["bench", *flags, *live]) == 0
    doc = json.loads(out.read_text())
    streamed = {r["index"]: r["completion_tokens"] for r in doc["requests"] if r["error_code"] is None}
    # Either run may refuse a request at arrival (each predicts with its own clock); the rest agree.
    assert {r["error_code"] for r in doc["requests"]} <= {None, "RESOURCE_EXHAUSTED"}
    both = streamed.keys() & simulated.keys()
    assert len(both) >= 0.75 * len(planned)
    assert {i: streamed[i] for i in both} == {i: simulated[i] for i in both}
    cut = [p for p in planned if p.index in both and streamed[p.index] < p.true_output_tokens]
    assert cut and all(not p.ignore_eos for p in cut)  # some answers really ended at an EOS


async def test_a_decode_failover_keeps_the_planned_length() -> None:
    """The stop string travels with the request: killing the decode worker mid-answer, the router
    resumes on the other decoder with the tokens so far, and the answer still ends at its planned
    length, not at the cap the router was given."""
    plan = RequestPlan(0, 0.0, "c", 64, 400, SloTarget(), prompt_seed=5, output_tokens=150)
    request = build_request(plan, LoadConfig(engine="sim"))
    assert request.sampling.max_tokens == 400 and len(request.sampling.stop) == 1
    async with embedded_cluster(prefill=1, decode=2, engine_overrides={"speed_factor": 5.0}) as cluster:
        tokens: list[int] = []
        last = None
        killed = False
        async for message in cluster.stub.Generate(request, timeout=60):
            if message.HasField("route"):
                decoder = message.route.decode_instance_id
            tokens.extend(message.token_ids)
            last = message
            if not killed and len(tokens) >= 10:
                await cluster.kill_worker(decoder)
                killed = True
    assert killed and last is not None
    key = request_key(0, prompt_digest(plan.prompt_token_ids()))
    assert bytes(tokens).decode() == output_text(key, 150)
    assert last.finished and last.finish_reason == "stop" and last.usage.completion_tokens == 150


async def test_the_router_decides_the_same_with_or_without_the_stop_string() -> None:
    """A stop string is no length hint: once the length predictor has samples, the dry run of a
    request decides and predicts the same with bench's stop string as without it, while a cap the
    router does read (max_tokens 2) changes the prediction."""
    plans = bench_plans(["--workload", "mixed", "--seed", "8", "--num-requests", "12"])
    config = LoadConfig(engine="sim")
    async with embedded_cluster(neutral=2, engine_overrides=FAST_ENGINES) as cluster:
        for plan in plans[:10]:  # answers the predictor learns from
            async for _ in cluster.stub.Generate(build_request(plan, config), timeout=60):
                pass
        probe = build_request(plans[10], config)
        assert probe.sampling.stop and probe.sampling.max_tokens > 2
        bare, short = router_pb2.GenerateRequest(), router_pb2.GenerateRequest()
        bare.CopyFrom(probe)
        del bare.sampling.stop[:]
        short.CopyFrom(bare)
        short.sampling.max_tokens = 2

        async def dry(request: router_pb2.GenerateRequest) -> router_pb2.ScheduleResponse:
            reply: router_pb2.ScheduleResponse = await cluster.stub.Schedule(
                router_pb2.ScheduleRequest(request=request, explain=True), timeout=10
            )
            return reply

        for _ in range(20):  # until the view holds still over the four calls (workers report every 0.2 s)
            first, without, capped, again = [await dry(r) for r in (probe, bare, short, probe)]
            if first == again:
                break
            await asyncio.sleep(0.3)
        else:
            raise AssertionError("the router's view never held still over four dry runs")
    assert without == first
    assert capped != first
