"""The workloads the docs run: every file in ``docs/scenarios`` loads, and every one a doc names exists.

The docs print the command beside every figure (``--workload docs/scenarios/X.json``, or ``$D/X.json``
with ``D=docs/scenarios``); a reader who copies one should get the workload it was measured on, not a
parse error or a missing file.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from workload.spec import load_workload

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "docs" / "scenarios"
#: A scenario file named in a doc: by its path, or through the docs' ``D=docs/scenarios`` shorthand.
NAMED = re.compile(r"(?:scenarios/|\$D/)([A-Za-z0-9_.-]+\.(?:json|ya?ml))")
#: Names the docs use as templates in a command's description (``aladdin-W.json``: one per row).
TEMPLATES = {"W.json", "aladdin-W.json"}


def _scenario_files() -> list[Path]:
    return sorted(p for p in SCENARIOS.iterdir() if p.suffix in (".json", ".yaml", ".yml"))


def test_the_scenarios_folder_is_not_empty() -> None:
    assert len(_scenario_files()) >= 10


@pytest.mark.parametrize("path", _scenario_files(), ids=lambda p: p.name)
def test_every_scenario_file_loads_as_a_workload(path: Path) -> None:
    spec = load_workload(str(path))
    assert spec.classes, f"{path.name}: no classes"
    # Every class is judged on something: the docs' figures are attainment.
    untargeted = [c.name for c in spec.classes if c.slo.describe() == "none"]
    assert not untargeted, f"{path.name}: classes without an SLO target: {untargeted}"


def test_every_scenario_a_doc_names_exists() -> None:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named: dict[str, str] = {}
    for doc in docs:
        for name in NAMED.findall(doc.read_text(encoding="utf-8")):
            named.setdefault(name, doc.name)
    assert len(named) >= 10  # the pattern still finds the docs' commands
    present = {p.name for p in SCENARIOS.iterdir()}
    missing = {name: doc for name, doc in named.items() if name not in present and name not in TEMPLATES}
    assert not missing, f"scenario files named in the docs but absent from docs/scenarios: {missing}"
