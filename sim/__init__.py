"""The cluster simulator: the router's scheduling core in front of modelled engines, in virtual time.

- the engine model every simulated instance runs is :mod:`engine.model` (the
  sim worker, :mod:`workers.sim_engine`, runs the same core in real time).
- :mod:`sim.fastforward`: skips runs of identical decode steps in closed form.
- :mod:`sim.fleet`: fleet specs (``--fleet``, fleet files) and per-group engine settings.
- :mod:`sim.cluster`: the event loop that places requests with :mod:`router.core`.
- :mod:`sim.sweep`: policy x rate sweeps and their report; :mod:`sim.cli`: ``slo-router simulate``.
- :mod:`sim.plan`: ``slo-router plan``, the fewest instances meeting an attainment target.

May import :mod:`router.core`, :mod:`predictor`, :mod:`fleet`, :mod:`engine`
and :mod:`workload` (see ``docs/layers.md``). Never grpc, asyncio or :mod:`cms`:
nothing here opens a socket or sleeps.
"""
