"""``--queue-policy qlm`` through `slo-router up` with a sim worker: a tight burst behind long loose requests.

One neutral sim worker taking 4 requests at once from its virtual queue
(``--qlm-batch 4``). Twelve loose requests (2000-token prompts, 200 tokens out,
judged end to end) arrive first; two tight ones (TTFT 1 s) arrive 2 s later,
when four loose ones stream and eight wait. Under ``qlm`` the tight group goes
to the head of the virtual queue and running loose requests are evicted for it
(aborted on the worker; they continue later with their tokens appended to the
prompt): the tight requests meet their TTFT. Under ``fcfs`` they wait behind
the loose prefills in the engine and miss. Every stream, evicted or not, ends
with exactly ``max_tokens`` tokens, each message starting at
``first_token_index`` = the tokens received before (nothing lost, nothing repeated).
"""

from __future__ import annotations

import asyncio
import random
import signal
from dataclasses import dataclass, field

import grpc
import pytest
from slorouter.v1 import common_pb2, router_pb2, router_pb2_grpc

from tests.router.e2e.up_process import reap, start_up, wait_for_line

LOOSE, TIGHT = 12, 2
LOOSE_PROMPT, LOOSE_OUT = 2000, 200
TIGHT_PROMPT, TIGHT_OUT = 64, 8
TIGHT_TTFT_MS = 1000.0


@dataclass
class Stream:
    tokens: list[int] = field(default_factory=list)
    ttft_ms: float = 0.0
    finish_reason: str = ""
    gaps: int = 0  # messages whose first_token_index was not the tokens received before


async def _generate(
    stub: router_pb2_grpc.RouterAsyncStub,
    rid: str,
    prompt: list[int],
    max_tokens: int,
    slo: common_pb2.SloTarget,
    name: str,
) -> Stream:
    out = Stream()
    request = router_pb2.GenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        slo=slo,
        slo_class=name,
    )
    async for message in stub.Generate(request, timeout=120):
        if message.first_token_index != len(out.tokens):
            out.gaps += 1
        out.tokens.extend(message.token_ids)
        if message.finished:
            out.finish_reason = message.finish_reason
            out.ttft_ms = message.usage.ttft_ms
    return out


async def _scenario(address: str) -> tuple[list[Stream], list[Stream]]:
    rng = random.Random(0)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        loose_slo = common_pb2.SloTarget(e2e_ms=600_000.0)
        tight_slo = common_pb2.SloTarget(ttft_ms=TIGHT_TTFT_MS, tpot_ms=200.0)
        loose = [
            asyncio.ensure_future(
                _generate(
                    stub,
                    f"loose-{k}",
                    [rng.randrange(1, 200) for _ in range(LOOSE_PROMPT)],
                    LOOSE_OUT,
                    loose_slo,
                    "batch",
                )
            )
            for k in range(LOOSE)
        ]
        await asyncio.sleep(2.0)
        tight = [
            asyncio.ensure_future(
                _generate(
                    stub,
                    f"tight-{k}",
                    [rng.randrange(1, 200) for _ in range(TIGHT_PROMPT)],
                    TIGHT_OUT,
                    tight_slo,
                    "interactive",
                )
            )
            for k in range(TIGHT)
        ]
        done = await asyncio.wait_for(asyncio.gather(*loose, *tight), timeout=180)
    return list(done[:LOOSE]), list(done[LOOSE:])


def _run(*flags: str) -> tuple[list[Stream], list[Stream], str]:
    """The scenario against a fresh ``up --neutral 1``; the streams and what ``up`` printed meanwhile."""
    up = start_up("--neutral", "1", *flags)
    try:
        address = wait_for_line(up, "router listening on ")
        loose, tight = asyncio.run(_scenario(address))
        up.send_signal(signal.SIGTERM)
        rest, _ = up.communicate(timeout=30)
        assert up.returncode == 0
        return loose, tight, rest
    finally:
        reap(up)


@pytest.mark.timeout(500)
def test_qlm_evicts_loose_requests_so_the_tight_burst_meets_its_ttft_and_fcfs_does_not() -> None:
    loose, tight, log = _run("--queue-policy", "qlm", "--qlm-batch", "4")
    for s in loose + tight:
        assert s.finish_reason == "length" and s.gaps == 0
    assert all(len(s.tokens) == LOOSE_OUT for s in loose)
    assert all(len(s.tokens) == TIGHT_OUT for s in tight)
    evicted = log.count("qlm: evicted")
    assert evicted >= 1, log[-3000:]
    assert all(s.ttft_ms <= TIGHT_TTFT_MS for s in tight), [s.ttft_ms for s in tight]

    loose, tight, _ = _run("--queue-policy", "fcfs")
    assert all(len(s.tokens) == LOOSE_OUT for s in loose)
    assert any(s.ttft_ms > TIGHT_TTFT_MS for s in tight), [s.ttft_ms for s in tight]
