"""Cluster metadata service: stores, gRPC service and clients.

The snapshot routers read is :mod:`fleet.snapshot`, shared with the router's core.

- ``store``: the store interface and its rules; ``memory`` and ``redis_store`` implement it.
- ``validation``: input bounds; ``errors``: the exception tree and its gRPC codes.
- ``server``: the ClusterMetadata service (``start_cms_server``); ``view``: the watch pump.
- ``agent``: ``AgentWriter``, the worker side; ``reader``: ``open_reader``, the router side.
- ``cli``: ``slo-router cms``; ``testing``: a throwaway redis-server for tests and benchmarks.

May import :mod:`fleet` and the generated protobuf modules; nothing of the router or the workers.
"""
