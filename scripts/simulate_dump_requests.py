"""Run ``slo-router simulate ARGS`` and write every request's result (its repr, one a line) to $DUMP.

Two runs of different code on the same seed compare request by request with ``cmp``: the
placements, the predictions and the latencies of each request, not only the summary table.

    DUMP=/tmp/before.txt .venv/bin/python scripts/simulate_dump_requests.py simulate --workload ...
"""

from __future__ import annotations

import os
import sys
from typing import Any

import sim.cluster
import sim.sweep
from router.cli import main

_simulate = sim.cluster.simulate


def _dumping(*args: Any, **kwargs: Any) -> sim.cluster.SimOutcome:
    outcome = _simulate(*args, **kwargs)
    with open(os.environ["DUMP"], "a", encoding="utf-8") as out:
        for result in outcome.results:
            out.write(repr(result) + "\n")
    return outcome


if __name__ == "__main__":
    setattr(sim.sweep, "simulate", _dumping)  # the name the sweep calls  # noqa: B010
    sys.argv[0] = "slo-router"
    sys.exit(main())
