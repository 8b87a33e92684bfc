"""The load generator and the speed benchmarks.

- :mod:`bench.workload`: workload specs (classes, length distributions, arrival
  processes) shared by the load generator and the simulator; :mod:`bench.report`:
  per-request results and their summary (attainment, goodput, latencies).
- :mod:`bench.loadgen` and :mod:`bench.cli`: ``slo-router bench``, which drives a
  running router over its public gRPC API.
- ``bench_*`` and :mod:`bench.__main__`: ``make bench``, the figures that
  measure speed (they print; nothing asserts a time).

May import everything else in the project (it measures it); only
:mod:`bench.workload` and :mod:`bench.report` are imported back, by :mod:`sim`.
"""
