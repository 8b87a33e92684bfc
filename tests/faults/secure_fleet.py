"""A fleet of real processes on loopback for the security fault tests: CMS, sim workers, router.

Every process is ``python -m router.cli ...`` as a user would run it, with
authentication on: a token per worker, one for the router's reads and one for
the fuzzer (its own principal, so it can never own the workers' entries), and
a cluster kv key. Waiting is always bounded.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from slorouter.v1 import common_pb2, router_pb2, router_pb2_grpc

REPO = Path(__file__).resolve().parents[2]

TOKENS = {
    "worker.p0": "p0-token-0123456789abcdef",
    "worker.d0": "d0-token-0123456789abcdef",
    "router": "router-token-0123456789abcdef",
    "fuzz": "fuzz-token-0123456789abcdef",
}


def auth(principal: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[principal]}"),)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[str]
    address: str
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def rss_kb(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout_s)
        if self.popen.stdout is not None:
            self.popen.stdout.close()


def spawn(name: str, args: list[str], ready: str, logs: Path, timeout_s: float = 90.0) -> Proc:
    """Start ``slo-router ARGS`` and wait (boundedly) for its ``ready ... ADDRESS`` line."""
    log = logs / f"{name}.log"
    with log.open("w") as err:
        popen = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "--log-level", "WARNING", *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    lines = wait_for_lines(popen, [ready], timeout_s)
    if ready in lines:
        return Proc(name, popen, lines[ready].split()[len(ready.split())], log)
    popen.kill()
    popen.wait(10)
    raise AssertionError(f"{name} did not start: {log.read_text()[-2000:]}")


def wait_for_lines(popen: subprocess.Popen[str], prefixes: list[str], timeout_s: float) -> dict[str, str]:
    """The first stdout line starting with each prefix, read until all are seen or ``timeout_s``.

    A reader thread does the reading (a selector on the pipe would miss lines
    already buffered by the text wrapper); the wait for it is bounded.
    """
    found: dict[str, str] = {}
    done = threading.Event()

    def read() -> None:
        assert popen.stdout is not None
        for line in popen.stdout:
            for prefix in prefixes:
                if prefix not in found and line.startswith(prefix):
                    found[prefix] = line.strip()
            if len(found) == len(prefixes):
                break
        done.set()

    threading.Thread(target=read, daemon=True).start()
    done.wait(timeout_s)
    return dict(found)


@dataclass
class Fleet:
    dir: Path
    cms: Proc
    workers: dict[str, Proc]
    router: Proc
    kv_key_file: Path
    procs: list[Proc] = field(default_factory=list)

    def token_file(self, principal: str) -> Path:
        return self.dir / f"{principal}.token"

    def start_worker(self, instance_id: str, role: str) -> Proc:
        proc = spawn(
            instance_id,
            [
                "worker", "--engine", "sim", "--role", role, "--listen", "127.0.0.1:0",
                "--cms", self.cms.address, "--instance-id", instance_id,
                "--cms-auth-token-file", str(self.token_file(f"worker.{instance_id}")),
                "--kv-key-file", str(self.kv_key_file), "--speed-factor", "50",
                "--max-model-len", "4096", "--shutdown-grace-s", "1",
            ],
            "worker listening on",
            self.dir,
        )  # fmt: skip
        self.workers[instance_id] = proc
        self.procs.append(proc)
        return proc

    def alive(self) -> bool:
        return all(p.alive() for p in (self.cms, self.router, *self.workers.values()))


def request(request_id: str = "", max_tokens: int = 4, **fields: object) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=list(range(1, 33)),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
        slo=common_pb2.SloTarget(ttft_ms=60_000, tpot_ms=60_000),
        **fields,  # type: ignore[arg-type]
    )


def generate_ok(stub: router_pb2_grpc.RouterStub, request_id: str, timeout_s: float = 30.0) -> list[int]:
    """One request end to end; the tokens (raises the RpcError on failure)."""
    tokens: list[int] = []
    for message in stub.Generate(request(request_id), timeout=timeout_s):
        tokens.extend(message.token_ids)
    return tokens


def wait_routable(router_address: str, timeout_s: float = 60.0) -> None:
    """Until the router places a request on a prefill and a decode instance."""
    deadline = time.monotonic() + timeout_s
    last = ""
    with grpc.insecure_channel(router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        while time.monotonic() < deadline:
            try:
                stub.Schedule(router_pb2.ScheduleRequest(request=request()), timeout=5)
                return
            except grpc.RpcError as exc:
                last = f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]
            time.sleep(0.1)
    raise AssertionError(f"the router never became routable: {last}")


@contextlib.contextmanager
def running_fleet(tmp: Path) -> Iterator[Fleet]:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "cms-tokens").write_text("".join(f"{name} {token}\n" for name, token in TOKENS.items()))
    for name, token in TOKENS.items():
        (tmp / f"{name}.token").write_text(token + "\n")
    kv_key = tmp / "kv.key"
    kv_key.write_text("cluster-kv-key-0123456789abcdef\n")
    procs: list[Proc] = []
    try:
        cms = spawn(
            "cms",
            [
                "cms",
                "--listen",
                "127.0.0.1:0",
                "--auth-token-file",
                str(tmp / "cms-tokens"),
                "--lease-ttl-s",
                "2",
            ],
            "cms listening on",
            tmp,
        )
        procs.append(cms)
        fleet = Fleet(tmp, cms, {}, cms, kv_key, procs)
        fleet.start_worker("p0", "prefill")
        fleet.start_worker("d0", "decode")
        router = spawn(
            "router",
            [
                "router", "--listen", "127.0.0.1:0", "--cms", f"grpc://{cms.address}",
                "--cms-auth-token-file", str(tmp / "router.token"), "--seed", "0",
                "--ttft-slo", "60000", "--tpot-slo", "60000",
            ],
            "router listening on",
            tmp,
        )  # fmt: skip
        procs.append(router)
        fleet.router = router
        wait_routable(router.address)
        yield fleet
    finally:
        for proc in reversed(procs):
            proc.stop()
