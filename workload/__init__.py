"""What a fleet is asked to serve, and how well it was served.

Named ``workload`` because that is what every module here describes: the
request stream a run replays and the verdict on it, independent of who replays
it. ``slo-router bench`` drives a live router with it, ``slo-router simulate``
replays it in virtual time, and ``make bench`` measures with it; all three read
the same specs and summarise with the same report, so the package sits below
them (see ``docs/layers.md``).

- :mod:`workload.spec`: workload specs (SLO classes, length distributions,
  arrival processes, prefixes) and :func:`workload.spec.generate_requests`,
  which turns a spec and a seed into the request plan.
- :mod:`workload.traces`: replaying a recorded trace (CSV/JSONL) as a plan.
- :mod:`workload.sequence`: the request sequence of a run, the one function
  ``bench`` and ``simulate`` both plan with (same workload and seed, same requests).
- :mod:`workload.report`: per-request results and their summary (attainment,
  goodput, latency percentiles), tables, JSON and plots.
- :mod:`workload.prediction`: how far the router's predicted latencies were
  from the measured ones, over a run's results.

Imports nothing of the project but the pure decision core's value types at
most: never ``sim``, ``bench``, ``workers`` or the router's shell, so any of
them may import it.
"""
