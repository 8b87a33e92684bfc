"""A throwaway ``redis-server`` on a loopback port, for tests and benchmarks.

Not used by the service itself. :class:`RedisServer` *is* its URL (a ``str``
subclass, ``redis://127.0.0.1:PORT/0``), so it can be handed to anything that
takes a Redis URL, and it can be stopped and started again on the same port
to simulate an outage, or paused (SIGSTOP) to simulate a frozen one. It runs without persistence: a restart comes back
empty, like a Redis that lost its data.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

REDIS_SERVER_CANDIDATES = ("redis-server", "/usr/bin/redis-server", "/usr/local/bin/redis-server")


def find_redis_server() -> str | None:
    """Path of a ``redis-server`` binary, or ``None``."""
    for name in REDIS_SERVER_CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer(str):
    """A ``redis-server`` child process; the string value is its URL."""

    port: int
    workdir: Path
    binary: str
    _proc: subprocess.Popen[bytes] | None

    def __new__(cls, workdir: Path, *, port: int | None = None, binary: str | None = None) -> RedisServer:
        binary = binary or find_redis_server()
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (run scripts/ensure_system_deps.sh)")
        port = port or free_loopback_port()
        self = super().__new__(cls, f"redis://127.0.0.1:{port}/0")
        self.port = port
        self.workdir = Path(workdir)
        self.binary = binary
        self._proc = None
        return self

    @property
    def url(self) -> str:
        return str(self)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 5.0) -> None:
        """Start the server (no-op if running) and wait until it answers PING."""
        if self.running:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = (self.workdir / "redis.log").open("ab")
        try:
            self._proc = subprocess.Popen(
                [
                    self.binary,
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self.workdir),
                    "--protected-mode",
                    "yes",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        finally:
            log.close()
        deadline = time.monotonic() + timeout_s
        while not _ping(self.port):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server on port {self.port} did not start:\n{tail}")
            time.sleep(0.01)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Kill the server (no-op if stopped), like a crash; the port is free again afterwards.

        Nothing is persisted, so a graceful shutdown would only cost time.
        """
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)  # a paused server must be able to die
            proc.kill()
        proc.wait(timeout=timeout_s)

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open, nothing is answered."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Thaw a paused server (SIGCONT)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """Stop, then start again on the same port (empty: no persistence)."""
        self.stop()
        self.start()

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
