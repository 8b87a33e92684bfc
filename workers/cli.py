"""``slo-router worker`` and ``slo-router profile``.

``worker`` serves one engine behind the Worker gRPC service, with the status
agent when ``--cms`` is given. The engine's own flags come from its backend
(:mod:`workers.backends`) and are added once ``--engine`` is known, so
``slo-router worker --engine vllm --help`` lists vLLM's flags and the vLLM
module is imported only when it is asked for.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import re
import signal
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

from fleet.flags import (
    check_listen,
    check_metrics_port,
    cms_target,
    error_line,
    file_problem,
    read_flag_file,
    split_host_port,
)
from workers.backends import BACKENDS, BackendError, BackendRegistry

logger = logging.getLogger(__name__)

_ROLES = ("neutral", "prefill", "decode")


def _engine_choice(args: Sequence[str], default: str) -> str:
    """The value of ``--engine`` among raw arguments (before ``--``), else ``default``."""
    for i, arg in enumerate(args):
        if arg == "--":
            break
        if arg == "--engine" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--engine="):
            return arg.partition("=")[2]
    return default


class _WorkerParser(argparse.ArgumentParser):
    """Adds the chosen backend's flags before parsing (backends are only imported when chosen)."""

    registry: BackendRegistry = BACKENDS
    _backend_added: str | None = None

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        raw = list(sys.argv[1:] if args is None else args)
        name = _engine_choice(raw, "sim")
        if self._backend_added is None:
            if name not in self.registry.names():
                self.error(
                    f"argument --engine: invalid choice {name!r} (choose from {', '.join(self.registry.names())})"
                )
            try:
                backend = self.registry.load(name)
            except BackendError as exc:
                self.error(str(exc))
            backend.add_arguments(self)
            self._backend_added = name
        return super().parse_known_args(raw, namespace)


def register(subparsers: Any) -> None:
    worker: argparse.ArgumentParser = subparsers.add_parser(
        "worker",
        help="serve an engine (sim or vllm) behind the Worker gRPC service",
        description=(
            "Serve one engine behind the Worker gRPC service (Generate, Prefill, Decode, Abort, GetInfo, "
            "plus health and reflection). With --cms, the instance registers with the cluster metadata "
            "service and reports its load on every change. The engine's flags depend on --engine; "
            "see `slo-router worker --engine NAME --help`."
        ),
    )
    # The backend's flags are added at parse time; see _WorkerParser.
    worker.__class__ = _WorkerParser
    worker.add_argument(
        "--engine",
        default="sim",
        help=f"engine backend: {', '.join(BACKENDS.names())} (default: %(default)s)",
    )
    worker.add_argument(
        "--role", choices=_ROLES, default="neutral", help="stage registered for (default: %(default)s)"
    )
    worker.add_argument(
        "--listen",
        default="127.0.0.1:0",
        help="HOST:PORT to serve on; port 0 picks one (default: %(default)s)",
    )
    worker.add_argument(
        "--http-listen",
        default="",
        metavar="HOST:PORT",
        help="also serve OpenAI's HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health, "
        "/metrics with vllm:num_requests_running/waiting and vllm:kv_cache_usage_perc, /get_load) here, "
        "so HTTP routers can use this worker; off by default",
    )
    worker.add_argument(
        "--advertise-host",
        default=None,
        help="host other processes reach this worker at (default: the listen host)",
    )
    worker.add_argument(
        "--cms", default=None, help="CMS address (host:port or grpc://host:port); none = no agent"
    )
    worker.add_argument(
        "--cms-auth-token-file",
        default=None,
        help="file holding this worker's CMS token (its own, or the cluster's)",
    )
    worker.add_argument(
        "--tls-ca", default=None, help="CA bundle (PEM): reach the CMS and other workers over TLS"
    )
    worker.add_argument(
        "--kv-key-file",
        default=None,
        help="the cluster's kv handle key: sign the handles this worker hands out and accept only signed ones",
    )
    worker.add_argument(
        "--worker-auth-token-file",
        default=None,
        help="the cluster's worker token: Prefill, Generate, Decode, Streams and Abort need it "
        "(UNAUTHENTICATED without), and this worker's own calls to other workers carry it; give the "
        "router the same file",
    )
    worker.add_argument(
        "--tls-cert", default=None, help="serve the Worker service over TLS with this PEM chain"
    )
    worker.add_argument("--tls-key", default=None, help="the private key (PEM) of --tls-cert")
    worker.add_argument("--instance-id", default="", help="instance id (default: worker-<endpoint>)")
    worker.add_argument("--node-id", default="", help="failure domain: host id")
    worker.add_argument("--unit-id", default="", help="failure domain: unit id")
    worker.add_argument(
        "--engine-stall-s",
        type=float,
        default=30.0,
        help="an engine that holds requests but finishes no step for this long is reported "
        "unschedulable (reason in its status) until its steps resume; 0 = off (default: %(default)s)",
    )
    worker.add_argument(
        "--stream-interval-ms",
        type=float,
        default=0.0,
        help="space a stream's messages at least this far apart: the tokens of the engine steps in "
        "between go out merged in the next message (fewer, larger messages for the router and the "
        "client; the first token is never held); 0 = one message per step (default: %(default)s)",
    )
    worker.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=5.0,
        help="seconds running calls get on shutdown (default: %(default)s)",
    )
    worker.add_argument(
        "--metrics-port", type=int, default=0, help="serve Prometheus metrics on this port (0 = off)"
    )
    worker.add_argument(
        "--metrics-host", default="127.0.0.1", help="address of the metrics endpoint (default: %(default)s)"
    )
    worker.set_defaults(func=run_worker)

    prof: argparse.ArgumentParser = subparsers.add_parser(
        "profile",
        help="measure a live worker and write ttft.json / tpot.json",
        description=(
            "Measure TTFT by prompt length on an idle worker and TPOT by decode batch size and context "
            "length, through the Worker service, and write ttft.json and tpot.json in the profiling schema "
            "the router reads."
        ),
    )
    prof.add_argument("--target", required=True, help="the worker's HOST:PORT")
    prof.add_argument("--out", required=True, help="directory to write ttft.json and tpot.json into")
    prof.add_argument(
        "--tokens", default="128,256,512,1024,2048", help="TTFT prompt lengths (default: %(default)s)"
    )
    prof.add_argument("--batch-sizes", default="1,2,4,8,16", help="TPOT batch sizes (default: %(default)s)")
    prof.add_argument(
        "--tokens-per-request", default="128,512,1024", help="TPOT context lengths (default: %(default)s)"
    )
    prof.add_argument(
        "--repeats", type=int, default=5, help="samples per TTFT point / batches per TPOT point"
    )
    prof.add_argument("--decode-tokens", type=int, default=16, help="output tokens per TPOT request")
    prof.add_argument("--max-token-id", type=int, default=999, help="prompt ids are drawn from 1..this")
    prof.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    prof.add_argument(
        "--worker-auth-token-file",
        default=None,
        help="the cluster's worker token, for a worker started with --worker-auth-token-file",
    )
    prof.set_defaults(func=run_profile)

    tiny: argparse.ArgumentParser = subparsers.add_parser(
        "vllm-tiny-model",
        help="write a tiny random-weight model vLLM loads in seconds on a CPU (for trying the vllm engine)",
        description=(
            "Write a tiny random-weight Llama (2 layers, hidden size 128, a 1000-word made-up vocabulary, "
            "float32) and its tokenizer into DIR, with no download. Its output is noise: it is there to try "
            "and test `slo-router worker --engine vllm` without fetching a real model. Needs torch and "
            "transformers, i.e. the vLLM environment (.venv-vllm, `make vllm-venv`); run from the main "
            "environment it builds the model there."
        ),
    )
    tiny.add_argument("dir", metavar="DIR", help="directory to write the model into (created if needed)")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the weights (default: %(default)s)")
    tiny.set_defaults(func=run_tiny_model)


def _int_list(flag: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated integers, got {text!r}") from None


def run_async(coro: Coroutine[Any, Any, int]) -> int:
    """Run the entry coroutine, on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def check_worker_args(args: argparse.Namespace) -> None:
    """The engine-independent flags; ``ValueError`` naming the flag."""
    split_host_port("--listen", args.listen)
    if args.http_listen:
        split_host_port("--http-listen", args.http_listen)
    if args.cms is not None:
        cms_target("--cms", args.cms)  # HOST:PORT and grpc://HOST:PORT alike
    if not (math.isfinite(args.shutdown_grace_s) and args.shutdown_grace_s >= 0):
        raise ValueError(f"--shutdown-grace-s {args.shutdown_grace_s}: must be a finite number >= 0")
    if not 0 <= args.metrics_port <= 65535:
        raise ValueError(f"--metrics-port {args.metrics_port}: must be a port 0-65535 (0 = off)")
    if not (math.isfinite(args.engine_stall_s) and args.engine_stall_s >= 0):
        raise ValueError(f"--engine-stall-s {args.engine_stall_s}: must be a finite number >= 0 (0 = off)")
    if not (math.isfinite(args.stream_interval_ms) and 0 <= args.stream_interval_ms <= 1000):
        raise ValueError(
            f"--stream-interval-ms {args.stream_interval_ms}: must be a number of milliseconds within [0, 1000]"
        )


def run_worker(args: argparse.Namespace) -> int:
    from cms.auth import read_client_token_text
    from cms.call_auth import read_worker_token
    from cms.transport import client_tls_from_arg, server_tls_from_args
    from workers.kv_auth import KvSigner
    from workers.metadata import WorkerIdentity, WorkerRole

    try:
        check_worker_args(args)
    except ValueError as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    token: str | None = None
    try:
        if args.cms_auth_token_file:
            text = read_flag_file("--cms-auth-token-file", args.cms_auth_token_file)
            try:
                token = read_client_token_text(text, "")
            except ValueError as exc:
                raise ValueError(f"--cms-auth-token-file {args.cms_auth_token_file}: {exc}") from None
        args.kv_signer = None
        if args.kv_key_file:
            try:
                key = Path(args.kv_key_file).read_bytes()
            except OSError as exc:
                raise ValueError(f"--kv-key-file {args.kv_key_file}: {file_problem(exc)}") from None
            try:
                args.kv_signer = KvSigner(key.strip())
            except ValueError as exc:
                raise ValueError(f"--kv-key-file {args.kv_key_file}: {exc}") from None
    except ValueError as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    try:
        args.worker_token = read_worker_token(args.worker_auth_token_file)
    except ValueError as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    try:
        args.server_tls = server_tls_from_args(args.tls_cert, args.tls_key)
        args.cms_tls = client_tls_from_arg(args.tls_ca)
    except ValueError as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    try:
        # Before the engine starts (a vLLM engine takes tens of seconds): the ports are free now.
        check_listen("--listen", args.listen)
        if args.http_listen:
            check_listen("--http-listen", args.http_listen)
        check_metrics_port("--metrics-port", args.metrics_port, args.metrics_host)
    except ValueError as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    try:
        engine = BACKENDS.load(args.engine).build_engine(args)
    except (BackendError, ValueError) as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    identity = WorkerIdentity(
        instance_id=args.instance_id,
        role=WorkerRole(args.role),
        node_id=args.node_id,
        unit_id=args.unit_id,
    )
    return run_async(_serve(engine, args, identity, token))


async def _serve(engine: Any, args: argparse.Namespace, identity: Any, token: str | None) -> int:
    from workers.service import start_worker_server

    try:
        server = await start_worker_server(
            engine,
            args.listen,
            identity=identity,
            advertise_host=args.advertise_host,
            cms=args.cms,
            cms_auth_token=token,
            http_listen=args.http_listen,
            engine_stall_s=args.engine_stall_s,
            kv_signer=args.kv_signer,
            tls=args.server_tls,
            cms_tls=args.cms_tls,
            stream_interval_s=args.stream_interval_ms / 1e3,
            worker_token=args.worker_token,
        )
    except (OSError, ValueError) as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    if args.metrics_port:
        from workers.telemetry import serve_metrics

        serve_metrics(engine, server.metadata.instance_id, args.metrics_port, args.metrics_host)
    if server.http is not None:
        print(f"worker HTTP API on http://{server.http.address}/v1", flush=True)
    print(f"worker listening on {server.address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        logger.info("shutting down worker %s", server.instance_id)
        await server.stop(args.shutdown_grace_s)
    return 0


def run_tiny_model(args: argparse.Namespace) -> int:
    import importlib.util

    out = Path(args.dir)
    if out.exists() and not out.is_dir():
        print(error_line(f"DIR {args.dir}: exists and is not a directory"), file=sys.stderr)
        return 2
    if importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None:
        from workers.vllm_tiny_model import build

        build(out, args.seed)
    else:  # the main environment has no torch: build it in the vLLM environment
        from workers.vllm_process import MISSING_VENV_HINT, build_tiny_model, vllm_env_ready

        if not vllm_env_ready():
            print(
                f"error: building the model needs torch and transformers; {MISSING_VENV_HINT}",
                file=sys.stderr,
            )
            return 1
        try:
            build_tiny_model(out.resolve(), seed=args.seed)
        except RuntimeError as exc:
            print(error_line(exc), file=sys.stderr)
            return 1
    print(f"wrote a tiny random-weight model into {out}")
    print(
        f"serve it with: slo-router worker --engine vllm --model {out} --dtype float32 --enforce-eager "
        "(from .venv-vllm; the CMS and router flags: docs/operator-guide.md, 'A vLLM worker end to end')"
    )
    return 0


def run_profile(args: argparse.Namespace) -> int:
    from cms.call_auth import read_worker_token
    from cms.transport import target_error
    from predictor.fit import write_coefficients
    from predictor.profile import load_tpot_profile, load_ttft_profile
    from workers.profile import ProfilePlan, profile_worker, write_profiles

    bad_target = target_error(args.target, "worker")
    if bad_target is not None:
        print(error_line(bad_target), file=sys.stderr)
        return 2
    try:
        plan = ProfilePlan(
            tokens=_int_list("--tokens", args.tokens),
            batch_sizes=_int_list("--batch-sizes", args.batch_sizes),
            tokens_per_request=_int_list("--tokens-per-request", args.tokens_per_request),
            repeats=args.repeats,
            decode_tokens=args.decode_tokens,
            max_token_id=args.max_token_id,
            seed=args.seed,
        )
    except ValueError as exc:  # ProfilePlan names its fields; name the flags that set them
        message = str(exc)
        for name in (
            "tokens_per_request",
            "batch_sizes",
            "decode_tokens",
            "max_token_id",
            "repeats",
            "tokens",
        ):
            # The field opens the message; the same word later is prose ("gaps between tokens").
            message = re.sub(rf"^{name}(?![\w-])", "--" + name.replace("_", "-"), message)
        print(error_line(message), file=sys.stderr)
        return 2

    try:
        call_token = read_worker_token(args.worker_auth_token_file)
    except ValueError as exc:
        print(error_line(exc), file=sys.stderr)
        return 2

    async def go() -> int:
        try:
            ttft, tpot = await profile_worker(args.target, plan, call_token=call_token)
        except ValueError as exc:
            print("\n" + error_line(exc), file=sys.stderr)
            return 2
        except Exception as exc:  # gRPC failures: say which worker and why, without a traceback
            import grpc

            why = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            print("\n" + error_line(f"profiling {args.target} failed: {why}"), file=sys.stderr)
            return 1
        ttft_path, tpot_path = write_profiles(args.out, ttft, tpot)
        # The seed model's coefficients beside the grids: a summary to compare fleets by.
        coefficients = write_coefficients(
            args.out, load_ttft_profile(ttft_path), load_tpot_profile(tpot_path)
        )
        print(f"wrote {ttft_path}, {tpot_path} and {coefficients}")
        return 0

    return run_async(go())
