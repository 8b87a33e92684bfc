"""``pyproject.toml`` states one Python floor, and the linters check the code against that floor.

``requires-python`` is what pip enforces; mypy's ``python_version`` rejects standard-library names
newer than it (``typing.Self`` under 3.10, ``itertools.batched`` under 3.11); ruff's
``target-version`` rejects newer syntax. If the three disagree, the code can quietly start needing
a newer Python than the one it promises.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_one_python_floor_everywhere() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    floor = re.fullmatch(r">=(\d+)\.(\d+)", config["project"]["requires-python"])
    assert floor is not None, "requires-python should be a plain floor like >=3.11"
    major, minor = int(floor.group(1)), int(floor.group(2))
    assert config["tool"]["mypy"]["python_version"] == f"{major}.{minor}"
    assert config["tool"]["ruff"]["target-version"] == f"py{major}{minor}"
    assert sys.version_info[:2] >= (major, minor)
