"""The security fault tests' fleet (authenticated, real processes on loopback), one per test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.faults.secure_fleet import Fleet, running_fleet
from tests.faults.up_cluster import UpCluster, up_cluster, wait_serving


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with running_fleet(tmp_path_factory.mktemp("fleet")) as running:
        yield running
        assert running.alive(), "a process of the fleet died during the tests"


@pytest.fixture(scope="session")
def shared_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpCluster]:
    """One ``up`` (default flags, 1 prefill + 1 decode) shared by the tests that need nothing else."""
    with up_cluster(tmp_path_factory.mktemp("shared-up")) as cluster:
        wait_serving(cluster.router)
        yield cluster
        assert cluster.popen.poll() is None, "the shared up died during the tests"
