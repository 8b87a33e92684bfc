"""Prediction error and attainment of the calibrated predictor against the calibrator's refit cadence.

The calibrator (:mod:`router.core.calibration`) recomputes a track's correction (medians, robust
refit) at most once per ``update_every_samples`` new samples and, optionally, once per
``update_every_s`` seconds. Sparser updates cost less CPU (the simulator's largest cost at
``refit``) but follow the hardware later. This script runs seeded simulations of several
workloads with each cadence and prints, per run: SLO attainment, the calibrated predictor's TTFT
and TPOT prediction error (:func:`workload.prediction.prediction_error`: median and p90 of
``|observed - predicted| / predicted`` over successful requests after a warm-up), the number of
calibration updates and the CPU seconds (process time) of the run.

Cadences (``--cadences``): ``every N``: every N samples per track (``update_every_s`` 0, the default
is ``every 4``); ``4 + T s``: every 4 samples and at most once per T seconds; ``off``: no calibration.

Workloads (``--workloads``, comma-separated):

- ``mixed-pd``: the bench's shape, 16 prefill + 16 decode instances on the bundled profile, the
  ``mixed`` preset at the bench's load per instance (profile = hardware: calibration corrects
  only the profile's own interpolation);
- ``azure``: the one-hour Azure conversation trace (its own timing) on 16 neutral instances;
- ``mismatch``: 16 neutral instances, 8 as profiled and 8 whose hardware differs (the other
  bundled profile's shape, 0.7x speed, 5 % noise, KV slowdown 0.3), the ``mixed`` preset near
  capacity: where calibration matters;
- ``quickstart``: the README's quick start (4 neutral instances, ``mixed`` at 9 requests/s, the
  ``edf`` router queue; ``--requests 600`` is the README's run);
- ``drift``: 8 neutral instances whose hardware runs 1.6x slower than the profile (noise 5 %),
  the ``interactive-batch`` preset: a uniform speed mismatch the factors must find.

    .venv/bin/python scripts/calibration_cadence.py [--requests N] [--workloads mixed-pd,azure,...]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from router.core import calibration as calibration_module
from router.core.calibration import CalibrationConfig
from router.core.config import SchedulerConfig
from router.core.queue import QueueConfig
from sim.cluster import SimFleet, simulate
from sim.fleet import FleetSpec, fleet_from_counts, parse_fleet_dict
from workload.prediction import prediction_error
from workload.report import summarize
from workload.sequence import request_sequence
from workload.spec import RequestPlan, generate_requests, load_workload
from workload.traces import load_trace

#: The Azure trace (``--trace``); the default is where the project's shared traces live.
TRACE = Path("/work/shared/traces/azure-conv-2023.csv")

#: The cadences compared: a name and the settings (None: calibration off, the reference floor).
CADENCES: dict[str, CalibrationConfig | None] = {
    "off": None,
    "every 4": CalibrationConfig(mode="refit", update_every_samples=4, update_every_s=0.0),
    "every 16": CalibrationConfig(mode="refit", update_every_samples=16, update_every_s=0.0),
    "every 64": CalibrationConfig(mode="refit", update_every_samples=64, update_every_s=0.0),
    "4 + 0.1 s": CalibrationConfig(mode="refit", update_every_samples=4, update_every_s=0.1),
    "4 + 0.25 s": CalibrationConfig(mode="refit", update_every_samples=4, update_every_s=0.25),
    "4 + 0.5 s": CalibrationConfig(mode="refit", update_every_samples=4, update_every_s=0.5),
    "4 + 1 s": CalibrationConfig(mode="refit", update_every_samples=4, update_every_s=1.0),
}


@dataclass(frozen=True)
class Scenario:
    fleet: FleetSpec
    plans: Callable[[int, int], list[RequestPlan]]
    queue: QueueConfig | None = None


def _mixed_pd() -> Scenario:
    rate = 400.0 * 16 / 128  # python -m bench simulator's load per instance pair
    spec = load_workload("mixed").with_arrival(rate_per_s=rate)
    return Scenario(
        fleet_from_counts(prefill=16, decode=16),
        lambda n, seed: generate_requests(spec, rng=seed, num_requests=n),
    )


def _azure(path: Path = TRACE) -> Scenario:
    trace = load_trace(f"trace:{path}")
    return Scenario(
        fleet_from_counts(neutral=16), lambda n, seed: request_sequence(trace, seed=seed, num_requests=n)
    )


def _mismatch() -> Scenario:
    fleet = parse_fleet_dict(
        {
            "groups": [
                {"role": "neutral", "count": 8, "profile": "qwen2.5-7b-2xv100-linear", "name": "as-profiled"},
                {
                    "role": "neutral",
                    "count": 8,
                    "profile": "qwen2.5-7b-2xv100-linear",
                    "true_profile": "qwen2.5-7b-2xv100-linear-x4",
                    "name": "other-hw",
                    "engine": {"speed_factor": 0.7, "noise": 0.05, "kv_slowdown": 0.3},
                },
            ]
        }
    )
    spec = load_workload("mixed").with_arrival(rate_per_s=26.0)
    return Scenario(fleet, lambda n, seed: generate_requests(spec, rng=seed + 1, num_requests=n))


def _drift() -> Scenario:
    fleet = parse_fleet_dict(
        {
            "groups": [
                {
                    "role": "neutral",
                    "count": 8,
                    "profile": "qwen2.5-7b-2xv100-linear",
                    "engine": {"speed_factor": 0.625, "noise": 0.05},
                }
            ]
        }
    )
    spec = load_workload("interactive-batch").with_arrival(rate_per_s=10.0)
    return Scenario(fleet, lambda n, seed: generate_requests(spec, rng=seed + 2, num_requests=n))


def _quickstart() -> Scenario:
    # The README's quick start: `slo-router simulate --neutral 4 --workload mixed --rates 9` (edf queue).
    spec = load_workload("mixed")
    return Scenario(
        fleet_from_counts(neutral=4),
        lambda n, seed: request_sequence(spec, seed=seed, num_requests=n, rate=9.0),
        QueueConfig(queue_policy="edf"),
    )


SCENARIOS: dict[str, Callable[[], Scenario]] = {
    "quickstart": _quickstart,
    "mixed-pd": _mixed_pd,
    "azure": _azure,
    "mismatch": _mismatch,
    "drift": _drift,
}


def _pct(value: float | None) -> str:
    return "    -" if value is None else f"{100.0 * value:5.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000, help="requests per run (a trace: its first N)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the plans and of the runs")
    parser.add_argument("--warmup", type=int, default=200, help="first requests left out of the error")
    parser.add_argument(
        "--workloads", default=",".join(SCENARIOS), help="comma-separated, of: " + ", ".join(SCENARIOS)
    )
    parser.add_argument(
        "--cadences", default=",".join(CADENCES), help="comma-separated, of: " + ", ".join(CADENCES)
    )
    parser.add_argument("--trace", type=Path, default=TRACE, help="the Azure conversation trace (CSV)")
    args = parser.parse_args()
    SCENARIOS["azure"] = lambda: _azure(args.trace)
    if not 1 <= args.requests <= 1_000_000 or not 0 <= args.warmup < args.requests:
        parser.error("--requests must be in [1, 1000000] and --warmup in [0, --requests)")
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    cadences = [c.strip() for c in args.cadences.split(",") if c.strip()]
    for name in names:
        if name not in SCENARIOS:
            parser.error(f"--workloads: unknown {name!r}")
    for name in cadences:
        if name not in CADENCES:
            parser.error(f"--cadences: unknown {name!r}")
    print("workload   cadence       attain%  TTFT err med/p90 %   TPOT err med/p90 %   updates   CPU s")
    for name in names:
        scenario = SCENARIOS[name]()
        plans = scenario.plans(args.requests, args.seed)
        for cadence in cadences:
            settings = CADENCES[cadence]
            mode = "off" if settings is None else settings.mode
            config = SchedulerConfig(scheduling_policy="slo", calibration=mode)
            updates = _count_updates()
            cpu = time.process_time()
            outcome = simulate(
                SimFleet(scenario.fleet),
                config,
                plans,
                seed=args.seed,
                calibration=settings,
                queue=scenario.queue,
            )
            cpu = time.process_time() - cpu
            report = summarize(outcome.results, outcome.duration_s)
            error = prediction_error(outcome.results, skip_first=args.warmup)
            ttft, tpot = error["ttft"], error["tpot"]
            print(
                f"{name:10} {cadence:12} {100 * report.overall.slo_attainment:7.1f}   "
                f"{_pct(ttft['median'])} / {_pct(ttft['p90'])}       {_pct(tpot['median'])} / {_pct(tpot['p90'])}"
                f"      {updates():7d}  {cpu:6.1f}",
                flush=True,
            )


def _count_updates() -> Callable[[], int]:
    """Count the calibrator's correction updates from now on (a wrapper around ``Calibrator._update``)."""
    cls = calibration_module.Calibrator
    original = cls.__dict__.get("_original_update") or cls._update
    cls._original_update = original  # type: ignore[attr-defined]
    count = [0]

    def counted(self: calibration_module.Calibrator, *a: object, **k: object) -> None:
        count[0] += 1
        original(self, *a, **k)  # type: ignore[arg-type]

    cls._update = counted  # type: ignore[method-assign]
    return lambda: count[0]


if __name__ == "__main__":
    main()
