"""``slo-router simulate`` with the calibrated interleave carried forward, or scaled by an oracle.

    .venv/bin/python scripts/prefix_interleave_eval.py --recent 4 -- simulate --neutral 4 \
        --workload ph48.yaml --rates 8 --num-requests 330 --policies slo --prefix-cache-routing exact \
        --true-noise 0.1 --seed 0

``--recent N`` (and ``--max-ratio R``) set ``CalibrationConfig.interleave_recent_dispatches`` (and
``interleave_max_ratio``), which have no CLI flag: the interleave times
:func:`router.core.calibration.uncached_ratio`. ``--oracle H,W`` instead runs the simulation twice:
the first pass records the fleet's computed share of the dispatched prompt tokens per second of
virtual time (unscaled), the second multiplies every instance's interleave, at each update, by that
share over the next H s over the share over the last W s, clipped to [1/2, 2]: foresight of the
cache's warm-up no router has, to see what following it would give. The workload is seeded, so the
second pass meets the same arrivals (its placements may differ). A diagnosis aid for
docs/prefix-cache.md ("The interleave carried forward to the coming prefill"); figures only.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from typing import Any

import router.core.calibration as calibration
import router.core.scheduler as scheduler
from router.cli import main


def _configure(recent: float, max_ratio: float) -> None:
    make = calibration.CalibrationConfig

    def config(*args: Any, **kwargs: Any) -> calibration.CalibrationConfig:
        kwargs = {**kwargs, "interleave_recent_dispatches": recent, "interleave_max_ratio": max_ratio}
        return make(*args, **kwargs)

    setattr(scheduler, "CalibrationConfig", config)  # noqa: B010


def _oracle(ahead_s: float, behind_s: float, args: list[str]) -> int:
    #: second of virtual time -> [prompt tokens, computed tokens] dispatched in it
    shares: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    recording = [True]
    dispatched = calibration.Calibrator.dispatched
    update = calibration.Calibrator._update

    def record(self: Any, instance_id: str, prompt: int, cached: int, now_s: float) -> None:
        if recording[0]:
            cell = shares[int(now_s)]
            cell[0] += prompt
            cell[1] += prompt - min(cached, prompt)
        dispatched(self, instance_id, prompt, cached, now_s)

    def share(start_s: float, end_s: float) -> float | None:
        cells = [shares[k] for k in range(int(start_s), int(end_s) + 1) if k in shares]
        prompt = sum(c[0] for c in cells)
        return sum(c[1] for c in cells) / prompt if prompt > 0 else None

    def scaled(self: Any, track: Any, group: str, now_s: float, ring: Any = None) -> None:
        update(self, track, group, now_s, ring)
        if not recording[0] and track.interleave_ms > 0:
            coming, past = share(now_s, now_s + ahead_s), share(max(0.0, now_s - behind_s), now_s)
            if coming is not None and past:
                track.interleave_ms *= min(max(coming / past, 0.5), 2.0)

    setattr(calibration.Calibrator, "dispatched", record)  # noqa: B010
    setattr(calibration.Calibrator, "_update", scaled)  # noqa: B010
    # Both passes read the dispatches; neither scales by them (the ratio is 1).
    setattr(calibration, "uncached_ratio", lambda *a, **k: 1.0)  # noqa: B010
    _configure(1.0, 2.0)
    sys.argv = ["slo-router", *args]
    print("first pass: recording the fleet's computed share per second", flush=True)
    main()
    recording[0] = False
    print(
        f"second pass: the interleave x share over the next {ahead_s} s / the last {behind_s} s", flush=True
    )
    sys.argv = ["slo-router", *args]
    return main()


def run() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recent", type=float, default=4.0, help="interleave_recent_dispatches (0: off)")
    parser.add_argument("--max-ratio", type=float, default=2.0, help="interleave_max_ratio")
    parser.add_argument(
        "--oracle", default="", help="H,W: scale by the fleet's share over the next H s / last W s"
    )
    parser.add_argument(
        "args", nargs=argparse.REMAINDER, help="-- then slo-router's arguments (simulate ...)"
    )
    ns = parser.parse_args()
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    if ns.oracle:
        ahead, behind = (float(v) for v in ns.oracle.split(","))
        return _oracle(ahead, behind, args)
    _configure(ns.recent, ns.max_ratio)
    sys.argv = ["slo-router", *args]
    return main()


if __name__ == "__main__":
    sys.exit(run())
