"""``slo-router up`` as a child process for fault tests: started, read, signalled and reaped, bounded.

:func:`up_cluster` starts ``python -m router.cli up ...`` on loopback (port 0
everywhere), waits (bounded) for the lines that name its addresses and kills
it by its own pid when the test ends. :func:`grpc_probes` drives small
``Generate`` calls from a thread while a test attacks the HTTP edge, and
records each one's latency and status.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from slorouter.v1 import common_pb2, router_pb2, router_pb2_grpc

from tests.faults.secure_fleet import wait_for_lines

REPO = Path(__file__).resolve().parents[2]


@dataclass
class UpCluster:
    popen: subprocess.Popen[str]
    router: str
    http: str
    cms: str
    log: Path
    lines: dict[str, str]
    #: The read-only CMS token ``up`` prints for other routers.
    read_token_file: Path
    #: instance id -> worker address.
    workers: dict[str, str]
    #: Lines of stdout after start (read by a thread so the pipe never fills).
    out: list[str] = field(default_factory=list)

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, and wait (bounded) for the exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        return self.popen.wait(timeout_s)


def _nofile(limit: int) -> Callable[[], None]:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    return apply


def _grpc_server_flag() -> list[str]:
    """``--grpc-server`` as ``$SLO_ROUTER_TEST_GRPC_SERVER`` says (unset: the default server)."""
    value = os.environ.get("SLO_ROUTER_TEST_GRPC_SERVER", "")
    return ["--grpc-server", value] if value else []


@contextlib.contextmanager
def up_cluster(tmp: Path, *extra: str, nofile: int = 0, timeout_s: float = 90.0) -> Iterator[UpCluster]:
    """``up`` with one prefill and one decode sim worker (fast), and ``extra`` flags."""
    log = tmp / "up.log"
    with log.open("w") as err:
        popen = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "--log-level", "WARNING", "up", "--listen", "127.0.0.1:0",
             "--http-listen", "127.0.0.1:0", "--prefill", "1", "--decode", "1", "--speed-factor", "50",
             "--ttft-slo", "60000", "--tpot-slo", "60000", *_grpc_server_flag(), *extra],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=_nofile(nofile) if nofile else None,
        )  # fmt: skip
    reader: threading.Thread | None = None
    try:
        prefixes = [
            "cms listening on",
            "cms read token for other routers:",
            "workers:",
            "router listening on",
            "OpenAI-compatible HTTP API on",
        ]
        lines = wait_for_lines(popen, prefixes, timeout_s)
        if len(lines) < len(prefixes):
            state = (
                f"exited {popen.returncode}"
                if popen.poll() is not None
                else f"still running after {timeout_s:.0f} s"
            )
            raise AssertionError(
                f"up did not start ({state}; saw {sorted(lines)} of {prefixes}): {log.read_text()[-3000:]}"
            )
        http = lines["OpenAI-compatible HTTP API on"].split()[-1].removeprefix("http://").removesuffix("/v1")
        cluster = UpCluster(
            popen,
            router=lines["router listening on"].split()[-1],
            http=http,
            cms=lines["cms listening on"].split()[-1],
            log=log,
            lines=lines,
            read_token_file=Path(lines["cms read token for other routers:"].split()[-1]),
            workers=dict(w.split("@", 1) for w in lines["workers:"].split(" ", 1)[1].split(", ")),
        )

        def drain() -> None:
            assert popen.stdout is not None
            for line in popen.stdout:
                cluster.out.append(line.rstrip("\n"))

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        yield cluster
    finally:
        if popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(popen.pid, signal.SIGCONT)
                popen.kill()
        popen.wait(30)
        if reader is not None:
            reader.join(5)
        if popen.stdout is not None:
            popen.stdout.close()


def small_request(request_id: str, max_tokens: int = 4, **slo: float) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=list(range(1, 17)),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        slo=common_pb2.SloTarget(**slo),
    )


@dataclass
class Probes:
    """Latency (s) and status of each gRPC probe, in order."""

    results: list[tuple[float, str]] = field(default_factory=list)

    @property
    def failed(self) -> list[str]:
        return [code for _, code in self.results if code != "OK"]

    @property
    def slowest_s(self) -> float:
        return max((t for t, _ in self.results), default=0.0)


@contextlib.contextmanager
def grpc_probes(router: str, *, interval_s: float = 0.05, max_probes: int = 2000) -> Iterator[Probes]:
    """Small ``Generate`` calls from a thread, one after another, until the block ends (bounded)."""
    probes = Probes()
    stop = threading.Event()

    def run() -> None:
        with grpc.insecure_channel(router) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            for i in range(max_probes):
                if stop.is_set():
                    return
                started = time.monotonic()
                code = "OK"
                try:
                    for _ in stub.Generate(small_request(f"probe-{i}"), timeout=5.0):
                        pass
                except grpc.RpcError as exc:
                    code = exc.code().name  # type: ignore[attr-defined]
                probes.results.append((time.monotonic() - started, code))
                stop.wait(interval_s)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield probes
    finally:
        stop.set()
        thread.join(15)


def wait_serving(router: str, timeout_s: float = 30.0) -> None:
    """Until one small request succeeds through the router (bounded)."""
    deadline = time.monotonic() + timeout_s
    last = ""
    with grpc.insecure_channel(router) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for i in range(1000):
            try:
                for _ in stub.Generate(small_request(f"ready-{i}"), timeout=5.0):
                    pass
                return
            except grpc.RpcError as exc:
                last = f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
    raise AssertionError(f"the router did not serve within {timeout_s} s: {last}")


def child_pid(cluster: UpCluster, instance_id: str) -> int:
    """The pid of ``up``'s worker process for ``instance_id``."""
    children = Path(f"/proc/{cluster.popen.pid}/task/{cluster.popen.pid}/children").read_text().split()
    for pid in children:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"--instance-id" in argv and argv[argv.index(b"--instance-id") + 1] == instance_id.encode():
            return int(pid)
    raise AssertionError(f"no worker process for {instance_id} among {children}")
