"""The load generator and the speed benchmarks.

- :mod:`bench.loadgen` and :mod:`bench.cli`: ``slo-router bench``, which drives a
  running router over its public gRPC API.
- ``bench_*`` and :mod:`bench.__main__`: ``make bench``, the figures that
  measure speed (they print; nothing asserts a time).

Workload specs, trace replay and reports live in :mod:`workload` (shared with
the simulator). May import everything else in the project (it measures it);
nothing imports it back but its own entry points (``slo-router bench`` is
reached through the router CLI's table of subcommands).
"""
