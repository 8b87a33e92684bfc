"""The ``sim`` backend: :class:`SimEngine` runs :class:`engine.model.SimCore` in real time.

The step loop asks the core for a step, sleeps its duration and applies it,
then turns the tokens the step produced into token ids and text and hands
them to each request's :class:`engine.interface.DeltaCollector`.

Output tokens are a pure function of the request (sampling seed, prompt,
position; :mod:`engine.outputs`), never of the engine or of timing, so a ``Prefill`` on one sim
worker followed by a ``Decode`` on another yields exactly the tokens a
``Generate`` on one would. With ``eos_probability > 0`` the position of the
EOS token is drawn the same way (geometric, from the request's seed), and
``ignore_eos`` skips it. Token ids are printable ASCII bytes of the built-in
tokenizer (:mod:`engine.tokenizer`), so the text is readable.

This module is also the ``sim`` entry of the backend registry
(:mod:`workers.backends`): :func:`add_arguments` and :func:`build_engine`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import enum
import logging
import random
import re
import secrets
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

from engine.interface import (
    DeltaCollector,
    DuplicateRequestError,
    EngineInfo,
    EngineLoad,
    EngineShuttingDownError,
    InvalidRequestError,
    KvHandleError,
    PrefillResult,
    Sampling,
    TokenDelta,
    validate_request,
)
from engine.model import ProfileCostModel, SimConfig, SimCore, SimRequestSpec, StepResult
from engine.outputs import eos_position, output_length, output_token, prompt_digest, request_key
from engine.tokenizer import EOS_TOKEN_ID, IncrementalDecoder, SimpleTokenizer
from fleet.prefix import token_block_hashes
from predictor import LatencyPredictor
from workers.kv_events import KvEventHub
from workers.kv_transfer import GrpcKvPeer, KvPeer, SimKvHandle

logger = logging.getLogger(__name__)

#: How far a late step loop (a busy event loop, a descheduled process) may shorten the
#: following steps to get back onto the profile's timeline; longer stalls are lost time.
_MAX_CATCH_UP_S = 0.010
#: Bound on the timer lateness the step loop learns and aims ahead by.
_MAX_LATENESS_S = 0.002

#: Where the bundled default profiles live (the repository's profiling_data/).
DEFAULT_PROFILE_DIR = Path(__file__).resolve().parent.parent / "profiling_data" / "qwen2.5-7b-2xv100-linear"


class _Kind(enum.Enum):
    GENERATE = "generate"
    PREFILL = "prefill"
    DECODE = "decode"


class _Stream:
    """The runner's side of one request: token values, text, stop strings, and its consumer."""

    __slots__ = (
        "collector",
        "decoder",
        "digest",
        "done",
        "emitted",
        "eos_index",
        "future",
        "key",
        "kind",
        "num_prompt_tokens",
        "offset",
        "request_id",
        "stop",
        "text",
        "total",
        "total_reason",
    )

    def __init__(
        self,
        request_id: str,
        kind: _Kind,
        prompt_token_ids: Sequence[int],
        sampling: Sampling,
        generated: Sequence[int],
        eos_probability: float,
    ) -> None:
        self.request_id = request_id
        self.kind = kind
        self.digest = prompt_digest(prompt_token_ids)
        self.key = request_key(sampling.seed, self.digest)
        self.eos_index = None if sampling.ignore_eos else eos_position(self.key, eos_probability)
        self.total, self.total_reason = output_length(self.key, sampling, eos_probability)
        self.offset = len(generated)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.stop = sampling.stop
        self.decoder = IncrementalDecoder()
        # Only kept when there are stop strings: the text generated so far and
        # how much of it was sent (the rest may be the start of a stop string).
        self.text = ""
        try:
            prior = self.decoder.push(generated)
        except ValueError:
            # Tokens from another tokenizer: their text is unknown here, only new text is sent.
            self.decoder = IncrementalDecoder()
            prior = ""
        if self.stop:
            self.text = prior
        self.emitted = len(self.text)
        self.collector = DeltaCollector()
        self.future: asyncio.Future[PrefillResult] | None = None
        self.done = False


class _Held:
    __slots__ = ("nonce", "num_tokens", "timer")

    def __init__(self, nonce: str, num_tokens: int, timer: asyncio.TimerHandle) -> None:
        self.nonce = nonce
        self.num_tokens = num_tokens
        self.timer = timer


class SimEngine:
    """A simulated engine with profile-driven step times; implements :class:`engine.interface.Engine`."""

    def __init__(
        self,
        config: SimConfig | None = None,
        predictor: LatencyPredictor | None = None,
        *,
        model: str = "sim",
        rng: random.Random | None = None,
        kv_peer: KvPeer | None = None,
        endpoint: str = "",
    ) -> None:
        self._config = config if config is not None else SimConfig()
        if predictor is None:
            predictor = LatencyPredictor.from_files(
                DEFAULT_PROFILE_DIR / "ttft.json", DEFAULT_PROFILE_DIR / "tpot.json"
            )
        self.predictor = predictor
        cost = ProfileCostModel(
            predictor,
            speed_factor=self._config.speed_factor,
            noise=self._config.noise,
            rng=rng if rng is not None else random.Random(self._config.seed),
        )
        self.core = SimCore(self._config, cost)
        # Per request, the prompt tokens the prefix cache spared it at its first lookup, until its first
        # delta reports them (``TokenDelta.num_cached_prompt_tokens``, as a vLLM engine reports its
        # ``num_cached_tokens``); an entry goes with its stream.
        self._prefix_hits: dict[str, int] = {}
        if self._config.prefix_cache_block_tokens:
            self.core.on_lookup = self._note_lookup
        #: The prefix cache's block events for ``Worker.KvEvents`` (block_tokens 0: caching off).
        self.kv_events = KvEventHub(
            self._config.prefix_cache_block_tokens,
            self.core.cached_block_hashes,
            flush=self._publish_kv_events,
        )
        self._info = EngineInfo(
            model=model,
            max_num_batched_tokens=self._config.max_num_batched_tokens,
            kv_capacity_tokens=self._config.kv_capacity_tokens,
            block_size=self._config.block_size,
            max_model_len=self._config.max_model_len,
            max_num_seqs=self._config.max_num_seqs,
        )
        self._tokenizer = SimpleTokenizer()
        # Pulls from other instances go over their Worker service unless told otherwise.
        self._kv_peer: KvPeer = kv_peer if kv_peer is not None else GrpcKvPeer()
        self._endpoint = endpoint
        self._engine_id = uuid.uuid4().hex
        self._streams: dict[str, _Stream] = {}
        # Decodes pulling KV from a prefill instance; the value says "aborted meanwhile".
        self._pulls: dict[str, bool] = {}
        self._held: dict[str, _Held] = {}
        self._listeners: list[Callable[[], None]] = []
        self._wake = asyncio.Event()
        # Cleared by the stall() fault hook: the step loop waits on it between steps.
        self._steps_allowed = asyncio.Event()
        self._steps_allowed.set()
        self._task: asyncio.Task[None] | None = None
        # Mean lateness of the event loop's timers (seconds), subtracted from step sleeps.
        self._lateness_s = 0.0005
        self._started = False
        self._stopped = False

    # ------------------------------------------------------------------ Engine protocol

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def config(self) -> SimConfig:
        return self._config

    @property
    def tokenizer(self) -> SimpleTokenizer:
        return self._tokenizer

    @property
    def engine_id(self) -> str:
        return self._engine_id

    def set_endpoint(self, endpoint: str) -> None:
        self._endpoint = endpoint

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine-steps")

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])
        for rid in list(self._streams):
            self._abort(rid)
        for rid in list(self._held):
            self._drop_held(rid)
        for rid in list(self._pulls):
            self._pulls[rid] = True
        await self._kv_peer.close()
        self._changed()

    # ------------------------------------------------------------------ fault injection

    def stall(self) -> None:
        """Fault injection: stop the step loop after the step in progress, as a hung engine would.

        Admission keeps working (requests queue up, the load says so) and the
        worker's agent keeps heart-beating, but no step finishes until
        :meth:`resume`. Tests use it to check engine-liveness reporting.
        """
        self._steps_allowed.clear()

    def resume(self) -> None:
        """End a :meth:`stall`: steps run again from the current state."""
        self._steps_allowed.set()

    @property
    def stalled(self) -> bool:
        return not self._steps_allowed.is_set()

    async def generate(
        self, request_id: str, prompt_token_ids: tuple[int, ...], sampling: Sampling
    ) -> AsyncIterator[TokenDelta]:
        stream = self._admit(request_id, prompt_token_ids, sampling, _Kind.GENERATE)
        async for delta in self._drain(stream):
            yield delta

    async def prefill(
        self, request_id: str, prompt_token_ids: tuple[int, ...], sampling: Sampling
    ) -> PrefillResult:
        stream = self._admit(request_id, prompt_token_ids, sampling, _Kind.PREFILL)
        assert stream.future is not None
        try:
            return await stream.future
        finally:
            self._release(stream)

    async def decode(
        self,
        request_id: str,
        prompt_token_ids: tuple[int, ...],
        sampling: Sampling,
        kv_handle: bytes,
        generated_token_ids: tuple[int, ...],
    ) -> AsyncIterator[TokenDelta]:
        self._check_open()
        validate_request(self._info, request_id, prompt_token_ids, sampling, generated_token_ids)
        cached = 0
        if kv_handle:
            handle = SimKvHandle.decode(kv_handle)
            if handle.prompt_digest != prompt_digest(prompt_token_ids).hex():
                raise InvalidRequestError(
                    "kv_handle: it was made for a different prompt than prompt_token_ids; send the prompt "
                    "the Prefill computed"
                )
            self._check_free_id(request_id)
            self._pulls[request_id] = False
            try:
                cached = await self._pull(handle)
                aborted = self._pulls[request_id]
            finally:
                del self._pulls[request_id]
            if aborted:
                yield TokenDelta(token_ids=(), finished=True, finish_reason="abort")
                return
        stream = self._admit(
            request_id, prompt_token_ids, sampling, _Kind.DECODE, generated=generated_token_ids, cached=cached
        )
        first = True
        async for delta in self._drain(stream):
            if first and cached:
                delta = dataclasses.replace(delta, num_cached_prompt_tokens=cached)
            first = False
            yield delta

    async def abort(self, request_id: str) -> bool:
        return self._abort(request_id)

    def load(self) -> EngineLoad:
        return self.core.load(schedulable=self._started and not self._stopped)

    def add_load_listener(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)

    # ------------------------------------------------------------------ admission

    def _check_open(self) -> None:
        if not self._started:
            raise EngineShuttingDownError("the engine has not been started")
        if self._stopped:
            raise EngineShuttingDownError("the engine is shutting down; send the request to another instance")

    def _check_free_id(self, request_id: str) -> None:
        if request_id in self._streams or request_id in self._pulls or self.core.is_active(request_id):
            raise DuplicateRequestError(
                f"request_id {request_id!r} is already in flight on this instance; use a new id or Abort it first"
            )

    def _admit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: Sampling,
        kind: _Kind,
        *,
        generated: Sequence[int] = (),
        cached: int = 0,
    ) -> _Stream:
        self._check_open()
        validate_request(self._info, request_id, prompt_token_ids, sampling, generated)
        self._check_free_id(request_id)
        stream = _Stream(
            request_id, kind, prompt_token_ids, sampling, generated, self._config.eos_probability
        )
        if kind is _Kind.PREFILL:
            stream.future = asyncio.get_running_loop().create_future()
        remaining = stream.total - stream.offset
        if remaining <= 0:
            # The request's own EOS lies among the tokens already generated elsewhere
            # (an engine with a different eos_probability made them); nothing is left.
            stream.done = True
            stream.collector.put((), finished=True, finish_reason="stop")
            return stream
        if request_id in self._held:
            self._drop_held(request_id)
        pbt = self._config.prefix_cache_block_tokens
        hashes: tuple[int, ...] = ()
        if pbt and kind is not _Kind.DECODE:
            # Content addresses of the prompt's full blocks: what the cache looks up and stores.
            hashes = token_block_hashes(prompt_token_ids, pbt)
        spec = SimRequestSpec(
            request_id=request_id,
            num_context_tokens=len(prompt_token_ids) + len(generated),
            max_new_tokens=1 if kind is _Kind.PREFILL else remaining,
            num_cached_tokens=cached,
            hold_kv=kind is _Kind.PREFILL and stream.total > 1,
            counts_as_decode=kind is _Kind.DECODE or (kind is _Kind.GENERATE and remaining > 1),
            block_hashes=hashes,
        )
        self.core.add(spec)
        self._streams[request_id] = stream
        self._changed(wake=True)
        return stream

    def _note_lookup(self, request_id: str, context_tokens: int, hit_tokens: int) -> None:
        if hit_tokens and request_id in self._streams:
            self._prefix_hits.setdefault(request_id, hit_tokens)

    async def _drain(self, stream: _Stream) -> AsyncIterator[TokenDelta]:
        first = True
        try:
            while True:
                delta = await stream.collector.get()
                if first:
                    first = False
                    hit = self._prefix_hits.pop(stream.request_id, 0)
                    if hit and not delta.num_cached_prompt_tokens:
                        delta = dataclasses.replace(delta, num_cached_prompt_tokens=hit)
                yield delta
                if delta.finished:
                    return
        finally:
            self._release(stream)

    def _release(self, stream: _Stream) -> None:
        """The consumer is gone: abort the request unless it already ended."""
        self._prefix_hits.pop(stream.request_id, None)
        if stream.done or self._streams.get(stream.request_id) is not stream:
            return
        stream.done = True
        del self._streams[stream.request_id]
        self.core.abort(stream.request_id)
        self._changed(wake=True)

    def _abort(self, request_id: str) -> bool:
        found = False
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            found = True
            stream.done = True
            self.core.abort(request_id)
            self._finish_stream(stream, (), "", "abort")
        if request_id in self._held:
            self._drop_held(request_id)
            found = True
        if request_id in self._pulls:
            self._pulls[request_id] = True
            found = True
        if found:
            self._changed(wake=True)
        return found

    # ------------------------------------------------------------------ PD

    async def _pull(self, handle: SimKvHandle) -> int:
        """Take the KV a handle names; the number of context tokens now cached here."""
        if handle.engine_id == self._engine_id:
            held = self._held.get(handle.request_id)
            if held is None or held.nonce != handle.nonce:
                raise KvHandleError(
                    f"kv_handle: the KV of {handle.request_id!r} is no longer held here (expired after "
                    f"{self._config.kv_hold_timeout_s} s, already pulled, or aborted); re-prefill or decode "
                    "with an empty kv_handle"
                )
            self._drop_held(handle.request_id)
            return handle.num_tokens
        await asyncio.sleep(self._config.kv_transfer_s(handle.num_tokens))
        if not await self._kv_peer.release(handle.endpoint, handle.request_id):
            raise KvHandleError(
                f"kv_handle: the prefill instance at {handle.endpoint} no longer holds the KV of "
                f"{handle.request_id!r} (expired, already pulled, aborted, or the instance restarted); "
                "re-prefill or decode with an empty kv_handle"
            )
        return handle.num_tokens

    def _hold(self, stream: _Stream) -> bytes:
        """Start the hold timer of a finished prefill's KV and return its handle."""
        num_tokens = self.core.held_tokens(stream.request_id)
        assert num_tokens is not None
        nonce = secrets.token_hex(8)
        timer = asyncio.get_running_loop().call_later(
            self._config.kv_hold_timeout_s, self._expire_held, stream.request_id, nonce
        )
        self._held[stream.request_id] = _Held(nonce, num_tokens, timer)
        return SimKvHandle(
            endpoint=self._endpoint,
            engine_id=self._engine_id,
            request_id=stream.request_id,
            nonce=nonce,
            num_tokens=num_tokens,
            prompt_digest=stream.digest.hex(),
        ).encode()

    def _expire_held(self, request_id: str, nonce: str) -> None:
        held = self._held.get(request_id)
        if held is not None and held.nonce == nonce:
            logger.debug("KV of %s expired unpulled", request_id)
            self._drop_held(request_id)
            self._changed(wake=True)

    def _drop_held(self, request_id: str) -> None:
        held = self._held.pop(request_id, None)
        if held is not None:
            held.timer.cancel()
        self.core.release_held(request_id)

    # ------------------------------------------------------------------ step loop

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        # While steps run back to back, each starts at the previous one's planned
        # end rather than when the loop woke up: the event loop's timers are only
        # millisecond-precise, and this keeps the average step time on the profile.
        deadline: float | None = None
        try:
            while True:
                if not self._steps_allowed.is_set():
                    await self._steps_allowed.wait()
                self._wake.clear()
                step = self.core.schedule()
                self._publish_kv_events()  # making room evicts cached blocks
                if step is None:
                    deadline = None
                    await self._wake.wait()
                    continue
                now = loop.time()
                start = now if deadline is None else max(deadline, now - _MAX_CATCH_UP_S)
                deadline = start + step.duration_ms / 1000.0
                self._changed()
                await self._sleep_until(loop, deadline)
                self._dispatch(self.core.finish_step(step))
                self._publish_kv_events()  # the step's computed blocks are now cached
                self._changed()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("sim engine step loop failed; aborting every request")
            self._stopped = True
            for rid in list(self._streams):
                self._abort(rid)
            raise

    def _publish_kv_events(self) -> None:
        """Hand the core's cache events since the last call to the subscribers, as one batch."""
        if not self.core.prefix_block_tokens:
            return
        events, _lost = self.core.drain_kv_events()  # after a loss: CLEARED + the whole cache
        if events:
            self.kv_events.publish((e.kind.value, e.block_hashes) for e in events)

    async def _sleep_until(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        """Sleep until ``deadline`` on average: the loop's timers wake late by up to a
        millisecond, so aim earlier by the lateness seen so far."""
        target = deadline - self._lateness_s
        delay = target - loop.time()
        if delay <= 0:
            await asyncio.sleep(0)
            return
        await asyncio.sleep(delay)
        late = min(max(loop.time() - target, 0.0), _MAX_LATENESS_S)
        self._lateness_s += 0.1 * (late - self._lateness_s)

    def _dispatch(self, result: StepResult) -> None:
        for out in result.outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            pos = stream.offset + out.position
            token = EOS_TOKEN_ID if pos == stream.eos_index else output_token(stream.key, pos)
            prefill = stream.kind is _Kind.PREFILL
            # A prefill's own work ends with its first token; the request ends only if that is its last.
            ends = pos + 1 >= stream.total if prefill else out.finished
            reason = stream.total_reason if ends else ""
            piece = stream.decoder.push((token,))
            if ends:
                piece += stream.decoder.flush()
            stopped = False
            if stream.stop:
                piece, stopped = self._apply_stop(stream, piece, ends or prefill)
            if stopped:
                ends, reason = True, "stop"
                if not out.finished:
                    self.core.abort(out.request_id)
            if prefill:
                self._finish_prefill(stream, token, piece, ends, reason, held=out.held and not stopped)
            elif ends:
                self._finish_stream(stream, (token,), piece, reason)
            else:
                stream.collector.put((token,), piece)

    def _apply_stop(self, stream: _Stream, piece: str, flush: bool) -> tuple[str, bool]:
        """Append ``piece`` to the text; what may be sent now and whether a stop string ended it.

        Without ``flush`` a tail that could still grow into a stop string is held back.
        """
        stream.text += piece
        longest = max(len(s) for s in stream.stop)
        window_start = max(0, stream.emitted - longest + 1)
        hits = [i for i in (stream.text.find(s, window_start) for s in stream.stop) if i >= 0]
        if hits:
            end, stopped = min(hits), True
        elif flush:
            end, stopped = len(stream.text), False
        else:
            # Hold back a tail that could still become a stop string.
            end, stopped = max(stream.emitted, len(stream.text) - longest + 1), False
        out = stream.text[stream.emitted : end] if end > stream.emitted else ""
        stream.emitted = max(stream.emitted, end)
        return out, stopped

    def _finish_prefill(
        self, stream: _Stream, token: int, text: str, finished: bool, reason: str, *, held: bool
    ) -> None:
        stream.done = True
        self._streams.pop(stream.request_id, None)
        if not held:
            self.core.release_held(stream.request_id)
        handle = self._hold(stream) if held else b""
        result = PrefillResult(
            first_token_id=token,
            text=text,
            kv_handle=handle,
            finished=finished,
            finish_reason=reason if finished else "",
            num_prompt_tokens=stream.num_prompt_tokens,
        )
        assert stream.future is not None
        if not stream.future.done():
            stream.future.set_result(result)
        elif held:
            # The caller went away while the step ran: nobody will pull this KV.
            self._drop_held(stream.request_id)

    def _finish_stream(self, stream: _Stream, token_ids: tuple[int, ...], text: str, reason: str) -> None:
        stream.done = True
        self._streams.pop(stream.request_id, None)
        if stream.future is not None:
            if not stream.future.done():
                stream.future.set_result(
                    PrefillResult(
                        first_token_id=0,
                        text="",
                        kv_handle=b"",
                        finished=True,
                        finish_reason=reason,
                        num_prompt_tokens=stream.num_prompt_tokens,
                    )
                )
            return
        stream.collector.put(token_ids, text, finished=True, finish_reason=reason)

    def _changed(self, *, wake: bool = False) -> None:
        if wake:
            self._wake.set()
        for callback in self._listeners:
            try:
                callback()
            except Exception:
                logger.exception("load listener %r failed", callback)


# ---------------------------------------------------------------------- backend registry entry


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``sim`` backend's flags (``slo-router worker --engine sim ...``)."""
    d = SimConfig()
    g = parser.add_argument_group("sim engine")
    g.add_argument("--model", default="sim", help="model name the instance registers (default: %(default)s)")
    g.add_argument(
        "--ttft-profiling-data-path",
        default=str(DEFAULT_PROFILE_DIR / "ttft.json"),
        help="TTFT profile JSON (or a directory holding ttft.json) the step times follow "
        "(default: the bundled Qwen2.5-7B profile's)",
    )
    g.add_argument(
        "--tpot-profiling-data-path",
        default=str(DEFAULT_PROFILE_DIR / "tpot.json"),
        help="TPOT profile JSON (or a directory holding tpot.json) (default: the bundled Qwen2.5-7B profile's)",
    )
    ints = (
        ("--max-num-batched-tokens", d.max_num_batched_tokens, "token budget of one step"),
        ("--kv-capacity-tokens", d.kv_capacity_tokens, "KV cache size in tokens"),
        ("--block-size", d.block_size, "tokens per KV block"),
        ("--max-model-len", d.max_model_len, "longest prompt + output accepted"),
        ("--max-num-seqs", d.max_num_seqs, "most requests running at once"),
        (
            "--max-waiting-requests",
            d.max_waiting_requests,
            "waiting-queue bound; beyond it requests are refused",
        ),
        ("--seed", d.seed, "seed of the step-time noise"),
        (
            "--prefix-cache-block-tokens",
            d.prefix_cache_block_tokens,
            "tokens per prefix-cache block (a multiple of --block-size); 0 = no prefix caching",
        ),
        (
            "--kv-bytes-per-token",
            d.kv_bytes_per_token,
            "KV bytes per token, for the simulated PD transfer time",
        ),
    )
    for flag, default, text in ints:
        g.add_argument(flag, type=int, default=default, help=f"{text} (default: %(default)s)")
    floats = (
        (
            "--speed-factor",
            d.speed_factor,
            "run this many times faster than the profile (2 halves every step)",
        ),
        ("--noise", d.noise, "relative std-dev of seeded step-time noise"),
        ("--kv-slowdown", d.kv_slowdown, "steps take this fraction longer with a full KV cache"),
        ("--eos-probability", d.eos_probability, "chance each output token is EOS"),
        ("--kv-bandwidth-gbps", d.kv_bandwidth_gbps, "PD KV transfer bandwidth, gigabits/s"),
        (
            "--kv-hold-timeout-s",
            d.kv_hold_timeout_s,
            "free a prefill's KV if no decode pulls it within this time",
        ),
    )
    for flag, fdefault, text in floats:
        g.add_argument(flag, type=float, default=fdefault, help=f"{text} (default: %(default)s)")


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """A :class:`SimConfig` from the flags :func:`add_arguments` added; ValueError names a bad flag."""
    try:
        return _sim_config(args)
    except ValueError as exc:
        # SimConfig's messages name its fields; on the command line name the flags (--max-num-seqs).
        message = str(exc)
        for name in sorted((f.name for f in dataclasses.fields(SimConfig)), key=len, reverse=True):
            message = re.sub(rf"(?<![\w-]){name}(?![\w-])", "--" + name.replace("_", "-"), message)
        raise ValueError(message) from exc


def _sim_config(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_capacity_tokens=args.kv_capacity_tokens,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_waiting_requests=args.max_waiting_requests,
        speed_factor=args.speed_factor,
        noise=args.noise,
        kv_slowdown=args.kv_slowdown,
        seed=args.seed,
        eos_probability=args.eos_probability,
        kv_bytes_per_token=args.kv_bytes_per_token,
        kv_bandwidth_gbps=args.kv_bandwidth_gbps,
        kv_hold_timeout_s=args.kv_hold_timeout_s,
        prefix_cache_block_tokens=args.prefix_cache_block_tokens,
    )


def _profile_file(path: str, name: str) -> Path:
    p = Path(path)
    return p / name if p.is_dir() else p


def load_predictor(ttft_path: str, tpot_path: str) -> LatencyPredictor:
    """The profiles the engine's step times follow (a path may be a directory holding ttft.json/tpot.json)."""
    return LatencyPredictor.from_files(
        _profile_file(ttft_path, "ttft.json"), _profile_file(tpot_path, "tpot.json")
    )


def build_engine(args: argparse.Namespace) -> SimEngine:
    """The engine the flags describe; raises ValueError (bad flag) or ProfileError (bad profile)."""
    config = config_from_args(args)
    predictor = load_predictor(args.ttft_profiling_data_path, args.tpot_profiling_data_path)
    from cms.transport import client_tls_from_arg  # --tls-ca: reach prefill peers over TLS

    peer = GrpcKvPeer(
        tls=client_tls_from_arg(getattr(args, "tls_ca", None)),
        call_token=getattr(args, "worker_token", None),
    )
    return SimEngine(config, predictor, model=args.model or "sim", kv_peer=peer)
