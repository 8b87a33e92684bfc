"""Helpers for the tests of the ``vllm`` engine: the vLLM environment, a tiny model, worker processes, a CMS.

vLLM is not installed in the main environment: the tests run there and start
``slo-router worker --engine vllm`` as subprocesses from ``.venv-vllm``
(``make vllm-venv`` creates it; ``make test`` does so first). A missing
environment fails the tests with that instruction rather than skipping them.
"""

from __future__ import annotations

import asyncio
import json
import random
import struct
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import grpc
import pytest
from slorouter.v1 import cms_pb2, cms_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_pb2_grpc

from cms.memory import MemoryStore
from cms.server import CmsServer, start_cms_server
from workers import vllm_process
from workers.vllm_process import VllmWorkerProcess

MAIN_SLO_ROUTER = Path(sys.executable).parent / "slo-router"

#: The tiny model's vocabulary (see workers/vllm_tiny_model.py); ids 0-3 are special.
VOCAB_SIZE = 1000
FIRST_WORD_ID = 4
#: vLLM's KV block size on CPU.
CPU_BLOCK_SIZE = 128
#: Flags every test worker gets: the tiny model in float32, no compilation (faster start).
COMMON_WORKER_ARGS = ("--dtype", "float32", "--enforce-eager")


def require_vllm_env() -> None:
    """Fail (not skip) when the vLLM environment is missing: CI must run these tests."""
    if not vllm_process.vllm_env_ready():
        pytest.fail(vllm_process.MISSING_VENV_HINT, pytrace=False)


def build_tiny_model(out_dir: Path) -> Path:
    """A tiny random Llama + word-level tokenizer in ``out_dir``, built by the vLLM environment's Python."""
    require_vllm_env()
    return vllm_process.build_tiny_model(out_dir)


def random_prompt(n: int, seed: int) -> list[int]:
    """``n`` word token ids (no special tokens), different for every seed."""
    rng = random.Random(seed)
    return [rng.randrange(FIRST_WORD_ID, VOCAB_SIZE) for _ in range(n)]


def start_workers(specs: Sequence[tuple[Path, Path, Sequence[str]]]) -> list[VllmWorkerProcess]:
    """Start several test workers at once (their start-up overlaps) and wait for all of them."""
    require_vllm_env()
    return vllm_process.start_workers(
        [(model, log, [*COMMON_WORKER_ARGS, *args]) for model, log, args in specs]
    )


class CmsThread:
    """An in-memory CMS (``cms.server.start_cms_server``) on its own event loop in a thread.

    Lets module-scoped fixtures share one CMS with worker subprocesses while
    each test runs on its own event loop.
    """

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cms", daemon=True)
        self._thread.start()
        self._server: CmsServer = self._call(start_cms_server(MemoryStore(), "127.0.0.1:0", lease_ttl_s=10.0))
        self.address: str = self._server.address

    def _call(self, coro: Any) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(30)

    def stop(self) -> None:
        self._call(self._server.stop(0))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


async def cluster_view(cms_address: str) -> cms_pb2.ClusterView:
    async with grpc.aio.insecure_channel(cms_address) as channel:
        view: cms_pb2.ClusterView = await cms_pb2_grpc.ClusterMetadataStub(channel).GetClusterView(
            cms_pb2.GetClusterViewRequest(), timeout=5
        )
        return view


async def instance_state(cms_address: str, endpoint: str) -> cms_pb2.InstanceState | None:
    """The CMS's record of the instance serving at ``endpoint``, if registered."""
    for state in (await cluster_view(cms_address)).instances:
        if state.metadata.endpoint == endpoint:
            return state
    return None


# ---------------------------------------------------------------------- ExampleConnector's files


def kv_folders(shared_dir: Path) -> set[str]:
    """The per-prompt folders ExampleConnector has written into its shared directory."""
    return {p.name for p in shared_dir.iterdir() if p.is_dir()}


def _safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """(header, offset of the data) of a safetensors file: u64 LE header length, JSON header, data."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return header, 8 + length


def kv_token_counts(folder: Path) -> dict[str, int]:
    """Tokens of KV per layer file in one ExampleConnector folder (first dimension of its tensor)."""
    counts: dict[str, int] = {}
    for path in sorted(folder.glob("*.safetensors")):
        header, _ = _safetensors_header(path)
        counts[path.name] = int(header["kv_cache"]["shape"][0])
    return counts


def zero_kv_files(folder: Path) -> int:
    """Overwrite the KV data of every layer file in ``folder`` with zeros; returns the files changed."""
    changed = 0
    for path in sorted(folder.glob("*.safetensors")):
        _, offset = _safetensors_header(path)
        size = path.stat().st_size - offset
        with path.open("r+b") as f:
            f.seek(offset)
            f.write(b"\0" * size)
        changed += 1
    return changed


class Entries:
    """Channels to vLLM endpoints (``vllm-grpc://host:port``), as the router's vLLM client keeps them."""

    def __init__(self) -> None:
        self.channels: dict[str, grpc.aio.Channel] = {}

    def entry(self, endpoint: str) -> tuple[object, object]:
        if endpoint not in self.channels:
            self.channels[endpoint] = grpc.aio.insecure_channel(endpoint.removeprefix("vllm-grpc://"))
        channel = self.channels[endpoint]
        return channel, vllm_pb2_grpc.VllmEngineStub(channel)

    async def close(self) -> None:
        for channel in self.channels.values():
            await channel.close(None)
