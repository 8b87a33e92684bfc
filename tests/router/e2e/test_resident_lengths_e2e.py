"""The live router re-estimates its resident decode legs' lengths as their tokens stream.

A decode leg enters the router's resident tally with its prompt plus the output its length
predictor expected at dispatch. The residents' TPOT filter (``slo``'s ``tpot_residents``) spreads a
new prompt's prefill stall over the residents' remaining output, taken from that tally. A leg that
outlived its estimate used to keep "no output left" there, so one long answer made its instance
refuse every prompt that would stall it (the stall spread over one token), however much of the
answer was still to come: live, the router queue held twice the requests the simulator held on
the same workload (``docs/prefix-cache.md``, "Live router vs simulator"). The router now re-estimates
each started leg from the tokens it forwarded, as the simulator does on each status push.

Real gRPC on loopback: an embedded CMS, one neutral sim worker and the router.
"""

from __future__ import annotations

import asyncio

from slorouter.v1 import common_pb2, router_pb2

from tests.router.e2e.cluster import collect, embedded_cluster, generate_request

#: Answers the router learns first: every one of them this short, so it expects the next one to be too.
SHORT = 8
#: Tokens the long answer streams past its estimate before the probe.
STREAMED = 80


def _probe() -> router_pb2.ScheduleRequest:
    """A prompt whose prefill stalls a resident by far more than the TPOT target in one step."""
    request = generate_request(3000, SHORT, request_id="probe")
    request.slo.CopyFrom(common_pb2.SloTarget(ttft_ms=60_000.0, tpot_ms=50.0))
    return router_pb2.ScheduleRequest(request=request)


async def test_a_resident_past_its_length_estimate_does_not_make_its_instance_refuse_prompts() -> None:
    async with embedded_cluster(
        neutral=1, engine_overrides={"speed_factor": 4.0}, scheduler_overrides={"calibration": "off"}
    ) as cluster:
        lengths = cluster.router.service._placer.lengths
        for k in range(8):  # the length predictor's min_samples: its estimate is now SHORT
            done = await collect(cluster.stub, generate_request(64, SHORT, request_id=f"short-{k}"))
            assert len(done.tokens) == SHORT
        assert lengths.estimate("", 64, 2000).tokens == SHORT

        # Nothing decodes: the probe goes through (no resident to slow down).
        idle = await cluster.stub.Schedule(_probe(), timeout=10)
        assert idle.prefill.instance_id == "neutral-0"

        long = cluster.stub.Generate(generate_request(64, 2000, request_id="long"), timeout=60)
        streamed = 0
        try:
            async with asyncio.timeout(30.0):
                async for message in long:
                    streamed += len(message.token_ids)
                    if streamed >= STREAMED:
                        break
            assert streamed >= STREAMED, f"the long answer ended after {streamed} tokens"
            # Let a status push of the worker reach the router (its view refreshes the residents).
            await asyncio.sleep(0.2)
            # The long answer has gone ten times past what was expected of it; its instance must
            # still take a prompt whose stall, spread over what the answer has left, is small.
            busy = await cluster.stub.Schedule(_probe(), timeout=10)
            assert busy.prefill.instance_id == "neutral-0"
            inflight = cluster.router.scheduler.inflight
            legs, final = inflight.resident("neutral-0")
            assert legs == 1
            assert final > 64 + streamed, "the resident leg's expected length was not re-estimated"
        finally:
            long.cancel()
