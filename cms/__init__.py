"""Cluster metadata service: data model, stores, gRPC service and clients.

- ``model``: the immutable snapshot routers read (the contract with ``router/``).
- ``store``: the store interface and its rules; ``memory`` and ``redis_store`` implement it.
- ``validation``: input bounds; ``errors``: the exception tree and its gRPC codes.
- ``server``: the ClusterMetadata service (``start_cms_server``); ``view``: the watch pump.
- ``agent``: ``AgentWriter``, the worker side; ``reader``: ``open_reader``, the router side.
- ``cli``: ``slo-router cms``; ``testing``: a throwaway redis-server for tests and benchmarks.
"""
