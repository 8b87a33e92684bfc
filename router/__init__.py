"""The SLO-aware router: the Router gRPC service around the scheduling core, and the CLI.

:mod:`router.core` is the decision core (pure, no I/O). Around it, the shell:
:mod:`router.placement` (the live view and the in-flight account feeding the
scheduler), :mod:`router.admission` (requests waiting in the router queue,
released on view pushes, completions, cancels and timers), :mod:`router.route`,
:mod:`router.service` (the Router servicer:
validation, forwarding, retries, cancel), :mod:`router.forward` and
:mod:`router.pool` (worker calls over pooled channels), :mod:`router.telemetry`
(Prometheus), :mod:`router.tokenize`, :mod:`router.http_edge` (the OpenAI-compatible HTTP
edge over the same service, with :mod:`router.chat_template`), :mod:`router.server` (``slo-router
router``), :mod:`router.up` (``slo-router up``, the embedded cluster) and
:mod:`router.cli` (the ``slo-router`` entry point).

The shell may import :mod:`router.core`, :mod:`openai_http`, :mod:`cms` (readers, and the CMS
server for ``up``), :mod:`workers` (for ``up``), :mod:`predictor`, :mod:`fleet`
and the generated protobuf modules.
"""
