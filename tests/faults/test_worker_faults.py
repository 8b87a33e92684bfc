"""Workers fail under a steady load: a frozen worker, a killed decode worker, an endpoint that never answers.

Real processes on loopback (CMS, sim workers, router). The router picks among
the two decode instances at random (``--dispatch-top-k 2``), so both get traffic.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from pathlib import Path

import grpc
import pytest
from slorouter.v1 import cms_pb2, router_pb2_grpc

from cms.agent import AgentWriter

from .fleet import Fleet, Outcome, SteadyLoad, failures, generate, wait_for_instances

STALENESS_S = 5.0  # the router's default --instance-staleness-seconds
CONNECT_TIMEOUT_S = 1.0  # Fleet.router's --worker-connect-timeout-s
MAX_RETRIES = 2  # the router's default --max-retries


async def _fleet(fleet: Fleet, streams: str = "mux") -> tuple[str, str]:
    cms = fleet.cms("--store", "memory")
    workers = [
        fleet.worker("p0", "prefill", cms.address, speed=2.0),
        fleet.worker("d0", "decode", cms.address, speed=2.0),
        fleet.worker("d1", "decode", cms.address, speed=2.0),
    ]
    fleet.wait_listening(*workers)
    router = fleet.router(f"grpc://{cms.address}", "--dispatch-top-k", "2", "--worker-streams", streams)
    await wait_for_instances(router.address, {"p0", "d0", "d1"})
    return cms.address, router.address


def _proc(fleet: Fleet, name: str):  # type: ignore[no-untyped-def]
    return next(p for p in fleet.procs if p.name == name)


#: The router's --worker-streams: every decode leg on one Worker.Streams call per worker, or one call each.
STREAMS = pytest.mark.parametrize("streams", ["mux", "per-request"])


@pytest.mark.timeout(150)
@STREAMS
async def test_a_frozen_decode_worker_stops_getting_requests_and_gets_them_again(
    tmp_path: Path, streams: str
) -> None:
    fleet = Fleet(tmp_path)
    try:
        _, router_address = await _fleet(fleet, streams)
        load = SteadyLoad(router_address, rate_hz=10)
        await load.start()
        await load.run_for(3.0)
        assert any(o.decode == "d1" for o in load.outcomes), "d1 must take traffic before the fault"
        d1 = _proc(fleet, "d1")
        d1.signal(signal.SIGSTOP)
        stopped = time.monotonic()
        await load.run_for(STALENESS_S + 4.0)
        d1.signal(signal.SIGCONT)
        resumed = time.monotonic()
        deadline = resumed + 30.0
        while time.monotonic() < deadline and not any(o.decode == "d1" and o.ok for o in load.since(resumed)):
            await load.run_for(0.5)
        outcomes = await load.stop()
    finally:
        fleet.close()
    # Requests placed on the frozen worker before it was noticed were moved (first-message deadline).
    assert failures(outcomes) == []
    # Within its bound (the staleness of its silent agent, or its first failed call) it gets nothing new.
    bound = stopped + STALENESS_S + 1.0
    late = [o.request_id for o in outcomes if bound <= o.started_s < resumed and o.decode == "d1"]
    assert late == []
    assert len([o for o in outcomes if bound <= o.started_s < resumed]) >= 20
    # After it thaws it is used again.
    assert any(o.decode == "d1" and o.ok for o in outcomes if o.started_s >= resumed)


@pytest.mark.timeout(150)
@STREAMS
async def test_kill_9_of_a_decode_worker_mid_stream_loses_and_repeats_no_token(
    tmp_path: Path, streams: str
) -> None:
    fleet = Fleet(tmp_path)
    max_tokens = 300
    prompt = list(range(1, 65))
    try:
        _, router_address = await _fleet(fleet, streams)
        async with grpc.aio.insecure_channel(router_address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            track: dict[str, Outcome] = {}
            tasks: list[asyncio.Task[Outcome]] = []
            victim: Outcome | None = None
            for batch in range(5):  # until a stream runs on d1 (each batch: 6 streams spread at random)
                tasks += [
                    asyncio.ensure_future(
                        generate(stub, f"long-{batch}-{i}", prompt, max_tokens=max_tokens, track=track)
                    )
                    for i in range(6)
                ]
                deadline = time.monotonic() + 10.0
                while time.monotonic() < deadline and victim is None:
                    victim = next(
                        (
                            o
                            for o in track.values()
                            if o.decode == "d1" and len(o.token_ids) >= 20 and not o.finished
                        ),
                        None,
                    )
                    await asyncio.sleep(0.01)
                if victim is not None:
                    break
            assert victim is not None, "no stream ran on d1"
            _proc(fleet, "d1").kill()  # SIGKILL mid-stream
            killed_at = len(victim.token_ids)
            outcomes = await asyncio.gather(*tasks)
            # The same prompt and seed on the surviving workers: the tokens every stream must have had.
            reference = await generate(stub, "reference", prompt, max_tokens=max_tokens)
    finally:
        fleet.close()
    assert reference.ok and len(reference.token_ids) == max_tokens
    assert killed_at < max_tokens
    assert failures(outcomes) == []
    for outcome in outcomes:
        assert outcome.gaps == 0
        assert outcome.token_ids == reference.token_ids, f"{outcome.request_id}: tokens lost or repeated"


@pytest.mark.timeout(120)
async def test_an_endpoint_that_accepts_and_never_answers_costs_at_most_the_retry_budget(
    tmp_path: Path,
) -> None:
    fleet = Fleet(tmp_path)
    hole = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    hole.bind(("127.0.0.1", 0))
    hole.listen(128)  # the kernel completes every handshake; nobody ever reads or writes
    hole_address = f"127.0.0.1:{hole.getsockname()[1]}"
    agent: AgentWriter | None = None
    try:
        cms_address, router_address = await _fleet(fleet)
        metadata = cms_pb2.InstanceMetadata(
            instance_id="p-hole",
            endpoint=hole_address,
            role=cms_pb2.INSTANCE_ROLE_PREFILL,
            model="sim",
            max_num_batched_tokens=2048,
            kv_capacity_tokens=65536,
        )
        agent = AgentWriter(cms_address, metadata, heartbeat_interval_s=0.2)
        await agent.start()
        agent.publish(
            cms_pb2.InstanceStatus(
                instance_id="p-hole", update_id=1, timestamp_ms=int(time.time() * 1000), schedulable=True
            )
        )
        await wait_for_instances(router_address, {"p0", "p-hole"})
        async with grpc.aio.insecure_channel(router_address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            outcomes = []
            for i in range(20):
                started = time.monotonic()
                outcome = await generate(stub, f"r{i}", list(range(1, 33)), max_tokens=4)
                outcomes.append((outcome, time.monotonic() - started))
        hole.setblocking(False)
        tried = 0
        for _ in range(1000):  # connections the router opened to the hole, waiting in its backlog
            try:
                conn, _ = hole.accept()
            except BlockingIOError:
                break
            conn.close()
            tried += 1
    finally:
        if agent is not None:
            await agent.stop()
        hole.close()
        fleet.close()
    assert tried >= 1, "the router never tried the endpoint"
    assert failures([o for o, _ in outcomes]) == []
    # The hole is the only other prefill instance, so it was tried; a try costs one connect deadline,
    # and the router does not wait out gRPC's 20 s connect deadline.
    budget = CONNECT_TIMEOUT_S * (MAX_RETRIES + 1)
    slowest = max(elapsed for _, elapsed in outcomes)
    assert slowest < budget + 5.0, f"a request took {slowest:.1f} s with a {budget:.0f} s retry budget"
