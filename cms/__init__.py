"""Cluster metadata service: data model, stores, gRPC service and clients."""
