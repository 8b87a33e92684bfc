"""The engine: the interface every backend implements, and the modelled engine.

Named ``engine`` for the one thing all of it describes. The worker serves an
engine, the simulator runs many, and the router counts prompt tokens the way
the modelled engine does, so the contract and the model sit below all three
instead of inside one of them (the layer order is in ``docs/layers.md``).

- :mod:`engine.interface`: the :class:`~engine.interface.Engine` protocol, its
  error tree and the frozen value types that cross it (sampling, token deltas,
  step records, load).
- :mod:`engine.model`: the clock-free engine model (continuous batching,
  chunked prefill, KV blocks with preemption, step times from a profile) that
  the sim worker runs in real time and the simulator in virtual time.
- :mod:`engine.tokenizer`: the built-in byte-level tokenizer (the sim engine's
  text, and the router's token count when no Hugging Face tokenizer is given).

Imports only :mod:`predictor`; never grpc, asyncio's servers, :mod:`cms`,
:mod:`workers`, :mod:`sim` or :mod:`router`.
"""
