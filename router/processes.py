"""``slo-router router --processes N``: N router processes on one port.

The first process (the one the user started) binds ``--listen`` with
``SO_REUSEPORT``, creates the shared in-flight segment
(:mod:`router.shared_inflight`) and starts N-1 more ``slo-router router``
processes with the same flags, on the port it got, each with a slot of the
segment. The kernel spreads new connections over the N listeners; a
connection (and every call on it) stays with the process that accepted it.
The HTTP edge and ``--metrics-port`` stay on the first process. Every
process answers ``Generate`` with trailing metadata ``slo-router-process``
(its slot), so a client can tell which one served it.

Children die with the first process (``PR_SET_PDEATHSIG``, :mod:`router.lifetime`) and get SIGTERM
on a clean shutdown; a child's slot is cleared when it exits, and a child that exits on its own is
started again with backoff (0.5 s, doubling to 30 s while it keeps dying young).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.core.inflight import InflightAccount
from router.lifetime import child_env
from router.service import RouterService
from router.shared_inflight import InflightSharing, SharedInflight

logger = logging.getLogger(__name__)

#: How long a started process may take to listen.
START_TIMEOUT_S = 60.0
#: A process that exited is started again after this long, doubling while it keeps dying young.
RESPAWN_BACKOFF_S = 0.5
RESPAWN_MAX_BACKOFF_S = 30.0
#: A process that ran this long before exiting is restarted after the first backoff again.
RESPAWN_HEALTHY_S = 60.0


@dataclass
class RouterProcesses:
    """The other router processes this one started (none for N = 1), and the in-flight sharing."""

    shared: SharedInflight | None = None
    sharing: InflightSharing | None = None
    children: list[asyncio.subprocess.Process] = field(default_factory=list)
    _watchers: list[asyncio.Task[None]] = field(default_factory=list)

    @classmethod
    async def start(
        cls, args: argparse.Namespace, address: str, service: RouterService, account: InflightAccount
    ) -> RouterProcesses:
        """``slo-router router``: join the segment of ``--shared-inflight``, or start the others."""
        argv: list[str] = list(getattr(args, "argv", None) or sys.argv[1:])
        return await cls.start_group(
            address, service, account, args.processes, argv, shared_inflight=args.shared_inflight
        )

    @classmethod
    async def start_group(
        cls,
        address: str,
        service: RouterService,
        account: InflightAccount,
        processes: int,
        router_argv: Sequence[str],
        *,
        shared_inflight: str = "",
    ) -> RouterProcesses:
        """Share ``account`` (the scheduler's); with ``processes`` > 1 start ``slo-router ROUTER_ARGV`` N-1 times.

        ``address`` is where this process's router listens (with ``SO_REUSEPORT``);
        ``router_argv`` starts with the ``router`` command; the listen address,
        the segment, and HTTP and metrics off are appended to it.
        """
        group = cls()
        if shared_inflight:  # one of the N, started by the first
            name, slot, count = shared_inflight.split(":")
            group.shared = SharedInflight(name, int(count), int(slot))
        elif processes > 1:
            group.shared = SharedInflight(None, processes, 0, create=True)
        else:
            return group
        service.process_label = str(group.shared.slot)
        group.sharing = InflightSharing(group.shared, account)
        group.sharing.start()
        if not shared_inflight:
            try:
                await group._spawn(router_argv, address)
            except BaseException:
                await group.stop()
                await group.close()
                raise
        return group

    def _command(self, argv: Sequence[str], address: str, slot: int) -> list[str]:
        assert self.shared is not None
        return [
            sys.executable, "-m", "router.cli", *argv,
            # argparse takes the last of a repeated flag: these override the user's.
            "--listen", address, "--processes", "1",
            "--shared-inflight", f"{self.shared.name}:{slot}:{self.shared.processes}",
            "--http-listen", "", "--metrics-port", "0",
        ]  # fmt: skip

    @staticmethod
    async def _exec(cmd: Sequence[str]) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            env=child_env(),  # (:mod:`router.lifetime`: no preexec_fn in a threaded process)
        )

    @staticmethod
    async def _listening(child: asyncio.subprocess.Process) -> bool:
        assert child.stdout is not None
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                while line := (await child.stdout.readline()).decode(errors="replace"):
                    if line.startswith("router listening on "):
                        return True
        except TimeoutError:
            pass
        return False

    async def _spawn(self, argv: Sequence[str], address: str) -> None:
        assert self.shared is not None
        for slot in range(1, self.shared.processes):
            self.children.append(await self._exec(self._command(argv, address, slot)))
        for slot, child in enumerate(self.children, start=1):
            if not await self._listening(child):
                raise OSError(f"--processes: router process {slot} did not start (exit {child.returncode})")
            print(f"router process {slot} (pid {child.pid}) listening on {address}", flush=True)
            cmd = self._command(argv, address, slot)
            self._watchers.append(asyncio.get_running_loop().create_task(self._watch(slot, child, cmd)))

    async def _watch(self, slot: int, child: asyncio.subprocess.Process, cmd: Sequence[str]) -> None:
        """Keep slot ``slot`` served: a process that exits on its own is started again, with backoff.

        Its in-flight rows stop counting at once. The restart waits
        :data:`RESPAWN_BACKOFF_S` (doubling up to :data:`RESPAWN_MAX_BACKOFF_S` while it keeps
        dying young, back to the start after it ran :data:`RESPAWN_HEALTHY_S`), so a process that
        cannot start does not spin. Cancelled by :meth:`stop`.
        """
        loop = asyncio.get_running_loop()
        backoff = RESPAWN_BACKOFF_S
        while True:
            started = loop.time()
            assert child.stdout is not None
            while await child.stdout.readline():  # keep its pipe drained until it exits
                pass
            code = await child.wait()
            if self.shared is not None:
                self.shared.clear(slot)
            if loop.time() - started >= RESPAWN_HEALTHY_S:
                backoff = RESPAWN_BACKOFF_S
            logger.warning(
                "router process %d (pid %d) exited with %s; starting it again in %.1f s",
                slot,
                child.pid,
                code,
                backoff,
            )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RESPAWN_MAX_BACKOFF_S)
            child = await self._exec(cmd)
            self.children[slot - 1] = child
            if await self._listening(child):
                logger.warning("router process %d started again (pid %d)", slot, child.pid)
            else:
                logger.warning("router process %d (pid %d) did not start again", slot, child.pid)

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the processes this one started (SIGTERM: each drains, see ``--drain-timeout-s``; SIGKILL
        after ``timeout_s``) and clear their slots."""
        for watcher in self._watchers:
            watcher.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        self._watchers.clear()
        for child in self.children:
            if child.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signal.SIGTERM)
        for slot, child in enumerate(self.children, start=1):
            try:
                async with asyncio.timeout(timeout_s):
                    await child.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    child.kill()
                await child.wait()
            if self.shared is not None:
                self.shared.clear(slot)
        self.children.clear()

    async def close(self) -> None:
        """Stop sharing and release the segment (the first process also removes it)."""
        if self.sharing is not None:
            await self.sharing.stop()
            self.sharing = None
        elif self.shared is not None:
            self.shared.close()
        self.shared = None
