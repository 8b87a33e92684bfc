"""Workers: the Worker gRPC service over an engine backend (sim or vLLM), and the status agent.

Every backend implements :mod:`engine.interface` (the Protocol and the value types
that cross it); :mod:`workers.sim_engine` runs the engine model
(:mod:`engine.model`) in real time, :mod:`workers.vllm_engine` drives vLLM's
AsyncLLM in-process. :mod:`workers.service` is the gRPC servicer,
:mod:`workers.http_face` its OpenAI-compatible HTTP face (over
:mod:`openai_http`), :mod:`workers.agent` the status agent that reports to the CMS through
:mod:`cms.agent`, :mod:`workers.profile` is ``slo-router profile``.

May import :mod:`engine`, :mod:`predictor`, :mod:`cms` (its agent writer and
server helpers), :mod:`openai_http`, :mod:`router.core`'s value modules and the generated
protobuf modules; never the router's shell, :mod:`sim` or :mod:`bench` (see ``docs/layers.md``).
"""
