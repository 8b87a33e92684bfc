"""Package layering: every import goes to a lower layer, so no two packages depend on each other.

The layer order (lowest first) is the table in ``docs/layers.md``; this test parses it from there,
so the document and the rule cannot drift apart. Every import counts, including imports inside
functions and under ``if TYPE_CHECKING:`` (see :mod:`tests.layout.imports`).
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from pathlib import Path

import pytest

from tests.layout.imports import PROJECT_PACKAGES, cycles, module_name, package_edges, project_graph

ROOT = Path(__file__).resolve().parents[2]
LAYERS_DOC = ROOT / "docs" / "layers.md"

_BEGIN = "<!-- layers: begin"
_END = "<!-- layers: end -->"
_ROW = re.compile(r"^\|\s*(\d+)\s*\|([^|]*)\|")


def read_layers(text: str) -> dict[str, int]:
    """package (``router.core`` is one of its own) -> its layer, from the table between the markers."""
    start = text.index(_BEGIN)
    table = text[start : text.index(_END, start)]
    layers: dict[str, int] = {}
    for line in table.splitlines():
        row = _ROW.match(line)
        if row is None:
            continue
        for name in re.findall(r"`([A-Za-z_][\w.]*)`", row.group(2)):
            assert name not in layers, f"docs/layers.md names {name} twice"
            layers[name] = int(row.group(1))
    return layers


def layering_problems(graph: Mapping[str, set[str]], layers: Mapping[str, int]) -> list[str]:
    """Every import between packages that does not go to a strictly lower layer, and every package cycle."""
    edges = package_edges(graph, layers)
    problems = [
        f"{source} (layer {layers[source]}) may not import {dest} (layer {layers[dest]}): {', '.join(why)}"
        for (source, dest), why in sorted(edges.items())
        if layers[dest] >= layers[source]
    ]
    package_graph: dict[str, set[str]] = {name: set() for name in layers}
    for source, dest in edges:
        package_graph[source].add(dest)
    problems.extend(f"package cycle: {' <-> '.join(cycle)}" for cycle in cycles(package_graph))
    return problems


def top_level_packages(root: Path) -> set[str]:
    """Every directory at the repository's top that is a Python package, and the generated ``slorouter``."""
    found = {path.parent.name for path in root.glob("*/__init__.py")} - {"tests"}
    if (root / "proto" / "slorouter" / "__init__.py").exists():
        found.add("slorouter")
    return found


def test_layers_doc_names_every_package_once() -> None:
    layers = read_layers(LAYERS_DOC.read_text(encoding="utf-8"))
    assert set(PROJECT_PACKAGES) == top_level_packages(ROOT), "tests/layout/imports.PROJECT_PACKAGES is stale"
    assert set(layers) == {*PROJECT_PACKAGES, "router.core"}


def test_every_package_is_installed_and_type_checked() -> None:
    """A package missing from pyproject's list is left out of the wheel; from the Makefile, out of mypy."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    listed = set(config["tool"]["setuptools"]["packages"])
    on_disk = {
        module_name(ROOT, path.parent)
        for package in top_level_packages(ROOT) - {"slorouter"}
        for path in (ROOT / package).rglob("__init__.py")
    }
    assert on_disk <= listed
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    line = re.search(r"^PACKAGES\s*:=(.*)$", makefile, re.MULTILINE)
    assert line is not None
    assert set(line.group(1).split()) == top_level_packages(ROOT) - {"slorouter"}


def test_every_import_goes_down_a_layer() -> None:
    layers = read_layers(LAYERS_DOC.read_text(encoding="utf-8"))
    graph = project_graph(ROOT)
    assert layering_problems(graph, layers) == []
    # Also with router.core counted as part of router: the router's shell imports nothing that
    # imports the core back (workers and sim reach the core only).
    whole: dict[str, set[str]] = {name: set() for name in PROJECT_PACKAGES}
    for source, dest in package_edges(graph, PROJECT_PACKAGES):
        whole[source].add(dest)
    assert cycles(whole) == []


LAYERS = {"low": 0, "mid": 1, "mid.core": 1, "top": 2}


def _tree(tmp_path: Path, files: Mapping[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import top.cli\n", "mid (layer 1) may not import top (layer 2): mid.shell imports top.cli"),
        ("def later():\n    from top import cli\n", "mid (layer 1) may not import top (layer 2)"),
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mid.core import x\n",
            "mid (layer 1) may not import mid.core (layer 1)",
        ),
    ],
)
def test_layering_check_catches_upward_sideways_and_lazy_imports(
    tmp_path: Path, source: str, expected: str
) -> None:
    root = _tree(
        tmp_path,
        {
            "low/__init__.py": "",
            "mid/__init__.py": "",
            "mid/core/__init__.py": "",
            "mid/core/x.py": "import low\n",
            "mid/shell.py": source,
            "top/__init__.py": "",
            "top/cli.py": "import mid.shell\nimport low\n",
        },
    )
    problems = layering_problems(project_graph(root, ("low", "mid", "top")), LAYERS)
    assert any(problem.startswith(expected) for problem in problems), problems


def test_layering_check_reports_a_package_cycle(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "low/__init__.py": "def f():\n    import top\n",
            "top/__init__.py": "import low\n",
        },
    )
    problems = layering_problems(project_graph(root, ("low", "top")), {"low": 0, "top": 2})
    assert problems[-1] == "package cycle: low <-> top"
    assert layering_problems(project_graph(root, ("top",)), {"low": 0, "top": 2}) == []


def test_layers_table_is_parsed_from_its_markers() -> None:
    text = "x\n<!-- layers: begin -->\n| layer | p |\n|---|---|\n| 0 | `a` |\n| 1 | `b`, `b.c` |\n<!-- layers: end -->\n| 9 | `z` |\n"
    assert read_layers(text) == {"a": 0, "b": 1, "b.c": 1}
