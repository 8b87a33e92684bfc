"""The SLO-aware router: scheduling core, Router gRPC service and the ``slo-router`` CLI."""
