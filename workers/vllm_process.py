"""Run ``slo-router worker --engine vllm`` as a child process of a process that has no vLLM.

vLLM lives in its own environment (``.venv-vllm``, made by ``make
vllm-venv``); the tests and ``make bench`` run in the main one and start
vLLM workers from there. :class:`VllmWorkerProcess` starts one, finds its
address in its output, and stops it (and vLLM's engine processes with it).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workers import vllm_env

#: The repository this package is installed from (editable installs only).
REPO = Path(__file__).resolve().parent.parent
#: Where ``make vllm-venv`` puts the vLLM environment.
VLLM_VENV = REPO / ".venv-vllm"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
VLLM_SLO_ROUTER = VLLM_VENV / "bin" / "slo-router"
MISSING_VENV_HINT = (
    f"{VLLM_VENV} is missing or incomplete: run `make vllm-venv` (make test and make bench do it)"
)

_LISTENING = re.compile(r"worker listening on (\S+)")


def vllm_env_ready() -> bool:
    """True when the vLLM environment exists and has this project installed."""
    return VLLM_SLO_ROUTER.exists() and VLLM_PYTHON.exists()


def build_tiny_model(out_dir: Path, timeout_s: float = 120.0, *, seed: int = 0) -> Path:
    """Write the tiny test model (:mod:`workers.vllm_tiny_model`) into ``out_dir`` using the vLLM environment."""
    proc = subprocess.run(
        [str(VLLM_PYTHON), "-m", "workers.vllm_tiny_model", str(out_dir), "--seed", str(seed)],
        cwd=REPO,
        env=vllm_env.subprocess_env({"HF_HUB_OFFLINE": "1"}),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"building the tiny model failed:\n{proc.stdout}\n{proc.stderr}")
    return out_dir


#: Popen arguments that put the child in a process group of its own, in the caller's session.
_OWN_PROCESS_GROUP: dict[str, Any] = (
    {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
)


class _LoggedChild:
    """A child process of the vLLM environment whose output goes to ``log_path``."""

    log_path: Path
    proc: subprocess.Popen[bytes]

    def _spawn(self, cmd: Sequence[str], overrides: dict[str, str], env: dict[str, str] | None) -> None:
        """Start ``cmd`` in a process group of its own, ``overrides`` then ``env`` on the environment."""
        overrides = {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **overrides, **(env or {})}
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=vllm_env.subprocess_env(overrides),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            **_OWN_PROCESS_GROUP,
        )

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


class VllmWorkerProcess(_LoggedChild):
    """``slo-router worker --engine vllm --model MODEL ARGS...`` from the vLLM environment.

    Its output (vLLM logs to stdout) goes to ``log_path``; :meth:`wait_ready`
    reads the worker's address from its "worker listening on ..." line. The
    worker gets its own process group so :meth:`stop` can also end vLLM's
    engine processes should the worker hang. It stays in the caller's session,
    as ``slo-router up`` keeps its workers: with the kernel's session
    autogroups (``/proc/sys/kernel/sched_autogroup_enabled``), a worker in a
    session of its own is scheduled as one group against its clients, and on
    a 2-core host, while vLLM's engine processes poll, the clients then lose
    the CPU for 250-340 ms at a time (seen as first tokens that late in
    ``python -m bench vllm``; with autogroups switched off, or the worker in
    the caller's session, the client's event loop is never late by 30 ms).
    """

    def __init__(
        self,
        model: str | Path,
        log_path: Path,
        args: Sequence[str] = (),
        *,
        env: dict[str, str] | None = None,
    ) -> None:
        if not vllm_env_ready():
            raise RuntimeError(MISSING_VENV_HINT)
        self.log_path = log_path
        self.address = ""
        self._terminated = False
        cmd = [
            str(VLLM_SLO_ROUTER),
            "worker",
            "--engine",
            "vllm",
            "--model",
            str(model),
            "--listen",
            "127.0.0.1:0",
            "--shutdown-grace-s",
            "1",
            *args,
        ]
        self._spawn(cmd, {}, env)

    def wait_ready(self, timeout_s: float = 150.0) -> str:
        """The worker's ``host:port`` once it serves; RuntimeError (with its log) if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = _LISTENING.search(self.log_path.read_text(errors="replace"))
            if match:
                self.address = match.group(1)
                return self.address
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM worker exited with {self.proc.returncode}:\n{self.log_tail()}")
            time.sleep(0.2)
        raise RuntimeError(f"vLLM worker not ready within {timeout_s} s:\n{self.log_tail()}")

    def terminate(self) -> None:
        """Ask the worker to shut down gracefully (SIGTERM, once); see :meth:`stop`."""
        # A second SIGTERM would arrive after the worker restored the default
        # handler for its shutdown and kill it midway.
        if not self._terminated and self.proc.poll() is None:
            self._terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM and wait; SIGKILL the worker's process group if it does not exit in time. Its exit code."""
        self.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        # vLLM's engine processes follow their parent; make sure none is left behind.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()
        return self.proc.returncode


def start_workers(
    specs: Sequence[tuple[str | Path, Path, Sequence[str]]], timeout_s: float = 150.0
) -> list[VllmWorkerProcess]:
    """Start several workers at once (their start-up overlaps) and wait until all serve."""
    workers = [VllmWorkerProcess(model, log, args) for model, log, args in specs]
    try:
        for w in workers:
            w.wait_ready(timeout_s)
    except BaseException:
        stop_workers(workers)
        raise
    return workers


def stop_workers(workers: Sequence[VllmWorkerProcess], timeout_s: float = 30.0) -> list[int]:
    """Stop several workers in parallel; their exit codes."""
    for w in workers:
        w.terminate()
    return [w.stop(timeout_s) for w in workers]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (vLLM's launcher takes no port 0)."""
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class StockEngineProcess(_LoggedChild):
    """An unmodified vLLM gRPC engine: ``python -m vllm.entrypoints.launchers.grpc_server``.

    The same server ``vllm serve MODEL --grpc`` runs (the CPU build's ``vllm`` console script
    looks for a distribution named ``vllm`` and fails, so the module form is used). Its output
    goes to ``log_path``; :meth:`wait_ready` polls its ``HealthCheck``. Like
    :class:`VllmWorkerProcess` it gets a process group of its own in the caller's session, so
    :meth:`kill` ends the engine processes with it.
    """

    def __init__(
        self,
        model: str | Path,
        log_path: Path,
        args: Sequence[str] = (),
        *,
        port: int = 0,
        env: dict[str, str] | None = None,
    ) -> None:
        if not VLLM_PYTHON.exists():
            raise RuntimeError(MISSING_VENV_HINT)
        self.log_path = log_path
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._terminated = False
        cmd = [
            str(VLLM_PYTHON),
            "-m",
            "vllm.entrypoints.launchers.grpc_server",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *args,
        ]
        overrides = {
            # The servicer's start-up warm-up visits every prompt length class (up to 27 s here on
            # a busy 2-core host) and, with a shared-directory KV connector, has engines started
            # together store and load the same warm-up prompts' KV at once (seen to crash one).
            "SMG_VLLM_SERVICER_WARMUP": "off",
            # No KV-event publisher (a ZMQ socket and a relay nobody here subscribes to).
            "SMG_VLLM_SERVICER_KV_EVENTS": "0",
        }
        # vLLM leaves its ZeroMQ socket files behind: give them a directory removed at stop().
        self._rpc_dir = vllm_env.new_rpc_dir()
        overrides[vllm_env.RPC_BASE_PATH] = self._rpc_dir
        self._spawn(cmd, overrides, env)

    def wait_ready(self, timeout_s: float = 180.0) -> str:
        """The engine's ``host:port`` once ``HealthCheck`` answers healthy; RuntimeError if it exits or times out."""
        import grpc
        from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2
        from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_pb2_grpc

        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.address) as channel:
            stub = vllm_pb2_grpc.VllmEngineStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"vLLM engine exited with {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    if stub.HealthCheck(vllm_pb2.HealthCheckRequest(), timeout=1.0).healthy:
                        return self.address
                except grpc.RpcError:
                    pass
                time.sleep(0.5)
        raise RuntimeError(f"vLLM engine not ready within {timeout_s} s:\n{self.log_tail()}")

    def pause(self) -> None:
        """SIGSTOP the server process (the engine stops answering, its TCP port stays open)."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the engine's whole process group (a crash)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (after SIGCONT, should it be paused) and wait; SIGKILL the group if it does not exit."""
        if not self._terminated and self.proc.poll() is None:
            self._terminated = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
                self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait(10)
        self.kill()
        self._log.close()
        shutil.rmtree(self._rpc_dir, ignore_errors=True)
        return self.proc.returncode


def start_stock_engines(
    specs: Sequence[tuple[str | Path, Path, Sequence[str]]], timeout_s: float = 240.0
) -> list[StockEngineProcess]:
    """Start several stock vLLM gRPC engines at once (their start-up overlaps) and wait for all."""
    engines = [StockEngineProcess(model, log, args) for model, log, args in specs]
    try:
        for engine in engines:
            engine.wait_ready(timeout_s)
    except BaseException:
        for engine in engines:
            engine.stop(10)
        raise
    return engines
