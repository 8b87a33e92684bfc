"""The layout's contracts: the decision core does no I/O, and no two modules import each other."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.layout.imports import cycles, external_imports, project_graph

ROOT = Path(__file__).resolve().parents[2]

#: What the decision core (``router/core``) must never import: transports, event loops, stores,
#: the processes around it, and the router's own gRPC shell.
CORE_FORBIDDEN = (
    "grpc",
    "grpc_health",
    "grpc_reflection",
    "asyncio",
    "uvloop",
    "redis",
    "socket",
    "subprocess",
    "threading",
    "prometheus_client",
    "cms",
    "workers",
    "sim",
    "bench",
    "engine",  # the engine model is what the core predicts, never what it reads
    "workload",
    "router",  # the shell: service, server, placement, forward, pool, telemetry, ...
)
CORE_ALLOWED_PREFIXES = ("router.core",)


def forbidden_in_core(root: Path) -> list[str]:
    problems = []
    for module, names in external_imports(root, ["router/core"]).items():
        for name in sorted(names):
            if name.startswith(CORE_ALLOWED_PREFIXES) or name.startswith("slorouter.v1."):
                if name.endswith("_grpc"):
                    problems.append(f"{module} imports {name}")
                continue
            top = name.split(".")[0]
            if top in CORE_FORBIDDEN:
                problems.append(f"{module} imports {name}")
    return problems


def test_core_imports_no_io() -> None:
    assert forbidden_in_core(ROOT) == []


def test_no_import_cycles() -> None:
    assert cycles(project_graph(ROOT)) == []


@pytest.mark.parametrize(
    "line",
    [
        "import grpc",
        "import asyncio",
        "from redis import asyncio as aioredis",
        "from cms.reader import open_reader",
        "from workers.engine import StepRecord",
        "from router.service import RouterService",
        "from slorouter.v1 import router_pb2_grpc",
    ],
)
def test_core_contract_catches(tmp_path: Path, line: str) -> None:
    core = tmp_path / "router" / "core"
    core.mkdir(parents=True)
    (tmp_path / "router" / "__init__.py").write_text("")
    (core / "__init__.py").write_text("")
    (core / "fine.py").write_text("import numpy\nfrom router.core import bad\nfrom fleet.snapshot import X\n")
    (core / "bad.py").write_text(f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    {line}\n")
    assert forbidden_in_core(tmp_path) == [f"router.core.bad imports {name}" for name in _names(line)]


def _names(line: str) -> list[str]:
    words = line.split()
    if words[0] == "import":
        return [words[1]]
    module, imported = words[1], words[3]
    return sorted({module, f"{module}.{imported}"} - ({module} if module.startswith("slorouter") else set()))


def test_cycle_finder_sees_type_only_and_lazy_imports() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
