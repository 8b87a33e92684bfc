"""CPU per view of the router's calibration feed (what `router.placement` does per new snapshot).

16 instances of one profile group, each reporting 4-8 engine steps per view, 2,000 views, mode
``refit`` (the default), a correction read after each view. Prints CPU seconds (process time),
which a loaded machine does not inflate the way it does wall time.

    .venv/bin/python scripts/calibration_feed_cpu.py [--update-every-s S]
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np

from router.core.calibration import CalibrationConfig, Calibrator, StepPredictor
from router.core.columns import FloatArray


def _predict(group: str) -> StepPredictor:
    def step(p: FloatArray, b: FloatArray, t: FloatArray) -> tuple[FloatArray, FloatArray]:
        return np.where(p > 0, 0.05 * p + 4.0, 0.0), np.where(b > 0, 10 + 0.5 * b + 0.001 * t, 0.0)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--update-every-s",
        type=float,
        default=0.0,
        help="the calibrator's update_every_s (views are 0.1 s apart; default: %(default)s, the router's)",
    )
    args = parser.parse_args()
    rng = random.Random(0)
    calibrator = Calibrator(CalibrationConfig(mode="refit", update_every_s=args.update_every_s), _predict)
    ids = [f"i{k}" for k in range(16)]
    views = []
    for _ in range(2000):
        batches = []
        for instance_id in ids:
            steps = []
            for _ in range(rng.randint(4, 8)):
                p = rng.choice([0, 0, 0, rng.randint(16, 2048)])
                b = rng.randint(1, 48)
                t = b * rng.randint(64, 2048)
                steps.append((p, b, t, (12 + 0.06 * p + 0.6 * b + 2e-5 * t) * rng.uniform(0.9, 1.1)))
            batches.append((instance_id, "g", np.array(steps, dtype=np.float64)))
        views.append(batches)
    start = time.process_time()
    for v, batches in enumerate(views):
        calibrator.observe_steps(batches, v * 0.1)
        calibrator.correction(ids, ["g"] * len(ids))
    cpu = time.process_time() - start
    print(
        f"{cpu / len(views) * 1e3:.3f} ms CPU per view (16 instances, 4-8 steps each); {cpu:.2f} s for {len(views)} views"
    )


if __name__ == "__main__":
    main()
