"""``python -m bench vllm``'s two worker clients against a real sim worker on loopback.

The benchmark needs vLLM to run whole, but the clients it drives the worker with do not: they
speak the worker's gRPC, which the sim worker serves too. Each must read a request's every token
and its first token's time, the way the router reads them (a change to the router's leg API once
broke the ``Streams`` client without any test noticing).
"""

from __future__ import annotations

import grpc
from slorouter.v1 import worker_pb2_grpc

from bench.bench_vllm import OUTPUT_TOKENS, _measure, _streams_requests, _worker_requests
from router.mux import MuxConnection
from tests.workers.helpers import make_engine
from workers.metadata import WorkerIdentity, build_metadata
from workers.service import WorkerServicer


async def test_both_worker_clients_read_every_token_of_every_request() -> None:
    engine = make_engine(speed_factor=50.0)
    await engine.start()
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    metadata = build_metadata(engine.info, WorkerIdentity(instance_id="w"), address)
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(engine, metadata), server)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            mux = MuxConnection(channel, stub, address, lambda _: None)
            await mux.opened
            try:
                for one in (_streams_requests(mux), _worker_requests(stub)):
                    figures = await _measure(one, concurrency=4, per_stream=2, first_index=0)
                    assert figures.requests == 8
                    assert figures.tokens == 8 * OUTPUT_TOKENS
                    assert figures.ttft_p50_ms > 0
                    # Every request's first-token time, for the median over all rounds.
                    assert len(figures.ttfts_ms) == 8 and min(figures.ttfts_ms) > 0
                    assert sorted(figures.ttfts_ms)[3] <= figures.ttft_p50_ms <= sorted(figures.ttfts_ms)[4]
            finally:
                await mux.close()
    finally:
        await server.stop(0)
        await engine.stop()
