"""Forwarding to an unmodified vLLM over vLLM's own gRPC service (``vllm-grpc`` instances).

``vllm serve MODEL --grpc`` (or ``python -m vllm.entrypoints.launchers.grpc_server``) serves
``vllm.grpc.engine.VllmEngine``; its messages come from the ``smg-grpc-proto`` package. An
instance registered with ``worker_protocol: "vllm-grpc"`` (``slo-router agent`` does that) is
reached here instead of through the ``Worker`` service. :class:`router.forward.WorkerClient` picks
this client by the endpoint's scheme (:mod:`router.core.protocols`) and keeps everything around a
call the same: the connect and first-message deadlines, the error classification into
:class:`~router.forward.LegError`, the outlier detector's evidence and the abort ledger. So
retries, failover, deadlines, cancel and ejection behave as on the ``Worker`` path.

How the ``Worker`` operations map onto vLLM's:

- neutral ``Generate``: one ``Generate`` with the prompt's token ids, streamed;
- ``Prefill``: ``Generate`` with ``max_tokens=1`` and ``kv_transfer_params_json``
  ``{"do_remote_decode": true}`` (the engine's KV connector then keeps the prompt's KV for a
  decode engine); the first token goes to the client at once, and the
  ``kv_transfer_params_json`` the engine returns becomes the opaque kv handle;
- ``Decode``: ``Generate`` of the prompt *plus every token already produced*, with
  ``max_tokens`` reduced by their number and the prefill's ``kv_transfer_params_json``. The
  decode engine's connector loads the prompt's KV and the engine computes the rest itself.
  Because the input is always "prompt + tokens so far", the same call resumes a request on
  another engine after its decode engine failed, without repeating or losing a token; with
  greedy sampling the continuation is the one the failed engine would have produced;
- ``Abort``: ``Abort(request_ids=[id])``; a cancelled stream is also cancelled on the engine.

vLLM's gRPC server returns token ids only; the text of each message is produced here with the
router's tokenizer (``--tokenizer``, the model directory), incrementally and with a few tokens of
context so that a piece carries its leading space the way the engine's own detokenizer would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any

import grpc
from slorouter.v1 import common_pb2, worker_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_pb2_grpc

from cms import limits
from cms.transport import ClientTls, open_channel
from router.core.protocols import split_endpoint
from router.legs import LegLedger, LegOwner, RelayPacer, Target, paced_batches
from router.mux import Tokens
from router.pool import CHANNEL_OPTIONS
from router.vllm_h2 import AVAILABLE as H2_AVAILABLE
from router.vllm_h2 import CallError, H2Pool, paced_stream_batches

logger = logging.getLogger(__name__)

#: The end-of-stream marker ``call.read()`` returns (missing from the type stubs).
_EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]
#: The ``kv_transfer_params_json`` a prefill leg sends: keep the KV for a remote decode. Connectors
#: that key KV by content (ExampleConnector) ignore it; NIXL-style ones answer with the handle.
PREFILL_KV_PARAMS = json.dumps({"do_remote_decode": True})
#: Tokens of context the detokenizer decodes before the new ones (a piece's leading space, a
#: multi-token character, depend on them).
DETOKENIZE_CONTEXT = 6
#: The default of ``--vllm-stream-interval-ms``: a vLLM leg's tokens reach the client at most this
#: late, in at most one message per stream per interval (see :func:`router.legs.paced_batches`).
DEFAULT_STREAM_INTERVAL_S = 0.005
#: The default of ``--vllm-stream-messages-per-s``: the write budget over all paced vLLM streams of
#: a router process, which stretches the interval when many streams run (:class:`RelayPacer`).
DEFAULT_STREAM_MESSAGES_PER_S = 2000.0
#: vLLM takes a 32-bit signed seed.
_SEED_MODULUS = 1 << 31
#: ``--vllm-transport``: how a stock engine's ``Generate`` streams are read. ``h2``: this router's
#: own HTTP/2 reader (:mod:`router.vllm_h2`: every message of every stream that one TCP read
#: carries, in one event-loop wake-up); ``grpc``: ``grpc.aio`` (a wake-up per message). TLS
#: endpoints always use ``grpc``; prefill, ``Abort`` and the KV events always do.
VLLM_TRANSPORTS = ("h2", "grpc")
#: The HTTP/2 path of vLLM's ``Generate``.
GENERATE_PATH = "/vllm.grpc.engine.VllmEngine/Generate"


def vllm_sampling(sampling: common_pb2.SamplingParams, max_tokens: int) -> Any:
    """vLLM's ``SamplingParams`` for ours, with ``max_tokens`` replaced (the leg's own budget)."""
    params = vllm_pb2.SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=max(0, sampling.top_k),
        stop=list(sampling.stop),
        ignore_eos=sampling.ignore_eos,
        max_tokens=max_tokens,
        n=1,
    )
    if sampling.seed:
        params.seed = sampling.seed % _SEED_MODULUS
    return params


class Detokenizer:
    """Text of a growing token sequence, piece by piece (vLLM's prefix/read offsets, simplified).

    Each :meth:`add` decodes the window from ``prefix`` to the end and returns what it adds to the
    window up to ``read``; a piece that ends in U+FFFD (an incomplete UTF-8 sequence of a
    byte-level vocabulary) is held back until the next tokens complete it. The list is trimmed as
    it grows, so the work per call is bounded by the window, not by the output length.
    """

    def __init__(self, decode: Callable[[list[int]], str], context: Sequence[int]) -> None:
        self._decode = decode
        self._ids = list(context[-DETOKENIZE_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)

    def add(self, token_ids: Sequence[int]) -> str:
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        before = self._decode(self._ids[self._prefix : self._read]) if self._read > self._prefix else ""
        after = self._decode(self._ids[self._prefix :])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        piece = after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        if self._prefix > 4 * DETOKENIZE_CONTEXT:
            cut = self._prefix - DETOKENIZE_CONTEXT
            del self._ids[:cut]
            self._prefix -= cut
            self._read -= cut
        return piece


async def _nothing_left(request_id: str) -> AsyncGenerator[Tokens, None]:
    """A leg with no token left to make (all were produced before a failure): its end at once."""
    yield Tokens(request_id, [], "", True, "length", 0, 0)


def _finish_reason(reason: str) -> str:
    """vLLM's finish reason in the Worker protocol's words ("length" | "stop" | "abort")."""
    return reason if reason in ("length", "stop", "abort") else "stop"


class GenerateMerge:
    """One leg's ``Generate`` responses merged as they arrive; :meth:`take` hands them over as one record.

    What arrives between two takes becomes one :class:`~router.mux.Tokens`: the chunks' token ids
    in order, the first non-zero ``prompt_tokens``, the largest ``cached_tokens``, and the end
    (``GenerateComplete``: finished, with the finish reason in the Worker protocol's words;
    anything after it is ignored). A ``finish_reason`` of ``"error"`` makes the next take raise
    the owner's failure (the tokens merged with it are dropped: the service resumes after the
    tokens the client has).

    The HTTP/2 reader feeds raw messages (:meth:`feed`, a :class:`router.vllm_h2.MessageSink`):
    a stream chunk, what vLLM sends per token, is decoded here straight into the list of ids,
    without a protobuf message, its sub-message and its repeated-field wrapper per token; any
    other message (the end, a chunk with logprobs, an unknown field, a large or malformed one) is
    parsed by protobuf and added as ``grpc.aio`` delivers it (:meth:`add`).
    """

    __slots__ = ("_detok", "_error", "cached", "failed", "finished", "ids", "prompt", "reason", "request_id")

    def __init__(self, request_id: str, detok: Detokenizer | None, error: Callable[[], Exception]) -> None:
        self.request_id = request_id
        self._detok = detok
        self._error = error
        self.ids: list[int] = []
        self.prompt = 0
        self.cached = 0
        self.finished = False
        self.reason = ""
        self.failed = False

    def add(self, response: Any) -> None:
        """One parsed ``GenerateResponse``."""
        if self.finished or self.failed:
            return
        kind = response.WhichOneof("response")
        if kind == "chunk":
            chunk = response.chunk
            self.ids.extend(chunk.token_ids)
            if not self.prompt:
                self.prompt = chunk.prompt_tokens
            if chunk.cached_tokens > self.cached:
                self.cached = chunk.cached_tokens
        elif kind == "complete":
            reason = response.complete.finish_reason
            if reason == "error":
                self.failed = True
                return
            # In a streamed call the chunks already carried every token.
            self.finished = True
            self.reason = _finish_reason(reason)

    def feed(self, data: bytes) -> None:
        """One serialized ``GenerateResponse`` (see the class docstring)."""
        if self.finished or self.failed:
            return
        n = len(data)
        # A chunk under 128 bytes: tag 1 (length-delimited), a one-byte length that spans the rest.
        if n >= 2 and data[0] == 0x0A and data[1] < 0x80 and data[1] + 2 == n:
            ids = self.ids
            had = len(ids)
            if _chunk_into(data, ids, self):
                return
            del ids[had:]  # not a plain chunk after all: protobuf decides
        self.add(_RESPONSE_FROM_STRING(data))

    def take(self) -> Tokens:
        """Everything since the last take as one record; raises the owner's failure after an error."""
        if self.failed:
            raise self._error()
        ids = self.ids
        self.ids = []
        detok = self._detok
        text = detok.add(ids) if detok is not None and ids else ""
        out = Tokens(self.request_id, ids, text, self.finished, self.reason, self.prompt, self.cached)
        self.prompt = self.cached = 0
        return out


_RESPONSE_FROM_STRING = vllm_pb2.GenerateResponse.FromString


def _chunk_into(data: bytes, ids: list[int], merge: GenerateMerge) -> bool:
    """Decode the ``GenerateStreamChunk`` in ``data[2:]`` into ``ids`` and ``merge``'s counts.

    Only the fields vLLM sends on the token path are read (token ids packed or not, prompt,
    completion and cached token counts, the output index); False for anything else (logprobs,
    an unknown field, a varint longer than a ``uint32``'s or running past the end), and the
    caller hands the message to protobuf. Protobuf's rules for these fields: the last value of a
    scalar wins, repeated values accumulate.

    The varint loop is written out twice (packed ids, single fields) rather than called: this runs
    once per token of every stream, and a helper would add a Python call per token to it.
    """
    n = len(data)
    pos = 2
    prompt = cached = -1
    try:
        while pos < n:
            tag = data[pos]
            pos += 1
            if tag == 0x0A:  # token_ids, packed
                stop = pos + 1 + data[pos]
                if data[pos] >= 0x80 or stop > n:
                    return False
                pos += 1
                while pos < stop:
                    byte = data[pos]
                    pos += 1
                    if byte < 0x80:
                        ids.append(byte)
                        continue
                    value = byte & 0x7F
                    shift = 7
                    while True:
                        byte = data[pos]
                        pos += 1
                        value |= (byte & 0x7F) << shift
                        if byte < 0x80:
                            break
                        shift += 7
                        if shift > 28:
                            return False
                    if value >> 32:
                        return False
                    ids.append(value)
                if pos != stop:
                    return False
            elif tag in (0x08, 0x10, 0x18, 0x20, 0x38):  # token id (unpacked), the counts, index
                value = 0
                shift = 0
                while True:
                    byte = data[pos]
                    pos += 1
                    value |= (byte & 0x7F) << shift
                    if byte < 0x80:
                        break
                    shift += 7
                    if shift > 28:
                        return False
                if value >> 32:
                    return False
                if tag == 0x08:
                    ids.append(value)
                elif tag == 0x10:
                    prompt = value
                elif tag == 0x20:
                    cached = value
            else:
                return False
    except IndexError:  # a varint running past the end: protobuf says what is wrong
        return False
    if prompt > 0 and not merge.prompt:
        merge.prompt = prompt
    if cached > merge.cached:
        merge.cached = cached
    return True


class VllmGrpcClient:
    """Calls ``vllm.grpc.engine.VllmEngine`` for a :class:`~router.forward.WorkerClient`.

    Holds its own bounded set of channels (vLLM's stub differs from the Worker stub); the
    deadlines, the outcome reports and the error type are the owner's.
    """

    def __init__(
        self,
        owner: LegOwner,
        *,
        max_channels: int,
        tls: ClientTls | None,
        decode: Callable[[list[int]], str] | None = None,
        stream_interval_s: float = DEFAULT_STREAM_INTERVAL_S,
        stream_messages_per_s: float = DEFAULT_STREAM_MESSAGES_PER_S,
    ) -> None:
        self._owner = owner
        #: Paces every stream this client relays (one budget for all of them).
        self.pacer = RelayPacer(stream_interval_s, stream_messages_per_s)
        self._max = max_channels
        self._tls = tls
        self._decode = decode
        self._channels: OrderedDict[str, tuple[grpc.aio.Channel, Any]] = OrderedDict()
        #: ``--vllm-transport`` (:data:`VLLM_TRANSPORTS`).
        self.transport = "h2"
        self._h2 = H2Pool(max_channels, limits.SERVING_MAX_MESSAGE_BYTES)

    @property
    def h2_read_pauses(self) -> int:
        """How often the HTTP/2 reader's open connections paused reading (see ``H2Connection._coalesce``)."""
        return self._h2.read_pauses

    def set_transport(self, transport: str) -> None:
        """``--vllm-transport``: ``h2`` or ``grpc`` (see :data:`VLLM_TRANSPORTS`)."""
        if transport not in VLLM_TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(VLLM_TRANSPORTS)}, got {transport!r}")
        self.transport = transport

    def set_pacing(self, interval_s: float, messages_per_s: float) -> None:
        """``--vllm-stream-interval-ms`` and ``--vllm-stream-messages-per-s`` (see :class:`RelayPacer`)."""
        self.pacer = RelayPacer(interval_s, messages_per_s)

    def set_decoder(self, decode: Callable[[list[int]], str] | None) -> None:
        """The token → text function (the router's tokenizer); None leaves messages without text."""
        self._decode = decode

    def entry(self, endpoint: str) -> tuple[grpc.aio.Channel, Any]:
        """The channel to ``endpoint`` (``vllm-grpc://host:port``) and its ``VllmEngine`` stub."""
        found = self._channels.get(endpoint)
        if found is not None:
            self._channels.move_to_end(endpoint)
            return found
        _, address = split_endpoint(endpoint)
        channel = open_channel(address, CHANNEL_OPTIONS, tls=self._tls)
        found = (channel, vllm_pb2_grpc.VllmEngineStub(channel))
        self._channels[endpoint] = found
        while len(self._channels) > self._max:
            _, (old, _) = self._channels.popitem(last=False)
            task = asyncio.get_running_loop().create_task(old.close(grace=30.0))
            self._owner.keep(task)
        return found

    def _text(self, detok: Detokenizer | None, token_ids: Sequence[int]) -> str:
        return detok.add(token_ids) if detok is not None else ""

    def _detokenizer(self, context: Sequence[int]) -> Detokenizer | None:
        return Detokenizer(self._decode, context) if self._decode is not None else None

    async def prefill(
        self,
        target: Target,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: common_pb2.SamplingParams,
        timeout_s: float,
        ledger: LegLedger,
    ) -> worker_pb2.PrefillResponse:
        """The prefill leg: one token, the KV kept for a decode engine; see the module docstring."""
        owner = self._owner
        ledger.endpoints.add(target.endpoint)
        channel, stub = self.entry(target.endpoint)
        await owner.await_channel(channel, target)
        request = vllm_pb2.GenerateRequest(
            request_id=request_id,
            tokenized=vllm_pb2.TokenizedInput(input_ids=prompt_token_ids),
            sampling_params=vllm_sampling(sampling, 1),
            stream=False,
            kv_transfer_params_json=PREFILL_KV_PARAMS,
        )
        first_bound = owner.first_message_timeout_s < timeout_s
        complete = None
        try:
            call = stub.Generate(request, timeout=min(timeout_s, owner.first_message_timeout_s))
            async for response in call:
                if response.HasField("complete"):
                    complete = response.complete
        except grpc.aio.AioRpcError as exc:
            if first_bound and exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                raise owner.first_message_error(target) from exc
            raise owner.failed_call(target, exc) from exc
        if complete is None or not complete.output_ids or complete.finish_reason == "error":
            raise owner.failed(
                target,
                grpc.StatusCode.INTERNAL,
                f"vLLM at {target.endpoint} ended the prefill without a token "
                f"(finish_reason {getattr(complete, 'finish_reason', '')!r})",
            )
        owner.succeeded(target)
        token = int(complete.output_ids[0])
        finished = complete.finish_reason == "stop" or sampling.max_tokens <= 1
        detok = self._detokenizer(prompt_token_ids)
        handle = complete.kv_transfer_params_json if complete.HasField("kv_transfer_params_json") else ""
        return worker_pb2.PrefillResponse(
            request_id=request_id,
            first_token_id=token,
            text=self._text(detok, [token]),
            kv_handle=handle.encode(),
            finished=finished,
            finish_reason=_finish_reason(complete.finish_reason) if finished else "",
            num_prompt_tokens=complete.prompt_tokens or len(prompt_token_ids),
            num_cached_prompt_tokens=complete.cached_tokens,
        )

    def stream(
        self,
        target: Target,
        request: worker_pb2.WorkerGenerateRequest | worker_pb2.DecodeRequest,
        timeout_s: float,
        ledger: LegLedger,
    ) -> AsyncIterator[Tokens]:
        """A neutral generate or a decode leg as :class:`~router.mux.Tokens`; see the module docstring.

        Returns the transport's own generator (:meth:`_stream_h2` or :meth:`_stream_grpc`), not a
        generator around it: each generator between the engine's message and the client is one
        more hop per message.
        """
        ledger.endpoints.add(target.endpoint)
        sampling = request.sampling
        if isinstance(request, worker_pb2.DecodeRequest):
            context = [*request.prompt_token_ids, *request.generated_token_ids]
            remaining = sampling.max_tokens - len(request.generated_token_ids)
            kv_params = request.kv_handle.decode() if request.kv_handle else ""
        else:
            context = list(request.prompt_token_ids)
            remaining = sampling.max_tokens
            kv_params = ""
        request_id = request.request_id
        if remaining <= 0:  # every token was produced before a failure: nothing to run
            return _nothing_left(request_id)
        message = vllm_pb2.GenerateRequest(
            request_id=request_id,
            sampling_params=vllm_sampling(sampling, remaining),
            stream=True,
        )
        if context:
            message.tokenized.input_ids.extend(context)
        else:
            message.text = getattr(request, "prompt", "")
        if kv_params:
            message.kv_transfer_params_json = kv_params
        owner = self._owner

        def error() -> Exception:
            return owner.failed(
                target, grpc.StatusCode.INTERNAL, f"vLLM at {target.endpoint} failed the request"
            )

        merge = GenerateMerge(request_id, self._detokenizer(context), error)
        if self.transport == "h2" and self._tls is None and H2_AVAILABLE:
            return self._stream_h2(target, message, timeout_s, merge)
        return self._stream_grpc(target, message, timeout_s, merge)

    async def _stream_grpc(
        self, target: Target, message: Any, timeout_s: float, merge: GenerateMerge
    ) -> AsyncGenerator[Tokens, None]:
        """:meth:`stream`'s call over ``grpc.aio`` (TLS endpoints, ``--vllm-transport grpc``)."""
        owner = self._owner
        channel, stub = self.entry(target.endpoint)
        await owner.await_channel(channel, target)
        call = stub.Generate(message, timeout=timeout_s)
        # The first response goes straight through (the TTFT path); after it a reader task drains the
        # stream and each step of the consumer takes everything that arrived meanwhile as one
        # message, as the Worker path does (router.forward._coalesced): when the client or the
        # router falls behind, the ready tokens go out together instead of one message each.
        try:
            try:
                async with asyncio.timeout(owner.first_message_timeout_s):
                    response = await call.read()
            except TimeoutError:
                raise owner.first_message_error(target) from None
            if response is _EOF:
                return
            owner.succeeded(target)
            merge.add(response)
            first = merge.take()
            yield first
            if first.finished:
                return
        except grpc.aio.AioRpcError as exc:
            call.cancel()
            raise owner.failed_call(target, exc) from exc
        except BaseException:
            call.cancel()
            raise

        try:
            async with contextlib.aclosing(paced_batches(call, self.pacer)) as batches:
                async for batch in batches:
                    for response in batch:
                        merge.add(response)
                    out = merge.take()
                    yield out
                    if out.finished:
                        return
        except grpc.aio.AioRpcError as exc:
            raise owner.failed_call(target, exc) from exc
        finally:
            call.cancel()  # no-op once the stream ended; stops the request when the consumer left

    async def _stream_h2(
        self, target: Target, message: Any, timeout_s: float, merge: GenerateMerge
    ) -> AsyncGenerator[Tokens, None]:
        """:meth:`stream`'s call over :mod:`router.vllm_h2`: the same deadlines, outcomes and errors."""
        owner = self._owner
        _, address = split_endpoint(target.endpoint)
        try:
            conn = await self._h2.connection(address, owner.connect_timeout_s)
        except TimeoutError:
            raise owner.failed(
                target,
                grpc.StatusCode.UNAVAILABLE,
                f"no connection to {target.endpoint} within {owner.connect_timeout_s:g} s "
                "(--worker-connect-timeout-s): the endpoint accepts but does not answer",
            ) from None
        except (OSError, ValueError) as exc:
            raise owner.failed(
                target,
                grpc.StatusCode.UNAVAILABLE,
                f"cannot connect to {target.endpoint} ({exc}; the engine is down or unreachable)",
            ) from exc
        call = conn.start(GENERATE_PATH, message.SerializeToString(), timeout_s, merge)
        # The call's deadline is a timer (grpc-timeout tells the server too); it resets the stream.
        deadline = asyncio.get_running_loop().call_later(
            timeout_s, call.cancel, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
        )
        try:
            try:
                async with asyncio.timeout(owner.first_message_timeout_s):
                    await call.wait()
            except TimeoutError:
                raise owner.first_message_error(target) from None
            if not call.ready:
                if call.error is not None:
                    raise call.error
                return
            owner.succeeded(target)
            # The first response goes straight through (the TTFT path), with whatever came with it.
            first: Tokens = call.take()
            yield first
            if first.finished:
                return
            async with contextlib.aclosing(paced_stream_batches(call, self.pacer)) as batches:
                async for out in batches:
                    yield out
                    if out.finished:
                        return
        except CallError as exc:
            raise owner.failed(target, exc.code, exc.details) from exc
        finally:
            deadline.cancel()
            call.cancel()  # no-op once the call ended; stops the request when the consumer left

    async def abort(self, endpoint: str, request_id: str, timeout_s: float) -> None:
        try:
            await self.entry(endpoint)[1].Abort(
                vllm_pb2.AbortRequest(request_ids=[request_id]), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            logger.debug("abort of %s on %s failed: %s", request_id, endpoint, exc.code().name)

    async def close(self) -> None:
        channels = [c for c, _ in self._channels.values()]
        self._channels.clear()
        self._h2.close()
        await asyncio.gather(*(c.close(grace=None) for c in channels), return_exceptions=True)


#: Most vLLM block hashes a :class:`KvEventTranslator` remembers per engine (the engine's own
#: bound is its KV capacity; a CPU engine with 1 GiB of KV holds a few thousand blocks).
MAX_TRANSLATED_BLOCKS = 1 << 20


class KvEventGap(Exception):
    """A ``SubscribeKvEvents`` batch went missing (or a snapshot chunk came without its start)."""


class KvEventTranslator:
    """vLLM's KV events in this router's chained block hashes (:func:`fleet.prefix.token_block_hashes`).

    vLLM names a block by its own hash (SHA-256 over its block layout, salted per process
    unless ``PYTHONHASHSEED`` is fixed) and publishes, with each stored block, its token ids and
    its parent's hash. The router names a prompt's blocks by ``hash((parent, tokens))`` from
    :data:`fleet.prefix.ROOT_HASH`. So each stored block is re-hashed here from its tokens and its
    parent's re-hash, and the pair is remembered for the removals and children to come. Blocks the
    router cannot name are skipped, with their descendants: a block of another size than the
    router's chain block, one whose hash folds in more than tokens (a LoRA adapter, a cache salt,
    multimodal inputs: vLLM's ``extra_keys``), and one whose parent it never heard of.
    """

    def __init__(self, block_tokens: int, max_blocks: int = MAX_TRANSLATED_BLOCKS) -> None:
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
        self.block_tokens = block_tokens
        self._max = max_blocks
        self._ours: dict[int, int] = {}
        #: Stored blocks skipped (wrong size, extra keys, unknown parent), for logs and tests.
        self.skipped = 0

    def __len__(self) -> int:
        return len(self._ours)

    def reset(self) -> None:
        """Forget every block (a new subscription starts from nothing)."""
        self._ours.clear()

    def events(self, batch: Any) -> list[tuple[str, list[int]]]:
        """The ``(kind, our hashes)`` events of one ``KvEventBatch``, oldest first."""
        from fleet.prefix import ROOT_HASH

        out: list[tuple[str, list[int]]] = []
        ours = self._ours
        for event in batch.events:
            kind = event.WhichOneof("data")
            if kind == "stored":
                stored = event.stored
                parent: int | None = ROOT_HASH
                if stored.HasField("parent_block_hash"):
                    parent = ours.get(stored.parent_block_hash)
                hashes: list[int] = []
                for block in stored.blocks:
                    tokens = tuple(block.token_ids)
                    if parent is None or len(tokens) != self.block_tokens or len(block.extra_keys):
                        parent = None
                        self.skipped += 1
                        continue
                    parent = hash((parent, tokens))
                    hashes.append(parent)
                    if len(ours) < self._max or block.block_hash in ours:
                        ours[block.block_hash] = parent
                if hashes:
                    out.append(("stored", hashes))
            elif kind == "removed":
                removed = [
                    h for h in (ours.pop(b, None) for b in event.removed.block_hashes) if h is not None
                ]
                if removed:
                    out.append(("removed", removed))
            elif kind == "cleared":
                ours.clear()
                out.append(("cleared", []))
        return out


async def follow_kv_events(
    stub: Any,
    apply: Callable[[list[tuple[str, list[int]]]], None],
    translator: KvEventTranslator,
    on_synced: Callable[[], None] | None = None,
) -> None:
    """Follow one engine's ``SubscribeKvEvents`` until the stream ends; :class:`KvEventGap` on a gap.

    ``apply`` gets each batch's events in the router's hashes. The servicer starts a stream with a
    snapshot of the engine's blocks when its relay has history (chunks numbered up to the
    current sequence, the first one beginning with a clear), else with live batches only; so a
    (re)subscription first clears what the router held of the engine, then applies what comes.
    After that each data-parallel rank's batches must come numbered one after the other (a
    ``load_only`` batch repeats the last number and carries no events). ``on_synced`` is called
    after the first applied batch.
    """
    from smg_grpc_proto.generated import common_pb2 as smg_common_pb2

    call = stub.SubscribeKvEvents(smg_common_pb2.SubscribeKvEventsRequest())
    last: dict[int, int] = {}
    synced = False
    translator.reset()
    apply([("cleared", [])])
    try:
        async for batch in call:
            if batch.HasField("load") and batch.load.load_only:
                continue
            rank = batch.dp_rank if batch.HasField("dp_rank") else 0
            seq = batch.sequence_number
            previous = last.get(rank)
            starts = batch.HasField("snapshot") and batch.snapshot.index == 0
            if not starts and previous is not None and seq != previous + 1:
                raise KvEventGap(f"rank {rank}: batch {seq} after {previous}")
            if not starts and previous is None and batch.HasField("snapshot"):
                raise KvEventGap(f"snapshot chunk {batch.snapshot.index} without its start")
            last[rank] = seq
            events = translator.events(batch)
            if events:
                apply(events)
            if not synced:
                synced = True
                if on_synced is not None:
                    on_synced()
    finally:
        call.cancel()
