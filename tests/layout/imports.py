"""Read the project's import graph from source (no imports executed).

Every ``import`` statement counts, including those inside functions and
``if TYPE_CHECKING:`` blocks: a cycle through a type-only import is still a
cycle a reader has to untangle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

#: Top-level packages that make up the project (``slorouter`` is the generated protobuf code).
PROJECT_PACKAGES = (
    "router",
    "predictor",
    "fleet",
    "cms",
    "workers",
    "sim",
    "bench",
    "workload",
    "engine",
    "openai_http",
    "slorouter",
)


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def iter_modules(root: Path, packages: Iterable[str]) -> Iterator[tuple[str, Path]]:
    for package in packages:
        base = root / package
        if package == "slorouter":
            base = root / "proto" / "slorouter"
        for path in sorted(base.rglob("*.py")):
            name_root = root / "proto" if package == "slorouter" else root
            yield module_name(name_root, path), path


def imported_names(path: Path, module: str) -> set[str]:
    """Every module name ``path`` imports (absolute; relative imports resolved against ``module``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.add(target)
            # ``from pkg import mod`` imports the submodule ``pkg.mod`` when one exists.
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def project_graph(root: Path, packages: Iterable[str] = PROJECT_PACKAGES) -> dict[str, set[str]]:
    """module -> the project modules it imports."""
    modules = dict(iter_modules(root, packages))
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = {m for m in imported_names(path, name) if m in modules and m != name}
    return graph


def external_imports(root: Path, packages: Iterable[str]) -> dict[str, set[str]]:
    """module -> every name it imports (project and third-party alike)."""
    return {name: imported_names(path, name) for name, path in iter_modules(root, packages)}


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def unit_of(module: str, units: Iterable[str]) -> str | None:
    """The longest of ``units`` that is ``module`` or a dotted prefix of it (``router.core`` before ``router``)."""
    best: str | None = None
    for unit in units:
        if (module == unit or module.startswith(unit + ".")) and (best is None or len(unit) > len(best)):
            best = unit
    return best


def package_edges(graph: Mapping[str, set[str]], units: Iterable[str]) -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) -> the module imports behind that edge, for edges between units."""
    names = tuple(units)
    edges: dict[tuple[str, str], list[str]] = {}
    for module, targets in graph.items():
        source = unit_of(module, names)
        for target in sorted(targets):
            dest = unit_of(target, names)
            if source is None or dest is None or source == dest:
                continue
            edges.setdefault((source, dest), []).append(f"{module} imports {target}")
    return edges
