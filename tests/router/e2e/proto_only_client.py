"""A Router client built from the .proto files alone (run as a script by the `up` test).

    python proto_only_client.py GENERATED_DIR ROUTER_ADDR NUM_REQUESTS CONCURRENCY [PROMPT_TOKENS]

GENERATED_DIR holds modules generated from proto/slorouter/v1/*.proto by the
test; nothing of the project is imported. PROMPT_TOKENS fixes every prompt's
length (default: 16 to 315 tokens). Prints one JSON line with the outcome of
every stream, and the error codes seen.
"""

import asyncio
import json
import sys

GENERATED, TARGET, NUM, CONCURRENCY = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
PROMPT_TOKENS = int(sys.argv[5]) if len(sys.argv) > 5 else 0
sys.path.insert(0, GENERATED)

import grpc  # noqa: E402
from slorouter.v1 import common_pb2, router_pb2, router_pb2_grpc  # noqa: E402

assert router_pb2.__file__.startswith(GENERATED), router_pb2.__file__


async def one(stub, i):
    max_tokens = 8 + i % 24
    request = router_pb2.GenerateRequest(
        request_id=f"proto-only-{i}",
        prompt_token_ids=[(i * 31 + k) % 250 + 1 for k in range(PROMPT_TOKENS or 16 + (i * 37) % 300)],
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    problems = []
    tokens = 0
    messages = []
    try:
        async for message in stub.Generate(request, timeout=60):
            messages.append(message)
            tokens += len(message.token_ids)
    except grpc.aio.AioRpcError as exc:
        return {"ok": False, "problems": [f"{exc.code().name}: {exc.details()}"], "code": exc.code().name}
    if tokens != max_tokens:
        problems.append(f"{tokens} tokens, wanted {max_tokens}")
    if not messages or not messages[0].HasField("route"):
        problems.append("first message has no route")
    elif not messages[0].route.prefill_instance_id or not messages[0].route.decode_instance_id:
        problems.append("route names no instances")
    if not messages or not messages[-1].finished or messages[-1].finish_reason != "length":
        problems.append("last message is not a finished 'length' message")
    elif messages[-1].usage.completion_tokens != max_tokens:
        problems.append("usage does not count the tokens")
    if any(m.finished for m in messages[:-1]):
        problems.append("a message before the last is marked finished")
    if any(m.request_id != request.request_id for m in messages):
        problems.append("request id not echoed")
    return {"ok": not problems, "problems": problems}


async def main():
    async with grpc.aio.insecure_channel(TARGET) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        gate = asyncio.Semaphore(CONCURRENCY)

        async def bounded(i):
            async with gate:
                return await one(stub, i)

        results = await asyncio.gather(*(bounded(i) for i in range(NUM)))
    print(
        json.dumps(
            {
                "total": len(results),
                "ok": sum(r["ok"] for r in results),
                "problems": [p for r in results for p in r["problems"]][:20],
                "codes": sorted({r["code"] for r in results if "code" in r}),
            }
        )
    )


asyncio.run(main())
