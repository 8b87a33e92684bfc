"""Which protocol a worker endpoint speaks, carried in the endpoint string the core hands out.

An instance registers the protocol it speaks (``InstanceMetadata.worker_protocol``): this
project's ``Worker`` service, or vLLM's own gRPC service (``vllm-grpc``, an unmodified
``vllm serve --grpc`` behind ``slo-router agent``). The core never looks at the protocol; it
only keeps the two kinds of endpoint apart, so the endpoint of a vLLM instance is written
``vllm-grpc://host:port`` in the view and in every placement. The forwarding layer reads the
scheme back (:func:`split_endpoint`) to pick the client that speaks it. A ``Worker`` endpoint
stays a bare ``host:port``, exactly as before.
"""

from __future__ import annotations

#: ``InstanceMetadata.worker_protocol`` of this project's Worker service ("" means the same).
WORKER = "worker"
#: ``InstanceMetadata.worker_protocol`` of vLLM's gRPC service (``vllm.grpc.engine.VllmEngine``).
VLLM_GRPC = "vllm-grpc"
VLLM_GRPC_SCHEME = VLLM_GRPC + "://"


def dial_endpoint(endpoint: str, protocol: str) -> str:
    """The endpoint as the router dials it: ``vllm-grpc://host:port`` for vLLM, ``host:port`` otherwise."""
    if protocol == VLLM_GRPC:
        return VLLM_GRPC_SCHEME + endpoint
    return endpoint


def split_endpoint(endpoint: str) -> tuple[str, str]:
    """(protocol, ``host:port``) of a dialed endpoint (:func:`dial_endpoint`'s inverse)."""
    if endpoint.startswith(VLLM_GRPC_SCHEME):
        return VLLM_GRPC, endpoint[len(VLLM_GRPC_SCHEME) :]
    return WORKER, endpoint
