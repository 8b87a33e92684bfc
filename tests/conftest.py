"""Fixtures shared by every test package.

``redis_server``: a real ``redis-server`` on a free loopback port in a temp
dir, one per test. The value *is* its URL (``redis://127.0.0.1:PORT/0``, a
``str``), and it also has ``.port``, ``.url``, ``.stop()``, ``.start()`` and
``.restart()`` (same port, comes back empty) for fault tests. Tests that use
it are marked ``redis`` automatically and skipped when no ``redis-server`` is
installed (``make test`` installs one).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import tests  # noqa: F401  (before anything that loads numpy: it pins numpy's and BLAS's numeric paths)
from cms.testing import RedisServer, find_redis_server


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "redis_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.redis)


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    binary = find_redis_server()
    if binary is None:
        pytest.skip("redis-server is not installed; run scripts/ensure_system_deps.sh")
    workdir: Path = tmp_path_factory.mktemp("redis")
    last_error: Exception | None = None
    for _ in range(3):  # a free port can be taken between probing it and binding it
        server = RedisServer(workdir, binary=binary)
        try:
            server.start()
        except RuntimeError as exc:
            last_error = exc
            continue
        try:
            yield server
        finally:
            server.stop()
        return
    raise RuntimeError(f"could not start redis-server: {last_error}")
