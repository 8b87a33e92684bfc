"""The request sequence of a run: the one function ``slo-router bench`` and ``slo-router simulate`` call.

A run's requests come from a workload spec (a preset, a class mix or a file) or
from a trace, a seed, a request count and, optionally, an arrival rate that
overrides the source's own. Both commands turn those into the list of
:class:`~workload.spec.RequestPlan` they replay through :func:`request_sequence`,
and shape the arrival process from their flags through :func:`shape_arrivals`,
so the same workload, seed, count and rate give the same requests, in the same
order, at the same planned times, with the same prompts, caps, answer lengths
and prefix blocks, whether a live router or the simulator serves them
(``tests/workload/test_parity.py`` checks it through both command lines).

What the two commands still do differently with a plan is the replay, not the
plan: ``bench`` sends a class with ``ignore_eos`` its answer's length as
``max_tokens`` (a live engine can only be told where to stop that way), while
the simulator's router sees the plan's cap and the engine stops at the length
(see ``docs/real-traces.md``).
"""

from __future__ import annotations

import dataclasses

from workload.spec import ArrivalProcess, RequestPlan, WorkloadError, WorkloadSpec, generate_requests
from workload.traces import Trace


def shape_arrivals(
    spec: WorkloadSpec,
    *,
    rate: float | None = None,
    burstiness: float | None = None,
    concurrency: int | None = None,
    open_loop: bool = False,
) -> WorkloadSpec:
    """``spec`` with the arrival flags applied (``--rate``, ``--burstiness``, ``--concurrency``).

    ``rate`` sets the mean arrivals per second (a closed loop becomes Poisson at that rate);
    ``burstiness`` makes the gaps gamma with that shape (1: Poisson); ``concurrency`` makes a
    closed loop of that many clients. ``open_loop``: a closed-loop workload becomes Poisson at its
    rate (the simulator replays open-loop arrivals only).
    """
    arrival = spec.arrival
    if concurrency is not None:
        if burstiness is not None:
            raise WorkloadError(
                "--burstiness shapes open-loop arrivals; it cannot be used with --concurrency"
            )
        if open_loop:
            raise WorkloadError("--concurrency is a closed loop; this command replays open-loop arrivals")
        arrival = dataclasses.replace(arrival, process=ArrivalProcess.CLOSED, concurrency=concurrency)
        return dataclasses.replace(spec, arrival=arrival)
    if rate is not None:
        arrival = dataclasses.replace(arrival, rate_per_s=rate)
    if arrival.process is ArrivalProcess.CLOSED and (rate is not None or open_loop):
        arrival = dataclasses.replace(arrival, process=ArrivalProcess.POISSON, burstiness=1.0)
    if burstiness is not None:
        process = ArrivalProcess.POISSON if burstiness == 1.0 else ArrivalProcess.GAMMA
        arrival = dataclasses.replace(arrival, process=process, burstiness=burstiness)
    return dataclasses.replace(spec, arrival=arrival)


def request_sequence(
    source: WorkloadSpec | Trace,
    *,
    seed: int,
    num_requests: int | None,
    rate: float | None = None,
    duration_s: float | None = None,
) -> list[RequestPlan]:
    """The requests of one run, in arrival order: pure and deterministic (no clock, no sockets).

    - A workload spec: drawn with ``seed`` (:func:`workload.spec.generate_requests`), at
      ``rate`` arrivals per second when given (else the spec's own), at most ``num_requests``
      of them and only those arriving before ``duration_s`` (at least one bound is needed).
    - A trace: its first ``num_requests`` records (all: None) on the trace's own clock at its
      ``--trace-speed``, or rescaled to ``rate``; those arriving before ``duration_s``. The
      seed plays no part: a trace's prompts are seeded by its own lines.
    """
    if isinstance(source, Trace):
        plans = source.plans(num_requests, rate=rate)
        if duration_s is not None:
            plans = [p for p in plans if p.arrival_s < duration_s]
        return plans
    spec = source if rate is None else shape_arrivals(source, rate=rate)
    return generate_requests(spec, rng=seed, num_requests=num_requests, duration_s=duration_s)
