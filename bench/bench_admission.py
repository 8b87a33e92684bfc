"""The router's CPU per placement decision: ``Admission.place`` as ``slo-router router`` builds it.

Where the router spends a request's CPU between the gRPC server handing it over and the call
to the engine is mostly the decision: the waiting dispatcher's arrival check, the router
queue's pass (its load watch, release limit and offer), the scheduler's filters and selector,
and recording the dispatch. On a burst that the event loop takes in one request at a time, the
last request reaches the engine after the decisions of all before it, so this cost is the
TTFT a burst's tail pays (``python -m bench.vllm_stock_trace``).

The driver, placer, scheduler and queue are built from the router's own flags
(:func:`router.server.plan_from_args`, the flags of the stock-vLLM benches: ``load-balance``,
the default ``edf`` queue) over a view of stock vLLM engines (``vllm-grpc://`` endpoints,
statuses shaped as ``slo-router agent`` reports them). Two shapes of arrival:

- *lone*: a new status arrived since the last request (a new snapshot) and the last request's
  timed prefill moved the calibration (as on a stock engine), one request placed, then released:
  what a request alone pays (the per-view and per-calibration builds are its own);
- *burst of B*: one snapshot, B requests placed one after another (each recorded before the
  next is decided, as the router does), then released.

Timed: the event loop thread's CPU time (``thread_time``) of each ``place`` (nothing else runs
on the thread meanwhile), which moves much less with the host's load than the wall clock.
Medians and 90th percentiles in µs over the rounds. Figures only, no assertions.

    .venv/bin/python -m bench.bench_admission
    .venv/bin/python -m bench.bench_admission --instances 4 --router-args "--queue-policy none"
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import shlex
import statistics
import sys
import time
from collections.abc import Callable

from slorouter.v1 import cms_pb2

from bench.figures import Figure, print_load_average
from fleet.snapshot import ClusterSnapshot, InstanceRecord
from router.admission import Admission, make_admission
from router.core.calibration import StepSample
from router.core.dispatch import DispatchSetup, make_dispatcher
from router.core.health import OutlierDetector
from router.core.rng import PeekableRandom
from router.placement import PlacementRequest, Placer
from router.telemetry import RequestObserver

#: The stock-vLLM benches' router flags, less the addresses and the tokenizer (not used here).
ROUTER_ARGS = ["router", "--cms", "grpc://127.0.0.1:1", "--scheduling-policy", "load-balance"]
PROMPT_TOKENS = 64
MAX_TOKENS = 128
KV_CAPACITY = 60_000


class _Views:
    """The snapshot source: a new snapshot per :meth:`advance` (a status arrived), on the monotonic clock."""

    def __init__(self, instances: int) -> None:
        self.instances = instances
        self.update = 0
        self.version = 0
        self._listeners: list[Callable[[ClusterSnapshot], None]] = []
        self._snapshot = self._make()

    def add_snapshot_listener(self, listener: Callable[[ClusterSnapshot], None]) -> None:
        """As the CMS reader: ``listener`` hears every new snapshot (the placer's calibration does)."""
        self._listeners.append(listener)

    def _make(self) -> ClusterSnapshot:
        records = []
        for i in range(self.instances):
            metadata = cms_pb2.InstanceMetadata(
                instance_id=f"v{i}",
                endpoint=f"vllm-grpc://127.0.0.1:{50051 + i}",
                role=cms_pb2.INSTANCE_ROLE_NEUTRAL,
                model="tiny",
                max_model_len=1024,
                max_num_batched_tokens=2048,
                kv_capacity_tokens=KV_CAPACITY,
                node_id=f"node-{i}",
            )
            status = cms_pb2.InstanceStatus(
                instance_id=metadata.instance_id,
                update_id=self.update,
                timestamp_ms=int(time.time() * 1000),
                schedulable=True,
            )
            records.append(InstanceRecord(metadata=metadata, status=status, status_age_s=0.005))
        self.version += 1
        return ClusterSnapshot(instances=tuple(records), taken_at_s=time.monotonic(), version=self.version)

    def advance(self) -> None:
        self.update += 1
        self._snapshot = self._make()
        for listener in self._listeners:
            listener(self._snapshot)

    def snapshot(self) -> ClusterSnapshot:
        return self._snapshot


def build(instances: int, extra: list[str], incremental: str = "on") -> tuple[Admission, _Views]:
    """The router's driver over ``instances`` stock engines, from its own flags (plus ``extra``);
    ``incremental`` is the queue's incremental dispatch (``DispatchSetup.incremental``)."""
    from router.cli import build_parser
    from router.core.scheduler import Scheduler
    from router.server import plan_from_args

    args = build_parser().parse_args([*ROUTER_ARGS, *extra])
    plan = plan_from_args(args)
    scheduler = Scheduler(plan.config, plan.predictors, PeekableRandom(args.seed))
    views = _Views(instances)
    observer = RequestObserver()
    placer = Placer(scheduler, views, observer=observer, health=OutlierDetector(plan.outlier))
    if incremental == "on":
        admission = make_admission(
            placer,
            plan.queue,
            plan.qlm,
            observer=observer,
            slicing=plan.slice_config,
            dispatch_mode=plan.dispatch_mode,
        )
    else:
        config = plan.config
        setup = DispatchSetup(
            plan.queue, config.ttft_slo_ms, config.tpot_slo_ms, plan.qlm, incremental=incremental
        )
        admission = Admission(
            placer, plan.queue, plan.qlm, observer=observer, dispatcher=make_dispatcher(setup)
        )
    return admission, views


def _request(i: int) -> PlacementRequest:
    prompt = [4 + (i * 7919 + j * 104729) % 996 for j in range(PROMPT_TOKENS)]
    return PlacementRequest(
        f"bench-{i}",
        prompt,
        "tiny",
        ttft_slo_ms=0.0,
        tpot_slo_ms=0.0,
        max_tokens=MAX_TOKENS,
        arrival_s=time.monotonic(),
    )


async def _measure(admission: Admission, views: _Views, burst: int, rounds: int, start: int) -> list[float]:
    """µs of thread CPU per ``place`` over ``rounds`` bursts of ``burst`` requests (a new view before each)."""
    config = admission.placer.scheduler.config
    samples: list[float] = []
    index = start
    calibration = admission.placer.calibration
    for _ in range(rounds):
        views.advance()
        if calibration is not None:
            # The last burst's timed prefill (``Placer.prefill_timed``, taken on every request to an
            # idle stock engine) moved the calibration, as it does between two lone requests.
            sample = StepSample(PROMPT_TOKENS, 1, 200, 6.0 + 0.01 * (index % 7))
            calibration.observe("v0", "", (sample,), time.monotonic())
        placed = []
        for _ in range(burst):
            req = _request(index)
            index += 1
            req = PlacementRequest(
                req.request_id,
                req.prompt_token_ids,
                req.model,
                config.ttft_slo_ms,
                config.tpot_slo_ms,
                max_tokens=req.max_tokens,
                arrival_s=req.arrival_s,
            )
            before = time.thread_time_ns()
            await admission.place(req)
            samples.append((time.thread_time_ns() - before) / 1e3)
            placed.append(req)
            await asyncio.sleep(0)  # one loop pass per request, as the gRPC server takes them in
        for req in placed:
            admission.release(req.request_id, MAX_TOKENS)
        await asyncio.sleep(0)
    return samples


def _summary(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


async def _run(
    instances: int, extra: list[str], rounds: int, bursts: list[int], incremental: str
) -> dict[int, tuple[float, float]]:
    admission, views = build(instances, extra, incremental)
    await _measure(admission, views, 16, 10, 0)  # warm-up: caches, the length predictor's tables
    gc.collect()
    out = {}
    start = 10_000
    for burst in bursts:
        samples = await _measure(admission, views, burst, max(1, rounds // burst), start)
        start += 100_000
        out[burst] = _summary(samples)
    admission.close()
    return out


def main(argv: list[str] | None = None) -> list[Figure]:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bench_admission", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--instances", type=int, default=1, help="stock engines in the view (default: 1)")
    parser.add_argument("--requests", type=int, default=1200, help="requests per shape (default: 1200)")
    parser.add_argument("--bursts", default="1,16,64", help="burst sizes (default: %(default)s)")
    parser.add_argument("--router-args", default="", help='extra router flags, e.g. "--queue-policy none"')
    parser.add_argument(
        "--incremental",
        choices=("on", "exact", "off"),
        default="on",
        help="the router queue's incremental dispatch (the router's is on; off: no load watch)",
    )
    options = parser.parse_args(sys.argv[1:] if argv is None and __name__ == "__main__" else argv or [])
    if not 1 <= options.instances <= 4096:
        parser.error(f"--instances {options.instances}: must be within 1-4096")
    if not 16 <= options.requests <= 1_000_000:
        parser.error(f"--requests {options.requests}: must be within 16-1000000")
    try:
        bursts = [int(b) for b in options.bursts.split(",")]
    except ValueError:
        parser.error(f"--bursts {options.bursts!r}: expected integers separated by commas")
    if any(not 1 <= b <= 1024 for b in bursts):
        parser.error(f"--bursts {options.bursts!r}: each must be within 1-1024")
    print_load_average()
    # The bench's timed prefills are all alike: the calibration's drift notice says nothing here.
    logging.getLogger("router.placement").setLevel(logging.ERROR)
    extra = shlex.split(options.router_args)
    results = asyncio.run(_run(options.instances, extra, options.requests, bursts, options.incremental))
    flags = " ".join([*ROUTER_ARGS[3:], *extra])
    if options.incremental != "on":
        flags += f" (incremental dispatch {options.incremental})"
    print(
        f"Admission.place, thread CPU per request (µs), {options.instances} stock engine(s), router flags: {flags}"
    )
    print(f"{'shape':>12} | {'median':>7} | {'p90':>7}")
    figures = []
    for burst, (median, p90) in results.items():
        shape = "lone" if burst == 1 else f"burst of {burst}"
        print(f"{shape:>12} | {median:7.0f} | {p90:7.0f}")
        figures.append(
            Figure(
                f"router decision CPU per request, {shape} (`Admission.place`, µs)",
                f"{median:.0f} (p90 {p90:.0f})",
            )
        )
    return figures


if __name__ == "__main__":
    main()
