"""``slo-router agent``: registers an unmodified vLLM gRPC engine with the CMS and reports its load.

Runs beside ``vllm serve MODEL --grpc`` (or ``python -m vllm.entrypoints.launchers.grpc_server``),
which serves ``vllm.grpc.engine.VllmEngine``. The agent:

- waits for the engine's ``HealthCheck``, then registers it with ``worker_protocol: "vllm-grpc"``,
  so routers reach it through :mod:`router.vllm_grpc`; the limits come from the engine:
  ``GetModelInfo`` (model name, ``max_model_len``), ``GetServerInfo`` (KV block size, connector)
  and ``GetLoads`` (KV capacity in tokens);
- every ``--poll-interval-s`` asks ``GetLoads`` and publishes a status whose timestamp is the time
  of the engine's measurement (``GetLoads``' ``timestamp``, never later than now). The CMS writer
  (:class:`cms.agent.AgentWriter`) sends it, coalesces, heartbeats and retries;
- every ``--health-interval-s`` (and at every poll while the engine is unschedulable) asks
  ``HealthCheck`` and ``GetServerInfo`` too, in the same round trip as ``GetLoads``. The engine's
  gRPC server answers these in the process that also writes every token of every stream, on the
  cores the engine computes on: three calls per poll where one carries the load was a cost for
  nothing, since health and pause change rarely;
- marks the engine unschedulable, with the reason, when ``GetLoads`` or ``HealthCheck`` fails, is
  unhealthy or does not answer within ``--probe-timeout-s``, or when the engine is paused. A hung
  engine thus leaves placement at the next poll, not when its lease lapses (the writer's
  heartbeats would otherwise keep the last good status fresh); an engine whose core died while its
  server still answers ``GetLoads`` leaves within ``--health-interval-s``;
- deregisters the instance when it stops (SIGINT/SIGTERM).

Which of the predictor's inputs are exact and which estimated (vLLM exposes no per-request state):

===============================  =========================================================  =========
status field                     from                                                       kind
===============================  =========================================================  =========
num_running_requests             ``SchedulerLoad.num_running_reqs`` (last engine step)      exact
num_waiting_requests             ``SchedulerLoad.num_waiting_reqs`` (last engine step)      exact
num_used_kv_tokens               ``token_usage`` × KV capacity (block granular)             exact to a block
num_uncomputed_prefill_tokens    ``num_waiting_uncached_tokens``: the servicer's count of   estimated
                                 waiting prompts' tokens, discounted by its recent prefix
                                 hit rate; the unfinished part of a running chunked
                                 prefill is not in it
num_decode_requests              ``num_running_reqs`` (includes requests still prefilling)  estimated
num_decode_tokens                ``num_used_kv_tokens`` less half a block per running       estimated
                                 request (the running requests' contexts; KV is block
                                 granular, :func:`decode_context_tokens`)
admitted_request_ids             none: vLLM does not list them; the router confirms an      —
                                 in-flight entry at the request's first output and drops
                                 it at the next status measured after that
step_samples                     one decode step per 0.5 s, estimated from                  estimated
                                 ``gen_throughput`` and the running requests over the
                                 servicer's 2 s window (:class:`DecodeStepEstimate`;
                                 ``--step-estimate off``: none). Prefill steps: the router
                                 times them (``router.placement.PrefillTiming``)
cache_hit_rate                   ``cache_hit_rate`` per rank, weighted by running requests  exact
num_preemptions                  none: ``GetLoads`` carries no preemption count (left       —
                                 unset, so ``--dispatch-mode auto`` stays on request
                                 dispatch over such a fleet)
num_preemption_recompute_tokens  none (left unset, as ``num_preemptions``)                  —
===============================  =========================================================  =========
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import itertools
import logging
import math
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from slorouter.v1 import cms_pb2

from cms.transport import ClientTls
from router.core.protocols import VLLM_GRPC

logger = logging.getLogger(__name__)

_ROLES = {
    "neutral": cms_pb2.INSTANCE_ROLE_NEUTRAL,
    "prefill": cms_pb2.INSTANCE_ROLE_PREFILL,
    "decode": cms_pb2.INSTANCE_ROLE_DECODE,
}
#: Longest ``unschedulable_reason`` the agent writes.
MAX_REASON_CHARS = 200


@dataclass(frozen=True)
class AgentConfig:
    """The agent's settings (the ``slo-router agent`` flags)."""

    engine: str  # host:port of the engine's gRPC service
    cms: str
    instance_id: str
    role: str = "neutral"
    advertise: str = ""  # host:port routers dial; default: engine
    node_id: str = ""
    unit_id: str = ""
    model: str = ""  # default: the engine's served model name
    max_num_batched_tokens: int = 0  # 0 = the router's default
    poll_interval_s: float = 0.1
    health_interval_s: float = 1.0  # HealthCheck and GetServerInfo at most this often while healthy
    probe_timeout_s: float = 1.0
    heartbeat_interval_s: float = 0.5
    engine_wait_s: float = 300.0
    step_estimate: bool = True  # --step-estimate: decode-step samples from GetLoads for calibration

    def check(self) -> None:
        """``ValueError`` naming the flag of the first bad setting."""
        for flag, value in (("--engine", self.engine), ("--cms", self.cms), ("--advertise", self.advertise)):
            if flag == "--advertise" and not value:
                continue
            host, sep, port = value.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
                raise ValueError(f"{flag} {value!r}: expected HOST:PORT with a port 1-65535")
        if not self.instance_id:
            raise ValueError("--instance-id: must not be empty")
        if self.role not in _ROLES:
            raise ValueError(f"--role {self.role!r}: must be one of {', '.join(_ROLES)}")
        if self.max_num_batched_tokens < 0:
            raise ValueError(f"--max-num-batched-tokens {self.max_num_batched_tokens}: must be >= 0")
        bounds: tuple[tuple[str, float, float, float], ...] = (
            ("--poll-interval-s", self.poll_interval_s, 0.005, 60.0),
            ("--health-interval-s", self.health_interval_s, 0.0, 60.0),
            ("--probe-timeout-s", self.probe_timeout_s, 0.01, 60.0),
            ("--heartbeat-interval-s", self.heartbeat_interval_s, 0.05, 60.0),
            ("--engine-wait-s", self.engine_wait_s, 0.0, 86400.0),
        )
        for name, seconds, low, high in bounds:
            if not (math.isfinite(seconds) and low <= seconds <= high):
                raise ValueError(f"{name} {seconds}: must be a number of seconds within [{low:g}, {high:g}]")


def strip_scheme(address: str) -> str:
    """``grpc://host:port`` → ``host:port`` (the form the flags accept either way)."""
    return address.removeprefix("grpc://").removeprefix("vllm-grpc://")


def measurement_ms(timestamp: str, now_ms: int) -> int:
    """Epoch ms of ``GetLoads``' ISO 8601 timestamp, never after ``now_ms``; ``now_ms`` if unreadable."""
    try:
        parsed = dt.datetime.fromisoformat(timestamp)
    except ValueError:
        return now_ms
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=dt.UTC)
    return min(now_ms, int(parsed.timestamp() * 1000))


def status_from_loads(
    instance_id: str,
    loads: Any,
    kv_capacity_tokens: int,
    *,
    update_id: int,
    now_ms: int,
    unschedulable_reason: str = "",
    step_sample: Any = None,
    block_size: int = 0,
) -> cms_pb2.InstanceStatus:
    """The CMS status of one ``GetLoadsResponse`` (summed over data-parallel ranks); see the table above.

    ``step_sample`` (a :class:`DecodeStepEstimate` result) goes into ``step_samples``.
    ``block_size`` (the engine's KV block, ``GetServerInfo.block_size``) turns the block-granular
    KV in use into the running requests' contexts (:func:`decode_context_tokens`).
    """
    running = waiting = uncached = used = 0
    # A rank's hit rate weighs by its share of the running requests (all alike when none runs).
    hits = weights = 0.0
    for load in loads.loads:
        rate = load.cache_hit_rate
        if math.isfinite(rate):
            weight = 1.0 + max(0, load.num_running_reqs)
            hits += weight * min(1.0, max(0.0, rate))
            weights += weight
        running += max(0, load.num_running_reqs)
        waiting += max(0, load.num_waiting_reqs)
        uncached += max(0, load.num_waiting_uncached_tokens)
        capacity = load.max_total_num_tokens or kv_capacity_tokens
        if load.num_used_tokens > 0:
            used += load.num_used_tokens
        else:
            used += round(min(1.0, max(0.0, load.token_usage)) * capacity)
    return cms_pb2.InstanceStatus(
        instance_id=instance_id,
        update_id=update_id,
        timestamp_ms=measurement_ms(loads.timestamp, now_ms),
        schedulable=not unschedulable_reason,
        unschedulable_reason=unschedulable_reason[:MAX_REASON_CHARS],
        num_waiting_requests=waiting,
        num_running_requests=running,
        num_uncomputed_prefill_tokens=uncached,
        num_decode_requests=running,
        num_decode_tokens=decode_context_tokens(used, running, block_size),
        num_used_kv_tokens=used,
        cache_hit_rate=hits / weights if weights else 0.0,
        step_samples=[step_sample] if step_sample is not None else [],
    )


def decode_context_tokens(used_tokens: int, running: int, block_size: int) -> int:
    """The running requests' context tokens, estimated from the KV tokens in use.

    vLLM reports KV in whole blocks (``token_usage`` × capacity): each running request's last
    block is partly empty, on average by (block − 1) / 2 tokens when its length is spread evenly
    over the block, so the KV in use overstates the contexts by about that much per request. With
    128-token blocks (vLLM on CPU) that is ~64 tokens a request, more than a chat answer's
    remaining output. The router's packing metrics take the residents' remaining output as their
    final lengths (known to the router) minus this context: fed the KV in use, the difference was
    clamped to nothing, every prompt's prefill stall was charged to the residents' next token
    alone (``predicted_tpot_residents``), and ``slo`` held requests a colocated engine could take
    (measured: ``python -m bench.vllm_stock_slo``, docs/vllm-grpc.md). Unbiased on average, never
    below 0 or above the KV in use; ``block_size`` 0 (unknown) leaves the KV in use as it is.
    """
    if block_size <= 1 or running <= 0:
        return used_tokens
    return max(0, used_tokens - round(running * (block_size - 1) / 2))


#: The window over which vLLM's servicer counts ``gen_throughput`` (tokens streamed over the last
#: 2 s, divided by 2: ``smg_grpc_servicer.vllm.loads.THROUGHPUT_WINDOW``).
THROUGHPUT_WINDOW_S = 2.0


class DecodeStepEstimate:
    """A decode-step sample for online calibration, estimated from ``GetLoads`` polls.

    vLLM reports no engine steps, so without this the router's calibration has nothing to fit
    and a stock engine is predicted by the profile alone (measured elsewhere, on other
    hardware or another load). What ``GetLoads`` does give: ``gen_throughput`` G, the tokens the
    servicer streamed over the last :data:`THROUGHPUT_WINDOW_S` seconds W, divided by W; and, at
    every poll, the running requests R. An engine step of duration d with R running requests
    streams R tokens, so over the window the tokens are sum(R_i) and the time-average of R is
    sum(R_i d_i) / W: their ratio, mean(R) / G, is the mean step time weighted by batch (idle time,
    R = 0, drops out). The sample's batch is the mean R over the polls with R > 0, its context the
    mean KV tokens in use over those polls, its prefill tokens 0: a decode step with the prefill
    chunks that ran between decode steps folded in, which is what a stream's TPOT sees. Estimated:
    R is sampled per poll, W is the servicer's clock; a sample is made only once the polls span
    the whole window (G undercounts until the servicer has streamed for W), and then once every
    quarter window: each sample averages the whole window, so one per poll would repeat the same
    estimate twenty times and crowd the calibration's window (256 steps per instance) with it,
    leaving no room for the prefill steps the router times itself
    (:class:`router.placement.PrefillTiming`).
    """

    def __init__(self, window_s: float = THROUGHPUT_WINDOW_S) -> None:
        self.window_s = window_s
        #: (monotonic time, running requests, KV tokens used) per poll, oldest first.
        self._polls: list[tuple[float, int, int]] = []
        self._started: float | None = None
        self._sampled_at = -math.inf

    def observe(self, now_s: float, running: int, used_tokens: int, gen_throughput: float) -> Any:
        """Record one poll; the ``StepSample`` estimated for the window ending now, or None."""
        if self._started is None:
            self._started = now_s
        polls = self._polls
        polls.append((now_s, max(0, running), max(0, used_tokens)))
        cutoff = now_s - self.window_s
        drop = 0
        while drop < len(polls) and polls[drop][0] < cutoff:
            drop += 1
        del polls[:drop]
        if (
            now_s - self._started < self.window_s
            or now_s - self._sampled_at < self.window_s / 4
            or not (math.isfinite(gen_throughput) and gen_throughput > 0)
        ):
            return None
        # Time-weighted mean of R over the window (each poll's R holds until the next poll).
        weighted = 0.0
        for (t0, r0, _), (t1, _, _) in itertools.pairwise(polls):
            weighted += r0 * (t1 - t0)
        covered = polls[-1][0] - polls[0][0]
        busy = [(r, u) for _, r, u in polls if r > 0]
        if covered <= 0 or not busy or weighted <= 0:
            return None
        mean_running = weighted / covered
        self._sampled_at = now_s
        step_ms = 1000.0 * mean_running / gen_throughput
        batch = sum(r for r, _ in busy) / len(busy)
        context = sum(u for _, u in busy) / len(busy)
        return cms_pb2.StepSample(
            num_prefill_tokens=0,
            num_decode_requests=max(1, round(batch)),
            num_decode_tokens=round(context),
            duration_ms=step_ms,
        )


async def _no_reason() -> str:
    return ""


class StockEngineAgent:
    """Registers one vLLM gRPC engine and keeps its status in the CMS (see the module docstring)."""

    def __init__(
        self, config: AgentConfig, *, auth_token: str | None = None, cms_tls: ClientTls | None = None
    ) -> None:
        from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_pb2_grpc

        config.check()
        self.config = config
        self._auth_token = auth_token
        self._cms_tls = cms_tls
        self._channel = grpc.aio.insecure_channel(strip_scheme(config.engine))
        self._stub = vllm_pb2_grpc.VllmEngineStub(self._channel)
        self._writer: Any = None
        self._update_id = time.time_ns() // 1000
        self._last_key: tuple[Any, ...] | None = None
        self._steps = DecodeStepEstimate() if config.step_estimate else None
        #: When HealthCheck and GetServerInfo were last asked (monotonic; they ride along with GetLoads).
        self._health_at = -math.inf
        self.kv_capacity_tokens = 0
        #: The engine's KV block in tokens (``GetServerInfo.block_size``; 0 until registered).
        self.block_size = 0
        #: The latest status published (for tests and logs).
        self.last_status: cms_pb2.InstanceStatus | None = None

    async def wait_for_engine(self, stop: asyncio.Event | None = None) -> bool:
        """True once the engine answers ``HealthCheck`` healthy, False when ``stop`` is set first.

        ``TimeoutError`` after ``--engine-wait-s``.
        """
        deadline = time.monotonic() + self.config.engine_wait_s
        while True:
            reason = await self._health_reason()
            if not reason:
                return True
            if stop is not None and stop.is_set():
                return False
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"engine {self.config.engine} not healthy within {self.config.engine_wait_s:g} s "
                    f"(--engine-wait-s): {reason}"
                )
            await asyncio.sleep(min(0.5, self.config.poll_interval_s * 5))

    async def metadata(self) -> cms_pb2.InstanceMetadata:
        """What the CMS registers, from ``GetModelInfo``, ``GetServerInfo`` and ``GetLoads``."""
        from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2

        timeout = self.config.probe_timeout_s * 5
        model = await self._stub.GetModelInfo(vllm_pb2.GetModelInfoRequest(), timeout=timeout)
        server = await self._stub.GetServerInfo(vllm_pb2.GetServerInfoRequest(), timeout=timeout)
        loads = await self._stub.GetLoads(vllm_pb2.GetLoadsRequest(), timeout=timeout)
        capacity = sum(max(0, load.max_total_num_tokens) for load in loads.loads)
        self.kv_capacity_tokens = capacity
        self.block_size = max(0, server.block_size)
        labels = {"engine": "vllm"}
        if server.kv_connector:
            labels["kv_connector"] = server.kv_connector[:64]
        if server.kv_role:
            labels["kv_role"] = server.kv_role[:64]
        config = self.config
        return cms_pb2.InstanceMetadata(
            instance_id=config.instance_id,
            endpoint=strip_scheme(config.advertise or config.engine),
            worker_protocol=VLLM_GRPC,
            role=_ROLES[config.role],
            model=(config.model or model.served_model_name or model.model_path)[:256],
            node_id=config.node_id,
            unit_id=config.unit_id,
            max_num_batched_tokens=config.max_num_batched_tokens,
            kv_capacity_tokens=capacity,
            block_size=max(0, server.block_size),
            max_model_len=max(0, model.max_context_length),
            labels=labels,
        )

    async def _health_reason(self) -> str:
        """Empty when the engine answers ``HealthCheck`` healthy, else why not."""
        from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2

        try:
            reply = await self._stub.HealthCheck(
                vllm_pb2.HealthCheckRequest(), timeout=self.config.probe_timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                return f"engine HealthCheck unanswered for {self.config.probe_timeout_s:g} s"
            return f"engine HealthCheck failed: {exc.code().name}"
        if not reply.healthy:
            return f"engine unhealthy: {reply.message[:120]}"
        return ""

    async def poll_once(self) -> cms_pb2.InstanceStatus:
        """Probe the engine once and publish its status (unschedulable with the reason when it fails)."""
        from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb2

        now_ms = int(time.time() * 1000)
        timeout = self.config.probe_timeout_s
        started = time.monotonic()
        healthy = self.last_status is not None and self.last_status.schedulable
        probe = not healthy or started - self._health_at >= self.config.health_interval_s
        reason = ""
        loads: Any = None
        server: Any = None
        calls: list[Any] = [self._stub.GetLoads(vllm_pb2.GetLoadsRequest(), timeout=timeout)]
        if probe:
            self._health_at = started
            calls.append(self._stub.GetServerInfo(vllm_pb2.GetServerInfoRequest(), timeout=timeout))
        results = await asyncio.gather(
            *calls, self._health_reason() if probe else _no_reason(), return_exceptions=True
        )
        reason = results[-1] if isinstance(results[-1], str) else "engine HealthCheck failed"
        if not reason:
            for result in results[:-1]:
                if isinstance(result, grpc.aio.AioRpcError):
                    reason = f"engine GetLoads/GetServerInfo failed: {result.code().name}"
                    break
                if isinstance(result, BaseException):
                    raise result
            else:
                loads = results[0]
                server = results[1] if probe else None
                if server is not None and server.is_paused:
                    reason = "engine paused"
        if reason:
            loads = None
        if loads is None:
            loads = vllm_pb2.GetLoadsResponse()
        key = (
            reason,
            tuple(
                (x.num_running_reqs, x.num_waiting_reqs, x.num_waiting_uncached_tokens, x.token_usage)
                for x in loads.loads
            ),
        )
        sample = None
        if self._steps is not None and not reason:
            sample = self._steps.observe(
                time.monotonic(),
                sum(max(0, x.num_running_reqs) for x in loads.loads),
                sum(round(min(1.0, max(0.0, x.token_usage)) * self.kv_capacity_tokens) for x in loads.loads),
                sum(max(0.0, x.gen_throughput) for x in loads.loads),
            )
        if key != self._last_key or sample is not None:
            # A real change (or a new step sample): a newer update id (else the writer heartbeats).
            self._last_key = key
            self._update_id += 1
        status = status_from_loads(
            self.config.instance_id,
            loads,
            self.kv_capacity_tokens,
            update_id=self._update_id,
            now_ms=now_ms,
            unschedulable_reason=reason,
            step_sample=sample,
            block_size=self.block_size,
        )
        if reason and (self.last_status is None or self.last_status.schedulable):
            logger.warning("agent %s: engine unschedulable: %s", self.config.instance_id, reason)
        elif not reason and self.last_status is not None and not self.last_status.schedulable:
            logger.info("agent %s: engine schedulable again", self.config.instance_id)
        self.last_status = status
        if self._writer is not None:
            self._writer.publish(status)
        return status

    async def run(self, stop: asyncio.Event) -> None:
        """Wait for the engine, register, poll until ``stop`` is set, deregister."""
        from cms.agent import AgentWriter

        if not await self.wait_for_engine(stop):
            await self.close()
            return
        metadata = await self.metadata()
        self._writer = AgentWriter(
            self.config.cms,
            metadata,
            auth_token=self._auth_token,
            heartbeat_interval_s=self.config.heartbeat_interval_s,
            tls=self._cms_tls,
        )
        await self.poll_once()  # the first status goes with the registration
        await self._writer.start()
        logger.info(
            "agent %s: registered vLLM engine %s (%s, KV %d tokens) with %s",
            self.config.instance_id,
            metadata.endpoint,
            metadata.model,
            metadata.kv_capacity_tokens,
            self.config.cms,
        )
        try:
            while not stop.is_set():
                started = time.monotonic()
                await self.poll_once()
                delay = self.config.poll_interval_s - (time.monotonic() - started)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), max(0.0, delay))
        finally:
            await self.close()

    async def close(self) -> None:
        """Deregister (best effort) and close the engine channel. Idempotent."""
        writer, self._writer = self._writer, None
        if writer is not None:
            await writer.stop()
        await self._channel.close(None)


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "agent",
        help="register an unmodified vLLM gRPC engine (vllm serve --grpc) with the CMS and report its load",
        description=(
            "Runs beside `vllm serve MODEL --grpc` (or python -m vllm.entrypoints.launchers.grpc_server): "
            "registers the engine with worker protocol vllm-grpc, reports its load from GetLoads every "
            "--poll-interval-s, marks it unschedulable when HealthCheck fails or the engine pauses, and "
            "deregisters it on exit."
        ),
    )
    parser.add_argument(
        "--engine", required=True, help="the engine's gRPC HOST:PORT (grpc://HOST:PORT works too)"
    )
    parser.add_argument("--cms", required=True, help="CMS address (HOST:PORT or grpc://HOST:PORT)")
    parser.add_argument("--instance-id", required=True, help="the instance id to register")
    parser.add_argument(
        "--role", choices=tuple(_ROLES), default="neutral", help="stage (default: %(default)s)"
    )
    parser.add_argument(
        "--advertise", default="", help="HOST:PORT routers dial for this engine (default: --engine)"
    )
    parser.add_argument("--node-id", default="", help="failure domain: host id")
    parser.add_argument("--unit-id", default="", help="failure domain: unit id")
    parser.add_argument("--model", default="", help="model name to register (default: the engine's)")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=0,
        help="the engine's chunked-prefill budget per step, which vLLM's gRPC service does not report "
        "(default: 0 = the router's default)",
    )
    parser.add_argument(
        "--poll-interval-s", type=float, default=0.1, help="status poll interval (default: %(default)s)"
    )
    parser.add_argument(
        "--health-interval-s",
        type=float,
        default=1.0,
        help="ask the engine's HealthCheck and GetServerInfo (paused?) at most this often while it is "
        "healthy; GetLoads goes every --poll-interval-s and a failed or unanswered one makes the engine "
        "unschedulable at once (default: %(default)s)",
    )
    parser.add_argument(
        "--probe-timeout-s",
        type=float,
        default=1.0,
        help="an engine RPC unanswered this long makes the engine unschedulable (default: %(default)s)",
    )
    parser.add_argument(
        "--heartbeat-interval-s",
        type=float,
        default=0.5,
        help="CMS heartbeat interval (default: %(default)s)",
    )
    parser.add_argument(
        "--engine-wait-s",
        type=float,
        default=300.0,
        help="how long to wait for the engine to become healthy at start (default: %(default)s)",
    )
    parser.add_argument(
        "--step-estimate",
        choices=("on", "off"),
        default="on",
        help="on: each status carries a decode-step sample estimated from GetLoads' generation "
        "throughput and the running requests, so the router's online calibration corrects the "
        "profile for this engine; off: no samples (the profile as is) (default: %(default)s)",
    )
    parser.add_argument("--cms-auth-token-file", default=None, help="file holding the CMS token")
    parser.add_argument("--tls-ca", default=None, help="CA bundle (PEM): reach the CMS over TLS")
    parser.set_defaults(func=run_agent)


def run_agent(args: argparse.Namespace) -> int:
    from cms.auth import read_client_token
    from cms.transport import client_tls_from_arg
    from workers.cli import run_async

    config = AgentConfig(
        engine=strip_scheme(args.engine),
        cms=strip_scheme(args.cms),
        instance_id=args.instance_id,
        role=args.role,
        advertise=strip_scheme(args.advertise),
        node_id=args.node_id,
        unit_id=args.unit_id,
        model=args.model,
        max_num_batched_tokens=args.max_num_batched_tokens,
        poll_interval_s=args.poll_interval_s,
        health_interval_s=args.health_interval_s,
        probe_timeout_s=args.probe_timeout_s,
        heartbeat_interval_s=args.heartbeat_interval_s,
        engine_wait_s=args.engine_wait_s,
        step_estimate=args.step_estimate == "on",
    )
    try:
        config.check()
        token = read_client_token(Path(args.cms_auth_token_file)) if args.cms_auth_token_file else None
        tls = client_tls_from_arg(args.tls_ca)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return run_async(_main(config, token, tls))


async def _main(config: AgentConfig, token: str | None, tls: ClientTls | None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    agent = StockEngineAgent(config, auth_token=token, cms_tls=tls)
    print(f"agent {config.instance_id} watching vLLM engine {config.engine}", flush=True)
    try:
        await agent.run(stop)
    except TimeoutError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
