"""``slo-router up``: a whole cluster on loopback in one command.

The CMS (memory store) and the router run in this process; each sim worker
runs in a child process of its own (``slo-router worker --engine sim``), so
workers and router use both cores. Authentication is on: ``up`` makes a
token per worker (so one worker cannot write another's CMS entry) and a
cluster key for kv handles, in a private directory removed on exit. Children die with this process: they get
SIGTERM on a clean shutdown and, on Linux, also when this process dies
without one (``PR_SET_PDEATHSIG``, :mod:`router.lifetime`), so nothing is left running.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cms.auth import TokenTable, new_token
from cms.call_auth import read_worker_token
from cms.memory import MemoryStore
from cms.reader import open_reader
from cms.server import CmsServer, start_cms_server
from fleet.flags import check_listen, check_metrics_port, error_line, split_host_port
from openai_http.bounded import EdgeLimits
from predictor import LatencyPredictor
from router.core.config import SchedulerConfig
from router.core.qlm import QlmConfig
from router.core.queue import QueueConfig
from router.core.rng import PeekableRandom
from router.core.scheduler import Scheduler
from router.core.slicing import SliceConfig
from router.http_edge import add_http_edge_arguments, edge_limits_from_args
from router.lifetime import child_env
from router.pool import (
    DEFAULT_KEEPALIVE_S,
    DEFAULT_KEEPALIVE_TIMEOUT_S,
    add_keepalive_arguments,
    keepalive_from_args,
)
from router.processes import RouterProcesses
from router.server import (
    DEFAULT_LISTEN,
    DEFAULT_PROFILE_DIR,
    RouterServer,
    add_drain_argument,
    add_grpc_server_argument,
    add_worker_streams_argument,
    check_drain_timeout,
    check_grpc_server,
    check_worker_streams,
    qlm_config,
    queue_config,
    scheduler_config,
    start_router_server,
    wait_for_signals,
)
from router.service import ServiceConfig
from router.shared_inflight import MAX_PROCESSES
from router.slicing import add_arguments as add_slice_arguments
from router.slicing import dispatcher_from_args, slice_config_from_args
from router.telemetry import RequestObserver

logger = logging.getLogger(__name__)

DEFAULT_HTTP_LISTEN = "127.0.0.1:8000"


@dataclass
class WorkerProcess:
    instance_id: str
    role: str
    process: asyncio.subprocess.Process
    address: str = ""
    #: Base URL of the worker's OpenAI-compatible HTTP face (``http://HOST:PORT/v1``), with --worker-http.
    http_url: str = ""


@dataclass
class Cluster:
    """A running embedded cluster."""

    cms: CmsServer
    router: RouterServer
    workers: list[WorkerProcess]
    #: The private directory holding the tokens and the kv key (removed by ``stop``).
    secrets_dir: Path | None = field(default=None)
    #: ``--processes``: the other router processes and the shared in-flight account.
    processes: RouterProcesses = field(default_factory=RouterProcesses)
    #: A CMS read token for routers started by hand against this cluster (``--cms-auth-token-file``).
    router_token_file: Path | None = None
    #: The token the workers ask of their callers, for routers started by hand (``--worker-auth-token-file``).
    worker_token_file: Path | None = None

    async def stop(self, drain_timeout_s: float | None = None, force: asyncio.Event | None = None) -> None:
        """Router first (it drains: :meth:`RouterServer.drain`; the other ``--processes`` at the same
        time), then the workers, then the CMS. Idempotent."""
        drain = 2.0 if drain_timeout_s is None else drain_timeout_s
        await asyncio.gather(
            self.processes.stop(timeout_s=drain + 15.0),
            self.router.stop(grace=2.0, drain_timeout_s=drain, force=force),
        )
        await self.processes.close()
        await stop_workers(self.workers)
        await self.cms.stop(grace=0.5)
        if self.secrets_dir is not None:
            shutil.rmtree(self.secrets_dir, ignore_errors=True)


#: Prefix of ``up``'s secrets directories in the temporary directory.
SECRETS_PREFIX = "slo-router-up-"
#: The file in a secrets directory naming the pid of the ``up`` that made it.
OWNER_FILE = "owner.pid"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def remove_stale_secrets(tmp: Path | None = None) -> list[Path]:
    """Remove secrets directories whose ``up`` died without cleaning up (kill -9); the removed ones.

    Only this user's directories (the only ones it can remove anyway), only those whose
    ``owner.pid`` names a process that no longer exists; a directory without a readable owner
    file is left alone (it may be one being written right now).
    """
    removed: list[Path] = []
    base = Path(tmp or tempfile.gettempdir())
    uid = os.getuid()
    for path in base.glob(SECRETS_PREFIX + "*"):
        try:
            if not path.is_dir() or path.is_symlink() or path.stat().st_uid != uid:
                continue
            pid = int((path / OWNER_FILE).read_text().strip())
        except (OSError, ValueError):
            continue
        if pid > 0 and not _alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class ClusterSecrets:
    """A token per worker and the cluster's kv handle key, as files only this user can read.

    The directory names its owner (``owner.pid``) so that the next ``up`` removes it when this
    one dies without cleaning up (:func:`remove_stale_secrets`).
    """

    def __init__(self) -> None:
        for stale in remove_stale_secrets():
            logger.info("removed %s, left behind by an up that died", stale)
        self.dir = Path(tempfile.mkdtemp(prefix=SECRETS_PREFIX))  # mode 0700
        self._write(OWNER_FILE, str(os.getpid()))
        self.kv_key_file = self._write("kv.key", new_token())
        self.worker_call_token = self.worker_call_token_file()
        #: principal -> (token, scope)
        self._tokens: dict[str, tuple[str, str]] = {}

    def _write(self, name: str, text: str) -> Path:
        path = self.dir / name
        path.touch(mode=0o600)
        path.write_text(text + "\n", encoding="utf-8")
        return path

    def worker_token_file(self, instance_id: str) -> Path:
        """A token that may write this worker's own instance id and no other."""
        token = new_token()
        self._tokens[f"worker.{instance_id}"] = (token, f"write:{instance_id}")
        return self._write(f"{instance_id}.token", token)

    def worker_call_token_file(self) -> Path:
        """The worker token: the router's (and workers') calls to workers carry it (cms.call_auth)."""
        return self._write("worker-call.token", new_token())

    def router_token_file(self) -> Path:
        """A read-only token: for the routers ``--processes`` starts and routers started by hand."""
        token = new_token()
        self._tokens["router"] = (token, "read")
        return self._write("router.token", token)

    def table(self) -> TokenTable:
        return TokenTable.of((name, token, scope) for name, (token, scope) in self._tokens.items())


async def stop_workers(workers: list[WorkerProcess], timeout_s: float = 10.0) -> None:
    for worker in workers:
        if worker.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                worker.process.send_signal(signal.SIGTERM)
    for worker in workers:
        try:
            await asyncio.wait_for(worker.process.wait(), timeout_s)
        except TimeoutError:
            logger.warning("worker %s did not stop in %.0f s; killing it", worker.instance_id, timeout_s)
            with contextlib.suppress(ProcessLookupError):
                worker.process.kill()
            await worker.process.wait()


async def _spawn_worker(
    instance_id: str,
    role: str,
    cms_address: str,
    profile: Path,
    extra: list[str],
    token_file: Path,
    secrets: ClusterSecrets,
) -> WorkerProcess:
    cmd = [
        sys.executable, "-m", "router.cli", "worker", "--engine", "sim", "--role", role,
        "--worker-auth-token-file", str(secrets.worker_call_token),
        "--listen", "127.0.0.1:0", "--cms", cms_address, "--instance-id", instance_id,
        "--cms-auth-token-file", str(token_file),
        "--kv-key-file", str(secrets.kv_key_file),
        "--ttft-profiling-data-path", str(profile / "ttft.json"),
        "--tpot-profiling-data-path", str(profile / "tpot.json"),
        *extra,
    ]  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL, env=child_env()
    )
    return WorkerProcess(instance_id, role, process)


async def _await_listening(worker: WorkerProcess, timeout_s: float) -> None:
    assert worker.process.stdout is not None
    try:
        while True:
            line = await asyncio.wait_for(worker.process.stdout.readline(), timeout_s)
            if not line:
                raise RuntimeError(
                    f"worker {worker.instance_id} exited (code {worker.process.returncode}) before listening"
                )
            text = line.decode(errors="replace").strip()
            if text.startswith("worker HTTP API on "):
                worker.http_url = text.rsplit(" ", 1)[1]
            if text.startswith("worker listening on "):
                worker.address = text.rsplit(" ", 1)[1]
                return
    except TimeoutError as exc:
        raise RuntimeError(f"worker {worker.instance_id} did not start within {timeout_s:.0f} s") from exc


async def _drain_stdout(worker: WorkerProcess) -> None:
    """Keep reading a worker's stdout so it never blocks on a full pipe."""
    assert worker.process.stdout is not None
    while await worker.process.stdout.readline():
        pass


@dataclass(frozen=True)
class ClusterPlan:
    """What ``up``'s flags describe, checked, with nothing started yet."""

    roles: list[tuple[str, int]]
    profile: Path
    predictor: LatencyPredictor
    config: SchedulerConfig
    #: ``--dispatch-mode slice`` or ``auto``: the slice configuration (None: request dispatch).
    slice_config: SliceConfig | None = None
    queue: QueueConfig = field(default_factory=QueueConfig)
    qlm: QlmConfig = field(default_factory=QlmConfig)
    #: ``--http-*``: the HTTP edge's connection bounds.
    http_limits: EdgeLimits = field(default_factory=EdgeLimits)
    #: ``--worker-keepalive-s``, ``--worker-keepalive-timeout-s``.
    worker_keepalive: tuple[float, float] = (DEFAULT_KEEPALIVE_S, DEFAULT_KEEPALIVE_TIMEOUT_S)
    #: ``--dispatch-mode``: the dispatcher it names instead of the queue policy's ("": request).
    dispatch_mode: str = ""


def plan_cluster(args: argparse.Namespace) -> ClusterPlan:
    """Check every flag and load the profile; ``ValueError`` naming the flag. Starts nothing."""
    for flag, value in (("--prefill", args.prefill), ("--decode", args.decode), ("--neutral", args.neutral)):
        if value < 0:
            raise ValueError(f"{flag} {value}: must be >= 0")
    if not args.neutral and (args.prefill < 1 or args.decode < 1):
        raise ValueError("need --neutral K, or at least one --prefill and one --decode worker")
    if not (math.isfinite(args.speed_factor) and args.speed_factor > 0):
        raise ValueError(f"--speed-factor {args.speed_factor}: must be a finite number > 0")
    prefix_block = getattr(args, "prefix_cache_block_tokens", 0)
    if not 0 <= prefix_block <= 1 << 20 or prefix_block % 16:
        raise ValueError(
            f"--prefix-cache-block-tokens {prefix_block}: must be 0 (off) or a multiple of "
            "the sim workers' block size 16, at most 1048576"
        )
    if not 1 <= args.processes <= MAX_PROCESSES:
        raise ValueError(f"--processes {args.processes}: must be within [1, {MAX_PROCESSES}]")
    interval = args.worker_stream_interval_ms
    if not (math.isfinite(interval) and 0 <= interval <= 1000):
        raise ValueError(
            f"--worker-stream-interval-ms {interval}: must be a number of milliseconds within [0, 1000]"
        )
    if not (math.isfinite(args.start_timeout_s) and args.start_timeout_s > 0):
        raise ValueError(f"--start-timeout-s {args.start_timeout_s}: must be a finite number > 0")
    if args.dispatch_mode != "request" and not args.neutral:
        # auto too: its slices, once it picks them, are prefill and decode on one instance.
        raise ValueError(f"--dispatch-mode {args.dispatch_mode} runs on neutral workers: add --neutral K")
    if args.queue_policy == "qlm" and not args.neutral:
        raise ValueError(
            "--queue-policy qlm runs on neutral workers (it places whole requests): add --neutral K, "
            "or pick another queue policy (edf, sa) for prefill/decode workers"
        )
    slice_config = slice_config_from_args(args)
    split_host_port("--listen", args.listen)
    if args.http_listen:
        split_host_port("--http-listen", args.http_listen)
    check_worker_streams(args)
    if not 0 <= args.metrics_port <= 65535:
        raise ValueError(f"--metrics-port {args.metrics_port}: must be a port 0-65535 (0 = off)")
    check_drain_timeout(args)
    check_grpc_server(args.grpc_server, tls=False)
    config = scheduler_config(args)
    if (
        prefix_block
        and config.prefix_cache_routing in ("auto", "exact")
        and not config.prefix_chain_block_tokens
    ):
        # The workers' KV events name blocks of their cache's size: the router chains prompt hashes
        # in the same block (any other would match none of them) and looks them up in its own
        # --prefix-block-tokens where that is a multiple of it, else in the workers' block.
        if config.prefix_block_tokens % prefix_block:
            config = dataclasses.replace(config, prefix_block_tokens=prefix_block)
        config = dataclasses.replace(config, prefix_chain_block_tokens=prefix_block)
    if not prefix_block and config.prefix_cache_routing == "auto":
        # These sim workers keep no prefix cache: the routing history would credit them with the
        # blocks sent there (as it rightly does for vLLM, whose prefix caching is on by default),
        # and the queue would count a repeated prompt as nearly free to prefill.
        config = dataclasses.replace(config, prefix_cache_routing="off")
    queue = queue_config(args)
    profile = Path(args.profile)
    if not profile.is_dir():
        raise ValueError(f"--profile {args.profile}: not a directory (it needs ttft.json and tpot.json)")
    predictor = LatencyPredictor.from_files(profile / "ttft.json", profile / "tpot.json")
    if args.neutral:
        roles = [("neutral", i) for i in range(args.neutral)]
    else:
        roles = [("prefill", i) for i in range(args.prefill)] + [("decode", i) for i in range(args.decode)]
    edge, keepalive = edge_limits_from_args(args), keepalive_from_args(args)
    # Last: the addresses are free now (a mistaken flag above is reported as itself first).
    check_listen("--listen", args.listen)
    if args.http_listen:
        check_listen("--http-listen", args.http_listen)
    check_metrics_port("--metrics-port", args.metrics_port, "127.0.0.1")
    return ClusterPlan(
        roles,
        profile,
        predictor,
        config,
        slice_config,
        queue,
        qlm_config(args),
        edge,
        keepalive,
        dispatch_mode=dispatcher_from_args(args),
    )


async def start_cluster(args: argparse.Namespace, plan: ClusterPlan | None = None) -> Cluster:
    """Start CMS, workers and router as the flags say; wait until the router sees every worker."""
    plan = plan or plan_cluster(args)
    secrets = ClusterSecrets()
    ids = [f"{role}-{i}" for role, i in plan.roles]
    token_files = {iid: secrets.worker_token_file(iid) for iid in ids}
    # One read token for routers beside the embedded one: --processes, and routers started by hand.
    router_token = secrets.router_token_file()
    store = MemoryStore()
    try:
        cms = await start_cms_server(store, "127.0.0.1:0", tokens=secrets.table())
    except BaseException:
        shutil.rmtree(secrets.dir, ignore_errors=True)
        raise
    workers: list[WorkerProcess] = []
    try:
        extra = ["--speed-factor", str(args.speed_factor), "--seed", str(args.seed)]
        if args.worker_http:
            extra += ["--http-listen", "127.0.0.1:0"]
        if args.worker_stream_interval_ms:
            extra += ["--stream-interval-ms", str(args.worker_stream_interval_ms)]
        if getattr(args, "prefix_cache_block_tokens", 0):
            extra += ["--prefix-cache-block-tokens", str(args.prefix_cache_block_tokens)]
        for (role, _), iid in zip(plan.roles, ids, strict=True):
            workers.append(
                await _spawn_worker(iid, role, cms.address, plan.profile, extra, token_files[iid], secrets)
            )
        await asyncio.gather(*(_await_listening(w, args.start_timeout_s) for w in workers))
        scheduler = Scheduler(plan.config, plan.predictor, PeekableRandom(args.seed))
        observer = RequestObserver()
        if args.metrics_port:
            from prometheus_client import start_http_server

            start_http_server(args.metrics_port, addr="127.0.0.1", registry=observer.registry)
        router = await start_router_server(
            open_reader("memory", store=store),
            scheduler,
            listen=args.listen,
            service_config=ServiceConfig(
                ttft_slo_ms=plan.config.ttft_slo_ms, tpot_slo_ms=plan.config.tpot_slo_ms
            ),
            observer=observer,
            source=f"the embedded CMS on {cms.address}",
            slice_config=plan.slice_config,
            dispatch_mode=plan.dispatch_mode,
            http_listen=args.http_listen,
            queue_config=plan.queue,
            qlm_config=plan.qlm,
            reuse_port=args.processes > 1,
            worker_streams=args.worker_streams,
            vllm_stream_interval_s=args.vllm_stream_interval_ms / 1e3,
            vllm_stream_messages_per_s=args.vllm_stream_messages_per_s,
            vllm_transport=args.vllm_transport,
            http_limits=plan.http_limits,
            worker_token=read_worker_token(str(secrets.worker_call_token)),
            worker_keepalive=plan.worker_keepalive,
            grpc_server=args.grpc_server,
        )
    except BaseException:
        await stop_workers(workers)
        await cms.stop(grace=0)
        shutil.rmtree(secrets.dir, ignore_errors=True)
        raise
    cluster = Cluster(
        cms,
        router,
        workers,
        secrets.dir,
        router_token_file=router_token,
        worker_token_file=secrets.worker_call_token,
    )
    if args.processes > 1:
        try:
            cluster.processes = await RouterProcesses.start_group(
                router.address,
                router.service,
                router.scheduler.inflight,
                args.processes,
                _router_argv(args, plan, cms.address, router_token, secrets.worker_call_token),
            )
        except BaseException:
            await cluster.stop()
            raise
    deadline = asyncio.get_running_loop().time() + args.start_timeout_s
    # The router's own view, not the store: traffic sent after this returns finds every worker.
    while not router.ready or _reporting(router) < len(workers):
        if asyncio.get_running_loop().time() > deadline:
            await cluster.stop()
            raise RuntimeError("workers started but did not all register with the CMS in time")
        await asyncio.sleep(0.02)
    return cluster


#: ``up`` flags the started ``slo-router router`` processes do not take (True: the flag takes a value).
_UP_ONLY_FLAGS = {
    "--prefill": True, "--decode": True, "--neutral": True, "--listen": True, "--http-listen": True,
    "--worker-http": False, "--worker-stream-interval-ms": True, "--profile": True,
    "--speed-factor": True, "--start-timeout-s": True, "--metrics-port": True, "--processes": True,
    "--http-max-header-bytes": True, "--http-max-headers": True, "--http-header-timeout-s": True,
    "--http-idle-timeout-s": True, "--http-max-connections": True,
    "--prefix-cache-block-tokens": True,
}  # fmt: skip


def _router_argv(
    args: argparse.Namespace, plan: ClusterPlan, cms_address: str, token_file: Path, worker_token_file: Path
) -> list[str]:
    """``slo-router router`` flags for the other ``--processes``: the embedded CMS over gRPC, the
    profile, then every scheduling, queue and slicing flag of ``up`` as the user gave it."""
    argv: list[str] = list(getattr(args, "argv", None) or sys.argv[1:])
    # Options before the command (--log-level) stay in front of it; "up" becomes "router".
    at = argv.index("up") if "up" in argv else len(argv)
    before, given = argv[:at], argv[at + 1 :]
    forwarded: list[str] = []
    skip_value = False
    for token in given:
        if skip_value:
            skip_value = False
            continue
        flag, eq, _ = token.partition("=")
        if flag in _UP_ONLY_FLAGS:
            skip_value = _UP_ONLY_FLAGS[flag] and not eq
            continue
        forwarded.append(token)
    return [
        *before, "router", "--cms", f"grpc://{cms_address}", "--cms-auth-token-file", str(token_file),
        "--worker-auth-token-file", str(worker_token_file),
        "--ttft-profiling-data-path", str(plan.profile / "ttft.json"),
        "--tpot-profiling-data-path", str(plan.profile / "tpot.json"),
        "--scheduling-policy", args.scheduling_policy, "--seed", str(args.seed),
        *forwarded,
        # The prefix blocks plan_cluster chose from the workers' cache block (last: they win).
        "--prefix-block-tokens", str(plan.config.prefix_block_tokens),
        "--prefix-chain-block-tokens", str(plan.config.prefix_chain_block_tokens),
    ]  # fmt: skip


def _reporting(router: RouterServer) -> int:
    return sum(1 for r in router.reader.snapshot().instances if r.status is not None)


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "up",
        help="run a whole cluster on loopback: CMS, sim workers and router",
        description=(
            "Start an embedded cluster on loopback in one command: a CMS with the memory store, sim "
            "workers (each in its own process, with its status agent) and the router. Prints the router "
            "address, then serves until Ctrl-C or SIGTERM, and shuts everything down cleanly."
        ),
    )
    parser.add_argument("--prefill", type=int, default=2, help="prefill workers (default: %(default)s)")
    parser.add_argument("--decode", type=int, default=2, help="decode workers (default: %(default)s)")
    parser.add_argument(
        "--neutral", type=int, default=0, help="neutral workers instead of prefill/decode ones"
    )
    parser.add_argument("--listen", default=DEFAULT_LISTEN, help="router address (default: %(default)s)")
    parser.add_argument(
        "--http-listen",
        default=DEFAULT_HTTP_LISTEN,
        metavar="HOST:PORT",
        help="the router's OpenAI-compatible HTTP API (default: %(default)s; '' turns it off)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="router processes on --listen (SO_REUSEPORT), sharing their in-flight account; the "
        "others read the embedded CMS over gRPC; the HTTP edge and --metrics-port stay on the first "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--worker-http",
        action="store_true",
        help="give every sim worker an OpenAI-compatible HTTP face too (for HTTP routers and benchmarks)",
    )
    add_worker_streams_argument(parser)
    add_http_edge_arguments(parser)
    add_keepalive_arguments(parser)
    add_drain_argument(parser)
    add_grpc_server_argument(parser)
    parser.add_argument(
        "--worker-stream-interval-ms",
        type=float,
        default=0.0,
        help="the sim workers' --stream-interval-ms: space each stream's messages at least this far "
        "apart, merging the tokens in between (default: %(default)s = one message per engine step)",
    )
    parser.add_argument(
        "--profile",
        default=str(DEFAULT_PROFILE_DIR),
        help="profile directory (ttft.json + tpot.json) the sim workers run and the router predicts with "
        "(default: the bundled Qwen2.5-7B profile)",
    )
    parser.add_argument(
        "--speed-factor",
        type=float,
        default=1.0,
        help="sim workers run this many times faster than the profile (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the scheduler and the workers")
    parser.add_argument(
        "--prefix-cache-block-tokens",
        type=int,
        default=0,
        help="the sim workers' prefix cache: tokens per cached block, a multiple of their block size (16); "
        "0 = no prefix caching (default: %(default)s)",
    )
    parser.add_argument(
        "--metrics-port", type=int, default=0, help="serve the router's Prometheus metrics here"
    )
    parser.add_argument(
        "--start-timeout-s", type=float, default=60.0, help="how long workers may take to start"
    )
    SchedulerConfig.add_arguments(parser)
    add_slice_arguments(parser)
    QueueConfig.add_arguments(parser)
    QlmConfig.add_arguments(parser)
    parser.set_defaults(func=run, scheduling_policy="slo")


async def _serve(args: argparse.Namespace, plan: ClusterPlan) -> int:
    cluster = await start_cluster(args, plan)
    roles = ", ".join(f"{w.instance_id}@{w.address}" for w in cluster.workers)
    print(f"cms listening on {cluster.cms.address}", flush=True)
    print(f"cms read token for other routers: {cluster.router_token_file}", flush=True)
    print(f"worker token for other routers: {cluster.worker_token_file}", flush=True)
    print(f"workers: {roles}", flush=True)
    print(
        f"workers are simulated: the sim engine takes its step times from profile {plan.profile.name} "
        f"(speed x{args.speed_factor:g}); no model is loaded",
        flush=True,
    )
    if any(w.http_url for w in cluster.workers):
        print(
            "worker HTTP APIs: " + ", ".join(f"{w.instance_id}@{w.http_url}" for w in cluster.workers),
            flush=True,
        )
    print(f"router listening on {cluster.router.address}", flush=True)
    if cluster.router.http is not None:
        print(f"OpenAI-compatible HTTP API on http://{cluster.router.http.address}/v1", flush=True)
    policy = plan.config.policy_config_path or plan.config.scheduling_policy
    adaptive = " + adaptive PD" if plan.config.enable_adaptive_pd else ""
    print(
        f"router policy: {policy}{adaptive}; default SLO TTFT {plan.config.ttft_slo_ms:g} ms, "
        f"TPOT {plan.config.tpot_slo_ms:g} ms (a request's own SLO wins)",
        flush=True,
    )
    drains = [asyncio.ensure_future(_drain_stdout(w)) for w in cluster.workers]
    force = await wait_for_signals()
    print(f"shutting down (draining for up to {args.drain_timeout_s:g} s)", flush=True)
    await cluster.stop(args.drain_timeout_s, force)
    for task in drains:
        task.cancel()
    await asyncio.gather(*drains, return_exceptions=True)
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        plan = plan_cluster(args)
    except ValueError as exc:  # ProfileError included: it names the file and the entry
        print(error_line(exc), file=sys.stderr)
        return 2
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    try:
        return asyncio.run(_serve(args, plan))
    except (ValueError, OSError, RuntimeError) as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
