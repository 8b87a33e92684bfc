"""The load generator against a fake Router on loopback: measurements, stream checks, error counting."""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import AsyncIterator

import grpc
import pytest

from bench.loadgen import (
    CANCELLED,
    CLIENT_ERROR,
    LoadConfig,
    LoadError,
    Progress,
    ProgressBar,
    build_request,
    run_load,
)
from tests.bench.fake_router import (
    FAIL_EXHAUSTED,
    FAIL_MIDSTREAM,
    HANG,
    NO_ROUTE,
    SHORT_STREAM,
    STOP_EARLY,
    FakeRouter,
    start_fake_router,
)
from workload.report import BAD_STREAM, summarize
from workload.spec import (
    ArrivalProcess,
    FixedLength,
    SloClass,
    SloTarget,
    UniformLength,
    WorkloadSpec,
    generate_requests,
)

LOOSE = SloTarget(ttft_ms=60_000.0, tpot_ms=60_000.0, e2e_ms=60_000.0)


def make_class(name: str, priority: int = 0, *, share: float = 1.0, tokens: int = 5) -> SloClass:
    return SloClass(
        name=name,
        share=share,
        slo=LOOSE,
        prompt=UniformLength(4, 12),
        output=FixedLength(tokens),
        priority=priority,
    )


class StepClock:
    """A clock that advances ``step_s`` on every reading, so measurements are exact."""

    def __init__(self, step_s: float = 0.001) -> None:
        self.now = 0.0
        self.step_s = step_s

    def __call__(self) -> float:
        value = self.now
        self.now += self.step_s
        return value


@pytest.fixture
async def router() -> AsyncIterator[tuple[FakeRouter, str]]:
    servicer = FakeRouter()
    server, address = await start_fake_router(servicer)
    try:
        yield servicer, address
    finally:
        await server.stop(None)


async def test_open_loop_measures_every_stream_and_counts_errors(router: tuple[FakeRouter, str]) -> None:
    servicer, address = router
    spec = WorkloadSpec(
        name="t",
        classes=(make_class("good", share=3), make_class("refused", FAIL_EXHAUSTED, share=1)),
    ).with_arrival(rate_per_s=400.0)
    plans = generate_requests(spec, rng=3, num_requests=60)
    seen: list[Progress] = []
    outcome = await run_load(
        plans,
        LoadConfig(target=address, request_id_prefix="run1-", progress_interval_s=0.01),
        on_progress=seen.append,
    )

    assert len(outcome.results) == 60 == outcome.planned and not outcome.stopped_by_duration
    assert [r.index for r in outcome.results] == list(range(60))
    assert sorted(req.request_id for req in servicer.received) == sorted(f"run1-{i}" for i in range(60))
    by_class = {name: [r for r in outcome.results if r.class_name == name] for name in ("good", "refused")}
    n_refused = len(by_class["refused"])
    assert 0 < n_refused < 60
    for r in by_class["good"]:
        assert r.error_code is None and r.completion_tokens == 5 and r.finish_reason == "length"
        assert r.ttft_ms is not None and r.tpot_ms is not None and r.e2e_ms is not None
        assert 0 <= r.ttft_ms <= r.e2e_ms
        assert (r.prefill_instance_id, r.decode_instance_id, r.predicted_ttft_ms) == ("p0", "d0", 12.5)
    for r in by_class["refused"]:
        assert r.error_code == "RESOURCE_EXHAUSTED" and r.error_message == "no instance can meet the SLO"
        assert r.completion_tokens == 0 and r.ttft_ms is None

    # Every request the fake router saw carried the plan's prompt and parameters.
    first = servicer.received[[req.request_id for req in servicer.received].index("run1-0")]
    assert first == build_request(plans[0], LoadConfig(request_id_prefix="run1-"))
    assert first.slo.ttft_ms == 60_000.0 and first.sampling.max_tokens == 5 and first.sampling.ignore_eos

    report = summarize(outcome.results, outcome.duration_s)
    assert report.overall.errors_by_code == {"RESOURCE_EXHAUSTED": n_refused}
    assert report.overall.slo_met == 60 - n_refused
    assert report.by_class()["good"].slo_attainment == 1.0
    assert report.by_class()["refused"].slo_attainment == 0.0
    assert report.overall.completion_tokens == 5 * (60 - n_refused)
    assert seen and seen[-1].completed == 60 and seen[-1].in_flight == 0 and seen[-1].errors == n_refused


async def test_closed_loop_with_a_step_clock_gives_exact_latencies(router: tuple[FakeRouter, str]) -> None:
    _, address = router
    spec = WorkloadSpec(name="t", classes=(make_class("c", tokens=4),)).with_arrival(
        process=ArrivalProcess.CLOSED, concurrency=1
    )
    plans = generate_requests(spec, rng=1, num_requests=3)
    outcome = await run_load(plans, LoadConfig(target=address, concurrency=1), clock=StepClock(0.001))
    # Per request the clock is read before sending, at each of the 4 messages, and at the end;
    # one token per message, so TTFT is one step, TPOT one step, e2e five steps.
    for r in outcome.results:
        assert r.ttft_ms == pytest.approx(1.0)
        assert r.tpot_ms == pytest.approx(1.0)
        assert r.e2e_ms == pytest.approx(5.0)
    assert [r.start_s for r in outcome.results] == pytest.approx([0.002, 0.009, 0.016])
    assert outcome.duration_s == pytest.approx(0.021)
    report = summarize(outcome.results, outcome.duration_s)
    assert report.overall.goodput_rps == pytest.approx(3 / 0.021)
    assert report.overall.ttft.p99_ms == pytest.approx(1.0)


@pytest.mark.parametrize("engine", ["vllm", "sim"])
async def test_stream_contract_violations_and_midstream_errors(
    router: tuple[FakeRouter, str], engine: str
) -> None:
    """The fake router is no sim engine: an ``ignore_eos`` answer it stops early is fine from a real
    model (``vllm``) and a broken promise from a sim fleet (``sim``: the answer has its planned length)."""
    _, address = router
    spec = WorkloadSpec(
        name="t",
        classes=(
            make_class("short", SHORT_STREAM),
            make_class("stop", STOP_EARLY),
            make_class("noroute", NO_ROUTE),
            make_class("midstream", FAIL_MIDSTREAM),
        ),
    ).with_arrival(process=ArrivalProcess.CLOSED, concurrency=4)
    plans = generate_requests(spec, rng=2, num_requests=40)
    outcome = await run_load(plans, LoadConfig(target=address, concurrency=4, engine=engine))
    assert len(outcome.results) == 40
    for r in outcome.results:
        if r.class_name == "short":
            assert r.error_code == BAD_STREAM and "4 tokens received, max_tokens is 5" in r.error_message
        elif r.class_name == "stop" and engine == "sim":
            assert r.error_code == BAD_STREAM and r.finish_reason == "stop" and r.completion_tokens == 2
            assert "2 tokens received, the answer's planned length is 5" in r.error_message
            assert "--engine vllm" in r.error_message
        elif r.class_name == "stop":
            assert r.error_code is None and r.finish_reason == "stop" and r.completion_tokens == 2
        elif r.class_name == "noroute":
            assert r.error_code == BAD_STREAM and "no route" in r.error_message
            assert r.completion_tokens == 5
        else:
            assert r.error_code == "UNAVAILABLE" and r.completion_tokens == 1 and r.ttft_ms is not None
    report = summarize(outcome.results, outcome.duration_s)
    counts = {
        name: sum(r.class_name == name for r in outcome.results) for name in ("short", "noroute", "midstream")
    }
    stopped = sum(r.class_name == "stop" for r in outcome.results) if engine == "sim" else 0
    assert report.overall.errors_by_code == {
        BAD_STREAM: counts["short"] + counts["noroute"] + stopped,
        "UNAVAILABLE": counts["midstream"],
    }
    assert report.by_class()["stop"].slo_attainment == (0.0 if engine == "sim" else 1.0)


async def test_deadline_and_duration_cap_bound_the_run(router: tuple[FakeRouter, str]) -> None:
    _, address = router
    spec = WorkloadSpec(name="t", classes=(make_class("hang", HANG),)).with_arrival(rate_per_s=1000.0)
    plans = generate_requests(spec, rng=1, num_requests=3)
    outcome = await run_load(plans, LoadConfig(target=address, request_timeout_s=0.2))
    assert [r.error_code for r in outcome.results] == ["DEADLINE_EXCEEDED"] * 3

    # Closed loop on a router that never answers: the cap stops issuing, the drain cancels.
    closed = spec.with_arrival(process=ArrivalProcess.CLOSED, concurrency=2)
    plans = generate_requests(closed, rng=1, num_requests=50)
    config = LoadConfig(target=address, concurrency=2, duration_s=0.2, drain_timeout_s=0.1)
    outcome = await run_load(plans, config)
    assert len(outcome.results) == 2
    assert all(r.error_code == CANCELLED and r.e2e_ms is None for r in outcome.results)

    # Open loop whose plan runs past the cap: later arrivals are never issued.
    slow = WorkloadSpec(name="t", classes=(make_class("good"),)).with_arrival(rate_per_s=2.0)
    plans = generate_requests(slow, rng=1, num_requests=50)
    outcome = await run_load(plans, LoadConfig(target=address, duration_s=0.3))
    assert outcome.stopped_by_duration and 1 <= len(outcome.results) < 50
    assert all(r.error_code is None for r in outcome.results)


async def test_cancelling_the_caller_cancels_every_call_and_leaks_no_task(
    router: tuple[FakeRouter, str],
) -> None:
    servicer, address = router
    spec = WorkloadSpec(name="t", classes=(make_class("hang", HANG),)).with_arrival(rate_per_s=1000.0)
    plans = generate_requests(spec, rng=1, num_requests=5)
    task = asyncio.create_task(run_load(plans, LoadConfig(target=address), on_progress=lambda p: None))
    for _ in range(1000):
        if len(servicer.received) == 5:
            break
        await asyncio.sleep(0.01)
    assert len(servicer.received) == 5
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The fake server's own handler tasks live on; none of the load generator's may.
    assert [t for t in asyncio.all_tasks() if t.get_name().startswith("bench-")] == []
    assert servicer.received and all(r.priority == HANG for r in servicer.received)


async def test_a_failure_inside_the_client_is_counted_and_logged(
    router: tuple[FakeRouter, str], caplog: pytest.LogCaptureFixture
) -> None:
    _, address = router
    clock = StepClock()
    readings = 0

    def flaky_clock() -> float:
        nonlocal readings
        readings += 1
        if readings == 4:  # the first message of the first request
            raise RuntimeError("clock broke")
        return clock()

    spec = WorkloadSpec(name="t", classes=(make_class("c"),)).with_arrival(process=ArrivalProcess.CLOSED)
    plans = generate_requests(spec, rng=1, num_requests=2)
    with caplog.at_level(logging.ERROR, logger="bench.loadgen"):
        outcome = await run_load(plans, LoadConfig(target=address, concurrency=1), clock=flaky_clock)
    first, second = outcome.results
    assert (first.error_code, first.error_message) == (CLIENT_ERROR, "RuntimeError: clock broke")
    assert second.ok and second.completion_tokens == 5
    assert "request 0 failed in the client" in caplog.text


async def test_a_passed_channel_is_used_and_left_open(router: tuple[FakeRouter, str]) -> None:
    _, address = router
    spec = WorkloadSpec(name="t", classes=(make_class("c"),)).with_arrival(rate_per_s=1000.0)
    plans = generate_requests(spec, rng=1, num_requests=2)
    async with grpc.aio.insecure_channel(address) as channel:
        first = await run_load(plans, LoadConfig(target="unused:1"), channel=channel)
        second = await run_load(plans, LoadConfig(target="unused:1"), channel=channel)
    assert all(r.ok for r in first.results + second.results)


async def test_unreachable_router_is_a_clear_error() -> None:
    plans = generate_requests(WorkloadSpec(name="t", classes=(make_class("c"),)), rng=1, num_requests=2)
    with pytest.raises(LoadError, match=r"cannot reach a router at 127\.0\.0\.1:1 "):
        await run_load(plans, LoadConfig(target="127.0.0.1:1", connect_timeout_s=0.2))


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"concurrency": -1}, "concurrency must be >= 0"),
        ({"request_timeout_s": 0}, "request_timeout_s must be"),
        ({"duration_s": float("inf")}, "duration_s must be"),
        ({"max_in_flight": 0}, "max_in_flight must be >= 1"),
        ({"target": ""}, "target must be"),
    ],
)
def test_load_config_checks(changes: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        LoadConfig(**changes)  # type: ignore[arg-type]


def test_progress_bar_plain_output_is_throttled() -> None:
    out = io.StringIO()
    bar = ProgressBar(out, width=10, plain_interval_s=5.0)
    for second in range(12):
        bar(
            Progress(
                planned=100,
                issued=10,
                completed=second,
                errors=1,
                in_flight=3,
                elapsed_s=second,
                duration_s=None,
            )
        )
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3  # at 0, 5 and 10 s
    assert lines[-1] == "[#.........] 10/100 done, 3 in flight, 1 errors, 10.0 s"


def test_progress_bar_follows_completions_not_the_sending_window() -> None:
    out = io.StringIO()
    bar = ProgressBar(out, width=10, plain_interval_s=0.0)
    # 20 s of sending is over, but only 60 of 80 requests are done: the bar is not full.
    bar(Progress(80, 80, 60, 0, 20, elapsed_s=21.0, duration_s=20.0))
    bar(Progress(80, 80, 80, 0, 0, elapsed_s=30.0, duration_s=20.0, done=True))
    first, last = out.getvalue().splitlines()
    assert (
        first
        == "[########..] 60/80 done, 20 in flight, 0 errors, 21.0 s (sending over; waiting for the last ones)"
    )
    assert last == "[##########] 80/80 done, 0 in flight, 0 errors, 30.0 s"


async def test_a_router_that_cannot_place_a_request_yet_is_waited_for_not_sent_to() -> None:
    # Half a PD fleet (the decode worker has not registered yet): the router is up and its health
    # says SERVING, but every request would fail "no prefill+decode pair". The bench waits for a
    # fleet that can serve, within its connect timeout, and sends nothing meanwhile.
    from tests.router.e2e.cluster import embedded_cluster

    plans = generate_requests(WorkloadSpec(name="t", classes=(make_class("c"),)), rng=1, num_requests=2)
    async with embedded_cluster(prefill=1) as cluster:
        with pytest.raises(LoadError, match="can place a request"):
            await run_load(plans, LoadConfig(target=cluster.router.address, connect_timeout_s=1.0))
        assert cluster.router.service.active_requests == 0
