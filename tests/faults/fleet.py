"""Real processes on loopback for fault tests: CMS, sim workers and router, each a ``slo-router`` child.

Every process is started by the test, owned by a :class:`Fleet`, and killed
(by its own pid) when the fleet closes. :class:`SteadyLoad` drives a steady,
bounded stream of ``Generate`` calls through the router and checks every
response stream for lost or repeated tokens with ``first_token_index``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from slorouter.v1 import common_pb2, router_pb2, router_pb2_grpc

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Proc:
    """One child process; ``address`` is what it printed after ``listening on``."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    address: str = ""

    @property
    def pid(self) -> int:
        return self.popen.pid

    def signal(self, sig: signal.Signals) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)

    def kill(self) -> None:
        """SIGKILL, and reap it (a no-op when it already exited)."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, signal.SIGCONT)  # a stopped process must be able to die
                self.popen.kill()
        self.popen.wait(timeout=10)

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class Fleet:
    """Starts ``slo-router`` children into ``workdir`` and kills them all on :meth:`close`."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[Proc] = []

    def spawn(self, name: str, args: Sequence[str], *, wait: bool = True) -> Proc:
        """Run ``python -m router.cli ARGS``; with ``wait``, until it prints ``listening on``."""
        log = self.workdir / f"{name}.log"
        out = self.workdir / f"{name}.out"
        with log.open("ab") as err, out.open("wb") as stdout:
            popen = subprocess.Popen(
                [sys.executable, "-m", "router.cli", *args],
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=err,
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        if wait:
            self.wait_listening(proc)
        return proc

    def wait_listening(self, *procs: Proc, timeout_s: float = 90.0) -> None:
        """Wait (bounded) until every one of ``procs`` printed its ``listening on`` line."""
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            out = self.workdir / f"{proc.name}.out"
            while not proc.address:
                for line in out.read_text(errors="replace").splitlines():
                    if " listening on " in line:
                        proc.address = line.split(" listening on ", 1)[1].split()[0]
                if proc.address:
                    break
                if proc.popen.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError(
                        f"{proc.name} did not start (exit {proc.popen.returncode}):\n{proc.tail()}"
                    )
                time.sleep(0.05)

    def cms(self, *extra: str, listen: str = "127.0.0.1:0", name: str = "cms") -> Proc:
        return self.spawn(name, ["cms", "--listen", listen, "--lease-ttl-s", "3", *extra])

    def worker(self, instance_id: str, role: str, cms: str, *extra: str, speed: float = 20.0) -> Proc:
        """A sim worker; returns before it listens (start several, then :meth:`wait_listening`)."""
        return self.spawn(
            instance_id,
            ["worker", "--engine", "sim", "--role", role, "--cms", cms, "--instance-id", instance_id,
             "--speed-factor", str(speed), "--seed", "0", *extra],
            wait=False,
        )  # fmt: skip

    def router(self, cms_url: str, *extra: str) -> Proc:
        """The router, with short worker deadlines (1 s to connect, 2 s to a first message)."""
        return self.spawn(
            "router",
            ["router", "--listen", "127.0.0.1:0", "--cms", cms_url, "--scheduling-policy", "load-balance",
             "--worker-connect-timeout-s", "1", "--worker-first-message-timeout-s", "2",
             "--prefill-timeout-s", "10", "--stream-timeout-s", "30", "--seed", "0", *extra],
        )  # fmt: skip

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.kill()


@dataclass
class Outcome:
    """One request as the client saw it."""

    request_id: str
    started_s: float
    code: grpc.StatusCode
    details: str = ""
    prefill: str = ""
    decode: str = ""
    token_ids: list[int] = field(default_factory=list)
    #: Messages whose first_token_index did not continue the stream (lost or repeated tokens).
    gaps: int = 0
    completion_tokens: int = 0
    finished: bool = False

    @property
    def ok(self) -> bool:
        return self.code is grpc.StatusCode.OK


async def generate(
    stub: router_pb2_grpc.RouterAsyncStub,
    request_id: str,
    prompt: Sequence[int],
    *,
    max_tokens: int,
    seed: int = 7,
    timeout_s: float = 60.0,
    track: dict[str, Outcome] | None = None,
) -> Outcome:
    """One ``Generate``, checking that each message starts where the previous one ended.

    With ``track``, the outcome is put there at once and filled in as messages arrive.
    """
    started = time.monotonic()
    outcome = Outcome(request_id, started, grpc.StatusCode.OK)
    if track is not None:
        track[request_id] = outcome
    request = router_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True),
    )
    try:
        async for message in stub.Generate(request, timeout=timeout_s):
            if message.HasField("route") and not outcome.prefill:
                outcome.prefill = message.route.prefill_instance_id
                outcome.decode = message.route.decode_instance_id
            if message.first_token_index != len(outcome.token_ids):
                outcome.gaps += 1
            outcome.token_ids.extend(message.token_ids)
            if message.finished:
                outcome.completion_tokens = message.usage.completion_tokens
                outcome.finished = True
    except grpc.aio.AioRpcError as exc:
        outcome.code = exc.code()
        outcome.details = exc.details() or ""
    return outcome


class SteadyLoad:
    """Requests at a steady rate through the router, in the background, bounded in count and time.

    ``start()`` begins; ``stop()`` stops issuing and waits for the running
    ones (each has its own deadline). ``outcomes`` holds every finished request.
    """

    def __init__(
        self,
        router_address: str,
        *,
        rate_hz: float = 10.0,
        max_tokens: int = 8,
        prompt_len: int = 32,
        max_requests: int = 3000,
        max_duration_s: float = 120.0,
    ) -> None:
        self._channel = grpc.aio.insecure_channel(router_address)
        self.stub = router_pb2_grpc.RouterStub(self._channel)
        self._rate_hz = rate_hz
        self._max_tokens = max_tokens
        self._prompt = list(range(1, prompt_len + 1))
        self._max_requests = max_requests
        self._max_duration_s = max_duration_s
        self._task: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()
        self.outcomes: list[Outcome] = []

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._issue())

    async def _issue(self) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + self._max_duration_s
        for i in range(self._max_requests):
            if self._stopping.is_set() or loop.time() > end:
                return
            task = loop.create_task(self._one(f"load-{i}"))
            self._running.add(task)
            task.add_done_callback(self._running.discard)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), 1.0 / self._rate_hz)

    async def _one(self, request_id: str) -> None:
        self.outcomes.append(
            await generate(self.stub, request_id, self._prompt, max_tokens=self._max_tokens, timeout_s=30.0)
        )

    async def run_for(self, seconds: float) -> None:
        """Let the load run ``seconds`` more (bounded sleep)."""
        await asyncio.sleep(seconds)

    async def stop(self) -> list[Outcome]:
        self._stopping.set()
        if self._task is not None:
            await self._task
        if self._running:
            await asyncio.wait(set(self._running), timeout=60.0)
        await self._channel.close()
        return self.outcomes

    def since(self, t: float) -> list[Outcome]:
        return [o for o in self.outcomes if o.started_s >= t]


async def wait_until_serving(router_address: str, *, timeout_s: float = 30.0) -> None:
    """Probe the router with small requests (bounded) until one succeeds: the view has arrived."""
    async with grpc.aio.insecure_channel(router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        deadline = time.monotonic() + timeout_s
        for i in range(10_000):
            outcome = await generate(stub, f"probe-{i}", [1, 2, 3, 4], max_tokens=2, timeout_s=10.0)
            if outcome.ok:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the router did not serve within {timeout_s} s: {outcome.details}")
            await asyncio.sleep(0.2)


def failures(outcomes: Sequence[Outcome]) -> list[str]:
    """A readable list of what went wrong: failed requests and broken token streams."""
    bad = [f"{o.request_id}: {o.code.name}: {o.details}" for o in outcomes if not o.ok]
    bad += [
        f"{o.request_id}: {o.gaps} gaps, {len(o.token_ids)} tokens, usage {o.completion_tokens}"
        for o in outcomes
        if o.ok and (o.gaps or len(o.token_ids) != o.completion_tokens)
    ]
    return bad


async def wait_for_instances(router_address: str, ids: set[str], *, timeout_s: float = 30.0) -> None:
    """Wait (bounded) until the router's ``Schedule`` trace shows every one of ``ids`` usable."""
    async with grpc.aio.insecure_channel(router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        request = router_pb2.ScheduleRequest(
            request=router_pb2.GenerateRequest(
                prompt_token_ids=[1, 2, 3, 4], sampling=common_pb2.SamplingParams(max_tokens=2)
            ),
            explain=True,
        )
        deadline = time.monotonic() + timeout_s
        usable: set[str] = set()
        while True:
            with contextlib.suppress(grpc.aio.AioRpcError):
                response = await stub.Schedule(request, timeout=5.0)
                usable = {t.instance_id for t in response.trace if t.dropped_by not in _UNUSABLE}
                if ids <= usable:
                    return
            if time.monotonic() > deadline:
                raise AssertionError(f"the router sees only {sorted(usable)} of {sorted(ids)} as usable")
            await asyncio.sleep(0.2)


#: ``dropped_by`` labels that mean "not usable" (as opposed to "not picked this time").
_UNUSABLE = ("schedulability", "staleness", "excluded", "failover", "role")
