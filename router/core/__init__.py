"""The scheduling core: a pure function of (cluster view, request, now, rng) -> decision.

Everything a placement decision needs and nothing that does I/O: the request
(:mod:`.request`), the columnar view (:mod:`.columns`, built by :mod:`.view`),
the in-flight account (:mod:`.inflight`), the plugin interface (:mod:`.plugins`)
and the plugins registered by name (:mod:`.registry`: :mod:`.metrics`,
:mod:`.filters`, :mod:`.selectors`, :mod:`.policies`, :mod:`.adaptive_pd`,
:mod:`.packing`: KV and TPOT over a request's life, the safety valve), the
chain that runs them (:mod:`.chain`), the scheduler that ties them together
(:mod:`.scheduler`), its config (:mod:`.config`), the router queue's ordering,
shedding and release control (:mod:`.queue`), the simulated-annealing
release batches of its ``sa`` policy (:mod:`.sa`), per-group predictors
(:mod:`.predictors`), the capacity model (:mod:`.capacity`) and the error tree
(:mod:`.errors`). The same code runs in
the gRPC router and in the virtual-time simulator (:mod:`sim`).

May import: the standard library (no asyncio, sockets, threads or processes),
numpy, yaml (policy files, read when a policy is built, never during a
decision), :mod:`predictor`, :mod:`fleet` and the protobuf message modules.
Never grpc, redis, prometheus, :mod:`cms`, :mod:`workers` or the router shell
around it; ``tests/layout`` enforces this.
"""
