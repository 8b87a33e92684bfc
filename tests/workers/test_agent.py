"""The status agent: with a recording sink, and end to end with a real CMS that goes away and comes back."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from slorouter.v1 import cms_pb2

from cms.memory import MemoryStore
from cms.reader import open_reader
from cms.server import start_cms_server
from workers.agent import StatusAgent
from workers.metadata import WorkerIdentity, build_metadata
from workers.sim_engine import SimEngine

from .conftest import StartWorker
from .helpers import Client, drain, make_engine, prompt, sampling, wait_for


class RecordingSink:
    """A :class:`workers.agent.StatusSink` that keeps what it is given, with the loop time."""

    def __init__(self, *, fail: bool = False) -> None:
        self.statuses: list[cms_pb2.InstanceStatus] = []
        self.times: list[float] = []
        self.started = self.stopped = False
        self._fail = fail

    async def start(self) -> None:
        self.started = True

    def publish(self, status: cms_pb2.InstanceStatus) -> None:
        if self._fail:
            raise RuntimeError("sink down")
        self.statuses.append(status)
        self.times.append(asyncio.get_running_loop().time())

    async def stop(self) -> None:
        self.stopped = True


async def _agent(engine: SimEngine, sink: RecordingSink, **kw: object) -> StatusAgent:
    metadata = build_metadata(engine.info, WorkerIdentity(instance_id="w"), "127.0.0.1:1")
    agent = StatusAgent(engine, metadata, sink, **kw)  # type: ignore[arg-type]
    await agent.start()
    return agent


async def test_status_follows_load_within_a_few_ms() -> None:
    engine = make_engine(speed_factor=5.0)
    await engine.start()
    sink = RecordingSink()
    agent = await _agent(engine, sink, coalesce_s=0.005)
    loop = asyncio.get_running_loop()
    try:
        await wait_for(lambda: len(sink.statuses) == 1)  # the idle status at start
        assert sink.statuses[0].num_running_requests == 0 and sink.statuses[0].schedulable
        stream = engine.generate("r1", prompt(256), sampling(6))
        admitted_at = loop.time()
        first = await anext(stream)
        assert first.token_ids
        busy = next(
            i for i, s in enumerate(sink.statuses) if s.num_waiting_requests + s.num_running_requests == 1
        )
        assert "r1" in sink.statuses[busy].admitted_request_ids
        assert sink.times[busy] - admitted_at < 0.05  # a coalescing window (5 ms) plus scheduling slack
        await drain(stream)
        finished_at = loop.time()
        await wait_for(lambda: sink.statuses[-1].num_running_requests == 0)
        assert sink.times[-1] - finished_at < 0.05
    finally:
        await agent.stop()
        await engine.stop()
    assert sink.stopped
    gaps = [b - a for a, b in itertools.pairwise(sink.times)]
    assert min(gaps) >= 0.005 - 0.001  # coalesced: never more than one publish per window
    last = sink.statuses[-1]
    assert last.num_decode_requests == 0 and last.num_used_kv_tokens == 0
    assert sum(len(s.step_samples) for s in sink.statuses) == engine.load().num_steps


async def test_update_ids_grow_from_the_epoch_and_timestamps_use_the_clock() -> None:
    engine = make_engine()
    await engine.start()
    sink = RecordingSink()
    agent = await _agent(engine, sink, clock=lambda: 1_700_000_000.0)
    try:
        await drain(engine.generate("a", prompt(32), sampling(5)))
        await wait_for(lambda: sink.statuses[-1].num_running_requests == 0 and len(sink.statuses) > 2)
    finally:
        await agent.stop()
        await engine.stop()
    ids = [s.update_id for s in sink.statuses]
    assert ids[0] == 1_700_000_000_000_001
    assert all(b == a + 1 for a, b in itertools.pairwise(ids))
    assert {s.timestamp_ms for s in sink.statuses} == {1_700_000_000_000}
    assert all(s.instance_id == "w" for s in sink.statuses)


async def test_admitted_ids_and_step_samples_are_bounded() -> None:
    engine = make_engine(speed_factor=20.0, max_num_batched_tokens=64, max_num_seqs=8)
    await engine.start()
    sink = RecordingSink()
    agent = await _agent(engine, sink, coalesce_s=0.02, max_admitted_ids=8, max_step_samples=3)
    try:
        await asyncio.gather(
            *(drain(engine.generate(f"r{i}", prompt(40, i), sampling(10))) for i in range(40))
        )
        await wait_for(lambda: sink.statuses[-1].admitted_request_ids[-1:] == ["r39"])
        await wait_for(lambda: sink.statuses[-1].num_running_requests == 0)
    finally:
        await agent.stop()
        await engine.stop()
    assert len(sink.statuses) > 3
    assert engine.load().num_steps > len(sink.statuses)  # several steps per status: samples were cut
    assert all(len(s.admitted_request_ids) <= 8 and len(s.step_samples) <= 3 for s in sink.statuses)
    assert list(sink.statuses[-1].admitted_request_ids) == [f"r{i}" for i in range(32, 40)]


async def test_a_failing_sink_never_affects_serving() -> None:
    engine = make_engine()
    await engine.start()
    agent = await _agent(engine, RecordingSink(fail=True))
    try:
        tokens, _, reason, _ = await drain(engine.generate("a", prompt(32), sampling(7)))
    finally:
        await agent.stop()
        await agent.stop()  # idempotent
        await engine.stop()
    assert len(tokens) == 7 and reason == "length"
    assert agent.published == 0


async def test_cms_killed_and_restarted_worker_keeps_serving_and_reappears(start_worker: StartWorker) -> None:
    cms = await start_cms_server(MemoryStore(), lease_ttl_s=2.0)
    address = cms.address
    server = await start_worker(
        server_kw={
            "cms": address,
            "identity": WorkerIdentity(instance_id="w1", node_id="n1"),
            "heartbeat_interval_s": 0.2,
            "cms_backoff_max_s": 0.3,
        }
    )
    reader = open_reader(f"grpc://{address}", backoff_max_s=0.3)
    await reader.start()
    cms2 = None
    try:

        def status_of(iid: str) -> cms_pb2.InstanceStatus | None:
            record = reader.snapshot().by_id().get(iid)
            return None if record is None else record.status

        await wait_for(lambda: status_of("w1") is not None, timeout_s=10)
        record = reader.snapshot().by_id()["w1"]
        assert record.metadata.endpoint == server.address and record.metadata.node_id == "n1"
        assert record.metadata.kv_capacity_tokens == server.engine.info.kv_capacity_tokens
        async with Client(server.address) as client:
            assert len((await client.generate("before", prompt(16), 4)).tokens) == 4
            await wait_for(
                lambda: "before" in (status_of("w1") or cms_pb2.InstanceStatus()).admitted_request_ids, 10
            )

            await cms.stop(0)
            # No CMS: serving goes on.
            result = await client.generate("during", prompt(16), 5)
            assert len(result.tokens) == 5

            cms2 = await start_cms_server(MemoryStore(), listen=address, lease_ttl_s=2.0)
            await wait_for(
                lambda: "during" in (status_of("w1") or cms_pb2.InstanceStatus()).admitted_request_ids, 15
            )
            assert len((await client.generate("after", prompt(16), 3)).tokens) == 3
        await server.stop(0)
        await wait_for(lambda: "w1" not in reader.snapshot().by_id(), timeout_s=10)  # deregistered
    finally:
        await reader.stop()
        await cms.stop(0)
        if cms2 is not None:
            await cms2.stop(0)


async def test_worker_serves_without_a_reachable_cms(start_worker: StartWorker) -> None:
    # Nothing listens on port 9 of loopback (discard), so every CMS call fails fast.
    server = await start_worker(server_kw={"cms": "127.0.0.1:9", "cms_backoff_max_s": 0.2})
    async with Client(server.address) as client:
        result = await client.generate("a", prompt(16), 4)
    assert len(result.tokens) == 4
    assert server.agent is not None
    assert not server.agent.sink.registered  # type: ignore[attr-defined]


async def test_bad_cms_token_does_not_affect_serving(start_worker: StartWorker) -> None:
    cms = await start_cms_server(MemoryStore(), auth_token="right")
    try:
        server = await start_worker(
            server_kw={"cms": cms.address, "cms_auth_token": "wrong", "cms_backoff_max_s": 0.2}
        )
        async with Client(server.address) as client:
            assert len((await client.generate("a", prompt(16), 4)).tokens) == 4
        assert server.agent is not None and not server.agent.sink.registered  # type: ignore[attr-defined]
    finally:
        await cms.stop(0)


async def test_a_stalled_engine_is_reported_unschedulable_until_its_steps_resume() -> None:
    engine = make_engine(speed_factor=5.0)
    await engine.start()
    sink = RecordingSink()
    agent = await _agent(engine, sink, coalesce_s=0.001, engine_stall_s=0.2)
    try:
        await wait_for(lambda: len(sink.statuses) >= 1)
        # Idle for longer than the stall bound: nothing held, so nothing is stalled.
        await asyncio.sleep(0.3)
        assert sink.statuses[-1].schedulable and agent.stall_reason == ""

        engine.stall()
        stream = engine.generate("r1", prompt(64), sampling(4))
        first = asyncio.ensure_future(anext(stream))
        await wait_for(lambda: not sink.statuses[-1].schedulable, timeout_s=5.0)
        stalled = sink.statuses[-1]
        assert (
            "engine stalled" in stalled.unschedulable_reason
            and "--engine-stall-s" in stalled.unschedulable_reason
        )
        assert stalled.num_waiting_requests + stalled.num_running_requests == 1
        assert not first.done()  # really stalled: no token came out

        engine.resume()
        await first
        await wait_for(lambda: sink.statuses[-1].schedulable, timeout_s=5.0)
        assert sink.statuses[-1].unschedulable_reason == ""
        await drain(stream)
    finally:
        engine.resume()
        await agent.stop()
        await engine.stop()


async def test_engine_stall_check_can_be_turned_off() -> None:
    engine = make_engine(speed_factor=5.0)
    await engine.start()
    sink = RecordingSink()
    agent = await _agent(engine, sink, coalesce_s=0.001, engine_stall_s=0)
    try:
        engine.stall()
        stream = engine.generate("r1", prompt(64), sampling(4))
        first = asyncio.ensure_future(anext(stream))
        await wait_for(
            lambda: sink.statuses[-1].num_waiting_requests + sink.statuses[-1].num_running_requests == 1
        )
        await asyncio.sleep(0.3)
        assert sink.statuses[-1].schedulable and agent.stall_reason == ""
        engine.resume()
        await first
        await drain(stream)
    finally:
        engine.resume()
        await agent.stop()
        await engine.stop()


async def test_a_stalled_engine_whose_work_was_aborted_is_schedulable_again_on_probation() -> None:
    engine = make_engine(speed_factor=5.0)
    await engine.start()
    sink = RecordingSink()
    agent = await _agent(engine, sink, coalesce_s=0.001, engine_stall_s=0.2)
    try:
        engine.stall()
        stream = engine.generate("r1", prompt(64), sampling(4))
        first = asyncio.ensure_future(anext(stream))
        await wait_for(lambda: not sink.statuses[-1].schedulable, timeout_s=5.0)
        marked = len(sink.statuses)
        # The router gives up on it: the request is aborted and the engine holds nothing.
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await stream.aclose()
        await wait_for(lambda: engine.load().num_waiting_requests + engine.load().num_running_requests == 0)
        # Still stalled, but nothing shows it any more: schedulable again after engine_stall_s idle.
        await wait_for(lambda: sink.statuses[-1].schedulable, timeout_s=5.0)
        assert not sink.statuses[marked - 1].schedulable
        # New work that again finishes no step marks it again.
        stream2 = engine.generate("r2", prompt(64), sampling(4))
        second = asyncio.ensure_future(anext(stream2))
        await wait_for(lambda: not sink.statuses[-1].schedulable, timeout_s=5.0)
        engine.resume()
        await second
        await drain(stream2)
        await wait_for(lambda: sink.statuses[-1].schedulable, timeout_s=5.0)
    finally:
        engine.resume()
        await agent.stop()
        await engine.stop()


async def test_status_carries_the_engines_prefix_cache_hit_rate() -> None:
    engine = make_engine(speed_factor=20.0, prefix_cache_block_tokens=16)
    await engine.start()
    sink = RecordingSink()
    agent = await _agent(engine, sink, coalesce_s=0.005)
    try:
        await wait_for(lambda: len(sink.statuses) == 1)
        assert sink.statuses[0].cache_hit_rate == 0.0  # nothing looked up yet
        for rid in ("a", "b"):  # the same 256-token prompt twice: the second finds 240 cached
            await drain(engine.generate(rid, prompt(256), sampling(2)))
        expected = engine.load().cache_hit_rate
        assert 0.4 < expected < 0.5
        await wait_for(lambda: sink.statuses[-1].cache_hit_rate == pytest.approx(expected))
    finally:
        await agent.stop()
        await engine.stop()


async def test_status_carries_the_engines_preemption_count_and_leaves_it_unset_when_unknown() -> None:
    from engine.interface import EngineLoad
    from workers.agent import build_status

    counted = build_status(
        "n0", EngineLoad(num_preemptions=5, num_preemption_recompute_tokens=900), update_id=1, timestamp_ms=1
    )
    assert counted.HasField("num_preemptions") and counted.num_preemptions == 5
    assert counted.num_preemption_recompute_tokens == 900
    unknown = build_status("n0", EngineLoad(), update_id=1, timestamp_ms=1)
    assert not unknown.HasField("num_preemptions")
    assert not unknown.HasField("num_preemption_recompute_tokens")
    # The sim engine counts them: its first status says 0, not "unknown".
    engine = make_engine(speed_factor=20.0)
    await engine.start()
    sink = RecordingSink()
    agent = await _agent(engine, sink, coalesce_s=0.005)
    try:
        await wait_for(lambda: len(sink.statuses) == 1)
        assert sink.statuses[0].HasField("num_preemptions") and sink.statuses[0].num_preemptions == 0
    finally:
        await agent.stop()
        await engine.stop()
