"""`python -m bench peers`: a missing peer is skipped with a message saying how to install it."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import bench_peers


@pytest.mark.parametrize("kind", ["vllm-router", "smg"])
def test_a_missing_peer_names_the_make_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    monkeypatch.setattr(bench_peers, "PEER_VENV", tmp_path / "no-such-venv")
    why = bench_peers.peer_missing(kind)
    assert why is not None
    assert kind in why and "make peers-venv" in why


def test_this_router_is_never_missing() -> None:
    assert bench_peers.peer_missing("ours") is None


def test_every_router_kind_is_known() -> None:
    assert {r.kind for r in bench_peers.ROUTERS} == {"ours", "vllm-router", "smg"}
    assert len({r.name for r in bench_peers.ROUTERS}) == len(bench_peers.ROUTERS)
