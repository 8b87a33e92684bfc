"""Data every process shares about the fleet: the immutable cluster snapshot.

:mod:`fleet.snapshot` is the contract between the CMS (whose stores and
readers build snapshots) and the router's scheduling core (which turns them
into columns). May import only the protobuf message modules (``slorouter.v1``).
"""
