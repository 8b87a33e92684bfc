"""``scripts/readme_papers.py`` and the seed-paper tables (docs/seed-papers.md): the same rows, commands that parse."""

from __future__ import annotations

import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("readme_papers", REPO / "scripts" / "readme_papers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["readme_papers"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_every_row_of_the_script_is_in_the_tables_page_under_its_command() -> None:
    readme = (REPO / "docs" / "seed-papers.md").read_text(encoding="utf-8")
    for paper in _script().PAPERS:
        for command in paper.commands:
            assert f"`{command}`" in readme, command
        for row in paper.rows:
            assert f"| {row.scenario} |" in readme, row.scenario
            assert f"\n{row.args}\n" in readme, row.args


def test_every_scenario_file_a_row_names_exists() -> None:
    for paper in _script().PAPERS:
        for row in paper.rows:
            for word in shlex.split(row.args):
                if word.endswith(".json"):
                    assert (REPO / word).is_file(), word


def test_the_script_names_an_unknown_table() -> None:
    done = subprocess.run(
        [sys.executable, "scripts/readme_papers.py", "--papers", "sa,nope"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--papers sa,nope" in done.stderr


@pytest.mark.parametrize("paper", ["sa", "qlm"])
def test_the_queue_rows_parse_as_sim_papers_arguments(paper: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Each row of the two queue-policy tables is accepted by ``python -m sim.papers`` (checked
    with an output directory that does not exist, so the harness stops before any run)."""
    from sim import papers as harness

    (table,) = [p for p in _script().PAPERS if p.name == paper]
    for row in table.rows:
        argv = [*table.commands[0].split()[3:], *row.args.split(), "--output", "/nonexistent/t.json"]
        with pytest.raises(SystemExit) as exit_info:
            harness.main(argv)
        assert exit_info.value.code == 2
        assert (
            "--output /nonexistent/t.json: no such directory" in capsys.readouterr().err
        )  # not a bad argument
