"""What every gRPC server of the project does alike (CMS, router, workers).

A server never shares a busy port (no ``SO_REUSEPORT``: a second instance on
the same address must fail, not split the traffic), reports a bind failure as
``OSError``, and serves ``grpc.health.v1`` and server reflection next to its
own service.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection


async def bind_server(listen: str, options: Sequence[tuple[str, Any]] = ()) -> tuple[grpc.aio.Server, int]:
    """A new server bound to ``listen`` (``HOST:PORT``; port 0 picks one) and the port it got.

    Raises ``OSError`` when the address cannot be bound (the server is stopped first).
    """
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0), *options])
    try:
        port = server.add_insecure_port(listen)
    except RuntimeError as exc:
        await server.stop(None)
        raise OSError(f"cannot listen on {listen}: {exc}") from exc
    if port == 0:
        await server.stop(None)
        raise OSError(f"cannot listen on {listen}")
    return server, port


def add_health_and_reflection(server: grpc.aio.Server, service_name: str) -> Any:
    """Serve health checks and reflection for ``service_name``; returns the health servicer."""
    health_servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return health_servicer
