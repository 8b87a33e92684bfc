"""``make bench`` writes the speed table of docs/results.md: only between its markers, with the machine and the date."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.figures import BEGIN, END, RESULTS, Figure, Section, machine, render, write_results


def test_the_table_names_the_machine_and_every_figure() -> None:
    sections = [
        Section("scheduler", (Figure("decision", "p50 1 µs"), Figure("adaptive", "p50 2 µs")), 3.0),
        Section("vllm", (Figure("vLLM ratio", "not measured: `.venv-vllm` is missing"),), 0.5),
    ]
    block = render(sections, load_before=0.5, load_after=1.5)
    lines = block.splitlines()
    assert lines[0] == BEGIN and lines[-1] == END
    assert machine() in lines[1] and "UTC" in lines[1] and "load average 0.5 before and 1.5 after" in lines[1]
    assert "| decision | `python -m bench scheduler` | p50 1 µs |" in lines
    assert "| vLLM ratio | `python -m bench vllm` | not measured: `.venv-vllm` is missing |" in lines


def test_writing_replaces_only_the_block(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n{BEGIN}\nold table\n{END}\nafter\n", encoding="utf-8")
    write_results(f"{BEGIN}\nnew table\n{END}", readme)
    assert readme.read_text(encoding="utf-8") == f"# title\n\nbefore\n{BEGIN}\nnew table\n{END}\nafter\n"


def test_a_readme_without_markers_is_left_alone(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("no markers\n", encoding="utf-8")
    with pytest.raises(ValueError, match="bench:begin"):
        write_results(f"{BEGIN}\nx\n{END}", readme)
    assert readme.read_text(encoding="utf-8") == "no markers\n"


def test_the_repository_results_page_holds_a_table_written_by_make_bench() -> None:
    text = RESULTS.read_text(encoding="utf-8")
    block = text[text.index(BEGIN) : text.index(END)]
    assert "Measured " in block and "| figure | command | measured |" in block
    for name in ("cms", "predictor", "router", "scheduler", "simulator", "vllm", "workers"):
        assert f"`python -m bench {name}`" in block
