"""The security fault tests' fleet (authenticated, real processes on loopback), one per test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.faults.secure_fleet import Fleet, running_fleet


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with running_fleet(tmp_path_factory.mktemp("fleet")) as running:
        yield running
        assert running.alive(), "a process of the fleet died during the tests"
